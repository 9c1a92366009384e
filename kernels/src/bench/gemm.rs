//! `bench kernels`' GEMM part on CUDA: each projection GEMM of the 0.9B layer checked against
//! cubek's naive fp32 kernel ([`crate::cuda::naive`]), then timed in both precisions.

use crate::KernelError;
use crate::cuda::gemm::{gemm_with, prepare_operands, run};
use crate::cuda::naive::matmul_naive;
use crate::cuda::precision::GemmPrecision;
use crate::options::option_items;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;

type CudaTensor = CubeTensor<CudaRuntime>;

/// The projection GEMMs of one 0.9B layer (`y = x · Wᵀ`, weight `[out, in]`), by name, `in`
/// and `out` features.
const PROJECTIONS: [(&str, usize, usize); 5] = [
    ("block in (W_in, W_β, W_α, W_th)", 896, 7168),
    ("block out (W_out)", 7168, 896),
    ("block gate/skip", 896, 896),
    ("ffn gate+up", 896, 5376),
    ("ffn down", 2688, 896),
];

/// Options of the GEMM benchmark (`gemm_rows`, `gemm_reps`, `gemm_precision` in
/// `nsactor bench kernels --options`).
#[derive(Debug, Clone)]
pub struct GemmBench {
    /// Rows of the activations: `T·K·B` (0.9B: 511·16·4 = 32704).
    pub rows: usize,
    pub reps: usize,
    pub precisions: Vec<GemmPrecision>,
}

impl GemmBench {
    pub fn model_0_9b() -> Self {
        GemmBench {
            rows: 32704,
            reps: 10,
            precisions: vec![GemmPrecision::Bf16, GemmPrecision::Fp32],
        }
    }

    /// `rows=`, `reps=`, `precision=bf16|fp32|both` (the `gemm_` prefix already stripped).
    pub fn with_options(mut self, options: &str) -> Result<Self, KernelError> {
        for kv in option_items(options) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                KernelError::InvalidOption(format!("`gemm_{kv}` is not key=value"))
            })?;
            let num = || -> Result<usize, KernelError> {
                v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                    KernelError::InvalidOption(format!(
                        "gemm_{k}: `{v}` is not a positive whole number"
                    ))
                })
            };
            match k {
                "rows" => self.rows = num()?,
                "reps" => self.reps = num()?,
                "precision" => {
                    self.precisions = match v {
                        "both" => vec![GemmPrecision::Bf16, GemmPrecision::Fp32],
                        p => vec![GemmPrecision::parse(p)?],
                    }
                }
                other => {
                    return Err(KernelError::InvalidOption(format!(
                        "unknown option `gemm_{other}` (gemm_rows, gemm_reps, gemm_precision)"
                    )));
                }
            }
        }
        Ok(self)
    }
}

/// Largest accepted `max|gemm − naive fp32| / max|naive fp32|`: fp32 differs only in summation
/// order; bf16 rounds each input to 8 mantissa bits (relative 2⁻⁹ per input).
fn tolerance(p: GemmPrecision) -> f32 {
    match p {
        GemmPrecision::Fp32 => 1e-5,
        GemmPrecision::Bf16 => 2e-2,
    }
}

/// Checks each projection GEMM of the 0.9B layer (forward `x·Wᵀ`, `∂x = g·W`, `∂W = xᵀ·g`, in
/// the layouts autodiff hands them over) against cubek's naive fp32 kernel on the device, then
/// times the ones that agree. A GEMM that disagrees is reported and not timed.
pub fn bench(device: &CudaDevice, cfg: &GemmBench) -> Result<String, KernelError> {
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use std::fmt::Write;
    type B = burn_cuda::Cuda<f32, i32>;
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let wrap = |t: CudaTensor| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let sync = || <B as burn::tensor::backend::Backend>::sync(device).expect("device sync");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<9} {:>4} {:>22} {:>11} {:>10} {:>9} {:>10}",
        "GEMM (0.9B layer, M = rows)",
        "product",
        "prec",
        "M×K×N",
        "max rel err",
        "time (ms)",
        "TFLOP/s",
        "GEMM only"
    );
    let mut failed = Vec::new();
    let m = cfg.rows;
    for (name, inf, outf) in PROJECTIONS {
        let x = Tensor::<B, 2>::random([m, inf], Distribution::Normal(0.0, 1.0), device);
        let w = Tensor::<B, 2>::random([outf, inf], Distribution::Normal(0.0, 1.0), device)
            .div_scalar((inf as f32).sqrt());
        let g = Tensor::<B, 2>::random([m, outf], Distribution::Normal(0.0, 1.0), device);
        // (label, lhs, rhs, M, K, N) in the layouts the model and its backward use.
        let products = [
            ("x·Wᵀ", x.clone(), w.clone().transpose(), m, inf, outf),
            ("∂x=g·W", g.clone(), w.clone(), m, outf, inf),
            ("∂W=xᵀ·g", x.clone().transpose(), g.clone(), inf, m, outf),
        ];
        for (label, lhs, rhs, pm, pk, pn) in products {
            let want = wrap(matmul_naive(prim(&lhs), prim(&rhs)));
            let scale = want.clone().abs().max().into_scalar();
            for &p in &cfg.precisions {
                let got = wrap(gemm_with(p, prim(&lhs), prim(&rhs)));
                let err = (got - want.clone()).abs().max().into_scalar() / scale.max(1e-30);
                let dims = format!("{pm}×{pk}×{pn}");
                if err.is_nan() || err > tolerance(p) {
                    let _ = writeln!(
                        out,
                        "{name:<32} {label:<9} {:>4} {dims:>22} {err:>11.2e}  WRONG: differs from the naive fp32 GEMM; not timed",
                        p.name()
                    );
                    failed.push(format!("{name} {label} {}", p.name()));
                    continue;
                }
                let time = |f: &dyn Fn()| {
                    f();
                    sync();
                    let t = std::time::Instant::now();
                    for _ in 0..cfg.reps {
                        f();
                    }
                    sync();
                    t.elapsed().as_secs_f64() / cfg.reps as f64
                };
                let s = time(&|| {
                    let _ = gemm_with(p, prim(&lhs), prim(&rhs));
                });
                let ready = prepare_operands(p, prim(&lhs), prim(&rhs));
                let s_gemm = time(&|| {
                    let _ = run(&ready);
                });
                drop(ready);
                let flops = 2.0 * pm as f64 * pk as f64 * pn as f64;
                let _ = writeln!(
                    out,
                    "{name:<32} {label:<9} {:>4} {dims:>22} {err:>11.2e} {:>10.3} {:>9.1} {:>10.1}",
                    p.name(),
                    s * 1e3,
                    flops / s / 1e12,
                    flops / s_gemm / 1e12
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "(time and TFLOP/s include rounding both f32 operands to bf16; `GEMM only` times the cuBLASLt call on operands already in its input type; fp32 never uses TF32)"
    );

    if failed.is_empty() {
        Ok(out)
    } else {
        Err(KernelError::Mismatch {
            report: format!("{out}wrong GEMMs: {}", failed.join("; ")),
        })
    }
}
