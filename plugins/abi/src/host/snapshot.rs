//! The host side of stage snapshots (ABI 6): [`ForeignSnapshot`] holds a plugin's snapshot
//! handle and the context it belongs to, so it outlives the stage it came from and serialises
//! on whichever thread the checkpoint writer runs. Its bytes stay in the plugin's buffer
//! ([`PluginBuf`]): the host reads them in place and frees them through the plugin when done.

use super::{Context, ForeignBackend};
use crate::NsBuf;
use nsactor_plugin_api::{EngineError, ShardBytes, StageSnapshot};
use std::ffi::c_void;
use std::sync::Arc;

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
    fn bytes(mut self: Box<Self>) -> Result<ShardBytes, EngineError> {
        let c = &self.backend.ctx;
        let snap = std::mem::replace(&mut self.ptr, std::ptr::null_mut());
        let mut buf = NsBuf::EMPTY;
        let mut err = std::ptr::null_mut();
        // SAFETY: a live snapshot handle, given up here (the plugin frees it whatever happens).
        let code = unsafe { (c.table.snapshot_bytes)(c.ctx, snap, &mut buf, &mut err) };
        c.check(code, err)?;
        if buf.ptr.is_null() {
            return Ok(Vec::new().into());
        }
        Ok(ShardBytes::owned(PluginBuf {
            buf,
            ctx: c.clone(),
        }))
    }
}

/// Bytes the plugin allocated, read in place and given back to it (`buf_free`) when dropped.
struct PluginBuf {
    buf: NsBuf,
    /// Keeps the plugin loaded and its context open while the bytes live.
    ctx: Arc<Context>,
}

// SAFETY: the bytes are never written after the plugin hands them over, and `buf_free` may be
// called from any thread (ABI threading rule).
unsafe impl Send for PluginBuf {}
// SAFETY: as above: shared reads only.
unsafe impl Sync for PluginBuf {}

impl AsRef<[u8]> for PluginBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes from the plugin (not null: checked when made),
        // valid until `buf_free` in `drop`.
        unsafe { std::slice::from_raw_parts(self.buf.ptr, self.buf.len) }
    }
}

impl Drop for PluginBuf {
    fn drop(&mut self) {
        let buf = std::mem::replace(&mut self.buf, NsBuf::EMPTY);
        // SAFETY: handed back once.
        unsafe { (self.ctx.table.buf_free)(buf) };
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
