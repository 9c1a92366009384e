//! `nsactor`: train and (soon) serve NeuronSpark spiking language models.

use clap::{Parser, Subcommand};
use nsactor::backend;
use nsactor::config::RunConfig;
use nsactor::engine::{StagedModel, model_layers};
use nsactor::pipeline::{Pipeline, PipelinePlan, checkpoint};
use nsactor::train;
use nsactor_data::cli::{DataPrepareArgs, TokenizerTrainArgs};
use nsactor_data::{Mode, Sampler, ShardSet};
use nsactor_plugin_api::OptimizerKind;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "nsactor",
    version,
    about = "Train and serve NeuronSpark spiking language models"
)]
struct Cli {
    /// Log format on stderr: `human` or `json` (one object per line). Levels and targets come
    /// from $NSACTOR_LOG (tracing filter syntax, e.g. `debug` or `nsactor=debug`).
    #[arg(long, global = true, default_value = "human", value_parser = ["human", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (default: the tiny config on the bundled corpus, on CPU).
    Train(TrainArgs),
    /// List the backend plugins on the search path: name, version, ABI version, devices.
    Plugins(PluginsArgs),
    /// Benchmarks that print a figure, the device and the comparison.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Replay the reference's golden runs on a backend and check the tolerances.
    #[command(subcommand)]
    Verify(VerifyCommand),
    /// Tokenizers.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Serve a checkpoint: streaming generation over WebSocket (`/ws`) and OpenAI-style HTTP
    /// (`/v1/completions`, `/v1/chat/completions`), a chat page at `/`.
    Serve(ServeArgs),
    /// Generate from a checkpoint, streaming to stdout; `--chat` for an interactive loop.
    Generate(GenerateArgs),
    /// Held-out loss of a checkpoint: mean cross entropy and perplexity over batches of
    /// prepared shards or corpus files (e.g. the same weights with `--precision fp32` and `bf16`).
    Eval(EvalArgs),
    /// Write a checkpoint as a Hugging Face directory (config.json, model.safetensors with
    /// `model.` names, tokenizer.json).
    Export(ExportArgs),
    /// Make a run directory (config.toml, tokenizer.json, a step-0 checkpoint) from a Hugging
    /// Face directory; `nsactor train --config DIR/config.toml --resume` trains on from it.
    Import(ImportArgs),
}

#[derive(clap::Args)]
struct ModelArgs {
    /// A checkpoint directory, a checkpoints root or a run directory (newest valid checkpoint).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Backend: `embedded`, a plugin name or a plugin path (default: the run's).
    #[arg(long)]
    backend: Option<String>,
    /// Pipeline stages the layers are spread over.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Devices for the stages, e.g. `0,1`.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// tokenizer.json (default: the run's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Projection GEMM arithmetic: `fp32` or `bf16` (CUDA only). Default: the run's
    /// [backend].precision.
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
}

#[derive(clap::Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prepared shards (`nsactor data prepare`) to draw the batches from.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Corpus files instead (text, .jsonl, .json; .xz/.gz). Default: the bundled corpus.
    #[arg(long, num_args = 1..)]
    corpus: Vec<PathBuf>,
    /// Batches to average over (drawn in the run's seeded order, the same every time).
    #[arg(long, default_value_t = 8)]
    batches: usize,
    /// Sequences per batch (default: the run's batch_size).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Tokens per sequence (default: the run's seq_len).
    #[arg(long)]
    seq_len: Option<usize>,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Sessions decoding at once; more wait in the queue.
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// Requests that may wait for a session; past it the answer is "busy".
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Name reported by /v1/models (default: the checkpoint directory's name).
    #[arg(long)]
    model_name: Option<String>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (ignored with --chat).
    prompt: Option<String>,
    /// Interactive chat: each line you type is a user turn (ChatML).
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 50)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 1.1)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(clap::Args)]
struct ExportArgs {
    /// A checkpoint directory, a checkpoints root or a run directory (its newest valid
    /// checkpoint is used).
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    format: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// The run's tokenizer.json (default: the one in the checkpoint's config).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ImportArgs {
    /// A Hugging Face NeuronSpark directory.
    #[arg(long)]
    from: PathBuf,
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    format: String,
    /// The run directory to create.
    #[arg(long)]
    out: PathBuf,
    /// Backend that opens the stages to write the checkpoint.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE (NFKC, ChatML specials as ids 0–4) on corpus files.
    Train(TokenizerTrainArgs),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize corpus files into binary shards with a manifest.
    Prepare(DataPrepareArgs),
}

#[derive(Subcommand)]
enum VerifyCommand {
    /// `tiny_a`: forward, one training step (natural gradient, clip, Adam) and greedy decoding.
    TinyA(VerifyArgs),
    /// `plif_scan`: both PLIF scan variants, forward and backward, run by the backend (on the
    /// GPU for CUDA) in fp32 and with bf16 storage; prints every error and the spike agreement.
    PlifScan(VerifyScanArgs),
}

#[derive(clap::Args)]
struct VerifyScanArgs {
    /// The fixture file (`shared/fixtures/plif_scan.safetensors`).
    #[arg(long)]
    fixture: PathBuf,
    /// Backend: `embedded`, a plugin name or a plugin path.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
    /// `fp32` (the fixture README's bounds), `bf16` (bf16 storage, 1e-2 relative) or `both`.
    #[arg(long, value_parser = ["fp32", "bf16", "both"], default_value = "both")]
    precision: String,
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// The fixture file (`shared/fixtures/tiny_a.safetensors`).
    #[arg(long)]
    fixture: PathBuf,
    /// Backend: `embedded`, a plugin name or a plugin path.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
    /// Pipeline stages of the actor pipeline that runs the replay.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Devices the stages are spread over, e.g. `0,1` (default: device 0).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// GEMM arithmetic: `fp32` (the fixture's bounds) or `bf16` (bf16 inputs, fp32
    /// accumulation; CUDA only), held to 1e-2 relative with the greedy agreement reported.
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Per-call cost of the plugin boundary: the same calls through a loaded plugin and through
    /// the embedded engine.
    PluginOverhead(OverheadArgs),
    /// Cost of one actor-pipeline hop (message + worker handoff, no compute) and its share of a
    /// 0.9B layer's compute per micro-batch.
    PipelineHop(HopArgs),
    /// In-process recovery time on the tiny model, checkpoint write/read bandwidth of this
    /// disk, and what they project for the 0.9B model.
    Recovery(RecoveryArgs),
    /// Streaming server under load: time to first token, inter-token latency p50/p99 and
    /// aggregate tokens/s at several numbers of concurrent WebSocket sessions.
    Serve(ServeBenchArgs),
    /// The backend's PLIF scan kernels: each checked against the host reference (a wrong kernel
    /// is not timed), then its GB/s at the 0.9B shapes against the device's elementwise-copy
    /// bandwidth.
    Kernels(KernelsArgs),
    /// Training throughput of a config on a backend: synthetic batches of the config's shape
    /// through the actor pipeline; tokens/s, step time, model TFLOP/s and MFU, per-stage busy
    /// time, device memory.
    Train(TrainBenchArgs),
    /// Greedy decoding throughput: concurrent sessions straight on the pipeline's batched
    /// decoder (no network); prefill time, per-step latency p50/p99, aggregate tokens/s and the
    /// weight-streaming ceiling.
    Generate(GenerateBenchArgs),
    /// One decoder layer's decoding step on the backend's device without actors: the whole
    /// step, its parts, and the launch-overhead and GEMM probes that bound it.
    DecodeProfile(DecodeProfileArgs),
}

