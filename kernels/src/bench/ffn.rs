//! The SNNFFN's fused neurons against their composition from tensor ops on the same device, in
//! f32 (bit for bit forward) and, where the backend stores it, in bf16 storage.

use super::config::ScanBench;
use super::report::{
    Pair, TOLERANCE, host, rel_norm, report_pairs, rounded, time, worst, worst_rel_norm,
};
use crate::ops::snn::SnnOps;
use crate::ops::types::{FfnGrads, FfnInputs};
use crate::reference::ffn::{ffn_backward_reference, ffn_forward_reference};
use crate::tensor::prim;
use burn::tensor::{Distribution, Tensor, backend::Backend, ops::FloatTensor};

/// The FFN neurons' gradients in [`FfnInputs`]' order.
fn ffn_grad_list<B: Backend>(g: FfnGrads<B>) -> Vec<FloatTensor<B>> {
    vec![g.i_gu, g.w_gate, g.w_up, g.th_gate, g.th_up, g.v0]
}

/// Inputs of the FFN neurons at `steps` frames (`row_dim` = 2·D_ff channels) and an upstream
/// gradient of `g·v`: currents and thresholds near the model's operating point.
fn ffn_inputs<B: Backend>(
    steps: usize,
    cfg: &ScanBench,
    leak: bool,
    device: &B::Device,
) -> (FfnInputs<B>, FloatTensor<B>) {
    let n = |mean, std| Distribution::Normal(mean, std);
    let f = cfg.row_dim / 2;
    let vec = |d| prim(Tensor::<B, 1>::random([f], d, device));
    let inputs = FfnInputs {
        i_gu: prim(Tensor::<B, 3>::random(
            [steps, cfg.batch, 2 * f],
            n(0.2, 0.6),
            device,
        )),
        w_gate: vec(n(0.0, 0.5)),
        w_up: vec(n(0.0, 0.5)),
        th_gate: vec(n(0.15, 0.05)),
        th_up: vec(n(0.15, 0.05)),
        v0: prim(Tensor::<B, 2>::random(
            [cfg.batch, 2 * f],
            n(0.0, 0.1),
            device,
        )),
        leak,
    };
    let grad = prim(Tensor::<B, 3>::random(
        [steps, cfg.batch, f],
        n(0.0, 1.0),
        device,
    ));
    (inputs, grad)
}

/// The FFN neurons' training op ([`SnnOps::ffn_neurons_forward`] / `_backward`) against the
/// composition ([`ffn_forward_reference`] / [`ffn_backward_reference`]) on the same device:
/// `g·v` and `V_post` bit for bit, every gradient within the tolerance, in both output modes;
/// then both timed at the 0.9B shape (`row_dim` = 2·D_ff, leak).
pub(super) fn ffn_neurons<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let grads = ffn_grad_list::<B>;
    let fused_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = B::ffn_neurons_forward(inp.clone());
        grads(B::ffn_neurons_backward(inp.clone(), vpost, grad.clone()))
    };
    let ref_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = ffn_forward_reference(inp);
        grads(ffn_backward_reference(inp.clone(), vpost, grad.clone()))
    };
    // The forward's error is 0 when bit for bit, NaN otherwise.
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (small, grad) = ffn_inputs::<B>(cfg.check_steps, cfg, leak, device);
        let (gv, vp) = B::ffn_neurons_forward(small.clone());
        let (gv_ref, vp_ref) = ffn_forward_reference(&small);
        // Bit for bit: any difference (NaN included) fails the check.
        for (a, b) in [(gv, gv_ref), (vp, vp_ref)] {
            let (a, b) = (host::<B>(&a), host::<B>(&b));
            let same =
                a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same {
                err_fwd = f32::NAN;
            }
        }
        err_bwd = fused_bwd(&small, &grad)
            .iter()
            .zip(&ref_bwd(&small, &grad))
            .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
            .fold(err_bwd, f32::max);
    }
    let (full, grad) = ffn_inputs::<B>(cfg.steps, cfg, true, device);
    let n = cfg.steps * cfg.batch * cfg.row_dim / 2;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ffn_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = fused_bwd(&full, &grad);
    }) - t_fwd;
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ref_bwd(&full, &grad);
    }) - t_ref_fwd;
    // Bytes: i_gu read, g·v and V_post written (forward); ∂(g·v), i_gu, V_post read and ∂i_gu
    // written (backward). The forward must be bit for bit (tolerance 0).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed("ffn neurons fwd", err_fwd, 0.0, t_fwd, t_ref_fwd, 4 * 5 * n),
            Pair::composed(
                "ffn neurons bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 7 * n,
            ),
        ],
    )
}

/// The FFN neurons with bf16 storage: the currents `i_gu` and the upstream gradient rounded
/// to bf16 go in, `g·v` and `∂i_gu` come out in bf16, `V_post` (which the backward's spike
/// recomputation reads) in f32. Against the composition in f32 on the same rounded values:
/// `V_post` bit for bit, `g·v` and every gradient within [`TOLERANCE_BF16`], both output
/// modes; timed at the 0.9B shape.
///
/// [`TOLERANCE_BF16`]: super::report::TOLERANCE_BF16
pub(super) fn ffn_stored<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    if B::storage_dtype() == burn::tensor::DType::F32 {
        return Ok(());
    }
    let prepare = |steps: usize, leak: bool| {
        let (inp, grad) = ffn_inputs::<B>(steps, cfg, leak, device);
        let (mut low, mut wide) = (inp.clone(), inp.clone());
        (low.i_gu, wide.i_gu) = rounded::<B>(&inp.i_gu);
        let (grad_low, grad_wide) = rounded::<B>(&grad);
        (low, wide, grad_low, grad_wide)
    };
    let grads = ffn_grad_list::<B>;
    let fused_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = B::ffn_neurons_forward(inp.clone());
        grads(B::ffn_neurons_backward(inp.clone(), vpost, grad.clone()))
    };
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (low, wide, grad_low, grad_wide) = prepare(cfg.check_steps, leak);
        let (gv, vp) = B::ffn_neurons_forward(low.clone());
        let (gv_ref, vp_ref) = ffn_forward_reference(&wide);
        err_fwd = if host::<B>(&vp) == host::<B>(&vp_ref) {
            err_fwd.max(rel_norm(&host::<B>(&gv), &host::<B>(&gv_ref)))
        } else {
            f32::INFINITY
        };
        let reference = grads(ffn_backward_reference(wide, vp_ref, grad_wide));
        err_bwd = err_bwd.max(worst_rel_norm::<B>(&fused_bwd(&low, &grad_low), &reference));
    }
    let (full, _, grad, _) = prepare(cfg.steps, true);
    let n = cfg.steps * cfg.batch * cfg.row_dim / 2;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_forward(full.clone());
    });
    // The backward alone, on one forward's `V_post`.
    let (_, vpost) = B::ffn_neurons_forward(full.clone());
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_backward(full.clone(), vpost.clone(), grad.clone());
    });
    // Forward: i_gu read (2n bf16), g·v (n bf16) and V_post (2n f32) written; backward:
    // ∂(g·v), i_gu and V_post read, ∂i_gu (2n bf16) written.
    report_pairs(
        out,
        copy_bw,
        [
            Pair::stored("ffn neurons fwd, bf16", err_fwd, t_fwd, 14 * n, "-".into()),
            Pair::stored("ffn neurons bwd, bf16", err_bwd, t_bwd, 18 * n, "-".into()),
        ],
    )
}
