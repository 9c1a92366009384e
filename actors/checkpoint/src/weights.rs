//! Whole-model weight files built from stage shards (burn-free: safetensors bytes only).

use nsactor_engine::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

/// Prefix of optimizer-state tensors inside a stage shard.
const OPTIMIZER_PREFIX: &str = "adam.";

/// One safetensors file with every stage's parameters (optimizer state dropped), under the
/// reference names — the `model.safetensors` a run leaves behind.
pub fn merge_params<B: AsRef<[u8]>>(shards: &[B]) -> Result<Vec<u8>, RuntimeError> {
    let parsed = shards
        .iter()
        .enumerate()
        .map(|(i, b)| {
            SafeTensors::deserialize(b.as_ref())
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

pub use nsactor_plugin_api::files::write_atomic;
