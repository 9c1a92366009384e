//! The plugin side: a [`ComputeBackend`] behind the C table. A backend crate builds a `cdylib`
//! and invokes [`export_plugin!`](crate::export_plugin) once; everything else is here.
//!
//! Handles are `Box`es turned into raw pointers: the context is a `Box<Ctx>`, a stage a
//! `Box<Box<dyn Stage>>`, a tensor a `Box<DeviceTensor>`, a snapshot a
//! `Box<Box<dyn StageSnapshot>>`. Every entry runs inside `catch_unwind` (`unwind`): a panic is
//! [`NS_PANIC`] with its message and place, and the plugin's panic hook prints nothing.

use crate::*;
use nsactor_plugin_api::{
    ComputeBackend, DeviceTensor, EngineError, HostTensor, InitialWeights, OptimizerKind, Stage,
    StageKind, StageSpec,
};
use std::ffi::CString;

pub(crate) mod call;
pub mod collective;
pub mod snapshot;
mod unwind;

pub(crate) use unwind::{catch, quietly};

use call::decode_call;

/// The backend context behind a plugin's `*mut c_void` context handle.
pub struct Ctx {
    backend: Box<dyn ComputeBackend>,
}

/// Exports `$ctor` (`fn(&str) -> Result<Box<dyn ComputeBackend>, EngineError>`, given the open
/// options) as a plugin named `$name` with version `$version`.
#[macro_export]
macro_rules! export_plugin {
    ($name:expr, $version:expr, $ctor:path) => {
        /// # Safety
        /// Called by the host through the function table (see `nsactor-plugin-abi`).
        unsafe extern "C" fn __nsactor_open(
            options: *const u8,
            len: usize,
            out: *mut *mut ::std::ffi::c_void,
            err: $crate::ErrOut,
        ) -> i32 {
            // SAFETY: the host passes a readable options buffer and writable out-pointers.
            unsafe { $crate::export::open(options, len, out, err, $ctor) }
        }

        static __NSACTOR_TABLE: $crate::StaticTable = $crate::StaticTable($crate::NsPluginTable {
            abi_version: $crate::ABI_VERSION,
            size: ::std::mem::size_of::<$crate::NsPluginTable>() as u32,
            name: concat!($name, "\0").as_ptr() as *const ::std::ffi::c_char,
            version: concat!($version, "\0").as_ptr() as *const ::std::ffi::c_char,
            error_free: $crate::export::error_free,
            buf_free: $crate::export::buf_free,
            open: __nsactor_open,
            close: $crate::export::close,
            devices: $crate::export::devices,
            tensor_from_host: $crate::export::tensor_from_host,
            tensor_to_host: $crate::export::tensor_to_host,
            tensor_shape: $crate::export::tensor_shape,
            tensor_to_device: $crate::export::tensor_to_device,
            tensor_free: $crate::export::tensor_free,
            stage_open: $crate::export::stage_open,
            stage_free: $crate::export::stage_free,
            stage_call: $crate::export::stage_call,
            stage_save: $crate::export::stage_save,
            stage_load: $crate::export::stage_load,
            stage_param_count: $crate::export::stage_param_count,
            diagnose: $crate::export::diagnose,
            tensor_ready: $crate::export::tensor_ready,
            stage_snapshot: $crate::export::snapshot::stage_snapshot,
            snapshot_bytes: $crate::export::snapshot::snapshot_bytes,
            snapshot_free: $crate::export::snapshot::snapshot_free,
            collective_id: $crate::export::collective::collective_id,
            collective_join: $crate::export::collective::collective_join,
            collective_all_reduce: $crate::export::collective::collective_all_reduce,
            prewarm: $crate::export::prewarm,
        });

        /// The plugin's entry point.
        #[unsafe(no_mangle)]
        pub extern "C" fn nsactor_plugin_table() -> *const $crate::NsPluginTable {
            &__NSACTOR_TABLE.0
        }
    };
}

fn status(e: &EngineError) -> (i32, &str) {
    match e {
        EngineError::InvalidInput(m) => (NS_INVALID_INPUT, m),
        EngineError::Io(m) => (NS_IO, m),
        EngineError::Backend(m) => (NS_BACKEND, m),
        EngineError::Panic(m) => (NS_PANIC, m),
        EngineError::Plugin(m) => (NS_PLUGIN, m),
    }
}

