//! The backward of PonderAgg's training op ([`crate::cuda::ponder::ponder_agg_packed`]) as a
//! CubeCL kernel: per `(token, batch row)` it recomputes the halting distribution and takes the
//! packed gradient through the normalisation, the survival products and the clamp. For `K ≤ 32`
//! a cube per row holds every frame in registers (one read); otherwise one plane per row reads
//! the frames twice.

use crate::cuda::common::ponder_geometry;
use crate::cuda::common::{PLANE, launch_guarded, out_like, sigmoid_burn};
use crate::cuda::ponder::{plane_sums_transposed, row_cube, transposed_frame};
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The backward of [`ponder_agg_kernel`], one plane per `(token, batch row)`: recomputes the
/// halting distribution, then `∂λ̂_k = ∂agg·x_k + k·∂E[K]`, through the normalisation, the
/// survival products and the clamp to `∂logit_k`; writes `∂x_k = λ̂_k·∂agg + ∂logit_k·w` and
/// the row's contributions to the halt weight's and bias's gradients (summed by the caller).
/// `grad` is `[T, B, D + 1]`: `∂agg` then `∂E[K]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
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

/// [`ponder_backward_kernel`] with one cube per `(token, batch row)`, one unit per channel
/// (`per` channels a unit where `D` exceeds 1,024) holding its K frames in registers, so each
/// frame is read once: the K logits' and `∂agg·x_k` dot products are reduced across the cube,
/// then plane 0 takes lane `j` as frame `j` (`K ≤ 32`): the survival products through a
/// plane-wide exclusive prefix sum of `log(1 − p)` (as the forward's
/// [`ponder_rows_kernel`](crate::cuda::ponder)), and the suffix sums `Σ_{i>j} ∂λ_i·λ_i` through
/// an exclusive prefix sum over the lanes in reverse order (never `total − prefix`, which would
/// cancel). Same formulas as the plane kernel; sums in another order.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn ponder_backward_rows_kernel(
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
    #[comptime] planes: usize,
    #[comptime] per: usize,
) {
    let batch = batch as usize;
    let dim = dim as usize;
    let row = CUBE_POS;
    let t = row / batch;
    let b = row % batch;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let gs = dim + 1;
    let mut x = Array::<f32>::new(comptime![per * k]);
    let mut wds = Array::<f32>::new(per);
    let mut gas = Array::<f32>::new(per);
    let mut part = Array::<f32>::new(k);
    let mut gpart = Array::<f32>::new(k);
    #[unroll]
    for j in 0..k {
        part[j] = 0.0f32;
        gpart[j] = 0.0f32;
    }
    #[unroll]
    for q in 0..per {
        let d = lane + q * width;
        wds[q] = 0.0f32;
        gas[q] = 0.0f32;
        if d < dim {
            let wd = w[d];
            let ga = grad[row * gs + d];
            wds[q] = wd;
            gas[q] = ga;
            #[unroll]
            for j in 0..k {
                let v = frames[((t * k + j) * batch + b) * dim + d];
                x[q * k + j] = v;
                part[j] += v * wd;
                gpart[j] += v * ga;
            }
        } else {
            #[unroll]
            for j in 0..k {
                x[q * k + j] = 0.0f32;
            }
        }
    }
    // Plane sums to shared memory: the logits' at `[plane·k + j]`, `∂agg·x_j`'s after them.
    let mut sums = SharedMemory::<f32>::new(comptime![2 * planes * k]);
    // The per-frame coefficients of the last pass: `λ̂_j` at `[j]`, `∂logit_j` at `[k + j]`.
    let mut coef = SharedMemory::<f32>::new(comptime![2 * k]);
    let plane = lane / 32;
    if comptime![k.is_power_of_two()] {
        let s = plane_sums_transposed(&mut part, k);
        let g = plane_sums_transposed(&mut gpart, k);
        if UNIT_POS_PLANE < comptime![k as u32] {
            let j = transposed_frame(UNIT_POS_PLANE, k) as usize;
            sums[plane * k + j] = s;
            sums[(planes + plane) * k + j] = g;
        }
    } else {
        #[unroll]
        for j in 0..k {
            let s = plane_sum(part[j]);
            let g = plane_sum(gpart[j]);
            if UNIT_POS_PLANE == 0 {
                sums[plane * k + j] = s;
                sums[(planes + plane) * k + j] = g;
            }
        }
    }
    sync_cube();
    if plane == 0 {
        let j = lane;
        let live = j < k;
        let mut logit = bias[0];
        let mut gx = 0.0f32;
        if live {
            #[unroll]
            for p in 0..planes {
                logit += sums[p * k + j];
                gx += sums[(planes + p) * k + j];
            }
        }
        let s = sigmoid_burn(logit);
        let p = clamp(s, halt_clamp, 1.0f32 - halt_clamp);
        let log_keep = select(live, (-p).log1p(), 0.0f32);
        let surv = plane_exclusive_sum(log_keep).exp();
        let lam = select(live, p * surv, 0.0f32);
        let norm = plane_sum(lam) + norm_eps;
        let h = lam / norm;
        // ∂λ̂_j = ∂agg·x_j + j·∂E[K] (frames counted from 1), and Σ ∂λ̂·λ̂.
        let g = gx + f32::cast_from(j + 1) * grad[row * gs + dim];
        let dot = plane_sum(select(live, g * h, 0.0f32));
        let dlam = (g - dot) / norm;
        // Σ_{i>j} ∂λ_i·λ_i: lane j holds frame k − 1 − j's term, an exclusive prefix sum over
        // that order, read back by the mirror lane.
        let kk = comptime![k as u32];
        let lane32 = UNIT_POS_PLANE;
        let mirror = select(lane32 < kk, kk - 1 - lane32, lane32);
        let rev = plane_shuffle(select(live, dlam * lam, 0.0f32), mirror);
        let suffix = plane_shuffle(plane_exclusive_sum(rev), mirror);
        let dp = dlam * surv - suffix / (1.0f32 - p);
        let inside = s >= halt_clamp && s <= 1.0f32 - halt_clamp;
        let dl = select(live && inside, dp, 0.0f32) * (s * (1.0f32 - s));
        let d_bias = plane_sum(dl);
        if live {
            coef[j] = h;
            coef[k + j] = dl;
        }
        if lane == 0 {
            d_b_rows[row] = d_bias;
        }
    }
    sync_cube();
    #[unroll]
    for q in 0..per {
        let d = lane + q * width;
        if d < dim {
            let mut acc_w = 0.0f32;
            #[unroll]
            for j in 0..k {
                let dl = coef[k + j];
                acc_w += dl * x[q * k + j];
                d_frames[((t * k + j) * batch + b) * dim + d] = coef[j] * gas[q] + dl * wds[q];
            }
            d_w_rows[row * dim + d] = acc_w;
        }
    }
}

