//! The training loop behind `nsactor train`: steps on the actor pipeline, logging, metrics,
//! checkpoints, weights.

use crate::heldout::HeldOut;
use crate::history::previous_metrics;
use crate::shutdown::StopRequest;
use nsactor_checkpoint::writer::WriteDone;
use nsactor_decoding::Pipeline;
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use nsactor_telemetry::TrainingMetrics;
use nsactor_telemetry::training::StepSample;
use std::io::Write;
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
}

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
    let RunOptions {
        first_step,
        tokenizer_sha256,
        stop,
        mut held_out,
        metrics: live,
        rank,
    } = o;
    let leader = rank == 0;
    let t = &cfg.train;
    let out_dir = t.out_dir.clone();
    std::fs::create_dir_all(&out_dir).map_err(|e| RuntimeError::Io(out_dir.clone(), e))?;
    let metrics_path = out_dir.join("metrics.jsonl");
    // Resuming: keep the metrics of the steps the checkpoint holds, drop any logged after it.
    let mut losses = Vec::new();
    if first_step > 0 && leader {
        let (kept, text) = previous_metrics(&metrics_path, first_step);
        losses = kept;
        nsactor_checkpoint::weights::write_atomic(&metrics_path, text.as_bytes())
            .map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?;
    }
    let mut metrics: Box<dyn Write> = match leader {
        true => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(first_step > 0)
                .truncate(first_step == 0)
                .open(&metrics_path)
                .map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?,
        ),
        false => Box::new(std::io::sink()),
    };
    tracing::info!(
        "{} parameters on {}; {} steps × {} micro-batches × {}×{} tokens; pipeline {} [{}], imbalance {:.2} (devices {:.2})",
        pipeline.param_count(),
        describe(pipeline.backend().as_ref()),
        t.steps,
        t.accumulation,
        t.batch_size,
        t.seq_len,
        pipeline.plan().num_stages(),
        pipeline.plan().describe(),
        pipeline.plan().imbalance(),
        pipeline.plan().device_imbalance()
    );
    let replicas = pipeline.replica_plans();
    if replicas.len() > 1 {
        let layouts: Vec<String> = replicas
            .iter()
            .map(|p| format!("[{}]", p.describe()))
            .collect();
        tracing::info!(
            "data parallelism: {} replicas {}, {:?} reduction",
            replicas.len(),
            layouts.join(" "),
            t.dp_reduce.resolve(&pipeline.backend().info().name)
        );
    }
    // Drawn only on a terminal; otherwise the log lines below are the progress.
    let bar = indicatif::ProgressBar::new(t.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("a valid template"),
    );
    bar.set_position(first_step);
    let start = Instant::now();
    let mut tokens = 0u64;
    let config_text = cfg.to_toml();
    let ckpt_root = checkpoint_root(cfg);
    let mut last_saved = first_step;
    let mut cursor = None;
    let mut recoveries = Vec::new();
    let mut skipped_steps = 0u64;
    let mut spike_rollbacks = 0u64;
    let mut stopped_at = None;
    let mut log = |line: serde_json::Value| {
        writeln!(metrics, "{line}").map_err(|e| RuntimeError::Io(metrics_path.clone(), e))
    };
    let title = format!(
        "{} · {} parameters · {}",
        out_dir.display(),
        pipeline.param_count(),
        describe(pipeline.backend().as_ref())
    );
    if first_step == 0
        && let Some(h) = held_out.as_mut()
    {
        // The starting point, for the before/after of a fine-tune.
        evaluate(h, pipeline, 0, &bar, &mut log, live)?;
    }
    let mut step = first_step;
    while step < t.steps {
        let step_start = Instant::now();
        let r = match pipeline.step() {
            Ok(r) => r,
            Err(RuntimeError::Recovered {
                cause,
                to_step,
                seconds,
            }) => {
                bar.suspend(|| {
                    tracing::warn!(
                        "{cause}; actors rebuilt and rolled back to step {to_step} in {seconds:.2} s"
                    )
                });
                log(serde_json::json!({
                    "event": "recovered", "failed_step": step + 1, "to_step": to_step,
                    "seconds": seconds, "cause": cause,
                }))?;
                recoveries.push(seconds);
                if let Some(m) = live {
                    m.recoveries.inc();
                }
                losses.truncate(to_step as usize);
                step = to_step;
                bar.set_position(step);
                continue;
            }
            Err(RuntimeError::LossSpike {
                step: failed,
                loss,
                mean,
                factor,
                to_step,
            }) => {
                bar.suspend(|| {
                    tracing::warn!(
                        "step {failed}: loss {loss:.4} is over {factor} × the running mean \
                         {mean:.4}: no update; rolled back to step {to_step}, the batches of \
                         steps {}..={failed} are skipped",
                        to_step + 1
                    )
                });
                log(serde_json::json!({
                    "event": "loss_spike", "step": failed, "loss": loss, "mean": mean,
                    "factor": factor, "to_step": to_step,
                }))?;
                spike_rollbacks += 1;
                if let Some(m) = live {
                    m.loss_spikes.inc();
                }
                losses.truncate(to_step as usize);
                step = to_step;
                bar.set_position(step);
                continue;
            }
            Err(e) => return Err(e),
        };
        // The step's own time, without the logging, evaluation and checkpoints around it.
        let step_s = step_start.elapsed().as_secs_f64();
        step = r.step;
        let stats = r.stats;
        cursor = r.cursor;
        tokens += stats.tokens;
        // A step whose batch has no loss-mask token (SFT rows that score nothing) has no
        // cross entropy: its loss is the ponder term alone, logged as null (NaN in the
        // curve), never as ~0.
        let scored = stats.tokens > 0;
        losses.push(if scored { stats.loss } else { f64::NAN });
        let elapsed = start.elapsed().as_secs_f64();
        let mem = memory();
        let (loss, ce, ppl) = match scored {
            true => (Some(stats.loss), Some(stats.ce), Some(stats.ce.exp())),
            false => (None, None, None),
        };
        if !scored {
            bar.suspend(|| {
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
        });
        log(line)?;
        if let Some(m) = live {
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
            skipped_steps += 1;
            bar.suspend(|| {
                tracing::warn!(
                    "step {}: loss {} and gradient norm {} are not all finite: step skipped (no \
                     parameter or optimizer change; {skipped_steps} skipped so far)",
                    r.step,
                    stats.loss,
                    stats.grad_norm
                )
            });
        }
        bar.set_position(r.step);
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | E[K] {:.2}",
            stats.loss,
            tokens as f64 / elapsed,
            stats.expected_k
        ));
        if r.step % t.log_interval == 0 || r.step == first_step + 1 || r.step == t.steps {
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
            bar.suspend(|| tracing::info!("{line}"));
        }
        if let Some(h) = held_out.as_mut()
            && (r.step % t.eval_every == 0 || r.step == t.steps)
        {
            evaluate(h, pipeline, r.step, &bar, &mut log, live)?;
        }
        let signal = stop.and_then(StopRequest::requested);
        let periodic = t.checkpoint_every > 0 && r.step % t.checkpoint_every == 0;
        if leader && (periodic || signal.is_some()) && r.step < t.steps {
            // On a stop the checkpoint is written before returning, whatever the mode.
            let background = t.async_checkpoint && signal.is_none();
            let c = pipeline.checkpoint_with(
                &ckpt_root,
                t.keep_checkpoints,
                config_text.clone(),
                tokenizer_sha256.clone(),
                background,
            )?;
            log(serde_json::json!({
                "event": "checkpoint", "step": c.step, "background": background,
                "snapshot_s": c.snapshot_seconds, "waited_s": c.waited_seconds,
            }))?;
            for w in c.previous.into_iter().chain(c.written.map(Ok)) {
                bar.suspend(|| written(w, &mut log))?;
            }
            last_saved = r.step;
        }
        if let Some(sig) = signal
            && r.step < t.steps
        {
            log(serde_json::json!({
                "event": "stopped", "step": r.step, "signal": crate::shutdown::signal_name(sig),
            }))?;
            stopped_at = Some(r.step);
            break;
        }
    }
    bar.finish_and_clear();
    let summary = |weights| RunSummary {
        losses: losses.clone(),
        tokens_per_s: tokens as f64 / start.elapsed().as_secs_f64(),
        weights,
        recoveries: recoveries.clone(),
        skipped_steps,
        spike_rollbacks,
        stopped_at,
    };
    if !leader {
        return Ok(summary(PathBuf::new()));
    }
    if let Some(w) = pipeline.finish_checkpoint().transpose() {
        written(w, &mut log)?;
    }
    if stopped_at.is_none() && (last_saved < t.steps || first_step == t.steps) {
        let dir = pipeline.checkpoint(
            &ckpt_root,
            t.keep_checkpoints,
            config_text.clone(),
            tokenizer_sha256,
        )?;
        tracing::info!("checkpoint {}", dir.display());
    }
    if let Some(s) = stopped_at {
        tracing::warn!(
            "stopped after step {s} on request; its checkpoint is in {}: `--resume` continues",
            ckpt_root.display()
        );
        draw_curves(&metrics_path, &out_dir.join("loss.png"), title);
        return Ok(summary(PathBuf::new()));
    }
    draw_curves(&metrics_path, &out_dir.join("loss.png"), title);
    let weights = out_dir.join("model.safetensors");
    let merged = nsactor_checkpoint::weights::merge_params(&pipeline.save_stages()?)?;
    nsactor_checkpoint::weights::write_atomic(&weights, &merged)
        .map_err(|e| RuntimeError::Io(weights.clone(), e))?;
    let config_path = out_dir.join("config.toml");
    nsactor_checkpoint::weights::write_atomic(&config_path, config_text.as_bytes())
        .map_err(|e| RuntimeError::Io(config_path, e))?;
    if let Some(c) = cursor {
        let cursor_path = out_dir.join("data_cursor.json");
        let text = serde_json::to_string(&c).expect("a cursor serialises");
        nsactor_checkpoint::weights::write_atomic(&cursor_path, text.as_bytes())
            .map_err(|e| RuntimeError::Io(cursor_path, e))?;
    }
    Ok(summary(weights))
}

