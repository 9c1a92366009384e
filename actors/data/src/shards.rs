//! Token shards on disk: `nsactor data prepare` writes them, [`ShardSet`] memory-maps them.
//!
//! A directory holds `manifest.json` and, per shard, `shard-NNNNN.bin` (little-endian u16 or
//! u32 ids: every document stored as `BOS ids… EOS`, documents back to back) and
//! `shard-NNNNN.idx` (little-endian u64 start of each document in the shard). The manifest
//! records the tokenizer's hash, the counts and each file's sha256.
//!
//! `prepare` streams: one thread reads a file's documents a batch at a time
//! ([`crate::stream`]) while the batch before is encoded in parallel (rayon) and appended to
//! the open shard, so memory holds a couple of batches and one shard whatever the corpus size.

use crate::corpus;
use crate::error::{DataError, Result};
use crate::sampler::{MemTokens, TokenSource};
use crate::tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `format` of manifests this crate writes and reads.
pub const FORMAT: &str = "nsactor-shards/1";
pub const MANIFEST: &str = "manifest.json";

/// Width of stored ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    U16,
    U32,
}

impl Dtype {
    pub fn width(self) -> usize {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }

    /// The narrowest width that holds every id of `tok`.
    pub fn for_vocab(tok: &Tokenizer) -> Self {
        if tok.vocab_size() <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }
}

/// One input file of a prepared set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    pub path: String,
    /// Bytes of (decompressed) text.
    pub text_bytes: u64,
    pub documents: u64,
}

/// One shard: its files, counts and checksums.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub index: String,
    pub tokens: u64,
    pub documents: u64,
    pub sha256: String,
    pub index_sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub format: String,
    pub tokenizer_sha256: String,
    pub tokenizer_origin: String,
    pub vocab_size: usize,
    pub dtype: Dtype,
    pub bos_id: u32,
    pub eos_id: u32,
    pub documents: u64,
    pub tokens: u64,
    pub text_bytes: u64,
    pub sources: Vec<SourceInfo>,
    pub shards: Vec<ShardInfo>,
}

/// Options of [`prepare`].
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// JSON field holding the text.
    pub text_field: String,
    /// A shard is closed at the first document boundary past this many tokens.
    pub shard_tokens: u64,
    /// `None`: the narrowest width for the vocabulary.
    pub dtype: Option<Dtype>,
    pub progress: bool,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            text_field: "text".into(),
            shard_tokens: 1 << 26,
            dtype: None,
            progress: false,
        }
    }
}

/// What [`prepare`] did.
#[derive(Debug, Clone)]
pub struct PrepareReport {
    pub manifest: ShardManifest,
    pub seconds: f64,
    /// Bytes of the input files on disk (compressed, or Parquet, as stored).
    pub input_bytes: u64,
}

impl PrepareReport {
    /// Text throughput in MB/s (10⁶ bytes).
    pub fn mb_per_s(&self) -> f64 {
        self.manifest.text_bytes as f64 / 1e6 / self.seconds
    }

    /// Input throughput in MB/s: bytes of the files as stored.
    pub fn input_mb_per_s(&self) -> f64 {
        self.input_bytes as f64 / 1e6 / self.seconds
    }
}

/// Encodes documents in parallel (rayon), in input order.
pub fn encode_documents<S: AsRef<str> + Sync>(
    tok: &Tokenizer,
    docs: &[S],
) -> Result<Vec<Vec<u32>>> {
    docs.par_iter()
        .with_min_len(16)
        .map(|d| tok.encode(d.as_ref()))
        .collect()
}

/// Tokenizes `files` (folders expanded) into memory (for `--corpus` and the bundled corpus).
pub fn tokenize_files(tok: &Tokenizer, files: &[PathBuf], text_field: &str) -> Result<MemTokens> {
    let mut out = MemTokens::default();
    let docs = crate::stream::read_all_documents(files, text_field)?;
    for ids in encode_documents(tok, &docs)? {
        out.push(tok.bos_id(), &ids, tok.eos_id());
    }
    Ok(out)
}

/// Tokenizes the documents of one file's `text` into `out`.
pub fn tokenize_text(
    tok: &Tokenizer,
    path: &Path,
    text: &str,
    text_field: &str,
    out: &mut MemTokens,
) -> Result<()> {
    let docs = corpus::documents(path, text, text_field)?;
    for ids in encode_documents(tok, &docs)? {
        out.push(tok.bos_id(), &ids, tok.eos_id());
    }
    Ok(())
}

