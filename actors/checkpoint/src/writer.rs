//! The checkpoint writer: a checkpoint is a snapshot of every stage (taken between steps, while
//! no stage is busy: with the burn backends, handles on the device tensors, no copy) and the
//! serialising and writing of it to disk. The snapshot is quick; reading 10.5 GB back from the
//! device and writing it (hashing, files, fsync) is what stalled training for seconds at 0.9B. In
//! the background mode the supervisor hands the snapshot to a blocking task and goes on with
//! the next step; the next checkpoint (or a recovery, or the end of the run) first waits for
//! the write in flight, so at most one snapshot is held besides the live stages. Both modes
//! write the same files, stage by stage as they are read back ([`crate::stream`]); the run's
//! last checkpoint also gives the run its weights: the checkpoint's weights file, linked.

use super::checkpoint::{self, CheckpointMeta};
use super::stream;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{EngineError, ShardBytes, StageSnapshot};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A checkpoint write that finished.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteDone {
    pub step: u64,
    pub dir: PathBuf,
    /// Bytes of files written: the stage shards and the weights file.
    pub bytes: u64,
    /// From the snapshot being handed over to the manifest being on disk.
    pub seconds: f64,
    /// Time the stages spent being read back and serialised, summed over stages (the
    /// workers overlap them with each other and with the files).
    pub read_seconds: f64,
    /// The run's weights given with this checkpoint (its weights file linked there, or copied
    /// where no link can be made), and their size.
    pub export: Option<(PathBuf, u64)>,
}

/// What a checkpoint request did.
#[derive(Debug)]
pub struct CheckpointReport {
    pub step: u64,
    /// Where the checkpoint is (or will be, while it is written in the background).
    pub dir: PathBuf,
    /// Seconds training waited for an earlier write still in flight.
    pub waited_seconds: f64,
    /// Seconds the snapshot of every stage took.
    pub snapshot_seconds: f64,
    /// The earlier background write, when this request had to finish it.
    pub previous: Option<Result<WriteDone, RuntimeError>>,
    /// This checkpoint's write, when it was written before the reply (not in the background).
    pub written: Option<WriteDone>,
    /// A background write's signal that every stage has been read back: from then on the
    /// write is the disk's alone and work on the device no longer slows its reads. Closed
    /// unheard if the write failed first.
    pub reads_done: Option<std::sync::mpsc::Receiver<()>>,
}

/// The write in flight, if any.
#[derive(Default)]
pub struct Writer {
    pending: Option<(
        u64,
        tokio::task::JoinHandle<Result<WriteDone, RuntimeError>>,
    )>,
}

/// What a checkpoint writes: its directory's root, the shards and the manifest's fields.
pub struct Job {
    pub root: PathBuf,
    pub keep: usize,
    pub meta: CheckpointMeta,
    /// Every stage's snapshot, serialised by the writer.
    pub shards: Vec<Box<dyn StageSnapshot>>,
    /// `crash-in-checkpoint:STEP`: abort between the shards and the manifest.
    pub crash: bool,
    /// `enospc-in-checkpoint:STEP`: fail the first shard as a full disk would.
    pub disk_full: bool,
    /// Also make this path hold the checkpoint's weights file (the run's final weights): a
    /// hard link, so the weights are written once.
    pub export: Option<PathBuf>,
    /// Hears once every stage has been read back (the device is free of the write).
    pub reads_done: Option<std::sync::mpsc::Sender<()>>,
    /// Nothing runs on the device until the stages are read (a synchronous write, the end of a
    /// run): read them at the device's pace ([`stream::ReadAhead::alone`]) rather than
    /// the disk's, one reader beside the steps.
    pub alone: bool,
}

