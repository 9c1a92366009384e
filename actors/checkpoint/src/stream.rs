//! A checkpoint's shards written as they come off the device. A few workers each take the next
//! stage, read it back (a snapshot's device copy and serialising), then write its file in
//! large pieces, hashing each piece on the way (one pass over the bytes instead of a write and
//! a separate hash), so one stage's read overlaps the others' writes. A shard's bytes are
//! dropped once written, so the host holds a few stages at a time, not the whole 10.5 GB of a
//! 0.9B checkpoint. When the run's final weights are asked for, the same bytes feed them: an
//! exporter merges the stages' parameters into one file once every stage has been read, while
//! the shard files are still being written, so the end of a run reads the device once.

use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::files::write_atomic_with;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// One shard as the manifest records it: its file name, size and sha256.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

/// The sha256 of `bytes`, in lowercase hex.
pub fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// File name of stage `i` (0 = edge, i = layer i − 1).
pub fn shard_file(i: usize) -> String {
    if i == 0 {
        "edge.safetensors".into()
    } else {
        format!("layer-{:03}.safetensors", i - 1)
    }
}

/// Bytes per write (and per hash update): large enough that a write is a few system calls per
/// shard, small enough that hashing a piece keeps it in the cache.
const PIECE: usize = 8 << 20;

/// Most workers reading and writing shards at once.
const MAX_WORKERS: usize = 8;

/// What [`write_stages`] wrote.
#[derive(Debug)]
pub struct Written {
    /// One entry per stage, in stage order.
    pub entries: Vec<ShardEntry>,
    /// Time the stages spent being read (device copies and serialising), summed over stages.
    pub read_seconds: f64,
    /// Bytes of the merged weights file, when one was asked for.
    pub export_bytes: Option<u64>,
}

/// Writes `bytes` atomically to `path` and returns their sha256, hashing each piece as it is
/// written.
pub fn write_hashed(path: &Path, bytes: &[u8]) -> std::io::Result<String> {
    write_atomic_with(path, |f| {
        let mut h = Sha256::new();
        for piece in bytes.chunks(PIECE) {
            h.update(piece);
            f.write_all(piece)?;
        }
        Ok(format!("{:x}", h.finalize()))
    })
}

/// Workers for `n` shards on this machine: one per core, at least 2, at most
/// [`MAX_WORKERS`] and `n`.
pub fn workers(n: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(4, |p| p.get())
        .clamp(2, MAX_WORKERS)
        .min(n.max(1))
}

