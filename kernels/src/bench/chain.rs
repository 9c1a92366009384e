//! `bench kernels`' `chain` part on CUDA: the one-chain MMA GEMM ([`crate::cuda::gemm_chain`])
//! held bit for bit against the batch-invariant decoding GEMM (cuBLASLt's kernel for the
//! problem's size class) at each 0.9B projection, in both weight layouts and at a decoding
//! pass's row counts, then both timed.
//!
//! This part reports and never fails: whether the chain kernel lands in the unsplit kernels'
//! bits class is the question it answers, and the decoding path takes the kernel only where the
//! answer is yes for every row.

use crate::KernelError;
use crate::cuda::gemm::{prepare_operands, run_lt};
use crate::cuda::gemm_chain::{ChainForm, WeightLayout, chain_gemm_as};
use crate::cuda::precision::GemmPrecision;
use crate::options::{decoding_gemms, option_items};
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};
use burn_cuda::CudaDevice;
use std::fmt::Write;

type B = burn_cuda::Cuda<f32, i32>;

/// A 0.9B layer's decoding projections: name, `K` (in features), `N` (out features).
const SHAPES: [(&str, usize, usize); 7] = [
    ("merged scan input", 896, 28672),
    ("merged gate/skip", 896, 1792),
    ("block out (W_out)", 7168, 896),
    ("ffn gate+up", 896, 5376),
    ("ffn down", 2688, 896),
    ("896 × 896", 896, 896),
    ("head (vocab)", 896, 6144),
];

/// Options (`chain_rows`, `chain_reps`, `chain_forms`, the prefix already stripped).
#[derive(Debug, Clone)]
pub struct ChainBench {
    /// Row counts (frame rows: one session's pass is 16).
    pub rows: Vec<usize>,
    pub reps: usize,
    /// Kernel forms to run at each problem: the first one's verdicts make the summary line.
    pub forms: Vec<ChainForm>,
}

/// A form's name in the options and the table.
fn form_name(form: ChainForm) -> &'static str {
    match form {
        ChainForm::Auto => "auto",
        ChainForm::Plain => "plain",
        ChainForm::Staged { padded: true } => "staged",
        ChainForm::Staged { padded: false } => "staged0",
    }
}

const FORMS: [ChainForm; 4] = [
    ChainForm::Auto,
    ChainForm::Plain,
    ChainForm::Staged { padded: true },
    ChainForm::Staged { padded: false },
];

impl ChainBench {
    pub fn model_0_9b() -> Self {
        ChainBench {
            rows: vec![16, 64, 256],
            reps: 200,
            forms: vec![ChainForm::Auto],
        }
    }

    /// `rows=A/B/…` (multiples of 16), `reps=`, `forms=auto/plain/staged/staged0` (`staged0`:
    /// the staged kernel's shared rows unpadded).
    pub fn with_options(mut self, options: &str) -> Result<Self, KernelError> {
        let num = |k: &str, v: &str| {
            v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                KernelError::InvalidOption(format!(
                    "chain_{k}: `{v}` is not a positive whole number"
                ))
            })
        };
        for kv in option_items(options) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                KernelError::InvalidOption(format!("`chain_{kv}` is not key=value"))
            })?;
            match k {
                "rows" => {
                    self.rows = v.split('/').map(|c| num(k, c)).collect::<Result<_, _>>()?;
                    if let Some(r) = self.rows.iter().find(|r| !r.is_multiple_of(16)) {
                        return Err(KernelError::InvalidOption(format!(
                            "chain_rows: {r} is not a multiple of 16"
                        )));
                    }
                }
                "reps" => self.reps = num(k, v)?,
                "forms" => {
                    self.forms =
                        v.split('/')
                            .map(|f| {
                                FORMS.into_iter().find(|&x| form_name(x) == f).ok_or_else(|| {
                                KernelError::InvalidOption(format!(
                                    "chain_forms: `{f}` is not auto, plain, staged or staged0"
                                ))
                            })
                            })
                            .collect::<Result<_, _>>()?;
                }
                other => {
                    return Err(KernelError::InvalidOption(format!(
                        "unknown option `chain_{other}` (chain_rows, chain_reps, chain_forms)"
                    )));
                }
            }
        }
        Ok(self)
    }
}

fn values(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

/// Compares and times each shape, layout and row count.
pub fn bench(device: &CudaDevice, cfg: &ChainBench) -> Result<String, KernelError> {
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let wrap = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let time = |f: &dyn Fn()| super::report::time::<B>(device, cfg.reps, f);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "one-chain MMA GEMM against the batch-invariant decoding GEMM (bf16 in, f32 out; host-issued times per call, {} calls)",
        cfg.reps
    );
    let _ = writeln!(
        out,
        "{:<20} {:<6} {:>5} {:>6} {:>6} {:<8} {:>14} {:>10} {:>10} {:>9} {:>10}",
        "projection",
        "weight",
        "rows",
        "K",
        "N",
        "form",
        "bits differ",
        "max |d|",
        "lt (µs)",
        "chain µs",
        "chain GB/s"
    );
    let mut classes = (0usize, 0usize);
    for (name, k, n) in SHAPES {
        for layout in [WeightLayout::KByN, WeightLayout::NByK] {
            let scale = 1.0 / (k as f64).sqrt();
            let (w, rhs) = match layout {
                WeightLayout::KByN => {
                    let w =
                        Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, scale), device)
                            .cast(DType::BF16);
                    (w.clone(), w)
                }
                WeightLayout::NByK => {
                    let w =
                        Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, scale), device)
                            .cast(DType::BF16);
                    (w.clone(), w.transpose())
                }
            };
            for &rows in &cfg.rows {
                let x = Tensor::<B, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), device)
                    .cast(DType::BF16);
                // cuBLASLt's kernel whatever `gemm_chain_rows` says.
                let lt = || {
                    decoding_gemms(|| {
                        let op = prepare_operands(
                            GemmPrecision::Bf16,
                            prim(x.clone()),
                            prim(rhs.clone()),
                        );
                        run_lt(&op)
                    })
                };
                let want = values(wrap(lt()));
                let t_lt = time(&|| drop(lt()));
                for (f, &form) in cfg.forms.iter().enumerate() {
                    let chain = || chain_gemm_as(prim(x.clone()), prim(w.clone()), layout, form);
                    let got = values(wrap(chain()));
                    let differ = want
                        .iter()
                        .zip(&got)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    let max = want
                        .iter()
                        .zip(&got)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    if f == 0 {
                        classes.0 += usize::from(differ == 0);
                        classes.1 += 1;
                    }
                    let t_chain = time(&|| drop(chain()));
                    let _ = writeln!(
                        out,
                        "{name:<20} {:<6} {rows:>5} {k:>6} {n:>6} {:<8} {:>14} {max:>10.2e} {:>10.1} {:>9.1} {:>10.0}",
                        match layout {
                            WeightLayout::KByN => "[K,N]",
                            WeightLayout::NByK => "[N,K]ᵀ",
                        },
                        form_name(form),
                        format!("{differ} of {}", want.len()),
                        t_lt * 1e6,
                        t_chain * 1e6,
                        (k * n * 2) as f64 / t_chain / 1e9
                    );
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "chain kernel ({}) in the decoding GEMM's bits class at {} of {} problems",
        form_name(cfg.forms[0]),
        classes.0,
        classes.1
    );
    Ok(out)
}
