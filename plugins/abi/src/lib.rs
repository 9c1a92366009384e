//! The C boundary between the nsactor runtime and backend plugins: a versioned `#[repr(C)]`
//! function table ([`NsPluginTable`]), the plugin-side export ([`export_plugin!`]) and the
//! host-side loader ([`host`]), which turns a loaded table back into the burn-free
//! [`ComputeBackend`](nsactor_plugin_api::ComputeBackend) contract, so actors cannot tell a
//! plugin from the backend linked into the binary.
//!
//! # Rules of the boundary
//!
//! * **Versioning.** A plugin exports one symbol, `nsactor_plugin_table`, returning a pointer to
//!   a static table. The host reads its first two fields, `abi_version` and `size`, before
//!   anything else, and refuses the plugin unless the version equals
//!   [`ABI_VERSION`](nsactor_plugin_api::ABI_VERSION) and the size covers every entry it knows.
//! * **Ownership.** Whoever allocates frees. Error strings and byte buffers ([`NsBuf`]) are
//!   allocated by the plugin and handed back to it (`error_free`, `buf_free`); the host copies
//!   them first. Handles — the backend context, stages, tensors — are plugin allocations the
//!   host frees through `close`, `stage_free`, `tensor_free`. Tensors passed *into*
//!   `stage_call` or `tensor_to_device` are consumed by the plugin whatever the status; tensors
//!   in a reply belong to the host. Host memory passed in (token ids, model config, weight
//!   bytes) is only borrowed for the duration of the call.
//! * **Out-parameters.** On a non-OK status the plugin writes nothing but `err`: no reply
//!   tensors, buffers or handles. `stage_param_count` has no error channel and reports 0 if the
//!   stage panicked.
//! * **Errors.** Every fallible entry returns a status ([`NS_OK`] … [`NS_PLUGIN`]) and, on
//!   failure, an owned NUL-terminated message. Panics are caught inside the plugin and reported
//!   as [`NS_PANIC`]; nothing unwinds across the boundary.
//! * **Threads.** A context may be used from several threads at once (tensor transfer, opening
//!   stages); a stage is used by one thread at a time but may move between threads. The plugin
//!   keeps no thread-local state the host must know about.
//! * **Lifetime.** Loaded libraries are never unloaded: handles and the function table stay
//!   valid for the life of the process.
//!
//! Depends on `nsactor-plugin-api` and `libloading`; burn-free. All of the workspace's `unsafe`
//! FFI code lives here and in the backends' one-line [`export_plugin!`] invocations.

pub mod diagnostic;
pub mod discovery;
pub mod export;
pub mod file_check;
pub mod host;

use std::ffi::{c_char, c_void};

pub use nsactor_plugin_api::ABI_VERSION;

/// Status codes of the table's entries.
pub const NS_OK: i32 = 0;
pub const NS_INVALID_INPUT: i32 = 1;
pub const NS_IO: i32 = 2;
pub const NS_BACKEND: i32 = 3;
pub const NS_PANIC: i32 = 4;
pub const NS_PLUGIN: i32 = 5;

/// The exported symbol every plugin defines: `extern "C" fn() -> *const NsPluginTable`.
pub const ENTRY_SYMBOL: &[u8] = b"nsactor_plugin_table";

/// Most tensors a reply carries.
pub const MAX_REPLY_TENSORS: usize = 4;
/// Most scalars a reply carries.
pub const MAX_REPLY_SCALARS: usize = 8;
/// Most dimensions of a tensor.
pub const MAX_DIMS: usize = 4;

/// Bytes allocated by the plugin (a `Vec<u8>`'s parts); return them with `buf_free`.
#[repr(C)]
pub struct NsBuf {
    pub ptr: *mut u8,
    pub len: usize,
    pub cap: usize,
}

impl NsBuf {
    pub const EMPTY: NsBuf = NsBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
        cap: 0,
    };
}

/// A stage to open. `kind` 0 = edge, 1 = layer `layer`; `optimizer` 0 = Adam, 1 = AdamW,
/// 2 = none (a stage that only serves, ABI 12); `weights` 0 = seeded, 1 = loaded by the caller
/// (ABI 11).
#[repr(C)]
pub struct NsStageSpec {
    pub kind: u32,
    pub optimizer: u32,
    pub weights: u32,
    /// Zero; keeps the next field on 8 bytes.
    pub reserved: u32,
    pub layer: u64,
    pub device: u64,
    pub seed: u64,
    pub model: NsModelConfig,
}

/// A [`ModelConfig`](nsactor_plugin_api::ModelConfig) by value. `plif_out` 0 = leak,
/// 1 = v_post.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NsModelConfig {
    pub vocab_size: u64,
    pub d: u64,
    pub n: u64,
    pub k: u64,
    pub num_layers: u64,
    pub d_ff: u64,
    pub v_th_min: f64,
    pub plif_out: u32,
    pub reserved: u32,
}

