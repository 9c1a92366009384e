#[macro_use]
extern crate derive_new;
extern crate alloc;

mod compute;
mod device;
mod runtime;

pub use device::*;

/// nsactor patch: the calling thread's compile-only flag (see `compute/server/ahead.rs`).
pub use cubecl_runtime::nsactor_compile_only;

/// nsactor patch: how much of the server thread's time kernel launches take (count and total
/// nanoseconds since the process started), for `nsactor bench decode-profile`; and, with
/// `CUBECL_COMPILE_LOG=1`, a line for each kernel compiled.
pub mod nsactor_stats {
    use core::sync::atomic::{AtomicU64, Ordering};

    static LAUNCHES: AtomicU64 = AtomicU64::new(0);
    static LAUNCH_NS: AtomicU64 = AtomicU64::new(0);

    pub(crate) fn record_launch(took: std::time::Duration) {
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        LAUNCH_NS.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// `(launches, nanoseconds)` so far.
    pub fn launches() -> (u64, u64) {
        (LAUNCHES.load(Ordering::Relaxed), LAUNCH_NS.load(Ordering::Relaxed))
    }

    /// With `CUBECL_COMPILE_LOG=1`, prints a kernel brought in on the server thread (compiled,
    /// or its PTX taken from the on-disk cache, then loaded): when, which, how long, whether the
    /// cache had it.
    pub(crate) fn record_compile(name: &str, cached: bool, took: std::time::Duration) {
        if logging() {
            let base = name.split('<').next().unwrap_or(name);
            let short = base.rsplit("::").next().unwrap_or(base);
            eprintln!(
                "{} nsactor: kernel {short} {} in {:.1} ms",
                time_of_day(),
                if cached { "loaded from the cache" } else { "compiled" },
                took.as_secs_f64() * 1e3
            );
        }
    }

    /// With `CUBECL_COMPILE_LOG=1`, prints a drain of the compile-ahead queue
    /// (`compute/server/ahead.rs`): what made it, how much waited, how long it took.
    pub(crate) fn record_drain(
        cause: &str,
        entries: usize,
        compiling: usize,
        took: std::time::Duration,
    ) {
        if logging() {
            eprintln!(
                "{} nsactor: compile-ahead queue of {entries} ({compiling} compiling) drained for {cause} in {:.1} ms",
                time_of_day(),
                took.as_secs_f64() * 1e3
            );
        }
    }

    fn logging() -> bool {
        static LOG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *LOG.get_or_init(|| std::env::var("CUBECL_COMPILE_LOG").is_ok_and(|v| v == "1"))
    }

    fn time_of_day() -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let (s, ms) = (now.as_secs() % 86_400, now.subsec_millis());
        format!("{:02}:{:02}:{:02}.{ms:03}", s / 3600, s / 60 % 60, s % 60)
    }
}
pub use runtime::*;

/// nsactor patch: CUDA graphs of a stream's work (`CudaServer::nsactor_capture_begin`).
pub use compute::CapturedGraph;

#[cfg(feature = "ptx-wmma")]
pub(crate) type WmmaCompiler = cubecl_cpp::cuda::mma::PtxWmmaCompiler;

#[cfg(not(feature = "ptx-wmma"))]
pub(crate) type WmmaCompiler = cubecl_cpp::cuda::mma::CudaWmmaCompiler;

pub mod install {
    use std::path::PathBuf;

    pub fn include_path() -> PathBuf {
        let mut path = cuda_path().expect("
        CUDA installation not found.
        Please ensure that CUDA is installed and the CUDA_PATH environment variable is set correctly.
        Note: Default paths are used for Linux (/usr/local/cuda) and Windows (C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA/), which may not be correct.
    ");
        path.push("include");
        path
    }

    pub fn cccl_include_path() -> PathBuf {
        let mut path = include_path();
        path.push("cccl");
        path
    }

    pub fn cuda_path() -> Option<PathBuf> {
        if let Ok(path) = std::env::var("CUDA_PATH") {
            return Some(PathBuf::from(path));
        }

        #[cfg(target_os = "linux")]
        {
            // If it is installed as part of the distribution
            return if std::fs::exists("/usr/local/cuda").is_ok_and(|exists| exists) {
                Some(PathBuf::from("/usr/local/cuda"))
            } else if std::fs::exists("/opt/cuda").is_ok_and(|exists| exists) {
                Some(PathBuf::from("/opt/cuda"))
            } else if std::fs::exists("/usr/bin/nvcc").is_ok_and(|exists| exists) {
                // Maybe the compiler was installed within the user path.
                Some(PathBuf::from("/usr"))
            } else {
                None
            };
        }

        #[cfg(target_os = "windows")]
        {
            return Some(PathBuf::from(
                "C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA/",
            ));
        }

        #[allow(unreachable_code)]
        None
    }
}

#[cfg(test)]
#[allow(unexpected_cfgs)]
mod tests {
    pub type TestRuntime = crate::CudaRuntime;

    pub use half::{bf16, f16};

    cubecl_core::testgen_all!(f32: [f16, bf16, f32, f64], i32: [i8, i16, i32, i64], u32: [u8, u16, u32, u64]);
    cubecl_std::testgen!();
    cubecl_std::testgen_tensor_identity!([f16, bf16, f32, u32]);
    cubecl_std::testgen_quantized_view!(f16);
}
