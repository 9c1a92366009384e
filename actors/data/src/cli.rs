//! The `nsactor tokenizer …` and `nsactor data …` subcommands (clap arguments and runners).

use crate::corpus;
use crate::error::{DataError, Result};
use crate::shards::{self, Dtype, PrepareOptions};
use crate::tokenizer::{self, Tokenizer};
use std::path::PathBuf;

/// `nsactor tokenizer train`.
#[derive(Debug, clap::Args)]
pub struct TokenizerTrainArgs {
    /// Corpus files: text (paragraphs), .jsonl (one object per line) or .json (array), optionally .xz/.gz.
    #[arg(long, num_args = 1.., required = true)]
    pub corpus: Vec<PathBuf>,
    /// Vocabulary size, specials and the 256-byte alphabet included.
    #[arg(long, default_value_t = tokenizer::DEFAULT_VOCAB_SIZE)]
    pub vocab_size: usize,
    /// Where to write tokenizer.json.
    #[arg(long)]
    pub out: PathBuf,
    /// JSON field holding the text.
    #[arg(long, default_value = "text")]
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
    /// JSON field holding the text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Close a shard at the first document boundary past this many tokens.
    #[arg(long, default_value_t = 1 << 26)]
    pub shard_tokens: u64,
    /// Stored id width: auto (u16 when the vocabulary fits), u16 or u32.
    #[arg(long, default_value = "auto", value_parser = ["auto", "u16", "u32"])]
    pub dtype: String,
    /// Corpus files: text, .jsonl or .json, optionally .xz/.gz.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

/// Trains and writes a tokenizer; reports to stderr.
pub fn tokenizer_train(args: &TokenizerTrainArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let texts = corpus::read_all(&args.corpus)?;
    let mut docs = Vec::new();
    for (path, text) in &texts {
        docs.extend(corpus::documents(path, text, &args.text_field)?);
    }
    if docs.is_empty() {
        return Err(DataError::EmptyCorpus(corpus::list(&args.corpus)));
    }
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
    let r = shards::prepare(&tok, &args.files, &args.out, &opts)?;
    let m = &r.manifest;
    eprintln!(
        "{} documents, {} tokens ({:?}, {} shards) from {:.1} MB of text in {:.2} s: {:.2} MB/s, {:.2} bytes/token → {}",
        m.documents,
        m.tokens,
        m.dtype,
        m.shards.len(),
        m.text_bytes as f64 / 1e6,
        r.seconds,
        r.mb_per_s(),
        m.text_bytes as f64 / m.tokens as f64,
        args.out.display()
    );
    Ok(())
}
