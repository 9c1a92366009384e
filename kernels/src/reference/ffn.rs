//! The SNNFFN's gate and up neurons composed from tensor ops and the backend's row scan, op for
//! op as the model composes them: the forward and backward the fused kernels are checked
//! against, and the parameter gradients' last step, which the CUDA backward shares.

use crate::ops::scan::ScanOps;
use crate::ops::types::{FfnGrads, FfnInputs, ScanKind};
use crate::tensor::{prim, through_sigmoid, wrap};
use burn::tensor::{Tensor, activation::sigmoid, backend::Backend, ops::FloatTensor};

/// `β = σ(w)` of both neurons `[2·D_ff]`, `1 − β`, and the thresholds `[2·D_ff]` (gate first),
/// with the tensor ops the model composes them from.
fn ffn_params<B: Backend>(inp: &FfnInputs<B>) -> [Tensor<B, 1>; 3] {
    let beta = Tensor::cat(
        vec![
            sigmoid(wrap::<B, 1>(inp.w_gate.clone())),
            sigmoid(wrap::<B, 1>(inp.w_up.clone())),
        ],
        0,
    );
    let one_minus = beta.clone().neg() + 1.0;
    let vth = Tensor::cat(
        vec![
            wrap::<B, 1>(inp.th_gate.clone()),
            wrap::<B, 1>(inp.th_up.clone()),
        ],
        0,
    );
    [beta, one_minus, vth]
}

/// The input current `u = (1 − β)·i` on the flattened rows, and the scan's row parameters
/// expanded to `[B, 2·D_ff]`, as the model composes them.
fn ffn_scan_inputs<B: ScanOps>(
    inp: &FfnInputs<B>,
    beta: &Tensor<B, 1>,
    one_minus: &Tensor<B, 1>,
    vth: &Tensor<B, 1>,
) -> [FloatTensor<B>; 3] {
    let i_gu = wrap::<B, 3>(inp.i_gu.clone());
    let [tk, b, two_f] = i_gu.dims();
    let u = (i_gu.reshape([tk * b, two_f]) * one_minus.clone().unsqueeze::<2>())
        .reshape([tk, b, two_f]);
    [
        prim(beta.clone().unsqueeze::<2>().expand([b, two_f])),
        prim(u),
        prim(vth.clone().unsqueeze::<2>().expand([b, two_f])),
    ]
}

/// The FFN neurons composed from tensor ops and [`ScanOps::plif_row_forward`], op for op as the
/// model's composition: `(g·v, V_post)`.
pub fn ffn_forward_reference<B: ScanOps>(inp: &FfnInputs<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let [beta, one_minus, vth] = ffn_params(inp);
    let [beta_e, u, vth_e] = ffn_scan_inputs(inp, &beta, &one_minus, &vth);
    let vpost =
        wrap::<B, 3>(B::plif_forward(ScanKind::Row, beta_e, u, vth_e, inp.v0.clone()).vpost);
    let [tk, b, two_f] = vpost.dims();
    let f = two_f / 2;
    let act = if inp.leak {
        vpost.clone() * one_minus.unsqueeze::<3>()
    } else {
        vpost.clone()
    };
    let gv = act.clone().slice([0..tk, 0..b, 0..f]) * act.slice([0..tk, 0..b, f..two_f]);
    (prim(gv), prim(vpost))
}

/// The parameter gradients of the FFN neurons from per-batch-row sums `[B, 2·D_ff]`: `∂β` (the
/// scan's `Σ gv·V_{k−1}` minus the `(1 − β)` terms' `Σ ∂(1−β)`) and `∂V_th`; `∂w = ∂β·β(1 − β)`.
/// Returns `(∂w_gate, ∂w_up, ∂th_gate, ∂th_up)`.
pub fn ffn_param_grads<B: Backend>(
    inp: &FfnInputs<B>,
    d_beta_rows: FloatTensor<B>,
    d_th_rows: FloatTensor<B>,
) -> [FloatTensor<B>; 4] {
    let [beta, _, _] = ffn_params(inp);
    let two_f = beta.dims()[0];
    let f = two_f / 2;
    let d_beta = wrap::<B, 2>(d_beta_rows).sum_dim(0).reshape([two_f]);
    let d_w = through_sigmoid(d_beta, beta);
    let d_th = wrap::<B, 2>(d_th_rows).sum_dim(0).reshape([two_f]);
    [
        prim(d_w.clone().narrow(0, 0, f)),
        prim(d_w.narrow(0, f, f)),
        prim(d_th.clone().narrow(0, 0, f)),
        prim(d_th.narrow(0, f, f)),
    ]
}

/// Their backward composed from tensor ops and [`ScanOps::plif_row_backward`] (the spikes are
/// recomputed by the forward scan): `∂act` from the gating, `∂V_post = ∂act·(1 − β)` with
/// leak, the scan's backward, `∂i = ∂u·(1 − β)`, and `∂β` collecting the scan's term and both
/// `(1 − β)` factors' (`−Σ ∂act·V_post`, `−Σ ∂u·i`).
pub fn ffn_backward_reference<B: ScanOps>(
    inp: FfnInputs<B>,
    vpost: FloatTensor<B>,
    grad_gv: FloatTensor<B>,
) -> FfnGrads<B> {
    let [beta, one_minus, vth] = ffn_params(&inp);
    let [beta_e, u, vth_e] = ffn_scan_inputs(&inp, &beta, &one_minus, &vth);
    let spike = B::plif_forward(ScanKind::Row, beta_e.clone(), u, vth_e, inp.v0.clone()).spike;
    let vpost = wrap::<B, 3>(vpost);
    let [tk, b, two_f] = vpost.dims();
    let f = two_f / 2;
    let om3 = one_minus.clone().unsqueeze::<3>();
    let act = if inp.leak {
        vpost.clone() * om3.clone()
    } else {
        vpost.clone()
    };
    let grad = wrap::<B, 3>(grad_gv);
    let d_act = Tensor::cat(
        vec![
            grad.clone() * act.clone().slice([0..tk, 0..b, f..two_f]),
            grad * act.slice([0..tk, 0..b, 0..f]),
        ],
        2,
    );
    let rows = |t: Tensor<B, 3>| t.sum_dim(0).reshape([b, two_f]);
    let (d_vpost, d_om_leak) = if inp.leak {
        (d_act.clone() * om3, rows(d_act * vpost.clone()))
    } else {
        (d_act, Tensor::zeros([b, two_f], &vpost.device()))
    };
    let g = B::plif_backward(
        ScanKind::Row,
        beta_e,
        inp.v0.clone(),
        prim(vpost),
        spike,
        prim(d_vpost),
    );
    let g_u = wrap::<B, 3>(g.u);
    let i_gu = wrap::<B, 3>(inp.i_gu.clone());
    let d_i =
        (g_u.clone().reshape([tk * b, two_f]) * one_minus.unsqueeze::<2>()).reshape([tk, b, two_f]);
    let d_om_in = rows(g_u * i_gu);
    let d_beta_rows = wrap::<B, 2>(g.beta) - d_om_leak - d_om_in;
    let [w_gate, w_up, th_gate, th_up] = ffn_param_grads(&inp, prim(d_beta_rows), g.vth);
    FfnGrads {
        i_gu: prim(d_i),
        w_gate,
        w_up,
        th_gate,
        th_up,
        v0: g.v0,
    }
}