#[derive(clap::Args)]
struct DecodeProfileArgs {
    /// Backend plugin (or `embedded`).
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Projection GEMM arithmetic: fp32 or bf16 (CUDA).
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
    /// `batch=` (sessions), `reps=`, `config=tiny`.
    #[arg(long, default_value = "")]
    options: String,
}

#[derive(clap::Args)]
struct GenerateBenchArgs {
    /// Run config whose model is freshly initialised (default: the embedded configs/tiny.toml).
    #[arg(long, conflicts_with = "checkpoint")]
    config: Option<PathBuf>,
    /// A checkpoint to decode with instead of a fresh model.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Backend (default: the config's or the run's, else the embedded CPU one).
    #[arg(long)]
    backend: Option<String>,
    /// Projection GEMM arithmetic: fp32 or bf16 (CUDA).
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
    /// Concurrent sessions to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    sessions: Vec<usize>,
    /// Tokens each session generates (the first comes from the prefill).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Prompt length in tokens (a fixed synthetic prompt).
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Devices for the stages, e.g. `0,1`.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// The device's memory bandwidth in GB/s for the weight-streaming ceiling (default: H100
    /// SXM's measured copy bandwidth, 2,852).
    #[arg(long, default_value_t = 2852.0)]
    bandwidth_gbs: f64,
}

#[derive(clap::Args)]
struct TrainBenchArgs {
    /// Run config (default: the embedded configs/tiny.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Backend (default: the config's, else the embedded CPU one).
    #[arg(long)]
    backend: Option<String>,
    /// Projection GEMM arithmetic: fp32 or bf16 (CUDA). Overrides [backend].precision.
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
    /// Pipeline stages. Overrides [train].pipeline.
    #[arg(long)]
    pipeline: Option<usize>,
    /// Devices for the stages, e.g. `0,1`. Overrides [train].devices.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// Override [train].batch_size (sequences per micro-batch).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Override [train].seq_len.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Override [train].accumulation (micro-batches per step).
    #[arg(long)]
    accumulation: Option<usize>,
    /// Layers per pipeline stage (from its last) that keep their forward's autodiff graph
    /// instead of recomputing it in the backward: faster, more memory. Overrides
    /// [train].keep_activations.
    #[arg(long)]
    keep_activations: Option<usize>,
    /// Untimed steps first (kernel compilation, autotuning, pool growth).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The device's peak dense TFLOP/s for the MFU (default: H100 SXM bf16 989, fp32 67).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Skip the device-time breakdown (GEMMs, scans, other work, time outside stage calls),
    /// which brackets each GEMM, scan and stage call with device events and waits for the
    /// device between timed steps.
    #[arg(long)]
    no_breakdown: bool,
    /// Micro-batch order on the stage workers: `auto`, `fifo` or `depth-first` (overlaps
    /// stages of several layers; see [train].schedule). Overrides [train].schedule.
    #[arg(long, value_parser = ["auto", "fifo", "depth-first"])]
    schedule: Option<String>,
}

#[derive(clap::Args)]
struct KernelsArgs {
    /// Backend plugin (or `embedded`).
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Projection GEMM arithmetic of the process (CUDA): with bf16 the bf16-storage variants
    /// of the scans are checked and timed too.
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
    /// Shapes and repetitions as key=value pairs: steps (T·K), batch, elem_dim (D·N),
    /// row_dim (2·D_ff), check_steps, reps, dim (D), k (K). Default: the 0.9B shapes, 10 reps.
    #[arg(long, default_value = "")]
    options: String,
}

#[derive(clap::Args)]
struct ServeBenchArgs {
    /// Checkpoint to serve (default: the embedded tiny config, freshly initialised).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Backend (with --checkpoint: default the run's).
    #[arg(long)]
    backend: Option<String>,
    /// Concurrent sessions to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    sessions: Vec<usize>,
    /// Tokens each session generates.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
}

#[derive(clap::Args)]
struct RecoveryArgs {
    /// Scratch directory on the disk to measure (removed afterwards).
    #[arg(long, default_value = "runs/bench-recovery")]
    dir: PathBuf,
    /// Size of the synthetic checkpoint written and read back, in MB.
    #[arg(long, default_value_t = 1024)]
    size_mb: usize,
}

#[derive(clap::Args)]
struct HopArgs {
    /// Layer actors in the pipeline.
    #[arg(long, default_value_t = 20)]
    layers: usize,
    /// Pipeline stages to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pipeline: Vec<usize>,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 64)]
    micro: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 9)]
    steps: usize,
    /// Simulated device time per layer forward in µs (backward: 3×), held without using the
    /// CPU: measures the schedule's overlap and bubble instead of the hop cost.
    #[arg(long, default_value_t = 0)]
    layer_busy_us: u64,
    /// Micro-batch order on the stage workers: `auto`, `fifo` or `depth-first` (overlaps
    /// stages of several layers; see [train].schedule). Overrides [train].schedule.
    #[arg(long, value_parser = ["auto", "fifo", "depth-first"])]
    schedule: Option<String>,
}

