//! RMSNorm then the row-parameter input PLIF over the K frames of each token (SPEC §2.3),
//! composed from tensor ops and the backend's row scan: the forward and backward the fused
//! kernels are checked against.

use crate::ops::scan::ScanOps;
use crate::ops::types::{NormPlifInputs, ScanKind};
use crate::tensor::{prim, through_sigmoid, wrap};
use burn::tensor::{Tensor, activation::sigmoid, backend::Backend, ops::FloatTensor};

/// What the input neuron's reference computes from its inputs: `r = 1/√(mean_D(x²) + eps)`
/// `[T, B, 1]` and `x̂ = x·r·w_norm`; `β = σ(w)` and `1 − β` `[D]`; the scan's inputs `β`,
/// `u = (1 − β)·x̂` repeated over the K frames, and `V_th`, as the model composes them.
struct NormPlifParts<B: Backend> {
    r: Tensor<B, 3>,
    xh: Tensor<B, 3>,
    beta: Tensor<B, 1>,
    one_minus: Tensor<B, 1>,
    scan: [FloatTensor<B>; 3],
}

fn norm_plif_parts<B: ScanOps>(inp: &NormPlifInputs<B>) -> NormPlifParts<B> {
    let x = wrap::<B, 3>(inp.x.clone());
    let [t, b, d] = x.dims();
    let r = (x.clone().square().mean_dim(2) + inp.eps).sqrt().recip();
    let xh = x * r.clone() * wrap::<B, 1>(inp.norm_w.clone()).unsqueeze::<3>();
    let beta = sigmoid(wrap::<B, 1>(inp.w.clone()));
    let one_minus = beta.clone().neg() + 1.0;
    let u = (xh.clone() * one_minus.clone().unsqueeze::<3>())
        .unsqueeze_dim::<4>(1)
        .expand([t, inp.k, b, d])
        .reshape([t * inp.k, b, d]);
    let scan = [
        prim(beta.clone().unsqueeze::<2>().expand([b, d])),
        prim(u),
        prim(
            wrap::<B, 1>(inp.v_th.clone())
                .unsqueeze::<2>()
                .expand([b, d]),
        ),
    ];
    NormPlifParts {
        r,
        xh,
        beta,
        one_minus,
        scan,
    }
}

/// One run of the composed forward, with what decides its spikes: the output and `V_post`,
/// the spikes, and the scan's inputs `β`, `u` and `V_th` (`[T·K, B, D]` but `β` and `V_th`
/// `[B, D]`): what a check needs to tell a spike that flipped at a tie with the threshold
/// from a wrong kernel, all from the same run.
pub struct NormPlifRun<B: Backend> {
    pub y: FloatTensor<B>,
    pub vpost: FloatTensor<B>,
    pub spike: FloatTensor<B>,
    pub beta: FloatTensor<B>,
    pub u: FloatTensor<B>,
    pub vth: FloatTensor<B>,
}

/// RMSNorm and the input PLIF composed from tensor ops and [`ScanOps::plif_row_forward`],
/// with its spikes and the scan's inputs ([`NormPlifRun`]).
pub fn norm_plif_reference_run<B: ScanOps>(inp: &NormPlifInputs<B>) -> NormPlifRun<B> {
    let NormPlifParts {
        one_minus,
        scan: [beta, u, vth],
        ..
    } = norm_plif_parts(inp);
    let out = B::plif_forward(
        ScanKind::Row,
        beta.clone(),
        u.clone(),
        vth.clone(),
        inp.v0.clone(),
    );
    let vpost = wrap::<B, 3>(out.vpost);
    let y = if inp.leak {
        vpost.clone() * one_minus.unsqueeze::<3>()
    } else {
        vpost.clone()
    };
    NormPlifRun {
        y: prim(y),
        vpost: prim(vpost),
        spike: out.spike,
        beta,
        u,
        vth,
    }
}

/// RMSNorm and the input PLIF composed from tensor ops and [`ScanOps::plif_row_forward`]:
/// `(output, V_post)`.
pub fn norm_plif_forward_reference<B: ScanOps>(
    inp: &NormPlifInputs<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let r = norm_plif_reference_run(inp);
    (r.y, r.vpost)
}

/// Their backward composed from tensor ops and [`ScanOps::plif_row_backward`] (spikes
/// recomputed): `∂V_post = ∂y·(1 − β)` with leak; the scan's backward; `∂x̂ = (1 − β)·Σ_k ∂u`;
/// `∂β` = the scan's term less `Σ ∂y·V_post` (leak) and `Σ ∂u·x̂`, `∂w = ∂β·β(1 − β)`; the
/// norm's backward `∂x = r·g − x·r³·mean_D(g·x)` with `g = ∂x̂·w_norm`, `∂w_norm = Σ ∂x̂·x·r`.
pub fn norm_plif_backward_reference<B: ScanOps>(
    inp: NormPlifInputs<B>,
    vpost: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 5] {
    let NormPlifParts {
        r,
        xh,
        beta,
        one_minus,
        scan: [beta_e, u, vth_e],
    } = norm_plif_parts(&inp);
    let x = wrap::<B, 3>(inp.x.clone());
    let [t, b, d] = x.dims();
    let k = inp.k;
    let spike = B::plif_forward(ScanKind::Row, beta_e.clone(), u, vth_e, inp.v0.clone()).spike;
    let vpost = wrap::<B, 3>(vpost);
    let g = wrap::<B, 3>(grad);
    let om3 = one_minus.clone().unsqueeze::<3>();
    let cols = |t: Tensor<B, 3>| t.sum_dim(0).reshape([b, d]);
    let (g_v, om_leak) = if inp.leak {
        (g.clone() * om3.clone(), cols(g * vpost.clone()))
    } else {
        (g, Tensor::zeros([b, d], &x.device()))
    };
    let sg = B::plif_backward(
        ScanKind::Row,
        beta_e,
        inp.v0.clone(),
        prim(vpost),
        spike,
        prim(g_v),
    );
    let du = wrap::<B, 3>(sg.u)
        .reshape([t, k, b, d])
        .sum_dim(1)
        .reshape([t, b, d]);
    let dxh = du.clone() * om3;
    let om_in = cols(du * xh);
    let d_beta = (wrap::<B, 2>(sg.beta) - om_leak - om_in)
        .sum_dim(0)
        .reshape([d]);
    let d_w = through_sigmoid(d_beta, beta);
    let d_th = wrap::<B, 2>(sg.vth).sum_dim(0).reshape([d]);
    let nw = wrap::<B, 1>(inp.norm_w.clone()).unsqueeze::<3>();
    let gx = dxh.clone() * nw;
    let m = (gx.clone() * x.clone()).mean_dim(2);
    let r3 = r.clone() * r.clone() * r.clone();
    let dx = gx * r.clone() - x.clone() * r3 * m;
    let d_nw = (dxh * x * r).sum_dim(0).sum_dim(1).reshape([d]);
    [prim(dx), prim(d_nw), prim(d_w), prim(d_th), sg.v0]
}
