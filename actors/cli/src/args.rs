//! Arguments shared by several commands: opening a model ([`ModelArgs`]: `--checkpoint`,
//! a run, a Hugging Face directory or a Hub name, and [`OpenArgs`]) and placing a model on
//! backend and devices ([`LayoutArgs`]).

use nsactor_checkpoint::hub;
use nsactor_engine::RuntimeError;
use nsactor_engine::config::{KeepActivations, Overrides};
use nsactor_launch::launch::CheckpointOptions;
use std::path::PathBuf;

/// The model a command opens (`--checkpoint`) and how ([`OpenArgs`]).
#[derive(clap::Args)]
pub struct ModelArgs {
    /// The model: a checkpoint directory, a checkpoints root, a run directory (its newest
    /// valid checkpoint), a Hugging Face directory, or a Hugging Face Hub name
    /// `owner/name[@revision]` (fetched into the Hub cache; an existing path wins).
    #[arg(long, value_name = "PATH|OWNER/NAME")]
    pub checkpoint: String,
    #[command(flatten)]
    pub open: OpenArgs,
}

impl ModelArgs {
    /// What the runtime needs to open the model.
    pub fn options(&self) -> Result<CheckpointOptions, RuntimeError> {
        self.open.options(&self.checkpoint)
    }
}

/// How a model is opened: its Hub revision, backend, stages, devices, tokenizer, precision.
#[derive(clap::Args)]
pub struct OpenArgs {
    /// Revision of a Hub model: a branch, tag or commit (default `main`; `owner/name@REV`
    /// says the same).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// Backend: `embedded`, a plugin name or a plugin path (default: the run's).
    #[arg(long)]
    pub backend: Option<String>,
    /// Pipeline stages the layers are spread over.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Devices for the stages, e.g. `0,1`.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// tokenizer.json (default: the run's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Projection GEMM arithmetic: `fp32` or `bf16` (CUDA only). Default: the run's
    /// [backend].precision.
    #[arg(long, value_parser = ["fp32", "bf16"])]
    pub precision: Option<String>,
    /// Where a GPU backend keeps compiled kernels and autotune results between runs (`off`:
    /// nowhere). Default: the run's [backend] cache_dir, else `$XDG_CACHE_HOME/nsactor` or
    /// `~/.cache/nsactor`.
    #[arg(long, value_name = "DIR")]
    pub kernel_cache: Option<PathBuf>,
}

impl OpenArgs {
    /// What the runtime needs to open `model`: resolved to a directory (a Hub name fetched
    /// into the Hub cache, see `nsactor_checkpoint::hub`).
    pub fn options(&self, model: &str) -> Result<CheckpointOptions, RuntimeError> {
        let resolved = hub::resolve(model, self.revision.as_deref())?;
        Ok(CheckpointOptions {
            name: hub::display_name(&resolved),
            checkpoint: resolved.path,
            backend: self.backend.clone(),
            pipeline: self.pipeline,
            devices: self.devices.clone(),
            tokenizer: self.tokenizer.clone(),
            precision: self.precision.clone(),
            kernel_cache: self.kernel_cache.clone(),
            inject_fault: None,
        })
    }
}

/// Where and how a model runs, shared by `train` and `bench train`; each value overrides the
/// config's.
#[derive(clap::Args)]
pub struct LayoutArgs {
    /// Compute backend: `embedded` (linked in; the default), a plugin name (`ndarray`,
    /// `cuda`) or the path of a plugin library. Overrides [backend].name.
    #[arg(long)]
    pub backend: Option<String>,
    /// Projection GEMM arithmetic: `fp32` (exact) or `bf16` (fp32 accumulation; CUDA only).
    /// Overrides [backend].precision.
    #[arg(long, value_parser = ["fp32", "bf16"])]
    pub precision: Option<String>,
    /// Pipeline stages P: layers split into P groups on their own worker threads (devices),
    /// up to P micro-batches in flight. Overrides [train].pipeline.
    #[arg(long)]
    pub pipeline: Option<usize>,
    /// Data-parallel replicas D of the P-stage pipeline, each running a contiguous share of
    /// the step's micro-batches (the global batch stays `accumulation × batch_size`).
    /// Overrides [train].data_parallel.
    #[arg(long)]
    pub data_parallel: Option<usize>,
    /// Devices to spread the stages over, e.g. `0,1`; with D replicas, D equal blocks (replica
    /// r on block r) or one device for all. Overrides [train].devices.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Layers per pipeline stage (from its last) that keep their forward's autodiff graph
    /// instead of recomputing it in the backward: faster, more memory; `auto` measures the
    /// first two steps' device memory and keeps what fits. Overrides
    /// [train].keep_activations.
    #[arg(long)]
    pub keep_activations: Option<KeepActivations>,
    /// Micro-batch order on the stage workers: `auto`, `fifo` or `depth-first` (overlaps
    /// stages of several layers; see [train].schedule). Overrides [train].schedule.
    #[arg(long, value_parser = ["auto", "fifo", "depth-first"])]
    pub schedule: Option<String>,
}

impl LayoutArgs {
    /// The config overrides these options set.
    pub fn overrides(&self) -> Result<Overrides, RuntimeError> {
        Ok(Overrides {
            pipeline: self.pipeline,
            data_parallel: self.data_parallel,
            devices: self.devices.clone(),
            keep_activations: self.keep_activations,
            precision: self.precision.clone(),
            schedule: self.schedule.as_deref().map(str::parse).transpose()?,
            ..Overrides::default()
        })
    }
}
