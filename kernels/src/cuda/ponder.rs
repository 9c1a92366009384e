//! PonderNet's halting and aggregation as CubeCL kernels (SPEC §2.3). One plane of 32 units per
//! `(token, batch row)` computes the K halting logits (dot products with the halt weight,
//! reduced across the plane), the geometric halting distribution and E[K], and the weighted sum
//! of the K frames (≈ 50 ops composed): the inference op with the decoding fusions off. Every
//! inference pass's rows otherwise, and training's (both outputs packed in one tensor), get a
//! cube each, one unit per channel holding its K frames in registers; the aggregate comes out in the out
//! projection's GEMM input type (no cast before it), optionally with the sublayer's residual
//! update prepared. The backward is [`crate::cuda::ponder_backward`].

use crate::cuda::common::{
    FEW_ROWS, PLANE, gemm_input, launch_guarded, out_like, out_typed, ponder_geometry, sigmoid_burn,
};
use crate::options::decode_fusion;
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn ponder_agg_kernel(
    frames: &Tensor<f32>,
    w: &Tensor<f32>,
    bias: &Tensor<f32>,
    agg: &mut Tensor<f32>,
    ek: &mut Tensor<f32>,
    batch: u32,
    dim: u32,
    halt_clamp: f32,
    norm_eps: f32,
    #[comptime] k: usize,
    #[comptime] packed: bool,
    #[comptime] planes: usize,
) {
    let batch = batch as usize;
    let dim = dim as usize;
    let row = CUBE_POS;
    let t = row / batch;
    let b = row % batch;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut part = Array::<f32>::new(k);
    #[unroll]
    for j in 0..k {
        part[j] = 0.0f32;
    }
    let mut d = lane;
    while d < dim {
        let wd = w[d];
        #[unroll]
        for j in 0..k {
            part[j] += frames[((t * k + j) * batch + b) * dim + d] * wd;
        }
        d += width;
    }
    // The K logits' dot products: summed across the plane, then across the cube's planes.
    if comptime![planes > 1] {
        let mut shared = SharedMemory::<f32>::new(comptime![planes * k]);
        let plane = lane / 32;
        #[unroll]
        for j in 0..k {
            let s = plane_sum(part[j]);
            if UNIT_POS_PLANE == 0 {
                shared[plane * k + j] = s;
            }
        }
        sync_cube();
        #[unroll]
        for j in 0..k {
            let mut total = 0.0f32;
            #[unroll]
            for p in 0..planes {
                total += shared[p * k + j];
            }
            part[j] = total;
        }
    } else {
        #[unroll]
        for j in 0..k {
            part[j] = plane_sum(part[j]);
        }
    }
    let bb = bias[0];
    let mut lam = Array::<f32>::new(k);
    // λ_j = p_j · Π_{i<j}(1 − p_i), the product as exp of the running Σ log(1 − p_i).
    let mut log_survive = 0.0f32;
    let mut total = 0.0f32;
    #[unroll]
    for j in 0..k {
        let logit = part[j] + bb;
        let p = clamp(sigmoid_burn(logit), halt_clamp, 1.0f32 - halt_clamp);
        let l = p * log_survive.exp();
        lam[j] = l;
        total += l;
        log_survive += (-p).log1p();
    }
    let norm = total + norm_eps;
    let mut e = 0.0f32;
    let mut step = 0.0f32;
    #[unroll]
    for j in 0..k {
        step += 1.0f32;
        lam[j] = lam[j] / norm;
        e += lam[j] * step;
    }
    // Packed: aggregate and E[K] in one `[T, B, D + 1]` tensor (`agg` is that tensor).
    let stride = select(packed, dim + 1, dim);
    if lane == 0 {
        if comptime![packed] {
            agg[row * stride + dim] = e;
        } else {
            ek[row] = e;
        }
    }
    let mut d = lane;
    while d < dim {
        let mut acc = 0.0f32;
        #[unroll]
        for j in 0..k {
            acc += frames[((t * k + j) * batch + b) * dim + d] * lam[j];
        }
        agg[row * stride + d] = acc;
        d += width;
    }
}