#[derive(clap::Args)]
struct OverheadArgs {
    /// Plugin to measure (name or path).
    #[arg(long, default_value = "ndarray")]
    backend: String,
    /// Calls per timed repetition.
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

#[derive(clap::Args)]
struct PluginsArgs {
    /// Extra directory to search (repeatable), after $NSACTOR_PLUGIN_PATH.
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Run config (TOML with [model] and [train]); default: the embedded configs/tiny.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Corpus files (text, .jsonl, .json; .xz/.gz); with --sft, conversation files (alpaca,
    /// ShareGPT `conversations` or `messages`). Default: the bundled public-domain books.
    #[arg(long, num_args = 1.., conflicts_with = "data")]
    corpus: Vec<PathBuf>,
    /// Prepared shards (`nsactor data prepare`); their tokenizer must be the run's.
    #[arg(long)]
    data: Option<PathBuf>,
    /// tokenizer.json; overrides [data].tokenizer (default: the bundled tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Override [train].steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Override [train].out_dir.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override [train].seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Fine-tune with AdamW (weight decay 0.01 on the base group) instead of Adam.
    #[arg(long)]
    sft: bool,
    /// Compute backend: `embedded` (linked in; the default), a plugin name (`ndarray`,
    /// `cuda`) or the path of a plugin library. Overrides [backend].name.
    #[arg(long)]
    backend: Option<String>,
    /// Pipeline stages P: layers split into P groups on their own worker threads (devices),
    /// up to P micro-batches in flight. Overrides [train].pipeline.
    #[arg(long)]
    pipeline: Option<usize>,
    /// Devices to spread the stages over, e.g. `0,1`. Overrides [train].devices.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// Continue from the newest valid checkpoint in `<out_dir>/checkpoints` (a fresh start
    /// when there is none).
    #[arg(long)]
    resume: bool,
    /// Override [train].checkpoint_every.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Layers per pipeline stage (from its last) that keep their forward's autodiff graph
    /// instead of recomputing it in the backward: faster, more memory. Overrides
    /// [train].keep_activations.
    #[arg(long)]
    keep_activations: Option<usize>,
    /// Projection GEMM arithmetic: `fp32` (exact) or `bf16` (fp32 accumulation; CUDA only).
    /// Overrides [backend].precision.
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
    /// Micro-batch order on the stage workers: `auto`, `fifo` or `depth-first` (overlaps
    /// stages of several layers; see [train].schedule). Overrides [train].schedule.
    #[arg(long, value_parser = ["auto", "fifo", "depth-first"])]
    schedule: Option<String>,
    /// Inject one failure to exercise recovery: `layer-panic:LAYER:STEP` (the layer actor
    /// panics; the supervisor rebuilds the actors and rolls back to the newest checkpoint) or
    /// `crash-in-checkpoint:STEP` (the process aborts mid-checkpoint). Overrides
    /// [train].inject_fault.
    #[arg(long)]
    inject_fault: Option<String>,
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NSACTOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    let result = match cli.command {
        Command::Train(args) => train_cmd(args),
        Command::Plugins(args) => plugins_cmd(args),
        Command::Bench(BenchCommand::PluginOverhead(args)) => overhead_cmd(args),
        Command::Bench(BenchCommand::PipelineHop(args)) => hop_cmd(args),
        Command::Bench(BenchCommand::Recovery(args)) => recovery_cmd(args),
        Command::Bench(BenchCommand::Serve(args)) => serve_bench_cmd(args),
        Command::Bench(BenchCommand::Kernels(args)) => kernels_cmd(args),
        Command::Bench(BenchCommand::Train(args)) => train_bench_cmd(args),
        Command::Bench(BenchCommand::Generate(args)) => generate_bench_cmd(args),
        Command::Bench(BenchCommand::DecodeProfile(a)) => decode_profile_cmd(a),
        Command::Verify(VerifyCommand::TinyA(args)) => verify_cmd(args),
        Command::Verify(VerifyCommand::PlifScan(args)) => verify_scan_cmd(args),
        Command::Tokenizer(TokenizerCommand::Train(a)) => {
            nsactor_data::cli::tokenizer_train(&a).map_err(Into::into)
        }
        Command::Data(DataCommand::Prepare(a)) => {
            nsactor_data::cli::data_prepare(&a).map_err(Into::into)
        }
        Command::Serve(a) => serve_cmd(a),
        Command::Generate(a) => generate_cmd(a),
        Command::Eval(a) => eval_cmd(a),
        Command::Export(a) => {
            nsactor::export::export_hf(&a.checkpoint, &a.out, a.tokenizer.as_deref()).map(|dir| {
                println!("exported {} to {}", dir.display(), a.out.display());
            })
        }
        Command::Import(a) => backend::open(&a.backend, &[])
            .map_err(Into::into)
            .and_then(|b| nsactor::export::import_hf(&a.from, &a.out, b))
            .map(|dir| {
                println!(
                    "imported {} as {}; continue with: nsactor train --config {} --resume",
                    a.from.display(),
                    dir.display(),
                    a.out.join("config.toml").display()
                );
            }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train_cmd(args: TrainArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = RunConfig::load(args.config.as_deref())?;
    if let Some(s) = args.steps {
        cfg.train.steps = s;
    }
    if let Some(o) = args.out {
        cfg.train.out_dir = o;
    }
    if let Some(s) = args.seed {
        cfg.train.seed = s;
    }
    if let Some(p) = args.pipeline {
        cfg.train.pipeline = p;
    }
    if let Some(d) = args.devices.clone() {
        cfg.train.devices = Some(d);
    }
    if let Some(c) = args.checkpoint_every {
        cfg.train.checkpoint_every = c;
    }
    if let Some(k) = args.keep_activations {
        cfg.train.keep_activations = k;
    }
    if let Some(f) = args.inject_fault.clone() {
        cfg.train.inject_fault = Some(f);
    }
    if let Some(p) = args.precision.clone() {
        cfg.backend.precision = Some(p);
    }
    if let Some(s) = args.schedule.as_deref() {
        cfg.train.schedule = parse_schedule(s);
    }
    if let Some(t) = args.tokenizer.clone() {
        cfg.data.tokenizer = Some(t);
    }
    cfg.train
        .validate()
        .map_err(|m| format!("after the command-line options: [train] {m}"))?;
    let tok = nsactor_data::cli::load_tokenizer(cfg.data.tokenizer.as_deref())?;
    train::check_tokenizer(&cfg, &tok)?;
    let sampler = make_sampler(&cfg, &tok, &args.corpus, args.data.as_deref(), args.sft)?;
    let compute = open_run_backend(&cfg, args.backend.as_deref())?;
    let optimizer = if args.sft {
        OptimizerKind::AdamW
    } else {
        OptimizerKind::Adam
    };
    let devices = cfg.train.devices.clone().unwrap_or_else(|| vec![0]);
    check_devices(compute.as_ref(), &devices)?;
    let model_toml = cfg.model_toml();
    let plan = PipelinePlan::balanced(model_layers(&model_toml)?, cfg.train.pipeline, &devices)?;
    let model = StagedModel::open(
        compute,
        &model_toml,
        cfg.train.seed,
        optimizer,
        Some(plan.placement()),
    )?;
    let mut pipeline = Pipeline::start(model, plan, cfg.train.clone(), Some(sampler))?;
    let mut first_step = 0;
    if args.resume {
        first_step = resume(&cfg, &tok, &mut pipeline)?;
    }
    let summary = train::run(
        &cfg,
        &mut pipeline,
        first_step,
        Some(tok.hash().to_string()),
    )?;
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last = summary.losses.last().copied().unwrap_or(f64::NAN);
    tracing::info!(
        "loss {first:.4} → {last:.4}; {:.0} tokens/s; weights in {}",
        summary.tokens_per_s,
        summary.weights.display()
    );
    let mut ids = vec![i64::from(tok.bos_id())];
    ids.extend(tok.encode("Emma was")?.into_iter().map(i64::from));
    // The sample: seeded nucleus sampling with a repetition penalty (a small model's greedy
    // text loops), stopping at the end token, never emitting the other specials.
    let eos = i64::from(tok.eos_id());
    let specials: Vec<i64> = (0..5).filter(|&id| id != eos).collect();
    let sampling = nsactor::decode::SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.95,
        repetition_penalty: 1.2,
        seed: cfg.train.seed,
    };
    let out = pipeline.generate(&ids, 60, Some(eos), &specials, sampling)?;
    let out: Vec<u32> = out.iter().map(|&t| t as u32).collect();
    println!("{}", tok.decode(&out, true)?.replace('\n', " "));
    Ok(())
}

/// A checkpoint's model on the actor pipeline, ready to serve, with its tokenizer.
struct Loaded {
    pipeline: Pipeline,
    tokenizer: Arc<nsactor_data::Tokenizer>,
    vocab: usize,
    name: String,
    /// The run's configuration, from the checkpoint's manifest.
    config: RunConfig,
}

fn load_model(a: &ModelArgs) -> Result<Loaded, Box<dyn std::error::Error>> {
    let ck = nsactor::export::find_checkpoint(&a.checkpoint)?;
    let cfg = RunConfig::from_str(&ck.manifest.config, &ck.dir.display().to_string())?;
    let tok_path = a.tokenizer.clone().or(cfg.data.tokenizer.clone());
    let tok = nsactor_data::cli::load_tokenizer(tok_path.as_deref())?;
    if let Some(h) = &ck.manifest.tokenizer_sha256
        && h != tok.hash()
    {
        return Err(format!(
            "{} was trained with tokenizer {h}, but {} is {}; pass the run's with --tokenizer",
            ck.dir.display(),
            tok.origin(),
            tok.hash()
        )
        .into());
    }
    let backend_name = a
        .backend
        .clone()
        .or(cfg.backend.name.clone())
        .unwrap_or_else(|| backend::default_name().to_string());
    let mut backend_cfg = cfg.backend.clone();
    if let Some(p) = &a.precision {
        backend_cfg.precision = Some(p.clone());
    }
    let compute = backend::open_with(
        &backend_name,
        &backend_cfg.plugin_path,
        &backend_cfg.plugin_options(),
    )?;
    let n = model_layers(&cfg.model_toml())?;
    let devices = a.devices.clone().unwrap_or_else(|| vec![0]);
    let plan = PipelinePlan::balanced(n, a.pipeline, &devices)?;
    let model = StagedModel::open(
        compute,
        &cfg.model_toml(),
        cfg.train.seed,
        OptimizerKind::Adam,
        Some(plan.placement()),
    )?;
    let mut train = cfg.train.clone();
    train.inject_fault = None;
    let mut pipeline = Pipeline::start(model, plan, train, None)?;
    pipeline.load_stages(ck.shards)?;
    let vocab = cfg
        .vocab_size()
        .ok_or("the checkpoint's config has no vocab_size")?;
    let name = ck
        .dir
        .parent()
        .and_then(|p| p.parent())
        .and_then(|p| p.file_name())
        .map_or("nsactor".into(), |n| n.to_string_lossy().into_owned());
    tracing::info!(
        "loaded {} ({} parameters, step {})",
        ck.dir.display(),
        pipeline.param_count(),
        ck.manifest.step
    );
    Ok(Loaded {
        pipeline,
        tokenizer: Arc::new(tok),
        vocab,
        name,
        config: cfg,
    })
}

fn eval_cmd(a: EvalArgs) -> Result<(), Box<dyn std::error::Error>> {
    if a.batches == 0 {
        return Err("--batches must be at least 1".into());
    }
    let mut l = load_model(&a.model)?;
    let mut cfg = l.config.clone();
    if let Some(t) = a.seq_len {
        cfg.train.seq_len = t;
    }
    let batch = a.batch_size.unwrap_or(cfg.train.batch_size);
    if batch == 0 || cfg.train.seq_len == 0 {
        return Err("--batch-size and --seq-len must be at least 1".into());
    }
    let mut sampler = make_sampler(&cfg, &l.tokenizer, &a.corpus, a.data.as_deref(), false)?;
    let t0 = std::time::Instant::now();
    let (mut weighted, mut scored) = (0.0f64, 0u64);
    for i in 0..a.batches {
        let b = sampler.next_batch(batch, cfg.train.seq_len)?;
        let n = nsactor::engine::scored_tokens(&b);
        let ce = l.pipeline.eval_ce(&b)?;
        tracing::debug!("batch {i}: CE {ce:.5} over {n} tokens");
        weighted += ce * n as f64;
        scored += n;
    }
    if scored == 0 {
        return Err("the batches hold no scored tokens".into());
    }
    let ce = weighted / scored as f64;
    let info = l.pipeline.backend().info();
    println!(
        "held-out CE {ce:.5} (perplexity {:.3}) over {scored} tokens in {} batches of {batch} × {}; {} {} [{}], GEMMs {}; {:.1} s",
        ce.exp(),
        a.batches,
        cfg.train.seq_len,
        info.name,
        info.version,
        info.devices.first().map_or("", String::as_str),
        a.model
            .precision
            .as_deref()
            .or(cfg.backend.precision.as_deref())
            .unwrap_or("fp32"),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn server_state(
    l: &Loaded,
    max_sessions: usize,
    max_queue: usize,
    name: String,
) -> Arc<nsactor::server::ServerState> {
    use nsactor::server::generate::{Admission, Generator};
    let limits = nsactor::server::protocol::Limits::default();
    Arc::new(nsactor::server::ServerState {
        generator: Generator {
            decoder: l.pipeline.decoder(l.vocab),
            tokenizer: l.tokenizer.clone(),
            admission: Admission::new(max_sessions.max(1), max_queue),
            metrics: Arc::default(),
            max_prompt_tokens: limits.max_prompt_tokens,
        },
        model_name: name,
        limits,
    })
}

fn serve_cmd(a: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let l = load_model(&a.model)?;
    let state = server_state(
        &l,
        a.max_sessions,
        a.max_queue,
        a.model_name.clone().unwrap_or_else(|| l.name.clone()),
    );
    l.pipeline.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.addr)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", a.addr))?;
        tracing::info!(
            "serving on http://{} (WebSocket /ws, OpenAI /v1/completions and /v1/chat/completions, chat page /)",
            listener.local_addr()?
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        };
        nsactor::server::serve(listener, state, shutdown).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

fn generate_cmd(a: GenerateArgs) -> Result<(), Box<dyn std::error::Error>> {
    use nsactor::server::generate::GenEvent;
    use nsactor::server::protocol::{ChatMessage, Options, PromptSpec};
    use std::io::{BufRead, Write};
    let l = load_model(&a.model)?;
    let state = server_state(&l, 1, 0, l.name.clone());
    let options = || Options {
        max_tokens: Some(a.max_tokens),
        temperature: Some(a.temperature),
        top_k: Some(a.top_k),
        top_p: Some(a.top_p),
        repetition_penalty: Some(a.repetition_penalty),
        seed: a.seed,
        stop: None,
        ignore_eos: false,
    };
    // Streams one answer to stdout; returns its text.
    let run = |prompt: PromptSpec| -> Result<String, Box<dyn std::error::Error>> {
        let spec = options().validate(prompt, false, &state.limits)?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let g = state.clone();
        l.pipeline.block_on(async move {
            let job = tokio::spawn(async move {
                g.generator
                    .run(
                        spec,
                        tx,
                        Arc::new(std::sync::atomic::AtomicBool::new(false)),
                    )
                    .await
            });
            let mut text = String::new();
            let mut out = std::io::stdout();
            while let Some(e) = rx.recv().await {
                if let GenEvent::Delta { text: t, .. } = e {
                    print!("{t}");
                    let _ = out.flush();
                    text.push_str(&t);
                }
            }
            println!();
            let f = job.await.map_err(|e| e.to_string())??;
            tracing::info!(
                "{} tokens, {:.0} ms to the first, {:.1} tokens/s ({})",
                f.usage.completion_tokens,
                f.timing.time_to_first_token_ms,
                f.timing.tokens_per_s,
                f.finish_reason
            );
            Ok(text)
        })
    };
    if !a.chat {
        let prompt = a.prompt.clone().ok_or("give a prompt, or --chat")?;
        run(PromptSpec::Text(prompt))?;
        return Ok(());
    }
    let mut messages: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    eprint!("> ");
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            eprint!("> ");
            continue;
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line,
        });
        let answer = run(PromptSpec::Chat(messages.clone()))?;
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: answer,
        });
        eprint!("> ");
    }
    Ok(())
}

/// Loads the newest valid checkpoint of the run into `pipeline`; returns its step (0 when
/// there is none).
fn resume(
    cfg: &RunConfig,
    tok: &nsactor_data::Tokenizer,
    pipeline: &mut Pipeline,
) -> Result<u64, Box<dyn std::error::Error>> {
    let root = train::checkpoint_root(cfg);
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
        tracing::warn!(
            "--resume: no valid checkpoint in {}; starting from step 0",
            root.display()
        );
        return Ok(0);
    };
    if let Some(h) = &manifest.tokenizer_sha256
        && h != tok.hash()
    {
        return Err(format!(
            "checkpoint {} was trained with tokenizer {h}, this run uses {} ({})",
            dir.display(),
            tok.hash(),
            tok.origin()
        )
        .into());
    }
    pipeline.load_stages(shards)?;
    pipeline.set_position(manifest.step, manifest.data_cursor)?;
    tracing::info!("resuming from {} (step {})", dir.display(), manifest.step);
    Ok(manifest.step)
}

