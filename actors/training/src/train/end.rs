//! The end of a training run: the final checkpoint and weights started right after the last
//! step (the last evaluation and the work after the last step wait for their reads and run
//! beside their disk writes), the run's summary, and `loss.png`, the config and the data
//! cursor written last.

use super::records::{draw_curves, written};
use super::{Run, RunSummary};
use crate::startup::Startup;
use nsactor_checkpoint::checkpoint;
use nsactor_decoding::Pipeline;
use nsactor_engine::error::RuntimeError;
use std::path::PathBuf;
use std::time::Instant;

impl Run<'_> {
    /// Right after the last step: the final checkpoint and the run's weights, from one read of
    /// the stages, written in the background; returns once the stages are read back, so the
    /// last evaluation and the work after the last step run on the device beside the disk's
    /// part (on the H200 the reads took 15 s beside the evaluation and the sample, 4–7 s alone
    /// with one reader at the disk's pace, and slowed them as much). [`finish`](Self::finish)
    /// waits for the files. `end` times the start (any earlier background write still in
    /// flight, then the snapshot) and the reads; a failed write ends the wait at once.
    pub(super) fn start_final(
        &mut self,
        pipeline: &mut Pipeline,
        end: &mut Startup,
    ) -> Result<(), RuntimeError> {
        let t = &self.cfg.train;
        let c = pipeline.checkpoint_final(
            &self.ckpt_root,
            t.keep_checkpoints,
            self.config_text.clone(),
            self.tokenizer_sha256.clone(),
            &self.out_dir.join("model.safetensors"),
        )?;
        self.final_in_flight = true;
        self.metrics.log(serde_json::json!({
            "event": "checkpoint", "step": c.step, "background": true, "final": true,
            "snapshot_s": c.snapshot_seconds, "waited_s": c.waited_seconds,
        }))?;
        if let Some(w) = c.previous {
            self.bar
                .suspend(|| written(w, &mut |l| self.metrics.log(l)))?;
        }
        end.mark("the previous write and the final snapshot");
        if let Some(rx) = c.reads_done {
            let t = Instant::now();
            let _ = rx.recv();
            tracing::info!(
                "the final checkpoint's stages read back in {:.2} s; its files are written \
                 beside what follows",
                t.elapsed().as_secs_f64()
            );
        }
        end.mark("the final checkpoint's reads");
        Ok(())
    }

    /// Waits for the final checkpoint's write; where it fails on the disk's side (a full
    /// disk, a lost mount), the trained state is still on the devices, so it is read back and
    /// written again after a doubling wait, for up to `[train] final_write_wait_s` or until a
    /// signal asks the run to stop. Anything else, or the last failure, is the run's error.
    fn final_written(
        &mut self,
        pipeline: &mut Pipeline,
        end: &mut Startup,
    ) -> Result<nsactor_checkpoint::writer::WriteDone, RuntimeError> {
        let limit = std::time::Duration::from_secs_f64(self.cfg.train.final_write_wait_s);
        let started = Instant::now();
        let mut wait = std::time::Duration::from_secs(1);
        loop {
            let e = match pipeline.finish_checkpoint() {
                Ok(Some(done)) => return Ok(done),
                Ok(None) => {
                    return Err(RuntimeError::Runtime(
                        "the final checkpoint's write was not in flight".into(),
                    ));
                }
                Err(e) => e,
            };
            let disk = matches!(e, RuntimeError::CheckpointIo(..) | RuntimeError::Io(..));
            let stopping = || self.stop.and_then(|s| s.requested()).is_some();
            if !disk || started.elapsed() + wait > limit || stopping() {
                return Err(e);
            }
            tracing::error!(
                "the final checkpoint was not written: {e}. The trained model is still in \
                 memory: writing it again in {:.0} s (for up to {:.0} s more; free space \
                 there, or stop the run with a signal to give up)",
                wait.as_secs_f64(),
                (limit.saturating_sub(started.elapsed())).as_secs_f64()
            );
            self.metrics.log(serde_json::json!({
                "event": "final_write_failed", "error": e.to_string(),
                "retry_in_s": wait.as_secs_f64(),
            }))?;
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if stopping() {
                    return Err(e);
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            wait = (wait * 2).min(std::time::Duration::from_secs(30));
            self.start_final(pipeline, end)?;
        }
    }

    /// What a run reports, with its weights at `weights`.
    pub(super) fn summary(&self, weights: PathBuf) -> RunSummary {
        RunSummary {
            losses: self.losses.clone(),
            tokens_per_s: self.tokens as f64 / self.start.elapsed().as_secs_f64(),
            weights,
            recoveries: self.recoveries.clone(),
            skipped_steps: self.skipped_steps,
            spike_rollbacks: self.spike_rollbacks,
            stopped_at: self.stopped_at,
            after_last_step: None,
        }
    }

    /// After the last step (rank 0 only): `loss.png`, then — unless a stop ended the run,
    /// whose checkpoint is written — the work after the last step beside the final checkpoint
    /// and weights (started after the last step, or here when this process ran no step), the
    /// config and the data cursor.
    pub(super) fn finish(mut self, pipeline: &mut Pipeline) -> Result<RunSummary, RuntimeError> {
        self.bar.finish_and_clear();
        if !self.leader {
            return Ok(self.summary(PathBuf::new()));
        }
        // Where the time after the last step goes, phase by phase (as the start's), from the
        // end of the last step (or from here in a process that ran none).
        let mut end = self.end.take().unwrap_or_default();
        if !self.final_in_flight {
            if let Some(w) = pipeline.finish_checkpoint().transpose() {
                written(w, &mut |l| self.metrics.log(l))?;
            }
            end.mark("the background write in flight");
        }
        let (metrics_path, png) = (self.metrics.path.clone(), self.out_dir.join("loss.png"));
        if let Some(s) = self.stopped_at {
            tracing::warn!(
                "stopped after step {s} on request; its checkpoint is in {}: `--resume` continues",
                self.ckpt_root.display()
            );
            draw_curves(&metrics_path, &png, self.title.clone());
            return Ok(self.summary(PathBuf::new()));
        }
        // A process that ran no step (resumed at the end) finds the final checkpoint on disk:
        // it is not written again; the run's weights are linked from it where they are not
        // that file already, and a run whose end was all written is left as it is. A
        // format-1 checkpoint has no weights file to link: its final write runs here.
        let started_here = !self.final_in_flight;
        let mut final_write = true;
        if started_here {
            let dir = checkpoint::step_dir(&self.ckpt_root, self.cfg.train.steps);
            let weights = self.out_dir.join("model.safetensors");
            match nsactor_checkpoint::writer::export_sealed(&dir, &weights)? {
                Some(false) if self.out_dir.join("config.toml").is_file() => {
                    tracing::info!(
                        "the run already ended at step {} (its final checkpoint {} and its \
                         weights {}): nothing to train or write",
                        self.cfg.train.steps,
                        dir.display(),
                        weights.display()
                    );
                    return Ok(self.summary(weights));
                }
                Some(_) => {
                    tracing::info!(
                        "resumed at the last step: the run's weights are {}'s, which is not \
                         written again; the rest of the run's end follows",
                        dir.display()
                    );
                    final_write = false;
                }
                None => self.start_final(pipeline, &mut end)?,
            }
        }
        // `loss.png` on a host thread beside the work on the device, both while the host
        // writes; the work's failure is reported once the write ended.
        let after_last_step = self.after_last_step.take();
        let title = self.title.clone();
        let after = std::thread::scope(|s| {
            s.spawn(|| draw_curves(&metrics_path, &png, title));
            after_last_step.map(|f| f(pipeline))
        });
        end.mark(if after.is_some() {
            "loss.png beside the work on the trained model"
        } else {
            "loss.png"
        });
        if final_write {
            let done = self.final_written(pipeline, &mut end)?;
            written(Ok(done), &mut |l| self.metrics.log(l))?;
        }
        let config_path = self.out_dir.join("config.toml");
        nsactor_checkpoint::weights::write_atomic(&config_path, self.config_text.as_bytes())
            .map_err(|e| RuntimeError::Io(config_path, e))?;
        if let Some(c) = &self.cursor {
            let cursor_path = self.out_dir.join("data_cursor.json");
            let text = serde_json::to_string(c).expect("a cursor serialises");
            nsactor_checkpoint::weights::write_atomic(&cursor_path, text.as_bytes())
                .map_err(|e| RuntimeError::Io(cursor_path, e))?;
        }
        end.mark(if started_here {
            "the final checkpoint and weights"
        } else {
            "the rest of the final checkpoint and weights"
        });
        tracing::info!("after the last step: {}", end.phases_line());
        let after_last_step = after.transpose()?;
        // Logged once the run has ended well, with its last step (a resumed run keeps the
        // event lines of the runs before it).
        let mut event = end.event_named("end");
        event["step"] = serde_json::json!(self.cfg.train.steps);
        self.metrics.log(event)?;
        Ok(RunSummary {
            after_last_step,
            ..self.summary(self.out_dir.join("model.safetensors"))
        })
    }
}
