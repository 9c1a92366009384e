//! RMSNorm + the input PLIF's fused training op against its composition from tensor ops on the
//! same device, in both output modes. Spikes that flip at a tie with the threshold
//! ([`Flips`]) leave their columns out of the forward's comparison, as in the selective scan's
//! check; the backward is checked alone, both sides on the composition's `V_post`.

use super::config::ScanBench;
use super::flips::Flips;
use super::report::{
    Pair, TOLERANCE, error_in_type_over, host, report_pairs, rounded, time, worst,
};
use crate::ops::snn::SnnOps;
use crate::ops::types::NormPlifInputs;
use crate::reference::norm_plif::{
    norm_plif_backward_reference, norm_plif_forward_reference, norm_plif_spikes_reference,
};
use crate::tensor::prim;
use burn::tensor::{DType, Distribution, Tensor, TensorMetadata, ops::FloatTensor};

/// The fused forward's spikes, read off its `V_post` (`[frames, cols]` on the host, `cols` =
/// B·D neurons): each frame charges the fused membrane of the frame before with the
/// composition's inputs, `V_pre = β·V + u` (`β`, `V_th` per neuron, `u` per frame and neuron,
/// `v0` the membranes before the first frame), and spiked where `V_pre − V_post` is nearer
/// `V_th` than 0: a spike subtracts `V_th`, the rest of the difference is rounding.
fn spikes_of(
    vpost: &[f32],
    v0: &[f32],
    beta: &[f32],
    u: &[f32],
    vth: &[f32],
    cols: usize,
) -> Vec<f32> {
    let mut before = v0.to_vec();
    vpost
        .iter()
        .zip(u)
        .enumerate()
        .map(|(idx, (&v, &u))| {
            let c = idx % cols;
            let drop = beta[c].mul_add(before[c], u) - v;
            before[c] = v;
            if (drop - vth[c]).abs() < drop.abs() {
                1.0
            } else {
                0.0
            }
        })
        .collect()
}

/// Where the fused forward's spikes (read off `vpost`) differ from the composition's on `inp`.
fn spike_flips<B: SnnOps>(inp: &NormPlifInputs<B>, vpost: &[f32], ref_vpost: &[f32]) -> Flips {
    let [spike, beta, u, vth] = norm_plif_spikes_reference(inp).map(|t| host::<B>(&t));
    let cols = beta.len();
    let fused = spikes_of(vpost, &host::<B>(&inp.v0), &beta, &u, &vth, cols);
    Flips::find(&fused, &spike, ref_vpost, cols, |idx| vth[idx % cols])
}

/// RMSNorm + the input PLIF's training op ([`SnnOps::norm_plif_forward`] / `_backward`)
/// against the composition ([`norm_plif_forward_reference`] / [`norm_plif_backward_reference`])
/// on the same device, in both output modes: outputs and gradients within the tolerance (the
/// kernels reduce `mean(x²)` in another order; the output in the type the backend writes it,
/// [`error_in_type`](super::report::error_in_type), and the backward also from a gradient in that type), then both timed at
/// `steps` frames of `K` (`dim` = D, leak). A spike flipped at a tie with the threshold
/// ([`Flips`]) leaves its neuron out of the forward's comparison and is reported with its
/// margin; one flipped farther from it fails the check.
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
    let mut agree = Vec::new();
    for leak in [true, false] {
        let (small, grad) = inputs(cfg.check_steps.max(cfg.k), leak);
        let (y, vp) = B::norm_plif_forward(small.clone());
        let (y_ref, vp_ref) = norm_plif_forward_reference(&small);
        let (vp_h, vp_ref_h) = (host::<B>(&vp), host::<B>(&vp_ref));
        let flips = spike_flips(&small, &vp_h, &vp_ref_h);
        err_fwd = if flips.are_ties() {
            let keep = |v: Vec<f32>| flips.unflipped(&v);
            err_fwd
                .max(error_in_type_over::<B>(&y, &y_ref, keep))
                .max(worst(&keep(vp_h), &keep(vp_ref_h)))
        } else {
            f32::INFINITY
        };
        agree.push(flips.describe());
        // The backward alone, both on the composition's `V_post`. The output's gradient in
        // f32, and in the type the forward wrote the output (what the projections' summed
        // input gradients come in), against its exact f32 values.
        let vp: FloatTensor<B> = vp_ref.clone();
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
            )
            .agreeing(agree.join(" / ")),
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

#[cfg(test)]
mod tests {
    use super::spikes_of;

    /// Two neurons over six frames, one spiking often with a small threshold: the spikes read
    /// off `V_post` are the ones the trajectory fired.
    #[test]
    fn spikes_read_off_the_membrane_are_the_fired_ones() {
        let (beta, vth, v0) = ([0.9f32, 0.5], [1.0f32, 0.05], [0.2f32, -0.1]);
        let u = [
            0.5f32, 0.3, 0.6, 0.02, 0.1, 0.0, 0.2, 0.04, 0.7, 0.1, -0.3, 0.2,
        ];
        let (mut v, mut vpost, mut fired) = (v0, Vec::new(), Vec::new());
        for (idx, &u) in u.iter().enumerate() {
            let c = idx % 2;
            let pre = beta[c].mul_add(v[c], u);
            let s = if pre >= vth[c] { 1.0 } else { 0.0 };
            v[c] = pre - vth[c] * s;
            vpost.push(v[c]);
            fired.push(s);
        }
        assert!(fired.contains(&1.0) && fired.contains(&0.0));
        assert_eq!(spikes_of(&vpost, &v0, &beta, &u, &vth, 2), fired);
    }

    /// A membrane whose frame after a flip differs from the composition's by rounding only is
    /// still read as the spike it fired.
    #[test]
    fn rounding_in_the_membrane_does_not_move_the_reading() {
        let vpost = [0.25f32 + 1e-6, 0.975 - 2e-6];
        let got = spikes_of(&vpost, &[0.0], &[0.5], &[1.25, 0.85], &[1.0], 1);
        assert_eq!(got, vec![1.0, 0.0]);
    }
}