/// The batch source of a run: prepared shards, corpus files, or the bundled corpus; SFT rows
/// from conversation files with `--sft --corpus`.
fn make_sampler(
    cfg: &RunConfig,
    tok: &nsactor_data::Tokenizer,
    corpus: &[PathBuf],
    data: Option<&std::path::Path>,
    sft: bool,
) -> Result<Sampler, nsactor_data::DataError> {
    let (seq_len, seed) = (cfg.train.seq_len, cfg.train.seed);
    let mode = if cfg.data.packing {
        Mode::Packed
    } else {
        Mode::Padded
    };
    if let Some(dir) = data {
        let shards = ShardSet::open(dir, tok, true)?;
        return Sampler::pretrain(Arc::new(shards), mode, seq_len, seed);
    }
    if sft && !corpus.is_empty() {
        return nsactor_data::sample::sft_sampler(tok, corpus, None, seq_len, seed);
    }
    let tokens = if corpus.is_empty() {
        let mut m = nsactor_data::MemTokens::default();
        let text = nsactor_data::bundled_corpus();
        let name = std::path::Path::new("bundled-gutenberg-en.txt");
        nsactor_data::shards::tokenize_text(tok, name, &text, &cfg.data.text_field, &mut m)?;
        m
    } else {
        nsactor_data::shards::tokenize_files(tok, corpus, &cfg.data.text_field)?
    };
    Sampler::pretrain(Arc::new(tokens), mode, seq_len, seed)
}

