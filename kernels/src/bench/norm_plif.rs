//! RMSNorm + the input PLIF's fused training op against its composition from tensor ops on the
//! same device, in both output modes. Spikes that flip at a tie with the threshold
//! ([`Flips`]) leave their columns out of the forward's comparison, as in the selective scan's
//! check; the backward is checked alone, both sides on the composition's `V_post`.

use super::config::ScanBench;
use super::flips::{Flips, margin};
use super::report::{
    Pair, TOLERANCE, error_in_type_over, host, report_pairs, rounded, time, worst,
};
use crate::ops::snn::SnnOps;
use crate::ops::types::NormPlifInputs;
use crate::reference::norm_plif::{
    NormPlifRun, norm_plif_backward_reference, norm_plif_forward_reference, norm_plif_reference_run,
};
use crate::tensor::prim;
use burn::tensor::{DType, Distribution, Tensor, TensorMetadata};

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

/// How near `V_th` a frame's `V_pre` must lie for the fused backward to decide its spike
/// otherwise. Both sides of the backward get the composition's `V_post`, so the fused side's
/// `V_pre = β·V_post + u` differs from the composition's by one frame's rounding of `β` and `u`
/// (the norm's sum in another order, σ in a few instructions: around 1e-6), not by two
/// trajectories drifting apart as in the forward ([`super::flips::FLIP_MARGIN`], 1e-4). With
/// that wider margin, 518 of the 896 channels of the H200's `batch=14` check had such a frame
/// and their `∂V_th` went unchecked (s61).
const BACKWARD_TIE: f32 = 1e-5;

/// The composition's run on the host: spikes, `V_post`, `β`, `u`, `V_th`.
struct HostRun {
    spike: Vec<f32>,
    vpost: Vec<f32>,
    beta: Vec<f32>,
    u: Vec<f32>,
    vth: Vec<f32>,
}

impl HostRun {
    fn of<B: SnnOps>(r: &NormPlifRun<B>) -> Self {
        HostRun {
            spike: host::<B>(&r.spike),
            vpost: host::<B>(&r.vpost),
            beta: host::<B>(&r.beta),
            u: host::<B>(&r.u),
            vth: host::<B>(&r.vth),
        }
    }

    /// Where the fused forward's spikes (read off its `vpost`, from membranes `v0`) differ
    /// from these.
    fn flips(&self, vpost: &[f32], v0: &[f32]) -> Flips {
        let cols = self.beta.len();
        let fused = spikes_of(vpost, v0, &self.beta, &self.u, &self.vth, cols);
        Flips::find(&fused, &self.spike, &self.vpost, cols, |idx| {
            self.vth[idx % cols]
        })
    }

    /// The channels (of `dim`) where some frame's `V_pre` lies within [`BACKWARD_TIE`] of
    /// `V_th`: there a backward that decides the spikes again from `V_post` with its own `β`
    /// and `u` may decide otherwise, and only `∂V_th` (`−gV·s` summed) moves by it.
    fn tied_channels(&self, dim: usize) -> Vec<bool> {
        let cols = self.beta.len();
        let mut tied = vec![false; dim];
        for (idx, (&s, &v)) in self.spike.iter().zip(&self.vpost).enumerate() {
            if margin(s == 1.0, v, self.vth[idx % cols]).abs() <= BACKWARD_TIE {
                tied[idx % cols % dim] = true;
            }
        }
        tied
    }
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
    let (mut agree, mut tied_most) = (Vec::new(), 0);
    for leak in [true, false] {
        let (small, grad) = inputs(cfg.check_steps.max(cfg.k), leak);
        let (y, vp) = B::norm_plif_forward(small.clone());
        let reference = norm_plif_reference_run(&small);
        let run = HostRun::of(&reference);
        let vp_h = host::<B>(&vp);
        let flips = run.flips(&vp_h, &host::<B>(&small.v0));
        err_fwd = if flips.are_ties() {
            let keep = |v: Vec<f32>| flips.unflipped(&v);
            err_fwd
                .max(error_in_type_over::<B>(&y, &reference.y, keep))
                .max(worst(&keep(vp_h), &keep(run.vpost.clone())))
        } else {
            f32::INFINITY
        };
        agree.push(flips.describe());
        // The backward alone, both on the composition's `V_post`, `∂V_th` but in channels
        // where a spike sits at a tie ([`HostRun::tied_channels`]). The output's gradient in
        // f32, and in the type the forward wrote the output (what the projections' summed
        // input gradients come in), against its exact f32 values.
        let tied = run.tied_channels(cfg.dim);
        tied_most = tied_most.max(tied.iter().filter(|&&t| t).count());
        let untied = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter()
                .zip(&tied)
                .filter(|(_, t)| !**t)
                .map(|(x, _)| x)
                .collect()
        };
        let mut grads = vec![(grad.clone(), grad.clone())];
        if y.dtype() != DType::F32 {
            grads.push(rounded::<B>(&grad));
        }
        for (g, g_ref) in grads {
            let fused = B::norm_plif_backward(small.clone(), reference.vpost.clone(), g);
            let want = norm_plif_backward_reference(small.clone(), reference.vpost.clone(), g_ref);
            for (i, (a, b)) in fused.iter().zip(&want).enumerate() {
                let (a, b) = (host::<B>(a), host::<B>(b));
                // [∂x, ∂norm_w, ∂w, ∂v_th, ∂v0]
                let (a, b) = if i == 3 {
                    (untied(a), untied(b))
                } else {
                    (a, b)
                };
                err_bwd = err_bwd.max(worst(&a, &b));
            }
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
            )
            .agreeing(if tied_most > 0 {
                format!("∂v_th but {tied_most} of {} channels at a tie", cfg.dim)
            } else {
                "-".into()
            }),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::{HostRun, spikes_of};