struct ShardWriter {
    dir: PathBuf,
    dtype: Dtype,
    shards: Vec<ShardInfo>,
    buf: Vec<u8>,
    starts: Vec<u64>,
    tokens: u64,
}

impl ShardWriter {
    fn push(&mut self, ids: impl Iterator<Item = u32>, len: usize, limit: u64) -> Result<()> {
        if self.tokens > 0 && self.tokens + len as u64 > limit {
            self.finish()?;
        }
        self.starts.push(self.tokens);
        self.tokens += len as u64;
        match self.dtype {
            // Ids fit: the dtype was checked against the vocabulary.
            Dtype::U16 => ids.for_each(|t| self.buf.extend_from_slice(&(t as u16).to_le_bytes())),
            Dtype::U32 => ids.for_each(|t| self.buf.extend_from_slice(&t.to_le_bytes())),
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if self.starts.is_empty() {
            return Ok(());
        }
        let n = self.shards.len();
        let (file, index) = (format!("shard-{n:05}.bin"), format!("shard-{n:05}.idx"));
        let idx: Vec<u8> = self.starts.iter().flat_map(|s| s.to_le_bytes()).collect();
        for (name, bytes) in [(&file, &self.buf), (&index, &idx)] {
            let p = self.dir.join(name);
            std::fs::write(&p, bytes).map_err(|e| DataError::write(&p, e))?;
        }
        self.shards.push(ShardInfo {
            file,
            index,
            tokens: self.tokens,
            documents: self.starts.len() as u64,
            sha256: format!("{:x}", Sha256::digest(&self.buf)),
            index_sha256: format!("{:x}", Sha256::digest(&idx)),
        });
        self.buf.clear();
        self.starts.clear();
        self.tokens = 0;
        Ok(())
    }
}

/// The bar of `prepare`: bytes of the input files read, drawn on a terminal only.
fn progress_bar(on: bool, total: u64) -> ProgressBar {
    if !on {
        return ProgressBar::hidden();
    }
    // indicatif draws on stderr only when it is a terminal; a log gets the closing summary.
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template(
            "{msg} {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("a valid template"),
    );
    b
}

/// Reads `path`'s documents on a thread of its own and hands each batch to `consume` on this
/// one, so that reading (decompressing, decoding Parquet pages) overlaps encoding. A panic of
/// the reader (a corrupt file a decoder does not guard against) is an error naming the file.
fn read_overlapped(
    path: &Path,
    text_field: &str,
    consume: &mut dyn FnMut(crate::stream::Batch) -> Result<()>,
) -> Result<crate::stream::FileStats> {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let reader = s.spawn(move || {
            crate::stream::read_documents(path, text_field, &mut |b| {
                // The receiver is gone only when consuming failed; that error is the one told.
                tx.send(b).map_err(|_| DataError::Invalid("stopped".into()))
            })
        });
        let mut failed = None;
        for b in rx.iter() {
            if let Err(e) = consume(b) {
                failed = Some(e);
                break;
            }
        }
        drop(rx);
        let read = reader.join().map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            DataError::Invalid(format!(
                "{}: cannot be read, the file looks corrupt ({msg})",
                path.display()
            ))
        });
        match (failed, read) {
            (Some(e), _) => Err(e),
            (None, r) => r?,
        }
    })
}