fn verify_cmd(args: VerifyArgs) -> Result<(), Box<dyn std::error::Error>> {
    let bytes = std::fs::read(&args.fixture)
        .map_err(|e| format!("cannot read fixture {}: {e}", args.fixture.display()))?;
    let bf16 = args.precision == "bf16";
    let options = if bf16 { "precision=bf16" } else { "" };
    let compute = backend::open_with(&args.backend, &[], options)?;
    let info = compute.info();
    let started = std::time::Instant::now();
    let devices = args.devices.clone().unwrap_or_else(|| vec![0]);
    check_devices(compute.as_ref(), &devices)?;
    let r = nsactor::verify::tiny_a(compute, &bytes, args.pipeline, &devices)?;
    println!(
        "tiny_a on {} {} ({}), {} GEMMs, in {:.2} s",
        info.name,
        info.version,
        info.devices.join(", "),
        args.precision,
        started.elapsed().as_secs_f64()
    );
    println!(
        "CE {:.7} (ref {:.7}); loss {:.7} (ref {:.7}); |g| {:.6} (ref {:.6}); worst gradient {} {:.2e}; worst param after the step {} {:.2e}",
        r.ce_before,
        r.ce_want,
        r.loss,
        r.loss_want,
        r.grad_norm,
        r.grad_norm_want,
        r.worst_grad().0,
        r.worst_grad().1,
        r.worst_param.0,
        r.worst_param.1
    );
    println!("greedy {:?}\nref    {:?}", r.greedy, r.greedy_want);
    let (same, generated) = r.greedy_agreement();
    println!("generated tokens equal to the reference's: {same} of {generated}");
    let bound = if bf16 {
        nsactor::verify::BF16_REL
    } else {
        nsactor::verify::PARAM_REL
    };
    let mut over: Vec<_> = r.grad_errors.iter().filter(|(_, e)| *e > bound).collect();
    over.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!(
        "parameter gradients within {bound:.0e} of the reference's: {} of {}{}",
        r.grad_errors.len() - over.len(),
        r.grad_errors.len(),
        if over.is_empty() {
            ""
        } else {
            "; the farthest:"
        }
    );
    for (name, e) in over.iter().take(6) {
        println!("  {name:<44} {e:.2e}");
    }
    let checks = r.checks_at(bf16);
    for (name, value, bound, ok) in &checks {
        println!(
            "{:<32} {value:>10.3e} ≤ {bound:.0e}  {}",
            name,
            if *ok { "ok" } else { "FAIL" }
        );
    }
    if checks.iter().all(|c| c.3) {
        println!("PASS");
        Ok(())
    } else {
        Err("tiny_a: outside the fixture tolerances".into())
    }
}

fn verify_scan_cmd(args: VerifyScanArgs) -> Result<(), Box<dyn std::error::Error>> {
    // The plugin reads the file itself; read it here first so a bad path is our error.
    std::fs::metadata(&args.fixture)
        .map_err(|e| format!("cannot read fixture {}: {e}", args.fixture.display()))?;
    let path = args
        .fixture
        .to_str()
        .filter(|p| !p.contains(','))
        .ok_or_else(|| {
            format!(
                "the fixture path {} must be UTF-8 without commas",
                args.fixture.display()
            )
        })?;
    let compute = backend::open(&args.backend, &[])?;
    let info = compute.info();
    println!(
        "plif_scan on {} {} ({})",
        info.name,
        info.version,
        info.devices.join(", ")
    );
    let options = format!("fixture={path},precision={}", args.precision);
    match compute.bench("verify-plif-scan", &options) {
        Ok(report) => {
            print!("{report}");
            println!("PASS");
            Ok(())
        }
        Err(nsactor_plugin_api::EngineError::Backend(report)) => {
            println!("{report}");
            Err("plif_scan: outside the fixture tolerances".into())
        }
        Err(e) => Err(e.into()),
    }
}

/// A freshly initialised model of `config` (default: the embedded tiny one) behind a started
/// pipeline, for the benchmarks that need no checkpoint.
fn fresh_model(
    config: Option<&std::path::Path>,
    backend: Option<&str>,
    precision: Option<String>,
    pipeline: usize,
    devices: Option<&[usize]>,
) -> Result<Loaded, Box<dyn std::error::Error>> {
    let mut cfg = RunConfig::load(config)?;
    if precision.is_some() {
        cfg.backend.precision = precision;
    }
    let compute = open_run_backend(&cfg, backend)?;
    let devices = devices.map_or_else(|| vec![0], <[usize]>::to_vec);
    check_devices(compute.as_ref(), &devices)?;
    let model_toml = cfg.model_toml();
    let plan = PipelinePlan::balanced(model_layers(&model_toml)?, pipeline, &devices)?;
    let model = StagedModel::open(
        compute,
        &model_toml,
        cfg.train.seed,
        OptimizerKind::Adam,
        Some(plan.placement()),
    )?;
    Ok(Loaded {
        pipeline: Pipeline::start(model, plan, cfg.train.clone(), None)?,
        tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
        vocab: cfg.vocab_size().ok_or("[model] has no vocab_size")?,
        name: config.map_or("embedded configs/tiny.toml".into(), |p| {
            p.display().to_string()
        }),
        config: cfg,
    })
}