    /// The reference scan's trajectory from `v0` with inputs `u` (`[frames, cols]`) and
    /// per-column `β`, `V_th`: `(V_post, spikes)`.
    fn run(v0: &[f32], beta: &[f32], u: &[f32], vth: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let out = crate::reference::row_forward(beta, u, vth, v0, v0.len());
        (out.vpost, out.spike)
    }

    /// Three neurons over six frames, one with a negative threshold (it spikes at every frame
    /// whose `V_pre` is above it) and one with a small one: the spikes read off `V_post` are
    /// the ones the trajectory fired.
    #[test]
    fn spikes_read_off_the_membrane_are_the_fired_ones() {
        let (beta, vth, v0) = (
            [0.9f32, 0.5, 0.7],
            [1.0f32, 0.05, -0.2],
            [0.2f32, -0.1, 0.0],
        );
        let u = [
            0.5f32, 0.3, -0.5, 0.6, 0.02, 0.1, 0.1, 0.0, -0.4, 0.2, 0.04, 0.3, 0.7, 0.1, -0.1,
            -0.3, 0.2, 0.05,
        ];
        let (vpost, fired) = run(&v0, &beta, &u, &vth);
        for c in 0..3 {
            let col: Vec<f32> = fired.iter().skip(c).step_by(3).copied().collect();
            assert!(
                col.contains(&1.0) && col.contains(&0.0),
                "column {c}: {col:?}"
            );
        }
        assert_eq!(spikes_of(&vpost, &v0, &beta, &u, &vth, 3), fired);
    }

    /// Two neurons; in the second the reference's `V_pre` meets `V_th` within `tie` at frame 1
    /// and the fused run stays below it there (a flipped spike). A flip at a tie is accepted
    /// with its column left out and its channel's `∂V_th` too; one far from the threshold is
    /// not.
    fn flipped(tie: f32) -> (super::Flips, Vec<bool>) {
        let (beta, vth, v0) = ([0.5f32, 0.5], [1.0f32, 1.0], [0.0f32, 0.0]);
        // Column 1: V_pre = 0.5 at frame 0, then 0.25 + 0.75 + tie at frame 1.
        let u = [0.2f32, 0.5, 0.3, 0.75 + tie, 0.9, 0.1];
        let (vpost, spike) = run(&v0, &beta, &u, &vth);
        assert_eq!(spike[3], 1.0);
        let reference = HostRun {
            spike,
            vpost: vpost.clone(),
            beta: beta.to_vec(),
            u: u.to_vec(),
            vth: vth.to_vec(),
        };
        // The fused run: the same until column 1's spike at frame 1, which it did not fire.
        let mut fused_u = u;
        fused_u[3] = 0.75 - 1e-7;
        let (fused_vpost, _) = run(&v0, &beta, &fused_u, &vth);
        (
            reference.flips(&fused_vpost, &v0),
            reference.tied_channels(2),
        )
    }

    #[test]
    fn a_flip_at_a_tie_is_accepted_and_its_channel_left_out() {
        let (flips, tied) = flipped(1e-6);
        assert_eq!(flips.columns, vec![false, true]);
        assert!(flips.are_ties(), "{}", flips.describe());
        assert_eq!(tied, vec![false, true]);
    }

    #[test]
    fn a_forward_tie_wider_than_a_backward_one_keeps_its_channel_compared() {
        // Within the forward's margin, beyond the backward's: the backward, fed the same
        // `V_post` on both sides, cannot decide this spike otherwise.
        let (flips, tied) = flipped(5e-5);
        assert!(flips.are_ties(), "{}", flips.describe());
        assert_eq!(tied, vec![false, false]);
    }

    #[test]
    fn a_flip_far_from_the_threshold_fails() {
        let (flips, tied) = flipped(0.2);
        assert_eq!(flips.columns, vec![false, true]);
        assert!(!flips.are_ties(), "{}", flips.describe());
        assert_eq!(tied, vec![false, false]);
    }
}