/// [`ponder_agg_kernel`] one cube per `(token, batch row)` (a decoding step's few rows, and
/// training's: every frame read once, where the plane kernel reads it twice) with one unit per
/// channel (`per` channels a unit where `D` exceeds 1,024): each unit loads its
/// channels' K frames once and keeps them in registers, the K halting logits are reduced across
/// the cube, and one plane computes the halting distribution with a plane-wide prefix sum of
/// `log(1 − p)` (not a K-step loop in every unit). The aggregate is written in `O` (the type the
/// out projection's GEMM reads), E[K] in f32; `packed`, both in one `[T, B, D + 1]` f32
/// tensor (`agg` and `ek` are that tensor). Needs `K ≤ 32`.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn ponder_rows_kernel<O: Float>(
    frames: &Tensor<f32>,
    w: &Tensor<f32>,
    bias: &Tensor<f32>,
    h: &Tensor<f32>,
    w_mean: &Tensor<f32>,
    agg: &mut Tensor<O>,
    c: &mut Tensor<f32>,
    ek: &mut Tensor<f32>,
    batch: u32,
    dim: u32,
    halt_clamp: f32,
    norm_eps: f32,
    #[comptime] k: usize,
    #[comptime] planes: usize,
    #[comptime] per: usize,
    #[comptime] residual: bool,
    #[comptime] packed: bool,
    #[define(O)] _out: StorageType,
) {
    let batch = batch as usize;
    let dim = dim as usize;
    let row = CUBE_POS;
    let t = row / batch;
    let b = row % batch;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut x = Array::<f32>::new(comptime![per * k]);
    let mut part = Array::<f32>::new(k);
    #[unroll]
    for j in 0..k {
        part[j] = 0.0f32;
    }
    #[unroll]
    for q in 0..per {
        let d = lane + q * width;
        if d < dim {
            let wd = w[d];
            #[unroll]
            for j in 0..k {
                let v = frames[((t * k + j) * batch + b) * dim + d];
                x[q * k + j] = v;
                part[j] += v * wd;
            }
        } else {
            #[unroll]
            for j in 0..k {
                x[q * k + j] = 0.0f32;
            }
        }
    }
    let mut sums = SharedMemory::<f32>::new(comptime![planes * k]);
    let mut lam = SharedMemory::<f32>::new(k);
    let plane = lane / 32;
    if comptime![k.is_power_of_two()] {
        let s = plane_sums_transposed(&mut part, k);
        if UNIT_POS_PLANE < comptime![k as u32] {
            sums[plane * k + transposed_frame(UNIT_POS_PLANE, k) as usize] = s;
        }
    } else {
        #[unroll]
        for j in 0..k {
            let s = plane_sum(part[j]);
            if UNIT_POS_PLANE == 0 {
                sums[plane * k + j] = s;
            }
        }
    }
    sync_cube();
    if plane == 0 {
        // Lane j holds frame j: logit, halting probability, and the survival product as the
        // exp of the exclusive prefix sum of log(1 − p).
        let j = lane;
        let live = j < k;
        let mut logit = bias[0];
        if live {
            #[unroll]
            for p in 0..planes {
                logit += sums[p * k + j];
            }
        }
        let p = clamp(sigmoid_burn(logit), halt_clamp, 1.0f32 - halt_clamp);
        let log_keep = select(live, (-p).log1p(), 0.0f32);
        let survive = plane_exclusive_sum(log_keep).exp();
        let l = select(live, p * survive, 0.0f32);
        let norm = plane_sum(l) + norm_eps;
        let ln = l / norm;
        let e = plane_sum(ln * f32::cast_from(j + 1));
        if live {
            lam[j] = ln;
        }
        if lane == 0 {
            if comptime![packed] {
                agg[row * (dim + 1) + dim] = O::cast_from(e);
            } else {
                ek[row] = e;
            }
        }
    }
    sync_cube();
    // Packed (training): the aggregate and E[K] in one `[T, B, D + 1]` tensor of f32.
    let stride = select(packed, dim + 1, dim);
    let mut mean_part = 0.0f32;
    #[unroll]
    for q in 0..per {
        let d = lane + q * width;
        if d < dim {
            let mut acc = 0.0f32;
            #[unroll]
            for j in 0..k {
                acc += x[q * k + j] * lam[j];
            }
            let a = O::cast_from(acc);
            agg[row * stride + d] = a;
            if comptime![residual] {
                mean_part += f32::cast_from(a) * w_mean[d];
            }
        }
    }
    if comptime![residual] {
        // c = h − agg·w̄: the GEMM that adds c to agg·Wᵀ leaves h + (r − mean r).
        let mut means = SharedMemory::<f32>::new(planes);
        let s = plane_sum(mean_part);
        if UNIT_POS_PLANE == 0 {
            means[plane] = s;
        }
        sync_cube();
        let mut m = 0.0f32;
        #[unroll]
        for p in 0..planes {
            m += means[p];
        }
        #[unroll]
        for q in 0..per {
            let d = lane + q * width;
            if d < dim {
                c[row * dim + d] = h[row * dim + d] - m;
            }
        }
    }
}