impl Job {
    /// Writes the checkpoint (blocking), its stages read back as `ahead` says.
    fn run(self, ahead: stream::ReadAhead) -> Result<WriteDone, RuntimeError> {
        let t = Instant::now();
        let crash = self.crash;
        let dir = checkpoint::begin(&self.root, self.meta.step)?;
        let filled = if self.disk_full {
            // Injected: the disk fills part way through the first shard.
            let shard = dir.join(checkpoint::shard_file(0));
            let _ = std::fs::write(&shard, [0u8; 4096]);
            Err(RuntimeError::CheckpointIo(
                shard,
                std::io::Error::from_raw_os_error(28), // ENOSPC
            ))
        } else {
            stream::write_stages(
                &dir,
                self.shards,
                &|s: Box<dyn StageSnapshot>| Ok(s.bytes()?),
                ahead,
                self.reads_done,
            )
        };
        let sealed = filled.and_then(|written| {
            let weights = written.weights.clone();
            let bytes = written.entries.iter().map(|e| e.bytes).sum::<u64>() + weights.bytes;
            checkpoint::seal(
                &dir,
                &self.meta,
                (written.entries, written.weights),
                &|| {
                    if crash {
                        eprintln!("injected fault: crashing before the manifest");
                        std::process::abort();
                    }
                },
            )?;
            Ok((weights, bytes, written.read_seconds))
        });
        let (weights, bytes, read_seconds) = match sealed {
            Ok(done) => done,
            Err(e) => {
                checkpoint::abandon(&dir);
                return Err(e);
            }
        };
        if let Some(to) = &self.export {
            let from = dir.join(&weights.file);
            let linked = crate::split::link_or_copy(&from, to).map_err(|e| {
                RuntimeError::Io(
                    to.clone(),
                    std::io::Error::new(e.kind(), format!("from {}: {e}", from.display())),
                )
            })?;
            if !linked {
                tracing::info!(
                    "{} is a copy of {}: no hard link across the two file systems",
                    to.display(),
                    from.display()
                );
            }
        }
        // Older checkpoints go only now: the run's weights are linked from this one first.
        checkpoint::prune(&self.root, self.keep, &dir);
        Ok(WriteDone {
            step: self.meta.step,
            dir,
            bytes,
            seconds: t.elapsed().as_secs_f64(),
            read_seconds,
            export: self.export.map(|p| (p, weights.bytes)),
        })
    }
}

impl Writer {
    /// Waits for the write in flight, if any, and returns how it ended.
    pub async fn finish(&mut self) -> Option<Result<WriteDone, RuntimeError>> {
        let (step, handle) = self.pending.take()?;
        Some(handle.await.unwrap_or_else(|e| {
            Err(RuntimeError::Runtime(format!(
                "the writer of checkpoint step {step} failed: {e}"
            )))
        }))
    }

    /// Writes `job`: in the background (returns at once; the next call waits for it) or
    /// before returning.
    pub async fn write(
        &mut self,
        job: Job,
        background: bool,
    ) -> Result<Option<WriteDone>, RuntimeError> {
        let step = job.meta.step;
        let ahead = if job.alone || !background {
            stream::ReadAhead::alone()
        } else {
            stream::ReadAhead::BESIDE
        };
        let handle = tokio::task::spawn_blocking(move || job.run(ahead));
        if background {
            self.pending = Some((step, handle));
            return Ok(None);
        }
        let done = handle
            .await
            .map_err(|e| RuntimeError::Runtime(format!("checkpoint writer: {e}")))??;
        Ok(Some(done))
    }
}

/// The bytes of every snapshot, in order.
pub fn serialise(snaps: Vec<Box<dyn StageSnapshot>>) -> Result<Vec<ShardBytes>, RuntimeError> {
    Ok(snaps
        .into_iter()
        .map(|s| s.bytes())
        .collect::<Result<Vec<_>, EngineError>>()?)
}

/// A run resumed at its last step: makes `to` (the run's weights) the weights file of its
/// final checkpoint `dir`, sealed and verified before, without writing the checkpoint again
/// (a rewrite in place would put the run's final state at the mercy of a full disk or a
/// kill). `Some(false)` where `to` already is that file, `Some(true)` where it was linked
/// (or copied) now, `None` for a format-1 checkpoint, which has no weights file.
pub fn export_sealed(dir: &Path, to: &Path) -> Result<Option<bool>, RuntimeError> {
    use std::os::unix::fs::MetadataExt;
    let Some(w) = checkpoint::manifest(dir)?.weights else {
        return Ok(None);
    };
    let from = dir.join(&w.file);
    let same =
        |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    let source = std::fs::metadata(&from).map_err(|e| crate::split::listed_io(&from, e))?;
    if std::fs::metadata(to).is_ok_and(|t| same(&t, &source)) {
        return Ok(Some(false));
    }
    crate::split::link_or_copy(&from, to).map_err(|e| {
        RuntimeError::Io(
            to.into(),
            std::io::Error::new(e.kind(), format!("from {}: {e}", from.display())),
        )
    })?;
    Ok(Some(true))
}
