//! Fused CubeCL kernels for inference (forward only, no backward), each replacing tens of
//! tensor ops whose ≈ 11 µs of host time apiece set the speed of a decoding step:
//!
//! * [`ponder_agg`]: PonderNet halting and aggregation. One plane of 32 units per
//!   `(token, batch row)` computes the K halting logits (dot products with the halt weight,
//!   reduced across the plane), the geometric halting distribution and E[K], and the weighted
//!   sum of the K frames (≈ 50 ops composed). A decoding step's few rows get a cube each, one
//!   unit per channel holding its K frames in registers, and the aggregate comes out in the
//!   out projection's GEMM input type (no cast before it).
//! * [`norm_plif`]: RMSNorm, then the input PLIF over the K frames of each token.
//! * the SNNFFN's gate and up neurons and their product: [`crate::cuda_scan::ffn_infer`], the
//!   training kernel without its saved `V_post`.
//!
//! The model falls back to the compositions where a backend does not fuse
//! ([`SnnOps::ponder_agg_fused`] and its siblings return `None`).
//!
//! [`SnnOps::ponder_agg_fused`]: crate::SnnOps::ponder_agg_fused

use crate::cuda_scan::{out_like, out_typed, sigmoid_burn, softplus};
use burn::tensor::DType;
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube: one plane.
const PLANE: u32 = 32;

/// Below this many rows a row-per-cube kernel gives each row a cube of several planes.
const FEW_ROWS: usize = 1024;

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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

/// [`ponder_agg_kernel`] for a few rows (a decoding step), one cube per `(token, batch row)`
/// with one unit per channel (`per` channels a unit where `D` exceeds 1,024): each unit loads its
/// channels' K frames once and keeps them in registers, the K halting logits are reduced across
/// the cube, and one plane computes the halting distribution with a plane-wide prefix sum of
/// `log(1 − p)` (not a K-step loop in every unit). The aggregate is written in `O` (the type the
/// out projection's GEMM reads), E[K] in f32. Needs `K ≤ 32`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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
    #[unroll]
    for j in 0..k {
        let s = plane_sum(part[j]);
        if UNIT_POS_PLANE == 0 {
            sums[plane * k + j] = s;
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
            ek[row] = e;
        }
    }
    sync_cube();
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
            agg[row * dim + d] = a;
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

/// The backward of [`ponder_agg_kernel`], one plane per `(token, batch row)`: recomputes the
/// halting distribution, then `∂λ̂_k = ∂agg·x_k + k·∂E[K]`, through the normalisation, the
/// survival products and the clamp to `∂logit_k`; writes `∂x_k = λ̂_k·∂agg + ∂logit_k·w` and
/// the row's contributions to the halt weight's and bias's gradients (summed by the caller).
/// `grad` is `[T, B, D + 1]`: `∂agg` then `∂E[K]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ponder_backward_kernel(
    frames: &Tensor<f32>,
    w: &Tensor<f32>,
    bias: &Tensor<f32>,
    grad: &Tensor<f32>,
    d_frames: &mut Tensor<f32>,
    d_w_rows: &mut Tensor<f32>,
    d_b_rows: &mut Tensor<f32>,
    batch: u32,
    dim: u32,
    halt_clamp: f32,
    norm_eps: f32,
    #[comptime] k: usize,
) {
    let batch = batch as usize;
    let dim = dim as usize;
    let row = CUBE_POS;
    let t = row / batch;
    let b = row % batch;
    let lane = UNIT_POS as usize;
    let gs = dim + 1;
    let mut part = Array::<f32>::new(k);
    let mut gpart = Array::<f32>::new(k);
    #[unroll]
    for j in 0..k {
        part[j] = 0.0f32;
        gpart[j] = 0.0f32;
    }
    let mut d = lane;
    while d < dim {
        let wd = w[d];
        let ga = grad[row * gs + d];
        #[unroll]
        for j in 0..k {
            let x = frames[((t * k + j) * batch + b) * dim + d];
            part[j] += x * wd;
            gpart[j] += x * ga;
        }
        d += 32usize;
    }
    let g_ek = grad[row * gs + dim];
    let bb = bias[0];
    let mut sig = Array::<f32>::new(k);
    let mut pp = Array::<f32>::new(k);
    let mut surv = Array::<f32>::new(k);
    let mut lam = Array::<f32>::new(k);
    let mut log_survive = 0.0f32;
    let mut total = 0.0f32;
    #[unroll]
    for j in 0..k {
        let s = sigmoid_burn(plane_sum(part[j]) + bb);
        let p = clamp(s, halt_clamp, 1.0f32 - halt_clamp);
        let sv = log_survive.exp();
        sig[j] = s;
        pp[j] = p;
        surv[j] = sv;
        lam[j] = p * sv;
        total += p * sv;
        log_survive += (-p).log1p();
    }
    let norm = total + norm_eps;
    // ∂λ̂_k, and Σ_k ∂λ̂_k·λ̂_k for the normalisation.
    let mut dl = Array::<f32>::new(k);
    let mut lh = Array::<f32>::new(k);
    let mut dot = 0.0f32;
    let mut step = 0.0f32;
    #[unroll]
    for j in 0..k {
        step += 1.0f32;
        let h = lam[j] / norm;
        let g = plane_sum(gpart[j]) + step * g_ek;
        lh[j] = h;
        dl[j] = g;
        dot += g * h;
    }
    // ∂λ_k = (∂λ̂_k − Σ ∂λ̂·λ̂)/norm; λ_k = p_k·S_k with log S_k = Σ_{i<k} log(1 − p_i): the
    // survival terms reach p_i through the suffix sum of ∂λ_k·λ_k over k > i.
    let mut dlogit = Array::<f32>::new(k);
    let mut suffix = 0.0f32;
    let mut d_bias = 0.0f32;
    #[unroll]
    for q in 0..k {
        let j = k - 1 - q;
        let dlam = (dl[j] - dot) / norm;
        let dp = dlam * surv[j] - suffix / (1.0f32 - pp[j]);
        suffix += dlam * lam[j];
        let s = sig[j];
        let inside = s >= halt_clamp && s <= 1.0f32 - halt_clamp;
        let g = select(inside, dp, 0.0f32) * (s * (1.0f32 - s));
        dlogit[j] = g;
        d_bias += g;
    }
    let mut d = lane;
    while d < dim {
        let wd = w[d];
        let ga = grad[row * gs + d];
        let mut acc_w = 0.0f32;
        #[unroll]
        for j in 0..k {
            let i = ((t * k + j) * batch + b) * dim + d;
            acc_w += dlogit[j] * frames[i];
            d_frames[i] = lh[j] * ga + dlogit[j] * wd;
        }
        d_w_rows[row * dim + d] = acc_w;
        d += 32usize;
    }
    if lane == 0 {
        d_b_rows[row] = d_bias;
    }
}

