//! Held-out evaluation: the cross entropy of a fixed set of batches, no gradients. Training
//! holds `eval_batches × batch_size` rows, spread evenly over its data, out of training
//! ([`HeldOut::split`]) and
//! evaluates them every `eval_every` steps; `nsactor eval` evaluates a checkpoint the same way.

use crate::config::RunConfig;
use crate::error::RuntimeError;
use crate::pipeline::Pipeline;
use nsactor_data::sampler::{Cursor, Sampler};
use std::time::Instant;

/// A fixed set of batches to evaluate: every evaluation reads the same ones, in order.
pub struct HeldOut {
    sampler: Sampler,
    batches: usize,
    batch_size: usize,
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
    /// `batches` batches of `batch_size` rows drawn from `sampler` from its start.
    pub fn new(sampler: Sampler, batches: usize, batch_size: usize) -> Self {
        HeldOut {
            sampler,
            batches,
            batch_size,
        }
    }

    /// The run's training sampler and, when `[train] eval_every` is set, its held-out set: the
    /// `eval_batches × batch_size` rows spread evenly over the data (so the set samples every
    /// part of a corpus, not its last document), taken out of training.
    pub fn split(
        cfg: &RunConfig,
        sampler: Sampler,
    ) -> Result<(Sampler, Option<Self>), RuntimeError> {
        let t = &cfg.train;
        if t.eval_every == 0 {
            return Ok((sampler, None));
        }
        let rows = (t.eval_batches * t.batch_size) as u64;
        let (train, held) = sampler.hold_out(rows)?;
        tracing::info!(
            "{rows} of {} rows held out for evaluation every {} steps ({} batches of {})",
            rows + train.rows_per_epoch(),
            t.eval_every,
            t.eval_batches,
            t.batch_size
        );
        Ok((
            train,
            Some(HeldOut::new(held, t.eval_batches, t.batch_size)),
        ))
    }

    /// The set's cross entropy under the pipeline's current weights.
    pub fn evaluate(&mut self, pipeline: &mut Pipeline) -> Result<Evaluation, RuntimeError> {
        let start = Instant::now();
        self.sampler.resume(Cursor::default())?;
        let seq_len = self.sampler.seq_len();
        let (mut weighted, mut tokens) = (0.0f64, 0u64);
        for i in 0..self.batches {
            let b = self.sampler.next_batch(self.batch_size, seq_len)?;
            let n = crate::engine::scored_tokens(&b);
            if n == 0 {
                continue;
            }
            let ce = pipeline.eval_ce(&b)?;
            tracing::debug!("held-out batch {i}: CE {ce:.5} over {n} tokens");
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
