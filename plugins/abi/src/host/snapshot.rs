//! The host side of stage snapshots (ABI 6): [`ForeignSnapshot`] holds a plugin's snapshot
//! handle and the context it belongs to, so it outlives the stage it came from and serialises
//! on whichever thread the checkpoint writer runs.

use super::ForeignBackend;
use crate::NsBuf;
use nsactor_plugin_api::{EngineError, StageSnapshot};
use std::ffi::c_void;

/// A plugin stage's snapshot, not yet serialised. Dropping it frees it in the plugin.
pub struct ForeignSnapshot {
    ptr: *mut c_void,
    backend: ForeignBackend,
}

// SAFETY: the plugin's `snapshot_bytes` and `snapshot_free` may be called from any thread (ABI
// 6), and the handle is used by one owner at a time.
unsafe impl Send for ForeignSnapshot {}

/// Takes a snapshot of the plugin stage `stage`.
pub(super) fn take(
    backend: &ForeignBackend,
    stage: *mut c_void,
) -> Result<Box<dyn StageSnapshot>, EngineError> {
    let c = &backend.ctx;
    let mut out = std::ptr::null_mut();
    let mut err = std::ptr::null_mut();
    // SAFETY: live handles, writable out-pointers.
    let code = unsafe { (c.table.stage_snapshot)(c.ctx, stage, &mut out, &mut err) };
    c.check(code, err)?;
    Ok(Box::new(ForeignSnapshot {
        ptr: out,
        backend: backend.clone(),
    }))
}

impl StageSnapshot for ForeignSnapshot {
    fn bytes(mut self: Box<Self>) -> Result<Vec<u8>, EngineError> {
        let c = &self.backend.ctx;
        let snap = std::mem::replace(&mut self.ptr, std::ptr::null_mut());
        let mut buf = NsBuf::EMPTY;
        let mut err = std::ptr::null_mut();
        // SAFETY: a live snapshot handle, given up here (the plugin frees it whatever happens).
        let code = unsafe { (c.table.snapshot_bytes)(c.ctx, snap, &mut buf, &mut err) };
        c.check(code, err)?;
        Ok(c.take_buf(buf))
    }
}

impl Drop for ForeignSnapshot {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let c = &self.backend.ctx;
        // SAFETY: a live handle, freed once.
        unsafe { (c.table.snapshot_free)(c.ctx, self.ptr) };
    }
}
