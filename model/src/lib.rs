//! The NeuronSpark spiking language model in burn, generic over `B: SnnOps` (any burn backend
//! with the PLIF scans of `nsactor-kernels`).
//!
//! Reference semantics live here: every formula follows `SPEC.md` (the authors' HEAD code) and is
//! checked against their golden data. Layout mirrors the reference modules — [`PlifNode`],
//! [`SnnBlock`], [`SnnFfn`], PonderAgg ([`layer::ponder_agg`]), [`SnnDecoderLayer`], the [`Edge`]
//! (embedding, decode path, tied head) — and struct fields equal checkpoint keys so reference
//! weights load by name ([`io`]). The layer-level API is what the actors use: a decoder layer's
//! [`SnnDecoderLayer::forward`] over a whole sequence of per-token `(T, B, D)` vectors, and the
//! same call with an explicit [`LayerState`] for streaming. [`train`] has the optimizer step:
//! natural-gradient compensation, clipping and Adam/AdamW with parameter groups.
//!
//! Depends on burn, `nsactor-kernels` and the step arithmetic of `nsactor-plugin-api::optim`;
//! knows nothing of actors, plugin loading or devices.

pub mod config;
pub mod edge;
pub mod generate;
pub mod init;
pub mod io;
pub mod layer;
pub mod model;
pub mod neurons;
pub mod params;
pub mod snn_block;
pub mod snn_ffn;
pub mod train;

pub use config::{ModelConfig, PlifOut};
pub use edge::Edge;
pub use layer::{LayerOutput, LayerState, SnnDecoderLayer};
pub use model::{ForwardOutput, LossOutput, ModelState, NeuronSpark};
pub use neurons::{LateralInhibition, PlifNode, RmsNorm};
pub use params::{Params, is_neuron_param, param_shapes};
pub use snn_block::SnnBlock;
pub use snn_ffn::SnnFfn;

/// Errors of this crate: bad configs, unreadable or mismatched weights, I/O.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] nsactor_model_config::ModelConfigError),
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("weights: {0}")]
    Weights(String),
    #[error("{0}: {1}")]
    Context(String, Box<ModelError>),
}

impl ModelError {
    /// Wraps the error with where it happened (a file, a section).
    pub fn context(self, ctx: &str) -> Self {
        ModelError::Context(ctx.to_string(), Box::new(self))
    }
}
