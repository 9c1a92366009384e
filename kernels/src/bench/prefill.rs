//! `bench kernels`' `prefill` part on CUDA: the inference block scan, FFN neurons and the
//! RMSNorm with the input PLIF of one session's long pass walked in one chunk and cut in time
//! chunks ([`crate::cuda::speculative`]), held bit for bit against each other, then timed.
//!
//! The inputs imitate a fresh 0.9B layer: `b_β` the logits of β from 0.80 to 0.99 (SPEC's
//! initialisation), projections `N(0, σ)`, FFN `w` from `N(0, 0.5)`. How far a chunk's two
//! walks run before they meet depends on β, so the trained model's timings may differ.

use crate::KernelError;
use crate::cuda::decode::{BlockScanKernel, block_scan_by};
use crate::cuda::ffn::ffn_infer_cut;
use crate::cuda::norm_plif::norm_plif_cut;
use crate::options::option_items;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};
use burn_cuda::CudaDevice;
use std::fmt::Write;

type B = burn_cuda::Cuda<f32, i32>;

/// Options (`prefill_steps`, `prefill_batch`, `prefill_chunks`, `prefill_reps`, the prefix
/// already stripped).
#[derive(Debug, Clone)]
pub struct PrefillBench {
    /// Frames of the pass (a 1,024-token pass of the 0.9B: 16,384).
    pub steps: usize,
    pub batch: usize,
    /// Steps per chunk of the cut runs (0 also runs: one walk).
    pub chunks: Vec<usize>,
    pub reps: usize,
}

impl PrefillBench {
    pub fn model_0_9b() -> Self {
        PrefillBench {
            steps: 16384,
            batch: 1,
            chunks: vec![256, 512, 1024],
            reps: 10,
        }
    }

    /// `steps=`, `batch=`, `reps=`, `chunks=A/B/…`.
    pub fn with_options(mut self, options: &str) -> Result<Self, KernelError> {
        let num = |k: &str, v: &str| {
            v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                KernelError::InvalidOption(format!(
                    "prefill_{k}: `{v}` is not a positive whole number"
                ))
            })
        };
        for kv in option_items(options) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                KernelError::InvalidOption(format!("`prefill_{kv}` is not key=value"))
            })?;
            match k {
                "steps" => self.steps = num(k, v)?,
                "batch" => self.batch = num(k, v)?,
                "reps" => self.reps = num(k, v)?,
                "chunks" => {
                    self.chunks = v.split('/').map(|c| num(k, c)).collect::<Result<_, _>>()?
                }
                other => {
                    return Err(KernelError::InvalidOption(format!(
                        "unknown option `prefill_{other}` (prefill_steps, prefill_batch, prefill_chunks, prefill_reps)"
                    )));
                }
            }
        }
        Ok(self)
    }
}

const DN: usize = 7168;
const N: usize = 8;
const FF: usize = 2688;
const D: usize = 896;
const K: usize = 16;

/// The bits of a tensor's values as f32.
fn bits(t: Tensor<B, 2>) -> Vec<u32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Values whose bits differ between two runs' outputs and final states (`want` as [`bits`]).
fn differing(got: (Tensor<B, 2>, Tensor<B, 2>), want: &(Vec<u32>, Vec<u32>)) -> usize {
    let (out, last) = (bits(got.0), bits(got.1));
    out.iter()
        .zip(&want.0)
        .chain(last.iter().zip(&want.1))
        .filter(|(a, b)| a != b)
        .count()
}

