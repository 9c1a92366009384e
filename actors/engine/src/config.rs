//! Run configuration: a TOML file with a `[model]` table (the shared [`ModelConfig`], read by
//! `nsactor-model-config`), a `[train]` table (validated here) and optional `[backend]` and
//! `[data]` tables, layered with config-rs: defaults ← the file ← `NSACTOR_TABLE__KEY`
//! environment variables ([`EnvLayer`]) ← command-line flags ([`Overrides`]). Unknown tables
//! and keys are errors naming their path.

use crate::error::RuntimeError;
pub use crate::schedule::{DpReduce, Schedule};
pub use nsactor_model_config::{ModelConfig, ModelToml, from_toml_str as model_from_toml};
use nsactor_plugin_api::KernelTuning;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod backend;
mod coerce;
mod env;
mod keep;
use env::env_override;
pub use env::{ENV_PREFIX, ENV_SEPARATOR, EnvLayer};
pub use keep::KeepActivations;

/// The embedded default: `configs/tiny.toml`.
pub const DEFAULT_CONFIG: &str = include_str!("../../../configs/tiny.toml");

/// A two-layer model small enough for tests and for timing the boundary (compute per call
/// is small, so overhead shows).
pub fn tiny_model() -> ModelConfig {
    ModelConfig {
        vocab_size: 512,
        d: 64,
        n: 4,
        k: 4,
        num_layers: 2,
        d_ff: 192,
        v_th_min: 0.1,
        plif_out: nsactor_plugin_api::PlifOut::Leak,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(with = "ModelToml")]
    pub model: ModelConfig,
    pub train: TrainConfig,
    #[serde(default)]
    pub backend: BackendConfig,
    #[serde(default)]
    pub data: DataConfig,
}

/// `[backend]`: which compute backend runs the model (overridden by `--backend`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// `embedded`, a plugin name (`ndarray`, `cuda`) or a plugin library path; default:
    /// `embedded` when the binary has it, else `ndarray`.
    pub name: Option<String>,
    /// Extra directories to search for plugins, after `$NSACTOR_PLUGIN_PATH`.
    #[serde(default)]
    pub plugin_path: Vec<PathBuf>,
    /// Arithmetic of the projection GEMMs: `fp32` (exact, the default; parity with the
    /// reference) or `bf16` (bf16 inputs, fp32 accumulation; CUDA only). Master weights,
    /// optimizer state, membrane states and elementwise work stay fp32 either way.
    pub precision: Option<String>,
    /// How the CUDA plugin maps worker threads to streams: `per-thread` (its default, CubeCL's
    /// own: a stream and a memory pool per thread, so the stages and the edge on one GPU
    /// overlap) or `shared` (one stream and one pool per GPU: half the memory when several
    /// stages share a GPU, without that overlap).
    #[serde(default)]
    pub streams: Option<String>,
    /// Where a GPU backend keeps compiled kernels and autotune results between runs, so a
    /// restart skips compilation (CUDA: CubeCL's PTX and autotune caches). Default:
    /// `$XDG_CACHE_HOME/nsactor`, else `~/.cache/nsactor`; `off` keeps none. The CPU
    /// backends compile nothing and ignore it.
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// `[backend.kernels]`: the kernels' tuning knobs by key (`scan_cube = 64`,
    /// `stage_row_forward = "8x64"`; docs/CONFIG.md lists them), read into one typed
    /// [`KernelTuning`] by [`BackendConfig::kernel_tuning`]. A knob's `NSACTOR_*` variable
    /// overrides the file.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kernels: std::collections::BTreeMap<String, String>,
}

