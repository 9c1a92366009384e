//! Checkpoints on disk: every stage's parameters in one whole-model weights file, one safetensors
//! shard per stage with its optimizer state, and a JSON manifest (step, data cursor, config,
//! tokenizer hash, a sha256 per shard and per stage's parameters).
//!
//! Layout (format 2): `<root>/step-<step:08>/model.safetensors`,
//! `{edge,layer-000,…}.safetensors` + `manifest.json`. The weights file is the one a run exports:
//! the run's final weights are that file linked, not written again ([`crate::split`]). Format 1
//! (each shard a stage's parameters and optimizer state, no weights file) is still read. Files
//! are written in parallel ([`crate::stream`]), each atomically (temporary file, fsync, rename)
//! and hashed as it is written; the manifest is written last, so a directory without a valid
//! manifest is an unfinished checkpoint. After a write, `keep` checkpoints stay: the one just
//! written and the newest others by step number ([`prune`]). Reading verifies every checksum.

pub use crate::split::WeightsEntry;
pub use crate::stream::{ShardEntry, sha256, shard_file};
use nsactor_data::{Cursor, Tokenizer};
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
/// The format written.
const FORMAT: &str = "nsactor-checkpoint/2";
/// The format before the weights file (still read).
const FORMAT_1: &str = "nsactor-checkpoint/1";

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
    /// Format 2: the weights file holding every stage's parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsEntry>,
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

/// Writes checkpoint `meta.step` under `root` from per-stage bytes, then keeps `keep` of them
/// ([`prune`]; 0 keeps all). Returns its directory.
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
    let sealed = crate::stream::write_stages(
        &dir,
        shards.iter().collect(),
        &|b: &Vec<u8>| Ok(b.as_slice()),
        crate::stream::ReadAhead::BESIDE,
        None,
    )
    .and_then(|written| {
        seal(
            &dir,
            meta,
            (written.entries, written.weights),
            before_manifest,
        )
    });
    if let Err(e) = sealed {
        abandon(&dir);
        return Err(e);
    }
    prune(root, keep, &dir);
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

/// Removes checkpoint `dir` (made by [`begin`]) whose write failed: its partial shards can
/// never be resumed from and take the room the next write needs (a full disk). Best effort:
/// a failure to remove is logged, and the folder, without a manifest, is skipped by a resume
/// and removed by a later [`prune`].
pub fn abandon(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => tracing::info!("removed the failed checkpoint write {}", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            "could not remove the failed checkpoint write {}: {e}",
            dir.display()
        ),
    }
}

/// Finishes checkpoint `dir` (made by [`begin`], its shards and weights file written as
/// `files` say): calls `before_manifest`, then writes the manifest. The caller prunes the
/// older ones ([`prune`]) once nothing more is taken from this one.
pub fn seal(
    dir: &Path,
    meta: &CheckpointMeta,
    files: (Vec<ShardEntry>, WeightsEntry),
    before_manifest: &dyn Fn(),
) -> Result<(), RuntimeError> {
    let (entries, weights) = files;
    let manifest = CheckpointManifest {
        format: FORMAT.into(),
        step: meta.step,
        data_cursor: meta.data_cursor,
        seed: meta.seed,
        config: meta.config.clone(),
        tokenizer_sha256: meta.tokenizer_sha256.clone(),
        shards: entries,
        weights: Some(weights),
    };
    before_manifest();
    let text = serde_json::to_vec_pretty(&manifest).expect("a manifest serialises");
    let path = dir.join(MANIFEST);
    crate::weights::write_atomic(&path, &text).map_err(|e| RuntimeError::CheckpointIo(path, e))?;
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

/// Removes all but `keep` checkpoints under `root` (0: keeps all): `sealed`, the one just
/// written, and the newest others by step number that have a manifest. The one just written is
/// kept even when a run started afresh where an earlier run left checkpoints of later steps.
///
/// A folder without a manifest (a write cut short by a crash or a full disk) can never be
/// resumed from, so it does not count among the `keep`: counted, it would push out a good
/// checkpoint. One older than `sealed` is removed (its shards take room the next write
/// needs); a newer one is left as it is (not this run's to judge).
pub fn prune(root: &Path, keep: usize, sealed: &Path) {
    if keep == 0 {
        return;
    }
    let found = list(root);
    let sealed_step = found.iter().find(|(_, d)| d == sealed).map(|(s, _)| *s);
    let mut kept = 1;
    for (step, dir) in found.into_iter().filter(|(_, d)| d != sealed) {
        let remove = if dir.join(MANIFEST).exists() {
            kept += 1;
            kept > keep
        } else {
            sealed_step.is_some_and(|s| step < s)
        };
        if remove && let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("could not remove old checkpoint {}: {e}", dir.display());
        }
    }
}

