//! The CUDA backend: NeuronSpark stages on burn-cuda (CubeCL), built as the cdylib plugin
//! `libnsactor_backend_cuda.so` and loaded with `--backend cuda`.
//!
//! It compiles without a CUDA toolkit: the driver (`libcuda`), NVRTC and cuBLASLt are loaded at
//! run time, so opening the backend on a machine without an NVIDIA driver fails with a clear
//! error instead of at link time. The PLIF scans are the CubeCL kernels of `nsactor-kernels`;
//! the projection GEMMs go through cuBLASLt in the precision the `precision` option picks
//! (`fp32`, exact and the default, or `bf16` with fp32 accumulation).
//!
//! Depends on burn-cuda, cudarc (device discovery), `nsactor-backend-core`, `nsactor-kernels`
//! and the plugin crates.
//!
//! Options (`[backend]` in the run config; `--precision` on the command line; the kernel
//! knobs `kernel.KEY=VALUE` from `[backend.kernels]` and their `NSACTOR_*` variables):
//! `precision=fp32|bf16`, `streams=per-thread|shared`, and `cache=DIR`: CubeCL's compiled
//! kernels and autotune results kept in `DIR` between runs (`nsactor_kernels::cuda::cache`). `per-thread` (the default, CubeCL's
//! own) gives each worker thread its own CUDA stream and memory pool, so the stages and the edge
//! on one GPU overlap their kernels. `shared` puts every worker thread of a GPU on one stream and
//! one pool: the memory of one pool instead of one per thread, which matters when several stages
//! share a GPU (P = 4 on one H100: 32.6 GiB instead of 65.8 GiB), at the cost of that overlap
//! (1,053 instead of 1,267 tokens/s there; BENCHMARKS.md).

use burn_cuda::{Cuda, CudaDevice};
use nsactor_backend_core::{BurnBackend, TimingHooks};
use nsactor_kernels::KernelError;
use nsactor_kernels::bench::gemm::{self as kernel_bench, GemmBench};
use nsactor_kernels::cuda::precision::{GemmPrecision, set_precision};
use nsactor_plugin_api::timing::{DeviceTime, SpanKind};
use nsactor_plugin_api::{ComputeBackend, DeviceMemory, EngineError, KernelTuning};
use std::panic::{AssertUnwindSafe, catch_unwind};

pub type Gpu = Cuda<f32, i32>;

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Lists the GPUs the driver reports, or says why there are none.
fn probe(precision: GemmPrecision) -> Result<Vec<(CudaDevice, String)>, EngineError> {
    let no_driver = |why: String| {
        // cudarc lists every library name it tried: the first clause says enough.
        let why = why
            .split(" - searched for library names")
            .next()
            .unwrap_or_default();
        EngineError::Backend(format!(
            "cannot use CUDA: {why}. The cuda backend needs an NVIDIA GPU with its driver \
             (libcuda.so); on CPU-only hosts use --backend ndarray"
        ))
    };
    let count = catch_unwind(AssertUnwindSafe(cudarc::driver::CudaContext::device_count))
        .map_err(|p| no_driver(panic_text(p.as_ref())))?
        .map_err(|e| no_driver(format!("{e:?}")))?;
    if count <= 0 {
        return Err(no_driver("the driver reports no GPU".into()));
    }
    (0..count as usize)
        .map(|i| {
            let name = catch_unwind(AssertUnwindSafe(|| {
                cudarc::driver::CudaContext::new(i).and_then(|c| c.name())
            }))
            .map_err(|p| no_driver(panic_text(p.as_ref())))?
            .map_err(|e| no_driver(format!("device {i}: {e:?}")))?;
            let gemm = match precision {
                GemmPrecision::Fp32 => "f32",
                GemmPrecision::Bf16 => "f32, bf16 GEMMs",
            };
            Ok((CudaDevice::new(i), format!("cuda:{i} {name} ({gemm})")))
        })
        .collect()
}

/// How worker threads map to CUDA streams (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streams {
    Shared,
    PerThread,
}

