//! Whole-model weight files built from stage shards (burn-free: safetensors bytes only).

use crate::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use std::io::Write;
use std::path::Path;

/// Prefix of optimizer-state tensors inside a stage shard.
const OPTIMIZER_PREFIX: &str = "adam.";

/// One safetensors file with every stage's parameters (optimizer state dropped), under the
/// reference names — the `model.safetensors` a run leaves behind.
pub fn merge_params(shards: &[Vec<u8>]) -> Result<Vec<u8>, RuntimeError> {
    let parsed = shards
        .iter()
        .enumerate()
        .map(|(i, b)| {
            SafeTensors::deserialize(b)
                .map_err(|e| RuntimeError::Weights(format!("stage shard {i}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
    for st in &parsed {
        for (name, view) in st.tensors() {
            if name.starts_with(OPTIMIZER_PREFIX) {
                continue;
            }
            if views.iter().any(|(n, _)| *n == name) {
                return Err(RuntimeError::Weights(format!(
                    "tensor `{name}` appears in two stage shards"
                )));
            }
            views.push((name, view));
        }
    }
    safetensors::serialize(views, None)
        .map_err(|e| RuntimeError::Weights(format!("serialise: {e}")))
}

/// Atomic file write: a temporary file in the same directory, fsync, rename, fsync the
/// directory. A crash leaves the old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