/// Its backward from the packed gradient `[T, B, D + 1]`: `[∂frames [T·K, B, D], per-row ∂w
/// [T·B, D], per-row ∂b [T·B]]` (the caller sums the last two over rows).
pub fn ponder_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 3],
    grad: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> [CubeTensor<R>; 3] {
    let [frames, w, bias] = inputs;
    let (t, batch, dim) = ponder_geometry(&[&frames, &w, &bias, &grad], k);
    let [frames, w, bias, grad] = [frames, w, bias, grad].map(into_contiguous);
    assert_eq!(
        grad.meta.shape().num_elements(),
        t * batch * (dim + 1),
        "ponder_backward: the gradient is the packed [T, B, D + 1]"
    );
    let d_frames = out_like(&frames, frames.meta.shape().clone());
    let d_w_rows = out_like(&frames, Shape::new([t * batch, dim]));
    let d_b_rows = out_like(&frames, Shape::new([t * batch]));
    let client = frames.client.clone();
    if k <= PLANE as usize {
        let (planes, per) = row_cube(dim);
        // SAFETY: one cube per token row, lanes below `D`; `frames` `[T·K, B, D]`, `w` `[D]`,
        // `bias` (only its first value read) and `grad` `[T, B, D + 1]` asserted above, the
        // outputs allocated here.
        launch_guarded!(ponder_backward_rows_kernel::<R>(
            &client,
            CubeCount::Static((t * batch) as u32, 1, 1),
            CubeDim::new_1d(PLANE * planes as u32),
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
            planes,
            per,
        ));
        return [d_frames, d_w_rows, d_b_rows];
    }
    // SAFETY: as the rows kernel above.
    launch_guarded!(ponder_backward_kernel::<R>(
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
    ));
    [d_frames, d_w_rows, d_b_rows]
}
