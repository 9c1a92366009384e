//! The plugin side of stage snapshots (ABI 6): a snapshot taken on the stage's thread leaves
//! as a `Box<Box<dyn StageSnapshot>>` handle, and is serialised (or dropped) later from
//! whichever thread the host writes checkpoints on.

use super::{bytes_out, guard, stage_ref};
use crate::{ErrOut, NsBuf};
use nsactor_plugin_api::StageSnapshot;
use std::ffi::c_void;

/// # Safety
/// Live handles and a writable out-pointer.
pub unsafe extern "C" fn stage_snapshot(
    _c: *mut c_void,
    s: *mut c_void,
    out: *mut *mut c_void,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: live stage handle.
        let snap = unsafe { stage_ref(s) }.snapshot()?;
        // SAFETY: the host passes a writable out-pointer; the handle is its until
        // `snapshot_bytes` or `snapshot_free`.
        unsafe { *out = Box::into_raw(Box::new(snap)) as *mut c_void };
        Ok(())
    })
}

/// # Safety
/// A live snapshot handle (consumed, whatever the outcome) and a writable out-buffer.
pub unsafe extern "C" fn snapshot_bytes(
    _c: *mut c_void,
    snap: *mut c_void,
    out: *mut NsBuf,
    err: ErrOut,
) -> i32 {
    // SAFETY: a handle made by `stage_snapshot`, given back once.
    let snap = unsafe { Box::from_raw(snap as *mut Box<dyn StageSnapshot>) };
    guard(err, move || {
        // A backend's bytes are its `Vec`: handed over as they are, not copied.
        bytes_out(out, (*snap).bytes()?.into_vec());
        Ok(())
    })
}

/// # Safety
/// A live snapshot handle, given back once.
pub unsafe extern "C" fn snapshot_free(_c: *mut c_void, snap: *mut c_void) {
    // SAFETY: a handle made by `stage_snapshot`, given back once.
    let snap = unsafe { Box::from_raw(snap as *mut Box<dyn StageSnapshot>) };
    super::quietly("freeing a snapshot", move || drop(snap));
}
