//! `nsactor train`: a training run from the command line.

use crate::args::LayoutArgs;
use nsactor_plugin_api::OptimizerKind;
use nsactor_runtime::config::{Overrides, RunConfig};
use nsactor_runtime::heldout::HeldOut;
use nsactor_runtime::launch::{self};
use nsactor_runtime::train;
use nsactor_telemetry::{Exporter, TrainingMetrics};
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
    /// Start from the weights of another run's newest valid checkpoint (a run directory,
    /// its checkpoints root or one checkpoint): its [model] table, step 0, fresh optimizer
    /// state. With --resume it applies only while this run has no checkpoint of its own.
    #[arg(long, value_name = "RUN")]
    init_from: Option<PathBuf>,
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
}

pub fn run(args: TrainArgs) -> crate::CliResult {
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
        let policy = crate::agent::RestartPolicy {
            max_restarts,
            window: secs("restart-window", args.restart_window)?,
            backoff: secs("restart-backoff", args.restart_backoff)?,
        };
        return crate::agent::supervise(policy, &cfg.train.out_dir, group);
    }
    // One rank of several processes (the environment says so), or the whole run.
    let world = nsactor_cluster::World::from_env()?;
    let fingerprint = crate::world::fingerprint(&cfg);
    if let Some(w) = &world {
        crate::world::local_share(&mut cfg, w)?;
    }
    let stop = nsactor_runtime::shutdown::stop_on_signals(
        std::time::Duration::from_secs_f64(cfg.train.shutdown_grace_s),
        "finishing this step and writing a checkpoint (a resume starts from the newest complete one)",
    )?;
    let init = match &args.init_from {
        Some(run) => Some(launch::InitFrom::open(run, &mut cfg)?),
        None => None,
    };
    let tok = nsactor_data::cli::load_tokenizer(cfg.data.tokenizer.as_deref())?;
    train::check_tokenizer(&cfg, &tok)?;
    let sampler = launch::make_sampler(&cfg, &tok, &args.corpus, args.data.as_deref(), args.sft)?;
    let (sampler, mut held_out) = HeldOut::split(&cfg, sampler)?;
    let rank = world.as_ref().map_or(0, |w| w.rank);
    let live = match (&args.metrics_addr, rank) {
        (Some(_), 0) => Some(TrainingMetrics::new()?),
        _ => None,
    };
    let _exporter = match (&args.metrics_addr, &live) {
        (Some(addr), Some(m)) => Some(Exporter::start(addr, m.registry().clone())?),
        _ => None,
    };
    let compute = launch::open_backend(&cfg, args.layout.backend.as_deref())?;
    let member = match world {
        Some(w) => {
            crate::world::place(&mut cfg, &w, compute.as_ref());
            Some(crate::world::Rank::join(w)?)
        }
        None => None,
    };
    let optimizer = if args.sft {
        OptimizerKind::AdamW
    } else {
        OptimizerKind::Adam
    };
    let link = member.as_ref().map(|m| m.link(&compute)).transpose()?;
    let mut pipeline = launch::launch_in(compute, &cfg, optimizer, Some(sampler), link)?;
    let mut first_step = 0;
    if args.resume {
        first_step = launch::resume(&cfg, &tok, &mut pipeline)?;
    }
    if let Some(init) = init
        && first_step == 0
    {
        init.load(&tok, &mut pipeline)?;
    }
    if let Some(m) = &member {
        m.agree(fingerprint, first_step)?;
    }
    if rank > 0 {
        // Rank 0 evaluates and writes; a stop request is rank 0's to act on.
        held_out = None;
    }
    let options = train::RunOptions {
        first_step,
        tokenizer_sha256: Some(tok.hash().to_string()),
        stop: (rank == 0).then_some(&stop),
        held_out,
        metrics: live.as_ref(),
        rank,
    };
    let summary = match (train::run(&cfg, &mut pipeline, options), &member) {
        (Ok(s), _) => s,
        (Err(e), Some(m)) if m.peers.ended() => {
            // Rank 0 stopped the run on request while this rank was in a step.
            tracing::warn!("rank 0 ended the run ({e})");
            return m.finish();
        }
        (Err(e), m) => {
            if let Some(m) = m {
                m.abort(&e.to_string());
            }
            return Err(e.into());
        }
    };
    if let Some(m) = &member {
        m.finish()?;
        if m.rank() > 0 {
            return Ok(());
        }
    }
    if summary.stopped_at.is_some() {
        return Ok(());
    }
    // Steps that scored no token have no loss (NaN).
    let mut scored = summary.losses.iter().copied().filter(|l| l.is_finite());
    let first = scored.next().unwrap_or(f64::NAN);
    let last = scored.next_back().unwrap_or(first);
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
    let sampling = nsactor_runtime::decode::SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.95,
        repetition_penalty: 1.2,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: cfg.train.seed,
    };
    let out = pipeline.generate(&ids, 60, Some(eos), &specials, sampling)?;
    let out: Vec<u32> = out.iter().map(|&t| t as u32).collect();
    println!("{}", tok.decode(&out, true)?.replace('\n', " "));
    Ok(())
}