/// One level of [`plane_sums_transposed`]: at lane offset `offset`, each lane keeps the half of
/// its `2·half` values its bit selects and adds the partner's copy of it, sending the other half.
#[cube]
fn transpose_level(part: &mut Array<f32>, #[comptime] half: usize, #[comptime] offset: u32) {
    let bit = (UNIT_POS_PLANE & offset) != 0;
    #[unroll]
    for i in 0..half {
        let lo = part[i];
        let hi = part[i + half];
        let keep = select(bit, hi, lo);
        let send = select(bit, lo, hi);
        part[i] = keep + plane_shuffle_xor(send, offset);
    }
}

/// The plane sums of `part`'s `k` values (`k` a power of two ≤ 32) in `k − 1` shuffles plus one
/// per remaining offset instead of five per value: at offsets 1, 2, 4, … each lane keeps half
/// of its values and trades the other half, so after `log2 k` levels a lane holds one frame's
/// sum over its group of `k` lanes ([`transposed_frame`] says which), then the remaining offsets
/// sum it across the plane. Every partial sum pairs the same lanes at the same offsets as
/// `plane_sum` (`acc += shuffle_xor(acc, offset)`, offsets 1 to 16), so the sums are the same
/// bit for bit. Returns this lane's frame's sum.
#[cube]
pub(crate) fn plane_sums_transposed(part: &mut Array<f32>, #[comptime] k: usize) -> f32 {
    transpose_level(part, comptime![k >> 1], 1u32);
    transpose_level(part, comptime![k >> 2], 2u32);
    transpose_level(part, comptime![k >> 3], 4u32);
    transpose_level(part, comptime![k >> 4], 8u32);
    transpose_level(part, comptime![k >> 5], 16u32);
    let mut s = part[0];
    if comptime![k <= 1] {
        s += plane_shuffle_xor(s, 1u32);
    }
    if comptime![k <= 2] {
        s += plane_shuffle_xor(s, 2u32);
    }
    if comptime![k <= 4] {
        s += plane_shuffle_xor(s, 4u32);
    }
    if comptime![k <= 8] {
        s += plane_shuffle_xor(s, 8u32);
    }
    if comptime![k <= 16] {
        s += plane_shuffle_xor(s, 16u32);
    }
    s
}

/// The frame whose sum lane `lane` holds after [`plane_sums_transposed`]: bit `l` of the lane
/// chose the upper half at level `l + 1`, worth `k >> (l + 1)` frames.
#[cube]
pub(crate) fn transposed_frame(lane: u32, #[comptime] k: usize) -> u32 {
    let kk = comptime![k as u32];
    (lane & 1) * (kk >> 1)
        + ((lane >> 1) & 1) * (kk >> 2)
        + ((lane >> 2) & 1) * (kk >> 3)
        + ((lane >> 3) & 1) * (kk >> 4)
        + ((lane >> 4) & 1) * (kk >> 5)
}