/// `frames` `[T·K, B, D]`, halt weight `w` `[1, D]` (read flat), bias `[1]` → aggregate `[T, B, D]` and E[K]
/// `[T, B]` (SPEC §2.3: σ, clamp to `[c, 1 − c]`, λ normalised by `Σλ + eps`).
pub fn ponder_agg<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [agg, ek] = ponder_agg_with(frames, w, bias, k, halt_clamp, norm_eps, false);
    (agg, ek)
}

/// [`ponder_agg`] for training: the aggregate and E[K] packed in one `[T, B, D + 1]` tensor
/// (one differentiable output).
pub fn ponder_agg_packed<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> CubeTensor<R> {
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
    if !packed && rows_kernel_fits(t * batch, k) {
        // A decoding step: one unit per channel, the aggregate in the GEMM's input type.
        let [agg, _, ek] = ponder_rows(
            frames, w, bias, None, t, batch, dim, k, halt_clamp, norm_eps,
        );
        return [agg, ek];
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
    ponder_agg_kernel::launch::<R>(
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
    );
    [agg, ek]
}

/// Whether [`ponder_rows_kernel`] takes `rows` token rows at this `k`: a decoding step's few
/// rows, K within a plane, the decoding fusions on.
fn rows_kernel_fits(rows: usize, k: usize) -> bool {
    rows < FEW_ROWS && k <= PLANE as usize && crate::decode_fusion()
}

/// [`ponder_rows_kernel`]: `[aggregate, c (a placeholder without residual), E[K]]`.
#[allow(clippy::too_many_arguments)]
fn ponder_rows<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    residual: Option<(CubeTensor<R>, CubeTensor<R>)>,
    t: usize,
    batch: usize,
    dim: usize,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> [CubeTensor<R>; 3] {
    let planes = dim.div_ceil(PLANE as usize).clamp(1, 32);
    let per = dim.div_ceil(planes * PLANE as usize);
    let agg = out_typed(&frames, Shape::new([t, batch, dim]), gemm_input());
    let ek = out_like(&frames, Shape::new([t, batch]));
    let with_residual = residual.is_some();
    let (h, w_mean, c) = match residual {
        Some((h, w_mean)) => (h, w_mean, out_like(&frames, Shape::new([t, batch, dim]))),
        // Unread (and unwritten) without the residual.
        None => (w.clone(), w.clone(), out_like(&frames, Shape::new([1]))),
    };
    ponder_rows_kernel::launch::<R>(
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
        agg.dtype.into(),
    );
    [agg, c, ek]
}

/// PonderAgg with a sublayer's residual update prepared ([`crate::SnnOps::ponder_residual_fused`]):
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
    if !rows_kernel_fits(t * batch, k) {
        return None;
    }
    let [frames, w, bias, h, w_mean] = [frames, w, bias, h, w_mean].map(into_contiguous);
    let [agg, c, ek] = ponder_rows(
        frames,
        w,
        bias,
        Some((h, w_mean)),
        t,
        batch,
        dim,
        k,
        halt_clamp,
        norm_eps,
    );
    Some((agg, c, ek))
}

