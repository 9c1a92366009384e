//! Device time of the projection GEMMs, the PLIF scans and whole stage calls, from CUDA events
//! recorded on the streams the work runs on (`nsactor bench train`'s breakdown).
//!
//! Off until [`start`]. While on, every cuBLASLt call of [`crate::cuda::gemm`] is bracketed by two
//! events on its stream, recorded inside the server-thread task that enqueues it, and [`timed`]
//! brackets a closure's work on the calling thread's stream with two events recorded by tasks
//! queued on CubeCL's server thread in order with the closure's launches. [`collect`] waits for
//! the device, reads each event's time from the origin event [`start`] recorded, turns timing
//! off and returns the spans. Events are pooled: after the first measured step, none is created.
//!
//! An event pair costs a few microseconds of the server thread's time, about 1% of a 0.9B
//! training step's thousands of GEMMs and scans; off, the cost is one relaxed atomic load.

use crate::KernelError;
use crate::cuda::server::{Server, device_server};
use burn_cuda::CudaDevice;
use cubecl::stream_id::StreamId;
use cudarc::driver::result::event;
use cudarc::driver::sys::{CUevent, CUevent_flags, CUstream};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What a span ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gemm,
    Scan,
    /// A stage call, by its name (`StageCall::name`).
    Call(&'static str),
}

