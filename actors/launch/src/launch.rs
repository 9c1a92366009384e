//! Opening a run: its backend, its pipeline of actors over freshly initialised or
//! checkpointed stages, its data source, and resuming from its newest checkpoint. Every
//! command that needs a model goes through here, so the sequence "open the stages with the
//! plan's placement, then start the actors with the same plan" is written once.

use nsactor_checkpoint::checkpoint;
use nsactor_checkpoint::export::{HfModel, is_hf_dir, read_hf};
use nsactor_checkpoint::source::ModelSource;
use nsactor_data::{Mode, Sampler, ShardSet, Tokenizer};
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::backend;
use nsactor_engine::config::RunConfig;
use nsactor_engine::engine::StagedModel;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{ComputeBackend, InitialWeights, OptimizerKind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The run's backend — `arg` (the command line's `--backend`), else `[backend] name`, else
/// the default — opened with the config's plugin options.
pub fn open_backend(
    cfg: &RunConfig,
    arg: Option<&str>,
) -> Result<Arc<dyn ComputeBackend>, RuntimeError> {
    let name = backend_name(cfg, arg);
    let mut options = cfg.backend.plugin_options();
    // The kernels' tuning: the knobs that differ from their defaults.
    let tuning = cfg
        .backend
        .kernel_tuning()
        .map_err(RuntimeError::Invalid)?
        .to_options();
    if !tuning.is_empty() {
        if !options.is_empty() {
            options.push(',');
        }
        options.push_str(&tuning);
    }
    // The plugins' kernel cache (the embedded CPU backend compiles nothing and ignores it).
    if name != backend::EMBEDDED
        && let Some(dir) = cfg.backend.kernel_cache()
    {
        if dir.to_string_lossy().contains([',', ' ', '\t', '\n']) {
            return Err(RuntimeError::Invalid(format!(
                "the kernel cache directory `{}` has a comma or a space; set [backend] cache_dir (or --kernel-cache) to a path without",
                dir.display()
            )));
        }
        if !options.is_empty() {
            options.push(',');
        }
        options.push_str(&format!("cache={}", dir.display()));
    }
    Ok(backend::open_with(
        &name,
        &cfg.backend.plugin_path,
        &options,
    )?)
}

/// The backend `arg` (the command line's `--backend`) names, else `[backend] name`, else the
/// default.
fn backend_name(cfg: &RunConfig, arg: Option<&str>) -> String {
    arg.map(str::to_string)
        .or_else(|| cfg.backend.name.clone())
        .unwrap_or_else(|| backend::default_name().to_string())
}

/// The backend of a training process: [`open_backend`] with the decoding GEMMs' batch
/// invariance `off` unless `[backend.kernels] batch_invariant` or `NSACTOR_BATCH_INVARIANT`
/// names it. A training process decodes one session at most (the sample after the last step),
/// so no cohort can change its logits, and the training's own GEMMs never take the invariant
/// kernels; with them on, the sample first timed the nine decoding problems' candidates, 2.1 s
/// of a run's end on a machine's first decoding (s61). `cfg` itself is left as it is: the
/// run's saved `config.toml`, which a later `serve` may read, keeps what the user wrote.
pub fn open_training_backend(
    cfg: &RunConfig,
    arg: Option<&str>,
) -> Result<Arc<dyn ComputeBackend>, RuntimeError> {
    let mut cfg = cfg.clone();
    training_kernels(&mut cfg, |name| std::env::var(name).ok());
    open_backend(&cfg, arg)
}

/// Sets `[backend.kernels] batch_invariant = "off"` where neither the table nor the variable
/// `var` reads (`NSACTOR_BATCH_INVARIANT`) names a value ([`open_training_backend`]).
fn training_kernels(cfg: &mut RunConfig, var: impl Fn(&str) -> Option<String>) {
    use nsactor_plugin_api::tuning::KNOBS;
    let key = "batch_invariant";
    let env = KNOBS
        .iter()
        .find(|k| k.key == key)
        .map(|k| k.env)
        .expect("batch_invariant is a knob");
    let in_env = var(env).is_some_and(|v| !v.trim().is_empty());
    if !in_env && !cfg.backend.kernels.contains_key(key) {
        cfg.backend.kernels.insert(key.into(), "off".into());
    }
}