/// Tokenizes `files` (folders expanded, [`corpus::expand`]) into shards under `out` and writes
/// the manifest.
pub fn prepare(
    tok: &Tokenizer,
    files: &[PathBuf],
    out: &Path,
    opts: &PrepareOptions,
) -> Result<PrepareReport> {
    let start = Instant::now();
    let dtype = opts.dtype.unwrap_or_else(|| Dtype::for_vocab(tok));
    if dtype == Dtype::U16 && tok.vocab_size() > 1 << 16 {
        return Err(DataError::VocabTooLargeForU16 {
            origin: tok.origin().into(),
            vocab: tok.vocab_size(),
        });
    }
    if opts.shard_tokens == 0 {
        return Err(DataError::Invalid("--shard-tokens must be positive".into()));
    }
    // Fail on a missing input before writing anything.
    let files = corpus::expand(files)?;
    let mut input_bytes = 0;
    for f in &files {
        input_bytes += std::fs::metadata(f)
            .map_err(|e| DataError::read(f, e))?
            .len();
    }
    std::fs::create_dir_all(out).map_err(|e| DataError::write(out, e))?;
    let bar = progress_bar(opts.progress, input_bytes);
    let mut w = ShardWriter {
        dir: out.to_path_buf(),
        dtype,
        shards: Vec::new(),
        buf: Vec::new(),
        starts: Vec::new(),
        tokens: 0,
    };
    let (bos, eos) = (tok.bos_id(), tok.eos_id());
    let (mut sources, mut done) = (Vec::new(), 0u64);
    for path in &files {
        bar.set_message(path.display().to_string());
        let stats = read_overlapped(path, &opts.text_field, &mut |batch| {
            for ids in encode_documents(tok, &batch.docs)? {
                let all = std::iter::once(bos).chain(ids.iter().copied()).chain([eos]);
                w.push(all, ids.len() + 2, opts.shard_tokens)?;
            }
            bar.set_position(done + batch.file_read);
            Ok(())
        })?;
        done += stats.file_bytes;
        bar.set_position(done);
        sources.push(SourceInfo {
            path: path.display().to_string(),
            text_bytes: stats.text_bytes,
            documents: stats.documents,
        });
    }
    w.finish()?;
    bar.finish_and_clear();
    let manifest = ShardManifest {
        format: FORMAT.into(),
        tokenizer_sha256: tok.hash().into(),
        tokenizer_origin: tok.origin().into(),
        vocab_size: tok.vocab_size(),
        dtype,
        bos_id: bos,
        eos_id: eos,
        documents: w.shards.iter().map(|s| s.documents).sum(),
        tokens: w.shards.iter().map(|s| s.tokens).sum(),
        text_bytes: sources.iter().map(|s| s.text_bytes).sum(),
        sources,
        shards: w.shards,
    };
    if manifest.documents == 0 {
        return Err(DataError::EmptyCorpus(corpus::list(&files)));
    }
    let path = out.join(MANIFEST);
    let json = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
    std::fs::write(&path, json).map_err(|e| DataError::write(&path, e))?;
    Ok(PrepareReport {
        manifest,
        seconds: start.elapsed().as_secs_f64(),
        input_bytes,
    })
}

struct Shard {
    tokens: memmap2::Mmap,
    index: memmap2::Mmap,
    n_tokens: u64,
}

/// Prepared shards, memory-mapped, as one [`TokenSource`].
pub struct ShardSet {
    manifest: ShardManifest,
    shards: Vec<Shard>,
    /// Stream offset and first document of each shard, plus the totals at the end.
    token_base: Vec<u64>,
    doc_base: Vec<u64>,
}

fn map(path: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(path).map_err(|e| DataError::read(path, e))?;
    // SAFETY: shards are written once by `prepare` and only read afterwards; a file truncated
    // underneath a running reader is outside this format's contract (like any mmap'd dataset).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| DataError::read(path, e))
}

/// The first place where a shard cannot be what `prepare` wrote, whatever its checksum: an
/// index entry out of order or past the shard's end, or a token id outside the vocabulary.
/// `(true: in the index file, the fault with its byte offset)`.
fn structural_fault(
    tokens: &[u8],
    index: &[u8],
    info: &ShardInfo,
    manifest: &ShardManifest,
) -> Option<(bool, String)> {
    let mut prev = 0u64;
    for (k, e) in index.chunks_exact(8).enumerate() {
        let start = u64::from_le_bytes(e.try_into().expect("8 bytes"));
        if start < prev || start > info.tokens || (k == 0 && start != 0) {
            return Some((
                true,
                format!(
                    "byte offset {}: document {k} starts at token {start}, after {prev} and \
                     within 0..={} expected; the index is corrupt, prepare the data again",
                    8 * k,
                    info.tokens
                ),
            ));
        }
        prev = start;
    }
    let (dtype, vocab) = (manifest.dtype, manifest.vocab_size as u32);
    let n = tokens.len() / dtype.width();
    let bad = (0..n).find(|&i| token_at(dtype, tokens, i) >= vocab)?;
    Some((
        false,
        format!(
            "byte offset {}: token id {} is outside the vocabulary ({vocab} ids); the shard is \
             corrupt, prepare the data again",
            bad * dtype.width(),
            token_at(dtype, tokens, bad)
        ),
    ))
}

/// Token `i` of a shard's bytes stored as `dtype` (little-endian).
fn token_at(dtype: Dtype, t: &[u8], i: usize) -> u32 {
    match dtype {
        Dtype::U16 => u32::from(u16::from_le_bytes([t[2 * i], t[2 * i + 1]])),
        Dtype::U32 => u32::from_le_bytes(t[4 * i..4 * i + 4].try_into().expect("4 bytes")),
    }
}

