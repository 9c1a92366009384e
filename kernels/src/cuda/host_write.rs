//! Host values uploaded to the device through pinned staging: how a stage's parameters get
//! there, drawn at the start of a run or loaded from a checkpoint.
//!
//! CubeCL's own write hands the driver the caller's pageable buffer, which the driver stages
//! through pinned memory of its own, one copy at a time; on the H200 machines a 0.9B layer's
//! 172 MB took ~0.23 s that way (HISTORY, session 52). Here a tensor of at least
//! [`MIN_BYTES`] goes in pieces of [`PIECE`] bytes through one of the staging pairs
//! [`super::host_read`] keeps for the process: the host copies piece `i + 1` into one buffer of
//! the pair while piece `i` travels from the other.
//!
//! Ordering: the new tensor's buffer comes from the calling thread's CubeCL stream, and the
//! copies are enqueued on that stream (after the lookup of the buffer, a round trip to CubeCL's
//! server thread that has enqueued every earlier launch), so whatever last used the recycled
//! memory runs first and every later launch on the stream sees the values. The host waits for
//! every piece before it returns, so a staging buffer goes back to the pool idle.

use super::host_read::{PIECE, begin, check, settle};
use crate::KernelError;
use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys;
use std::ffi::c_void;

type CudaTensor = CubeTensor<CudaRuntime>;

/// Smaller uploads take CubeCL's write: a staging lease, two events and a buffer lookup cost
/// more than the driver's own staging of a few hundred kilobytes.
pub const MIN_BYTES: usize = 1 << 20;

/// A contiguous `f32` tensor of `shape` on `device` holding `values` (row-major). The backend
/// sends only uploads of at least [`MIN_BYTES`] here.
pub fn upload_f32(
    values: &[f32],
    shape: Shape,
    device: &CudaDevice,
) -> Result<CudaTensor, KernelError> {
    if shape.num_elements() != values.len() {
        return Err(KernelError::Misuse(format!(
            "upload: {} values for a shape of {} elements",
            values.len(),
            shape.num_elements()
        )));
    }
    let client = <CudaRuntime as cubecl::Runtime>::client(device);
    let src: &[u8] = bytemuck::cast_slice(values);
    if src.is_empty() {
        return Ok(empty_device_contiguous_dtype(
            client,
            device.clone(),
            shape,
            DType::F32,
        ));
    }
    let out = empty_device_contiguous_dtype(client, device.clone(), shape, DType::F32);
    let managed = out
        .client
        .get_resource(out.handle.clone())
        .map_err(|e| KernelError::Device(format!("upload: buffer unavailable: {e:?}")))?;
    let res = managed.resource();
    let (staging, events) = begin(device.index, res.stream)?;
    let pair = staging.pair();
    let bytes = src.len();
    let pieces = bytes.div_ceil(PIECE);
    let result = (|| {
        for i in 0..pieces {
            let (at, len) = (i * PIECE, (bytes - i * PIECE).min(PIECE));
            let buf = pair[i % 2];
            if i >= 2 {
                // The piece that used this buffer before has left it.
                // SAFETY: a live event of the current context, recorded two pieces ago.
                check("cuEventSynchronize", unsafe {
                    sys::cuEventSynchronize(events.0[i % 2])
                })?;
            }
            // SAFETY: the staging buffer holds PIECE ≥ len bytes and no transfer reads it (its
            // last one completed above); the destination range lies within the new tensor's
            // buffer (held by `out` and `managed`); the stream and the event belong to the
            // current context.
            unsafe {
                std::ptr::copy_nonoverlapping(src[at..].as_ptr(), buf as *mut u8, len);
                check(
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(
                        res.ptr + at as u64,
                        buf as *const c_void,
                        len,
                        res.stream,
                    ),
                )?;
                check(
                    "cuEventRecord",
                    sys::cuEventRecord(events.0[i % 2], res.stream),
                )?;
            }
        }
        // The last two pieces (one where there is one) still travel: wait before the pair
        // goes back to the pool.
        for i in pieces.saturating_sub(2)..pieces {
            // SAFETY: a live event of the current context, recorded for piece `i`.
            check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(events.0[i % 2])
            })?;
        }
        Ok(())
    })();
    settle(&result, res.stream);
    drop(events);
    drop(staging);
    drop(managed);
    result.map(|()| out)
}