impl BackendConfig {
    /// The option string handed to the plugin when it is opened (`precision=…,streams=…`).
    pub fn plugin_options(&self) -> String {
        [
            self.precision.as_ref().map(|p| format!("precision={p}")),
            self.streams.as_ref().map(|s| format!("streams={s}")),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(",")
    }

    /// The kernels' tuning: the defaults, then `[backend.kernels]`, then the environment's
    /// knob variables. The error names the key or variable and what it takes.
    pub fn kernel_tuning(&self) -> Result<KernelTuning, String> {
        self.kernel_table()?
            .with_vars(|name| std::env::var(name).ok())
            .map_err(|e| e.to_string())
    }

    /// The defaults with `[backend.kernels]` applied: what loading a config checks (the
    /// environment's knobs are read when a backend opens).
    pub fn kernel_table(&self) -> Result<KernelTuning, String> {
        let mut t = KernelTuning::default();
        for (k, v) in &self.kernels {
            t.set(k, v)
                .map_err(|e| format!("[backend.kernels] {k}: {e}"))?;
        }
        Ok(t)
    }

    /// The kernel cache directory ([`cache_dir`](Self::cache_dir), else the user's cache
    /// directory); `None` when it is `off` or no home is known.
    pub fn kernel_cache(&self) -> Option<PathBuf> {
        match &self.cache_dir {
            Some(p) if p.as_os_str() == "off" => None,
            Some(p) => Some(p.clone()),
            None => std::env::var_os("XDG_CACHE_HOME")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|c| c.join("nsactor")),
        }
    }
}

/// `[data]`: how training rows are made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Pack documents (separated by `<|im_end|>`) into full windows; `false` is the reference's
    /// one padded document per row (SPEC §8).
    pub packing: bool,
    /// tokenizer.json of the run; default: the bundled 2048-token tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// JSON field holding the text of `.jsonl`/`.json` corpora.
    pub text_field: String,
    /// With `--sft`: what happens to a conversation whose right-truncated row scores no token
    /// (`truncate-left`, `skip`, or the reference's `keep`).
    pub sft_overflow: nsactor_data::sample::SftOverflow,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            packing: true,
            tokenizer: None,
            text_field: "text".into(),
            sft_overflow: Default::default(),
        }
    }
}