/// Its backward from the packed gradient `[T, B, D + 1]`: `[∂frames [T·K, B, D], per-row ∂w
/// [T·B, D], per-row ∂b [T·B]]` (the caller sums the last two over rows).
#[allow(clippy::too_many_arguments)]
pub fn ponder_backward<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    grad: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> [CubeTensor<R>; 3] {
    let (t, batch, dim) = ponder_geometry(&[&frames, &w, &bias, &grad], k);
    let [frames, w, bias, grad] = [frames, w, bias, grad].map(into_contiguous);
    let d_frames = out_like(&frames, frames.meta.shape().clone());
    let d_w_rows = out_like(&frames, Shape::new([t * batch, dim]));
    let d_b_rows = out_like(&frames, Shape::new([t * batch]));
    let client = frames.client.clone();
    ponder_backward_kernel::launch::<R>(
        &client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        frames.into_tensor_arg(),
        w.into_tensor_arg(),
        bias.into_tensor_arg(),
        grad.into_tensor_arg(),
        d_frames.clone().into_tensor_arg(),
        d_w_rows.clone().into_tensor_arg(),
        d_b_rows.clone().into_tensor_arg(),
        batch as u32,
        dim as u32,
        halt_clamp,
        norm_eps,
        k,
    );
    [d_frames, d_w_rows, d_b_rows]
}

/// `(T, B, D)` of `frames` `[T·K, B, D]`, with every tensor checked f32.
fn ponder_geometry<R: CubeRuntime>(tensors: &[&CubeTensor<R>], k: usize) -> (usize, usize, usize) {
    for x in tensors {
        assert_eq!(x.dtype, burn::tensor::DType::F32, "ponder_agg takes f32");
    }
    let shape = tensors[0].meta.shape();
    assert_eq!(shape.num_dims(), 3, "ponder_agg: frames [T·K, B, D]");
    let (tk, batch, dim) = (shape[0], shape[1], shape[2]);
    assert!(
        k > 0 && tk % k == 0,
        "ponder_agg: {tk} frames are not whole tokens of K = {k}"
    );
    assert!(
        tk * batch * (dim + 1) <= u32::MAX as usize,
        "ponder_agg: 32-bit indexing"
    );
    (tk / k, batch, dim)
}

/// `1/√(mean_D(x²) + eps)` of every `(token, batch row)`: one plane per row.
#[cube(launch)]
fn rms_inv_kernel(x: &Tensor<f32>, r: &mut Tensor<f32>, dim: u32, eps: f32) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let mut ss = 0.0f32;
    let mut d = lane;
    while d < dim {
        let v = x[row * dim + d];
        ss += v * v;
        d += 32usize;
    }
    let total = plane_sum(ss);
    if lane == 0 {
        r[row] = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
    }
}

/// RMSNorm then the row-parameter input PLIF over K frames of each token: one unit per
/// `(batch row, channel)` walks the tokens and their frames in order. `u = (1 − β)·x̂` is the
/// same in a token's K frames (SPEC §3); the output is `(1 − β)·V_post` (`leak`) or `V_post`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn norm_plif_kernel<O: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    y: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    eps: f32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] save_vpost: bool,
    #[comptime] fused_rms: bool,
    #[comptime] mean_frames: bool,
    #[define(O)] _out: StorageType,
) {
    let cols = cols as usize;
    let dim = dim as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = c / dim;
    let d = c % dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    let mut v = v0[c];
    for t in 0..tokens as usize {
        // 1/RMS of the token's row: read from `r`, or (`r` is then a stand-in, its read
        // unused) summed here by the plane exactly as
        // `rms_inv_kernel` sums it (lane l takes channels l, l + 32, …; then the plane sum).
        // With `fused_rms` every plane holds 32 channels of one batch row (D a multiple of
        // 32), so no unit left before the plane's sums.
        let mut rr = r[t * (cols / dim) + b];
        if comptime![fused_rms] {
            let base = t * cols + b * dim;
            let mut ss = 0.0f32;
            let mut dd = d % 32;
            // Four loads in flight per round, summed in the same order as one at a time.
            while dd + 96 < dim {
                let x0 = x[base + dd];
                let x1 = x[base + dd + 32];
                let x2 = x[base + dd + 64];
                let x3 = x[base + dd + 96];
                ss += x0 * x0;
                ss += x1 * x1;
                ss += x2 * x2;
                ss += x3 * x3;
                dd += 128usize;
            }
            while dd < dim {
                let xv = x[base + dd];
                ss += xv * xv;
                dd += 32usize;
            }
            let total = plane_sum(ss);
            rr = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
        }
        let u = x[t * cols + c] * rr * nw * one_minus;
        let mut sum = 0.0f32;
        #[unroll]
        for j in 0..k {
            let v_pre = fma(beta, v, u);
            let s = select(v_pre >= th, 1.0f32, 0.0f32);
            v = v_pre - th * s;
            let out = select(leak, v * one_minus, v);
            if comptime![mean_frames] {
                sum += out;
            } else {
                y[(t * k + j) * cols + c] = O::cast_from(out);
            }
            if comptime![save_vpost] {
                vpost[(t * k + j) * cols + c] = v;
            }
        }
        if comptime![mean_frames] {
            y[t * cols + c] = O::cast_from(sum / f32::cast_from(k));
        }
    }
    last[c] = v;
}

