//! `nsactor data prepare`: corpora to token shards ([`crate::shards`] has the format), in three
//! stages that overlap.
//!
//! A reader thread per file hands on its documents a batch at a time ([`crate::stream`]:
//! Parquet a thousand rows of one column at a time, compressed text through its decoder); the
//! calling thread encodes each batch on rayon's pool; a writer thread appends the ids to the
//! open shard and, when it is full, writes it with its index and hashes both. Each channel
//! holds a batch or two, so memory is a few batches and one shard whatever the corpus size, and
//! on two cores the encoding (the bulk of the work) is never waiting for reading or hashing.

use crate::corpus;
use crate::error::{DataError, Result};
use crate::shards::{
    Dtype, FORMAT, MANIFEST, ShardInfo, ShardManifest, SourceInfo, encode_documents,
};
use crate::stream::{self, Batch, FileStats};
use crate::tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;
use std::time::Instant;

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

struct ShardWriter {
    dir: PathBuf,
    dtype: Dtype,
    shards: Vec<ShardInfo>,
    buf: Vec<u8>,
    starts: Vec<u64>,
    tokens: u64,
}

impl ShardWriter {
    /// Appends one document, `BOS ids… EOS`, closing the shard first when it would pass
    /// `limit` tokens.
    fn push(&mut self, ids: &[u32], (bos, eos): (u32, u32), limit: u64) -> Result<()> {
        let len = ids.len() as u64 + 2;
        if self.tokens > 0 && self.tokens + len > limit {
            self.finish()?;
        }
        self.starts.push(self.tokens);
        self.tokens += len;
        let all = std::iter::once(bos).chain(ids.iter().copied()).chain([eos]);
        match self.dtype {
            // Ids fit: the dtype was checked against the vocabulary.
            Dtype::U16 => self.buf.extend(all.flat_map(|t| (t as u16).to_le_bytes())),
            Dtype::U32 => self.buf.extend(all.flat_map(u32::to_le_bytes)),
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
    consume: &mut dyn FnMut(Batch) -> Result<()>,
) -> Result<FileStats> {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let reader = s.spawn(move || {
            stream::read_documents(path, text_field, &mut |b| {
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
            DataError::Invalid(format!(
                "{}: cannot be read, the file looks corrupt ({})",
                path.display(),
                panic_message(&*p)
            ))
        });
        match (failed, read) {
            (Some(e), _) => Err(e),
            (None, r) => r?,
        }
    })
}

/// A folder inside the output directory that a run writes its shards into
/// (`.prepare-<pid>`), removed when the run ends either way.
struct Staging {
    out: PathBuf,
    dir: PathBuf,
}

impl Staging {
    fn new(out: &Path) -> Result<Self> {
        // A killed run's folder (its process gone) is removed; a live run's is left alone.
        let entries = std::fs::read_dir(out).map_err(|e| DataError::read(out, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_prefix(".prepare-") else {
                continue;
            };
            let alive = Path::new("/proc").is_dir() && Path::new("/proc").join(pid).exists();
            if !alive || pid == std::process::id().to_string() {
                let p = entry.path();
                std::fs::remove_dir_all(&p).map_err(|e| DataError::write(&p, e))?;
            }
        }
        let dir = out.join(format!(".prepare-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| DataError::write(&dir, e))?;
        Ok(Staging {
            out: out.to_path_buf(),
            dir,
        })
    }

    /// Makes the staged `shards` and `manifest` the output directory's dataset: the old
    /// manifest goes first (a directory caught between two datasets has none, and readers say
    /// so), then the shards move in, the manifest is written, and shards of an earlier run
    /// that the new manifest does not name are removed.
    fn commit(&self, shards: &[ShardInfo], manifest: &[u8]) -> Result<()> {
        let old = self.out.join(MANIFEST);
        match std::fs::remove_file(&old) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(DataError::write(&old, e));
            }
            _ => {}
        }
        let mut named = std::collections::HashSet::new();
        for s in shards {
            for name in [&s.file, &s.index] {
                let (from, to) = (self.dir.join(name), self.out.join(name));
                std::fs::rename(&from, &to).map_err(|e| DataError::write(&to, e))?;
                named.insert(name.as_str());
            }
        }
        let staged = self.dir.join(MANIFEST);
        std::fs::write(&staged, manifest).map_err(|e| DataError::write(&staged, e))?;
        std::fs::rename(&staged, &old).map_err(|e| DataError::write(&old, e))?;
        let entries = std::fs::read_dir(&self.out).map_err(|e| DataError::read(&self.out, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let shard =
                name.starts_with("shard-") && (name.ends_with(".bin") || name.ends_with(".idx"));
            if shard && !named.contains(name.as_str()) {
                let p = entry.path();
                std::fs::remove_file(&p).map_err(|e| DataError::write(&p, e))?;
            }
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A panic's message.
fn panic_message(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("a panic")
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
    // Shards are written beside `out`'s contents and moved in only when all of them are: a
    // failed run leaves an earlier dataset in `out` as it was, and none of its own files.
    let staging = Staging::new(out)?;
    let bar = progress_bar(opts.progress, input_bytes);
    let mut w = ShardWriter {
        dir: staging.dir.clone(),
        dtype,
        shards: Vec::new(),
        buf: Vec::new(),
        starts: Vec::new(),
        tokens: 0,
    };
    let (bos, eos) = (tok.bos_id(), tok.eos_id());
    let (sources, shards) = std::thread::scope(|s| {
        let (tx, rx) = sync_channel::<Vec<Vec<u32>>>(2);
        let writer = s.spawn(move || {
            for docs in rx {
                for ids in &docs {
                    w.push(ids, (bos, eos), opts.shard_tokens)?;
                }
            }
            w.finish()?;
            Ok::<_, DataError>(w.shards)
        });
        let (mut sources, mut done) = (Vec::new(), 0u64);
        let mut read_all = || -> Result<()> {
            for path in &files {
                bar.set_message(path.display().to_string());
                let stats = read_overlapped(path, &opts.text_field, &mut |batch| {
                    let ids = encode_documents(tok, &batch.docs)?;
                    bar.set_position(done + batch.file_read);
                    // The writer is gone only when it failed; its error is the one told.
                    tx.send(ids)
                        .map_err(|_| DataError::Invalid("the shard writer stopped".into()))
                })?;
                done += stats.file_bytes;
                bar.set_position(done);
                sources.push(SourceInfo {
                    path: path.display().to_string(),
                    text_bytes: stats.text_bytes,
                    documents: stats.documents,
                });
            }
            Ok(())
        };
        let read = read_all();
        drop(tx);
        let written = writer.join().map_err(|p| {
            DataError::Invalid(format!("the shard writer failed: {}", panic_message(&*p)))
        })?;
        match (read, written) {
            (_, Err(e)) | (Err(e), _) => Err(e),
            (Ok(()), Ok(shards)) => Ok((sources, shards)),
        }
    })?;
    bar.finish_and_clear();
    let manifest = ShardManifest {
        format: FORMAT.into(),
        tokenizer_sha256: tok.hash().into(),
        tokenizer_origin: tok.origin().into(),
        vocab_size: tok.vocab_size(),
        dtype,
        bos_id: bos,
        eos_id: eos,
        documents: shards.iter().map(|s| s.documents).sum(),
        tokens: shards.iter().map(|s| s.tokens).sum(),
        text_bytes: sources.iter().map(|s| s.text_bytes).sum(),
        sources,
        shards,
    };
    if manifest.documents == 0 {
        return Err(DataError::EmptyCorpus(corpus::list(&files)));
    }
    let json = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
    staging.commit(&manifest.shards, json.as_bytes())?;
    Ok(PrepareReport {
        manifest,
        seconds: start.elapsed().as_secs_f64(),
        input_bytes,
    })
}
