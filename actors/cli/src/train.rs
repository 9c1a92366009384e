//! `nsactor train`: a training run from the command line.

use crate::args::LayoutArgs;
use nsactor_engine::config::{Overrides, RunConfig};
use nsactor_launch::training::{self, TrainOutcome, TrainRequest};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct TrainArgs {
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
    #[command(flatten)]
    layout: LayoutArgs,
    /// Continue from the newest valid checkpoint in `<out_dir>/checkpoints` (a fresh start,
    /// or --init-from, when there is none).
    #[arg(long)]
    resume: bool,
    /// Start from step 0 in a directory that holds another run: remove its checkpoints,
    /// metrics, weights and plot first (without it such a directory is refused).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Start from the weights of another run's newest valid checkpoint (a run directory,
    /// its checkpoints root or one checkpoint), of a Hugging Face directory, or of a Hub model
    /// `owner/name[@revision]` (fetched into the Hub cache; an existing path wins): its [model]
    /// table (and a Hugging Face model's tokenizer, unless the run names one), step 0, fresh
    /// optimizer state. With --resume it applies only while this run has no checkpoint of
    /// its own.
    #[arg(long, value_name = "RUN|OWNER/NAME")]
    init_from: Option<String>,
    /// Override [train].eval_every: steps between held-out evaluations.
    #[arg(long)]
    eval_every: Option<u64>,
    /// Serve the run's Prometheus metrics (loss, tokens/s, E[K], step time …) at
    /// http://ADDR/metrics, e.g. 127.0.0.1:9400.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<String>,
    /// Override [train].checkpoint_every.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Inject one failure to exercise recovery: `layer-panic:LAYER:STEP` (the layer actor
    /// panics; the supervisor rebuilds the actors and rolls back to the newest checkpoint),
    /// `crash-in-checkpoint:STEP` (the process aborts mid-checkpoint),
    /// `enospc-in-checkpoint:STEP` (that checkpoint's write fails as on a full disk) or
    /// `nan-grad:STEP` (that step's gradients are NaN; the step is skipped),
    /// `loss-spike:STEP` (that step measures 100× its loss; see --loss-spike-factor) or
    /// `kill-rank:RANK:STEP` (with --nproc-per-node: that rank's process dies from SIGKILL
    /// mid-step). Overrides [train].inject_fault.
    #[arg(long)]
    inject_fault: Option<String>,
    /// Roll back to the newest checkpoint and skip the batches since it when a step's loss
    /// exceeds this factor × the running mean (0: off). Overrides [train].loss_spike_factor.
    #[arg(long)]
    loss_spike_factor: Option<f64>,
    /// Run the training in a child process and restart it with --resume when it dies (a
    /// signal or a non-zero exit), at most this many times within --restart-window.
    #[arg(long)]
    max_restarts: Option<u32>,
    /// Seconds over which --max-restarts counts restarts.
    #[arg(long, default_value_t = 3600.0, requires = "max_restarts")]
    restart_window: f64,
    /// Seconds before the first restart; doubled for each further restart in the window, up
    /// to a minute.
    #[arg(long, default_value_t = 1.0, requires = "max_restarts")]
    restart_backoff: f64,
    #[command(flatten)]
    group: crate::group::GroupArgs,
    /// Text the trained model continues at the end of the run, printed on one line (empty:
    /// no sample).
    #[arg(long, default_value = "Emma was", value_name = "TEXT")]
    sample: String,
}

pub fn run(args: TrainArgs) -> crate::result::CliResult {
    let mut cfg = RunConfig::load(args.config.as_deref())?;
    cfg.apply(&Overrides {
        steps: args.steps,
        out_dir: args.out.clone(),
        seed: args.seed,
        checkpoint_every: args.checkpoint_every,
        inject_fault: args.inject_fault.clone(),
        loss_spike_factor: args.loss_spike_factor,
        eval_every: args.eval_every,
        tokenizer: args.tokenizer.clone(),
        ..args.layout.overrides()?
    })?;
    let group = args.group.group()?;
    if args.max_restarts.is_some() || group.is_some() {
        let max_restarts = args.max_restarts.unwrap_or(0);
        let secs = |name: &str, v: f64| {
            (v.is_finite() && v >= 0.0)
                .then(|| std::time::Duration::from_secs_f64(v))
                .ok_or_else(|| format!("--{name} must be a number of seconds ≥ 0, got {v}"))
        };
        let policy = nsactor_engine::supervision::RestartPolicy {
            max_restarts,
            window: secs("restart-window", args.restart_window)?,
            backoff: secs("restart-backoff", args.restart_backoff)?,
        };
        return crate::agent::supervise(policy, &cfg.train.out_dir, group);
    }
    let outcome = training::train(TrainRequest {
        config: cfg,
        corpus: args.corpus,
        data: args.data,
        sft: args.sft,
        backend: args.layout.backend,
        resume: args.resume,
        overwrite: args.overwrite,
        init_from: args
            .init_from
            .as_deref()
            .map(|m| nsactor_checkpoint::hub::resolve(m, None).map(|r| r.path))
            .transpose()?,
        metrics_addr: args.metrics_addr,
        sample: Some(args.sample).filter(|s| !s.is_empty()),
    })?;
    if let TrainOutcome::Finished {
        sample: Some(text), ..
    } = outcome
    {
        println!("{text}");
    }
    Ok(())
}
