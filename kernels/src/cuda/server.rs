//! CubeCL's server thread of each device, where queued work runs (the GEMMs' cuBLASLt calls,
//! timing events, graph replays and copies), and the first failure of such a task, which the
//! next GEMM raises (a panic there would only be logged).

use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use std::cell::RefCell;
use std::collections::HashMap;

/// The first failure of a queued GEMM: it happened on the server thread, where a panic would
/// only be logged, so the next GEMM of any thread raises it.
pub(crate) static QUEUED_FAILURE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

pub(crate) type Server = <CudaRuntime as cubecl::Runtime>::Server;

thread_local! {
    /// CubeCL's handle of each device's server (the same one the tensors' clients use).
    static SERVERS: RefCell<HashMap<usize, cubecl::device_handle::DeviceHandle<Server>>> =
        RefCell::new(HashMap::new());
}

/// CubeCL's handle of `device`'s server, to queue tasks on its thread.
pub(crate) fn device_server(device: &CudaDevice) -> cubecl::device_handle::DeviceHandle<Server> {
    SERVERS.with(|s| {
        s.borrow_mut()
            .entry(device.index)
            .or_insert_with(|| {
                cubecl::device_handle::DeviceHandle::new(cubecl::device::Device::to_id(device))
            })
            .clone()
    })
}

/// Puts the calling thread's stream on `device` in compile-only mode (`on`) or back, on the
/// server and in the thread's own flag (which the autotuner and [`crate::cuda::gemm`] read);
/// whether the mode is available (it needs CubeCL's compile-ahead queue). Turning it off also
/// frees the memory the stream's pool holds unused (the prewarm's step, already dropped).
pub(crate) fn compile_only(device: &CudaDevice, on: bool) -> bool {
    if on && super::device::SHARED_STREAM.load(std::sync::atomic::Ordering::Relaxed) {
        // Threads share stream 0 (`device::share_stream`): the calling thread's may be theirs.
        return false;
    }
    let set = device_server(device).submit_blocking(move |server: &mut Server| {
        server.nsactor_compile_only(cubecl::stream_id::StreamId::current(), on)
    });
    let available = set.unwrap_or(false);
    cubecl::cuda::nsactor_compile_only::set(on && available);
    if !on {
        // What the step allocated is free now: give the stream's pool back to the device.
        <CudaRuntime as cubecl::Runtime>::client(device).memory_cleanup();
    }
    available
}

/// Records the first failure of a task queued on a server thread; the next GEMM raises it.
pub(crate) fn record_queued_failure(e: String) {
    QUEUED_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert(e);
}