/// The backward of [`norm_plif_kernel`]'s neuron, one unit per `(batch row, channel)` walking
/// the tokens in reverse, each token's K frames loaded together: `∂V_post` from the output
/// (times `1 − β` with leak), the reverse recurrence with the spikes recomputed exactly as the
/// forward made them, `∂x̂ = (1 − β)·Σ_k ∂u` per token (the norm's backward follows in
/// [`rms_norm_backward_kernel`]), and per column the sums `∂β` (the scan's term less both
/// `(1 − β)` factors'), `∂V_th` and the carried `∂v0`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn norm_plif_backward_kernel(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    grad: &Tensor<f32>,
    d_xhat: &mut Tensor<f32>,
    d_beta: &mut Tensor<f32>,
    d_th: &mut Tensor<f32>,
    d_v0: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
) {
    let cols = cols as usize;
    let dim = dim as usize;
    let tokens = tokens as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = c / dim;
    let d = c % dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    let first = v0[c];
    let mut gy = Array::<f32>::new(k);
    let mut vp = Array::<f32>::new(k);
    let mut acc = 0.0f32;
    let mut s_beta = 0.0f32;
    let mut s_th = 0.0f32;
    let mut s_om = 0.0f32;
    for tq in 0..tokens {
        let t = tokens - 1 - tq;
        let xh = x[t * cols + c] * r[t * (cols / dim) + b] * nw;
        let u = xh * one_minus;
        #[unroll]
        for j in 0..k {
            let f = (t * k + j) * cols + c;
            gy[j] = grad[f];
            vp[j] = vpost[f];
        }
        let before = select(
            t > 0,
            vpost[select(t > 0, (t * k - 1) * cols + c, c)],
            first,
        );
        let mut du = 0.0f32;
        #[unroll]
        for q in 0..k {
            let j = k - 1 - q;
            // `j` is known when the kernel is expanded: no index below 0 is ever formed.
            let mut v_prev = before;
            if j > 0 {
                v_prev = vp[j - 1];
            }
            let mut g_out = gy[j];
            if comptime![leak] {
                s_om += gy[j] * vp[j];
                g_out = gy[j] * one_minus;
            }
            let gv = g_out + acc;
            let s = select(fma(beta, v_prev, u) >= th, 1.0f32, 0.0f32);
            s_beta += gv * v_prev;
            s_th += -gv * s;
            du += gv;
            acc = gv * beta;
        }
        d_xhat[t * cols + c] = du * one_minus;
        s_om += du * xh;
    }
    d_beta[c] = s_beta - s_om;
    d_th[c] = s_th;
    d_v0[c] = acc;
}

/// RMSNorm's backward, one plane per token row: with `g = ∂x̂·w`, `∂x = r·g − x·r³·mean(g·x)`;
/// writes the row's `∂w` terms `∂x̂·x·r` (summed over rows by the caller).
#[cube(launch)]
fn rms_norm_backward_kernel(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    d_xhat: &Tensor<f32>,
    d_x: &mut Tensor<f32>,
    d_w_rows: &mut Tensor<f32>,
    dim: u32,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let rr = r[row];
    let mut part = 0.0f32;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        part += d_xhat[i] * norm_w[d] * x[i];
        d += 32usize;
    }
    let m = plane_sum(part) / (dim as f32);
    let r3 = rr * rr * rr;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        let xi = x[i];
        let gi = d_xhat[i] * norm_w[d];
        d_x[i] = rr * gi - xi * r3 * m;
        d_w_rows[i] = d_xhat[i] * xi * rr;
        d += 32usize;
    }
}