/// Decoding and evaluation put each GPU's worker threads on one stream (`streams = shared`)
/// unless `[backend] streams` says otherwise. A decoding cohort runs through the edge and the
/// stages one after another anyway (the same throughput, BENCHMARKS.md), and with a stream per
/// thread the hand-offs between them race: on an H200, greedy texts of 1,024 concurrent
/// clients after a warm-up differed (15 distinct) with per-thread streams and agreed (1) with
/// one stream or with every launch blocking. The embedded backend takes no options.
///
/// With the stream shared and more than one stage, decoding steps are not captured as CUDA
/// graphs (`[backend.kernels] decode_graphs = "off"`, whatever set it): the decoder keeps a
/// cohort in flight per stage, so the edge and stage 0 (on one GPU, or every stage on one GPU)
/// submit to that stream side by side, and a capture there takes in the other thread's work
/// (measured on an H100, `bench generate --pipeline 2` on one GPU: "a write from the host on
/// the captured stream", then an illegal address in the edge's read).
fn decoding_streams(cfg: &mut RunConfig, arg: Option<&str>, stages: usize) {
    if backend_name(cfg, arg) == backend::EMBEDDED {
        return;
    }
    if cfg.backend.streams.is_none() {
        cfg.backend.streams = Some("shared".into());
    }
    let key = "decode_graphs";
    if stages > 1
        && cfg.backend.streams.as_deref() == Some("shared")
        && cfg.backend.kernels.get(key).map(String::as_str) != Some("off")
    {
        tracing::info!(
            "decoding steps run uncaptured: {stages} stages keep {stages} cohorts in flight, \
             and threads sharing a GPU's stream cannot capture one of them alone \
             ([backend] streams = \"per-thread\" captures again)"
        );
        cfg.backend.kernels.insert(key.into(), "off".into());
    }
}

/// Every one of `devices` exists on `compute`.
pub fn check_devices(
    compute: &dyn nsactor_plugin_api::ComputeBackend,
    devices: &[usize],
) -> Result<(), RuntimeError> {
    let info = compute.info();
    match devices.iter().find(|&&d| d >= info.devices.len()) {
        Some(bad) => Err(RuntimeError::Invalid(format!(
            "device {bad} does not exist: {} has {} device(s)",
            info.name,
            info.devices.len()
        ))),
        None => Ok(()),
    }
}

/// Opens `cfg`'s model on `compute` — its layers split over `[train] pipeline` stages on
/// `[train] devices` — freshly initialised from `[train] seed`, and starts the actors over it;
/// `sampler` feeds [`Pipeline::step`].
pub fn launch(
    compute: Arc<dyn ComputeBackend>,
    cfg: &RunConfig,
    optimizer: OptimizerKind,
    sampler: Option<Sampler>,
) -> Result<Pipeline, RuntimeError> {
    launch_in(compute, cfg, optimizer, sampler, None)
}

/// [`launch`] as one rank of a world of processes (`cfg.train.data_parallel` is this
/// process's share of the replicas).
pub fn launch_in(
    compute: Arc<dyn ComputeBackend>,
    cfg: &RunConfig,
    optimizer: OptimizerKind,
    sampler: Option<Sampler>,
    world: Option<Arc<nsactor_pipeline::world::WorldLink>>,
) -> Result<Pipeline, RuntimeError> {
    launch_with(
        compute,
        cfg,
        Some(optimizer),
        sampler,
        world,
        InitialWeights::Seeded,
    )
}