/// Reads every source with `read` and writes it as shard `i` (its stage order) in `dir`,
/// returning the entries for the manifest. With `export`, the stages' parameters are also
/// merged into that one whole-model file ([`crate::weights::merge_params`]). The first failure
/// stops the workers from taking further stages and is returned (a failed export too).
pub fn write_stages<S, B>(
    dir: &Path,
    sources: Vec<S>,
    read: &(dyn Fn(S) -> Result<B, RuntimeError> + Sync),
    export: Option<&Path>,
) -> Result<Written, RuntimeError>
where
    S: Send,
    B: AsRef<[u8]> + Send + Sync,
{
    let n = sources.len();
    let queue = Mutex::new(sources.into_iter().enumerate());
    let failed = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<(usize, Arc<B>)>();
    std::thread::scope(|scope| {
        let exporter = export.map(|path| scope.spawn(move || export_from(path, n, rx)));
        let workers: Vec<_> = (0..workers(n))
            .map(|_| {
                let tx = export.is_some().then(|| tx.clone());
                let (queue, failed) = (&queue, &failed);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    while !failed.load(Ordering::Relaxed) {
                        let Some((i, source)) = queue.lock().expect("queue").next() else {
                            break;
                        };
                        match one(dir, i, source, read, tx.as_ref()) {
                            Ok(d) => done.push((i, d)),
                            Err(e) => {
                                failed.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                        }
                    }
                    Ok(done)
                })
            })
            .collect();
        drop(tx);
        let mut entries: Vec<Option<ShardEntry>> = vec![None; n];
        let mut read = Duration::ZERO;
        let mut first_err = None;
        for w in workers {
            match w.join().expect("a shard worker does not panic") {
                Ok(done) => {
                    for (i, (entry, took)) in done {
                        entries[i] = Some(entry);
                        read += took;
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let export_bytes = match exporter.map(|h| h.join().expect("the exporter does not panic")) {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                first_err.get_or_insert(e);
                None
            }
            None => None,
        };
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(Written {
            entries: entries
                .into_iter()
                .map(|e| e.expect("every stage was written"))
                .collect(),
            read_seconds: read.as_secs_f64(),
            export_bytes,
        })
    })
}

/// Reads stage `i`, hands its bytes to the exporter (if any), writes its shard.
fn one<S, B: AsRef<[u8]>>(
    dir: &Path,
    i: usize,
    source: S,
    read: &(dyn Fn(S) -> Result<B, RuntimeError> + Sync),
    export: Option<&mpsc::Sender<(usize, Arc<B>)>>,
) -> Result<(ShardEntry, Duration), RuntimeError> {
    let t = Instant::now();
    let bytes = Arc::new(read(source)?);
    let took = t.elapsed();
    if let Some(tx) = export {
        // The exporter is gone only when it failed; its error is reported.
        let _ = tx.send((i, bytes.clone()));
    }
    let file = shard_file(i);
    let path = dir.join(&file);
    let data = (*bytes).as_ref();
    let sha256 = write_hashed(&path, data).map_err(|e| RuntimeError::CheckpointIo(path, e))?;
    Ok((
        ShardEntry {
            file,
            bytes: data.len() as u64,
            sha256,
        },
        took,
    ))
}

/// Collects the `n` stages' bytes and writes their merged parameters to `path`; `None` when
/// a stage never came (its read failed, which the workers report).
fn export_from<B: AsRef<[u8]>>(
    path: &Path,
    n: usize,
    rx: mpsc::Receiver<(usize, Arc<B>)>,
) -> Result<Option<u64>, RuntimeError> {
    let mut got: Vec<Option<Arc<B>>> = (0..n).map(|_| None).collect();
    for (i, b) in rx {
        got[i] = Some(b);
    }
    let Some(shards) = got.into_iter().collect::<Option<Vec<_>>>() else {
        return Ok(None);
    };
    let views: Vec<&[u8]> = shards.iter().map(|b| (**b).as_ref()).collect();
    let merged = crate::weights::merge_params(&views)?;
    drop(shards);
    crate::weights::write_atomic(path, &merged)
        .map_err(|e| RuntimeError::Io(path.to_path_buf(), e))?;
    Ok(Some(merged.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(tag: u8, n: usize) -> Vec<u8> {
        let data = vec![tag; n * 4];
        let v =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], &data).unwrap();
        let adam =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], &data).unwrap();
        safetensors::serialize(
            [(format!("p{tag}"), v), (format!("adam.m.p{tag}"), adam)],
            None,
        )
        .unwrap()
    }

    #[test]
    fn stages_are_written_hashed_in_order_and_exported_once() {
        let dir = tempfile::tempdir().unwrap();
        let shards: Vec<Vec<u8>> = (0..11u8).map(|t| shard(t, 1000 + t as usize)).collect();
        let export = dir.path().join("model.safetensors");
        let w = write_stages(
            dir.path(),
            shards.clone(),
            &|b: Vec<u8>| Ok(b),
            Some(&export),
        )
        .unwrap();
        for (i, (e, s)) in w.entries.iter().zip(&shards).enumerate() {
            assert_eq!(e.file, shard_file(i));
            assert_eq!(e.bytes, s.len() as u64);
            assert_eq!(e.sha256, sha256(s));
            assert_eq!(&std::fs::read(dir.path().join(&e.file)).unwrap(), s);
        }
        let merged = std::fs::read(&export).unwrap();
        assert_eq!(w.export_bytes, Some(merged.len() as u64));
        assert_eq!(merged, crate::weights::merge_params(&shards).unwrap());
        let st = safetensors::SafeTensors::deserialize(&merged).unwrap();
        assert_eq!(st.len(), 11, "the optimizer's tensors are left out");
    }

    #[test]
    fn a_failed_read_is_returned_and_no_export_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let export = dir.path().join("model.safetensors");
        let err = write_stages(
            dir.path(),
            (0..6usize).collect(),
            &|i| {
                if i == 3 {
                    Err(RuntimeError::Runtime("stage 3 lost".into()))
                } else {
                    Ok(shard(i as u8, 10))
                }
            },
            Some(&export),
        )
        .unwrap_err();
        assert!(err.to_string().contains("stage 3 lost"), "{err}");
        assert!(!export.exists());
    }

    #[test]
    fn a_failed_write_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("missing");
        let err = write_stages(&gone, vec![shard(1, 4)], &|b: Vec<u8>| Ok(b), None).unwrap_err();
        assert!(err.to_string().contains("edge.safetensors"), "{err}");
    }
}