/// `x` `[T, B, D]` → RMSNorm (`norm_w`, `eps`) → input PLIF (`w` = the β logits, `v_th`, state
/// `v0` `[B, D]`) over K frames per token: output `[T·K, B, D]` and the final state `[B, D]`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif<R: CubeRuntime>(
    x: CubeTensor<R>,
    norm_w: CubeTensor<R>,
    eps: f32,
    w: CubeTensor<R>,
    v_th: CubeTensor<R>,
    v0: CubeTensor<R>,
    k: usize,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [y, last, _] = norm_plif_with([x, norm_w, w, v_th, v0], eps, k, leak, false, false);
    (y, last)
}

/// [`norm_plif`] with each token's K outputs averaged in the kernel: `(mean [T, B, D] in the
/// GEMM's input type, final state [B, D])`, the edge's output neuron before `decode_proj`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_mean<R: CubeRuntime>(
    x: CubeTensor<R>,
    norm_w: CubeTensor<R>,
    eps: f32,
    w: CubeTensor<R>,
    v_th: CubeTensor<R>,
    v0: CubeTensor<R>,
    k: usize,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [y, last, _] = norm_plif_with([x, norm_w, w, v_th, v0], eps, k, leak, false, true);
    (y, last)
}

/// The type the GEMM after an inference kernel reads (bf16 in bf16 precision, else f32): the
/// kernel writes it, so the GEMM needs no cast of its input (the same round to nearest even).
fn gemm_input() -> DType {
    crate::cuda_gemm::input_dtype()
}

/// The same for training: `(output, V_post [T·K, B, D])`, `V_post` saved for the backward.
pub fn norm_plif_train<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [y, _, vpost] = norm_plif_with(inputs, eps, k, leak, true, false);
    (y, vpost)
}

/// `(T, B, D)` of `x` `[T, B, D]`, every tensor checked f32.
fn norm_plif_geometry<R: CubeRuntime>(
    tensors: &[&CubeTensor<R>],
    k: usize,
) -> (usize, usize, usize) {
    for t in tensors {
        assert_eq!(t.dtype, burn::tensor::DType::F32, "norm_plif takes f32");
    }
    let shape = tensors[0].meta.shape();
    assert_eq!(shape.num_dims(), 3, "norm_plif: x [T, B, D]");
    let (t, batch, dim) = (shape[0], shape[1], shape[2]);
    assert!(
        k > 0 && t * k * batch * dim <= u32::MAX as usize,
        "norm_plif: 32-bit indexing"
    );
    (t, batch, dim)
}

/// `1/√(mean_D(x²) + eps)` per token row `[T, B]` of a contiguous `x`.
fn rms_inv<R: CubeRuntime>(
    x: &CubeTensor<R>,
    t: usize,
    batch: usize,
    dim: usize,
    eps: f32,
) -> CubeTensor<R> {
    let r = out_like(x, Shape::new([t, batch]));
    rms_inv_kernel::launch::<R>(
        &x.client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        x.clone().into_tensor_arg(),
        r.clone().into_tensor_arg(),
        dim as u32,
        eps,
    );
    r
}

/// Units per cube of the input neuron's kernels: a few thousand columns (3,584 at the 0.9B
/// shape) spread over the SMs one plane each.
const NORM_PLIF_CUBE: u32 = 32;

/// `[output, final state, V_post (empty unless save_vpost)]`; inputs `x, norm_w, w, v_th, v0`.
fn norm_plif_with<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    save_vpost: bool,
    mean_frames: bool,
) -> [CubeTensor<R>; 3] {
    let (t, batch, dim) = norm_plif_geometry(&inputs.each_ref(), k);
    let [x, norm_w, w, v_th, v0] = inputs.map(into_contiguous);
    // A decoding step (few token rows) sums each row's RMS inside the scan kernel where a
    // plane holds one row's channels: one launch instead of two. With many token rows (a
    // training micro-batch, even untracked) every plane would walk all its tokens' rows alone,
    // so the separate kernel, one plane per row, stays.
    let fused_rms =
        !save_vpost && t * batch < FEW_ROWS && dim.is_multiple_of(NORM_PLIF_CUBE as usize);
    let r = if fused_rms {
        x.clone()
    } else {
        rms_inv(&x, t, batch, dim, eps)
    };
    // Inference writes the output in the type the projections' GEMM reads; training keeps f32
    // (autodiff's GEMM node rounds its saved operand itself).
    let y_dtype = if save_vpost { DType::F32 } else { gemm_input() };
    let frames = if mean_frames { t } else { t * k };
    let y = out_typed(&x, Shape::new([frames, batch, dim]), y_dtype);
    let last = out_like(&x, Shape::new([batch, dim]));
    let vpost = out_like(
        &x,
        Shape::new(if save_vpost {
            [t * k, batch, dim]
        } else {
            [1, 1, 1]
        }),
    );
    let cols = batch * dim;
    norm_plif_kernel::launch::<R>(
        &x.client.clone(),
        CubeCount::Static(cols.div_ceil(NORM_PLIF_CUBE as usize) as u32, 1, 1),
        CubeDim::new_1d(NORM_PLIF_CUBE),
        x.into_tensor_arg(),
        r.into_tensor_arg(),
        norm_w.into_tensor_arg(),
        w.into_tensor_arg(),
        v_th.into_tensor_arg(),
        v0.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        cols as u32,
        dim as u32,
        t as u32,
        eps,
        k,
        leak,
        save_vpost,
        fused_rms,
        mean_frames,
        y_dtype.into(),
    );
    [y, last, vpost]
}