/// `frames` `[T·K, B, D]`, halt weight `w` `[1, D]` (read flat), bias `[1]` → aggregate `[T, B, D]` and E[K]
/// `[T, B]` (SPEC §2.3: σ, clamp to `[c, 1 − c]`, λ normalised by `Σλ + eps`).
/// `inputs`: `[frames, w, bias]`, as [`ponder_agg_packed`] and the backward take them.
pub fn ponder_agg<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 3],
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [frames, w, bias] = inputs;
    let [agg, ek] = ponder_agg_with(frames, w, bias, k, halt_clamp, norm_eps, false);
    (agg, ek)
}

/// [`ponder_agg`] for training: the aggregate and E[K] packed in one `[T, B, D + 1]` tensor
/// (one differentiable output).
pub fn ponder_agg_packed<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 3],
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> CubeTensor<R> {
    let [frames, w, bias] = inputs;
    let [packed, _] = ponder_agg_with(frames, w, bias, k, halt_clamp, norm_eps, true);
    packed
}

/// `[aggregate, E[K]]`, or with `packed` `[both in one [T, B, D + 1] tensor, the same tensor]`.
#[allow(clippy::too_many_arguments)]
fn ponder_agg_with<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
    packed: bool,
) -> [CubeTensor<R>; 2] {
    let (t, batch, dim) = ponder_geometry(&[&frames, &w, &bias], k);
    let [frames, w, bias] = [frames, w, bias].map(into_contiguous);
    if !packed && rows_kernel_fits(k) {
        // Inference: one unit per channel, the aggregate in the GEMM's input type.
        let [agg, _, ek] = ponder_rows(
            frames,
            w,
            bias,
            Rows::Decoding(None),
            (t, batch, dim),
            k,
            halt_clamp,
            norm_eps,
        );
        return [agg, ek];
    }
    if packed && k <= PLANE as usize {
        // Training: the same kernel, every frame read once (into registers), both outputs
        // packed in f32.
        let [p, _, _] = ponder_rows(
            frames,
            w,
            bias,
            Rows::Packed,
            (t, batch, dim),
            k,
            halt_clamp,
            norm_eps,
        );
        return [p.clone(), p];
    }
    let (agg, ek) = if packed {
        let p = out_like(&frames, Shape::new([t, batch, dim + 1]));
        (p.clone(), p)
    } else {
        (
            out_like(&frames, Shape::new([t, batch, dim])),
            out_like(&frames, Shape::new([t, batch])),
        )
    };
    let client = frames.client.clone();
    // One plane per row when the rows fill the GPU (training); a cube of eight planes per row
    // when they are few and K exceeds a plane.
    let planes = if t * batch < FEW_ROWS { 8 } else { 1 };
    // SAFETY: one cube per token row of `frames` `[T·K, B, D]`, lanes below `D`; `w` `[D]`
    // and `bias` asserted by `ponder_geometry`; `agg` and `ek` allocated here (`ek`
    // unwritten when packed).
    launch_guarded!(ponder_agg_kernel::<R>(
        &client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE * planes as u32),
        frames.into_tensor_arg(),
        w.into_tensor_arg(),
        bias.into_tensor_arg(),
        agg.clone().into_tensor_arg(),
        ek.clone().into_tensor_arg(),
        batch as u32,
        dim as u32,
        halt_clamp,
        norm_eps,
        k,
        packed,
        planes,
    ));
    [agg, ek]
}

/// Whether [`ponder_rows_kernel`] takes an inference pass's rows at this `k`: K within a plane,
/// the decoding fusions on, whatever the row count. A decoding step and a prompt's long pass
/// so share one arithmetic (the halting distribution as a plane's prefix sum, where
/// [`ponder_agg_kernel`] walks it): until s47 passes of 1,024 token rows or more took the plane
/// kernel, and a prompt's logits depended on how its passes were cut (issue 60). Training's
/// packed forward runs the same kernel at 32k rows, so it serves long passes too.
fn rows_kernel_fits(k: usize) -> bool {
    k <= PLANE as usize && decode_fusion()
}

/// What [`ponder_rows_kernel`] writes. Moved once into [`ponder_rows`], so the variants'
/// sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Rows<R: CubeRuntime> {
    /// A decoding step: the aggregate in the GEMM's input type and E[K] apart, with the
    /// residual update prepared from `(h, w̄)` where given.
    Decoding(Option<(CubeTensor<R>, CubeTensor<R>)>),
    /// Training's packed `[T, B, D + 1]` f32 tensor (no residual).
    Packed,
}

