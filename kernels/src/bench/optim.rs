//! Adam's update ([`OptimOps::adam_update`](crate::OptimOps::adam_update)) against its
//! composition ([`crate::reference::optim::adam`]) on the same device: the three results of
//! five updates (plain Adam at steps 1 and 7, AdamW, Adam with L2 decay, a clipped gradient),
//! then both timed over about one 0.9B layer's parameters. And the gradients' sums of squares
//! ([`OptimOps::square_sums`](crate::OptimOps::square_sums)) against theirs
//! ([`crate::reference::optim::square_sum`]) over a layer's worth of gradients of mixed sizes.

use super::config::ScanBench;
use super::report::time;
use crate::ops::snn::SnnOps;
use crate::ops::types::AdamStep;
use crate::reference::optim;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use std::fmt::Write;

/// Largest accepted `|kernel − reference| / (1 + |reference|)`: the kernel does the
/// composition's operations in its order, and only a contraction of a multiply and an add into
/// one rounding may move the last bits.
const TOLERANCE: f32 = 1e-6;

fn values<B: SnnOps>(t: &Tensor<B, 1>) -> Vec<f32> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32")
}

/// A parameter, its gradient and both moments near a training run's values.
fn state<B: SnnOps>(n: usize, device: &B::Device) -> [Tensor<B, 1>; 4] {
    let r = |std: f64| Tensor::<B, 1>::random([n], Distribution::Normal(0.0, std), device);
    let g = r(1e-3);
    [r(0.02), g.clone(), r(1e-3), g.clone() * g]
}

fn fused<B: SnnOps>(x: &[Tensor<B, 1>; 4], s: &AdamStep) -> [Tensor<B, 1>; 3] {
    let [p, g, m, v] = x.clone().map(|t| t.into_primitive().tensor());
    B::adam_update(p, g, m, v, s).map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
}

fn composed<B: SnnOps>(x: &[Tensor<B, 1>; 4], s: &AdamStep) -> [Tensor<B, 1>; 3] {
    let [p, g, m, v] = x.clone();
    let (p, m, v) = optim::adam(p, g, m, v, s);
    [p, m, v]
}

/// Checks and times the update; a line in `out`, `Err` with the kernel's name when it differs.
pub(super) fn adam<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let name = "adam update";
    let n = (cfg.steps * cfg.batch * cfg.elem_dim / 5).max(1);
    let small = state::<B>(n.min(1 << 20) | 1, device);
    let adam = AdamStep {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        lr: 6e-4,
        wd: 0.0,
        decoupled: false,
        step: 1,
        grad_scale: 1.0,
    };
    let cases = [
        AdamStep { step: 7, ..adam },
        adam,
        AdamStep {
            wd: 0.01,
            decoupled: true,
            ..adam
        },
        AdamStep { wd: 0.01, ..adam },
        AdamStep {
            grad_scale: 0.37,
            ..adam
        },
    ];
    let (mut err, mut same, mut total) = (0.0f32, 0usize, 0usize);
    for s in &cases {
        for (got, want) in fused(&small, s).iter().zip(composed(&small, s).iter()) {
            let (got, want) = (values(got), values(want));
            total += want.len();
            same += got.iter().zip(&want).filter(|(a, b)| a == b).count();
            err = got
                .iter()
                .zip(&want)
                .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
                .fold(err, f32::max);
        }
    }
    let agree = same as f64 / total.max(1) as f64;
    if err.is_nan() || err > TOLERANCE {
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e}  WRONG: differs from the composition; not timed \
             ({agree:.6} of values identical)"
        );
        return Err(name);
    }
    drop(small);
    let full = state::<B>(n, device);
    let fused_s = time::<B>(device, cfg.reps, || {
        let _ = fused(&full, &adam);
    });
    let composed_s = time::<B>(device, cfg.reps, || {
        let _ = composed(&full, &adam);
    });
    // p, g, m, v read and p, m, v written once.
    let bw = 28.0 * n as f64 / fused_s;
    let _ = writeln!(
        out,
        "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {agree:>12.6}  ({n} values; \
         composed {:.3} ms)",
        fused_s * 1e3,
        bw / 1e9,
        100.0 * bw / copy_bw,
        composed_s * 1e3
    );
    Ok(())
}

/// Largest accepted relative difference of a sum of squares from the composition's: both sum
/// f32 squares in f32, in different orders.
const SUM_TOLERANCE: f64 = 1e-5;

/// Checks and times [`OptimOps::square_sums`](crate::OptimOps::square_sums) on gradients shaped
/// like a 0.9B layer's (a few long ones, more short ones).
pub(super) fn square_sums<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let name = "gradient square sums";
    let big = (cfg.steps * cfg.batch * cfg.elem_dim / 20).max(1);
    // No empty gradient: a random fill of none is an invalid (zero-cube) launch on CUDA.
    let sizes: Vec<usize> = [big, big, big / 3 + 7, 4096, 896, 896, 1]
        .into_iter()
        .cycle()
        .take(40)
        .collect();
    let ts: Vec<Tensor<B, 1>> = sizes
        .iter()
        .map(|&n| Tensor::random([n], Distribution::Normal(0.0, 1e-3), device))
        .collect();
    let fused = || {
        let prims = ts
            .iter()
            .map(|t| t.clone().into_primitive().tensor())
            .collect();
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::square_sums(prims)))
    };
    let composed = || Tensor::cat(ts.iter().map(optim::square_sum).collect(), 0);
    let (got, want) = (values(&fused()), values(&composed()));
    let err = got
        .iter()
        .zip(&want)
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (y as f64).abs().max(f64::MIN_POSITIVE))
        .filter(|e| !e.is_nan())
        .fold(0.0f64, f64::max);
    // A zero sum is zero in both (the division above skips it).
    let zeros_agree = got
        .iter()
        .zip(&want)
        .all(|(x, y)| (*y == 0.0) == (*x == 0.0));
    if got.len() != sizes.len() || !zeros_agree || err > SUM_TOLERANCE {
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e}  WRONG: differs from the composition; not timed"
        );
        return Err(name);
    }
    let fused_s = time::<B>(device, cfg.reps, || {
        let _ = fused();
    });
    let composed_s = time::<B>(device, cfg.reps, || {
        let _ = composed();
    });
    let total: usize = sizes.iter().sum();
    let bw = 4.0 * total as f64 / fused_s;
    let _ = writeln!(
        out,
        "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {:>12}  ({} gradients, {total} \
         values; composed {:.3} ms)",
        fused_s * 1e3,
        bw / 1e9,
        100.0 * bw / copy_bw,
        "",
        sizes.len(),
        composed_s * 1e3
    );
    Ok(())
}