impl NsModelConfig {
    pub fn new(m: &nsactor_plugin_api::ModelConfig) -> Self {
        NsModelConfig {
            vocab_size: m.vocab_size as u64,
            d: m.d as u64,
            n: m.n as u64,
            k: m.k as u64,
            num_layers: m.num_layers as u64,
            d_ff: m.d_ff as u64,
            v_th_min: m.v_th_min,
            plif_out: match m.plif_out {
                nsactor_plugin_api::PlifOut::Leak => 0,
                nsactor_plugin_api::PlifOut::VPost => 1,
            },
            reserved: 0,
        }
    }

    pub fn get(&self) -> Result<nsactor_plugin_api::ModelConfig, nsactor_plugin_api::EngineError> {
        let plif_out = match self.plif_out {
            0 => nsactor_plugin_api::PlifOut::Leak,
            1 => nsactor_plugin_api::PlifOut::VPost,
            k => {
                return Err(nsactor_plugin_api::EngineError::InvalidInput(format!(
                    "unknown plif_out {k}"
                )));
            }
        };
        Ok(nsactor_plugin_api::ModelConfig {
            vocab_size: self.vocab_size as usize,
            d: self.d as usize,
            n: self.n as usize,
            k: self.k as usize,
            num_layers: self.num_layers as usize,
            d_ff: self.d_ff as usize,
            v_th_min: self.v_th_min,
            plif_out,
        })
    }
}

/// The arguments of one `stage_call`, a flattened
/// [`StageCall`](nsactor_plugin_api::StageCall); unused fields are zero. Pointers are borrowed.
#[repr(C)]
pub struct NsArgs {
    pub micro: u64,
    /// Session ids ([`SessionId`](nsactor_plugin_api::SessionId)): `SessionForward`/`SessionDecode`
    /// batch them, `SessionClose` has one.
    pub sessions: *const u64,
    pub sessions_len: usize,
    pub batch: u64,
    pub seq_len: u64,
    pub ids: *const i64,
    pub ids_len: usize,
    pub targets: *const i64,
    pub targets_len: usize,
    pub mask: *const f32,
    pub mask_len: usize,
    /// Call-specific numbers: `Forward` `[keep_graph as 0 or 1]`, `Backward` `[ponder_grad]`,
    /// `Head` `[loss_scale]`, `ScaleGrads` the three factors, `Step` `[lr, neuron_lr, clip]`.
    pub f: [f64; 4],
}

/// What `stage_call` returns; tensors belong to the host.
#[repr(C)]
pub struct NsReply {
    pub tensors: [*mut c_void; MAX_REPLY_TENSORS],
    pub n_tensors: u32,
    pub n_scalars: u32,
    pub scalars: [f64; MAX_REPLY_SCALARS],
}

impl NsReply {
    pub fn empty() -> Self {
        NsReply {
            tensors: [std::ptr::null_mut(); MAX_REPLY_TENSORS],
            n_tensors: 0,
            n_scalars: 0,
            scalars: [0.0; MAX_REPLY_SCALARS],
        }
    }
}

/// `err` out-parameter: on failure the plugin stores an owned C string there.
pub type ErrOut = *mut *mut c_char;

