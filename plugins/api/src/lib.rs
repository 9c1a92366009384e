//! The burn-free contract between the nsactor runtime and its compute backends.
//!
//! Both sides depend on this crate and nothing else of each other: the runtime (`actors`) drives
//! an engine through [`TrainEngine`]; a backend (`backends/*`) implements it. Only plain Rust
//! values cross — token ids, scalars, hyperparameters, paths — never tensors, so the same trait
//! can later be carried across the versioned C ABI of a loaded plugin (DESIGN "The seams",
//! points 2 and 3). [`ABI_VERSION`] names the revision of this contract.
//!
//! Depends on nothing but `std`.

use std::fmt;
use std::path::Path;

/// Revision of the engine contract; bumped on any incompatible change.
pub const ABI_VERSION: u32 = 1;

/// One micro-batch of token ids, row-major `[batch, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    /// Model inputs.
    pub inputs: Vec<i64>,
    /// Shifted targets (`inputs[t + 1]`); id 0 is padding and never scored.
    pub targets: Vec<i64>,
    /// 1.0 where a target counts toward the loss.
    pub loss_mask: Vec<f32>,
}

impl Batch {
    /// Checks the three arrays agree with `batch × seq_len`.
    pub fn validate(&self) -> Result<(), EngineError> {
        let n = self.batch * self.seq_len;
        if n == 0 || self.inputs.len() != n || self.targets.len() != n || self.loss_mask.len() != n
        {
            return Err(EngineError::InvalidInput(format!(
                "batch {}×{} needs {n} inputs, targets and mask values; got {}, {}, {}",
                self.batch,
                self.seq_len,
                self.inputs.len(),
                self.targets.len(),
                self.loss_mask.len()
            )));
        }
        Ok(())
    }
}

/// Hyperparameters of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepParams {
    /// Base learning rate at this step.
    pub lr: f64,
    /// Learning rate of the neuron parameter group.
    pub neuron_lr: f64,
    /// λ of the ponder cost.
    pub ponder_weight: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
}

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Total loss (masked CE + λ·ponder), averaged over the accumulated micro-batches.
    pub loss: f64,
    /// Masked mean cross entropy, averaged over the micro-batches.
    pub ce: f64,
    /// Mean E[K] over layers and tokens (the ponder cost), averaged over the micro-batches.
    pub expected_k: f64,
    /// Global gradient norm after natural-gradient compensation, before clipping.
    pub grad_norm: f64,
    /// Loss-mask tokens in the step.
    pub tokens: u64,
}

/// Errors an engine reports; each carries a message that says what to do.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineError {
    InvalidInput(String),
    Io(String),
    Backend(String),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            EngineError::Io(m) => write!(f, "I/O: {m}"),
            EngineError::Backend(m) => write!(f, "backend: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}

/// A whole-model training engine: owns parameters and optimizer state on its device.
pub trait TrainEngine: Send {
    /// Backend name and device, for logs (e.g. `ndarray (cpu)`).
    fn describe(&self) -> String;
    /// Number of trainable parameters.
    fn param_count(&self) -> usize;
    /// Forward + backward over every micro-batch (gradients accumulated as a mean), then
    /// natural-gradient compensation, global clipping and one optimizer step.
    fn train_step(
        &mut self,
        micro_batches: &[Batch],
        params: &StepParams,
    ) -> Result<StepStats, EngineError>;
    /// Loss on a batch without updating anything.
    fn eval_loss(&mut self, batch: &Batch, ponder_weight: f64) -> Result<f64, EngineError>;
    /// Greedy continuation of `prompt` by `max_new_tokens`.
    fn generate_greedy(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
    ) -> Result<Vec<i64>, EngineError>;
    /// Writes the parameters as safetensors under the reference names.
    fn save_weights(&self, path: &Path) -> Result<(), EngineError>;
    /// Reads parameters written by [`save_weights`](Self::save_weights) (or an HF export).
    fn load_weights(&mut self, path: &Path) -> Result<(), EngineError>;
}