fn set_err(err: ErrOut, msg: &str) {
    if err.is_null() {
        return;
    }
    let c = CString::new(msg.replace('\0', "\\0")).expect("no NUL bytes left");
    // SAFETY: the host passes a writable `*mut *mut c_char` (checked non-null above).
    unsafe { *err = c.into_raw() };
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// Runs `f`, turning errors and panics into a status and an owned message.
fn guard(err: ErrOut, f: impl FnOnce() -> Result<(), EngineError>) -> i32 {
    match catch(f) {
        Ok(Ok(())) => NS_OK,
        Ok(Err(e)) => {
            let (code, msg) = status(&e);
            set_err(err, msg);
            code
        }
        Err(message) => {
            set_err(err, &message);
            NS_PANIC
        }
    }
}

fn bytes_out(out: *mut NsBuf, v: Vec<u8>) {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: the host passes a writable NsBuf; ownership of the Vec's allocation moves to it
    // until `buf_free` gives it back.
    unsafe {
        *out = NsBuf {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            cap: v.capacity(),
        }
    };
}

/// A borrowed slice from a host pointer and length (empty when `len` is 0).
///
/// # Safety
/// `ptr` must point to `len` readable values for the duration of the call.
unsafe fn slice<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if len == 0 || ptr.is_null() {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

/// # Safety
/// `options`/`len` must be readable; `out` and `err` writable.
pub unsafe fn open(
    options: *const u8,
    len: usize,
    out: *mut *mut c_void,
    err: ErrOut,
    ctor: fn(&str) -> Result<Box<dyn ComputeBackend>, EngineError>,
) -> i32 {
    guard(err, || {
        // SAFETY: the caller guarantees the buffer.
        let opts = std::str::from_utf8(unsafe { slice(options, len) })
            .map_err(|e| EngineError::InvalidInput(format!("open options are not UTF-8: {e}")))?;
        let backend = ctor(opts)?;
        let ctx = Box::new(Ctx { backend });
        // SAFETY: `out` is writable.
        unsafe { *out = Box::into_raw(ctx) as *mut c_void };
        Ok(())
    })
}

/// # Safety
/// `s` must come from this plugin's error path (or be null).
pub unsafe extern "C" fn error_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: made by `CString::into_raw` in `set_err`.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// # Safety
/// `b` must come from this plugin (or be empty).
pub unsafe extern "C" fn buf_free(b: NsBuf) {
    if !b.ptr.is_null() {
        // SAFETY: the parts of a Vec<u8> handed out by `bytes_out`.
        drop(unsafe { Vec::from_raw_parts(b.ptr, b.len, b.cap) });
    }
}

/// # Safety
/// `ctx` must be a live context handle; every stage and tensor of it must be freed first.
pub unsafe extern "C" fn close(ctx: *mut c_void) {
    if !ctx.is_null() {
        // SAFETY: made by `open`; the host frees it once.
        quietly("closing the backend", || {
            drop(unsafe { Box::from_raw(ctx as *mut Ctx) })
        });
    }
}

/// # Safety
/// `ctx` must be a live context handle (the host never passes a dangling one).
unsafe fn ctx<'a>(ctx: *mut c_void) -> &'a Ctx {
    // SAFETY: guaranteed by the caller.
    unsafe { &*(ctx as *const Ctx) }
}

/// # Safety
/// Live handles and writable out-pointers.
pub unsafe extern "C" fn devices(c: *mut c_void, out: *mut NsBuf, err: ErrOut) -> i32 {
    guard(err, || {
        // SAFETY: live context.
        let info = unsafe { ctx(c) }.backend.info();
        bytes_out(out, info.devices.join("\n").into_bytes());
        Ok(())
    })
}

/// # Safety
/// Live context; `request`/`len` readable; `out` and `err` writable.
pub unsafe extern "C" fn diagnose(
    c: *mut c_void,
    request: *const u8,
    len: usize,
    out: *mut NsBuf,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: the caller guarantees the buffer.
        let req = std::str::from_utf8(unsafe { slice(request, len) })
            .map_err(|_| EngineError::InvalidInput("the diagnostic request is not UTF-8".into()))?;
        let what = crate::diagnostic::decode_request(req)?;
        // SAFETY: live context.
        let report = unsafe { ctx(c) }.backend.diagnose(&what)?;
        bytes_out(out, crate::diagnostic::encode_report(&report).into_bytes());
        Ok(())
    })
}

/// # Safety
/// Live handles, readable data/shape, writable out-pointers.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tensor_from_host(
    c: *mut c_void,
    device: u64,
    data: *const f32,
    len: usize,
    shape: *const usize,
    ndim: usize,
    out: *mut *mut c_void,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: the caller guarantees the buffers.
        let (data, shape) = unsafe { (slice(data, len), slice(shape, ndim)) };
        let t = HostTensor {
            data: data.to_vec(),
            shape: shape.to_vec(),
        };
        // SAFETY: live context.
        let handle = unsafe { ctx(c) }.backend.from_host(device as usize, &t)?;
        // SAFETY: `out` is writable.
        unsafe { *out = Box::into_raw(Box::new(handle)) as *mut c_void };
        Ok(())
    })
}