/// [`ponder_rows_kernel`]: `[aggregate, c (a placeholder without residual), E[K]]`; packed,
/// `[the packed tensor, placeholder, the packed tensor]`. `(t, batch, dim)` as
/// [`ponder_geometry`] found them.
#[allow(clippy::too_many_arguments)]
fn ponder_rows<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    rows: Rows<R>,
    (t, batch, dim): (usize, usize, usize),
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> [CubeTensor<R>; 3] {
    let (planes, per) = row_cube(dim);
    let packed = matches!(rows, Rows::Packed);
    let residual = match rows {
        Rows::Decoding(r) => r,
        Rows::Packed => None,
    };
    let (agg, ek) = if packed {
        let p = out_like(&frames, Shape::new([t, batch, dim + 1]));
        (p.clone(), p)
    } else {
        (
            out_typed(&frames, Shape::new([t, batch, dim]), gemm_input()),
            out_like(&frames, Shape::new([t, batch])),
        )
    };
    let with_residual = residual.is_some();
    let (h, w_mean, c) = match residual {
        Some((h, w_mean)) => (h, w_mean, out_like(&frames, Shape::new([t, batch, dim]))),
        // Unread (and unwritten) without the residual.
        None => (w.clone(), w.clone(), out_like(&frames, Shape::new([1]))),
    };
    // SAFETY: one cube per token row of `frames` `[T·K, B, D]`, lanes below `D`; `w`,
    // `bias` (and `h` `[T, B, D]`, `w_mean` `[D]` with the residual) asserted by the callers; the outputs
    // allocated here (`c` unwritten without the residual).
    launch_guarded!(ponder_rows_kernel::<R>(
        &frames.client.clone(),
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE * planes as u32),
        frames.into_tensor_arg(),
        w.into_tensor_arg(),
        bias.into_tensor_arg(),
        h.into_tensor_arg(),
        w_mean.into_tensor_arg(),
        agg.clone().into_tensor_arg(),
        c.clone().into_tensor_arg(),
        ek.clone().into_tensor_arg(),
        batch as u32,
        dim as u32,
        halt_clamp,
        norm_eps,
        k,
        planes,
        per,
        with_residual,
        packed,
        agg.dtype.into(),
    ));
    [agg, c, ek]
}

/// The cube of the one-row kernels for `dim` channels: `(planes, channels per unit)`, one unit
/// per channel up to 32 planes.
pub(crate) fn row_cube(dim: usize) -> (usize, usize) {
    let planes = dim.div_ceil(PLANE as usize).clamp(1, 32);
    (planes, dim.div_ceil(planes * PLANE as usize))
}

/// PonderAgg with a sublayer's residual update prepared
/// ([`crate::InferOps::ponder_residual_fused`]):
/// inputs `[frames [T·K, B, D], halt w [1, D], halt b [1], h [T, B, D], w̄ [1, D]]` →
/// `Some((aggregate in the GEMM's input type, c = h − round(aggregate)·w̄ᵀ, E[K]))`, or `None`
/// where the rows are not a decoding step's few (or K exceeds a plane, or the decoding fusions
/// are off).
pub fn ponder_residual<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> Option<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
    let [frames, w, bias, h, w_mean] = inputs;
    let (t, batch, dim) = ponder_geometry(&[&frames, &w, &bias, &h, &w_mean], k);
    assert_eq!(
        h.meta.shape().dims::<3>(),
        [t, batch, dim],
        "ponder_residual: h is [T, B, D]"
    );
    assert_eq!(
        w_mean.meta.shape().num_elements(),
        dim,
        "ponder_residual: w̄ has D values"
    );
    if !rows_kernel_fits(k) {
        return None;
    }
    let [frames, w, bias, h, w_mean] = [frames, w, bias, h, w_mean].map(into_contiguous);
    let [agg, c, ek] = ponder_rows(
        frames,
        w,
        bias,
        Rows::Decoding(Some((h, w_mean))),
        (t, batch, dim),
        k,
        halt_clamp,
        norm_eps,
    );
    Some((agg, c, ek))
}
