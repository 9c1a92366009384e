//! The CPU backend: NeuronSpark stages on burn-ndarray.
//!
//! Built twice from the same code: as an rlib linked into the `nsactor` binary (the embedded
//! default, so `cargo run --release -- train` works on any machine) and as the cdylib plugin
//! `libnsactor_backend_ndarray.so` loaded with `--backend ndarray`. The stages are
//! `nsactor-backend-core`'s; the PLIF scans run the exact host reference of `nsactor-kernels`.
//!
//! Depends on burn-ndarray, `nsactor-backend-core`, `nsactor-kernels` and the plugin crates.

use burn_ndarray::{NdArray, NdArrayDevice};
use nsactor_backend_core::BurnBackend;
use nsactor_plugin_api::{ComputeBackend, EngineError};

pub type Cpu = NdArray<f32>;

/// The CPU backend with its one device.
pub fn backend() -> BurnBackend<Cpu> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    BurnBackend::new(
        "ndarray",
        env!("CARGO_PKG_VERSION"),
        vec![(NdArrayDevice::Cpu, format!("cpu ({threads} threads, f32)"))],
    )
}

/// The CPU backend opened with `options`: the kernel knobs (`kernel.KEY=VALUE`, of which the
/// CPU honours `decode_fusion`; the rest tune GPU kernels and change nothing here) and the GPU
/// options a run's config may carry wherever it runs, `cache=DIR` (kernel cache) and
/// `streams=…`, which it ignores: it compiles nothing at run time and has no streams.
pub fn backend_with(options: &str) -> Result<BurnBackend<Cpu>, EngineError> {
    let items = options
        .split(',')
        .map(str::trim)
        .filter(|kv| !kv.is_empty());
    let (tuning, rest) = nsactor_plugin_api::KernelTuning::from_options(items)?;
    let other: Vec<&str> = rest
        .into_iter()
        .filter(|kv| !kv.starts_with("cache=") && !kv.starts_with("streams="))
        .collect();
    if !other.is_empty() {
        return Err(EngineError::InvalidInput(format!(
            "the ndarray backend takes no options (other than kernel.KEY=VALUE and the GPU ones it ignores: cache, streams), got `{}`",
            other.join(",")
        )));
    }
    nsactor_kernels::tuning::install(tuning)?;
    Ok(backend())
}

/// Plugin constructor ([`backend_with`]).
fn open(options: &str) -> Result<Box<dyn ComputeBackend>, EngineError> {
    Ok(Box::new(backend_with(options)?))
}

nsactor_plugin_abi::export_plugin!("ndarray", env!("CARGO_PKG_VERSION"), open);
