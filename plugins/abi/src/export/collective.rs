//! The plugin side of collectives between processes (ABI 10): a group's id out as bytes, a
//! joined group as the backend's communicator number, a tensor in (consumed) and its sum over
//! the group out.

use super::{bytes_out, ctx, guard};
use crate::{ErrOut, NsBuf};
use nsactor_plugin_api::{CollectiveId, Communicator, DeviceTensor};
use std::ffi::c_void;

/// # Safety
/// A live context and a writable out-buffer.
pub unsafe extern "C" fn collective_id(c: *mut c_void, out: *mut NsBuf, err: ErrOut) -> i32 {
    guard(err, || {
        // SAFETY: live context.
        let CollectiveId(bytes) = unsafe { ctx(c) }.backend.collective_id()?;
        bytes_out(out, bytes);
        Ok(())
    })
}

/// # Safety
/// A live context, `len` readable bytes at `id` and a writable out-pointer.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn collective_join(
    c: *mut c_void,
    id: *const u8,
    len: usize,
    rank: u64,
    size: u64,
    device: u64,
    out: *mut u64,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        let id = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: the host lends `len` readable bytes for the call.
            unsafe { std::slice::from_raw_parts(id, len) }.to_vec()
        };
        // SAFETY: live context.
        let comm = unsafe { ctx(c) }.backend.collective_join(
            &CollectiveId(id),
            rank as usize,
            size as usize,
            device as usize,
        )?;
        // SAFETY: `out` is writable.
        unsafe { *out = comm.0 };
        Ok(())
    })
}

/// # Safety
/// Live handles (the tensor is consumed) and a writable out-pointer.
pub unsafe extern "C" fn collective_all_reduce(
    c: *mut c_void,
    comm: u64,
    t: *mut c_void,
    out: *mut *mut c_void,
    err: ErrOut,
) -> i32 {
    // SAFETY: the host hands over a live tensor handle; it is ours from here on.
    let t = unsafe { Box::from_raw(t as *mut DeviceTensor) };
    guard(err, || {
        // SAFETY: live context.
        let sum = unsafe { ctx(c) }
            .backend
            .all_reduce_sum(Communicator(comm), *t)?;
        // SAFETY: `out` is writable.
        unsafe { *out = Box::into_raw(Box::new(sum)) as *mut c_void };
        Ok(())
    })
}
