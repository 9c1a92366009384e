//! The fused selective scan against its composition from tensor ops on the same device, in
//! f32 and, where the backend stores it, in bf16 storage.

use super::config::ScanBench;
use super::flips::Flips;
use super::report::{
    Pair, TOLERANCE, host, rel_norm, report_pairs, rounded, time, worst, worst_rel_norm,
};
use crate::ops::snn::SnnOps;
use crate::ops::types::{SelectiveGrads, SelectiveInputs};
use crate::reference::selective::{selective_backward_reference, selective_forward_reference};
use crate::tensor::prim;
use burn::tensor::{Distribution, Tensor, backend::Backend, ops::FloatTensor};
use std::fmt::Write;

/// The selective scan's gradients in [`SelectiveInputs`]' order.
fn selective_grad_list<B: Backend>(g: SelectiveGrads<B>) -> Vec<FloatTensor<B>> {
    vec![
        g.i, g.r_beta, g.r_alpha, g.r_th, g.b_beta, g.b_alpha, g.b_th, g.v0,
    ]
}

/// Inputs of the fused selective scan at `steps` frames: projections around the model's
/// operating point (β ≈ σ(1), α ≈ 1, thresholds near the inputs so neurons spike often).
fn selective_inputs<B: Backend>(
    steps: usize,
    cfg: &ScanBench,
    device: &B::Device,
) -> (SelectiveInputs<B>, FloatTensor<B>) {
    let n = |mean, std| Distribution::Normal(mean, std);
    let seq = |d| {
        prim(Tensor::<B, 3>::random(
            [steps, cfg.batch, cfg.elem_dim],
            d,
            device,
        ))
    };
    let vec = |d| prim(Tensor::<B, 1>::random([cfg.elem_dim], d, device));
    let inputs = SelectiveInputs {
        i: seq(n(0.3, 0.5)),
        r_beta: seq(n(0.0, 0.5)),
        r_alpha: seq(n(0.0, 0.5)),
        r_th: seq(n(0.0, 0.3)),
        b_beta: vec(n(1.0, 0.5)),
        b_alpha: vec(n(0.54, 0.1)),
        b_th: vec(n(0.3, 0.1)),
        v_th_min: 0.1,
        v0: prim(Tensor::<B, 2>::random(
            [cfg.batch, cfg.elem_dim],
            n(0.0, 0.2),
            device,
        )),
    };
    (inputs, seq(n(0.0, 1.0)))
}

/// The fused spikes' flips against the reference's on `inp` (whose thresholds
/// `|r_th + b_th| + V_min` the reference used), spikes and `V_post` `[steps, B, DN]`.
fn spike_flips<B: Backend>(
    inp: &SelectiveInputs<B>,
    fused_spike: &[f32],
    ref_spike: &[f32],
    ref_vpost: &[f32],
    cols: usize,
) -> Flips {
    let r_th = host::<B>(&inp.r_th);
    let b_th = host::<B>(&inp.b_th);
    let v_min = inp.v_th_min;
    Flips::find(fused_spike, ref_spike, ref_vpost, cols, |idx| {
        (r_th[idx] + b_th[(idx % cols) % b_th.len()]).abs() + v_min
    })
}

