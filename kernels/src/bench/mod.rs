//! `nsactor bench kernels`, generic over the backend: every PLIF scan of the `SnnOps` family
//! checked against the host reference, every fused op against its composition from tensor ops,
//! then timed at the 0.9B shapes and set against the device's measured elementwise-copy
//! bandwidth. A kernel whose results differ is reported as wrong and not timed. On CUDA,
//! [`gemm`] checks and times the projection GEMMs.
//!
//! [`run`] (here) measures the copy bandwidth and runs the four scans (`scans`); the fused ops
//! each have their file (`selective`, `ffn`, `ponder`, `norm_plif`, `gated`, and `optim` for
//! Adam's update); `report` holds the error measures, the timer and the report lines; `config` the
//! shapes. Production code never imports this module.

#[cfg(feature = "cuda")]
pub mod chain;
mod config;
mod ffn;
mod flips;
mod gated;
#[cfg(feature = "cuda")]
pub mod gemm;
mod norm_plif;
mod optim;
mod ponder;
#[cfg(feature = "cuda")]
pub mod prefill;
mod report;
mod scans;
mod selective;

pub use config::{PARTS, ScanBench};

use crate::KernelError;
use crate::ops::snn::SnnOps;
use crate::ops::types::ScanKind;
use burn::tensor::{Distribution, Tensor};
use ffn::{ffn_neurons, ffn_stored};
use gated::gated_out;
use norm_plif::norm_plif;
use ponder::ponder;
use report::{TOLERANCE, host, time, worst};
use scans::{Inputs, Scan};
use selective::{selective, selective_stored};
use std::fmt::Write;

/// Runs the check and the timings; the report is plain text, one line per kernel. Fails when
/// a kernel disagrees with the reference.
pub fn run<B: SnnOps>(device: &B::Device, cfg: &ScanBench) -> Result<String, KernelError> {
    let mut out = String::new();
    // Copy bandwidth: an elementwise pass over the largest sequence tensor (read once, write once).
    let n_big = cfg.steps * cfg.batch * cfg.elem_dim;
    let x: Tensor<B, 1> = Tensor::random([n_big], Distribution::Default, device);
    // The best of three rounds: the figure is a ceiling.
    let copy_s = (0..3)
        .map(|_| {
            time::<B>(device, cfg.reps, || {
                let _ = x.clone().mul_scalar(1.000_001);
            })
        })
        .fold(f64::INFINITY, f64::min);
    let copy_bw = 8.0 * n_big as f64 / copy_s;
    drop(x);
    let _ = writeln!(
        out,
        "elementwise copy (x·c, {n_big} f32): {:.0} GB/s",
        copy_bw / 1e9
    );
    let _ = writeln!(
        out,
        "{:<24} {:>11} {:>10} {:>9} {:>10} {:>12}",
        "kernel", "max rel err", "time (ms)", "GB/s", "of copy", "spike agree"
    );
    let mut failed = Vec::new();
    let scans: &[Scan] = if cfg.runs("scans") { &Scan::ALL } else { &[] };
    for scan in scans {
        let name = scan.name();
        let dim = match scan.kind {
            ScanKind::Elem => cfg.elem_dim,
            ScanKind::Row => cfg.row_dim,
        };
        let cols = cfg.batch * dim;
        // Parity on a short sequence of the full width.
        let small = Inputs::<B>::new(cfg.check_steps, cfg.batch, dim, device);
        let got: Vec<Vec<f32>> = scan.run(&small).iter().map(host::<B>).collect();
        let want = scan.reference(&small, cols);
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| worst(g, w))
            .fold(0.0f32, f32::max);
        let agree = if !scan.backward {
            let same = got[0].iter().zip(&want[0]).filter(|(a, b)| a == b).count();
            format!("{:.6}", same as f64 / want[0].len().max(1) as f64)
        } else {
            "-".into()
        };
        drop(small);
        if err.is_nan() || err > TOLERANCE {
            let _ = writeln!(
                out,
                "{name:<24} {err:>11.2e}  WRONG: differs from the reference; not timed"
            );
            failed.push(name);
            continue;
        }
        let full = Inputs::<B>::new(cfg.steps, cfg.batch, dim, device);
        let n = cfg.steps * cols;
        let s = time::<B>(device, cfg.reps, || {
            let _ = scan.run(&full);
        });
        // The backward rows time the forward too (it makes their inputs): subtract it.
        let s = if scan.backward {
            let f = time::<B>(device, cfg.reps, || {
                let _ = scan.forward().run(&full);
            });
            (s - f).max(1e-9)
        } else {
            s
        };
        let bw = scan.bytes(n, cols) as f64 / s;
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {agree:>12}",
            s * 1e3,
            bw / 1e9,
            100.0 * bw / copy_bw
        );
    }
    // Each part checks its kernels, times them and reports into `out`; `Err` names a wrong one.
    type Part<D> = fn(&D, &ScanBench, f64, &mut String) -> Result<(), &'static str>;
    let parts: [(&str, Part<B::Device>); 9] = [
        ("selective", selective::<B>),
        ("selective", selective_stored::<B>),
        ("ffn", ffn_neurons::<B>),
        ("ffn", ffn_stored::<B>),
        ("ponder", ponder::<B>),
        ("norm", norm_plif::<B>),
        ("gated", gated_out::<B>),
        ("optim", optim::adam::<B>),
        ("optim", optim::square_sums::<B>),
    ];
    for (part, check) in parts {
        if cfg.runs(part)
            && let Err(name) = check(device, cfg, copy_bw, &mut out)
        {
            failed.push(name);
        }
    }
    if failed.is_empty() {
        Ok(out)
    } else {
        Err(KernelError::Mismatch {
            report: format!("{out}wrong kernels: {}", failed.join(", ")),
        })
    }
}
