//! Held-out evaluation: the cross entropy of a fixed set of batches, no gradients. Training
//! holds `eval_batches × batch_size` rows, spread evenly over its data, out of training
//! ([`HeldOut::split`]) and
//! evaluates them every `eval_every` steps; `nsactor eval` evaluates a checkpoint the same way.

use nsactor_data::sampler::{Cursor, Sampler};
use nsactor_decoding::Pipeline;
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::Batch;
use std::time::Instant;

/// A fixed set of batches to evaluate: every evaluation reads the same ones, in order.
pub struct HeldOut {
    sampler: Sampler,
    batches: usize,
    batch_size: usize,
    /// Sequences per forward: a training run's `batch_size`, so an evaluation runs the
    /// shapes the steps already tuned their kernels for (HISTORY, session 53).
    rows: usize,
    /// The batches, read once and cut into forwards of `rows` ([`forwards`](Self::forwards)):
    /// an evaluation never reads the data (one may run while a checkpoint's writes fill the
    /// disk) nor copies it.
    read: Option<Vec<Batch>>,
}

/// One evaluation's result.
#[derive(Debug, Clone, Copy)]
pub struct Evaluation {
    /// Token-weighted mean cross entropy; None when no token of the set is scored.
    pub ce: Option<f64>,
    pub tokens: u64,
    pub seconds: f64,
}

impl HeldOut {
    /// `batches` batches of `batch_size` rows drawn from `sampler` from its start, evaluated
    /// in forwards of at most `rows` sequences (at least 1).
    pub fn new(sampler: Sampler, batches: usize, batch_size: usize, rows: usize) -> Self {
        HeldOut {
            sampler,
            batches,
            batch_size,
            rows: rows.max(1),
            read: None,
        }
    }

    /// The set's batches cut into forwards of at most `rows` sequences, in order, read from
    /// the data the first time ([`split`](Self::split) reads them before training starts).
    pub fn forwards(&mut self) -> Result<&[Batch], RuntimeError> {
        if self.read.is_none() {
            self.sampler.resume(Cursor::default())?;
            let seq_len = self.sampler.seq_len();
            let mut read = Vec::new();
            for _ in 0..self.batches {
                let b = self.sampler.next_batch(self.batch_size, seq_len)?;
                read.extend(pieces(&b, self.rows));
            }
            self.read = Some(read);
        }
        Ok(self.read.as_deref().unwrap_or_default())
    }

    /// The run's training sampler and, when `[train] eval_every` is set, its held-out set: the
    /// `eval_batches × batch_size` rows spread evenly over the data (so the set samples every
    /// part of a corpus, not its last document), taken out of training. Data of fewer than
    /// twice that many rows is all trained on, without evaluation (a warning says so).
    pub fn split(
        cfg: &RunConfig,
        sampler: Sampler,
    ) -> Result<(Sampler, Option<Self>), RuntimeError> {
        let t = &cfg.train;
        if t.eval_every == 0 {
            return Ok((sampler, None));
        }
        let rows = (t.eval_batches * t.batch_size) as u64;
        let available = sampler.rows_per_epoch();
        if available < 2 * rows {
            tracing::warn!(
                "[train] eval_every is {} but the data has {available} rows: holding out {rows} \
                 would leave too little to train on, so this run has no held-out evaluation \
                 (lower eval_batches or batch_size, or add data)",
                t.eval_every
            );
            return Ok((sampler, None));
        }
        let (train, held) = sampler.hold_out(rows)?;
        let mut held = HeldOut::new(held, t.eval_batches, t.batch_size, t.batch_size);
        held.forwards()?;
        tracing::info!(
            "{rows} of {} rows held out for evaluation every {} steps ({} batches of {})",
            rows + train.rows_per_epoch(),
            t.eval_every,
            t.eval_batches,
            t.batch_size
        );
        Ok((train, Some(held)))
    }

    /// The set's cross entropy under the pipeline's current weights.
    pub fn evaluate(&mut self, pipeline: &mut Pipeline) -> Result<Evaluation, RuntimeError> {
        let start = Instant::now();
        let (mut weighted, mut tokens) = (0.0f64, 0u64);
        for (i, piece) in self.forwards()?.iter().enumerate() {
            let n = nsactor_engine::engine::scored_tokens(piece);
            if n == 0 {
                continue;
            }
            let ce = pipeline.eval_ce(piece)?;
            tracing::debug!("held-out forward {i}: CE {ce:.5} over {n} tokens");
            weighted += ce * n as f64;
            tokens += n;
        }
        Ok(Evaluation {
            ce: (tokens > 0).then(|| weighted / tokens as f64),
            tokens,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Batches per evaluation and rows per batch.
    pub fn shape(&self) -> (usize, usize) {
        (self.batches, self.batch_size)
    }
}

/// `b` cut into batches of at most `rows` sequences each.
fn pieces(b: &Batch, rows: usize) -> Vec<Batch> {
    let t = b.seq_len;
    (0..b.batch)
        .step_by(rows)
        .map(|start| {
            let n = rows.min(b.batch - start);
            let span = start * t..(start + n) * t;
            Batch {
                batch: n,
                seq_len: t,
                inputs: b.inputs[span.clone()].to_vec(),
                targets: b.targets[span.clone()].to_vec(),
                loss_mask: b.loss_mask[span].to_vec(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_batch_in_order() {
        let b = Batch {
            batch: 5,
            seq_len: 2,
            inputs: (0..10).collect(),
            targets: (10..20).collect(),
            loss_mask: (0..10).map(|i| i as f32).collect(),
        };
        let p = pieces(&b, 2);
        assert_eq!(p.iter().map(|p| p.batch).collect::<Vec<_>>(), [2, 2, 1]);
        assert_eq!(p[1].inputs, [4, 5, 6, 7]);
        assert_eq!(p[2].targets, [18, 19]);
        assert_eq!(
            p.iter()
                .flat_map(|p| p.loss_mask.clone())
                .collect::<Vec<_>>(),
            b.loss_mask
        );
    }
}
