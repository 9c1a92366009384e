//! `nsactor eval`: held-out loss of a checkpoint.

use crate::args::ModelArgs;
use nsactor_launch::launch::{self};
use nsactor_training::heldout::HeldOut;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prepared shards (`nsactor data prepare`) to draw the batches from.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Corpus files instead (text, .jsonl, .json; .xz/.gz). Default: the bundled corpus.
    #[arg(long, num_args = 1..)]
    corpus: Vec<PathBuf>,
    /// Batches to average over (drawn in the run's seeded order, the same every time).
    #[arg(long, default_value_t = 8)]
    batches: usize,
    /// Sequences per batch (default: the run's batch_size).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Tokens per sequence (default: the run's seq_len).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sequences per forward pass (default: the batch size): lower it when a batch's forward
    /// does not fit the device; the cross entropy is the same up to floating-point rounding.
    #[arg(long)]
    forward_rows: Option<usize>,
}

pub fn run(a: EvalArgs) -> crate::result::CliResult {
    if a.batches == 0 {
        return Err(crate::result::refuse("--batches must be at least 1"));
    }
    let mut l = launch::load_checkpoint(&a.model.options()?)?;
    let mut cfg = l.config.clone();
    if let Some(t) = a.seq_len {
        cfg.train.seq_len = t;
    }
    let batch = a.batch_size.unwrap_or(cfg.train.batch_size);
    let rows = a.forward_rows.unwrap_or(batch);
    if batch == 0 || cfg.train.seq_len == 0 || rows == 0 {
        return Err(crate::result::refuse(
            "--batch-size, --seq-len and --forward-rows must be at least 1",
        ));
    }
    let sampler = launch::make_sampler(&cfg, &l.tokenizer, &a.corpus, a.data.as_deref(), false)?;
    let e = HeldOut::new(sampler, a.batches, batch, rows).evaluate(&mut l.pipeline)?;
    let (Some(ce), scored) = (e.ce, e.tokens) else {
        return Err("the batches hold no scored tokens".into());
    };
    let info = l.pipeline.backend().info();
    println!(
        "held-out CE {ce:.5} (perplexity {:.3}) over {scored} tokens in {} batches of {batch} × {}; {} {} [{}], GEMMs {}; {:.1} s",
        ce.exp(),
        a.batches,
        cfg.train.seq_len,
        info.name,
        info.version,
        info.devices.first().map_or("", String::as_str),
        a.model
            .open
            .precision
            .as_deref()
            .or(cfg.backend.precision.as_deref())
            .unwrap_or("fp32"),
        e.seconds
    );
    Ok(())
}
