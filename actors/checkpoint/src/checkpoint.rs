//! Checkpoints on disk: one safetensors shard per stage (parameters and optimizer state) and a JSON
//! manifest (step, data cursor, config, tokenizer hash, a sha256 per shard).
//!
//! Layout: `<root>/step-<step:08>/{edge,layer-000,…}.safetensors` + `manifest.json`. Shards are
//! written in parallel ([`crate::stream`]), each atomically (temporary file, fsync, rename) and
//! hashed as it is written; the manifest is written last, so a directory without a valid manifest
//! is an unfinished checkpoint. After a write, only the newest `keep` checkpoints (by step number)
//! stay. Reading verifies every checksum.

pub use crate::stream::{ShardEntry, sha256, shard_file};
use nsactor_data::{Cursor, Tokenizer};
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "nsactor-checkpoint/1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointManifest {
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the data continues (absent when the run had no sampler).
    pub data_cursor: Option<Cursor>,
    /// The run's seed; training draws no other random numbers (the data order is a function of
    /// the seed and the cursor), so this is the whole RNG state.
    pub seed: u64,
    /// The run's config as TOML.
    pub config: String,
    /// sha256 of the run's tokenizer.json, if one was used.
    pub tokenizer_sha256: Option<String>,
    /// Stage shards in stage order: the edge, then layers 0, 1, ….
    pub shards: Vec<ShardEntry>,
}

impl CheckpointManifest {
    /// Fails unless `tok` is the tokenizer the checkpoint in `dir` was trained with (when it
    /// recorded one): ids of another vocabulary would mean other tokens.
    pub fn check_tokenizer(
        &self,
        dir: &Path,
        tok: &nsactor_data::Tokenizer,
    ) -> Result<(), RuntimeError> {
        match &self.tokenizer_sha256 {
            Some(h) if h != tok.hash() => Err(RuntimeError::Invalid(format!(
                "{} was trained with tokenizer {h}, but {} is {}; pass the run's tokenizer with \
                 --tokenizer",
                dir.display(),
                tok.origin(),
                tok.hash()
            ))),
            _ => Ok(()),
        }
    }
}

/// What a checkpoint records besides the shards.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointMeta {
    pub step: u64,
    pub data_cursor: Option<Cursor>,
    pub seed: u64,
    pub config: String,
    pub tokenizer_sha256: Option<String>,
}

pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Writes checkpoint `meta.step` under `root` from per-stage bytes, then keeps the newest
/// `keep` (0 keeps all). Returns its directory.
pub fn write(
    root: &Path,
    meta: &CheckpointMeta,
    shards: &[Vec<u8>],
    keep: usize,
) -> Result<PathBuf, RuntimeError> {
    write_with(root, meta, shards, keep, &|| {})
}

/// [`write`], calling `before_manifest` between the shards and the manifest (fault injection).
pub fn write_with(
    root: &Path,
    meta: &CheckpointMeta,
    shards: &[Vec<u8>],
    keep: usize,
    before_manifest: &dyn Fn(),
) -> Result<PathBuf, RuntimeError> {
    let dir = begin(root, meta.step)?;
    let written = crate::stream::write_stages(
        &dir,
        shards.iter().collect(),
        &|b: &Vec<u8>| Ok(b.as_slice()),
        crate::stream::ReadAhead::BESIDE,
        None,
        None,
    )?;
    seal(root, &dir, meta, written.entries, keep, before_manifest)?;
    Ok(dir)
}

/// Creates step `step`'s directory under `root` for new shards, removing a manifest an earlier
/// attempt at the step left (it must not vouch for the new shards).
pub fn begin(root: &Path, step: u64) -> Result<PathBuf, RuntimeError> {
    let dir = step_dir(root, step);
    std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::CheckpointIo(dir.clone(), e))?;
    match std::fs::remove_file(dir.join(MANIFEST)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(RuntimeError::CheckpointIo(dir.join(MANIFEST), e))
        }
        _ => Ok(dir),
    }
}

/// Finishes checkpoint `dir` (made by [`begin`], its shards written as `entries`): calls
/// `before_manifest`, writes the manifest, then keeps the newest `keep` under `root`.
pub fn seal(
    root: &Path,
    dir: &Path,
    meta: &CheckpointMeta,
    entries: Vec<ShardEntry>,
    keep: usize,
    before_manifest: &dyn Fn(),
) -> Result<(), RuntimeError> {
    let manifest = CheckpointManifest {
        format: FORMAT.into(),
        step: meta.step,
        data_cursor: meta.data_cursor,
        seed: meta.seed,
        config: meta.config.clone(),
        tokenizer_sha256: meta.tokenizer_sha256.clone(),
        shards: entries,
    };
    before_manifest();
    let text = serde_json::to_vec_pretty(&manifest).expect("a manifest serialises");
    let path = dir.join(MANIFEST);
    crate::weights::write_atomic(&path, &text).map_err(|e| RuntimeError::CheckpointIo(path, e))?;
    if keep > 0 {
        prune(root, keep);
    }
    Ok(())
}

/// Step directories under `root`, newest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            e.file_type().ok()?.is_dir().then(|| (step, e.path()))
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
}

/// Removes all but the newest `keep` checkpoints (by step number).
fn prune(root: &Path, keep: usize) {
    for (_, dir) in list(root).into_iter().skip(keep) {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("could not remove old checkpoint {}: {e}", dir.display());
        }
    }
}

