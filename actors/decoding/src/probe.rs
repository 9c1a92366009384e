//! One sequence through the layer actors for the interpretability study (`nsactor analyze`):
//! each layer's `Probe` call (`nsactor_pipeline::probe`), then the edge's per-position cross entropy, with the numbers
//! copied to the host ([`SequenceProbe`]). Nothing is kept in any stage.

use super::decoder::AsyncDecoder;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::msg::{EdgeMsg, ask};
pub use nsactor_pipeline::probe::LayerProbe;
use nsactor_pipeline::probe::probe_layers;
use nsactor_plugin_api::EngineError;

/// What the model showed of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceProbe {
    /// One per layer, in order.
    pub layers: Vec<LayerProbe>,
    /// `−ln p(ids[t + 1])` at every position `t` but the last (nats).
    pub surprisal: Vec<f32>,
}

/// `ids` (one sequence, at least one token) through every layer and the edge.
pub(crate) async fn probe_sequence(
    d: &AsyncDecoder,
    ids: &[i64],
) -> Result<SequenceProbe, RuntimeError> {
    let t = ids.len();
    if t == 0 {
        return Err(
            EngineError::InvalidInput("an empty sequence has nothing to probe".into()).into(),
        );
    }
    let h = d.embed(ids.to_vec(), 1, t).await?;
    let (h, layers) = probe_layers(&d.children().layers, h, t).await?;
    let targets: Vec<i64> = ids[1..].iter().copied().chain([0]).collect();
    let mut surprisal = ask(&d.children().edge, "edge", |reply| EdgeMsg::TokenLosses {
        h,
        targets,
        reply,
    })
    .await?;
    surprisal.truncate(t - 1);
    Ok(SequenceProbe { layers, surprisal })
}
