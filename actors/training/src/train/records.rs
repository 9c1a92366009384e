//! A training run's records besides its weights: `metrics.jsonl` and its lines, the log line
//! of the run's shape, the held-out evaluations, the checkpoint writes' outcomes and the
//! `loss.png` curves.

use super::describe;
use crate::heldout::HeldOut;
use crate::history::previous_metrics;
use nsactor_checkpoint::writer::WriteDone;
use nsactor_decoding::Pipeline;
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use nsactor_telemetry::TrainingMetrics;
use std::io::Write;
use std::path::PathBuf;

/// `out_dir/metrics.jsonl` as a run writes it: one JSON line per step or event (a sink on a
/// rank other than 0).
pub(super) struct MetricsLog {
    file: Box<dyn Write>,
    pub(super) path: PathBuf,
}

impl MetricsLog {
    /// Opens the log; when resuming, keeps the metrics of the steps the checkpoint holds and
    /// drops any logged after it, returning the kept losses.
    pub(super) fn open(
        path: PathBuf,
        first_step: u64,
        leader: bool,
    ) -> Result<(Self, Vec<f64>), RuntimeError> {
        // Resuming: keep the metrics of the steps the checkpoint holds, drop any logged after it.
        let mut losses = Vec::new();
        if first_step > 0 && leader {
            let (kept, text) = previous_metrics(&path, first_step);
            losses = kept;
            nsactor_checkpoint::weights::write_atomic(&path, text.as_bytes())
                .map_err(|e| RuntimeError::Io(path.clone(), e))?;
        }
        let file: Box<dyn Write> = match leader {
            true => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(first_step > 0)
                    .truncate(first_step == 0)
                    .open(&path)
                    .map_err(|e| RuntimeError::Io(path.clone(), e))?,
            ),
            false => Box::new(std::io::sink()),
        };
        Ok((MetricsLog { file, path }, losses))
    }

    /// Writes one line.
    pub(super) fn log(&mut self, line: serde_json::Value) -> Result<(), RuntimeError> {
        writeln!(self.file, "{line}").map_err(|e| RuntimeError::Io(self.path.clone(), e))
    }
}

/// Logs the run's shape: parameters, backend, steps and batches, the pipeline's plan and,
/// with data parallelism, its replicas.
pub(super) fn log_shape(cfg: &RunConfig, pipeline: &Pipeline) {
    let t = &cfg.train;
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
}

/// Evaluates the held-out set after `step` steps: a log line, an `eval` event in
/// `metrics.jsonl` and the live gauge.
pub(super) fn evaluate(
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
pub(super) fn draw_curves(metrics: &std::path::Path, png: &std::path::Path, title: String) {
    match crate::history::draw(metrics, png, title) {
        Ok(()) => tracing::info!("training curves in {}", png.display()),
        Err(e) => tracing::warn!("{} not drawn: {e}", png.display()),
    }
}

/// Logs how a checkpoint write ended: written (with its throughput) or failed. A failed write
/// leaves the previous checkpoints as they were; training goes on.
pub(super) fn written(
    w: Result<WriteDone, RuntimeError>,
    log: &mut impl FnMut(serde_json::Value) -> Result<(), RuntimeError>,
) -> Result<(), RuntimeError> {
    match w {
        Ok(w) => {
            let mb_per_s = w.bytes as f64 / 1e6 / w.seconds.max(1e-9);
            match &w.export {
                Some((path, bytes)) => tracing::info!(
                    "checkpoint {} ({:.1} MB in {:.2} s, {mb_per_s:.0} MB/s; reading the stages \
                     {:.2} s summed); the run's weights {} are its weights file ({:.1} MB)",
                    w.dir.display(),
                    w.bytes as f64 / 1e6,
                    w.seconds,
                    w.read_seconds,
                    path.display(),
                    *bytes as f64 / 1e6
                ),
                None => tracing::info!(
                    "checkpoint {} ({:.1} MB in {:.2} s, {mb_per_s:.0} MB/s; reading the stages \
                     {:.2} s summed)",
                    w.dir.display(),
                    w.bytes as f64 / 1e6,
                    w.seconds,
                    w.read_seconds
                ),
            }
            log(serde_json::json!({
                "event": "checkpoint_written", "step": w.step, "bytes": w.bytes,
                "write_s": w.seconds, "mb_per_s": mb_per_s, "read_s": w.read_seconds,
                "export_bytes": w.export.as_ref().map(|e| e.1),
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
