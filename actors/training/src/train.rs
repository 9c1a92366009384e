//! The training loop behind `nsactor train`: steps on the actor pipeline, logging, metrics,
//! checkpoints, weights.

mod end;
mod records;

use crate::heldout::HeldOut;
use crate::shutdown::StopRequest;
use crate::startup::Startup;
use nsactor_data::Cursor;
use nsactor_decoding::{Pipeline, StepReport};
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use nsactor_telemetry::TrainingMetrics;
use nsactor_telemetry::training::StepSample;
use records::{MetricsLog, evaluate, log_shape, written};
use std::path::PathBuf;
use std::time::Instant;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub losses: Vec<f64>,
    pub tokens_per_s: f64,
    pub weights: PathBuf,
    /// Seconds each in-process recovery took (failure noticed → actors rebuilt and rolled back).
    pub recoveries: Vec<f64>,
    /// Steps skipped for a non-finite loss or gradient norm.
    pub skipped_steps: u64,
    /// Loss spikes the guard rolled back from.
    pub spike_rollbacks: u64,
    /// Set when a stop was asked for (SIGTERM, SIGINT): the step the run stopped after, with
    /// its checkpoint written; the final weights were not.
    pub stopped_at: Option<u64>,
    /// What [`RunOptions::after_last_step`] returned.
    pub after_last_step: Option<String>,
}

/// Resident memory of this process: (now, peak) in bytes, where the OS reports it.
pub fn memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Where a run's checkpoints live.
pub fn checkpoint_root(cfg: &RunConfig) -> PathBuf {
    cfg.train.out_dir.join("checkpoints")
}

/// What a run is given besides its configuration and pipeline.
#[derive(Default)]
pub struct RunOptions<'a> {
    /// Optimizer steps already done (a resume from that step's checkpoint).
    pub first_step: u64,
    /// Stored in every checkpoint's manifest.
    pub tokenizer_sha256: Option<String>,
    /// Polled after every step: once it is set the run writes a checkpoint of the step just
    /// finished and returns with `stopped_at`.
    pub stop: Option<&'a StopRequest>,
    /// Evaluated every `[train] eval_every` steps and at the last.
    pub held_out: Option<HeldOut>,
    /// The live registry (`--metrics-addr`), updated after every step.
    pub metrics: Option<&'a TrainingMetrics>,
    /// This process's rank in a world of several: only rank 0 writes metrics, checkpoints
    /// and weights; the others train alongside.
    pub rank: usize,
    /// The phases timed before the run (from the process's start): the run adds the step-0
    /// evaluation and the first step, then logs them.
    pub startup: Option<Startup>,
    /// The run starts from loaded weights (`--init-from`): unless `[train] eval_at_start`
    /// says otherwise, it is evaluated before its first step.
    pub loaded_weights: bool,
    /// Run on the trained model after the last step, while the final checkpoint and weights are
    /// written (a sample's text, returned in [`RunSummary::after_last_step`]).
    pub after_last_step: Option<AfterLastStep<'a>>,
}

/// Work on the trained pipeline after the last step ([`RunOptions::after_last_step`]).
pub type AfterLastStep<'a> = Box<dyn FnOnce(&mut Pipeline) -> Result<String, RuntimeError> + 'a>;

/// Runs the steps after `o.first_step` completed ones up to `cfg.train.steps` on `pipeline`
/// (whose data actor feeds them), logging every `log_interval` steps and every step to
/// `out_dir/metrics.jsonl` (appended to when resuming), evaluating the held-out set,
/// checkpointing every `checkpoint_every` steps and at the end, then writes
/// `out_dir/model.safetensors`, `out_dir/config.toml`, `out_dir/data_cursor.json` and
/// `out_dir/loss.png` (also drawn when a stop request ends the run early).
pub fn run(
    cfg: &RunConfig,
    pipeline: &mut Pipeline,
    o: RunOptions<'_>,
) -> Result<RunSummary, RuntimeError> {
    let at_start = cfg.train.eval_at_start.unwrap_or(o.loaded_weights);
    let mut run = Run::start(cfg, pipeline, o)?;
    if run.first_step == 0
        && at_start
        && let Some(h) = run.held_out.as_mut()
    {
        // The starting point, for the before/after of a fine-tune.
        evaluate(
            h,
            pipeline,
            0,
            &run.bar,
            &mut |l| run.metrics.log(l),
            run.live,
        )?;
    }
    if let Some(s) = run.startup.as_mut() {
        s.mark(if at_start {
            "run setup and step-0 evaluation"
        } else {
            "run setup"
        });
    }
    run.steps(pipeline)?;
    run.finish(pipeline)
}

