//! Token shards on disk: `nsactor data prepare` writes them, [`ShardSet`] memory-maps them.
//!
//! A directory holds `manifest.json` and, per shard, `shard-NNNNN.bin` (little-endian u16 or
//! u32 ids: every document stored as `BOS ids… EOS`, documents back to back) and
//! `shard-NNNNN.idx` (little-endian u64 start of each document in the shard). The manifest
//! records the tokenizer's hash, the counts and each file's sha256.
//! [`crate::prepare::prepare`] writes them.

use crate::error::{DataError, Result};
use crate::sampler::{MemTokens, TokenSource};
use crate::tokenizer::Tokenizer;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    let docs = crate::corpus::documents(path, text, text_field)?;
    for ids in encode_documents(tok, &docs)? {
        out.push(tok.bos_id(), &ids, tok.eos_id());
    }
    Ok(())
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
