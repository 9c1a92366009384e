//! How a checkpoint's stages flow from the readers to the writers ([`crate::stream`]): how
//! many readers read at once and how far ahead of the disk they may run ([`ReadAhead`]), and
//! the queue between them ([`Flow`]), which stops both sides at the first failure or once
//! every writer has gone. The weights file's writer (the exporter) holds each stage too until
//! it has written its parameters; the readers wait for it as they wait for the shard writers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Stages read and not yet taken by a writer beside training: the reader runs this far ahead
/// of the writers, so a writer that finishes a file finds the next stage ready, while the host
/// holds at most this many stages besides the ones being written.
pub(crate) const AHEAD: usize = 2;

/// Readers when the device is the write's alone ([`ReadAhead::alone`]): the host's part of a
/// read (populating the buffer, copying out of the staging pair) runs on one core per reader.
pub const READERS: usize = 2;

/// How a checkpoint's stages are read back: by how many readers, and how far ahead of the
/// writers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadAhead {
    /// Readers at once (each a thread of the checkpoint reader pool, `stream::reader`).
    pub readers: usize,
    /// Bytes of stages read and not yet taken by a writer, besides [`AHEAD`] stages, that the
    /// readers may hold: 0 beside training, where reads slow the steps and the host keeps
    /// little.
    pub bytes: u64,
}

impl ReadAhead {
    /// Beside training steps: one reader, [`AHEAD`] stages ahead (a read slows the step
    /// beside it; the writers set the pace).
    pub const BESIDE: ReadAhead = ReadAhead {
        readers: 1,
        bytes: 0,
    };

    /// Nothing else waits on the device (a synchronous checkpoint, the end of a run, whose
    /// next work waits for the reads): [`READERS`] readers, ahead of the disk by up to a
    /// quarter of the host's available memory, so the reads end at read speed rather than
    /// the disk's.
    pub fn alone() -> Self {
        ReadAhead {
            readers: READERS,
            bytes: host_available().map_or(0, |b| b / 4),
        }
    }
}

/// The host's available memory in bytes (`MemAvailable` of `/proc/meminfo`; `None` elsewhere).
fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A stage read back: its order, its bytes and how long the read took.
pub(crate) type Read<B> = (usize, Arc<B>, Duration);

/// Stages read and waiting for a writer, with who is still at work on either side.
struct Queue<B> {
    ready: std::collections::VecDeque<Read<B>>,
    /// Bytes of `ready`.
    bytes: u64,
    /// Readers not yet done.
    readers: usize,
    /// Writers still taking stages.
    writers: usize,
    /// Stages the exporter holds (sent to it, their parameters not yet written), and their
    /// bytes.
    exporting: usize,
    export_bytes: u64,
}

impl<B> Queue<B> {
    /// Whether a reader may add a stage: fewer than [`AHEAD`] wait for a writer, or fewer
    /// bytes than `ahead.bytes`; and the exporter holds at most one more than that (the stage
    /// it writes), or fewer bytes than `ahead.bytes`.
    fn has_room(&self, ahead: ReadAhead) -> bool {
        (self.ready.len() < AHEAD || self.bytes < ahead.bytes)
            && (self.exporting <= AHEAD || self.export_bytes < ahead.bytes)
    }
}

/// [`Queue`] and its wake-ups.
pub(crate) struct Flow<B> {
    queue: Mutex<Queue<B>>,
    changed: Condvar,
    failed: AtomicBool,
    ahead: ReadAhead,
}

impl<B: AsRef<[u8]>> Flow<B> {
    /// An empty queue between `readers` readers and `writers` writers, read as `ahead` says.
    pub(crate) fn new(readers: usize, writers: usize, ahead: ReadAhead) -> Self {
        Flow {
            queue: Mutex::new(Queue {
                ready: Default::default(),
                bytes: 0,
                readers,
                writers,
                exporting: 0,
                export_bytes: 0,
            }),
            changed: Condvar::new(),
            failed: AtomicBool::new(false),
            ahead,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<B>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until a reader may read another stage; false when it must stop (a failure, or
    /// every writer gone).
    pub(crate) fn may_read(&self) -> bool {
        let mut q = self.lock();
        loop {
            if self.failed.load(Ordering::Relaxed) || q.writers == 0 {
                return false;
            }
            if q.has_room(self.ahead) {
                return true;
            }
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Hands a stage read to the writers.
    pub(crate) fn push(&self, r: Read<B>) {
        let mut q = self.lock();
        q.bytes += (*r.1).as_ref().len() as u64;
        q.ready.push_back(r);
        self.changed.notify_all();
    }

    /// The next stage for a writer; `None` once the readers are done and nothing waits, or on
    /// a failure.
    pub(crate) fn take(&self) -> Option<Read<B>> {
        let mut q = self.lock();
        loop {
            if self.failed.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(r) = q.ready.pop_front() {
                q.bytes -= (*r.1).as_ref().len() as u64;
                self.changed.notify_all();
                return Some(r);
            }
            if q.readers == 0 {
                return None;
            }
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A stage of `bytes` bytes is handed to the exporter: [`Self::exported`] when it lets go.
    pub(crate) fn to_export(&self, bytes: u64) {
        let mut q = self.lock();
        q.exporting += 1;
        q.export_bytes += bytes;
    }

    /// The exporter let go of a stage of `bytes` bytes (written, or dropped on a failure).
    pub(crate) fn exported(&self, bytes: u64) {
        let mut q = self.lock();
        q.exporting -= 1;
        q.export_bytes -= bytes;
        self.changed.notify_all();
    }

    /// A reader or writer is done (or failed, which stops the others).
    pub(crate) fn leave(&self, reader: bool, failed: bool) {
        let mut q = self.lock();
        if failed {
            self.failed.store(true, Ordering::Relaxed);
        }
        if reader {
            q.readers -= 1;
        } else {
            q.writers -= 1;
        }
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_alone_run_ahead_by_bytes_and_beside_training_by_two_stages() {
        let mut q = Queue::<Vec<u8>> {
            ready: Default::default(),
            bytes: 0,
            readers: 1,
            writers: 1,
            exporting: 0,
            export_bytes: 0,
        };
        let alone = ReadAhead {
            readers: 2,
            bytes: 3_000,
        };
        for i in 0..AHEAD {
            assert!(
                q.has_room(ReadAhead::BESIDE) && q.has_room(alone),
                "{i} waiting"
            );
            q.ready
                .push_back((i, Arc::new(vec![0; 1_000]), Duration::ZERO));
            q.bytes += 1_000;
        }
        assert!(
            !q.has_room(ReadAhead::BESIDE),
            "beside training: two stages ahead"
        );
        assert!(q.has_room(alone), "2,000 of 3,000 bytes ahead");
        q.bytes += 1_000;
        assert!(!q.has_room(alone), "3,000 of 3,000 bytes ahead");
        assert!(ReadAhead::alone().readers > 1);
        // The writers took every stage; the exporter still holds them.
        q.ready.clear();
        q.bytes = 0;
        (q.exporting, q.export_bytes) = (AHEAD, 2_000);
        assert!(q.has_room(ReadAhead::BESIDE) && q.has_room(alone));
        (q.exporting, q.export_bytes) = (AHEAD + 1, 3_000);
        assert!(
            !q.has_room(ReadAhead::BESIDE),
            "beside training: the exporter at most three stages behind"
        );
        assert!(
            !q.has_room(alone),
            "3,000 of 3,000 bytes held by the exporter"
        );
    }
}