/// Values given on the command line that replace the config file's; `None` keeps the file's.
/// [`RunConfig::apply`] applies them and validates the result.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub steps: Option<u64>,
    pub out_dir: Option<PathBuf>,
    pub seed: Option<u64>,
    pub batch_size: Option<usize>,
    pub seq_len: Option<usize>,
    pub accumulation: Option<usize>,
    pub pipeline: Option<usize>,
    pub data_parallel: Option<usize>,
    pub devices: Option<Vec<usize>>,
    pub schedule: Option<Schedule>,
    pub keep_activations: Option<KeepActivations>,
    pub checkpoint_every: Option<u64>,
    pub inject_fault: Option<String>,
    pub loss_spike_factor: Option<f64>,
    pub eval_every: Option<u64>,
    pub precision: Option<String>,
    pub tokenizer: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Tokens per sequence the model sees (T).
    pub seq_len: usize,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Peak base learning rate.
    pub lr: f64,
    /// Neuron parameters train at `lr × neuron_lr_mult` (SPEC §7.1).
    pub neuron_lr_mult: f64,
    /// Linear warmup length in micro-steps (SPEC §7.2).
    pub warmup_iters: u64,
    /// The cosine decays to `lr × min_lr_ratio`.
    pub min_lr_ratio: f64,
    /// λ of the ponder cost (the released run used 0).
    pub ponder_weight: f64,
    pub max_grad_norm: f64,
    pub seed: u64,
    pub log_interval: u64,
    pub out_dir: PathBuf,
    /// Pipeline stages P (`--pipeline`): the layers split into P groups, each with its own
    /// worker thread on its device; up to P micro-batches are in flight (1F1B).
    #[serde(default = "one")]
    pub pipeline: usize,
    /// Data-parallel replicas D (`--data-parallel`): D copies of the P-stage pipeline, each
    /// running a contiguous share of the step's `accumulation` micro-batches (the global batch
    /// stays `accumulation × batch_size`); gradients are reduced across replicas before the
    /// optimizer phase, which every replica runs on the same reduced gradients.
    #[serde(default = "one")]
    pub data_parallel: usize,
    /// How replicas' gradients are summed: `ordered` (each micro-batch's gradients in
    /// micro-batch order, bit-identical to one replica, holding a gradient copy per
    /// micro-batch), `sum` (each replica sums its own, then the replica sums in replica
    /// order) or `auto` (the default: `ordered` on the CPU backend, `sum` elsewhere).
    #[serde(default)]
    pub dp_reduce: DpReduce,
    /// Micro-batch order on the stage workers: `fifo` (jobs of a class run as they arrive, at
    /// most P micro-batches in flight; bit-for-bit reproducible on the CPU backend),
    /// `depth-first` (the oldest micro-batch first, at most 2P in flight: stages of several
    /// layers overlap instead of taking turns, 1.80× on two GPUs against 1.10× for `fifo`; on
    /// multi-threaded CPU kernels the last bits of a run may vary, as concurrent reductions do)
    /// or `auto` (the default: `fifo` on the CPU backend, `depth-first` elsewhere).
    #[serde(default)]
    pub schedule: Schedule,
    /// Layers per pipeline stage, counted from its last, that keep their forward's autodiff
    /// graph until their backward instead of recomputing the forward there (`0`: every layer
    /// recomputes, i.e. activation checkpointing per layer). Each kept layer saves one forward
    /// pass per micro-batch and holds its activations meanwhile: at the 0.9B shape in bf16
    /// about 2 MB per token of the micro-batch (14–15 GiB at 14 × 511). `auto`, the default,
    /// measures the device memory the first two steps take with 1 and then 3 kept layers per
    /// stage and keeps as many as fit under [`memory_budget_gib`](Self::memory_budget_gib) from
    /// the third step on (the log says what it measured and chose); on a backend that reports
    /// no device memory (the CPU) `auto` keeps none.
    #[serde(default)]
    pub keep_activations: KeepActivations,
    /// The device memory in use (GiB per device, as the driver counts it: everything
    /// allocated on the device) that `keep_activations = "auto"` may fill, at most the
    /// device's total less a reserve (2 % of it, at least 2 GiB; that is the default). From
    /// either, the stages' parameters and optimizer state are held back again when checkpoints
    /// are written during the run (a background checkpoint holds the old values while the
    /// next step's update writes new ones).
    #[serde(default)]
    pub memory_budget_gib: Option<f64>,
    /// Devices the stages are spread over (`--devices 0,1`); default: device 0. With D
    /// replicas, D equal blocks, one per replica (`--data-parallel 2 --pipeline 2 --devices
    /// 0,1,2,3`: replica 0 on 0–1, replica 1 on 2–3), or one device for all.
    #[serde(default)]
    pub devices: Option<Vec<usize>>,
    /// Write a checkpoint every this many steps (0: only at the end of the run).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest by step number; 0 keeps all).
    #[serde(default = "three")]
    pub keep_checkpoints: usize,
    /// Recoveries from actor failures a run may make within `restart_window_s` before it gives
    /// up; also the rollbacks to one checkpoint after loss spikes ([`Self::restart_policy`]).
    #[serde(default = "three_u32")]
    pub max_restarts: u32,
    /// Seconds over which `max_restarts` counts recoveries (Erlang's restart period).
    #[serde(default = "an_hour")]
    pub restart_window_s: f64,
    /// Write checkpoints in the background: the step loop waits only for the snapshot of the
    /// stages (and for an earlier write still in flight); the files are written meanwhile.
    /// `false` writes each checkpoint before the next step. The files are the same either way.
    #[serde(default = "yes")]
    pub async_checkpoint: bool,
    /// Compile the first step's kernels while the stages are set up: a thread per device runs
    /// one layer's training step at the micro-batch's shape with the backend in compile-only
    /// mode (nothing runs; CUDA with its compile-ahead queue only), so that a process with cold
    /// kernel caches finds most of them compiled when its first step reaches them. `false`
    /// leaves every kernel to be compiled when first launched.
    #[serde(default = "yes")]
    pub prewarm: bool,
    /// Seconds a run has after SIGTERM or SIGINT to finish its step and write a checkpoint
    /// before it exits anyway (then `--resume` starts from the newest complete checkpoint).
    #[serde(default = "two_minutes")]
    pub shutdown_grace_s: f64,
    /// Seconds the end of a run keeps trying to write its final checkpoint when the write
    /// fails (a full disk, a lost mount): the trained state is still in memory, so it is read
    /// again and written again with a doubling wait (1 s up to 30 s) until this much time has
    /// passed or a signal asks it to stop. `0` gives up at the first failure.
    #[serde(default = "fifteen_minutes")]
    pub final_write_wait_s: f64,
    /// The loss-spike guard: a step whose loss exceeds this factor × the mean loss of the
    /// previous `loss_spike_window` updated steps makes no update; the run rolls back to the
    /// newest checkpoint and skips the batches from it through the offending step (PaLM's
    /// remedy; without a checkpoint only the offending batches are skipped). `0`, the default,
    /// turns the guard off; otherwise it must be > 1.
    #[serde(default)]
    pub loss_spike_factor: f64,
    /// Updated steps the loss-spike guard averages over; it judges no step before it has
    /// seen this many.
    #[serde(default = "twenty")]
    pub loss_spike_window: usize,
    /// A failure to inject once, to exercise recovery: `layer-panic:LAYER:STEP`,
    /// `session-panic:LAYER:PASS`, `crash-in-checkpoint:STEP`, `enospc-in-checkpoint:STEP`, `nan-grad:STEP` or
    /// `loss-spike:STEP` (`--inject-fault`).
    #[serde(default)]
    pub inject_fault: Option<String>,
    /// Steps between held-out evaluations (0: none). `eval_batches × batch_size` rows spread
    /// evenly over the data (before shuffling) are held out of training; every evaluation reads
    /// all of them, in the same order, and logs their cross entropy (`"event": "eval"` in
    /// `metrics.jsonl`, orange points in `loss.png`). The last step is evaluated too, and the
    /// start as [`eval_at_start`](Self::eval_at_start) says.
    #[serde(default)]
    pub eval_every: u64,
    /// Batches of `batch_size` rows in the held-out set.
    #[serde(default = "four")]
    pub eval_batches: usize,
    /// Whether a run that is not a resume evaluates before its first step. Unset: when it
    /// starts from loaded weights (`--init-from`, a fine-tune's "before"); a fresh model's
    /// cross entropy is its initialisation's (≈ ln V), and measuring it delays the first step
    /// by the evaluation and its kernels' first compile.
    #[serde(default)]
    pub eval_at_start: Option<bool>,
}