/// RMSNorm of each row with a gain, one cube per row: `x` `[rows, D]` f32 →
/// `x / √(mean(x²) + eps) · gain` in `O` (the GEMM's input type).
#[cube(launch)]
fn rms_norm_kernel<O: Float>(
    x: &Tensor<f32>,
    gain: &Tensor<f32>,
    y: &mut Tensor<O>,
    dim: u32,
    eps: f32,
    #[comptime] planes: usize,
    #[define(O)] _out: StorageType,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut ss = 0.0f32;
    let mut d = lane;
    while d < dim {
        let v = x[row * dim + d];
        ss += v * v;
        d += width;
    }
    let mut sums = SharedMemory::<f32>::new(planes);
    let s = plane_sum(ss);
    if UNIT_POS_PLANE == 0 {
        sums[lane / 32] = s;
    }
    sync_cube();
    let mut total = 0.0f32;
    #[unroll]
    for p in 0..planes {
        total += sums[p];
    }
    let r = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
    let mut d = lane;
    while d < dim {
        y[row * dim + d] = O::cast_from(x[row * dim + d] * r * gain[d]);
        d += width;
    }
}

/// `x` `[rows, D]` → RMSNorm with `gain` `[D]` and `eps`, in the GEMM's input type: the edge's
/// LateralInhibition before the head.
pub fn rms_norm<R: CubeRuntime>(x: CubeTensor<R>, gain: CubeTensor<R>, eps: f32) -> CubeTensor<R> {
    for t in [&x, &gain] {
        assert_eq!(t.dtype, DType::F32, "rms_norm takes f32");
    }
    let shape = x.meta.shape().clone();
    assert_eq!(shape.num_dims(), 2, "rms_norm: x [rows, D]");
    let (rows, dim) = (shape[0], shape[1]);
    assert_eq!(
        gain.meta.shape().num_elements(),
        dim,
        "rms_norm: gain has D values"
    );
    let [x, gain] = [x, gain].map(into_contiguous);
    let y = out_typed(&x, Shape::new([rows, dim]), gemm_input());
    let planes = dim.div_ceil(PLANE as usize).clamp(1, 8);
    rms_norm_kernel::launch::<R>(
        &x.client.clone(),
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(PLANE * planes as u32),
        x.into_tensor_arg(),
        gain.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        dim as u32,
        eps,
        planes,
        y.dtype.into(),
    );
    y
}

/// Backward of [`norm_plif_train`] from the saved `V_post` and the output's gradient:
/// `[∂x [T, B, D], per-row ∂norm_w [T·B, D], per-column ∂β, ∂V_th, ∂v0 [B, D]]` (the caller
/// sums the per-row and per-column terms and applies σ′ to ∂β).
pub fn norm_plif_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    vpost: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 5] {
    let (t, batch, dim) = norm_plif_geometry(&inputs.each_ref(), k);
    let [x, norm_w, w, v_th, v0] = inputs.map(into_contiguous);
    let [vpost, grad] = [vpost, grad].map(into_contiguous);
    let r = rms_inv(&x, t, batch, dim, eps);
    let cols = batch * dim;
    let d_xhat = out_like(&x, Shape::new([t, batch, dim]));
    let d_beta = out_like(&x, Shape::new([batch, dim]));
    let d_th = out_like(&x, Shape::new([batch, dim]));
    let d_v0 = out_like(&x, Shape::new([batch, dim]));
    let client = x.client.clone();
    norm_plif_backward_kernel::launch::<R>(
        &client,
        CubeCount::Static(cols.div_ceil(NORM_PLIF_CUBE as usize) as u32, 1, 1),
        CubeDim::new_1d(NORM_PLIF_CUBE),
        x.clone().into_tensor_arg(),
        r.clone().into_tensor_arg(),
        norm_w.clone().into_tensor_arg(),
        w.into_tensor_arg(),
        v_th.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        grad.into_tensor_arg(),
        d_xhat.clone().into_tensor_arg(),
        d_beta.clone().into_tensor_arg(),
        d_th.clone().into_tensor_arg(),
        d_v0.clone().into_tensor_arg(),
        cols as u32,
        dim as u32,
        t as u32,
        k,
        leak,
    );
    let d_x = out_like(&x, Shape::new([t, batch, dim]));
    let d_w_rows = out_like(&x, Shape::new([t * batch, dim]));
    rms_norm_backward_kernel::launch::<R>(
        &client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        x.into_tensor_arg(),
        r.into_tensor_arg(),
        norm_w.into_tensor_arg(),
        d_xhat.into_tensor_arg(),
        d_x.clone().into_tensor_arg(),
        d_w_rows.clone().into_tensor_arg(),
        dim as u32,
    );
    [d_x, d_w_rows, d_beta, d_th, d_v0]
}