/// The fused selective scan (modulation inside the kernel) against the same computation
/// composed from tensor ops ([`selective_forward_reference`]) on the same device: outputs and
/// every gradient checked, then both timed at the 0.9B shape. Spikes that flip at a tie with
/// the threshold ([`Flips`]) leave their columns out of the forward's comparison; the backward
/// is checked alone, on the reference forward's outputs. Reports into `out`; the name of the
/// failing kernel on a mismatch.
pub(super) fn selective<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let grads = selective_grad_list::<B>;
    let fused_fwd = |inp: &SelectiveInputs<B>| B::plif_selective_forward(inp.clone());
    let fused_bwd = |inp: &SelectiveInputs<B>, grad: &FloatTensor<B>| {
        let o = B::plif_selective_forward(inp.clone());
        grads(B::plif_selective_backward(
            inp.clone(),
            o.vpost,
            o.spike,
            grad.clone(),
        ))
    };
    let ref_fwd = |inp: &SelectiveInputs<B>| selective_forward_reference(inp.clone());
    let ref_bwd = |inp: &SelectiveInputs<B>, grad: &FloatTensor<B>| {
        let o = selective_forward_reference(inp.clone());
        grads(selective_backward_reference(
            inp.clone(),
            o.vpost,
            o.spike,
            grad.clone(),
        ))
    };
    let (small, grad) = selective_inputs::<B>(cfg.check_steps, cfg, device);
    let (f, r) = (fused_fwd(&small), ref_fwd(&small));
    let (fs, rs, rv) = (
        host::<B>(&f.spike),
        host::<B>(&r.spike),
        host::<B>(&r.vpost),
    );
    let cols = cfg.batch * cfg.elem_dim;
    let flips = spike_flips(&small, &fs, &rs, &rv, cols);
    let fired = rs.iter().filter(|&&s| s == 1.0).count() as f64 / rs.len() as f64;
    let err_fwd = if flips.are_ties() {
        worst(
            &flips.unflipped(&host::<B>(&f.vpost)),
            &flips.unflipped(&rv),
        )
    } else {
        f32::INFINITY
    };
    // The backward alone: both on the reference forward's spikes and `V_post`.
    let (v, s) = (r.vpost.clone(), r.spike.clone());
    let fused = B::plif_selective_backward(small.clone(), v.clone(), s.clone(), grad.clone());
    let reference = selective_backward_reference(small.clone(), v, s, grad.clone());
    let err_bwd = grads(fused)
        .iter()
        .zip(&grads(reference))
        .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
        .fold(0.0f32, f32::max);
    drop((small, grad));
    let (full, grad) = selective_inputs::<B>(cfg.steps, cfg, device);
    let (n, c) = (
        cfg.steps * cfg.batch * cfg.elem_dim,
        cfg.batch * cfg.elem_dim,
    );
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = fused_fwd(&full);
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ref_fwd(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = fused_bwd(&full, &grad);
    }) - t_fwd;
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ref_bwd(&full, &grad);
    }) - t_ref_fwd;
    let mut failed = Ok(());
    for (name, err, s, s_ref, bytes) in [
        (
            "selective fused fwd",
            err_fwd,
            t_fwd,
            t_ref_fwd,
            4 * (6 * n + 4 * c),
        ),
        (
            "selective fused bwd",
            err_bwd,
            t_bwd,
            t_ref_bwd,
            4 * (11 * n + 8 * c),
        ),
    ] {
        if err.is_nan() || err > TOLERANCE {
            let _ = writeln!(
                out,
                "{name:<24} {err:>11.2e}  WRONG: differs from the composed reference; not timed"
            );
            failed = Err(name);
            continue;
        }
        let bw = bytes as f64 / s.max(1e-9);
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {:>12}  composed from tensor ops: {:.3} ms ({:.1}× slower)",
            s * 1e3,
            bw / 1e9,
            100.0 * bw / copy_bw,
            if name.ends_with("fwd") {
                flips.describe()
            } else {
                "-".into()
            },
            s_ref * 1e3,
            s_ref / s.max(1e-9)
        );
    }
    let _ = writeln!(
        out,
        "  (selective check: {:.1}% of the reference's spikes fire)",
        100.0 * fired
    );
    failed
}