/// A run's state from its start to its summary.
struct Run<'a> {
    cfg: &'a RunConfig,
    first_step: u64,
    tokenizer_sha256: Option<String>,
    stop: Option<&'a StopRequest>,
    held_out: Option<HeldOut>,
    live: Option<&'a TrainingMetrics>,
    leader: bool,
    out_dir: PathBuf,
    metrics: MetricsLog,
    losses: Vec<f64>,
    bar: indicatif::ProgressBar,
    start: Instant,
    /// The process's start (the startup clock's origin), or the run's when not given.
    origin: Instant,
    tokens: u64,
    config_text: String,
    ckpt_root: PathBuf,
    cursor: Option<Cursor>,
    recoveries: Vec<f64>,
    skipped_steps: u64,
    spike_rollbacks: u64,
    stopped_at: Option<u64>,
    /// The title of `loss.png`.
    title: String,
    startup: Option<Startup>,
    after_last_step: Option<AfterLastStep<'a>>,
    /// The final checkpoint (with the weights) is being written in the background: started
    /// right after the last step; the last evaluation and the work after the last step wait
    /// for its reads and go on beside its disk writes.
    final_in_flight: bool,
    /// The end's clock, started when the last step ended: its phases (the final checkpoint's
    /// start and reads, the last evaluation, then [`finish`](Self::finish)'s) are logged as one
    /// line and a `metrics.jsonl` `end` event.
    end: Option<Startup>,
}