/// Evaluates the held-out set after `step` steps: a log line, an `eval` event in
/// `metrics.jsonl` and the live gauge.
fn evaluate(
    h: &mut HeldOut,
    pipeline: &mut Pipeline,
    step: u64,
    bar: &indicatif::ProgressBar,
    log: &mut impl FnMut(serde_json::Value) -> Result<(), RuntimeError>,
    live: Option<&TrainingMetrics>,
) -> Result<(), RuntimeError> {
    let e = h.evaluate(pipeline)?;
    let (batches, rows) = h.shape();
    bar.suspend(|| match e.ce {
        Some(ce) => tracing::info!(
            "step {step:>6} held-out CE {ce:.4} ppl {:.2} over {} tokens ({batches} × {rows} rows, {:.2} s)",
            ce.exp(),
            e.tokens,
            e.seconds
        ),
        None => tracing::warn!("step {step}: the held-out set scores no token"),
    });
    log(serde_json::json!({
        "event": "eval", "step": step, "eval_loss": e.ce,
        "eval_ppl": e.ce.map(f64::exp), "eval_tokens": e.tokens, "seconds": e.seconds,
    }))?;
    if let (Some(m), Some(ce)) = (live, e.ce) {
        m.eval_loss.set(ce);
    }
    Ok(())
}

