//! A training run assembled from what its command asked for ([`TrainRequest`]): joining a world
//! of processes when the environment names one, stopping on signals, the tokenizer and its
//! check, the batches and the held-out split, live metrics, the backend and the stages'
//! placement, the pipeline, a resume or `--init-from`, the run itself, and a sample of the
//! trained model. `nsactor train` parses its flags and makes this one call.

use crate::launch::{self, InitFrom};
use crate::prewarm::Prewarm;
use crate::world::{self, Rank};
use nsactor_data::Tokenizer;
use nsactor_decoding::Pipeline;
use nsactor_engine::config::RunConfig;
use nsactor_engine::decode::SamplingParams;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::OptimizerKind;
use nsactor_telemetry::{Exporter, TrainingMetrics};
use nsactor_training::heldout::HeldOut;
use nsactor_training::startup::Startup;
use nsactor_training::train::{self, RunSummary};
use std::path::PathBuf;

/// What a training run is asked to do.
#[derive(Debug, Clone)]
pub struct TrainRequest {
    /// The run's configuration, flags already applied.
    pub config: RunConfig,
    /// Corpus files (with `sft`, conversation files); none: the bundled books.
    pub corpus: Vec<PathBuf>,
    /// Prepared shards instead of a corpus.
    pub data: Option<PathBuf>,
    /// Fine-tune (AdamW, assistant tokens scored) instead of pretraining (Adam).
    pub sft: bool,
    /// Backend name or plugin path (default: the configuration's).
    pub backend: Option<String>,
    /// Continue from the run's newest valid checkpoint.
    pub resume: bool,
    /// Without `resume`: remove a previous run's files from the run directory instead of
    /// refusing to start there ([`crate::run_dir::claim`]).
    pub overwrite: bool,
    /// Start from another run's weights (while this run has no checkpoint of its own).
    pub init_from: Option<PathBuf>,
    /// Serve the run's Prometheus metrics here.
    pub metrics_addr: Option<String>,
    /// Text to continue with the trained model, printed by the command (none: no sample).
    pub sample: Option<String>,
}

/// How a training run ended, for the command to report.
#[derive(Debug)]
pub enum TrainOutcome {
    /// The run reached its last step (on rank 0 of a world; other ranks end [`Self::Rank`]).
    Finished {
        summary: RunSummary,
        /// The sample's text, when one was asked for.
        sample: Option<String>,
    },
    /// A signal stopped the run after a checkpoint; `--resume` continues it.
    Stopped { step: u64 },
    /// A rank other than 0 finished its part (or rank 0 ended the run while it was in a step).
    Rank,
}

