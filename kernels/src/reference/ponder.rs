//! PonderNet's halting and aggregation (SPEC §2.3) composed from tensor ops: the halting
//! distribution, and the forward and backward the fused kernels are checked against.

use crate::ops::types::PonderInputs;
use crate::tensor::{prim, wrap};
use burn::tensor::{Tensor, TensorData, activation::sigmoid, backend::Backend, ops::FloatTensor};

/// The halting distribution of [`PonderInputs`] from tensor ops: `σ(logit)`, `p`, the survival
/// `S_k = Π_{j<k}(1 − p_j)`, `λ = p·S` and `Σλ + eps`, all `[T, K, B]` (the last `[T, 1, B]`).
/// The logits are exact f32 dot products (`Σ_D x·w`), as the fused kernels compute them.
fn ponder_halting<B: Backend>(inp: &PonderInputs<B>) -> [Tensor<B, 3>; 5] {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let w = wrap::<B, 2>(inp.halt_w.clone()).reshape([1, 1, d]);
    let bias = wrap::<B, 1>(inp.halt_b.clone()).reshape([1, 1, 1]);
    let logit = ((frames * w).sum_dim(2) + bias).reshape([t, k, b]);
    let sig = sigmoid(logit);
    let p = sig.clone().clamp(inp.clamp, 1.0 - inp.clamp);
    let log_stay = p.clone().neg().log1p();
    let survive = Tensor::cat(
        vec![
            Tensor::zeros([t, 1, b], &log_stay.device()),
            log_stay.slice([0..t, 0..k - 1]).cumsum(1),
        ],
        1,
    )
    .exp();
    let lambda = p.clone() * survive.clone();
    let norm = lambda.clone().sum_dim(1) + inp.eps;
    [sig, p, survive, lambda, norm]
}

/// `1, 2, …, K` shaped `[1, K, 1]`.
fn ponder_steps<B: Backend>(k: usize, device: &B::Device) -> Tensor<B, 3> {
    let steps: Vec<f32> = (1..=k).map(|i| i as f32).collect();
    Tensor::<B, 1>::from_data(TensorData::new(steps, [k]), device).reshape([1, k, 1])
}

/// PonderAgg composed from tensor ops: `Σ_k λ̂_k·x_k` and `E[K] = Σ_k k·λ̂_k`, packed `[T, B, D + 1]`.
pub fn ponder_forward_reference<B: Backend>(inp: &PonderInputs<B>) -> FloatTensor<B> {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let [_, _, _, lambda, norm] = ponder_halting(inp);
    let lh = lambda / norm;
    let agg = (frames.reshape([t, k, b, d]) * lh.clone().unsqueeze_dim::<4>(3))
        .sum_dim(1)
        .reshape([t, b, d]);
    let ek = (lh * ponder_steps::<B>(k, &agg.device()))
        .sum_dim(1)
        .reshape([t, b, 1]);
    prim(Tensor::cat(vec![agg, ek], 2))
}

/// Its backward composed from tensor ops: `∂λ̂_k = ∂agg·x_k + k·∂E[K]`; `∂λ_k = (∂λ̂_k −
/// Σ_j ∂λ̂_j·λ̂_j)/(Σλ + eps)`; `∂p_k = ∂λ_k·S_k − (Σ_{m>k} ∂λ_m·λ_m)/(1 − p_k)`; the clamp
/// passes it where `c ≤ σ ≤ 1 − c`; `∂logit = ∂σ·σ(1 − σ)`; `∂x_k = λ̂_k·∂agg + ∂logit_k·w`,
/// `∂w = Σ ∂logit·x`, `∂b = Σ ∂logit`.
pub fn ponder_backward_reference<B: Backend>(
    inp: PonderInputs<B>,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 3] {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let [sig, p, survive, lambda, norm] = ponder_halting(&inp);
    let lh = lambda.clone() / norm.clone();
    let grad = wrap::<B, 3>(grad);
    let g_agg = grad.clone().slice([0..t, 0..b, 0..d]).unsqueeze_dim::<4>(1); // [T, 1, B, D]
    let g_ek = grad.slice([0..t, 0..b, d..d + 1]).reshape([t, 1, b]);
    let x4 = frames.reshape([t, k, b, d]);
    let dlh = (x4.clone() * g_agg.clone()).sum_dim(3).reshape([t, k, b])
        + ponder_steps::<B>(k, &g_ek.device()) * g_ek;
    let dot = (dlh.clone() * lh.clone()).sum_dim(1);
    let dlam = (dlh - dot) / norm;
    let dlog_s = dlam.clone() * lambda;
    // Σ_{m>k} ∂log S_m: the total less the inclusive running sum.
    let suffix = dlog_s.clone().sum_dim(1) - dlog_s.cumsum(1);
    let dp = dlam * survive + suffix * (p - 1.0).recip();
    let inside = sig
        .clone()
        .greater_equal_elem(inp.clamp)
        .bool_and(sig.clone().lower_equal_elem(1.0 - inp.clamp));
    let dsig = dp.mask_fill(inside.bool_not(), 0.0);
    let dlogit = dsig * sig.clone() * (sig.neg() + 1.0); // [T, K, B]
    let w = wrap::<B, 2>(inp.halt_w.clone()).reshape([1, 1, 1, d]);
    let dl4 = dlogit.clone().unsqueeze_dim::<4>(3);
    let dx = lh.unsqueeze_dim::<4>(3) * g_agg + dl4.clone() * w;
    let dw = (x4 * dl4).sum_dim(0).sum_dim(1).sum_dim(2).reshape([1, d]);
    let db = dlogit.sum().reshape([1]);
    [prim(dx.reshape([tk, b, d])), prim(dw), prim(db)]
}