/// Draws `loss.png`; a picture that cannot be drawn or written is a warning: the run's
/// results are the weights and the metrics.
fn draw_curves(metrics: &std::path::Path, png: &std::path::Path, title: String) {
    match crate::history::draw(metrics, png, title) {
        Ok(()) => tracing::info!("training curves in {}", png.display()),
        Err(e) => tracing::warn!("{} not drawn: {e}", png.display()),
    }
}

/// Logs how a checkpoint write ended: written (with its throughput) or failed. A failed write
/// leaves the previous checkpoints as they were; training goes on.
fn written(
    w: Result<WriteDone, RuntimeError>,
    log: &mut impl FnMut(serde_json::Value) -> Result<(), RuntimeError>,
) -> Result<(), RuntimeError> {
    match w {
        Ok(w) => {
            tracing::info!(
                "checkpoint {} ({:.1} MB in {:.2} s)",
                w.dir.display(),
                w.bytes as f64 / 1e6,
                w.seconds
            );
            log(serde_json::json!({
                "event": "checkpoint_written", "step": w.step, "bytes": w.bytes,
                "write_s": w.seconds, "mb_per_s": w.bytes as f64 / 1e6 / w.seconds.max(1e-9),
            }))
        }
        Err(e) => {
            tracing::error!(
                "checkpoint write failed: {e}; the previous checkpoints are kept, training goes on"
            );
            log(serde_json::json!({"event": "checkpoint_failed", "cause": e.to_string()}))
        }
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