/// [`launch_in`] with the stages' optimizer (none for a pipeline that only serves or
/// evaluates) and first weights chosen: [`InitialWeights::Loaded`] for a pipeline whose
/// weights are loaded next ([`Pipeline::load_from`]), which then draws none.
fn launch_with(
    compute: Arc<dyn ComputeBackend>,
    cfg: &RunConfig,
    optimizer: Option<OptimizerKind>,
    sampler: Option<Sampler>,
    world: Option<Arc<nsactor_pipeline::world::WorldLink>>,
    weights: InitialWeights,
) -> Result<Pipeline, RuntimeError> {
    let devices = cfg.train.devices.clone().unwrap_or_else(|| vec![0]);
    check_devices(compute.as_ref(), &devices)?;
    // Replica 0's placement; `Pipeline::start` places the other data-parallel replicas.
    let plan = PipelinePlan::replicas(
        cfg.model.num_layers,
        cfg.train.pipeline,
        cfg.train.data_parallel,
        &devices,
    )?
    .swap_remove(0);
    let model = StagedModel::open_with(
        compute,
        &cfg.model,
        cfg.train.seed,
        optimizer,
        Some(plan.placement()),
        weights,
    )?;
    let (edge, layers) = model.open_seconds();
    nsactor_pipeline::topology::log_open_times("the stages", weights, edge, layers);
    Pipeline::start_in(model, plan, cfg.train.clone(), sampler, world)
}

/// A model on the actor pipeline, ready to serve or evaluate, with its tokenizer.
pub struct Loaded {
    pub pipeline: Pipeline,
    pub tokenizer: Arc<Tokenizer>,
    pub vocab: usize,
    /// The run's name (its directory), or the config's.
    pub name: String,
    /// The run's configuration (from the checkpoint's manifest).
    pub config: RunConfig,
}

/// Where and how to open a checkpoint for serving or evaluation.
#[derive(Debug, Clone, Default)]
pub struct CheckpointOptions {
    /// A checkpoint directory, a checkpoints root or a run directory (newest valid one), or a
    /// Hugging Face directory.
    pub checkpoint: PathBuf,
    /// The model's name to report (a Hub name); default: its directory's.
    pub name: Option<String>,
    /// Backend name or plugin path (default: the run's).
    pub backend: Option<String>,
    /// Pipeline stages (at least 1).
    pub pipeline: usize,
    /// Devices for the stages (default `[0]`).
    pub devices: Option<Vec<usize>>,
    /// tokenizer.json (default: the run's).
    pub tokenizer: Option<PathBuf>,
    /// GEMM precision (default: the run's).
    pub precision: Option<String>,
    /// Kernel cache directory (default: the run's `[backend] cache_dir`, else the user's).
    pub kernel_cache: Option<PathBuf>,
    /// A failure to inject once while decoding, to exercise recovery
    /// (`session-panic:LAYER:PASS`).
    pub inject_fault: Option<String>,
}

/// Opens the model that `o` names (a checkpoint, the newest valid one of a run, or a Hugging
/// Face directory: [`ModelSource::open`]) on the actor pipeline.
pub fn load_checkpoint(o: &CheckpointOptions) -> Result<Loaded, RuntimeError> {
    let mut source = ModelSource::open(&o.checkpoint, o.tokenizer.as_deref())?;
    let mut cfg = source.config.clone();
    let mut pipeline = serving_pipeline(&mut cfg, o)?;
    pipeline.load_from(source.weights(pipeline.num_layers() + 1))?;
    tracing::info!(
        "loaded {} ({} parameters)",
        source.origin,
        pipeline.param_count()
    );
    Ok(Loaded {
        pipeline,
        tokenizer: Arc::new(source.tokenizer),
        vocab: cfg.model.vocab_size,
        name: o.name.clone().unwrap_or(source.name),
        config: cfg,
    })
}

/// The pipeline a checkpoint is opened on for serving or evaluation: `o`'s precision set in
/// `cfg`, its backend, pipeline stages and devices, `o`'s injected fault (if any), stages
/// waiting for the checkpoint's weights (none drawn) and keeping no optimizer: the
/// checkpoint's Adam moments, twice the weights' bytes, are neither uploaded nor held.
fn serving_pipeline(cfg: &mut RunConfig, o: &CheckpointOptions) -> Result<Pipeline, RuntimeError> {
    if let Some(p) = &o.precision {
        cfg.backend.precision = Some(p.clone());
    }
    if let Some(d) = &o.kernel_cache {
        cfg.backend.cache_dir = Some(d.clone());
    }
    decoding_streams(cfg, o.backend.as_deref(), o.pipeline);
    let compute = open_backend(cfg, o.backend.as_deref())?;
    let mut run = cfg.clone();
    run.train.pipeline = o.pipeline;
    run.train.devices = o.devices.clone();
    run.train.data_parallel = 1;
    run.train.inject_fault = o.inject_fault.clone();
    launch_with(compute, &run, None, None, None, InitialWeights::Loaded)
}

