//! The selective scan with its SNNBlock modulation (SPEC §2.3, Eq. 5–7) composed from tensor ops
//! and the backend's per-element scan: the modulation the model composes, and the forward and
//! backward the fused kernels are checked against.

use crate::ops::scan::ScanOps;
use crate::ops::types::{PlifOutput, ScanKind, SelectiveGrads, SelectiveInputs};
use crate::tensor::{prim, softplus, through_sigmoid, wrap};
use burn::tensor::{Tensor, activation::sigmoid, backend::Backend, ops::FloatTensor};

/// The three pre-activations `r_β + b_β`, `r_α + b_α`, `r_th + b_th`.
fn preactivations<B: Backend>(inp: &SelectiveInputs<B>) -> [Tensor<B, 3>; 3] {
    let add = |r: &FloatTensor<B>, b: &FloatTensor<B>| {
        wrap::<B, 3>(r.clone()) + wrap::<B, 1>(b.clone()).unsqueeze::<3>()
    };
    [
        add(&inp.r_beta, &inp.b_beta),
        add(&inp.r_alpha, &inp.b_alpha),
        add(&inp.r_th, &inp.b_th),
    ]
}

/// `β, α, V_th, u` of the fused selective scan from its inputs, with the tensor ops the model
/// composes them from (burn's `sigmoid`, [`softplus`], `abs`): the reference the fused kernels
/// repeat op for op.
pub fn selective_modulation<B: Backend>(inp: &SelectiveInputs<B>) -> [Tensor<B, 3>; 4] {
    let [x_beta, x_alpha, x_th] = preactivations(inp);
    let alpha = softplus(x_alpha);
    let u = alpha.clone() * wrap::<B, 3>(inp.i.clone());
    [sigmoid(x_beta), alpha, x_th.abs() + inp.v_th_min as f64, u]
}

/// The fused selective scan composed from tensor ops and [`ScanOps::plif_elem_forward`].
pub fn selective_forward_reference<B: ScanOps>(inp: SelectiveInputs<B>) -> PlifOutput<B> {
    let [beta, _, vth, u] = selective_modulation(&inp);
    B::plif_forward(ScanKind::Elem, prim(beta), prim(u), prim(vth), inp.v0)
}

/// Its backward composed from tensor ops and [`ScanOps::plif_elem_backward`]: `∂r_β = ∂β·β(1−β)`,
/// `∂r_α = ∂u·i·σ(r_α + b_α)` (softplus′ = σ), `∂i = ∂u·α`, `∂r_th = ∂V_th·sign(r_th + b_th)`;
/// each bias gradient sums its projection's over `TK` and `B`.
pub fn selective_backward_reference<B: ScanOps>(
    inp: SelectiveInputs<B>,
    vpost: FloatTensor<B>,
    spike: FloatTensor<B>,
    grad_vpost: FloatTensor<B>,
) -> SelectiveGrads<B> {
    let [x_beta, x_alpha, x_th] = preactivations(&inp);
    let beta = sigmoid(x_beta);
    let alpha = softplus(x_alpha.clone());
    let g = B::plif_backward(
        ScanKind::Elem,
        prim(beta.clone()),
        inp.v0,
        vpost,
        spike,
        grad_vpost,
    );
    let dn = beta.dims()[2];
    let g_u = wrap::<B, 3>(g.u);
    let r_beta = through_sigmoid(wrap::<B, 3>(g.beta), beta);
    let r_alpha = g_u.clone() * wrap::<B, 3>(inp.i) * sigmoid(x_alpha);
    let i = g_u * alpha;
    let r_th = wrap::<B, 3>(g.vth) * x_th.sign();
    let sum = |t: &Tensor<B, 3>| prim(t.clone().sum_dim(0).sum_dim(1).reshape([dn]));
    SelectiveGrads {
        b_beta: sum(&r_beta),
        b_alpha: sum(&r_alpha),
        b_th: sum(&r_th),
        i: prim(i),
        r_beta: prim(r_beta),
        r_alpha: prim(r_alpha),
        r_th: prim(r_th),
        v0: g.v0,
    }
}
