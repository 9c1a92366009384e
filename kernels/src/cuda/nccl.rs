//! NCCL collectives between processes: a group's unique id, joining it, and the all-reduce
//! the runtime runs on each stage's gradients when a world's ranks sit on GPUs.
//!
//! NCCL is loaded at run time (`libnccl.so.2`, through cudarc), so the plugin still opens on a
//! machine without it; only a world that asks for collectives there fails, saying so. Joined
//! communicators live in a process-wide table and are numbered in join order; the runtime
//! never frees one before the process ends (a world lasts as long as its run).
//!
//! The all-reduce is enqueued on the calling thread's CubeCL stream of the tensor's device,
//! which `get_resource` first makes wait for the input's producer, as [`super::device`]'s peer
//! copy does; later work on that stream sees the sum, and the host never waits. Call it on the
//! thread whose stream made the input and will use the sum (the runtime runs it as a job of
//! the stage's worker): called from another thread while that stream went on computing, the
//! training losses drifted from one GPU's (2 × H200, docs/benchmarks/HISTORY.md issue 32): presumably the
//! input's buffer goes back to its pool when it is dropped here, with nothing making the
//! producer's stream wait for the collective (not verified). Out of place: the input may share
//! its buffer with another tensor.

use crate::KernelError;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use cudarc::nccl::{result as nccl, sys};
use std::sync::Mutex;

type CudaTensor = CubeTensor<CudaRuntime>;

/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// A joined communicator and the device it was joined on.
struct Comm {
    raw: usize,
    device: usize,
}

/// Communicators in join order (index = number handed out).
static COMMS: Mutex<Vec<Comm>> = Mutex::new(Vec::new());

fn nccl_error(what: &str, e: nccl::NcclError) -> KernelError {
    KernelError::Device(format!("NCCL {what}: {:?}", e.0))
}

/// Fails clearly when libnccl cannot be loaded (instead of cudarc's panic on first use).
fn loaded() -> Result<(), KernelError> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::Device(
            "NCCL is not installed (libnccl.so.2 not found on the library path); a world on \
             GPUs needs it on every host"
                .into(),
        ))
    }
}

/// A new group id (`ncclGetUniqueId`): 128 bytes, made by one rank and sent to the others.
pub fn unique_id() -> Result<Vec<u8>, KernelError> {
    loaded()?;
    let id = nccl::get_uniqueid().map_err(|e| nccl_error("get unique id", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Joins group `id` as `rank` of `size` on `device` (`ncclCommInitRank`, which returns once
/// every rank has joined); the communicator's number in this process.
pub fn join(id: &[u8], rank: usize, size: usize, device: &CudaDevice) -> Result<u64, KernelError> {
    loaded()?;
    if id.len() != ID_BYTES {
        return Err(KernelError::Misuse(format!(
            "an NCCL group id has {ID_BYTES} bytes, not {}",
            id.len()
        )));
    }
    if rank >= size {
        return Err(KernelError::Misuse(format!(
            "rank {rank} of a group of {size}"
        )));
    }
    let mut unique = sys::ncclUniqueId {
        internal: [0; ID_BYTES],
    };
    for (d, s) in unique.internal.iter_mut().zip(id) {
        *d = *s as std::ffi::c_char;
    }
    super::device::make_current(device.index);
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `comm` is a writable out-pointer; the device's primary context is current, so
    // NCCL binds the communicator to that GPU.
    unsafe { nccl::comm_init_rank(&mut comm, size as i32, unique, rank as i32) }.map_err(|e| {
        KernelError::Device(format!(
            "NCCL join as rank {rank} of {size} on cuda:{}: {:?}. NCCL takes one rank per GPU: \
             give each process its own (`--devices`), or reduce through the host with \
             NSACTOR_COLLECTIVES=host",
            device.index, e.0
        ))
    })?;
    let mut comms = COMMS.lock().unwrap_or_else(|e| e.into_inner());
    comms.push(Comm {
        raw: comm as usize,
        device: device.index,
    });
    Ok(comms.len() as u64 - 1)
}

/// The sum of `t` over communicator `comm`'s ranks (`ncclAllReduce`, out of place), enqueued
/// on the calling thread's stream of `t`'s device (module docs).
pub fn all_reduce_sum(t: CudaTensor, comm: u64) -> Result<CudaTensor, KernelError> {
    let (raw, device) = {
        let comms = COMMS.lock().unwrap_or_else(|e| e.into_inner());
        let c = comms.get(comm as usize).ok_or_else(|| {
            KernelError::Misuse(format!(
                "communicator {comm} was never joined ({} are)",
                comms.len()
            ))
        })?;
        (c.raw as sys::ncclComm_t, c.device)
    };
    if t.device.index != device {
        return Err(KernelError::Misuse(format!(
            "all-reduce of a tensor on cuda:{} over a communicator of cuda:{device}",
            t.device.index
        )));
    }
    let datatype = match t.dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        other => {
            return Err(KernelError::Misuse(format!(
                "all-reduce of {other:?} values"
            )));
        }
    };
    let t = into_contiguous(t);
    let count = t.meta.shape().num_elements();
    let out = empty_device_contiguous_dtype(
        t.client.clone(),
        t.device.clone(),
        t.meta.shape().clone(),
        t.dtype,
    );
    if count == 0 {
        return Ok(out);
    }
    let src = t
        .client
        .get_resource(t.handle.clone())
        .map_err(|e| KernelError::Device(format!("all-reduce input unavailable: {e:?}")))?;
    let dst = out
        .client
        .get_resource(out.handle.clone())
        .map_err(|e| KernelError::Device(format!("all-reduce output unavailable: {e:?}")))?;
    let (src, dst) = (src.resource(), dst.resource());
    if dst.stream.is_null() {
        return Err(KernelError::Device(
            "the patched cubecl-cuda reports no stream".into(),
        ));
    }
    super::device::make_current(device);
    // SAFETY: both pointers are live device buffers of `count` elements of `datatype` on the
    // communicator's device (the tensors are held until after the call); the stream belongs
    // to that device's primary context, which is current.
    unsafe {
        nccl::all_reduce(
            src.ptr as *const std::ffi::c_void,
            dst.ptr as *mut std::ffi::c_void,
            count,
            datatype,
            sys::ncclRedOp_t::ncclSum,
            raw,
            dst.stream as sys::cudaStream_t,
        )
    }
    .map_err(|e| nccl_error("all-reduce", e))?;
    drop(t);
    Ok(out)
}