/// A freshly initialised model of `config` (default: the embedded tiny one) behind a started
/// pipeline with the bundled tokenizer, for the benchmarks that need no checkpoint.
pub fn load_fresh(
    config: Option<&Path>,
    backend: Option<&str>,
    precision: Option<String>,
    pipeline: usize,
    devices: Option<&[usize]>,
) -> Result<Loaded, RuntimeError> {
    let mut cfg = RunConfig::load(config)?;
    if precision.is_some() {
        cfg.backend.precision = precision;
    }
    cfg.train.pipeline = pipeline;
    cfg.train.devices = devices.map(<[usize]>::to_vec);
    decoding_streams(&mut cfg, backend, pipeline);
    let compute = open_backend(&cfg, backend)?;
    Ok(Loaded {
        pipeline: launch(compute, &cfg, OptimizerKind::Adam, None)?,
        tokenizer: Arc::new(Tokenizer::bundled()),
        vocab: cfg.model.vocab_size,
        name: config.map_or("embedded configs/tiny.toml".into(), |p| {
            p.display().to_string()
        }),
        config: cfg,
    })
}

/// Loads the newest valid checkpoint of the run into `pipeline`; returns its step (0 when
/// there is none).
pub fn resume(
    cfg: &RunConfig,
    tok: &Tokenizer,
    pipeline: &mut Pipeline,
) -> Result<u64, RuntimeError> {
    let root = nsactor_training::train::checkpoint_root(cfg);
    let (found, skipped) = checkpoint::latest_valid(&root);
    for s in &skipped {
        tracing::warn!("{s}");
    }
    let Some(checkpoint::Loaded {
        dir,
        manifest,
        shards,
    }) = found
    else {
        // Checkpoints that were written whole (their manifest is there) and no longer read
        // back are a run's work, damaged: starting over would prune them. Only a run with
        // none, or with only writes a crash cut short (no manifest), starts from step 0.
        let whole: Vec<String> = checkpoint::list(&root)
            .into_iter()
            .filter(|(_, dir)| dir.join(checkpoint::MANIFEST).exists())
            .map(|(_, dir)| dir.display().to_string())
            .collect();
        if !whole.is_empty() {
            return Err(RuntimeError::Invalid(format!(
                "--resume: every checkpoint in {} is damaged ({}; the log says how); none was \
                 loaded and none is removed: repair or move them, or start a new run with \
                 another --out",
                root.display(),
                whole.join(", ")
            )));
        }
        tracing::warn!(
            "--resume: no valid checkpoint in {}; starting from step 0",
            root.display()
        );
        return Ok(0);
    };
    if manifest.step > cfg.train.steps {
        return Err(RuntimeError::Invalid(format!(
            "--resume: the run is at step {} ({}), past [train] steps = {}: nothing would be \
             trained, and nothing is changed; raise --steps above {} to train on, or start \
             again with --overwrite",
            manifest.step,
            dir.display(),
            cfg.train.steps,
            manifest.step
        )));
    }
    manifest.check_tokenizer(&dir, tok)?;
    pipeline.load_stages(shards)?;
    pipeline.set_position(manifest.step, manifest.data_cursor)?;
    tracing::info!("resuming from {} (step {})", dir.display(), manifest.step);
    Ok(manifest.step)
}

/// The weights a run starts from (`--init-from`): the newest valid checkpoint of a run
/// directory, checkpoints root or checkpoint directory, or a Hugging Face directory (a Hub
/// name is resolved to one before). The new run takes that model's `[model]` table (its
/// weights fix the shapes) and starts at step 0 with fresh optimizer state; [`InitFrom::load`]
/// puts the weights into the started pipeline.
pub enum InitFrom {
    Checkpoint(checkpoint::Loaded),
    /// A Hugging Face directory: its path and its model as read.
    HuggingFace(PathBuf, Box<HfModel>),
}

