//! CUDA plumbing under CubeCL: the primary contexts CubeCL runs on, and device-to-device copies.
//!
//! [`to_device`] moves a tensor to another GPU with one `cuMemcpyPeerAsync` (over NVLink/PCIe
//! peer access when the pair supports it), never through host memory, and without blocking the
//! host. Ordering uses two events:
//!
//! * the copy is enqueued on this thread's CubeCL stream of the destination device, after that
//!   stream waits for an event recorded on this thread's stream of the source device (which
//!   CubeCL had already made wait for the tensor's producer); later kernels on the destination
//!   stream therefore see the data;
//! * the source stream then waits for an event recorded after the copy, so the source memory
//!   (recycled in stream order by CubeCL's pool) cannot be reused while the copy still reads it.
//!
//! CubeCL's own cross-device path (`to_client`, NCCL send/recv on a shared communication stream)
//! was measured producing NaN gradients with two stages on two GPUs; it orders neither the
//! receive buffer's reuse nor the send buffer's release against the compute streams.

use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result as drv, sys};
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

type CudaTensor = CubeTensor<CudaRuntime>;

fn check(what: &str, r: sys::CUresult) {
    if r != sys::CUresult::CUDA_SUCCESS {
        panic!("{what}: {r:?}");
    }
}

/// The retained primary context of `device` (the one CubeCL runs on).
pub fn primary_context(device: usize) -> sys::CUcontext {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    let map = CONTEXTS.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    *map.entry(device).or_insert_with(|| {
        let dev =
            drv::device::get(device as i32).unwrap_or_else(|e| panic!("cuda:{device}: {e:?}"));
        // SAFETY: `dev` is a valid device; the retained primary context is never released, so
        // it lives as long as the process.
        let ctx = unsafe { drv::primary_ctx::retain(dev) }
            .unwrap_or_else(|e| panic!("cuda:{device} primary context: {e:?}"));
        ctx as usize
    }) as sys::CUcontext
}

/// Makes `device`'s primary context current on this thread, so that driver calls and
/// libraries (cuBLASLt) act on it.
pub fn make_current(device: usize) {
    // SAFETY: a valid, retained context.
    unsafe { drv::ctx::set_current(primary_context(device)) }
        .unwrap_or_else(|e| panic!("cuda:{device} set context: {e:?}"));
}

/// Enables `to` to read `from`'s memory directly, once per ordered pair, where the hardware
/// allows (otherwise the driver stages peer copies itself).
fn enable_peer_access(from: usize, to: usize) {
    static DONE: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
    let done = DONE.get_or_init(Default::default);
    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
    if !done.insert((from, to)) {
        return;
    }
    let (Ok(a), Ok(b)) = (drv::device::get(from as i32), drv::device::get(to as i32)) else {
        return;
    };
    let mut can = 0;
    // SAFETY: valid devices and an out-pointer to a local.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, b, a) };
    if can == 1 {
        make_current(to);
        // SAFETY: both contexts are valid; "already enabled" is not an error for us.
        let r = unsafe { sys::cuCtxEnablePeerAccess(primary_context(from), 0) };
        if r != sys::CUresult::CUDA_SUCCESS
            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        {
            panic!("cuda:{to} enable peer access to cuda:{from}: {r:?}");
        }
    }
}

/// Records an event on `stream` (of `device`) and makes `waiter` wait for it.
fn order(device: usize, stream: sys::CUstream, waiter: sys::CUstream) {
    make_current(device);
    let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .unwrap_or_else(|e| panic!("cuda:{device} event: {e:?}"));
    // SAFETY: `ev` was just created in `device`'s context, `stream` belongs to that context;
    // waiting on an event of another device is allowed; destroying a pending event defers the
    // release until it completes.
    unsafe {
        check("cuEventRecord", sys::cuEventRecord(ev, stream));
        check("cuStreamWaitEvent", sys::cuStreamWaitEvent(waiter, ev, 0));
        check("cuEventDestroy", sys::cuEventDestroy_v2(ev));
    }
}

/// `t` on `device`: itself if it is there already, else a contiguous copy made device to device.
pub fn to_device(t: CudaTensor, device: &CudaDevice) -> CudaTensor {
    if t.device == *device {
        return t;
    }
    let (from, to) = (t.device.index, device.index);
    let t = into_contiguous(t);
    let bytes = t.meta.shape().num_elements() * t.dtype.size();
    let dst_client = <CudaRuntime as cubecl::Runtime>::client(device);
    let out = empty_device_contiguous_dtype(
        dst_client.clone(),
        device.clone(),
        t.meta.shape().clone(),
        t.dtype,
    );
    if bytes == 0 {
        return out;
    }
    enable_peer_access(from, to);
    let src = t
        .client
        .get_resource(t.handle.clone())
        .unwrap_or_else(|e| panic!("peer copy: source buffer unavailable: {e:?}"));
    let dst = dst_client
        .get_resource(out.handle.clone())
        .unwrap_or_else(|e| panic!("peer copy: destination buffer unavailable: {e:?}"));
    let (src, dst) = (src.resource(), dst.resource());
    assert!(
        !src.stream.is_null() && !dst.stream.is_null(),
        "the patched cubecl-cuda reports no stream"
    );
    // Destination stream waits for the source's producer, copies, then the source stream waits
    // for the copy before its memory can be reused.
    order(from, src.stream, dst.stream);
    make_current(to);
    // SAFETY: both pointers are live device buffers of at least `bytes` bytes (the tensors are
    // held until after the call), in the given contexts; the stream belongs to `to`'s context.
    unsafe {
        check(
            "cuMemcpyPeerAsync",
            sys::cuMemcpyPeerAsync(
                dst.ptr,
                primary_context(to),
                src.ptr,
                primary_context(from),
                bytes,
                dst.stream,
            ),
        );
    }
    order(to, dst.stream, src.stream);
    drop(t);
    out
}

/// Whether some thread has put its work on the shared stream 0 ([`share_stream`]): then no
/// stream may be put in compile-only mode ([`crate::cuda::server::compile_only`]), since it
/// could be every thread's.
pub(crate) static SHARED_STREAM: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Puts the calling thread's CubeCL work on stream 0 of each device, the stream every thread
/// that calls this shares (CubeCL otherwise gives each thread its own stream and memory pool).
pub fn share_stream() {
    use cubecl::stream_id::StreamId;
    SHARED_STREAM.store(true, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: only sets this thread's stream id. CubeCL's device server runs each stream's work
    // in submission order, so threads sharing a stream stay ordered among themselves, and a
    // tensor made by one of them is used by another without a cross-stream event.
    unsafe {
        StreamId::swap(StreamId { value: 0 });
    }
}