/// # Safety
/// Live handles; `shape` has room for `MAX_DIMS` values.
pub unsafe extern "C" fn tensor_to_host(
    c: *mut c_void,
    t: *mut c_void,
    out: *mut NsBuf,
    shape: *mut usize,
    ndim: *mut usize,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: live tensor handle.
        let t = unsafe { &*(t as *const DeviceTensor) };
        // SAFETY: live context.
        let host = unsafe { ctx(c) }.backend.to_host(t)?;
        write_shape(&host.shape, shape, ndim)?;
        let bytes: Vec<u8> = host.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes_out(out, bytes);
        Ok(())
    })
}

fn write_shape(s: &[usize], shape: *mut usize, ndim: *mut usize) -> Result<(), EngineError> {
    if s.len() > MAX_DIMS {
        return Err(EngineError::Backend(format!(
            "tensor has {} dimensions, the ABI carries at most {MAX_DIMS}",
            s.len()
        )));
    }
    // SAFETY: the host passes room for MAX_DIMS values and a writable ndim.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), shape, s.len());
        *ndim = s.len();
    }
    Ok(())
}

/// # Safety
/// Live handles; `shape` has room for `MAX_DIMS` values.
pub unsafe extern "C" fn tensor_shape(
    _c: *mut c_void,
    t: *mut c_void,
    shape: *mut usize,
    ndim: *mut usize,
) {
    quietly("reading a tensor's shape", || {
        // SAFETY: live tensor handle.
        let t = unsafe { &*(t as *const DeviceTensor) };
        let _ = write_shape(&t.shape(), shape, ndim);
    });
}

/// # Safety
/// A live context and tensor handle (borrowed).
pub unsafe extern "C" fn tensor_ready(c: *mut c_void, t: *mut c_void, err: ErrOut) -> i32 {
    guard(err, || {
        // SAFETY: live tensor handle, borrowed for the call.
        let t = unsafe { &*(t as *const DeviceTensor) };
        // SAFETY: live context.
        unsafe { ctx(c) }.backend.ready(t)
    })
}

/// # Safety
/// Live handles (the tensor is consumed) and a writable out-pointer.
pub unsafe extern "C" fn tensor_to_device(
    c: *mut c_void,
    t: *mut c_void,
    device: u64,
    out: *mut *mut c_void,
    err: ErrOut,
) -> i32 {
    // SAFETY: the host hands over a live tensor handle; it is ours from here on.
    let t = unsafe { Box::from_raw(t as *mut DeviceTensor) };
    guard(err, || {
        // SAFETY: live context.
        let moved = unsafe { ctx(c) }.backend.to_device(*t, device as usize)?;
        // SAFETY: `out` is writable.
        unsafe { *out = Box::into_raw(Box::new(moved)) as *mut c_void };
        Ok(())
    })
}

/// # Safety
/// A live tensor handle, freed once.
pub unsafe extern "C" fn tensor_free(_c: *mut c_void, t: *mut c_void) {
    if !t.is_null() {
        // SAFETY: made by this plugin; the host frees it once.
        quietly("freeing a tensor", || {
            drop(unsafe { Box::from_raw(t as *mut DeviceTensor) })
        });
    }
}

/// The spec the host sent, read back into its typed form.
fn stage_spec(s: &NsStageSpec) -> Result<StageSpec, EngineError> {
    let kind = match s.kind {
        0 => StageKind::Edge,
        1 => StageKind::Layer(s.layer as usize),
        k => return Err(EngineError::InvalidInput(format!("unknown stage kind {k}"))),
    };
    let optimizer = match s.optimizer {
        0 => Some(OptimizerKind::Adam),
        1 => Some(OptimizerKind::AdamW),
        2 => None,
        k => return Err(EngineError::InvalidInput(format!("unknown optimizer {k}"))),
    };
    let weights = match s.weights {
        0 => InitialWeights::Seeded,
        1 => InitialWeights::Loaded,
        w => {
            return Err(EngineError::InvalidInput(format!(
                "unknown initial weights {w}"
            )));
        }
    };
    Ok(StageSpec {
        kind,
        device: s.device as usize,
        model: s.model.get()?,
        seed: s.seed,
        optimizer,
        weights,
    })
}

/// # Safety
/// Live handles, a readable spec, a writable out-pointer.
pub unsafe extern "C" fn stage_open(
    c: *mut c_void,
    spec: *const NsStageSpec,
    out: *mut *mut c_void,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: the host passes a readable spec whose text it owns for the call.
        let spec = stage_spec(unsafe { &*spec })?;
        // SAFETY: live context.
        let stage = unsafe { ctx(c) }.backend.open_stage(&spec)?;
        // SAFETY: `out` is writable.
        unsafe { *out = Box::into_raw(Box::new(stage)) as *mut c_void };
        Ok(())
    })
}

