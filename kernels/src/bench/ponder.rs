//! PonderAgg's fused training op against its composition from tensor ops on the same device.

use super::config::ScanBench;
use super::report::{Pair, TOLERANCE, host, report_pairs, time, worst};
use crate::ops::snn::SnnOps;
use crate::ops::types::PonderInputs;
use crate::reference::ponder::{ponder_backward_reference, ponder_forward_reference};
use crate::tensor::prim;
use burn::tensor::{Distribution, Tensor};

/// PonderAgg's training op ([`SnnOps::ponder_forward`] / `_backward`) against the composition
/// ([`ponder_forward_reference`] / [`ponder_backward_reference`]) on the same device, outputs
/// and gradients within the tolerance (the logits' dot products sum in another order), then both
/// timed at `steps` frames of `K` (`dim` = D).
pub(super) fn ponder<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let n = |mean, std| Distribution::Normal(mean, std);
    let inputs = |steps: usize| {
        let frames = steps.div_ceil(cfg.k) * cfg.k;
        let inp = PonderInputs {
            frames: prim(Tensor::<B, 3>::random(
                [frames, cfg.batch, cfg.dim],
                n(0.0, 1.0),
                device,
            )),
            halt_w: prim(Tensor::<B, 2>::random([1, cfg.dim], n(0.0, 0.05), device)),
            halt_b: prim(Tensor::<B, 1>::random([1], n(-1.0, 0.1), device)),
            k: cfg.k,
            clamp: 1e-7,
            eps: 1e-8,
        };
        let grad = prim(Tensor::<B, 3>::random(
            [frames / cfg.k, cfg.batch, cfg.dim + 1],
            n(0.0, 1.0),
            device,
        ));
        (inp, grad)
    };
    let (small, grad) = inputs(cfg.check_steps.max(cfg.k));
    let err_fwd = worst(
        &host::<B>(&B::ponder_forward(small.clone())),
        &host::<B>(&ponder_forward_reference(&small)),
    );
    let err_bwd = B::ponder_backward(small.clone(), grad.clone())
        .iter()
        .zip(&ponder_backward_reference(small, grad))
        .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
        .fold(0.0f32, f32::max);
    let (full, grad) = inputs(cfg.steps);
    let frames = cfg.steps.div_ceil(cfg.k) * cfg.k * cfg.batch * cfg.dim;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ponder_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ponder_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::ponder_backward(full.clone(), grad.clone());
    });
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ponder_backward_reference(full.clone(), grad.clone());
    });
    // Bytes: the frames read once (forward); read twice and ∂frames written (backward).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed(
                "ponder agg fwd",
                err_fwd,
                TOLERANCE,
                t_fwd,
                t_ref_fwd,
                4 * frames,
            ),
            Pair::composed(
                "ponder agg bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 3 * frames,
            ),
        ],
    )
}