/// The SNNBlock's selective scan for a decoding step, read straight from the merged projection
/// `y` `[TK·B, W]` (row stride `row_stride`; columns `[0, DN)` the input current `i`, then
/// `r_β, r_α, r_th`): the modulation and recurrence of `selective_forward_kernel` op for op,
/// writing `V_post` `[TK·B, DN]` and the final state, no spikes. It replaces the four column
/// slices' copies, the scan and the final state's copy of the composed path.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn block_scan_kernel<O: Float>(
    y: &Tensor<f32>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    dn: u32,
    row_stride: u32,
    v_th_min: f32,
    #[comptime] unroll: usize,
    #[define(O)] _out: StorageType,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let dn = dn as usize;
    let row_stride = row_stride as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let batch = cols / dn;
    let b = c / dn;
    let j = c % dn;
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let mut v = v0[c];
    let mut bb_ = Array::<f32>::new(unroll);
    let mut uu = Array::<f32>::new(unroll);
    let mut tt = Array::<f32>::new(unroll);
    let mut k0 = 0usize;
    while k0 < steps {
        let n = select(k0 + unroll <= steps, unroll, steps - k0);
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let base = ((k0 + q) * batch + b) * row_stride + j;
                bb_[q] = sigmoid_burn(y[base + dn] + bb);
                uu[q] = softplus(y[base + 2 * dn] + ba) * y[base];
                tt[q] = (y[base + 3 * dn] + bt).abs() + v_th_min;
            }
        }
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let v_pre = fma(bb_[q], v, uu[q]);
                let s = select(v_pre >= tt[q], 1.0f32, 0.0f32);
                v = v_pre - tt[q] * s;
                vpost[(k0 + q) * cols + c] = O::cast_from(v);
            }
        }
        k0 += unroll;
    }
    last[c] = v;
}

/// `out·σ(gate) + skip` with `gate`, `skip` the columns `[gate_col, gate_col + D)` and
/// `[skip_col, skip_col + D)` of `y` (row stride `row_stride`): the SNNBlock's output in one
/// launch instead of three.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn gate_skip_kernel(
    out: &Tensor<f32>,
    y: &Tensor<f32>,
    res: &mut Tensor<f32>,
    n: u32,
    dim: u32,
    row_stride: u32,
    gate_col: u32,
    skip_col: u32,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let dim = dim as usize;
    let base = (i / dim) * (row_stride as usize) + i % dim;
    let g = sigmoid_burn(y[base + gate_col as usize]);
    let prod = out[i] * g;
    res[i] = prod + y[base + skip_col as usize];
}

/// `h + (r − mean_D(r))` per row, one cube of `planes` planes per row: the residual update with the centred
/// out-projection in one launch instead of three.
#[cube(launch)]
fn centred_residual_kernel(
    h: &Tensor<f32>,
    r: &Tensor<f32>,
    out: &mut Tensor<f32>,
    dim: u32,
    dim_f: f32,
    #[comptime] planes: usize,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut part = 0.0f32;
    let mut d = lane;
    while d < dim {
        part += r[row * dim + d];
        d += width;
    }
    let mut shared = SharedMemory::<f32>::new(planes);
    let s = plane_sum(part);
    if UNIT_POS_PLANE == 0 {
        shared[lane / 32] = s;
    }
    sync_cube();
    let mut total = 0.0f32;
    #[unroll]
    for p in 0..planes {
        total += shared[p];
    }
    let mean = total / dim_f;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        let centred = r[i] - mean;
        out[i] = h[i] + centred;
        d += width;
    }
}

/// Planes per row of [`centred_residual`] (a decoding step has few rows).
const CENTRED_PLANES: usize = 8;

/// Unrolled steps per load batch of [`block_scan`] (as the selective forward kernel's).
const UNROLL_BLOCK_SCAN: usize = 4;

/// `(stride of a row, columns)` of a 2-D f32 tensor whose columns are contiguous, else `None`.
fn rows_view<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<(usize, usize)> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    (t.dtype == burn::tensor::DType::F32
        && shape.num_dims() == 2
        && (strides[1] == 1 || shape[1] <= 1))
        .then(|| (strides[0].max(shape[1]), shape[1]))
}

