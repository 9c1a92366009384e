//! nsactor patch: fences on a stream that is being captured into a CUDA graph.
//!
//! CubeCL orders streams with events: a stream that reads a buffer another stream wrote waits on
//! an event recorded on the writer's stream, a host read waits on one, and the collector of
//! dropped buffers waits on one. While a stream is captured, an event recorded on it is a node
//! of the graph, not a point in its real work: another stream that waits on it is pulled into
//! the capture, and a host wait on it fails (`CUDA_ERROR_CAPTURED_EVENT`). When two threads
//! work on one device side by side (the edge and a pipeline stage, each on its own stream), one
//! of them captures while the other reads what the first produced before its capture began.
//! (Threads sharing one stream cannot capture side by side at all: nsactor turns decoding's
//! graphs off there.)
//!
//! Nothing recorded during a capture runs until the graph is launched, so the real work queued
//! on a captured stream is exactly the work queued before its capture began. [`begin`] records
//! an event there before the capture starts; while it lasts, [`stand_in`] gives every fence
//! asked of that stream a fresh event that completes with it (recorded on a helper stream that
//! waits on it), which the fence owns and destroys like any other.

use cudarc::driver::sys::{CUevent_flags, CUevent_st, CUevent_wait_flags, CUstream_st};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Captured {
    stream: usize,
    /// Recorded on `stream` just before its capture began.
    before: usize,
    /// Records the stand-ins after waiting on `before`.
    helper: usize,
}

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static CAPTURED: Mutex<Vec<Captured>> = Mutex::new(Vec::new());

fn lock() -> std::sync::MutexGuard<'static, Vec<Captured>> {
    CAPTURED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records the point `stream` has reached; call right before its capture begins.
pub fn begin(stream: *mut CUstream_st) -> Result<(), String> {
    // SAFETY: `stream` is a live stream of the current context; the event and the helper
    // stream are destroyed by `end`.
    let (before, helper) = unsafe {
        let before = cudarc::driver::result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("capture fence: {e:?}"))?;
        cudarc::driver::result::event::record(before, stream)
            .map_err(|e| format!("capture fence: {e:?}"))?;
        let helper = cudarc::driver::result::stream::create(
            cudarc::driver::result::stream::StreamKind::NonBlocking,
        )
        .map_err(|e| format!("capture fence stream: {e:?}"))?;
        (before, helper)
    };
    lock().push(Captured {
        stream: stream as usize,
        before: before as usize,
        helper: helper as usize,
    });
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// The capture of `stream` has ended: its fences are recorded on it again.
pub fn end(stream: *mut CUstream_st) {
    let mut v = lock();
    if let Some(i) = v.iter().position(|c| c.stream == stream as usize) {
        let c = v.remove(i);
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: created by `begin`, destroyed once; the driver keeps what pending work
        // still needs of them.
        unsafe {
            let _ = cudarc::driver::result::event::destroy(c.before as *mut CUevent_st);
            let _ = cudarc::driver::result::stream::destroy(c.helper as *mut CUstream_st);
        }
    }
}

/// Where `stream` is being captured, an event (owned by the caller) that completes when the
/// work queued on it before the capture has.
pub fn stand_in(stream: *mut CUstream_st) -> Option<*mut CUevent_st> {
    if ACTIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    let v = lock();
    let c = v.iter().find(|c| c.stream == stream as usize)?;
    // SAFETY: `before` and `helper` live until `end`, which needs the lock held here.
    unsafe {
        let helper = c.helper as *mut CUstream_st;
        cudarc::driver::result::stream::wait_event(
            helper,
            c.before as *mut CUevent_st,
            CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
        .ok()?;
        let event =
            cudarc::driver::result::event::create(CUevent_flags::CU_EVENT_DEFAULT).ok()?;
        cudarc::driver::result::event::record(event, helper).ok()?;
        Some(event)
    }
}
