//! The SNNBlock's gated output `r·σ(g) + s` as one op against its composition from tensor ops
//! on the same device, forward and backward, at the 0.9B's `[T·K·B, D]`.

use super::config::ScanBench;
use super::report::{Pair, TOLERANCE, error_in_type, host, report_pairs, time, worst};
use crate::ops::snn::SnnOps;
use crate::reference::gated::{gated_out_backward_reference, gated_out_forward_reference};
use crate::tensor::prim;
use burn::tensor::{Distribution, Tensor, TensorMetadata, ops::FloatTensor};

/// `[r, g, s, dy]` of `rows × dim`.
fn inputs<B: SnnOps>(rows: usize, dim: usize, device: &B::Device) -> [FloatTensor<B>; 4] {
    [1.0, 4.0, 1.0, 1.0].map(|std| {
        prim(Tensor::<B, 2>::random(
            [rows, dim],
            Distribution::Normal(0.0, std),
            device,
        ))
    })
}

/// Checked on `check_steps` frames of the batch (the gradients against the reference in the
/// type the backend writes them: [`error_in_type`]), timed on `steps` frames (`dim` = D).
pub(super) fn gated_out<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let [r, g, s, dy] = inputs::<B>(cfg.check_steps * cfg.batch, cfg.dim, device);
    let err_fwd = worst(
        &host::<B>(&B::gated_out_forward(r.clone(), g.clone(), s.clone())),
        &host::<B>(&gated_out_forward_reference::<B>(r.clone(), g.clone(), s)),
    );
    let got = B::gated_out_backward(r.clone(), g.clone(), dy.clone());
    let want = gated_out_backward_reference::<B>(r, g, dy);
    let err_bwd = got
        .iter()
        .zip(want)
        .map(|(a, b)| error_in_type::<B>(a, &b))
        .fold(0.0f32, f32::max);
    let [r, g, s, dy] = inputs::<B>(cfg.steps * cfg.batch, cfg.dim, device);
    let n = cfg.steps * cfg.batch * cfg.dim;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::gated_out_forward(r.clone(), g.clone(), s.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = gated_out_forward_reference::<B>(r.clone(), g.clone(), s.clone());
    });
    let grads = B::gated_out_backward(r.clone(), g.clone(), dy.clone());
    let out_bytes = grads[0].dtype().size();
    drop(grads);
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::gated_out_backward(r.clone(), g.clone(), dy.clone());
    });
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = gated_out_backward_reference::<B>(r.clone(), g.clone(), dy.clone());
    });
    // Bytes: three f32 reads and one write forward; three reads and three writes (in the
    // gradients' type) backward.
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed(
                "gated output fwd",
                err_fwd,
                TOLERANCE,
                t_fwd,
                t_ref_fwd,
                16 * n,
            ),
            Pair::composed(
                "gated output bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                (12 + 3 * out_bytes) * n,
            ),
        ],
    )
}
