//! Whole tensors read back to host memory for checkpoints, fast and beside training. The
//! staging pairs are shared with the uploads ([`super::host_write`]).
//!
//! CubeCL's own read (`read_async`) stages every tensor through pinned memory taken from the
//! calling thread's stream pool; a checkpoint's worker threads are new each time, so their pools
//! start empty and each checkpoint pins (`cuMemAllocHost`) its 10.5 GB again, a slow call that
//! also holds up the driver for the training beside it. Here each read goes through one of a
//! few pinned staging pairs kept for the life of the process: pieces of [`PIECE`] bytes are
//! copied device to host into one buffer of the pair while the host copies the other into the
//! caller's buffer, so the host copy and the transfer overlap and nothing is pinned per read.
//!
//! Ordering: the copies run on the calling thread's CubeCL stream, which CubeCL makes wait for
//! the tensor's producer when the buffer is looked up; the host waits for every piece before it
//! returns, and the tensor is held until then, so its memory cannot be reused under the copy.

use super::device::make_current;
use crate::KernelError;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result as drv, sys};
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

type CudaTensor = CubeTensor<CudaRuntime>;

/// Bytes per piece (each of a staging pair's buffers).
pub const PIECE: usize = 8 << 20;

/// A pair of pinned host buffers of [`PIECE`] bytes (addresses kept as integers so the pool is
/// `Send`; the memory is portable, usable from every context).
struct Staging([usize; 2]);

/// Staging pairs not in use, for any thread to take.
fn pool() -> &'static Mutex<Vec<Staging>> {
    static POOL: OnceLock<Mutex<Vec<Staging>>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

pub(crate) fn check(what: &str, r: sys::CUresult) -> Result<(), KernelError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Device(format!("{what}: {r:?}")))
    }
}

/// A staging pair from the pool, or two new pinned buffers when every pair is in use.
fn take() -> Result<Staging, KernelError> {
    if let Some(s) = pool().lock().unwrap_or_else(|e| e.into_inner()).pop() {
        return Ok(s);
    }
    let mut bufs = [0usize; 2];
    for b in &mut bufs {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; a context is current (the caller made it so).
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, PIECE, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        *b = p as usize;
    }
    Ok(Staging(bufs))
}

/// Returns a pair to the pool (its buffers stay pinned for the next read).
fn give(s: Staging) {
    pool().lock().unwrap_or_else(|e| e.into_inner()).push(s);
}

/// Copies `t`'s values (`f32`, any layout) into `out`, which holds exactly their bytes, in
/// pieces through a staging pair: piece `i + 1` travels while the host copies piece `i` out.
pub fn read_f32_into(t: CudaTensor, out: &mut [u8]) -> Result<(), KernelError> {
    let t = into_contiguous(t);
    let bytes = t.meta.shape().num_elements() * t.dtype.size();
    if bytes != out.len() {
        return Err(KernelError::Misuse(format!(
            "read back {bytes} bytes into a buffer of {}",
            out.len()
        )));
    }
    if bytes == 0 {
        return Ok(());
    }
    let device = t.device.index;
    let managed = t
        .client
        .get_resource(t.handle.clone())
        .map_err(|e| KernelError::Device(format!("read back: buffer unavailable: {e:?}")))?;
    let res = managed.resource();
    let (staging, events) = begin(device, res.stream)?;
    let pair = staging.pair();
    let pieces = bytes.div_ceil(PIECE);
    let span = |i: usize| (i * PIECE, (bytes - i * PIECE).min(PIECE));
    let enqueue = |i: usize| -> Result<(), KernelError> {
        let (at, len) = span(i);
        // SAFETY: the staging buffer holds PIECE ≥ len bytes and the host is not reading it
        // (its previous piece was copied out before this call); the source range lies within
        // the tensor's live buffer (held by `t` and `managed` until the end); the stream and
        // the event belong to the current context.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(
                    pair[i % 2] as *mut c_void,
                    res.ptr + at as u64,
                    len,
                    res.stream,
                ),
            )?;
            check(
                "cuEventRecord",
                sys::cuEventRecord(events.0[i % 2], res.stream),
            )
        }
    };
    let result = (|| {
        enqueue(0)?;
        for i in 0..pieces {
            if i + 1 < pieces {
                enqueue(i + 1)?;
            }
            // SAFETY: a live event of the current context.
            check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(events.0[i % 2])
            })?;
            let (at, len) = span(i);
            // SAFETY: the piece's transfer has completed (its event fired); the staging buffer
            // and `out[at..at + len]` are valid for `len` bytes and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    pair[i % 2] as *const u8,
                    out[at..at + len].as_mut_ptr(),
                    len,
                );
            }
        }
        Ok(())
    })();
    settle(&result, res.stream);
    drop(events);
    drop(staging);
    drop(managed);
    drop(t);
    result
}

/// For one transfer on `stream` (a buffer's, as the patched cubecl-cuda reports it): the
/// calling thread on `device`'s context, a staging pair and two events.
pub(crate) fn begin(device: usize, stream: sys::CUstream) -> Result<(Lease, Events), KernelError> {
    if stream.is_null() {
        return Err(KernelError::Device(
            "the patched cubecl-cuda reports no stream".into(),
        ));
    }
    make_current(device);
    Ok((Lease(Some(take()?)), Events::new()?))
}

/// After a transfer loop that failed, waits for `stream`: a transfer may still be in flight
/// from or into the staging pair, which must be idle before it goes back to the pool.
pub(crate) fn settle<T>(result: &Result<T, KernelError>, stream: sys::CUstream) {
    if result.is_err() {
        // SAFETY: the stream of a live buffer of the current context (the caller's).
        unsafe { sys::cuStreamSynchronize(stream) };
    }
}

/// A new event of the current context, without timing.
fn event() -> Result<sys::CUevent, KernelError> {
    drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| KernelError::Device(format!("event: {e:?}")))
}

/// Two events, destroyed when dropped.
pub(crate) struct Events(pub(crate) [sys::CUevent; 2]);

impl Events {
    /// Two new events of the current context (the first destroyed if the second fails).
    pub(crate) fn new() -> Result<Self, KernelError> {
        let first = event()?;
        match event() {
            Ok(second) => Ok(Events([first, second])),
            Err(e) => {
                // SAFETY: an event created above and never used.
                unsafe { sys::cuEventDestroy_v2(first) };
                Err(e)
            }
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for e in self.0 {
            // SAFETY: events created by [`event`]; destroying one still pending defers its
            // release until it completes.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

/// A staging pair taken from the pool, returned to it when dropped.
pub(crate) struct Lease(Option<Staging>);

impl Lease {
    /// The pair's two buffers.
    pub(crate) fn pair(&self) -> [usize; 2] {
        self.0.as_ref().expect("held until dropped").0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            give(s);
        }
    }
}
