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

/// Records the first failure of a task queued on a server thread; the next GEMM raises it.
pub(crate) fn record_queued_failure(e: String) {
    QUEUED_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert(e);
}
