//! The persistent caches of a process's CUDA work, in one directory: CubeCL's compiled kernels
//! (each kernel's machine code, CUBIN, keyed by its stable hash, per architecture:
//! `<dir>/cubecl/cuda-sm90/…`) and its autotune results
//! (`<dir>/cubecl/autotune`), so a restarted server or run skips compilation and tuning. The
//! driver's own cache of PTX compiled to machine code is `$CUDA_CACHE_PATH` (the driver's
//! default `~/.nv/ComputeCache` otherwise).
//!
//! CubeCL reads its configuration once per process, on first use: [`set_dir`] must come
//! before the first kernel (the plugin calls it when it is opened).

use crate::KernelError;
use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use std::path::{Path, PathBuf};

/// Where the caches under `dir` go.
pub fn cubecl_dir(dir: &Path) -> PathBuf {
    dir.join("cubecl")
}

/// The directory [`set_dir`] was given in this process (other caches of ours live under it).
pub(crate) fn dir() -> Option<&'static Path> {
    DIR.get().map(PathBuf::as_path)
}

static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Points CubeCL's kernel and autotune caches at `dir` (created if missing), keeping the rest
/// of its configuration (`cubecl.toml`, `CUBECL_*`). Fails if `dir` cannot be created, or if
/// CubeCL was configured already in this process with other caches.
pub fn set_dir(dir: &Path) -> Result<(), KernelError> {
    let root = cubecl_dir(dir);
    std::fs::create_dir_all(&root).map_err(|e| {
        KernelError::InvalidOption(format!(
            "the kernel cache directory {} cannot be created: {e}",
            root.display()
        ))
    })?;
    let wanted = CacheConfig::File(root.clone());
    if CubeClRuntimeConfig::storage().lock().is_some() {
        let now = CubeClRuntimeConfig::get();
        let same = |c: &CacheConfig| matches!(c, CacheConfig::File(p) if *p == root);
        if now.compilation.cache.as_ref().is_some_and(same) && same(&now.autotune.cache) {
            let _ = DIR.set(dir.to_path_buf());
            return Ok(());
        }
        return Err(KernelError::Misuse(format!(
            "CubeCL is configured already in this process; the kernel cache {} cannot apply",
            root.display()
        )));
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = Some(wanted.clone());
    config.autotune.cache = wanted;
    CubeClRuntimeConfig::set(config);
    let _ = DIR.set(dir.to_path_buf());
    Ok(())
}