/// # Safety
/// A live context, a readable spec, a writable `did`.
pub unsafe extern "C" fn prewarm(
    c: *mut c_void,
    spec: *const NsStageSpec,
    batch: u64,
    seq_len: u64,
    did: *mut u32,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: the host passes a readable spec whose text it owns for the call.
        let spec = stage_spec(unsafe { &*spec })?;
        // SAFETY: live context.
        let compiled =
            unsafe { ctx(c) }
                .backend
                .prewarm(&spec, batch as usize, seq_len as usize)?;
        // SAFETY: `did` is writable.
        unsafe { *did = u32::from(compiled) };
        Ok(())
    })
}

/// # Safety
/// A live stage handle, freed once.
pub unsafe extern "C" fn stage_free(_c: *mut c_void, s: *mut c_void) {
    if !s.is_null() {
        // SAFETY: made by `stage_open`; the host frees it once.
        quietly("freeing a stage", || {
            drop(unsafe { Box::from_raw(s as *mut Box<dyn Stage>) })
        });
    }
}

/// # Safety
/// A live stage handle.
unsafe fn stage_ref<'a>(s: *mut c_void) -> &'a dyn Stage {
    // SAFETY: guaranteed by the caller.
    unsafe { &**(s as *const Box<dyn Stage>) }
}

/// # Safety
/// A live stage handle used by one thread at a time.
unsafe fn stage<'a>(s: *mut c_void) -> &'a mut Box<dyn Stage> {
    // SAFETY: guaranteed by the caller.
    unsafe { &mut *(s as *mut Box<dyn Stage>) }
}

/// # Safety
/// Live handles; `inputs` holds `n_inputs` live tensor handles (consumed); `reply` writable.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stage_call(
    _c: *mut c_void,
    s: *mut c_void,
    op: u32,
    args: *const NsArgs,
    inputs: *const *mut c_void,
    n_inputs: usize,
    reply: *mut NsReply,
    err: ErrOut,
) -> i32 {
    // Take ownership of the inputs first: they are consumed whatever happens next.
    // SAFETY: the host passes `n_inputs` live handles it no longer owns.
    let owned: Vec<DeviceTensor> = unsafe { slice(inputs, n_inputs) }
        .iter()
        .map(|&p| *unsafe { Box::from_raw(p as *mut DeviceTensor) })
        .collect();
    guard(err, || {
        // SAFETY: readable args for the duration of the call.
        let a = unsafe { &*args };
        let mut mask = nsactor_plugin_api::ParamMask::default();
        let call = decode_call(op, a, owned, &mut mask)?;
        // SAFETY: live stage handle, one thread at a time.
        let r = unsafe { stage(s) }.call(call)?;
        if r.tensors.len() > MAX_REPLY_TENSORS || r.scalars.len() > MAX_REPLY_SCALARS {
            return Err(EngineError::Backend(format!(
                "reply of {} tensors and {} scalars exceeds the ABI's {MAX_REPLY_TENSORS} and {MAX_REPLY_SCALARS}",
                r.tensors.len(),
                r.scalars.len()
            )));
        }
        let mut out = NsReply::empty();
        out.n_scalars = r.scalars.len() as u32;
        out.scalars[..r.scalars.len()].copy_from_slice(&r.scalars);
        out.n_tensors = r.tensors.len() as u32;
        for (slot, t) in out.tensors.iter_mut().zip(r.tensors) {
            *slot = Box::into_raw(Box::new(t)) as *mut c_void;
        }
        // SAFETY: `reply` is writable.
        unsafe { *reply = out };
        Ok(())
    })
}

/// # Safety
/// Live handles and a writable out-buffer.
pub unsafe extern "C" fn stage_save(
    _c: *mut c_void,
    s: *mut c_void,
    out: *mut NsBuf,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: live stage handle.
        let bytes = unsafe { stage_ref(s) }.save()?;
        bytes_out(out, bytes);
        Ok(())
    })
}

/// # Safety
/// Live handles and `len` readable bytes.
pub unsafe extern "C" fn stage_load(
    _c: *mut c_void,
    s: *mut c_void,
    data: *const u8,
    len: usize,
    err: ErrOut,
) -> i32 {
    guard(err, || {
        // SAFETY: live stage handle and a readable buffer.
        unsafe { stage(s) }.load(unsafe { slice(data, len) })
    })
}

/// # Safety
/// A live stage handle.
pub unsafe extern "C" fn stage_param_count(_c: *mut c_void, s: *mut c_void) -> u64 {
    // SAFETY: live stage handle.
    catch(|| unsafe { stage_ref(s) }.param_count()).unwrap_or_else(|m| {
        eprintln!("error: a backend plugin panicked while counting parameters: {m}");
        0
    })
}
