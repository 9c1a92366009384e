//! The host side of collectives between processes (ABI 10): [`ForeignBackend`]'s
//! `collective_id`, `collective_join` and `all_reduce_sum` through the plugin's table.

use super::ForeignBackend;
use crate::NsBuf;
use nsactor_plugin_api::{CollectiveId, Communicator, DeviceTensor, EngineError};

pub(super) fn id(b: &ForeignBackend) -> Result<CollectiveId, EngineError> {
    let c = &b.ctx;
    let mut buf = NsBuf::EMPTY;
    let mut err = std::ptr::null_mut();
    // SAFETY: live context, writable out-pointers.
    let code = unsafe { (c.table.collective_id)(c.ctx, &mut buf, &mut err) };
    c.check(code, err)?;
    Ok(CollectiveId(c.take_buf(buf)))
}

pub(super) fn join(
    b: &ForeignBackend,
    id: &CollectiveId,
    rank: usize,
    size: usize,
    device: usize,
) -> Result<Communicator, EngineError> {
    let c = &b.ctx;
    let mut out = 0u64;
    let mut err = std::ptr::null_mut();
    // SAFETY: live context; the id bytes live for the call; writable out-pointers.
    let code = unsafe {
        (c.table.collective_join)(
            c.ctx,
            id.0.as_ptr(),
            id.0.len(),
            rank as u64,
            size as u64,
            device as u64,
            &mut out,
            &mut err,
        )
    };
    c.check(code, err)?;
    Ok(Communicator(out))
}

pub(super) fn all_reduce(
    b: &ForeignBackend,
    comm: Communicator,
    t: DeviceTensor,
) -> Result<DeviceTensor, EngineError> {
    let c = &b.ctx;
    let ptr = b.own(t, "all_reduce_sum")?.into_raw();
    let mut out = std::ptr::null_mut();
    let mut err = std::ptr::null_mut();
    // SAFETY: a live handle we give up (consumed by the plugin), writable out-pointers.
    let code = unsafe { (c.table.collective_all_reduce)(c.ctx, comm.0, ptr, &mut out, &mut err) };
    c.check(code, err)?;
    Ok(b.wrap(out))
}
