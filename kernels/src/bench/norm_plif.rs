//! RMSNorm + the input PLIF's fused training op against its composition from tensor ops on the
//! same device, in both output modes.

use super::config::ScanBench;
use super::report::{Pair, TOLERANCE, error_in_type, host, report_pairs, rounded, time, worst};
use crate::ops::snn::SnnOps;
use crate::ops::types::NormPlifInputs;
use crate::reference::norm_plif::{norm_plif_backward_reference, norm_plif_forward_reference};
use crate::tensor::prim;
use burn::tensor::{DType, Distribution, Tensor, TensorMetadata};

/// RMSNorm + the input PLIF's training op ([`SnnOps::norm_plif_forward`] / `_backward`)
/// against the composition ([`norm_plif_forward_reference`] / [`norm_plif_backward_reference`])
/// on the same device, in both output modes: outputs and gradients within the tolerance (the
/// kernels reduce `mean(x²)` in another order; the output in the type the backend writes it,
/// [`error_in_type`], and the backward also from a gradient in that type), then both timed at
/// `steps` frames of `K` (`dim` = D, leak).
pub(super) fn norm_plif<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let n = |mean, std| Distribution::Normal(mean, std);
    let inputs = |steps: usize, leak: bool| {
        let t = steps.div_ceil(cfg.k);
        let vec = |d| prim(Tensor::<B, 1>::random([cfg.dim], d, device));
        let inp = NormPlifInputs {
            x: prim(Tensor::<B, 3>::random(
                [t, cfg.batch, cfg.dim],
                n(0.1, 1.0),
                device,
            )),
            norm_w: vec(n(1.0, 0.2)),
            eps: 1e-6,
            w: vec(n(0.0, 0.5)),
            v_th: vec(n(0.5, 0.15)),
            v0: prim(Tensor::<B, 2>::random(
                [cfg.batch, cfg.dim],
                n(0.0, 0.2),
                device,
            )),
            k: cfg.k,
            leak,
        };
        let grad = prim(Tensor::<B, 3>::random(
            [t * cfg.k, cfg.batch, cfg.dim],
            n(0.0, 1.0),
            device,
        ));
        (inp, grad)
    };
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (small, grad) = inputs(cfg.check_steps.max(cfg.k), leak);
        let (y, vp) = B::norm_plif_forward(small.clone());
        let (y_ref, vp_ref) = norm_plif_forward_reference(&small);
        err_fwd = err_fwd
            .max(error_in_type::<B>(&y, &y_ref))
            .max(worst(&host::<B>(&vp), &host::<B>(&vp_ref)));
        // The output's gradient in f32, and in the type the forward wrote the output (what
        // the projections' summed input gradients come in), against its exact f32 values.
        let mut grads = vec![(grad.clone(), grad.clone())];
        if y.dtype() != DType::F32 {
            grads.push(rounded::<B>(&grad));
        }
        for (g, g_ref) in grads {
            err_bwd = B::norm_plif_backward(small.clone(), vp.clone(), g)
                .iter()
                .zip(&norm_plif_backward_reference(
                    small.clone(),
                    vp_ref.clone(),
                    g_ref,
                ))
                .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
                .fold(err_bwd, f32::max);
        }
    }
    let (full, grad) = inputs(cfg.steps, true);
    let frames = cfg.steps.div_ceil(cfg.k) * cfg.k * cfg.batch * cfg.dim;
    let (_, vpost) = B::norm_plif_forward(full.clone());
    let (_, vpost_ref) = norm_plif_forward_reference(&full);
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::norm_plif_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = norm_plif_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::norm_plif_backward(full.clone(), vpost.clone(), grad.clone());
    });
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = norm_plif_backward_reference(full.clone(), vpost_ref.clone(), grad.clone());
    });
    // Bytes: the output and V_post written (forward); ∂y and V_post read (backward).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed(
                "norm + input plif fwd",
                err_fwd,
                TOLERANCE,
                t_fwd,
                t_ref_fwd,
                4 * 2 * frames,
            ),
            Pair::composed(
                "norm + input plif bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 2 * frames,
            ),
        ],
    )
}
