//! `nsactor`: train and (soon) serve NeuronSpark spiking language models.

use clap::{Parser, Subcommand};
use nsactor::config::RunConfig;
use nsactor::train;
use nsactor_data::cli::{DataPrepareArgs, TokenizerTrainArgs};
use nsactor_data::{Mode, Sampler, ShardSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

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
    /// Tokenizers.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Datasets.
    #[command(subcommand)]
    Data(DataCommand),
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE (NFKC, ChatML specials as ids 0–4) on corpus files.
    Train(TokenizerTrainArgs),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize corpus files into binary shards with a manifest.
    Prepare(DataPrepareArgs),
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Run config (TOML with [model] and [train]); default: the embedded configs/tiny.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Corpus files (text, .jsonl, .json; .xz/.gz); with --sft, conversation files (alpaca,
    /// ShareGPT `conversations` or `messages`). Default: the bundled public-domain books.
    #[arg(long, num_args = 1.., conflicts_with = "data")]
    corpus: Vec<PathBuf>,
    /// Prepared shards (`nsactor data prepare`); their tokenizer must be the run's.
    #[arg(long)]
    data: Option<PathBuf>,
    /// tokenizer.json; overrides [data].tokenizer (default: the bundled tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
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
        Command::Tokenizer(TokenizerCommand::Train(a)) => {
            nsactor_data::cli::tokenizer_train(&a).map_err(Into::into)
        }
        Command::Data(DataCommand::Prepare(a)) => {
            nsactor_data::cli::data_prepare(&a).map_err(Into::into)
        }
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
    if let Some(t) = args.tokenizer {
        cfg.data.tokenizer = Some(t);
    }
    let tok = nsactor_data::cli::load_tokenizer(cfg.data.tokenizer.as_deref())?;
    train::check_tokenizer(&cfg, &tok)?;
    let mut sampler = make_sampler(&cfg, &tok, &args.corpus, args.data.as_deref(), args.sft)?;
    let mut engine = make_engine(&cfg, args.sft)?;
    let summary = train::run(&cfg, engine.as_mut(), &mut sampler)?;
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last = summary.losses.last().copied().unwrap_or(f64::NAN);
    eprintln!(
        "loss {first:.4} → {last:.4}; {:.0} tokens/s; weights in {}",
        summary.tokens_per_s,
        summary.weights.display()
    );
    let mut ids = vec![i64::from(tok.bos_id())];
    ids.extend(tok.encode("Emma was")?.into_iter().map(i64::from));
    let out = engine.generate_greedy(&ids, 60)?;
    let out: Vec<u32> = out.iter().map(|&t| t as u32).collect();
    println!("{}", tok.decode(&out, false)?.replace('\n', " "));
    Ok(())
}

/// The batch source of a run: prepared shards, corpus files, or the bundled corpus; SFT rows
/// from conversation files with `--sft --corpus`.
fn make_sampler(
    cfg: &RunConfig,
    tok: &nsactor_data::Tokenizer,
    corpus: &[PathBuf],
    data: Option<&std::path::Path>,
    sft: bool,
) -> Result<Sampler, nsactor_data::DataError> {
    let (seq_len, seed) = (cfg.train.seq_len, cfg.train.seed);
    let mode = if cfg.data.packing {
        Mode::Packed
    } else {
        Mode::Padded
    };
    if let Some(dir) = data {
        let shards = ShardSet::open(dir, tok, true)?;
        return Sampler::pretrain(Arc::new(shards), mode, seq_len, seed);
    }
    if sft && !corpus.is_empty() {
        return nsactor_data::sample::sft_sampler(tok, corpus, None, seq_len, seed);
    }
    let tokens = if corpus.is_empty() {
        let mut m = nsactor_data::MemTokens::default();
        let text = nsactor_data::bundled_corpus();
        let name = std::path::Path::new("bundled-gutenberg-en.txt");
        nsactor_data::shards::tokenize_text(tok, name, &text, &cfg.data.text_field, &mut m)?;
        m
    } else {
        nsactor_data::shards::tokenize_files(tok, corpus, &cfg.data.text_field)?
    };
    Sampler::pretrain(Arc::new(tokens), mode, seq_len, seed)
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
