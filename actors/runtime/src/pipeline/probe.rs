//! One sequence through the layer actors for the interpretability study (`nsactor analyze`):
//! each layer's [`Probe`] call, then the edge's per-position cross entropy, with the numbers
//! copied to the host ([`SequenceProbe`]). Nothing is kept in any stage.

use super::decoder::AsyncDecoder;
use super::layers::share_layers;
use super::msg::{EdgeMsg, ask};
use super::worker::{JobPanicked, Priority};
use crate::error::RuntimeError;
use nsactor_plugin_api::{EngineError, Probe, StageCall};

/// What one layer showed of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerProbe {
    /// E[K] of every token, SNNBlock then SNNFFN.
    pub expected_k: [Vec<f32>; 2],
    /// Counts of the hidden neurons' β(t) in [`BETA_BINS`](nsactor_plugin_api::BETA_BINS)
    /// equal bins of `[0, 1]`, over the sequence's frames.
    pub beta_hist: Vec<f64>,
    /// Each hidden neuron's mean β(t) over the sequence's frames.
    pub beta_mean: Vec<f32>,
}

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
    let mut h = d.embed(ids.to_vec(), 1, t).await?;
    let holders = share_layers(&d.children().layers).await?;
    let mut layers = Vec::with_capacity(holders.len());
    for holder in holders {
        let who = holder.who.clone();
        let job = holder
            .worker
            .clone()
            .run_then(Priority::FORWARD_UNTRAINED, None, move || {
                holder.run(Some(h), |st, h| {
                    let p = Probe::try_from(st.call(StageCall::Probe {
                        h: h.expect("moved"),
                    })?)?;
                    let host = |x| holder.backend.to_host(x).map(|x| x.data);
                    let ek = host(&p.expected_k)?;
                    if ek.len() != 2 * t {
                        return Err(EngineError::Backend(format!(
                            "Probe replied {} E[K] values for 2 × {t} tokens",
                            ek.len()
                        )));
                    }
                    let layer = LayerProbe {
                        expected_k: [ek[..t].to_vec(), ek[t..].to_vec()],
                        beta_hist: host(&p.beta_hist)?.into_iter().map(f64::from).collect(),
                        beta_mean: host(&p.beta_mean)?,
                    };
                    Ok((p.h, layer))
                })
            });
        let (out, layer) = match job.await {
            Ok(r) => r.map_err(|error| RuntimeError::Stage {
                who: who.clone(),
                error,
            })?,
            Err(JobPanicked(m)) => {
                return Err(RuntimeError::Stage {
                    who,
                    error: EngineError::Panic(m),
                });
            }
        };
        h = out;
        layers.push(layer);
    }
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