impl ShardSet {
    /// Opens `dir` for a run using `tok`; with `verify`, checks every file's sha256.
    pub fn open(dir: &Path, tok: &Tokenizer, verify: bool) -> Result<Self> {
        let mpath = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&mpath).map_err(|e| DataError::read(&mpath, e))?;
        let manifest: ShardManifest = serde_json::from_str(&text).map_err(|e| DataError::Json {
            path: mpath.clone(),
            what: "manifest".into(),
            msg: e.to_string(),
        })?;
        let bad = |msg: String| DataError::Shard {
            path: mpath.clone(),
            msg,
        };
        if manifest.format != FORMAT {
            return Err(bad(format!(
                "format `{}`, expected `{FORMAT}`",
                manifest.format
            )));
        }
        if manifest.tokenizer_sha256 != tok.hash() {
            return Err(DataError::TokenizerMismatch {
                dir: dir.to_path_buf(),
                shards: manifest.tokenizer_sha256.clone(),
                run: tok.hash().into(),
                origin: tok.origin().into(),
            });
        }
        if manifest.dtype == Dtype::U16 && manifest.vocab_size > 1 << 16 {
            return Err(DataError::VocabTooLargeForU16 {
                origin: manifest.tokenizer_origin.clone(),
                vocab: manifest.vocab_size,
            });
        }
        let width = manifest.dtype.width() as u64;
        let (mut shards, mut token_base, mut doc_base) = (Vec::new(), vec![0], vec![0]);
        for info in &manifest.shards {
            let (bp, ip) = (dir.join(&info.file), dir.join(&info.index));
            let (tokens, index) = (map(&bp)?, map(&ip)?);
            if tokens.len() as u64 != info.tokens * width
                || index.len() as u64 != info.documents * 8
            {
                return Err(DataError::Shard {
                    path: bp,
                    msg: format!(
                        "size {} / index {} bytes, the manifest says {} tokens / {} documents",
                        tokens.len(),
                        index.len(),
                        info.tokens,
                        info.documents
                    ),
                });
            }
            if let Some((in_index, msg)) = structural_fault(&tokens, &index, info, &manifest) {
                return Err(DataError::Shard {
                    path: if in_index { ip } else { bp },
                    msg,
                });
            }
            if verify {
                for (p, bytes, want) in [
                    (&bp, &tokens[..], &info.sha256),
                    (&ip, &index[..], &info.index_sha256),
                ] {
                    let got = format!("{:x}", Sha256::digest(bytes));
                    if &got != want {
                        return Err(DataError::Shard {
                            path: p.clone(),
                            msg: format!("sha256 {got} differs from the manifest's {want}"),
                        });
                    }
                }
            }
            token_base.push(token_base.last().unwrap() + info.tokens);
            doc_base.push(doc_base.last().unwrap() + info.documents);
            shards.push(Shard {
                tokens,
                index,
                n_tokens: info.tokens,
            });
        }
        Ok(ShardSet {
            manifest,
            shards,
            token_base,
            doc_base,
        })
    }

    pub fn manifest(&self) -> &ShardManifest {
        &self.manifest
    }

    fn id(&self, shard: usize, i: u64) -> i64 {
        i64::from(token_at(
            self.manifest.dtype,
            &self.shards[shard].tokens,
            i as usize,
        ))
    }
}

impl TokenSource for ShardSet {
    fn total_tokens(&self) -> u64 {
        *self.token_base.last().expect("token_base starts with 0")
    }

    fn documents(&self) -> u64 {
        *self.doc_base.last().expect("doc_base starts with 0")
    }

    fn document(&self, d: u64) -> Range<u64> {
        let s = self.doc_base.partition_point(|&b| b <= d) - 1;
        let local = (d - self.doc_base[s]) as usize;
        let idx = &self.shards[s].index;
        let start = |k: usize| u64::from_le_bytes(idx[8 * k..8 * k + 8].try_into().expect("8"));
        let begin = start(local);
        let end = if (local as u64 + 1) < self.doc_base[s + 1] - self.doc_base[s] {
            start(local + 1)
        } else {
            self.shards[s].n_tokens
        };
        self.token_base[s] + begin..self.token_base[s] + end
    }

    fn read(&self, r: Range<u64>, out: &mut Vec<i64>) {
        let mut pos = r.start;
        while pos < r.end {
            let s = self.token_base.partition_point(|&b| b <= pos) - 1;
            let end = r.end.min(self.token_base[s + 1]);
            out.extend((pos..end).map(|g| self.id(s, g - self.token_base[s])));
            pos = end;
        }
    }
}