/// The plugin's function table. Append-only within one [`ABI_VERSION`]; `size` tells the host
/// how many entries the plugin has.
#[repr(C)]
pub struct NsPluginTable {
    pub abi_version: u32,
    /// `size_of::<NsPluginTable>()` as the plugin was built.
    pub size: u32,
    /// Static NUL-terminated backend name (`ndarray`, `cuda`).
    pub name: *const c_char,
    /// Static NUL-terminated version of the plugin crate.
    pub version: *const c_char,
    pub error_free: unsafe extern "C" fn(*mut c_char),
    pub buf_free: unsafe extern "C" fn(NsBuf),
    /// Creates the backend context (initialises devices). `options`: UTF-8, may be empty.
    pub open: unsafe extern "C" fn(*const u8, usize, *mut *mut c_void, ErrOut) -> i32,
    pub close: unsafe extern "C" fn(*mut c_void),
    /// Device descriptions, one per line (UTF-8).
    pub devices: unsafe extern "C" fn(*mut c_void, *mut NsBuf, ErrOut) -> i32,
    /// `(ctx, device, data, len, shape, ndim, out)`.
    pub tensor_from_host: unsafe extern "C" fn(
        *mut c_void,
        u64,
        *const f32,
        usize,
        *const usize,
        usize,
        *mut *mut c_void,
        ErrOut,
    ) -> i32,
    /// `(ctx, tensor, out f32 bytes, shape[MAX_DIMS], ndim)`.
    pub tensor_to_host: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        *mut NsBuf,
        *mut usize,
        *mut usize,
        ErrOut,
    ) -> i32,
    /// `(ctx, tensor, shape[MAX_DIMS], ndim)`; cannot fail for a live handle.
    pub tensor_shape: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut usize, *mut usize),
    /// `(ctx, tensor (consumed), device, out)`.
    pub tensor_to_device:
        unsafe extern "C" fn(*mut c_void, *mut c_void, u64, *mut *mut c_void, ErrOut) -> i32,
    pub tensor_free: unsafe extern "C" fn(*mut c_void, *mut c_void),
    pub stage_open:
        unsafe extern "C" fn(*mut c_void, *const NsStageSpec, *mut *mut c_void, ErrOut) -> i32,
    pub stage_free: unsafe extern "C" fn(*mut c_void, *mut c_void),
    /// `(ctx, stage, opcode, args, inputs (consumed), n_inputs, reply)`.
    pub stage_call: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        u32,
        *const NsArgs,
        *const *mut c_void,
        usize,
        *mut NsReply,
        ErrOut,
    ) -> i32,
    pub stage_save: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut NsBuf, ErrOut) -> i32,
    pub stage_load: unsafe extern "C" fn(*mut c_void, *mut c_void, *const u8, usize, ErrOut) -> i32,
    pub stage_param_count: unsafe extern "C" fn(*mut c_void, *mut c_void) -> u64,
    /// `(ctx, request, len, out report, err)`: a
    /// [`Diagnostic`](nsactor_plugin_api::Diagnostic) in, its
    /// [`DiagnosticReport`](nsactor_plugin_api::DiagnosticReport) out, both as the JSON of
    /// [`diagnostic`] ([`ComputeBackend::diagnose`](nsactor_plugin_api::ComputeBackend::diagnose)).
    pub diagnose: unsafe extern "C" fn(*mut c_void, *const u8, usize, *mut NsBuf, ErrOut) -> i32,
    /// `(ctx, tensor (borrowed), err)`: returns once the work producing the tensor has finished
    /// ([`ComputeBackend::ready`](nsactor_plugin_api::ComputeBackend::ready)). ABI 4.
    pub tensor_ready: unsafe extern "C" fn(*mut c_void, *mut c_void, ErrOut) -> i32,
    /// `(ctx, stage, out snapshot, err)`: the stage's state now, serialised later
    /// ([`Stage::snapshot`](nsactor_plugin_api::Stage::snapshot)). ABI 6.
    pub stage_snapshot:
        unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void, ErrOut) -> i32,
    /// `(ctx, snapshot (consumed), out bytes, err)`: what `stage_save` would have written when
    /// the snapshot was taken; callable from any thread. ABI 6.
    pub snapshot_bytes: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut NsBuf, ErrOut) -> i32,
    /// `(ctx, snapshot)`: drops a snapshot that was not serialised. ABI 6.
    pub snapshot_free: unsafe extern "C" fn(*mut c_void, *mut c_void),
    /// `(ctx, out id bytes, err)`: a new communication group's id
    /// ([`ComputeBackend::collective_id`](nsactor_plugin_api::ComputeBackend::collective_id)).
    /// ABI 10.
    pub collective_id: unsafe extern "C" fn(*mut c_void, *mut NsBuf, ErrOut) -> i32,
    /// `(ctx, id, id len, rank, size, device, out communicator, err)`: joins the group
    /// ([`ComputeBackend::collective_join`](nsactor_plugin_api::ComputeBackend::collective_join)).
    /// ABI 10.
    pub collective_join:
        unsafe extern "C" fn(*mut c_void, *const u8, usize, u64, u64, u64, *mut u64, ErrOut) -> i32,
    /// `(ctx, communicator, tensor (consumed), out, err)`: the sum over the group's ranks
    /// ([`ComputeBackend::all_reduce_sum`](nsactor_plugin_api::ComputeBackend::all_reduce_sum)).
    /// ABI 10.
    pub collective_all_reduce:
        unsafe extern "C" fn(*mut c_void, u64, *mut c_void, *mut *mut c_void, ErrOut) -> i32,
    /// `(ctx, spec, batch, seq_len, out did (0 or 1), err)`: a step's kernels compiled, not run
    /// ([`ComputeBackend::prewarm`](nsactor_plugin_api::ComputeBackend::prewarm)). ABI 17.
    pub prewarm:
        unsafe extern "C" fn(*mut c_void, *const NsStageSpec, u64, u64, *mut u32, ErrOut) -> i32,
}

// Layouts the ABI version stands for (64-bit targets): a change here must bump `ABI_VERSION`
// (and these sizes).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<NsArgs>() == 120);
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<NsReply>() == 104);
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<NsStageSpec>() == 104);
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<NsBuf>() == 24);

/// The table as a `static`: raw pointers to static strings and functions only.
#[repr(transparent)]
pub struct StaticTable(pub NsPluginTable);

// SAFETY: the table holds pointers to 'static NUL-terminated strings and to functions; nothing
// in it is ever mutated.
unsafe impl Sync for StaticTable {}