impl<'a> Run<'a> {
    /// Creates `out_dir`, opens `metrics.jsonl`, logs the run's shape and starts the progress
    /// bar and the clock.
    fn start(
        cfg: &'a RunConfig,
        pipeline: &Pipeline,
        o: RunOptions<'a>,
    ) -> Result<Self, RuntimeError> {
        let RunOptions {
            first_step,
            tokenizer_sha256,
            stop,
            held_out,
            metrics: live,
            rank,
            startup,
            loaded_weights: _,
            after_last_step,
        } = o;
        let leader = rank == 0;
        let t = &cfg.train;
        let out_dir = t.out_dir.clone();
        std::fs::create_dir_all(&out_dir).map_err(|e| RuntimeError::Io(out_dir.clone(), e))?;
        let (metrics, losses) =
            MetricsLog::open(out_dir.join("metrics.jsonl"), first_step, leader)?;
        log_shape(cfg, pipeline);
        // Drawn only on a terminal; otherwise the log lines below are the progress.
        let bar = indicatif::ProgressBar::new(t.steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]",
            )
            .expect("a valid template"),
        );
        bar.set_position(first_step);
        let start = Instant::now();
        let origin = startup.as_ref().map_or(start, Startup::origin);
        let title = format!(
            "{} · {} parameters · {}",
            out_dir.display(),
            pipeline.param_count(),
            describe(pipeline.backend().as_ref())
        );
        Ok(Run {
            cfg,
            first_step,
            tokenizer_sha256,
            stop,
            held_out,
            live,
            leader,
            out_dir,
            metrics,
            losses,
            bar,
            start,
            origin,
            tokens: 0,
            config_text: cfg.to_toml(),
            ckpt_root: checkpoint_root(cfg),
            cursor: None,
            recoveries: Vec::new(),
            skipped_steps: 0,
            spike_rollbacks: 0,
            stopped_at: None,
            title,
            startup,
            after_last_step,
            final_in_flight: false,
            end: None,
        })
    }

    /// The steps up to `[train] steps`, or to a stop request: each step's record, then the
    /// held-out evaluation and checkpoint due after it. A recovery or a loss spike rolls the
    /// count back.
    fn steps(&mut self, pipeline: &mut Pipeline) -> Result<(), RuntimeError> {
        // From here a signal lets the step finish and checkpoints; before, it exits at once.
        if let Some(stop) = self.stop {
            stop.arm();
        }
        let mut step = self.first_step;
        while step < self.cfg.train.steps {
            let step_start = Instant::now();
            let r = match pipeline.step() {
                Ok(r) => r,
                Err(RuntimeError::Recovered {
                    cause,
                    to_step,
                    seconds,
                }) => {
                    self.bar.suspend(|| {
                        tracing::warn!(
                            "{cause}; actors rebuilt and rolled back to step {to_step} in {seconds:.2} s"
                        )
                    });
                    self.metrics.log(serde_json::json!({
                        "event": "recovered", "failed_step": step + 1, "to_step": to_step,
                        "seconds": seconds, "cause": cause,
                    }))?;
                    self.recoveries.push(seconds);
                    if let Some(m) = self.live {
                        m.recoveries.inc();
                    }
                    step = self.roll_back(to_step);
                    continue;
                }
                Err(RuntimeError::LossSpike {
                    step: failed,
                    loss,
                    mean,
                    factor,
                    to_step,
                }) => {
                    self.bar.suspend(|| {
                        tracing::warn!(
                            "step {failed}: loss {loss:.4} is over {factor} × the running mean \
                             {mean:.4}: no update; rolled back to step {to_step}, the batches of \
                             steps {}..={failed} are skipped",
                            to_step + 1
                        )
                    });
                    self.metrics.log(serde_json::json!({
                        "event": "loss_spike", "step": failed, "loss": loss, "mean": mean,
                        "factor": factor, "to_step": to_step,
                    }))?;
                    self.spike_rollbacks += 1;
                    if let Some(m) = self.live {
                        m.loss_spikes.inc();
                    }
                    step = self.roll_back(to_step);
                    continue;
                }
                Err(e) => return Err(e),
            };
            // The step's own time, without the logging, evaluation and checkpoints around it.
            let step_s = step_start.elapsed().as_secs_f64();
            step = r.step;
            self.record(&r, step_s)?;
            if let Some(mut s) = self.startup.take() {
                s.mark("first step");
                self.bar.suspend(|| tracing::info!("{}", s.line()));
                self.metrics.log(s.event())?;
            }
            self.cursor = r.cursor;
            if self.after_step(pipeline, r.step)? {
                break;
            }
        }
        Ok(())
    }

    /// Drops the losses after `to_step`, the step the run goes on from; returns it.
    fn roll_back(&mut self, to_step: u64) -> u64 {
        self.losses.truncate(to_step as usize);
        self.bar.set_position(to_step);
        to_step
    }

    /// A finished step's record: its loss, its `metrics.jsonl` line, the live registry, the
    /// warnings it calls for, the progress bar and, every `log_interval` steps, a log line.
    fn record(&mut self, r: &StepReport, step_s: f64) -> Result<(), RuntimeError> {
        let stats = r.stats;
        self.tokens += stats.tokens;
        let tokens = self.tokens;
        // A step whose batch has no loss-mask token (SFT rows that score nothing) has no
        // cross entropy: its loss is the ponder term alone, logged as null (NaN in the
        // curve), never as ~0.
        let scored = stats.tokens > 0;
        self.losses.push(if scored { stats.loss } else { f64::NAN });
        let elapsed = self.start.elapsed().as_secs_f64();
        let mem = memory();
        let (loss, ce, ppl) = match scored {
            true => (Some(stats.loss), Some(stats.ce), Some(stats.ce.exp())),
            false => (None, None, None),
        };
        if !scored {
            self.bar.suspend(|| {
                tracing::warn!(
                    "step {}: no token of the batch is scored (loss mask empty); its loss is \
                     logged as null",
                    r.step
                )
            });
        }
        let line = serde_json::json!({
            "step": r.step, "loss": loss, "ce": ce, "ppl": ppl, "lr": r.lr,
            "scored_tokens": stats.tokens,
            "expected_k": stats.expected_k, "expected_k_min": stats.expected_k_min,
            "expected_k_max": stats.expected_k_max, "grad_norm": stats.grad_norm,
            "tokens": tokens, "tokens_per_s": tokens as f64 / elapsed,
            "rss_bytes": mem.map(|m| m.0), "peak_rss_bytes": mem.map(|m| m.1),
            "skipped": stats.skipped,
            "step_s": step_s, "data_wait_s": r.data_wait_s,
            "wall_s": self.origin.elapsed().as_secs_f64(),
        });
        self.metrics.log(line)?;
        if let Some(m) = self.live {
            m.record(&StepSample {
                step: r.step,
                loss,
                lr: r.lr,
                expected_k: stats.expected_k,
                grad_norm: stats.grad_norm,
                tokens: stats.tokens,
                tokens_per_second: tokens as f64 / elapsed,
                seconds: step_s,
                skipped: stats.skipped,
            });
        }
        if stats.skipped {
            self.skipped_steps += 1;
            let skipped_steps = self.skipped_steps;
            self.bar.suspend(|| {
                tracing::warn!(
                    "step {}: loss {} and gradient norm {} are not all finite: step skipped (no \
                     parameter or optimizer change; {skipped_steps} skipped so far)",
                    r.step,
                    stats.loss,
                    stats.grad_norm
                )
            });
        }
        self.progress(r, elapsed);
        Ok(())
    }

    /// The progress bar after a step, and its log line every `log_interval` steps (and at the
    /// first and the last).
    fn progress(&self, r: &StepReport, elapsed: f64) {
        let (t, tokens, stats) = (&self.cfg.train, self.tokens, r.stats);
        self.bar.set_position(r.step);
        self.bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | E[K] {:.2}",
            stats.loss,
            tokens as f64 / elapsed,
            stats.expected_k
        ));
        if r.step.is_multiple_of(t.log_interval)
            || r.step == self.first_step + 1
            || r.step == t.steps
        {
            let line = format!(
                "step {:>6}/{} loss {:.4} ppl {:>8.2} lr {:.2e} E[K] {:.3} [{:.2}, {:.2}] |g| {:.3} {:.0} tok/s",
                r.step,
                t.steps,
                stats.loss,
                stats.ce.exp(),
                r.lr,
                stats.expected_k,
                stats.expected_k_min,
                stats.expected_k_max,
                stats.grad_norm,
                tokens as f64 / elapsed
            );
            self.bar.suspend(|| tracing::info!("{line}"));
        }
    }

    /// What is due after step `step`: the held-out evaluation, a checkpoint (periodic, or on a
    /// stop request), and the stop itself. True when the run stops here.
    fn after_step(&mut self, pipeline: &mut Pipeline, step: u64) -> Result<bool, RuntimeError> {
        let t = &self.cfg.train;
        if self.leader && step == t.steps {
            // The final checkpoint and weights first, read back with the device to
            // themselves (two readers, ahead of the disk); the last evaluation and the work
            // after the last step then run beside their disk writes. Beside the reads, the
            // evaluation slowed them to 15 s against 4 s alone, and a sample that compiled
            // its kernels took the run's end to 22 s against 12 s (sessions 52 and 53).
            let mut end = Startup::new();
            self.start_final(pipeline, &mut end)?;
            self.end = Some(end);
        }
        if let Some(h) = self.held_out.as_mut()
            && (step.is_multiple_of(t.eval_every) || step == t.steps)
        {
            evaluate(
                h,
                pipeline,
                step,
                &self.bar,
                &mut |l| self.metrics.log(l),
                self.live,
            )?;
            if let Some(end) = self.end.as_mut().filter(|_| step == t.steps) {
                end.mark("the last evaluation");
            }
        }
        let signal = self.stop.and_then(StopRequest::requested);
        let periodic = t.checkpoint_every > 0 && step.is_multiple_of(t.checkpoint_every);
        if self.leader && (periodic || signal.is_some()) && step < t.steps {
            // On a stop the checkpoint is written before returning, whatever the mode.
            let background = t.async_checkpoint && signal.is_none();
            let c = pipeline.checkpoint_with(
                &self.ckpt_root,
                t.keep_checkpoints,
                self.config_text.clone(),
                self.tokenizer_sha256.clone(),
                background,
            )?;
            self.metrics.log(serde_json::json!({
                "event": "checkpoint", "step": c.step, "background": background,
                "snapshot_s": c.snapshot_seconds, "waited_s": c.waited_seconds,
            }))?;
            for w in c.previous.into_iter().chain(c.written.map(Ok)) {
                self.bar
                    .suspend(|| written(w, &mut |l| self.metrics.log(l)))?;
            }
        }
        if let Some(sig) = signal
            && step < t.steps
        {
            self.metrics.log(serde_json::json!({
                "event": "stopped", "step": step, "signal": crate::shutdown::signal_name(sig),
            }))?;
            self.stopped_at = Some(step);
            return Ok(true);
        }
        Ok(false)
    }
}

/// `ndarray 0.1.0 (cpu (2 threads, f32))`.
pub fn describe(backend: &dyn nsactor_plugin_api::ComputeBackend) -> String {
    let info = backend.info();
    format!(
        "{} {} ({})",
        info.name,
        info.version,
        info.devices.join(", ")
    )
}
