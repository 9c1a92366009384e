//! The SNNBlock's gated output `y = r·σ(g) + s` (SPEC §2.3: the out projection `r` gated by
//! `σ(W_gate·a)` plus the skip path `s = W_skip·a`) composed from tensor ops, forward and
//! backward, op for op as burn's autodiff differentiates the composition: what `SnnOps`'
//! defaults run, and what the fused kernels are checked against.

use crate::tensor::{prim, wrap};
use burn::tensor::{activation::sigmoid, backend::Backend, ops::FloatTensor};

/// `r·σ(g) + s` on `[rows, D]` tensors.
pub fn gated_out_forward_reference<B: Backend>(
    r: FloatTensor<B>,
    g: FloatTensor<B>,
    s: FloatTensor<B>,
) -> FloatTensor<B> {
    let (r, g, s) = (wrap::<B, 2>(r), wrap::<B, 2>(g), wrap::<B, 2>(s));
    prim(r * sigmoid(g) + s)
}

/// `[∂r, ∂g, ∂s]` of `Σ y·dy`: `∂r = dy·σ(g)`, `∂g = (σ·(1 − σ))·(dy·r)` (burn's sigmoid
/// backward: `(−σ + 1)`, then the products in this grouping), `∂s = dy`.
pub fn gated_out_backward_reference<B: Backend>(
    r: FloatTensor<B>,
    g: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> [FloatTensor<B>; 3] {
    let (r, g, dy) = (wrap::<B, 2>(r), wrap::<B, 2>(g), wrap::<B, 2>(dy));
    let sig = sigmoid(g);
    let dr = dy.clone() * sig.clone();
    let slope = sig.clone() * (sig.neg() + 1.0);
    let dg = slope * (dy.clone() * r);
    [prim(dr), prim(dg), prim(dy)]
}
