//! The CUDA backend: NeuronSpark stages on burn-cuda (CubeCL), built as the cdylib plugin
//! `libnsactor_backend_cuda.so` and loaded with `--backend cuda`.
//!
//! It compiles without a CUDA toolkit: the driver (`libcuda`) and NVRTC are loaded at run time,
//! so opening the backend on a machine without an NVIDIA driver fails with a clear error instead
//! of at link time. Until the fused CubeCL PLIF kernels land, the scans run the exact host
//! reference of `nsactor-kernels` (correct, not fast).
//!
//! Depends on burn-cuda, cudarc (device discovery), `nsactor-backend-core`, `nsactor-kernels`
//! and the plugin crates.

use burn_cuda::{Cuda, CudaDevice};
use nsactor_backend_core::BurnBackend;
use nsactor_plugin_api::{ComputeBackend, EngineError};
use std::panic::{AssertUnwindSafe, catch_unwind};

pub type Gpu = Cuda<f32, i32>;

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Lists the GPUs the driver reports, or says why there are none.
fn probe() -> Result<Vec<(CudaDevice, String)>, EngineError> {
    let no_driver = |why: String| {
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
            Ok((CudaDevice::new(i), format!("cuda:{i} {name} (f32)")))
        })
        .collect()
}

/// The CUDA backend over every GPU the driver reports.
pub fn backend() -> Result<BurnBackend<Gpu>, EngineError> {
    Ok(BurnBackend::new(
        "cuda",
        env!("CARGO_PKG_VERSION"),
        probe()?,
    ))
}

/// Plugin constructor; the cuda backend takes no options yet.
fn open(options: &str) -> Result<Box<dyn ComputeBackend>, EngineError> {
    if !options.trim().is_empty() {
        return Err(EngineError::InvalidInput(format!(
            "the cuda backend takes no options, got `{options}`"
        )));
    }
    Ok(Box::new(backend()?))
}

nsactor_plugin_abi::export_plugin!("cuda", env!("CARGO_PKG_VERSION"), open);