/// Runs the training `req` describes in this process (one rank of a world when the
/// environment names one).
pub fn train(req: TrainRequest) -> Result<TrainOutcome, RuntimeError> {
    let mut startup = Startup::new();
    let mut cfg = req.config.clone();
    let world =
        nsactor_cluster::World::from_env().map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    let fingerprint = world::fingerprint(&cfg);
    if let Some(w) = &world {
        world::local_share(&mut cfg, w)?;
    }
    let stop = nsactor_training::shutdown::stop_on_signals(
        std::time::Duration::from_secs_f64(cfg.train.shutdown_grace_s),
        "finishing this step and writing a checkpoint (a resume starts from the newest complete one)",
    )?;
    let init = match &req.init_from {
        Some(run) => Some(InitFrom::open(run, &mut cfg)?),
        None => None,
    };
    if let Some(f) = &cfg.train.inject_fault {
        let fault: nsactor_engine::fault::Fault = f.parse()?;
        fault.fits_training(cfg.model.num_layers, cfg.train.steps)?;
    }
    let tok = Tokenizer::load_or_bundled(cfg.data.tokenizer.as_deref())?;
    nsactor_checkpoint::checkpoint::check_tokenizer(&cfg, &tok)?;
    let sampler = launch::make_sampler(&cfg, &tok, &req.corpus, req.data.as_deref(), req.sft)?;
    let (sampler, mut held_out) = HeldOut::split(&cfg, sampler)?;
    startup.mark("tokenizer and data");
    let rank = world.as_ref().map_or(0, |w| w.rank);
    let telemetry = |e: nsactor_telemetry::TelemetryError| RuntimeError::Invalid(e.to_string());
    let live = match (&req.metrics_addr, rank) {
        (Some(_), 0) => Some(TrainingMetrics::new().map_err(telemetry)?),
        _ => None,
    };
    let _exporter = match (&req.metrics_addr, &live) {
        (Some(addr), Some(m)) => {
            Some(Exporter::start(addr, m.registry().clone()).map_err(telemetry)?)
        }
        _ => None,
    };
    let compute = launch::open_training_backend(&cfg, req.backend.as_deref())?;
    startup.mark("backend");
    // Rank 0 writes the run's files, so it alone locks, looks at (and clears) its directory;
    // after the configuration, data and backend are known good, before anything is read from
    // it or written. The lock is held until the run returns.
    let _lock = if rank == 0 {
        let lock = crate::run_dir::RunLock::acquire(&cfg.train.out_dir)?;
        if !req.resume {
            crate::run_dir::claim(&cfg.train.out_dir, req.overwrite)?;
        }
        Some(lock)
    } else {
        None
    };
    let member = match world {
        Some(w) => {
            world::place(&mut cfg, &w, compute.as_ref());
            Some(Rank::join(w)?)
        }
        None => None,
    };
    let optimizer = if req.sft {
        OptimizerKind::AdamW
    } else {
        OptimizerKind::Adam
    };
    // The first step's kernels compiled beside the stages' opening and the first step.
    let _prewarm = Prewarm::start(&compute, &cfg);
    let link = member.as_ref().map(|m| m.link(&compute)).transpose()?;
    let mut pipeline = launch::launch_in(compute, &cfg, optimizer, Some(sampler), link)?;
    startup.mark("stages");
    let mut first_step = 0;
    if req.resume {
        first_step = launch::resume(&cfg, &tok, &mut pipeline)?;
    }
    let mut loaded_weights = false;
    if let Some(init) = init
        && first_step == 0
    {
        init.load(&tok, &mut pipeline)?;
        loaded_weights = true;
    }
    startup.mark("resume or initial weights");
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
        startup: Some(startup),
        loaded_weights,
        // The sample runs on the device while the final checkpoint is written.
        after_last_step: req.sample.clone().map(|prompt| {
            let (tok, seed) = (&tok, cfg.train.seed);
            Box::new(move |p: &mut Pipeline| {
                let t = std::time::Instant::now();
                let text = sample(p, tok, &prompt, seed)?;
                tracing::info!("sample in {:.2} s", t.elapsed().as_secs_f64());
                Ok(text)
            }) as train::AfterLastStep<'_>
        }),
    };
    let mut summary = match (train::run(&cfg, &mut pipeline, options), &member) {
        (Ok(s), _) => s,
        (Err(e), Some(m)) if m.peers.ended() => {
            // Rank 0 stopped the run on request while this rank was in a step.
            tracing::warn!("rank 0 ended the run ({e})");
            m.finish()?;
            return Ok(TrainOutcome::Rank);
        }
        (Err(e), m) => {
            if let Some(m) = m {
                m.abort(&e.to_string());
            }
            return Err(e);
        }
    };
    if let Some(m) = &member {
        m.finish()?;
        if m.rank() > 0 {
            return Ok(TrainOutcome::Rank);
        }
    }
    if let Some(step) = summary.stopped_at {
        return Ok(TrainOutcome::Stopped { step });
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
    let sample = summary.after_last_step.take();
    Ok(TrainOutcome::Finished { summary, sample })
}

/// 60 tokens after `prompt` (BOS first) from the trained model: seeded nucleus sampling with a
/// repetition penalty (a small model's greedy text loops), stopping at the end token, never
/// emitting the other specials; on one line.
fn sample(
    pipeline: &mut Pipeline,
    tok: &Tokenizer,
    prompt: &str,
    seed: u64,
) -> Result<String, RuntimeError> {
    let mut ids = vec![i64::from(tok.bos_id())];
    ids.extend(tok.encode(prompt)?.into_iter().map(i64::from));
    let eos = i64::from(tok.eos_id());
    let specials: Vec<i64> = (0..5).filter(|&id| id != eos).collect();
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.0,
        repetition_penalty: 1.2,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed,
    };
    let out = pipeline.generate(&ids, 60, Some(eos), &specials, sampling)?;
    let out: Vec<u32> = out.iter().map(|&t| t as u32).collect();
    Ok(tok.decode(&out, true)?.replace('\n', " "))
}