/// The options the plugin takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub precision: GemmPrecision,
    pub streams: Streams,
    /// Directory of the kernel and autotune caches (none: CubeCL's defaults).
    pub cache: Option<std::path::PathBuf>,
    /// The kernels' tuning (`kernel.KEY=VALUE` options over the environment).
    pub tuning: KernelTuning,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            precision: GemmPrecision::Fp32,
            streams: Streams::PerThread,
            cache: None,
            // The environment's knobs, as every kernel read them before they were typed; a
            // host's `kernel.` options go over them ([`parse_options`]).
            tuning: KernelTuning::from_env().unwrap_or_default(),
        }
    }
}

/// The CUDA backend over every GPU the driver reports, with its projection GEMMs in `precision`
/// (a process-wide setting) and its threads' streams as `options.streams` says.
pub fn backend(options: Options) -> Result<BurnBackend<Gpu>, EngineError> {
    nsactor_kernels::tuning::install(options.tuning.clone())?;
    let devices = probe(options.precision)?;
    if let Some(dir) = &options.cache {
        nsactor_kernels::cuda::cache::set_dir(dir)?;
    }
    set_precision(options.precision);
    let b = BurnBackend::new("cuda", env!("CARGO_PKG_VERSION"), devices)
        .with_kernel_bench("gemm", gemm_bench)
        .with_kernel_bench("prefill", prefill_bench)
        .with_kernel_bench("chain", chain_bench)
        .with_memory(memory_report)
        .with_timing(TimingHooks {
            start: timing_start,
            report: timing_report,
        });
    Ok(match options.streams {
        Streams::Shared => b.with_enter(nsactor_kernels::cuda::device::share_stream),
        Streams::PerThread => b,
    })
}

/// `bench kernels`' GEMM part: the 0.9B projection GEMMs checked and timed in both precisions.
fn gemm_bench(device: &CudaDevice, options: &str) -> Result<String, KernelError> {
    let cfg = GemmBench::model_0_9b().with_options(options)?;
    kernel_bench::bench(device, &cfg)
}

/// `bench kernels`' prefill part: one session's long-pass scans cut in time chunks against
/// one walk, bit for bit, then timed.
fn prefill_bench(device: &CudaDevice, options: &str) -> Result<String, KernelError> {
    use nsactor_kernels::bench::prefill::{PrefillBench, bench};
    bench(device, &PrefillBench::model_0_9b().with_options(options)?)
}

/// `bench kernels`' chain part: the one-chain MMA GEMM against the decoding GEMM, bit for bit,
/// then timed.
fn chain_bench(device: &CudaDevice, options: &str) -> Result<String, KernelError> {
    use nsactor_kernels::bench::chain::{ChainBench, bench};
    bench(device, &ChainBench::model_0_9b().with_options(options)?)
}

/// `Diagnostic::Memory`: each GPU's memory in use (driver view: total − free, which includes
/// CubeCL's pools, so it is the high-water mark of what the run reserved; pools are not returned).
fn memory_report(devices: &[CudaDevice]) -> Result<Vec<DeviceMemory>, EngineError> {
    use cudarc::driver::result as drv;
    devices
        .iter()
        .map(|d| {
            nsactor_kernels::cuda::device::make_current(d.index);
            let (free, total) = drv::mem_get_info()
                .map_err(|e| EngineError::Backend(format!("cuda:{} memory: {e:?}", d.index)))?;
            Ok(DeviceMemory {
                device: d.index,
                used_bytes: (total - free) as u64,
                total_bytes: total as u64,
            })
        })
        .collect()
}

/// `Diagnostic::TimingStart`: opens a window of device timing on every GPU (CUDA events around
/// each GEMM, PLIF scan and stage call, `nsactor_kernels::cuda::timing`).
fn timing_start(devices: &[CudaDevice]) -> Result<(), EngineError> {
    Ok(nsactor_kernels::cuda::timing::start(devices)?)
}