impl InitFrom {
    /// Finds the model under `path` and sets `cfg.model` to its model; a Hugging Face
    /// model's tokenizer becomes the run's unless the run names one.
    pub fn open(path: &Path, cfg: &mut RunConfig) -> Result<Self, RuntimeError> {
        let (model, from) = if is_hf_dir(path) {
            let hf = read_hf(path)?;
            if cfg.data.tokenizer.is_none() {
                cfg.data.tokenizer = Some(path.join("tokenizer.json"));
            }
            (
                hf.model.clone(),
                InitFrom::HuggingFace(path.to_path_buf(), Box::new(hf)),
            )
        } else {
            let found = checkpoint::find_checkpoint(path)?;
            let source =
                RunConfig::from_str(&found.manifest.config, &found.dir.display().to_string())?;
            (source.model, InitFrom::Checkpoint(found))
        };
        if model != cfg.model {
            tracing::info!(
                "--init-from: the model is {}'s (its [model] table replaces this run's)",
                path.display()
            );
        }
        cfg.model = model;
        Ok(from)
    }

    /// Loads the weights into `pipeline` (started from the configuration [`InitFrom::open`]
    /// set) after checking the model was trained with `tok`.
    pub fn load(self, tok: &Tokenizer, pipeline: &mut Pipeline) -> Result<(), RuntimeError> {
        let (dir, step) = match self {
            InitFrom::Checkpoint(checkpoint::Loaded {
                dir,
                manifest,
                shards,
            }) => {
                manifest.check_tokenizer(&dir, tok)?;
                pipeline.load_stages(shards)?;
                (dir, manifest.step)
            }
            InitFrom::HuggingFace(dir, hf) => {
                if hf.tokenizer.hash() != tok.hash() {
                    return Err(RuntimeError::Invalid(format!(
                        "--init-from: {} was trained with its own tokenizer.json, not this run's \
                         (leave [data].tokenizer unset to use the model's)",
                        dir.display()
                    )));
                }
                // Every stage reads its own tensors from the one weights file.
                let stages = pipeline.num_layers() + 1;
                let one = Arc::new(hf.weights);
                pipeline.load_shared(vec![one; stages]).map_err(|e| {
                    if !e.refuses_input() {
                        return e;
                    }
                    RuntimeError::Weights(format!(
                        "--init-from: the weights in {} do not load into the model its \
                             config.json describes: {e}",
                        dir.display()
                    ))
                })?;
                (dir, 0)
            }
        };
        tracing::info!(
            "initialised from {} (its step {step}); this run starts at step 0 with fresh optimizer state",
            dir.display()
        );
        Ok(())
    }
}