/// The SNNBlock's scan on its merged projection `y` `[TK·B, W ≥ 4·DN]` (see
/// [`block_scan_kernel`]): `(V_post [TK·B, DN], final state [B, DN])`. Biases `[DN]`, `v0`
/// `[B, DN]`.
pub fn block_scan<R: CubeRuntime>(
    y: CubeTensor<R>,
    biases: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    v_th_min: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let y = match rows_view(&y) {
        Some(_) => y,
        None => into_contiguous(y),
    };
    let (row_stride, width) = rows_view(&y).expect("block scan: y is f32 [TK·B, W]");
    let rows = y.meta.shape()[0];
    let [bb, ba, bt] = biases.map(into_contiguous);
    let v0 = into_contiguous(v0);
    let (batch, dn) = (v0.meta.shape()[0], v0.meta.shape()[1]);
    assert!(
        width >= 4 * dn && batch > 0 && rows.is_multiple_of(batch),
        "block scan: y [{rows}, {width}] does not hold four [·, {dn}] projections of {batch} rows"
    );
    assert!(
        rows * row_stride <= u32::MAX as usize,
        "block scan: 32-bit indexing"
    );
    for t in [&bb, &ba, &bt, &v0] {
        assert_eq!(t.dtype, burn::tensor::DType::F32, "block scan takes f32");
    }
    let cols = batch * dn;
    let vpost = out_typed(&y, Shape::new([rows, dn]), gemm_input());
    let vpost_dtype = vpost.dtype;
    let last = out_like(&y, Shape::new([batch, dn]));
    block_scan_kernel::launch::<R>(
        &y.client.clone(),
        CubeCount::Static(cols.div_ceil(PLANE as usize) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        y.into_tensor_arg(),
        bb.into_tensor_arg(),
        ba.into_tensor_arg(),
        bt.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        cols as u32,
        (rows / batch) as u32,
        dn as u32,
        row_stride as u32,
        v_th_min,
        UNROLL_BLOCK_SCAN,
        vpost_dtype.into(),
    );
    (vpost, last)
}

/// `out·σ(y[:, gate_col..]) + y[:, skip_col..]` (see [`gate_skip_kernel`]); `out` `[rows, D]`.
pub fn gate_skip<R: CubeRuntime>(
    out: CubeTensor<R>,
    y: CubeTensor<R>,
    gate_col: usize,
    skip_col: usize,
) -> CubeTensor<R> {
    let out = into_contiguous(out);
    let y = match rows_view(&y) {
        Some(_) => y,
        None => into_contiguous(y),
    };
    let (row_stride, width) = rows_view(&y).expect("gate/skip: y is f32 [rows, W]");
    let shape = out.meta.shape().clone();
    assert_eq!(out.dtype, burn::tensor::DType::F32, "gate/skip takes f32");
    assert_eq!(shape.num_dims(), 2, "gate/skip: out [rows, D]");
    let (rows, dim) = (shape[0], shape[1]);
    assert!(
        y.meta.shape()[0] == rows && gate_col.max(skip_col) + dim <= width,
        "gate/skip: columns {gate_col}, {skip_col} (+{dim}) outside y [{}, {width}]",
        y.meta.shape()[0]
    );
    assert!(
        rows * row_stride <= u32::MAX as usize,
        "gate/skip: 32-bit indexing"
    );
    let res = out_like(&out, shape);
    let n = rows * dim;
    gate_skip_kernel::launch::<R>(
        &out.client.clone(),
        CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
        CubeDim::new_1d(256),
        out.into_tensor_arg(),
        y.into_tensor_arg(),
        res.clone().into_tensor_arg(),
        n as u32,
        dim as u32,
        row_stride as u32,
        gate_col as u32,
        skip_col as u32,
    );
    res
}

/// `h + (r − mean_D(r))` for `h`, `r` `[rows, D]` (see [`centred_residual_kernel`]).
pub fn centred_residual<R: CubeRuntime>(h: CubeTensor<R>, r: CubeTensor<R>) -> CubeTensor<R> {
    let [h, r] = [h, r].map(into_contiguous);
    let shape = h.meta.shape().clone();
    assert_eq!(shape.num_dims(), 2, "centred residual: h [rows, D]");
    assert_eq!(
        &shape,
        r.meta.shape(),
        "centred residual: h and r differ in shape"
    );
    for t in [&h, &r] {
        assert_eq!(
            t.dtype,
            burn::tensor::DType::F32,
            "centred residual takes f32"
        );
    }
    let (rows, dim) = (shape[0], shape[1]);
    let out = out_like(&h, shape);
    centred_residual_kernel::launch::<R>(
        &h.client.clone(),
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(PLANE * CENTRED_PLANES as u32),
        h.into_tensor_arg(),
        r.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dim as u32,
        dim as f32,
        CENTRED_PLANES,
    );
    out
}
