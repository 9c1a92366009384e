//! Typed numbers for what a stage keeps between calls: a training micro-batch's kept inputs
//! ([`MicroBatchId`]), a decoding session's membrane states ([`SessionId`]) and a copy of
//! those states kept for the prefix cache ([`SnapshotId`]).
//!
//! Both come from one [`IdAllocator`], so within a run no two things a stage keeps share a
//! number, whichever kind they are, and a micro-batch id can never be passed where a session is
//! meant. On the C boundary each is its `u64` (`#[repr(transparent)]`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A decoding session: the membrane states each stage keeps for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct SessionId(pub u64);

/// A training micro-batch in flight: the inputs (or graph) each stage keeps until its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct MicroBatchId(pub u64);

/// A copy of one session's states as they were after some prefix of its inputs, kept by each
/// stage until dropped (the prefix state cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct SnapshotId(pub u64);

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "snapshot {}", self.0)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {}", self.0)
    }
}

impl fmt::Display for MicroBatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "micro-batch {}", self.0)
    }
}

impl SessionId {
    /// The ids as the C boundary carries them.
    pub fn raw(ids: &[SessionId]) -> &[u64] {
        // SAFETY: `SessionId` is `#[repr(transparent)]` over `u64`.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u64>(), ids.len()) }
    }

    /// Ids received over the C boundary.
    pub fn from_raw(ids: &[u64]) -> &[SessionId] {
        // SAFETY: `SessionId` is `#[repr(transparent)]` over `u64`.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<SessionId>(), ids.len()) }
    }
}

impl SnapshotId {
    /// The ids as the C boundary carries them.
    pub fn raw(ids: &[SnapshotId]) -> &[u64] {
        // SAFETY: `SnapshotId` is `#[repr(transparent)]` over `u64`.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u64>(), ids.len()) }
    }

    /// Ids received over the C boundary.
    pub fn from_raw(ids: &[u64]) -> &[SnapshotId] {
        // SAFETY: `SnapshotId` is `#[repr(transparent)]` over `u64`.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<SnapshotId>(), ids.len()) }
    }
}

/// The one source of session and micro-batch ids of a run; shared by reference (`&self`).
#[derive(Debug, Default)]
pub struct IdAllocator {
    next: AtomicU64,
}

impl IdAllocator {
    pub const fn new() -> Self {
        IdAllocator {
            next: AtomicU64::new(0),
        }
    }

    /// A fresh session id.
    pub fn session(&self) -> SessionId {
        SessionId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh snapshot id.
    pub fn snapshot(&self) -> SnapshotId {
        SnapshotId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh micro-batch id.
    pub fn micro_batch(&self) -> MicroBatchId {
        MicroBatchId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// `n` fresh, consecutive micro-batch ids (one training step's).
    pub fn micro_batches(&self, n: usize) -> Vec<MicroBatchId> {
        let first = self.next.fetch_add(n as u64, Ordering::Relaxed);
        (first..first + n as u64).map(MicroBatchId).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_counter_serves_both_kinds_and_never_repeats() {
        let ids = IdAllocator::new();
        let s = ids.session();
        let m = ids.micro_batches(3);
        let t = ids.session();
        assert_eq!(s, SessionId(0));
        assert_eq!(m, vec![MicroBatchId(1), MicroBatchId(2), MicroBatchId(3)]);
        assert_eq!(t, SessionId(4));
        assert_eq!(ids.micro_batch(), MicroBatchId(5));
    }

    #[test]
    fn raw_views_round_trip() {
        let s = [SessionId(7), SessionId(9)];
        assert_eq!(SessionId::raw(&s), &[7, 9]);
        assert_eq!(SessionId::from_raw(&[7, 9]), &s);
    }
}