fn four() -> usize {
    4
}

fn twenty() -> usize {
    20
}

fn three_u32() -> u32 {
    3
}

fn yes() -> bool {
    true
}

fn two_minutes() -> f64 {
    120.0
}

fn fifteen_minutes() -> f64 {
    900.0
}

fn an_hour() -> f64 {
    3600.0
}

fn one() -> usize {
    1
}

fn three() -> usize {
    3
}

impl RunConfig {
    /// Replaces the values `o` sets and validates `[train]` again.
    pub fn apply(&mut self, o: &Overrides) -> Result<(), RuntimeError> {
        let t = &mut self.train;
        macro_rules! set {
            ($($field:ident => $target:expr),* $(,)?) => {
                $(if let Some(v) = &o.$field {
                    $target = v.clone().into();
                })*
            };
        }
        set! {
            steps => t.steps,
            out_dir => t.out_dir,
            seed => t.seed,
            batch_size => t.batch_size,
            seq_len => t.seq_len,
            accumulation => t.accumulation,
            pipeline => t.pipeline,
            data_parallel => t.data_parallel,
            devices => t.devices,
            schedule => t.schedule,
            keep_activations => t.keep_activations,
            checkpoint_every => t.checkpoint_every,
            inject_fault => t.inject_fault,
            loss_spike_factor => t.loss_spike_factor,
            eval_every => t.eval_every,
            precision => self.backend.precision,
            tokenizer => self.data.tokenizer,
        }
        self.train.validate("after the command-line options")?;
        self.check_toml("after the command-line options")
    }

