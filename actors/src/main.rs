//! `nsactor`: train and (soon) serve NeuronSpark spiking language models.

use clap::{Parser, Subcommand};
use nsactor::config::RunConfig;
use nsactor::train;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "nsactor",
    version,
    about = "Train and serve NeuronSpark spiking language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (default: the tiny config on the bundled corpus, on CPU).
    Train(TrainArgs),
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Run config (TOML with [model] and [train]); default: the embedded configs/tiny.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Plain-text corpus; default: the bundled public-domain book.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Override [train].steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Override [train].out_dir.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override [train].seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Fine-tune with AdamW (weight decay 0.01 on the base group) instead of Adam.
    #[arg(long)]
    sft: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train_cmd(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train_cmd(args: TrainArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = RunConfig::load(args.config.as_deref())?;
    if let Some(s) = args.steps {
        cfg.train.steps = s;
    }
    if let Some(o) = args.out {
        cfg.train.out_dir = o;
    }
    if let Some(s) = args.seed {
        cfg.train.seed = s;
    }
    let corpus = match &args.corpus {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| format!("cannot read corpus {}: {e}", p.display()))?,
        None => train::EMBEDDED_CORPUS.to_string(),
    };
    let mut engine = make_engine(&cfg, args.sft)?;
    let summary = train::run(&cfg, engine.as_mut(), &corpus)?;
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last = summary.losses.last().copied().unwrap_or(f64::NAN);
    eprintln!(
        "loss {first:.4} → {last:.4}; {:.0} tokens/s; weights in {}",
        summary.tokens_per_s,
        summary.weights.display()
    );
    let prompt = nsactor::data::encode("Emma was");
    let mut ids = vec![nsactor::data::BOS];
    ids.extend(prompt);
    let out = engine.generate_greedy(&ids, 60)?;
    println!("{}", nsactor::data::decode(&out).replace('\n', " "));
    Ok(())
}

#[cfg(feature = "embedded-cpu")]
fn make_engine(
    cfg: &RunConfig,
    sft: bool,
) -> Result<Box<dyn nsactor_plugin_api::TrainEngine>, Box<dyn std::error::Error>> {
    use nsactor_backend_ndarray::{CpuEngine, Optimizer};
    let opt = if sft {
        Optimizer::AdamW
    } else {
        Optimizer::Adam
    };
    Ok(Box::new(CpuEngine::new(
        &cfg.model_toml(),
        cfg.train.seed,
        opt,
    )?))
}

#[cfg(not(feature = "embedded-cpu"))]
fn make_engine(
    _: &RunConfig,
    _: bool,
) -> Result<Box<dyn nsactor_plugin_api::TrainEngine>, Box<dyn std::error::Error>> {
    Err("this build has no embedded backend (feature `embedded-cpu` is off) and backend plugins are not supported yet".into())
}
