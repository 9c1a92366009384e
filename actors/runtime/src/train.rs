//! The training loop behind `nsactor train`: steps on the actor pipeline, logging, metrics,
//! checkpoints, weights.

use crate::config::RunConfig;
use crate::error::RuntimeError;
use crate::pipeline::Pipeline;
use nsactor_data::Tokenizer;
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
}

/// Fails when `tok` has ids the model's embedding cannot hold.
pub fn check_tokenizer(cfg: &RunConfig, tok: &Tokenizer) -> Result<(), RuntimeError> {
    match cfg.model.vocab_size {
        v if tok.vocab_size() <= v => Ok(()),
        v => Err(RuntimeError::Invalid(format!(
            "tokenizer {} has {} tokens but [model] vocab_size is {}; set vocab_size ≥ {} or use \
             a smaller tokenizer",
            tok.origin(),
            tok.vocab_size(),
            v,
            tok.vocab_size()
        ))),
    }
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

/// Runs the steps after `first_step` completed ones up to `cfg.train.steps` on `pipeline`
/// (whose data actor feeds them), logging every `log_interval` steps and every step to
/// `out_dir/metrics.jsonl` (appended to when resuming), checkpointing every
/// `checkpoint_every` steps and at the end, then writes `out_dir/model.safetensors`,
/// `out_dir/config.toml`, `out_dir/data_cursor.json` and `out_dir/loss.png`.
pub fn run(
    cfg: &RunConfig,
    pipeline: &mut Pipeline,
    first_step: u64,
    tokenizer_sha256: Option<String>,
) -> Result<RunSummary, RuntimeError> {
    let t = &cfg.train;
    let out_dir = t.out_dir.clone();
    std::fs::create_dir_all(&out_dir).map_err(|e| RuntimeError::Io(out_dir.clone(), e))?;
    let metrics_path = out_dir.join("metrics.jsonl");
    // Resuming: keep the metrics of the steps the checkpoint holds, drop any logged after it.
    let mut losses = Vec::new();
    if first_step > 0 {
        let (kept, text) = previous_metrics(&metrics_path, first_step);
        losses = kept;
        crate::weights::write_atomic(&metrics_path, text.as_bytes())
            .map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?;
    }
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(first_step > 0)
        .truncate(first_step == 0)
        .open(&metrics_path)
        .map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?;
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
    // Drawn only on a terminal; otherwise the log lines below are the progress.
    let bar = indicatif::ProgressBar::new(t.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("a valid template"),
    );
    bar.set_position(first_step);
    let start = Instant::now();
    let mut tokens = 0u64;
    let config_text = toml::to_string(cfg).expect("a RunConfig serialises");
    let ckpt_root = checkpoint_root(cfg);
    let mut last_saved = first_step;
    let mut cursor = None;
    let mut recoveries = Vec::new();
    let mut step = first_step;
    while step < t.steps {
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
                let line = serde_json::json!({
                    "event": "recovered", "failed_step": step + 1, "to_step": to_step,
                    "seconds": seconds, "cause": cause,
                });
                writeln!(metrics, "{line}")
                    .map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?;
                recoveries.push(seconds);
                losses.truncate(to_step as usize);
                step = to_step;
                bar.set_position(step);
                continue;
            }
            Err(e) => return Err(e),
        };
        step = r.step;
        let stats = r.stats;
        cursor = r.cursor;
        tokens += stats.tokens;
        losses.push(stats.loss);
        let elapsed = start.elapsed().as_secs_f64();
        let mem = memory();
        let line = serde_json::json!({
            "step": r.step, "loss": stats.loss, "ce": stats.ce, "ppl": stats.ce.exp(), "lr": r.lr,
            "expected_k": stats.expected_k, "expected_k_min": stats.expected_k_min,
            "expected_k_max": stats.expected_k_max, "grad_norm": stats.grad_norm,
            "tokens": tokens, "tokens_per_s": tokens as f64 / elapsed,
            "rss_bytes": mem.map(|m| m.0), "peak_rss_bytes": mem.map(|m| m.1),
        });
        writeln!(metrics, "{line}").map_err(|e| RuntimeError::Io(metrics_path.clone(), e))?;
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
        if t.checkpoint_every > 0 && r.step % t.checkpoint_every == 0 && r.step < t.steps {
            let dir = pipeline.checkpoint(
                &ckpt_root,
                t.keep_checkpoints,
                config_text.clone(),
                tokenizer_sha256.clone(),
            )?;
            last_saved = r.step;
            bar.suspend(|| tracing::info!("checkpoint {}", dir.display()));
        }
    }
    bar.finish_and_clear();
    if last_saved < t.steps || first_step == t.steps {
        let dir = pipeline.checkpoint(
            &ckpt_root,
            t.keep_checkpoints,
            config_text.clone(),
            tokenizer_sha256,
        )?;
        tracing::info!("checkpoint {}", dir.display());
    }
    let plot_path = out_dir.join("loss.png");
    let png = crate::plot::loss_curve(&losses, 640, 360).to_png();
    crate::weights::write_atomic(&plot_path, &png).map_err(|e| RuntimeError::Io(plot_path, e))?;
    let weights = out_dir.join("model.safetensors");
    let merged = crate::weights::merge_params(&pipeline.save_stages()?)?;
    crate::weights::write_atomic(&weights, &merged)
        .map_err(|e| RuntimeError::Io(weights.clone(), e))?;
    let config_path = out_dir.join("config.toml");
    crate::weights::write_atomic(&config_path, config_text.as_bytes())
        .map_err(|e| RuntimeError::Io(config_path, e))?;
    if let Some(c) = cursor {
        let cursor_path = out_dir.join("data_cursor.json");
        let text = serde_json::to_string(&c).expect("a cursor serialises");
        crate::weights::write_atomic(&cursor_path, text.as_bytes())
            .map_err(|e| RuntimeError::Io(cursor_path, e))?;
    }
    Ok(RunSummary {
        losses,
        tokens_per_s: tokens as f64 / start.elapsed().as_secs_f64(),
        weights,
        recoveries,
    })
}

/// The metrics of steps 1..=`upto` from an earlier part of the run: their losses (for the loss
/// curve) and their lines (the last line of each step, in step order).
fn previous_metrics(metrics: &std::path::Path, upto: u64) -> (Vec<f64>, String) {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    let mut by_step = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
            && let (Some(step), Some(loss)) = (v["step"].as_u64(), v["loss"].as_f64())
            && step <= upto
        {
            // A step logged twice (redone after a rollback) keeps its last value.
            by_step.insert(step, (loss, line.to_string()));
        }
    }
    let losses = by_step.values().map(|(l, _)| *l).collect();
    let lines: String = by_step.into_values().map(|(_, l)| l + "\n").collect();
    (losses, lines)
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