    /// An error naming the first value TOML cannot hold (an integer past 2^63 − 1): every
    /// checkpoint's manifest stores the configuration as TOML, so such a value is refused here
    /// rather than when the first checkpoint is written.
    fn check_toml(&self, origin: &str) -> Result<(), RuntimeError> {
        let v = serde_json::to_value(self)
            .map_err(|e| RuntimeError::ConfigInvalid(origin.to_string(), e.to_string()))?;
        match coerce::past_i64_max(&v, "") {
            Some(at) => Err(RuntimeError::ConfigInvalid(
                origin.to_string(),
                format!("{at}: a configuration's integers are at most {}", i64::MAX),
            )),
            None => Ok(()),
        }
    }

    /// A config from TOML `text` alone (a checkpoint's manifest): `origin` names it in errors.
    /// The same parser as [`RunConfig::load`], without the environment layer.
    pub fn from_str(text: &str, origin: &str) -> Result<Self, RuntimeError> {
        layered(text, origin, &EnvLayer::default())
    }

    /// The run's configuration, in layers (config-rs): the defaults of each table, then the
    /// file (`path`, or the embedded `configs/tiny.toml`), then the environment's
    /// `NSACTOR_TABLE__KEY` variables ([`EnvLayer`]). Command-line flags come last
    /// ([`RunConfig::apply`]). Unknown tables and keys are errors that name their path.
    pub fn load(path: Option<&Path>) -> Result<Self, RuntimeError> {
        Self::load_with(path, &EnvLayer::from_env())
    }

    /// [`RunConfig::load`] with the environment layer given.
    pub fn load_with(path: Option<&Path>, env: &EnvLayer) -> Result<Self, RuntimeError> {
        match path {
            None => layered(DEFAULT_CONFIG, "embedded configs/tiny.toml", env),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| RuntimeError::ConfigRead(p.into(), e))?;
                layered(&text, &p.display().to_string(), env)
            }
        }
    }

    /// The configuration as TOML (what `nsactor config show` prints and every checkpoint's
    /// manifest stores).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a RunConfig serialises")
    }
}

/// Parses `text` (TOML) under the `env` layer and checks the result; `origin` names the file.
fn layered(text: &str, origin: &str, env: &EnvLayer) -> Result<RunConfig, RuntimeError> {
    let origin = match env.names()[..] {
        [] => origin.to_string(),
        ref names => format!("{origin} with ${}", names.join(", $")),
    };
    let parse = |m: String| RuntimeError::ConfigParse(origin.clone(), m);
    let mut builder = ::config::Config::builder()
        .add_source(::config::File::from_str(text, ::config::FileFormat::Toml));
    for var in &env.0 {
        builder = env_override(builder, var).map_err(|e| parse(e.to_string()))?;
    }
    let built = builder.build().map_err(|e| parse(e.to_string()))?;
    let source: Option<serde_json::Value> = built.clone().try_deserialize().ok();
    let float = |k: &str| built.get_float(k).ok();
    if let Some(at) = source.as_ref().and_then(|s| coerce::non_finite(s, &float)) {
        return Err(parse(format!("{at}: expected a finite number")));
    }
    let cfg: RunConfig = serde_path_to_error::deserialize(built).map_err(|e| {
        // The same layers through serde's own deserializer: its messages name an enum's
        // values (config-rs's name the Rust type); config-rs's where serde's pass.
        let (path, message) = source
            .as_ref()
            .and_then(|s| serde_path_to_error::deserialize::<_, RunConfig>(s).err())
            .map(|j| (j.path().to_string(), j.inner().to_string()))
            .unwrap_or_else(|| (e.path().to_string(), e.inner().to_string()));
        let message = nsactor_model_config::words::plain(&message);
        match path.as_str() {
            "." | "" => parse(message),
            _ => parse(format!("[{path}]: {message}")),
        }
    })?;
    if let (Some(source), Ok(parsed)) = (&source, serde_json::to_value(&cfg)) {
        if let Some(at) = coerce::fraction_into_integer(source, &parsed) {
            return Err(parse(format!("{at}: expected an integer")));
        }
        if let Some((at, expected)) = coerce::string_into_scalar(source, &parsed) {
            return Err(parse(format!("{at}: expected {expected}, not a string")));
        }
    }
    cfg.check_toml(&origin)?;
    if let Err(e) = cfg.model.validate() {
        let m = e.to_string().replacen("invalid input: ", "", 1);
        return Err(RuntimeError::ConfigInvalid(origin, format!("[model] {m}")));
    }
    cfg.train.validate(&origin)?;
    cfg.backend.check().map_err(parse)?;
    Ok(cfg)
}

