//! [`RuntimeError`]: the one error type of the runtime, from reading a config to a stage that
//! failed inside a pipeline step. The front ends map it to their wire (the CLI prints it, the
//! server turns it into an HTTP status in `nsactor-server`'s `error.rs`).

use nsactor_data::DataError;
use nsactor_plugin_api::EngineError;
use std::path::PathBuf;

/// Why a runtime call failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A backend or stage call failed.
    #[error("{0}")]
    Engine(#[from] EngineError),
    /// A stage call failed inside the pipeline; `who` names the actor.
    #[error("{who}: {error}")]
    Stage { who: String, error: EngineError },
    /// Reading, tokenizing or sampling the data failed.
    #[error("data: {0}")]
    Data(#[from] DataError),
    /// A config file could not be read.
    #[error("cannot read config {0}: {1}")]
    ConfigRead(PathBuf, std::io::Error),
    /// A config does not parse (unknown keys name their path).
    #[error("config {0}: {1}")]
    ConfigParse(String, String),
    /// A config parses but a value is out of range (the message names its table).
    #[error("config {0}: {1}")]
    ConfigInvalid(String, String),
    /// A checkpoint file could not be read or written.
    #[error("checkpoint {0}: {1}")]
    CheckpointIo(PathBuf, std::io::Error),
    /// A checkpoint is damaged or does not belong to this run.
    #[error("checkpoint {0}: {1}")]
    Checkpoint(PathBuf, String),
    /// A weights file (safetensors) is malformed.
    #[error("weights: {0}")]
    Weights(String),
    /// A Hugging Face directory could not be read or written (`nsactor export`/`import`).
    #[error("{0}")]
    Convert(String),
    /// A run file (metrics, plot, weights, cursor) could not be written.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// A request the runtime refuses: a device that does not exist, a tokenizer that does not
    /// fit the model or the checkpoint, an option out of range.
    #[error("{0}")]
    Invalid(String),
    /// The pipeline lost an actor and cannot continue.
    #[error("the pipeline cannot continue: {0}")]
    Broken(String),
    /// A session's work was given up because its client went away (the decoder's
    /// `give_up`): the passes not yet run for it are not.
    #[error("session {0}: given up, its client went away")]
    Cancelled(u64),
    /// The actor system itself failed (spawning, messaging).
    #[error("actor runtime: {0}")]
    Runtime(String),
    /// The step failed, the supervisor rebuilt the actors and rolled the run back to the
    /// newest checkpoint (step `to_step`); the run continues from there.
    #[error("{cause}; recovered in {seconds:.2} s, continuing after step {to_step}")]
    Recovered {
        cause: String,
        to_step: u64,
        seconds: f64,
    },
    /// Step `step` measured loss `loss`, over `factor` × the running mean `mean`: it made no
    /// update, and the run rolled back to step `to_step` (the newest checkpoint, or the step
    /// before when there is none) and skips the batches of steps `to_step + 1 ..= step`.
    #[error(
        "step {step}: loss {loss:.4} is over {factor} × the running mean {mean:.4}; rolled back \
         to step {to_step}, skipping the batches through step {step}"
    )]
    LossSpike {
        step: u64,
        loss: f64,
        mean: f64,
        factor: f64,
        to_step: u64,
    },
}

impl RuntimeError {
    /// Whether the error refuses what the run was given (its configuration, arguments, data,
    /// a checkpoint or weights that do not fit): starting the same command again fails the same
    /// way, so a supervising agent must not restart it. Device faults, lost actors, failed
    /// writes and the like are not refusals.
    pub fn refuses_input(&self) -> bool {
        let engine =
            |e: &EngineError| matches!(e, EngineError::InvalidInput(_) | EngineError::Plugin(_));
        match self {
            RuntimeError::Engine(e) | RuntimeError::Stage { error: e, .. } => engine(e),
            RuntimeError::Data(e) => e.refuses_input(),
            RuntimeError::ConfigRead(..)
            | RuntimeError::ConfigParse(..)
            | RuntimeError::ConfigInvalid(..)
            | RuntimeError::Checkpoint(..)
            | RuntimeError::Weights(_)
            | RuntimeError::Convert(_)
            | RuntimeError::Invalid(_) => true,
            RuntimeError::CheckpointIo(..)
            | RuntimeError::Io(..)
            | RuntimeError::Broken(_)
            | RuntimeError::Cancelled(_)
            | RuntimeError::Runtime(_)
            | RuntimeError::Recovered { .. }
            | RuntimeError::LossSpike { .. } => false,
        }
    }

    /// A copy of this error for each session of a failed decoding cohort: engine and stage
    /// errors exactly (the server tells a refused input from a fault by them), the rest by
    /// their message.
    pub fn for_each_session(&self) -> RuntimeError {
        match self {
            RuntimeError::Engine(e) => RuntimeError::Engine(e.clone()),
            RuntimeError::Stage { who, error } => RuntimeError::Stage {
                who: who.clone(),
                error: error.clone(),
            },
            RuntimeError::Broken(m) => RuntimeError::Broken(m.clone()),
            RuntimeError::Invalid(m) => RuntimeError::Invalid(m.clone()),
            other => RuntimeError::Runtime(other.to_string()),
        }
    }
}

impl From<RuntimeError> for EngineError {
    /// The engine error inside, or the runtime's reason as a backend error.
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Engine(e) | RuntimeError::Stage { error: e, .. } => e,
            other => EngineError::Backend(other.to_string()),
        }
    }
}

/// The runtime's results.
pub type Result<T> = std::result::Result<T, RuntimeError>;
