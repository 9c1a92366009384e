//! A checkpoint's shards written as they come off the device. A reader reads the stages back
//! in order (a snapshot's device copy and serialising) a little ahead of a few writers, each
//! of which takes the next stage read and writes its file in large pieces, hashing each piece
//! on the way (one pass over the bytes instead of a write and a separate hash). A shard's bytes
//! are dropped once written, so beside training the host holds a few stages at a time, not
//! the whole 10.5 GB of a 0.9B checkpoint. When nothing else waits on the device (the end of a
//! run, a synchronous checkpoint) two readers read at once and run ahead of the disk as far
//! as the host's memory allows ([`ReadAhead`]), so the device is free at read speed. The same
//! bytes feed the checkpoint's weights file (format 2, [`crate::split`]): an exporter writes
//! each stage's parameters into one file as the stage is read ([`crate::streamed`]), beside
//! the shard files' writers, and the readers wait for it as for them; so every checkpoint
//! reads the device once, and a run's final weights are its last checkpoint's weights file
//! (linked, not written again). The readers, writers and
//! exporter run below the training threads' CPU priority; the reads run on threads kept for
//! the process ([`reader`]), not new ones per checkpoint.

use crate::ahead::Flow;
pub use crate::ahead::{READERS, ReadAhead};
use crate::disk::DiskMode;
use crate::split::{StageParams, WEIGHTS_FILE, WeightsEntry};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::files::write_atomic_with;
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// How far below the training threads the checkpoint's own threads run (`nice` +10): a
/// background write takes the cores the step leaves idle, not the step's.
const NICE: i32 = 10;

/// Lowers the calling thread's CPU priority by [`NICE`] (Linux: a thread has its own nice
/// value). Best effort: a refusal leaves the thread as it was.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscalls on the calling thread's own id.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (now + NICE).min(19));
    }
}

/// The [`READERS`] threads every checkpoint's stages are read back on, started with the first
/// checkpoint and kept for the process (at [`NICE`]). A device backend may give each new
/// thread its own queue and memory pools (CubeCL's CUDA runtime makes each thread a stream of
/// its own, up to 128, with its own pools that outlive the thread); new readers per checkpoint
/// would add more each time.
fn reader() -> &'static rayon::ThreadPool {
    static READER: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    READER.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(READERS)
            .thread_name(|i| format!("nsactor-ckpt-read-{i}"))
            .start_handler(|_| lower_priority())
            .build()
            .expect("a thread for checkpoint reads")
    })
}

/// One shard as the manifest records it: its file name, size and sha256, and (format 2) the
/// stage's parameters, which are in the checkpoint's weights file ([`crate::split`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<StageParams>,
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
    /// The checkpoint's weights file (every stage's parameters).
    pub weights: WeightsEntry,
}