fn serve_bench_cmd(a: ServeBenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let l = match &a.checkpoint {
        Some(c) => load_model(&ModelArgs {
            checkpoint: c.clone(),
            backend: a.backend.clone(),
            pipeline: a.pipeline,
            devices: None,
            tokenizer: None,
            precision: None,
        })?,
        None => fresh_model(None, a.backend.as_deref(), None, a.pipeline, None)?,
    };
    let max = a.sessions.iter().copied().max().unwrap_or(1);
    let state = server_state(&l, max, max, l.name.clone());
    let info = l.pipeline.backend().info();
    println!(
        "serve: {} ({} parameters) on {} {} ({}), pipeline {}; {} tokens per session, WebSocket on loopback",
        l.name,
        l.pipeline.param_count(),
        info.name,
        info.version,
        info.devices.join(", "),
        a.pipeline,
        a.tokens
    );
    println!(
        "{:>9} {:>14} {:>14} {:>13} {:>13} {:>16} {:>12}",
        "sessions",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "tokens/s (all)",
        "mean cohort"
    );
    let decoder = l.pipeline.decoder(l.vocab);
    l.pipeline.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(nsactor::server::serve(
            listener,
            state,
            std::future::pending(),
        ));
        // Warm-up.
        nsactor::bench::serve_load(addr, 1, 8).await?;
        for &n in &a.sessions {
            let (c0, n0) = decoder.batch_counts();
            let t = nsactor::bench::serve_load(addr, n, a.tokens).await?;
            let (c1, n1) = decoder.batch_counts();
            println!(
                "{:>9} {:>14.1} {:>14.1} {:>13.2} {:>13.2} {:>16.0} {:>12.1}",
                t.sessions,
                t.ttft_p50_ms,
                t.ttft_p99_ms,
                t.itl_p50_ms,
                t.itl_p99_ms,
                t.tokens_per_s,
                (n1 - n0) as f64 / (c1 - c0).max(1) as f64
            );
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

/// The plugin option string that sets `precision` on `backend`: the CPU backend has one
/// precision and takes no options.
fn precision_option(backend: &str, precision: &str) -> String {
    if backend == "cuda" {
        format!("precision={precision}")
    } else {
        String::new()
    }
}

fn decode_profile_cmd(a: DecodeProfileArgs) -> Result<(), Box<dyn std::error::Error>> {
    let b = backend::open_with(&a.backend, &[], &precision_option(&a.backend, &a.precision))?;
    print!("{}", b.bench("decode-profile", &a.options)?);
    Ok(())
}

fn generate_bench_cmd(a: GenerateBenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    if a.tokens < 2 || a.prompt_len == 0 || a.sessions.contains(&0) {
        return Err("--tokens must be ≥ 2, --prompt-len ≥ 1 and every --sessions ≥ 1".into());
    }
    let l = match &a.checkpoint {
        Some(c) => load_model(&ModelArgs {
            checkpoint: c.clone(),
            backend: a.backend.clone(),
            pipeline: a.pipeline,
            devices: a.devices.clone(),
            tokenizer: None,
            precision: a.precision.clone(),
        })?,
        None => fresh_model(
            a.config.as_deref(),
            a.backend.as_deref(),
            a.precision.clone(),
            a.pipeline,
            a.devices.as_deref(),
        )?,
    };
    let info = l.pipeline.backend().info();
    let params = l.pipeline.param_count();
    let precision = l.config.backend.precision.clone().unwrap_or("fp32".into());
    let bytes = if precision == "bf16" { 2.0 } else { 4.0 };
    // Batch-1 decoding reads every weight once per token.
    let ceiling = a.bandwidth_gbs * 1e9 / (params as f64 * bytes);
    println!(
        "generate bench: {} ({params} parameters) on {} {} ({}), GEMMs {precision}, pipeline {}; prompt {} tokens, {} tokens per session, greedy",
        l.name,
        info.name,
        info.version,
        info.devices.join(", "),
        a.pipeline,
        a.prompt_len,
        a.tokens
    );
    println!(
        "batch-1 ceiling: {:.2} GB of {precision} weights per token at {} GB/s = {ceiling:.0} tokens/s",
        params as f64 * bytes / 1e9,
        a.bandwidth_gbs
    );
    println!(
        "{:>9} {:>16} {:>14} {:>14} {:>16} {:>18} {:>12}",
        "sessions",
        "prefill p50 (ms)",
        "step p50 (ms)",
        "step p99 (ms)",
        "tokens/s (all)",
        "tokens/s (decode)",
        "mean cohort"
    );
    let vocab = l.vocab;
    let prompt: Vec<i64> = (0..a.prompt_len)
        .map(|i| ((i * 7919 + 101) % vocab.max(1)) as i64)
        .collect();
    let decoder = l.pipeline.decoder(vocab);
    l.pipeline.block_on(async {
        // Warm-up at every batch size measured (kernel compilation, autotuning, pool growth).
        for &n in &a.sessions {
            nsactor::bench::generate_load(&decoder, n, &prompt, 4).await?;
        }
        let mut host = Vec::new();
        for &n in &a.sessions {
            let (c0, _) = decoder.batch_counts();
            let b0 = l.pipeline.busy();
            let p0 = decoder.cohort_phases();
            let _ = nsactor::pipeline::trace::take();
            let t = nsactor::bench::generate_load(&decoder, n, &prompt, a.tokens).await?;
            let timelines = nsactor::pipeline::trace::take();
            let (c1, _) = decoder.batch_counts();
            let p1 = decoder.cohort_phases();
            let per_pass: Vec<String> = l
                .pipeline
                .busy()
                .iter()
                .zip(&b0)
                .map(|((name, s1, _), (_, s0, _))| {
                    format!("{name} {:.2} ms", (s1 - s0) * 1e3 / (c1 - c0).max(1) as f64)
                })
                .collect();
            let passes = (c1 - c0).max(1) as f64;
            let ms: Vec<f64> = p1.iter().zip(&p0).map(|(x, y)| (x - y) * 1e3 / passes).collect();
            if nsactor::pipeline::trace::enabled() {
                println!("  cohort timeline, median µs from its start ({n} sessions):");
                for (m, us, count) in nsactor::pipeline::trace::medians(&timelines) {
                    println!("    {us:>9.1}  {} ({count} cohorts)", m.name());
                }
            }
            host.push((
                n,
                format!(
                    "{}; cohort {:.2} ms = embed {:.2} + layers {:.2} + decode and copy {:.2} (+ {:.2} between)",
                    per_pass.join(", "),
                    ms[3],
                    ms[0],
                    ms[1],
                    ms[2],
                    ms[3] - ms[0] - ms[1] - ms[2]
                ),
            ));
            println!(
                "{:>9} {:>16.1} {:>14.2} {:>14.2} {:>16.0} {:>18.0} {:>12.1}",
                t.sessions,
                t.prefill_p50_ms,
                t.step_p50_ms,
                t.step_p99_ms,
                t.tokens_per_s,
                t.decode_tokens_per_s,
                t.mean_cohort
            );
        }
        println!(
            "host time inside stage calls per batched pass (prefill and decode passes alike):"
        );
        for (n, line) in host {
            println!("  {n:>4} sessions: {line}");
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    match l.pipeline.backend().bench("memory", "") {
        Ok(m) => print!("{m}"),
        Err(e) => println!("device memory: not reported by this backend ({e})"),
    }
    Ok(())
}

fn recovery_cmd(args: RecoveryArgs) -> Result<(), Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(&args.dir);
    let r = nsactor::bench::recovery(&args.dir, args.size_mb);
    let _ = std::fs::remove_dir_all(&args.dir);
    let r = r?;
    println!(
        "tiny model, layer 1 panics in step 3, checkpoint at step 2 ({})",
        train::describe(backend::open(backend::default_name(), &[])?.as_ref())
    );
    println!(
        "  recovery (rebuild actors, read + verify + load checkpoint, rewind data): {:.1} ms",
        r.recover_s * 1e3
    );
    println!(
        "  first step after it: {:.1} ms (a normal step: {:.1} ms)",
        r.first_step_s * 1e3,
        r.step_s * 1e3
    );
    let gb = |b: f64| b / 1e9;
    println!(
        "disk {}: checkpoint of {:.2} GB in 21 shards: write (parallel, fsync) {:.2} GB/s, read + sha256 {:.2} GB/s",
        args.dir.display(),
        gb(r.checkpoint_bytes as f64),
        gb(r.write_bps),
        gb(r.read_bps)
    );
    // 0.9B (SPEC §0.5): 3.5 GB of fp32 parameters; Adam's two moments triple it.
    let ckpt = 3.5e9 * 3.0;
    println!(
        "0.9B projection: checkpoint {:.1} GB (edge ≈ 0.07 GB, 20 layer shards ≈ {:.2} GB each)",
        gb(ckpt),
        gb((ckpt - 0.066e9) / 20.0)
    );
    println!(
        "  write {:.1} s per checkpoint; recovery ≈ read + verify {:.1} s + host→GPU copy ≈ 0.5 s \
         (20 GB/s) + re-initialising the stages, then at most checkpoint_every steps redone",
        ckpt / r.write_bps,
        ckpt / r.read_bps
    );
    Ok(())
}

fn hop_cmd(args: HopArgs) -> Result<(), Box<dyn std::error::Error>> {
    // 0.9B, one layer, one micro-batch of 4 × 511 tokens: ≈107 GFLOP per trained token with
    // per-layer recompute over 20 layers (DESIGN.md performance model).
    let layer_flop = 107e9 / 20.0 * 4.0 * 511.0;
    let at = |tflops: f64| layer_flop / (tflops * 1e12);
    println!(
        "actor pipeline hop: {} no-compute layer actors, {} micro-batches per step, median of {} steps; {} CPU threads",
        args.layers,
        args.micro,
        args.steps,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "0.9B layer compute per micro-batch (4×511 tokens, fwd + recompute + bwd, {:.1} TFLOP): {:.1} ms at 600 TFLOP/s (cuBLAS bf16), {:.0} ms at 88 TFLOP/s (burn's matmul)",
        layer_flop * 1e-12,
        at(600.0) * 1e3,
        at(88.0) * 1e3
    );
    println!(
        "{:>9} {:>12} {:>8} {:>12} {:>22}",
        "pipeline", "step (ms)", "hops", "per hop (µs)", "share of a 0.9B layer"
    );
    for &p in &args.pipeline {
        let t = nsactor::bench::pipeline_hops(
            args.layers,
            p,
            args.micro,
            args.steps,
            args.layer_busy_us,
            parse_schedule(args.schedule.as_deref().unwrap_or("fifo")),
        )?;
        // A layer sees two hops per micro-batch: its forward input and its backward input.
        let share = 2.0 * t.per_hop_s() / at(600.0);
        println!(
            "{:>9} {:>12.3} {:>8} {:>12.2} {:>21.4}%",
            p,
            t.step_s * 1e3,
            t.hops,
            t.per_hop_s() * 1e6,
            share * 100.0
        );
    }
    Ok(())
}

/// The run's backend — `--backend`, else `[backend] name`, else the default — opened with the
/// config's plugin options.
fn open_run_backend(
    cfg: &RunConfig,
    arg: Option<&str>,
) -> Result<Arc<dyn nsactor_plugin_api::ComputeBackend>, Box<dyn std::error::Error>> {
    let name = arg
        .map(str::to_string)
        .or_else(|| cfg.backend.name.clone())
        .unwrap_or_else(|| backend::default_name().to_string());
    Ok(backend::open_with(
        &name,
        &cfg.backend.plugin_path,
        &cfg.backend.plugin_options(),
    )?)
}

/// Every one of `devices` exists on `compute`.
fn check_devices(
    compute: &dyn nsactor_plugin_api::ComputeBackend,
    devices: &[usize],
) -> Result<(), String> {
    let info = compute.info();
    match devices.iter().find(|&&d| d >= info.devices.len()) {
        Some(bad) => Err(format!(
            "device {bad} does not exist: {} has {} device(s)",
            info.name,
            info.devices.len()
        )),
        None => Ok(()),
    }
}

/// `--schedule` (clap already checked the value).
fn parse_schedule(s: &str) -> nsactor::config::Schedule {
    match s {
        "depth-first" => nsactor::config::Schedule::DepthFirst,
        "fifo" => nsactor::config::Schedule::Fifo,
        _ => nsactor::config::Schedule::Auto,
    }
}

fn train_bench_cmd(a: TrainBenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = RunConfig::load(a.config.as_deref())?;
    if let Some(p) = a.pipeline {
        cfg.train.pipeline = p;
    }
    if let Some(d) = a.devices.clone() {
        cfg.train.devices = Some(d);
    }
    if let Some(b) = a.batch_size {
        cfg.train.batch_size = b;
    }
    if let Some(t) = a.seq_len {
        cfg.train.seq_len = t;
    }
    if let Some(m) = a.accumulation {
        cfg.train.accumulation = m;
    }
    if let Some(k) = a.keep_activations {
        cfg.train.keep_activations = k;
    }
    if let Some(p) = a.precision.clone() {
        cfg.backend.precision = Some(p);
    }
    if let Some(s) = a.schedule.as_deref() {
        cfg.train.schedule = parse_schedule(s);
    }
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    cfg.train
        .validate()
        .map_err(|m| format!("after the command-line options: [train] {m}"))?;
    let compute = open_run_backend(&cfg, a.backend.as_deref())?;
    let info = compute.info();
    let devices = cfg.train.devices.clone().unwrap_or_else(|| vec![0]);
    check_devices(compute.as_ref(), &devices)?;
    let model_toml = cfg.model_toml();
    let vocab = cfg.vocab_size().ok_or("[model] has no vocab_size")?;
    let plan = PipelinePlan::balanced(model_layers(&model_toml)?, cfg.train.pipeline, &devices)?;
    // Layers that recompute their forward in the backward: all but the last `keep_activations`
    // of each stage.
    let recomputed: usize = plan
        .stages
        .iter()
        .map(|s| s.layers.len().saturating_sub(cfg.train.keep_activations))
        .sum();
    let model_flops = nsactor::bench::train_flops_per_token(&cfg.model, 0)?;
    let executed_flops = nsactor::bench::train_flops_per_token(&cfg.model, recomputed)?;
    let t_open = std::time::Instant::now();
    let model = StagedModel::open(
        compute.clone(),
        &model_toml,
        cfg.train.seed,
        OptimizerKind::Adam,
        Some(plan.placement()),
    )?;
    let params = model.param_count();
    let mut pipeline = Pipeline::start(model, plan.clone(), cfg.train.clone(), None)?;
    let open_s = t_open.elapsed().as_secs_f64();
    let precision = cfg.backend.precision.as_deref().unwrap_or("fp32");
    let used: Vec<&str> = devices.iter().map(|&d| info.devices[d].as_str()).collect();
    println!(
        "train bench: {} ({params} parameters) on {} {}, GEMMs {precision}; {}",
        a.config
            .as_ref()
            .map_or("embedded configs/tiny.toml".into(), |p| p
                .display()
                .to_string()),
        info.name,
        info.version,
        used.join(" | ")
    );
    println!(
        "pipeline {} stage(s) [{}] (layers@device), {:?} schedule; batch {} × T {} × accumulation {} = {} tokens/step; model opened in {open_s:.1} s",
        plan.num_stages(),
        plan.describe(),
        cfg.train.schedule.resolve(&info.name),
        cfg.train.batch_size,
        cfg.train.seq_len,
        cfg.train.accumulation,
        cfg.train.batch_size * cfg.train.seq_len * cfg.train.accumulation
    );
    let r = nsactor::bench::train_throughput(
        &mut pipeline,
        &cfg.train,
        vocab,
        a.warmup,
        a.steps,
        (!a.no_breakdown).then_some(compute.as_ref()),
    )?;
    println!(
        "{:>6} {:>10} {:>10} {:>9}",
        "step", "time (s)", "tokens/s", "loss"
    );
    for (i, s) in r.warmup.iter().chain(&r.steps).enumerate() {
        println!(
            "{:>6} {:>10.3} {:>10.0} {:>9.4}{}",
            i,
            s.seconds,
            r.tokens_per_step as f64 / s.seconds,
            s.loss,
            if i < r.warmup.len() {
                "  (warm-up)"
            } else {
                ""
            }
        );
    }
    let step = r.median_step_s();
    let tflops = r.tokens_per_s() * model_flops / 1e12;
    let executed = r.tokens_per_s() * executed_flops / 1e12;
    let peak = a
        .peak_tflops
        .unwrap_or(if precision == "bf16" { 989.0 } else { 67.0 });
    println!(
        "median step {:.3} s: {:.0} tokens/s; {:.4} GFLOP/token (projections, fwd + bwd) → {tflops:.3} TFLOP/s, MFU {:.2}% of {peak} TFLOP/s; executed with the recompute of {recomputed} of {} layers {:.4} GFLOP/token, {executed:.3} TFLOP/s ({:.2}%)",
        step,
        r.tokens_per_s(),
        model_flops / 1e9,
        100.0 * tflops / peak,
        plan.num_layers(),
        executed_flops / 1e9,
        100.0 * executed / peak
    );
    println!(
        "per-worker time per step (host time inside stage calls; of it, issuing input moves from another device):"
    );
    let busy = r.mean_busy();
    for ((name, b), t) in r.workers.iter().zip(&busy).zip(r.mean_transfer()) {
        println!(
            "  {name:<16} busy {b:>8.3} s  {:>5.1}% of the step   transfer {:>8.4} s",
            100.0 * b / step,
            t
        );
    }
    // The edge's worker is not a stage; stages are the rest.
    let stages = &busy[1..];
    let p = stages.len() as f64;
    let m = cfg.train.accumulation as f64;
    println!(
        "bubble: measured {:.1}% (1 − Σ stage busy / (P · step)), 1F1B theory (P−1)/(M+P−1) = {:.1}% for P = {p}, M = {m}",
        100.0 * (1.0 - stages.iter().sum::<f64>() / (p * step)),
        100.0 * (p - 1.0) / (m + p - 1.0)
    );
    print_device_breakdown(&r, &info, executed_flops, a.no_breakdown);
    match compute.bench("memory", "") {
        Ok(m) => print!("{m}"),
        Err(e) => println!("device memory: not reported by this backend ({e})"),
    }
    Ok(())
}

/// `bench train`'s device-time breakdown: per device, the mean per timed step of the time in
/// GEMMs, in PLIF scans, in other work inside stage calls, and outside every stage call.
fn print_device_breakdown(
    r: &nsactor::bench::TrainBench,
    info: &nsactor_plugin_api::BackendInfo,
    executed_flops: f64,
    skipped: bool,
) {
    let devices = r.mean_device();
    if devices.is_empty() {
        println!(
            "device time: {}",
            if skipped {
                "not measured (--no-breakdown)".to_string()
            } else {
                format!(
                    "not reported by this backend ({})",
                    r.device_note.as_deref().unwrap_or("no timing")
                )
            }
        );
        return;
    }
    println!(
        "device time per step (events on the work's streams; overlapping work of two streams counts once):"
    );
    let pct = |x: f64, w: f64| 100.0 * x / w.max(1e-12);
    for d in &devices {
        let w = d.window_s;
        println!(
            "  {:<10} {:.3} s: GEMM {:.3} s ({:.1}%, {} calls), PLIF scans {:.3} s ({:.1}%, {} kernels), \
             other work in stage calls {:.3} s ({:.1}%), outside stage calls (actor messaging, host \
             round trips, the supervisor) {:.3} s ({:.1}%)",
            info.devices
                .get(d.device)
                .and_then(|n| n.split_whitespace().next())
                .unwrap_or("?"),
            w,
            d.gemm_s,
            pct(d.gemm_s, w),
            d.gemms,
            d.scans_s,
            pct(d.scans_s, w),
            d.scans,
            d.other_s(),
            pct(d.other_s(), w),
            d.outside_calls_s(),
            pct(d.outside_calls_s(), w)
        );
        if d.gemm_sum_s > d.gemm_s * 1.001 || d.scans_sum_s > d.scans_s * 1.001 {
            println!(
                "             summed over streams: GEMM {:.3} s, scans {:.3} s",
                d.gemm_sum_s, d.scans_sum_s
            );
        }
    }
    let gemm: f64 = devices.iter().map(|d| d.gemm_sum_s).sum();
    if gemm > 0.0 {
        println!(
            "  GEMMs while running: {:.0} TFLOP/s ({:.4} GFLOP per token executed, {} tokens per step)",
            executed_flops * r.tokens_per_step as f64 / gemm / 1e12,
            executed_flops / 1e9,
            r.tokens_per_step
        );
    }
}

fn kernels_cmd(args: KernelsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let b = backend::open_with(
        &args.backend,
        &[],
        &precision_option(&args.backend, &args.precision),
    )?;
    let info = b.info();
    println!(
        "PLIF scan kernels: {} {} on {}",
        info.name,
        info.version,
        info.devices.first().map_or("?", |d| d.as_str())
    );
    print!("{}", b.bench("kernels", &args.options)?);
    Ok(())
}

fn overhead_cmd(args: OverheadArgs) -> Result<(), Box<dyn std::error::Error>> {
    use nsactor::bench::{Timing, boundary};
    let plugin = backend::open(&args.backend, &[])?;
    let info = plugin.info();
    let p = boundary(&plugin, args.iters, args.reps)?;
    let e = if backend::has_embedded() {
        Some(boundary(
            &backend::open(backend::EMBEDDED, &[])?,
            args.iters,
            args.reps,
        )?)
    } else {
        None
    };
    println!(
        "plugin boundary: {} {} on {} ({} × {} calls, median ns/call [p10–p90])",
        info.name,
        info.version,
        info.devices.join(", "),
        args.reps,
        args.iters
    );
    let cell = |t: &Timing| format!("{:>9.0} [{:.0}–{:.0}]", t.median_ns, t.p10_ns, t.p90_ns);
    println!(
        "{:<34} {:>24} {:>24} {:>12}",
        "call", "embedded", "plugin", "overhead"
    );
    let rows = [
        ("no-op stage call", p.noop_call, e.map(|e| e.noop_call)),
        (
            "from_host + free [1,1,64]",
            p.transfer,
            e.map(|e| e.transfer),
        ),
        (
            "tiny layer decode step",
            p.layer_step,
            e.map(|e| e.layer_step),
        ),
    ];
    for (name, pt, et) in rows {
        match et {
            Some(et) => println!(
                "{name:<34} {:>24} {:>24} {:>9.0} ns",
                cell(&et),
                cell(&pt),
                pt.median_ns - et.median_ns
            ),
            None => println!("{name:<34} {:>24} {:>24}", "-", cell(&pt)),
        }
    }
    Ok(())
}

fn plugins_cmd(args: PluginsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let (dirs, found) = backend::list(&args.plugin_dirs);
    println!(
        "ABI version of this nsactor: {}",
        nsactor_plugin_abi::ABI_VERSION
    );
    if backend::has_embedded() {
        let b = backend::open(backend::EMBEDDED, &[])?.info();
        println!(
            "embedded    {} {}  ABI {}  devices: {}",
            b.name,
            b.version,
            b.abi_version,
            b.devices.join("; ")
        );
    }
    for l in &found {
        match (&l.plugin, &l.info) {
            (Ok(p), Some(Ok(info))) => println!(
                "{:<11} {}  ABI {}  devices: {}  ({})",
                p.name,
                p.version,
                p.abi_version,
                info.devices.join("; "),
                l.path.display()
            ),
            (Ok(p), Some(Err(e))) => println!(
                "{:<11} {}  ABI {}  unusable here: {e}  ({})",
                p.name,
                p.version,
                p.abi_version,
                l.path.display()
            ),
            (Err(e), _) => println!("refused     {e}"),
            (Ok(p), None) => println!("{:<11} {}  ({})", p.name, p.version, l.path.display()),
        }
    }
    if found.is_empty() {
        println!("no plugins found; searched:");
    } else {
        println!("searched:");
    }
    for d in dirs {
        println!("  {}", d.display());
    }
    Ok(())
}