/// Reads and verifies checkpoint `dir`: its manifest and every shard's size and checksum (and,
/// format 2, every stage's parameters in the weights file). Returns each stage's bytes as the
/// stage gave them.
pub fn read(dir: &Path) -> Result<(CheckpointManifest, Vec<Vec<u8>>), RuntimeError> {
    let path = dir.join(MANIFEST);
    let m = manifest(dir)?;
    let weights = match (m.format.as_str(), &m.weights) {
        (FORMAT_1, None) => None,
        (FORMAT, Some(w)) => {
            let p = dir.join(&w.file);
            let opened = crate::split::WeightsFile::open(&p, w.bytes)?;
            Some((p, opened))
        }
        (FORMAT | FORMAT_1, w) => {
            let (has, wants) = match w {
                Some(_) => ("names", "has none"),
                None => ("names no", "has one"),
            };
            return Err(RuntimeError::Checkpoint(
                path,
                format!(
                    "format `{}` {has} weights file (the format {wants})",
                    m.format
                ),
            ));
        }
        _ => {
            return Err(RuntimeError::Checkpoint(
                path,
                format!(
                    "format `{}`, this nsactor reads `{FORMAT}` and `{FORMAT_1}`",
                    m.format
                ),
            ));
        }
    };
    // Shards are read, hashed and put together with their parameters in parallel.
    let shards = std::thread::scope(|scope| {
        let jobs: Vec<_> = m
            .shards
            .iter()
            .map(|s| {
                let (weights, format) = (weights.as_ref(), m.format.as_str());
                scope.spawn(move || {
                    let p = dir.join(&s.file);
                    let bytes = std::fs::read(&p).map_err(|e| crate::split::listed_io(&p, e))?;
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
                    match (weights, &s.params) {
                        (None, None) => Ok(bytes),
                        (Some((wp, w)), Some(params)) => crate::split::rebuild(w, &bytes, params)
                            .map_err(|e| {
                                RuntimeError::Checkpoint(
                                    (*wp).clone(),
                                    format!("the parameters of {}: {e}", s.file),
                                )
                            }),
                        _ => Err(RuntimeError::Checkpoint(
                            p,
                            format!("the manifest's entry does not fit format `{format}`"),
                        )),
                    }
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("a shard reader does not panic"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok((m, shards))
}

/// Checkpoint `dir`'s manifest alone (nothing it lists is read).
pub fn manifest(dir: &Path) -> Result<CheckpointManifest, RuntimeError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| RuntimeError::CheckpointIo(path.clone(), e))?;
    serde_json::from_slice(&text)
        .map_err(|e| RuntimeError::Checkpoint(path, format!("unreadable manifest: {e}")))
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

    /// Three stages' bytes as a stage gives them: parameters, Adam moments, metadata.
    fn stages() -> Vec<Vec<u8>> {
        (1..=3u8)
            .map(|tag| {
                let data = vec![tag; 40 * tag as usize];
                let view = || {
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        vec![10 * tag as usize],
                        &data,
                    )
                    .unwrap()
                };
                let meta = [("nsactor".to_string(), format!("{{\"stage\":{tag}}}"))];
                safetensors::serialize(
                    [
                        (format!("layers.{tag}.w"), view()),
                        (format!("layers.{tag}.b"), view()),
                        (format!("adam.layers.{tag}.w.m"), view()),
                    ],
                    Some(meta.into_iter().collect()),
                )
                .unwrap()
            })
            .collect()
    }

    #[test]
    fn writes_verifies_prunes_and_skips_damaged_checkpoints() {
        let root = tempfile::tempdir().unwrap();
        let shards = stages();
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

    /// A folder a write left without its manifest does not count among the checkpoints kept:
    /// with `keep` 2 the two newest whole ones stay, the torn one older than them goes, and
    /// a torn one newer than the one just written is left alone.
    #[test]
    fn a_torn_checkpoint_is_not_counted_among_those_kept() {
        let root = tempfile::tempdir().unwrap();
        let shards = stages();
        write(root.path(), &meta(10), &shards, 2).unwrap();
        let torn = |step| {
            let d = begin(root.path(), step).unwrap();
            std::fs::write(d.join(shard_file(0)), [1u8; 64]).unwrap();
        };
        torn(20);
        torn(90);
        write(root.path(), &meta(30), &shards, 2).unwrap();
        let steps: Vec<u64> = list(root.path()).iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [90, 30, 10]);
        let (found, _) = latest_valid(root.path());
        assert_eq!(found.unwrap().manifest.step, 30);
        write(root.path(), &meta(40), &shards, 2).unwrap();
        let steps: Vec<u64> = list(root.path()).iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [90, 40, 30]);
    }

    /// A run started afresh where an earlier, longer run left checkpoints keeps the one it
    /// just wrote (its weights are the run's), whatever the step numbers.
    #[test]
    fn the_checkpoint_just_written_is_kept_beside_later_steps_of_an_earlier_run() {
        let root = tempfile::tempdir().unwrap();
        let shards = stages();
        for step in [90, 99] {
            write(root.path(), &meta(step), &shards, 0).unwrap();
        }
        let dir = write(root.path(), &meta(2), &shards, 2).unwrap();
        let steps: Vec<u64> = list(root.path()).iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [99, 2], "the one just written and the newest other");
        assert_eq!(read(&dir).unwrap().1, shards);
        write(root.path(), &meta(4), &shards, 1).unwrap();
        let steps: Vec<u64> = list(root.path()).iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [4]);
    }

    /// Format 2's weights file is verified too: a flipped parameter byte, a truncated file,
    /// a missing one are each refused with the file named.
    #[test]
    fn a_damaged_weights_file_is_refused_with_its_name() {
        let root = tempfile::tempdir().unwrap();
        let shards = stages();
        let dir = write(root.path(), &meta(3), &shards, 0).unwrap();
        let weights = dir.join(crate::split::WEIGHTS_FILE);
        let good = std::fs::read(&weights).unwrap();
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        std::fs::write(&weights, &flipped).unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("corrupt"),
            "{err}"
        );
        std::fs::write(&weights, &good[..good.len() - 4]).unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        std::fs::remove_file(&weights).unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        std::fs::write(&weights, &good).unwrap();
        assert_eq!(read(&dir).unwrap().1, shards);
    }

    /// A format-1 checkpoint (each shard a stage's whole bytes, no weights file) still reads;
    /// an unknown format is refused naming both that are read.
    #[test]
    fn format_one_checkpoints_still_read() {
        let root = tempfile::tempdir().unwrap();
        let shards = stages();
        let dir = begin(root.path(), 5).unwrap();
        let entries = shards
            .iter()
            .enumerate()
            .map(|(i, b)| {
                std::fs::write(dir.join(shard_file(i)), b).unwrap();
                ShardEntry {
                    file: shard_file(i),
                    bytes: b.len() as u64,
                    sha256: sha256(b),
                    params: None,
                }
            })
            .collect();
        let mut m = CheckpointManifest {
            format: FORMAT_1.into(),
            step: 5,
            data_cursor: None,
            seed: 1,
            config: String::new(),
            tokenizer_sha256: None,
            shards: entries,
            weights: None,
        };
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
        assert_eq!(read(&dir).unwrap().1, shards);
        m.format = "nsactor-checkpoint/9".into();
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(
            err.contains("/9") && err.contains("/1") && err.contains("/2"),
            "{err}"
        );
    }
}
