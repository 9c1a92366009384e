//! Small tensor-level helpers shared by the ops, the composed references, autodiff, the CUDA
//! backend and the benchmark: the conversions between burn's `Tensor` and its float primitive,
//! the last frame of a sequence, PyTorch's softplus, and the chain rule through `β = σ(x)`.

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};

pub(crate) fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub(crate) fn wrap<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// The last frame `[B, C]` of a `[TK, B, C]` sequence, detached (the state a scan carries on).
pub fn last_frame<B: Backend>(x: &Tensor<B, 3>) -> Tensor<B, 2> {
    let [tk, b, c] = x.dims();
    x.clone().narrow(0, tk - 1, 1).reshape([b, c]).detach()
}

/// PyTorch's softplus (β = 1) in the overflow-free form `max(x, 0) + log1p(e^{−|x|})`; its
/// gradient is `σ(x)` like the reference's.
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone().clamp_min(0.0) + x.abs().neg().exp().log1p()
}

/// A gradient with respect to `β = σ(x)` taken back to `x`: `∂x = ∂β·β(1 − β)`.
pub(crate) fn through_sigmoid<B: Backend, const D: usize>(
    d_beta: Tensor<B, D>,
    beta: Tensor<B, D>,
) -> Tensor<B, D> {
    d_beta * (beta.clone() * (beta.neg() + 1.0))
}