/// Runs the checks and timings; fails when a cut run's bits differ from the one walk's.
pub fn bench(device: &CudaDevice, cfg: &PrefillBench) -> Result<String, KernelError> {
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let wrap = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let rows = cfg.steps * cfg.batch;
    let normal = |shape: [usize; 2], s: f64| {
        Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, s), device)
    };
    let bf16 = |t: Tensor<B, 2>| t.cast(DType::BF16);
    // Block scan: y = [i | r_β | r_α | r_th], biases per column, β's from 0.80 to 0.99.
    let y = bf16(normal([rows, 4 * DN], 1.0));
    let logit = |p: f64| (p / (1.0 - p)).ln();
    let b_beta: Vec<f32> = (0..DN)
        .map(|c| logit(0.80 + 0.19 * (c % N) as f64 / (N - 1) as f64) as f32)
        .collect();
    let b_beta = Tensor::<B, 1>::from_floats(b_beta.as_slice(), device).reshape([DN]);
    let b_alpha = Tensor::<B, 1>::random([DN], Distribution::Normal(0.0, 0.1), device);
    let b_th = Tensor::<B, 1>::random([DN], Distribution::Normal(0.3, 0.1), device);
    let v0 = Tensor::<B, 2>::zeros([cfg.batch, DN], device);
    let p1 = |t: &Tensor<B, 1>| t.clone().into_primitive().tensor();
    // The block scan on a named kernel (`ByShape`: as a pass of this shape runs it).
    let by = |chunk: usize, kernel: BlockScanKernel| {
        let (vpost, last) = block_scan_by(
            prim(y.clone()),
            [p1(&b_beta), p1(&b_alpha), p1(&b_th)],
            prim(v0.clone()),
            0.1,
            chunk,
            kernel,
        );
        (wrap(vpost), wrap(last))
    };
    let block = |chunk: usize| by(chunk, BlockScanKernel::ByShape);
    // FFN neurons: currents [rows, 2·D_ff], w ~ N(0, 0.5), thresholds around 0.5.
    let i_gu = bf16(normal([rows, 2 * FF], 1.0));
    let w = |s| Tensor::<B, 1>::random([FF], Distribution::Normal(0.0, s), device);
    let th = || Tensor::<B, 1>::random([FF], Distribution::Uniform(0.3, 0.7), device);
    let ffn_params = [w(0.5), w(0.5), th(), th()];
    let fv0 = Tensor::<B, 2>::zeros([cfg.batch, 2 * FF], device);
    let ffn = |chunk: usize| {
        let (gv, last) = ffn_infer_cut(
            prim(i_gu.clone()),
            ffn_params.clone().map(|t| p1(&t)),
            prim(fv0.clone()),
            true,
            chunk,
        );
        (wrap(gv), wrap(last))
    };
    // RMSNorm + input PLIF: a token's x [T, B, D], its K frames; w ~ N(0, 0.5).
    let x = Tensor::<B, 3>::random(
        [cfg.steps / K, cfg.batch, D],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let d1 = |mean: f64, s: f64| Tensor::<B, 1>::random([D], Distribution::Normal(mean, s), device);
    let norm_ins = [d1(1.0, 0.1), d1(0.0, 0.5), d1(0.5, 0.1)];
    let nv0 = Tensor::<B, 2>::zeros([cfg.batch, D], device);
    let norm = |chunk: usize| {
        let [nw, w, th] = norm_ins.clone().map(|t| p1(&t));
        let ins = [
            x.clone().into_primitive().tensor(),
            nw,
            w,
            th,
            prim(nv0.clone()),
        ];
        let (y, last) = norm_plif_cut(ins, 1e-6, K, true, false, chunk);
        let y = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(y));
        (y.reshape([cfg.steps, cfg.batch * D]), wrap(last))
    };
    let time = |f: &dyn Fn()| super::report::time::<B>(device, cfg.reps, f);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "one session's pass: {} frames × batch {} (bf16 inputs), cut in time chunks against one walk",
        cfg.steps, cfg.batch
    );
    let _ = writeln!(
        out,
        "{:<22} {:>12} {:>10} {:>9} {:>16}",
        "kernel", "chunk steps", "time (ms)", "speed-up", "bits differing"
    );
    let mut wrong = Vec::new();
    type Run<'a> = &'a dyn Fn(usize) -> (Tensor<B, 2>, Tensor<B, 2>);
    let kernels: [(&str, Run); 3] = [
        ("block scan", &block),
        ("ffn neurons", &ffn),
        ("norm + input plif", &norm),
    ];
    for (name, run) in kernels {
        let (want_out, want_last) = run(0);
        let want = (bits(want_out), bits(want_last));
        let base = time(&|| drop(run(0)));
        let _ = writeln!(
            out,
            "{name:<22} {:>12} {:>10.3} {:>9} {:>16}",
            "one walk",
            base * 1e3,
            "1.00×",
            "-"
        );
        for &chunk in &cfg.chunks {
            let differ = differing(run(chunk), &want);
            let s = time(&|| drop(run(chunk)));
            let verdict = if differ == 0 {
                "0".to_string()
            } else {
                format!("{differ}  WRONG")
            };
            if differ > 0 {
                wrong.push(format!("{name} at {chunk} steps a chunk"));
            }
            let _ = writeln!(
                out,
                "{name:<22} {chunk:>12} {:>10.3} {:>8.2}× {verdict:>16}",
                s * 1e3,
                base / s
            );
        }
    }
    // The block scan's kernels side by side at this shape, each held bit for bit against the
    // staged one: a session's bits must not depend on which kernel its cohort's size chose.
    let (want_out, want_last) = by(0, BlockScanKernel::Staged);
    let want = (bits(want_out), bits(want_last));
    let _ = writeln!(
        out,
        "block scan kernels at {} columns ({} frames × batch {}), against the staged one:",
        cfg.batch * DN,
        cfg.steps,
        cfg.batch
    );
    let bytes = (rows * 4 * DN * 2 + rows * DN * 2) as f64;
    for (name, kernel) in [
        ("staged", BlockScanKernel::Staged),
        ("wide, a column a unit", BlockScanKernel::Wide),
        ("wide, 4 columns a unit", BlockScanKernel::WideVector),
        ("staged, loads ahead", BlockScanKernel::Ahead),
    ] {
        let differ = differing(by(0, kernel), &want);
        if differ > 0 {
            wrong.push(format!("the {name} block scan"));
        }
        let s = time(&|| drop(by(0, kernel)));
        let _ = writeln!(
            out,
            "  {name:<24} {:>10.3} ms {:>8.0} GB/s (bf16 projections in, V_post out) {:>10} bits differing{}",
            s * 1e3,
            bytes / s / 1e9,
            differ,
            if differ > 0 { "  WRONG" } else { "" }
        );
    }
    if wrong.is_empty() {
        Ok(out)
    } else {
        Err(KernelError::Mismatch {
            report: format!(
                "{out}cut runs that differ from one walk: {}",
                wrong.join("; ")
            ),
        })
    }
}