/// Writes `parts`, one after another, atomically to `path` and returns their sha256, hashing
/// each piece as it is written and starting its write-out to the disk ([`crate::disk`]).
pub fn write_hashed(path: &Path, parts: &[&[u8]], mode: DiskMode) -> std::io::Result<String> {
    write_atomic_with(path, |f| {
        let mut h = Sha256::new();
        let mut out = crate::disk::Appender::new(f, mode);
        for piece in parts.iter().flat_map(|p| p.chunks(PIECE)) {
            h.update(piece);
            out.put(piece)?;
        }
        out.finish()?;
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

/// Reads every source with `read` on [`reader`]'s threads (`ahead.readers` at once, taking the
/// stages in order) and writes each stage's optimizer state as shard `i` in `dir` on up to
/// [`MAX_WORKERS`] writer threads, returning the entries for the manifest. Reading and writing
/// are apart: a writer never waits for a read of its own, so the disk sees every writer busy
/// while the readers go on (when each worker read its next stage itself, the reads stalled a
/// writer each and contended with each other: 8.2 s for a 0.9B checkpoint on a disk that takes
/// it in 5.0 s). The readers stay two stages, or `ahead.bytes`, ahead of the writers
/// ([`ReadAhead`]). The stages' parameters go into the checkpoint's one weights file
/// ([`WEIGHTS_FILE`]) as they are read ([`crate::streamed::write_streamed`], format 2:
/// [`crate::split`]). The first failure stops the readers and the writers from taking further
/// stages and is returned. `reads_done` hears once every stage has been read (it is dropped
/// unheard when the reading stopped early).
pub fn write_stages<S, B>(
    dir: &Path,
    sources: Vec<S>,
    read: &(dyn Fn(S) -> Result<B, RuntimeError> + Sync),
    ahead: ReadAhead,
    reads_done: Option<mpsc::Sender<()>>,
) -> Result<Written, RuntimeError>
where
    S: Send,
    B: AsRef<[u8]> + Send + Sync,
{
    let n = sources.len();
    let mode = DiskMode::from_env().map_err(RuntimeError::Runtime)?;
    let readers = ahead.readers.clamp(1, READERS).min(n.max(1));
    let writers = workers(n);
    let flow = Flow::new(readers, writers, ahead);
    let (to_export, exported) = mpsc::channel::<(usize, Held<'_, B>)>();
    let sources = Mutex::new(sources.into_iter().enumerate());
    std::thread::scope(|scope| {
        let weights = dir.join(WEIGHTS_FILE);
        let exporter = scope.spawn(move || {
            lower_priority();
            export_from(&weights, n, exported, mode)
        });
        let to_export = Some(to_export);
        let (flow, sources) = (&flow, &sources);
        let reading = scope.spawn(move || {
            let first_err = Mutex::new(None);
            let read_all = || {
                let result = (|| {
                    while flow.may_read() {
                        let next = sources.lock().unwrap_or_else(|e| e.into_inner()).next();
                        let Some((i, source)) = next else {
                            return Ok(());
                        };
                        let t = Instant::now();
                        let bytes = Arc::new(read(source)?);
                        if let Some(tx) = &to_export {
                            // The exporter is gone only when it failed; its error is reported.
                            let _ = tx.send((i, Held::new(bytes.clone(), flow)));
                        }
                        flow.push((i, bytes, t.elapsed()));
                    }
                    Ok(())
                })();
                flow.leave(true, result.is_err());
                if let Err(e) = result {
                    first_err
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                }
            };
            reader().scope(|s| {
                for _ in 0..readers {
                    s.spawn(|_| read_all());
                }
            });
            drop(to_export);
            if let Some(e) = first_err.into_inner().unwrap_or_else(|e| e.into_inner()) {
                return Err(e);
            }
            // Every stage is off the device (none was left untaken: the readers stop early
            // only on a failure or when every writer is gone): whoever waits may go on.
            let all_read = sources.lock().unwrap_or_else(|e| e.into_inner()).len() == 0;
            if all_read && let Some(tx) = reads_done {
                let _ = tx.send(());
            }
            Ok(())
        });
        let writers: Vec<_> = (0..writers)
            .map(|_| {
                scope.spawn(move || {
                    lower_priority();
                    let mut done = Vec::new();
                    while let Some((i, bytes, took)) = flow.take() {
                        match write_one(dir, i, (*bytes).as_ref(), mode) {
                            Ok(entry) => done.push((i, entry, took)),
                            Err(e) => {
                                flow.leave(false, true);
                                return Err(e);
                            }
                        }
                    }
                    flow.leave(false, false);
                    Ok(done)
                })
            })
            .collect();
        let mut entries: Vec<Option<ShardEntry>> = vec![None; n];
        let mut read = Duration::ZERO;
        let mut first_err = None;
        if let Err(e) = reading.join().expect("the shard readers do not panic") {
            first_err = Some(e);
        }
        for w in writers {
            match w.join().expect("a shard writer does not panic") {
                Ok(done) => {
                    for (i, entry, took) in done {
                        entries[i] = Some(entry);
                        read += took;
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let weights_bytes = match exporter.join().expect("the exporter does not panic") {
            Ok(b) => b,
            Err(e) => {
                first_err.get_or_insert(e);
                None
            }
        };
        if let Some(e) = first_err {
            return Err(e);
        }
        let Some(bytes) = weights_bytes else {
            return Err(RuntimeError::Runtime(
                "the weights file was given up with every stage read".into(),
            ));
        };
        Ok(Written {
            entries: entries
                .into_iter()
                .map(|e| e.expect("every stage was written"))
                .collect(),
            read_seconds: read.as_secs_f64(),
            weights: WeightsEntry {
                file: WEIGHTS_FILE.into(),
                bytes,
            },
        })
    })
}

/// Writes stage `i`'s shard in `dir` (its optimizer state, straight from the stage's bytes;
/// its parameters go to the weights file and are hashed for the manifest beside the write)
/// and returns its manifest entry.
fn write_one(
    dir: &Path,
    i: usize,
    stage: &[u8],
    mode: DiskMode,
) -> Result<ShardEntry, RuntimeError> {
    let file = shard_file(i);
    let path = dir.join(&file);
    let s = crate::split::split(stage)
        .map_err(|e| RuntimeError::Checkpoint(path.clone(), format!("stage {i}: {e}")))?;
    let parts: Vec<&[u8]> = std::iter::once(s.header.as_slice())
        .chain(s.pieces.iter().copied())
        .collect();
    let (written, params) = std::thread::scope(|scope| {
        let params = scope.spawn(|| {
            lower_priority();
            s.record()
        });
        let written = write_hashed(&path, &parts, mode);
        (written, params.join().expect("hashing does not panic"))
    });
    let sha256 = written.map_err(|e| RuntimeError::CheckpointIo(path, e))?;
    Ok(ShardEntry {
        file,
        bytes: parts.iter().map(|p| p.len() as u64).sum(),
        sha256,
        params: Some(params),
    })
}

/// Writes the `n` stages' parameters to `path` as each stage arrives, by several writers at
/// once, straight from the stages' bytes; `None` (and no file) when a stage never came (its
/// read failed, which the workers report). The stages go into the file in stage order
/// whatever order several readers deliver them in (one held back until those before it
/// came), so the same weights give the same file, byte for byte.
fn export_from<B: AsRef<[u8]>>(
    path: &Path,
    n: usize,
    rx: mpsc::Receiver<(usize, Held<'_, B>)>,
    mode: DiskMode,
) -> Result<Option<u64>, RuntimeError> {
    let t = Instant::now();
    let last = std::cell::Cell::new(t);
    let (mut early, mut next) = (std::collections::BTreeMap::new(), 0);
    let stages = std::iter::from_fn(|| {
        loop {
            if let Some(b) = early.remove(&next) {
                next += 1;
                return Some(b);
            }
            // A closed channel with `next` missing: its read failed; the file is given up.
            let (i, b) = rx.recv().ok()?;
            last.set(Instant::now());
            early.insert(i, b);
        }
    });
    let Some(bytes) = crate::streamed::write_streamed(path, n, stages, mode)? else {
        return Ok(None);
    };
    let (took, after) = (
        t.elapsed().as_secs_f64(),
        last.get().elapsed().as_secs_f64(),
    );
    tracing::info!(
        "weights {}: {:.1} MB written in {took:.2} s as the stages were read ({:.2} GB/s), \
         {after:.2} s of it after the last stage came",
        path.display(),
        bytes as f64 / 1e6,
        bytes as f64 / 1e9 / took.max(1e-9)
    );
    Ok(Some(bytes))
}

/// A stage's shared bytes as the exporter holds them: counted in the readers' [`Flow`] until
/// dropped, so the readers stay within their bound of the exporter as of the shard writers.
struct Held<'f, B: AsRef<[u8]>> {
    bytes: Arc<B>,
    flow: &'f Flow<B>,
}

impl<'f, B: AsRef<[u8]>> Held<'f, B> {
    fn new(bytes: Arc<B>, flow: &'f Flow<B>) -> Self {
        flow.to_export((*bytes).as_ref().len() as u64);
        Held { bytes, flow }
    }
}

impl<B: AsRef<[u8]>> AsRef<[u8]> for Held<'_, B> {
    fn as_ref(&self) -> &[u8] {
        (*self.bytes).as_ref()
    }
}

impl<B: AsRef<[u8]>> Drop for Held<'_, B> {
    fn drop(&mut self) {
        self.flow.exported((*self.bytes).as_ref().len() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

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
    fn stages_are_written_hashed_in_order_and_exported_once_by_one_reader_or_two() {
        // Beside training (one reader, two stages ahead), alone (two readers, ahead by the
        // host's memory), and two readers held to two stages ahead.
        let both = ReadAhead {
            readers: 2,
            bytes: 0,
        };
        for ahead in [ReadAhead::BESIDE, ReadAhead::alone(), both] {
            let dir = tempfile::tempdir().unwrap();
            let shards: Vec<Vec<u8>> = (0..11u8).map(|t| shard(t, 1000 + t as usize)).collect();
            let export = dir.path().join("model.safetensors");
            let (done_tx, done_rx) = mpsc::channel();
            let w = write_stages(
                dir.path(),
                shards.clone(),
                &|b: Vec<u8>| Ok(b),
                ahead,
                Some(done_tx),
            )
            .unwrap();
            assert_eq!(done_rx.try_recv(), Ok(()), "every stage was read");
            let merged = std::fs::read(&export).unwrap();
            assert_eq!(w.weights.bytes, merged.len() as u64);
            let st = safetensors::SafeTensors::deserialize(&merged).unwrap();
            let wf = crate::split::WeightsFile::open(&export, w.weights.bytes).unwrap();
            for (i, (e, s)) in w.entries.iter().zip(&shards).enumerate() {
                assert_eq!(e.file, shard_file(i));
                let file = std::fs::read(dir.path().join(&e.file)).unwrap();
                assert_eq!((e.bytes, &e.sha256), (file.len() as u64, &sha256(&file)));
                let params = e.params.as_ref().unwrap();
                assert_eq!(&crate::split::rebuild(&wf, &file, params).unwrap(), s);
            }
            assert_eq!(st.len(), 11, "the optimizer's tensors are left out");
            let whole = crate::weights::merge_params(&shards).unwrap();
            let whole = safetensors::SafeTensors::deserialize(&whole).unwrap();
            for (name, view) in whole.tensors() {
                assert_eq!(st.tensor(&name).unwrap().data(), view.data(), "{name}");
            }
        }
    }

    #[test]
    fn the_weights_file_is_the_same_whatever_order_two_readers_deliver_in() {
        let shards: Vec<Vec<u8>> = (0..6u8).map(|t| shard(t, 500 + t as usize)).collect();
        let export = |ahead: ReadAhead, slow: Option<u8>| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("model.safetensors");
            write_stages(
                dir.path(),
                shards.clone(),
                &|b: Vec<u8>| {
                    // A stage's tag fills its data (`shard`), so its bytes end with it: hold
                    // that stage back while the other reader delivers the next ones.
                    if slow.is_some_and(|t| b.ends_with(&[t; 4])) {
                        std::thread::sleep(std::time::Duration::from_millis(150));
                    }
                    Ok(b)
                },
                ahead,
                None,
            )
            .unwrap();
            std::fs::read(&path).unwrap()
        };
        let one = export(ReadAhead::BESIDE, None);
        let two = ReadAhead {
            readers: 2,
            bytes: u64::MAX,
        };
        assert_eq!(export(two, Some(0)), one, "stage 0 delivered last");
        assert_eq!(export(two, Some(3)), one, "stage 3 delivered late");
    }

    #[test]
    fn a_failed_read_is_returned_and_no_export_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (done_tx, done_rx) = mpsc::channel();
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
            ReadAhead::alone(),
            Some(done_tx),
        )
        .unwrap_err();
        assert!(err.to_string().contains("stage 3 lost"), "{err}");
        assert!(
            done_rx.recv().is_err(),
            "a failed read is not heard as done"
        );
        assert!(!export.exists());
    }

    #[test]
    fn failing_writers_stop_the_reader_ahead_of_them() {
        // Every write fails while the reader still has stages to read: the reader, blocked on
        // a full queue, must see the writers gone and stop (no hang), and read no further.
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("missing");
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let err = write_stages(
            &gone,
            (0..40u8).collect(),
            &|t| {
                reads.fetch_add(1, Ordering::SeqCst);
                Ok(shard(t, 8))
            },
            ReadAhead::BESIDE,
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains(".safetensors"), "{err}");
        let reads = reads.load(Ordering::SeqCst);
        assert!(
            reads < 40,
            "{reads} of 40 stages read after every write failed"
        );
    }

    #[test]
    fn a_failed_write_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("missing");
        let err = write_stages(
            &gone,
            vec![shard(1, 4)],
            &|b: Vec<u8>| Ok(b),
            ReadAhead::BESIDE,
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("edge.safetensors"), "{err}");
    }
}
