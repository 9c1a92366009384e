//! `nsactor analyze`: the paper's interpretability study on a checkpoint (see
//! `nsactor-analysis`): E[K] per token, by category, per layer and against surprisal, and
//! the learned β, as `analysis.json`, five charts and a summary.

use crate::args::ModelArgs;
use nsactor_analysis::report::{self, ModelInfo};
use nsactor_analysis::{observe, sentences, weights};
use nsactor_plugin_api::PlifOut;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct AnalyzeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Sentences to analyse, one per line (default: the bundled English and Chinese set).
    #[arg(long, conflicts_with = "jsonl")]
    text: Option<PathBuf>,
    /// Sentences as JSON lines, `{"text": …, "category": …}` (`category` optional: E[K] and
    /// surprisal are then also reported per category).
    #[arg(long)]
    jsonl: Option<PathBuf>,
    /// Directory for `analysis.json` and the charts (created).
    #[arg(long)]
    out: PathBuf,
    /// Tokens kept of each sentence (after BOS).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
}

pub fn run(a: AnalyzeArgs) -> crate::result::CliResult {
    if a.max_tokens == 0 {
        return Err(crate::result::refuse("--max-tokens must be at least 1"));
    }
    let set = match (&a.text, &a.jsonl) {
        (Some(p), _) => sentences::from_text(p)?,
        (_, Some(p)) => sentences::from_jsonl(p)?,
        _ => sentences::bundled(),
    };
    let opts = a.model.options()?;
    let mut l = nsactor_launch::launch::load_checkpoint(&opts)?;
    let m = l.config.model.clone();
    let betas = weights::read(&opts.checkpoint, m.num_layers)?;
    let t = std::time::Instant::now();
    let seen = observe::observe(&mut l.pipeline, &l.tokenizer, &set, a.max_tokens, m.k)?;
    let info = l.pipeline.backend().info();
    let model = ModelInfo {
        checkpoint: opts
            .name
            .clone()
            .unwrap_or_else(|| opts.checkpoint.display().to_string()),
        backend: format!(
            "{} {} [{}]",
            info.name,
            info.version,
            info.devices.first().map_or("", String::as_str)
        ),
        layers: m.num_layers,
        d: m.d,
        n: m.n,
        k: m.k,
        d_ff: m.d_ff,
        vocab_size: m.vocab_size,
        plif_out: match m.plif_out {
            PlifOut::Leak => "leak",
            PlifOut::VPost => "v_post",
        }
        .into(),
    };
    let study = report::build(model, &seen, &betas);
    let written = nsactor_analysis::write(&study, &a.out)?;
    print!("{}", nsactor_analysis::summary(&study));
    println!(
        "ran in {:.1} s; wrote {}",
        t.elapsed().as_secs_f64(),
        written
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