impl TrainConfig {
    /// How often the run's actors may be recovered ([`crate::supervision`]).
    pub fn restart_policy(&self) -> crate::supervision::RestartPolicy {
        crate::supervision::RestartPolicy::new(
            self.max_restarts,
            std::time::Duration::from_secs_f64(self.restart_window_s),
        )
    }

    /// Checks the values (run again after command-line overrides); `origin` names the config
    /// in the error.
    pub fn validate(&self, origin: &str) -> Result<(), RuntimeError> {
        let bad = |m: String| RuntimeError::ConfigInvalid(origin.into(), format!("[train] {m}"));
        let positive = [
            ("steps", self.steps as usize),
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
            ("accumulation", self.accumulation),
            ("log_interval", self.log_interval as usize),
            ("pipeline", self.pipeline),
            ("data_parallel", self.data_parallel),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(bad(format!("`{name}` must be positive")));
        }
        let finite = [
            ("lr", self.lr),
            ("neuron_lr_mult", self.neuron_lr_mult),
            ("min_lr_ratio", self.min_lr_ratio),
            ("ponder_weight", self.ponder_weight),
            ("max_grad_norm", self.max_grad_norm),
            ("shutdown_grace_s", self.shutdown_grace_s),
            ("final_write_wait_s", self.final_write_wait_s),
            ("restart_window_s", self.restart_window_s),
            ("loss_spike_factor", self.loss_spike_factor),
        ];
        if let Some((name, v)) = finite.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
            return Err(bad(format!("`{name}` must be finite and ≥ 0, got {v}")));
        }
        keep::check_budget(self.memory_budget_gib).map_err(bad)?;
        if self.restart_window_s == 0.0 {
            return Err(bad("`restart_window_s` must be more than 0".into()));
        }
        if self.loss_spike_factor != 0.0 && self.loss_spike_factor <= 1.0 {
            return Err(bad(format!(
                "`loss_spike_factor` must be 0 (off) or > 1, got {}",
                self.loss_spike_factor
            )));
        }
        if self.loss_spike_window == 0 {
            return Err(bad("`loss_spike_window` must be positive".into()));
        }
        if self.eval_every > 0 && self.eval_batches == 0 {
            return Err(bad(
                "`eval_batches` must be positive when `eval_every` is set".into(),
            ));
        }
        if self.data_parallel > self.accumulation {
            return Err(bad(format!(
                "`data_parallel` {} needs at least as many micro-batches per step; \
                 `accumulation` is {}",
                self.data_parallel, self.accumulation
            )));
        }
        if let Some(f) = &self.inject_fault {
            f.parse::<crate::fault::Fault>()
                .map_err(|e| bad(format!("`inject_fault`: {e}")))?;
        }
        Ok(())
    }

    /// Learning rate at micro-step `it` (SPEC §7.2): linear warmup, then cosine from `lr` to
    /// `lr × min_lr_ratio` at `total` micro-steps, constant after.
    pub fn lr_at(&self, it: u64, total: u64) -> f64 {
        let base = self.lr;
        let floor = base * self.min_lr_ratio;
        if it < self.warmup_iters {
            return base * it as f64 / self.warmup_iters as f64;
        }
        if it > total || total <= self.warmup_iters {
            return floor;
        }
        let progress = (it - self.warmup_iters) as f64 / (total - self.warmup_iters) as f64;
        floor + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (base - floor)
    }
}

#[cfg(test)]
mod tests;