/// A CUDA event handle (owned by a [`Log`]; used only on its device's server thread, or by a
/// caller holding the log's lock after the device was synchronised).
struct Ev(CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread of its context's process; the
// logs' mutex serialises every use.
unsafe impl Send for Ev {}

/// One device's events.
#[derive(Default)]
struct Log {
    origin: Option<Ev>,
    open: HashMap<u64, (Kind, Ev)>,
    done: Vec<(Kind, Ev, Ev)>,
    pool: Vec<Ev>,
    failure: Option<KernelError>,
}

impl Log {
    fn event(&mut self) -> Result<Ev, KernelError> {
        match self.pool.pop() {
            Some(e) => Ok(e),
            None => event::create(CUevent_flags::CU_EVENT_DEFAULT)
                .map(Ev)
                .map_err(|e| KernelError::device("timing: cuEventCreate", e)),
        }
    }

    /// Returns every span's events to the pool.
    fn recycle(&mut self) {
        let open: Vec<_> = self.open.drain().map(|(_, (_, e))| e).collect();
        self.pool.extend(open);
        for (_, a, b) in self.done.drain(..) {
            self.pool.push(a);
            self.pool.push(b);
        }
        if let Some(o) = self.origin.take() {
            self.pool.push(o);
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NEXT: AtomicU64 = AtomicU64::new(0);
static LOGS: Mutex<Vec<(usize, Log)>> = Mutex::new(Vec::new());

fn with_log<R>(device: usize, f: impl FnOnce(&mut Log) -> R) -> R {
    let mut logs = LOGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let i = match logs.iter().position(|(d, _)| *d == device) {
        Some(i) => i,
        None => {
            logs.push((device, Log::default()));
            logs.len() - 1
        }
    };
    f(&mut logs[i].1)
}

/// Whether spans are being recorded.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// A fresh span id.
pub(crate) fn next_id() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Opens span `id` of `kind` on `stream` of `device` (from a thread where that device's context
/// is current: its server thread).
pub(crate) fn begin_on(device: usize, id: u64, kind: Kind, stream: CUstream) {
    with_log(device, |log| {
        let r = log.event().and_then(|e| {
            // SAFETY: a live event of this context and a live stream of it.
            unsafe { event::record(e.0, stream) }
                .map_err(|x| KernelError::device("timing: cuEventRecord", x))?;
            log.open.insert(id, (kind, e));
            Ok(())
        });
        if let Err(e) = r {
            log.failure.get_or_insert(e);
        }
    });
}

/// Closes span `id` on `stream` (as [`begin_on`]); nothing when it was never opened (timing
/// started between the two).
pub(crate) fn end_on(device: usize, id: u64, stream: CUstream) {
    with_log(device, |log| {
        let Some((kind, start)) = log.open.remove(&id) else {
            return;
        };
        let r = log.event().and_then(|e| {
            // SAFETY: as in `begin_on`.
            unsafe { event::record(e.0, stream) }
                .map_err(|x| KernelError::device("timing: cuEventRecord", x))?;
            Ok(e)
        });
        match r {
            Ok(end) => log.done.push((kind, start, end)),
            Err(e) => {
                log.pool.push(start);
                log.failure.get_or_insert(e);
            }
        }
    });
}

/// Runs `f` — work the calling thread queues on `device` — as a span of `kind` when timing is
/// on; otherwise just runs it.
pub fn timed<R>(device: &CudaDevice, kind: Kind, f: impl FnOnce() -> R) -> R {
    if !on() {
        return f();
    }
    let id = next_id();
    let index = device.index;
    let server = device_server(device);
    // The tasks run under the submitting thread's stream id, in order with its launches.
    server.submit(
        move |s: &mut Server| match s.nsactor_stream(StreamId::current()) {
            Ok(stream) => begin_on(index, id, kind, stream),
            Err(e) => with_log(index, |l| {
                l.failure
                    .get_or_insert(KernelError::device("timing: no stream", e));
            }),
        },
    );
    let r = f();
    server.submit(
        move |s: &mut Server| match s.nsactor_stream(StreamId::current()) {
            Ok(stream) => end_on(index, id, stream),
            Err(e) => with_log(index, |l| {
                l.failure
                    .get_or_insert(KernelError::device("timing: no stream", e));
            }),
        },
    );
    r
}

/// Runs `f` on `device`'s server thread with that device's log, once the device has finished
/// all its queued work, giving it the calling thread's stream there.
fn on_drained_device<R: Send + 'static>(
    device: &CudaDevice,
    f: impl FnOnce(&mut Log, CUstream) -> Result<R, KernelError> + Send + 'static,
) -> Result<R, KernelError> {
    let index = device.index;
    device_server(device)
        .submit_blocking(move |s: &mut Server| -> Result<R, KernelError> {
            let stream = s
                .nsactor_stream(StreamId::current())
                .map_err(|e| KernelError::device("timing: no stream", e))?;
            cudarc::driver::result::ctx::synchronize()
                .map_err(|e| KernelError::device("timing: cuCtxSynchronize", e))?;
            with_log(index, |log| f(log, stream))
        })
        .map_err(|e| KernelError::device("timing: the device server did not answer", e))?
}

/// Starts a window on every device of `devices`: waits for their queued work, drops the spans
/// of any earlier window, records each device's origin event and turns timing on.
pub fn start(devices: &[CudaDevice]) -> Result<(), KernelError> {
    for d in devices {
        on_drained_device(d, |log, stream| {
            log.recycle();
            log.failure = None;
            let origin = log.event()?;
            // SAFETY: a live event and stream of this context.
            unsafe { event::record(origin.0, stream) }
                .map_err(|x| KernelError::device("timing: cuEventRecord", x))?;
            log.origin = Some(origin);
            Ok(())
        })?;
    }
    ON.store(true, Ordering::Relaxed);
    Ok(())
}

/// One device's window: its length and its spans `(kind, start, end)`, seconds from its origin.
#[derive(Debug, Clone)]
pub struct Window {
    pub device: usize,
    pub seconds: f64,
    pub spans: Vec<(Kind, f64, f64)>,
}

/// Ends the window [`start`] opened: turns timing off, waits for every device's queued work,
/// and reads the spans. An error where timing was not started, or an event failed.
pub fn collect(devices: &[CudaDevice]) -> Result<Vec<Window>, KernelError> {
    ON.store(false, Ordering::Relaxed);
    devices
        .iter()
        .map(|d| {
            let index = d.index;
            on_drained_device(d, move |log, stream| {
                let r = read(log, index, stream);
                log.recycle();
                r
            })
        })
        .collect()
}

/// The window of `log`, closed by an event recorded on `stream` now (every span has completed:
/// the caller synchronised the context).
fn read(log: &mut Log, device: usize, stream: CUstream) -> Result<Window, KernelError> {
    if let Some(e) = log.failure.take() {
        return Err(e);
    }
    let origin = log
        .origin
        .as_ref()
        .ok_or_else(|| KernelError::Misuse("timing: `report` without `start`".into()))?
        .0;
    let end = log.event()?;
    let err = |x: cudarc::driver::DriverError| KernelError::device("timing", x);
    // SAFETY: live events of this context, recorded on its streams.
    let seconds = unsafe {
        event::record(end.0, stream).map_err(err)?;
        event::synchronize(end.0).map_err(err)?;
        event::elapsed(origin, end.0).map_err(err)? as f64 * 1e-3
    };
    log.pool.push(end);
    let at = |e: &Ev| -> Result<f64, KernelError> {
        // SAFETY: as above; every span's events completed before `end`.
        Ok(unsafe { event::elapsed(origin, e.0) }.map_err(err)? as f64 * 1e-3)
    };
    let spans = log
        .done
        .iter()
        .map(|(k, a, b)| Ok((*k, at(a)?, at(b)?)))
        .collect::<Result<Vec<_>, KernelError>>()?;
    Ok(Window {
        device,
        seconds,
        spans,
    })
}