/// The selective scan with bf16 storage, where the backend stores it: the four projections
/// and the upstream gradient rounded to bf16 go in, spikes, `V_post` and the projections'
/// gradients come out in bf16. Checked against the composed f32 reference on the same rounded
/// values (spikes must agree but for ties at the threshold ([`Flips`]), whose columns are left
/// out; the final state, kept in f32, within the f32 [`TOLERANCE`]: the arithmetic is f32, with
/// the modulation's σ and softplus a few ulp from burn's; `V_post` and the gradients within
/// [`TOLERANCE_BF16`], the backward on the reference forward's outputs), then timed at the 0.9B
/// shape, bytes counted at their stored width.
///
/// [`TOLERANCE_BF16`]: super::report::TOLERANCE_BF16
pub(super) fn selective_stored<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    if B::storage_dtype() == burn::tensor::DType::F32 {
        return Ok(());
    }
    // (bf16 inputs, their exact f32 values, bf16 gradient, its f32 values)
    let prepare = |steps: usize| {
        let (inp, grad) = selective_inputs::<B>(steps, cfg, device);
        let (mut low, mut wide) = (inp.clone(), inp.clone());
        (low.i, wide.i) = rounded::<B>(&inp.i);
        (low.r_beta, wide.r_beta) = rounded::<B>(&inp.r_beta);
        (low.r_alpha, wide.r_alpha) = rounded::<B>(&inp.r_alpha);
        (low.r_th, wide.r_th) = rounded::<B>(&inp.r_th);
        let (grad_low, grad_wide) = rounded::<B>(&grad);
        (low, wide, grad_low, grad_wide)
    };
    let grads = selective_grad_list::<B>;
    let (low, wide, grad_low, grad_wide) = prepare(cfg.check_steps);
    let f = B::plif_selective_forward(low.clone());
    let r = selective_forward_reference(wide.clone());
    let (fs, rs, rv) = (
        host::<B>(&f.spike),
        host::<B>(&r.spike),
        host::<B>(&r.vpost),
    );
    let cols = cfg.batch * cfg.elem_dim;
    let flips = spike_flips(&wide, &fs, &rs, &rv, cols);
    // The final state `[B, DN]` is the last step's row, column by column.
    let last_err = f.last.as_ref().map_or(0.0, |last| {
        let keep = |row: &[f32]| flips.unflipped(row);
        worst(&keep(&host::<B>(last)), &keep(&rv[rv.len() - cols..]))
    });
    let err_fwd = if flips.are_ties() && last_err <= TOLERANCE {
        rel_norm(
            &flips.unflipped(&host::<B>(&f.vpost)),
            &flips.unflipped(&rv),
        )
    } else {
        f32::INFINITY
    };
    // The backward alone, on the reference forward's spikes and `V_post` (stored in bf16 as
    // the fused forward stores them).
    let fused = B::plif_selective_backward(
        low.clone(),
        rounded::<B>(&r.vpost).0,
        rounded::<B>(&r.spike).0,
        grad_low.clone(),
    );
    let reference = selective_backward_reference(wide, r.vpost, r.spike, grad_wide);
    let err_bwd = worst_rel_norm::<B>(&grads(fused), &grads(reference));
    drop((low, grad_low, f));
    let (full, _, grad, _) = prepare(cfg.steps);
    let (n, c) = (
        cfg.steps * cfg.batch * cfg.elem_dim,
        cfg.batch * cfg.elem_dim,
    );
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::plif_selective_forward(full.clone());
    });
    // The backward alone, on one forward's outputs.
    let o = B::plif_selective_forward(full.clone());
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::plif_selective_backward(
            full.clone(),
            o.vpost.clone(),
            o.spike.clone(),
            grad.clone(),
        );
    });
    let agree = if err_fwd.is_finite() {
        flips.describe()
    } else {
        format!(
            "spikes agree {}, final state off by {last_err:.2e}",
            flips.describe()
        )
    };
    // Stored values 2 bytes; biases, v0, the final state and the per-column sums 4.
    report_pairs(
        out,
        copy_bw,
        [
            Pair::stored(
                "selective fwd, bf16",
                err_fwd,
                t_fwd,
                2 * 6 * n + 4 * 3 * c,
                agree,
            ),
            Pair::stored(
                "selective bwd, bf16",
                err_bwd,
                t_bwd,
                2 * 11 * n + 4 * 5 * c,
                "-".into(),
            ),
        ],
    )
}
