//! The `nsactor tokenizer …` and `nsactor data …` subcommands (clap arguments and runners).
//!
//! Both take corpus files or folders: plain text (paragraphs), `.jsonl` (one object per line)
//! or `.json` (an array), each optionally `.xz`/`.gz`/`.zst`, and `.parquet` (one string
//! column); a folder stands for the data files under it ([`crate::corpus::expand`]).

use crate::error::Result;
use crate::prepare::{self, PrepareOptions};
use crate::shards::Dtype;
use crate::tokenizer::{self, Tokenizer};
use std::path::PathBuf;

/// `nsactor tokenizer train`.
#[derive(Debug, clap::Args)]
pub struct TokenizerTrainArgs {
    /// Corpus files or folders: text (paragraphs), .jsonl (one object per line) or .json
    /// (array), optionally .xz/.gz/.zst, and .parquet; a folder stands for the data files under
    /// it (only its .parquet files when it has any).
    #[arg(long, num_args = 1.., required = true)]
    pub corpus: Vec<PathBuf>,
    /// Vocabulary size, specials and the 256-byte alphabet included.
    #[arg(long, default_value_t = tokenizer::DEFAULT_VOCAB_SIZE)]
    pub vocab_size: usize,
    /// Where to write tokenizer.json.
    #[arg(long)]
    pub out: PathBuf,
    /// JSON field, or Parquet column, holding the text.
    #[arg(long, visible_alias = "text-column", default_value = "text")]
    pub text_field: String,
}

/// `nsactor data prepare`.
#[derive(Debug, clap::Args)]
pub struct DataPrepareArgs {
    /// tokenizer.json to encode with; default: the bundled tokenizer.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output directory (manifest.json and shards).
    #[arg(long)]
    pub out: PathBuf,
    /// JSON field, or Parquet column (a string column), holding the text.
    #[arg(long, visible_alias = "text-column", default_value = "text")]
    pub text_field: String,
    /// Close a shard at the first document boundary past this many tokens.
    #[arg(long, default_value_t = 1 << 26)]
    pub shard_tokens: u64,
    /// Stored id width: auto (u16 when the vocabulary fits), u16 or u32.
    #[arg(long, default_value = "auto", value_parser = ["auto", "u16", "u32"])]
    pub dtype: String,
    /// Corpus files or folders: text (paragraphs), .jsonl or .json, optionally .xz/.gz/.zst,
    /// and .parquet (a file, or a folder of shards as `datasets` and the Hub write them, e.g.
    /// data/train-00000-of-00004.parquet); a folder stands for the data files under it at any
    /// depth, in path order (only its .parquet files when it has any). Read as a stream: memory
    /// holds a few batches of documents and one shard.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

/// Trains and writes a tokenizer; reports to stderr.
pub fn tokenizer_train(args: &TokenizerTrainArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let docs = crate::stream::read_all_documents(&args.corpus, &args.text_field)?;
    let bytes: usize = docs.iter().map(|d| d.len()).sum();
    let tok = tokenizer::train(docs.iter(), args.vocab_size)?;
    tok.save(&args.out)?;
    eprintln!(
        "trained a {}-token byte-level BPE on {} documents ({:.1} MB) in {:.1} s → {} (sha256 {})",
        tok.vocab_size(),
        docs.len(),
        bytes as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        args.out.display(),
        &tok.hash()[..16]
    );
    Ok(())
}

/// Prepares shards; reports to stderr.
pub fn data_prepare(args: &DataPrepareArgs) -> Result<()> {
    let tok = Tokenizer::load_or_bundled(args.tokenizer.as_deref())?;
    let dtype = match args.dtype.as_str() {
        "u16" => Some(Dtype::U16),
        "u32" => Some(Dtype::U32),
        _ => None,
    };
    let opts = PrepareOptions {
        text_field: args.text_field.clone(),
        shard_tokens: args.shard_tokens,
        dtype,
        progress: true,
    };
    let r = prepare::prepare(&tok, &args.files, &args.out, &opts)?;
    let m = &r.manifest;
    eprintln!(
        "{} documents, {} tokens ({:?}, {} shards) from {:.1} MB of text ({:.1} MB of files) in {:.2} s: {:.2} MB/s of text, {:.2} MB/s of files, {:.2} bytes/token → {}",
        m.documents,
        m.tokens,
        m.dtype,
        m.shards.len(),
        m.text_bytes as f64 / 1e6,
        r.input_bytes as f64 / 1e6,
        r.seconds,
        r.mb_per_s(),
        r.input_mb_per_s(),
        m.text_bytes as f64 / m.tokens as f64,
        args.out.display()
    );
    Ok(())
}