/// `Diagnostic::TimingReport`: closes the window; one breakdown per GPU
/// (`nsactor_plugin_api::timing`).
fn timing_report(devices: &[CudaDevice]) -> Result<Vec<DeviceTime>, EngineError> {
    use nsactor_kernels::cuda::timing::{self as cuda_timing, Kind};
    let windows = cuda_timing::collect(devices)?;
    Ok(windows
        .into_iter()
        .map(|w| {
            let spans: Vec<_> = w
                .spans
                .iter()
                .map(|&(k, a, b)| {
                    let k = match k {
                        Kind::Gemm => SpanKind::Gemm,
                        Kind::Scan => SpanKind::Scan,
                        Kind::Call(name) => SpanKind::Call(name),
                    };
                    (k, a, b)
                })
                .collect();
            DeviceTime::from_spans(w.device, w.seconds, &spans)
        })
        .collect())
}

/// Parses the plugin options: `precision=fp32|bf16` (default fp32), `streams=per-thread|shared`
/// (default per-thread), `cache=DIR`, and the kernel knobs `kernel.KEY=VALUE` (over the
/// environment's, [`KernelTuning::from_options`]).
fn parse_options(options: &str) -> Result<Options, EngineError> {
    let mut o = Options::default();
    let unknown = |kv: &str| {
        EngineError::InvalidInput(format!(
            "the cuda backend does not take the option `{kv}` (it takes precision=fp32|bf16, \
             streams=shared|per-thread, cache=DIR, kernel.KEY=VALUE)"
        ))
    };
    let (tuning, rest) =
        KernelTuning::from_options(nsactor_kernels::options::option_items(options))?;
    o.tuning = tuning;
    for kv in rest {
        match kv.split_once('=') {
            Some(("precision", v)) => {
                o.precision = GemmPrecision::parse(v)
                    .map_err(|e| EngineError::InvalidInput(format!("cuda backend: {e}")))?
            }
            Some(("streams", "shared")) => o.streams = Streams::Shared,
            Some(("streams", "per-thread")) => o.streams = Streams::PerThread,
            Some(("cache", dir)) if !dir.is_empty() => o.cache = Some(dir.into()),
            _ => return Err(unknown(kv)),
        }
    }
    Ok(o)
}

/// Plugin constructor.
fn open(options: &str) -> Result<Box<dyn ComputeBackend>, EngineError> {
    Ok(Box::new(backend(parse_options(options)?)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_pick_the_precision_and_unknown_options_are_refused() {
        let (parsed, default) = (parse_options("").unwrap(), Options::default());
        assert_eq!(
            (parsed.precision, parsed.streams, parsed.cache),
            (default.precision, default.streams, default.cache)
        );
        assert_eq!(parse_options("").unwrap().streams, Streams::PerThread);
        assert_eq!(
            parse_options("precision=bf16").unwrap().precision,
            GemmPrecision::Bf16
        );
        assert_eq!(
            parse_options(" precision=fp32 ").unwrap().precision,
            GemmPrecision::Fp32
        );
        assert_eq!(
            parse_options("precision=bf16,streams=shared").unwrap(),
            Options {
                precision: GemmPrecision::Bf16,
                streams: Streams::Shared,
                cache: None,
                tuning: KernelTuning::from_env().unwrap_or_default(),
            }
        );
        let o = parse_options("kernel.scan_cube=64,precision=bf16").unwrap();
        assert_eq!((o.tuning.scan_cube, o.precision), (64, GemmPrecision::Bf16));
        let e = parse_options("kernel.scan_cube=0").unwrap_err().to_string();
        assert!(
            e.contains("kernel.scan_cube=0") && e.contains("1 to 1024"),
            "{e}"
        );
        assert_eq!(
            parse_options("cache=/var/cache/nsactor").unwrap().cache,
            Some("/var/cache/nsactor".into())
        );
        assert!(parse_options("cache=").is_err());
        let e = parse_options("streams=2").unwrap_err().to_string();
        assert!(e.contains("streams=2") && e.contains("per-thread"), "{e}");
        let e = parse_options("precision=fp8").unwrap_err().to_string();
        assert!(e.contains("fp8"), "{e}");
        let e = parse_options("threads=4").unwrap_err().to_string();
        assert!(e.contains("threads=4") && e.contains("precision"), "{e}");
    }
}

nsactor_plugin_abi::export_plugin!("cuda", env!("CARGO_PKG_VERSION"), open);
