//! What each layer actor shows of one sequence for the interpretability study: the layers'
//! [`Probe`] calls on their workers, in order, with the numbers copied to the host
//! ([`LayerProbe`]). Nothing is kept in any stage; the decoding engine's probe adds the edge.

use super::layers::share_layers;
use super::msg::LayerMsg;
use super::worker::{JobPanicked, Priority};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{DeviceTensor, EngineError, Probe, StageCall};
use ractor::ActorRef;

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

/// `h` (one sequence of `t` tokens) through every layer's probe; the last layer's output and
/// what each layer showed.
pub async fn probe_layers(
    layers: &[ActorRef<LayerMsg>],
    mut h: DeviceTensor,
    t: usize,
) -> Result<(DeviceTensor, Vec<LayerProbe>), RuntimeError> {
    let holders = share_layers(layers).await?;
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
    Ok((h, layers))
}