/// Reads and verifies checkpoint `dir`: its manifest and every shard's size and checksum.
pub fn read(dir: &Path) -> Result<(CheckpointManifest, Vec<Vec<u8>>), RuntimeError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| RuntimeError::CheckpointIo(path.clone(), e))?;
    let m: CheckpointManifest = serde_json::from_slice(&text)
        .map_err(|e| RuntimeError::Checkpoint(path.clone(), format!("unreadable manifest: {e}")))?;
    if m.format != FORMAT {
        return Err(RuntimeError::Checkpoint(
            path,
            format!("format `{}`, this nsactor reads `{FORMAT}`", m.format),
        ));
    }
    // Shards are read and hashed in parallel.
    let shards = std::thread::scope(|scope| {
        let jobs: Vec<_> = m
            .shards
            .iter()
            .map(|s| {
                scope.spawn(move || {
                    let p = dir.join(&s.file);
                    let bytes =
                        std::fs::read(&p).map_err(|e| RuntimeError::CheckpointIo(p.clone(), e))?;
                    if bytes.len() as u64 != s.bytes {
                        return Err(RuntimeError::Checkpoint(
                            p,
                            format!(
                                "{} bytes, the manifest says {} (truncated?)",
                                bytes.len(),
                                s.bytes
                            ),
                        ));
                    }
                    if sha256(&bytes) != s.sha256 {
                        return Err(RuntimeError::Checkpoint(
                            p,
                            "checksum mismatch: the shard is corrupt".into(),
                        ));
                    }
                    Ok(bytes)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("a shard reader does not panic"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok((m, shards))
}

/// A checkpoint read back and verified.
pub struct Loaded {
    pub dir: PathBuf,
    pub manifest: CheckpointManifest,
    /// Stage bytes, edge first.
    pub shards: Vec<Vec<u8>>,
}

/// The newest checkpoint under `root` that reads and verifies, with a warning for each newer
/// one that was skipped and why.
pub fn latest_valid(root: &Path) -> (Option<Loaded>, Vec<String>) {
    let mut skipped = Vec::new();
    for (_, dir) in list(root) {
        match read(&dir) {
            Ok((manifest, shards)) => {
                return (
                    Some(Loaded {
                        dir,
                        manifest,
                        shards,
                    }),
                    skipped,
                );
            }
            Err(e) => skipped.push(format!("skipping {}: {e}", dir.display())),
        }
    }
    (None, skipped)
}

/// Finds a checkpoint: `path` itself (it holds a manifest), else the newest valid one under
/// `path` or `path/checkpoints`. Skipped checkpoints are logged.
pub fn find_checkpoint(path: &Path) -> Result<Loaded, RuntimeError> {
    if path.join(MANIFEST).exists() {
        let (manifest, shards) = read(path)?;
        return Ok(Loaded {
            dir: path.to_path_buf(),
            manifest,
            shards,
        });
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        let (found, skipped) = latest_valid(&root);
        for s in skipped {
            tracing::warn!("{s}");
        }
        if let Some(l) = found {
            return Ok(l);
        }
    }
    Err(RuntimeError::Invalid(format!(
        "no valid checkpoint at {} or under it",
        path.display()
    )))
}

/// Fails when `tok` has ids the model's embedding cannot hold.
pub fn check_tokenizer(cfg: &RunConfig, tok: &Tokenizer) -> Result<(), RuntimeError> {
    match cfg.model.vocab_size {
        v if tok.vocab_size() <= v => Ok(()),
        v => Err(RuntimeError::Invalid(format!(
            "tokenizer {} has {} tokens but [model] vocab_size is {}; set vocab_size ≥ {} or use \
             a smaller tokenizer",
            tok.origin(),
            tok.vocab_size(),
            v,
            tok.vocab_size()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            step,
            data_cursor: Some(Cursor {
                epoch: 1,
                position: step,
            }),
            seed: 7,
            config: "x = 1".into(),
            tokenizer_sha256: None,
        }
    }

    #[test]
    fn writes_verifies_prunes_and_skips_damaged_checkpoints() {
        let root = tempfile::tempdir().unwrap();
        let shards = vec![vec![1u8; 100], vec![2u8; 50], vec![3u8; 70]];
        for step in [2, 4, 6] {
            write(root.path(), &meta(step), &shards, 2).unwrap();
        }
        let steps: Vec<u64> = list(root.path()).iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [6, 4], "only the newest two are kept");
        let (found, skipped) = latest_valid(root.path());
        let l = found.unwrap();
        assert!(skipped.is_empty());
        assert_eq!((l.manifest.step, &l.shards), (6, &shards));
        assert_eq!(l.manifest.data_cursor.unwrap().position, 6);
        let dir = l.dir;
        // Flip a byte of the newest: it is skipped with the file named, step 4 wins.
        let victim = dir.join(shard_file(1));
        let mut b = std::fs::read(&victim).unwrap();
        b[10] ^= 0x40;
        std::fs::write(&victim, b).unwrap();
        let (found, skipped) = latest_valid(root.path());
        assert_eq!(found.unwrap().manifest.step, 4);
        assert!(skipped[0].contains("layer-000.safetensors") && skipped[0].contains("corrupt"));
        // Truncate step 4's edge; tear (half-write) step 4's manifest next time round.
        let dir4 = step_dir(root.path(), 4);
        std::fs::write(dir4.join(shard_file(0)), [1u8; 10]).unwrap();
        let (found, skipped) = latest_valid(root.path());
        assert!(found.is_none());
        assert!(skipped[1].contains("truncated"), "{skipped:?}");
        let text = std::fs::read(dir4.join(MANIFEST)).unwrap();
        std::fs::write(dir4.join(MANIFEST), &text[..text.len() / 2]).unwrap();
        let (_, skipped) = latest_valid(root.path());
        assert!(skipped[1].contains("unreadable manifest"), "{skipped:?}");
    }
}