/// The batch source of a run: prepared shards, corpus files, or the bundled corpus; SFT rows
/// from conversation files with `--sft --corpus`.
pub fn make_sampler(
    cfg: &RunConfig,
    tok: &Tokenizer,
    corpus: &[PathBuf],
    data: Option<&Path>,
    sft: bool,
) -> Result<Sampler, RuntimeError> {
    let (seq_len, seed) = (cfg.train.seq_len, cfg.train.seed);
    let mode = if cfg.data.packing {
        Mode::Packed
    } else {
        Mode::Padded
    };
    if let Some(dir) = data {
        let shards = ShardSet::open(dir, tok, true)?;
        return Ok(Sampler::pretrain(Arc::new(shards), mode, seq_len, seed)?);
    }
    if sft && !corpus.is_empty() {
        let (sampler, report) = nsactor_data::sampler::sft_sampler(
            tok,
            corpus,
            None,
            (seq_len, cfg.data.sft_overflow),
            seed,
        )?;
        if report.unscored > 0 {
            tracing::warn!(
                "{report} ([data] sft_overflow = {:?})",
                cfg.data.sft_overflow
            );
        } else {
            tracing::info!("{report}");
        }
        return Ok(sampler);
    }
    let tokens = if corpus.is_empty() {
        let mut m = nsactor_data::MemTokens::default();
        let text = nsactor_data::bundled_corpus();
        let name = Path::new("bundled-gutenberg-en.txt");
        nsactor_data::shards::tokenize_text(tok, name, &text, &cfg.data.text_field, &mut m)?;
        m
    } else {
        nsactor_data::shards::tokenize_files(tok, corpus, &cfg.data.text_field)?
    };
    Ok(Sampler::pretrain(Arc::new(tokens), mode, seq_len, seed)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_puts_a_plugin_on_one_stream_unless_the_config_says_otherwise() {
        let base = RunConfig::load(None).unwrap();
        let mut cfg = base.clone();
        decoding_streams(&mut cfg, Some("cuda"), 1);
        assert_eq!(cfg.backend.streams.as_deref(), Some("shared"));
        assert_eq!(cfg.backend.kernels.get("decode_graphs"), None);
        let mut cfg = base.clone();
        cfg.backend.streams = Some("per-thread".into());
        decoding_streams(&mut cfg, Some("cuda"), 2);
        assert_eq!(cfg.backend.streams.as_deref(), Some("per-thread"));
        assert_eq!(cfg.backend.kernels.get("decode_graphs"), None);
        // The embedded backend takes no options at all.
        let mut cfg = base.clone();
        decoding_streams(&mut cfg, Some(backend::EMBEDDED), 2);
        assert_eq!(cfg.backend.streams, None);
        assert!(cfg.backend.kernels.is_empty());
        // Two stages on the shared stream: no captures, even where the table asked for them,
        // and the option reaches the plugin.
        let mut cfg = base;
        cfg.backend
            .kernels
            .insert("decode_graphs".into(), "on".into());
        decoding_streams(&mut cfg, Some("cuda"), 2);
        assert_eq!(cfg.backend.streams.as_deref(), Some("shared"));
        let tuning = cfg.backend.kernel_table().unwrap();
        assert!(!tuning.decode_graphs);
        assert!(
            tuning.to_options().contains("decode_graphs=off"),
            "{}",
            tuning.to_options()
        );
    }

    #[test]
    fn training_turns_batch_invariance_off_unless_the_config_or_the_environment_names_it() {
        use nsactor_plugin_api::tuning::BatchInvariance;
        let base = RunConfig::load(None).unwrap();
        let none = |_: &str| None;
        let invariance = |cfg: &RunConfig, var: &dyn Fn(&str) -> Option<String>| {
            cfg.backend
                .kernel_table()
                .unwrap()
                .with_vars(var)
                .unwrap()
                .batch_invariant
        };
        // A config whose `[backend.kernels]` names `batch_invariant = "single"`.
        let single = || {
            let mut cfg = base.clone();
            cfg.backend
                .kernels
                .insert("batch_invariant".into(), "single".into());
            cfg
        };
        // Nothing named: off.
        let mut cfg = base.clone();
        training_kernels(&mut cfg, none);
        assert_eq!(invariance(&cfg, &none), BatchInvariance::Off);
        // The file's value is kept.
        let mut cfg = single();
        training_kernels(&mut cfg, none);
        assert_eq!(invariance(&cfg, &none), BatchInvariance::Single);
        // The environment's value is kept (and still wins over the file), an empty one is none.
        let on = |n: &str| (n == "NSACTOR_BATCH_INVARIANT").then(|| "on".to_string());
        let mut cfg = base.clone();
        training_kernels(&mut cfg, on);
        assert!(!cfg.backend.kernels.contains_key("batch_invariant"));
        assert_eq!(invariance(&cfg, &on), BatchInvariance::On);
        let mut cfg = single();
        training_kernels(&mut cfg, on);
        assert_eq!(cfg.backend.kernels["batch_invariant"], "single");
        assert_eq!(invariance(&cfg, &on), BatchInvariance::On);
        let empty = |n: &str| (n == "NSACTOR_BATCH_INVARIANT").then(String::new);
        let mut cfg = base.clone();
        training_kernels(&mut cfg, empty);
        assert_eq!(invariance(&cfg, &empty), BatchInvariance::Off);
    }
}
