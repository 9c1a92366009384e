//! The host side: finding, loading and checking plugins, and [`ForeignBackend`], which wraps a
//! loaded table as a [`ComputeBackend`].

use crate::*;
use nsactor_plugin_api::{
    BackendInfo, CollectiveId, Communicator, ComputeBackend, DeviceTensor, Diagnostic,
    DiagnosticReport, EngineError, HostTensor, InitialWeights, OptimizerKind, Reply, Stage,
    StageCall, StageKind, StageSnapshot, StageSpec, TensorObject,
};
use std::any::Any;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) mod call;
mod collective;
mod snapshot;
pub use snapshot::ForeignSnapshot;

pub use crate::discovery::{PLUGIN_PATH_ENV, discover, library_file_name, resolve, search_dirs};

/// A loaded, version-checked plugin library. Never unloaded.
#[derive(Clone)]
pub struct Plugin {
    pub path: PathBuf,
    pub name: String,
    pub version: String,
    pub abi_version: u32,
    table: &'static NsPluginTable,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("name", &self.name)
            .field("version", &self.version)
            .field("abi_version", &self.abi_version)
            .finish()
    }
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the table's strings are static and NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Plugin {
    /// Loads `path`, finds its table and checks the ABI version and table size before touching
    /// anything else.
    pub fn load(path: &Path) -> Result<Plugin, EngineError> {
        let shown = path.display();
        // A file cut short would map and then kill the process on its first missing page.
        crate::file_check::check_library_file(path)?;
        // SAFETY: loading runs the library's initialisers; plugins are trusted code chosen by
        // the deployer.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| EngineError::Plugin(format!("cannot load {shown}: {e}")))?;
        // Never unloaded: handles and the table must outlive every user.
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: the symbol's type is fixed by the ABI; a library that exports the name with
        // another type is not a plugin of ours.
        let entry: libloading::Symbol<'static, unsafe extern "C" fn() -> *const NsPluginTable> =
            unsafe { lib.get(ENTRY_SYMBOL) }.map_err(|e| {
                EngineError::Plugin(format!(
                    "{shown} is not an nsactor backend plugin: missing symbol `{}` ({e})",
                    String::from_utf8_lossy(ENTRY_SYMBOL)
                ))
            })?;
        // SAFETY: calling the entry point of a plugin.
        let ptr = unsafe { entry() };
        if ptr.is_null() {
            return Err(EngineError::Plugin(format!(
                "{shown}: `nsactor_plugin_table` returned no table"
            )));
        }
        // Only the two leading u32 fields are read until the version is known to match.
        // SAFETY: every ABI revision starts with `abi_version: u32, size: u32`.
        let (abi_version, size) = unsafe {
            let head = ptr as *const u32;
            (head.read(), head.add(1).read())
        };
        if abi_version != ABI_VERSION {
            return Err(EngineError::Plugin(format!(
                "{shown} was built for plugin ABI version {abi_version}, but this nsactor speaks \
                 ABI version {ABI_VERSION}; rebuild the plugin from the same nsactor release"
            )));
        }
        let need = std::mem::size_of::<NsPluginTable>();
        if (size as usize) < need {
            return Err(EngineError::Plugin(format!(
                "{shown}: its function table has {size} bytes, ABI {ABI_VERSION} needs {need}"
            )));
        }
        // SAFETY: version and size checked; the table is static in the never-unloaded library.
        let table: &'static NsPluginTable = unsafe { &*ptr };
        Ok(Plugin {
            path: path.to_path_buf(),
            name: cstr(table.name),
            version: cstr(table.version),
            abi_version,
            table,
        })
    }

    /// Creates a backend context: the plugin initialises its devices here.
    pub fn open(&self, options: &str) -> Result<Arc<ForeignBackend>, EngineError> {
        let mut ctx = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: a checked table; the options buffer lives for the call.
        let code =
            unsafe { (self.table.open)(options.as_ptr(), options.len(), &mut ctx, &mut err) };
        if code != NS_OK {
            let e = take_error(self.table, code, err);
            return Err(EngineError::Plugin(format!(
                "the `{}` plugin ({}) could not initialise: {e}",
                self.name,
                self.path.display()
            )));
        }
        Ok(Arc::new(ForeignBackend {
            ctx: Arc::new(Context {
                table: self.table,
                ctx,
                name: self.name.clone(),
                version: self.version.clone(),
            }),
        }))
    }
}

/// Copies and frees the plugin's error message, mapping the status to an [`EngineError`].
fn take_error(table: &NsPluginTable, code: i32, err: *mut c_char) -> EngineError {
    let msg = if err.is_null() {
        format!("status {code} without a message")
    } else {
        let m = cstr(err);
        // SAFETY: the plugin allocated it; we give it back once.
        unsafe { (table.error_free)(err) };
        m
    };
    match code {
        NS_INVALID_INPUT => EngineError::InvalidInput(msg),
        NS_IO => EngineError::Io(msg),
        NS_BACKEND => EngineError::Backend(msg),
        NS_PANIC => EngineError::Panic(msg),
        _ => EngineError::Plugin(msg),
    }
}

/// An open plugin context; closed when the last backend, stage and tensor of it are gone.
struct Context {
    table: &'static NsPluginTable,
    ctx: *mut c_void,
    name: String,
    version: String,
}

// SAFETY: the ABI requires contexts to be usable from any thread, concurrently.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every stage and tensor holds an Arc of this context, so none is left.
        unsafe { (self.table.close)(self.ctx) };
    }
}

impl Context {
    fn check(&self, code: i32, err: *mut c_char) -> Result<(), EngineError> {
        if code == NS_OK {
            Ok(())
        } else {
            Err(take_error(self.table, code, err))
        }
    }

    fn take_buf(&self, b: NsBuf) -> Vec<u8> {
        if b.ptr.is_null() {
            return Vec::new();
        }
        // SAFETY: `len` initialised bytes from the plugin, valid until `buf_free`.
        let v = unsafe { std::slice::from_raw_parts(b.ptr, b.len) }.to_vec();
        // SAFETY: handed back once.
        unsafe { (self.table.buf_free)(b) };
        v
    }
}

/// A tensor owned by a plugin.
pub struct ForeignTensor {
    ptr: *mut c_void,
    ctx: Arc<Context>,
}

// SAFETY: plugin tensors may be used and freed from any thread (ABI threading rule).
unsafe impl Send for ForeignTensor {}

impl ForeignTensor {
    /// Gives the handle up (to a consuming call).
    fn into_raw(mut self) -> *mut c_void {
        std::mem::replace(&mut self.ptr, std::ptr::null_mut())
    }
}

impl Drop for ForeignTensor {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: a live handle of this context, freed once.
            unsafe { (self.ctx.table.tensor_free)(self.ctx.ctx, self.ptr) };
        }
    }
}

impl TensorObject for ForeignTensor {
    fn shape(&self) -> Vec<usize> {
        let mut shape = [0usize; MAX_DIMS];
        let mut ndim = 0usize;
        // SAFETY: a live handle; room for MAX_DIMS values.
        unsafe {
            (self.ctx.table.tensor_shape)(self.ctx.ctx, self.ptr, shape.as_mut_ptr(), &mut ndim)
        };
        shape[..ndim.min(MAX_DIMS)].to_vec()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// A plugin backend as a [`ComputeBackend`].
#[derive(Clone)]
pub struct ForeignBackend {
    ctx: Arc<Context>,
}

impl ForeignBackend {
    fn own(&self, t: DeviceTensor, what: &str) -> Result<ForeignTensor, EngineError> {
        let t = t.downcast::<ForeignTensor>().map_err(|t| {
            EngineError::InvalidInput(format!(
                "{what}: tensor {:?} belongs to another backend",
                t.shape()
            ))
        })?;
        if !Arc::ptr_eq(&t.ctx, &self.ctx) {
            return Err(EngineError::InvalidInput(format!(
                "{what}: tensor belongs to another context of the `{}` plugin",
                self.ctx.name
            )));
        }
        Ok(t)
    }

    /// `t` as this context's tensor, borrowed.
    fn borrow<'t>(
        &self,
        t: &'t DeviceTensor,
        what: &str,
    ) -> Result<&'t ForeignTensor, EngineError> {
        let ft = t.downcast_ref::<ForeignTensor>().ok_or_else(|| {
            EngineError::InvalidInput(format!("{what}: the tensor belongs to another backend"))
        })?;
        if !Arc::ptr_eq(&ft.ctx, &self.ctx) {
            return Err(EngineError::InvalidInput(format!(
                "{what}: tensor belongs to another context of the `{}` plugin",
                self.ctx.name
            )));
        }
        Ok(ft)
    }

    fn wrap(&self, ptr: *mut c_void) -> DeviceTensor {
        DeviceTensor::new(ForeignTensor {
            ptr,
            ctx: self.ctx.clone(),
        })
    }
}

impl ComputeBackend for ForeignBackend {
    fn info(&self) -> BackendInfo {
        let c = &self.ctx;
        let mut buf = NsBuf::EMPTY;
        let mut err = std::ptr::null_mut();
        // SAFETY: live context, writable out-pointers.
        let code = unsafe { (c.table.devices)(c.ctx, &mut buf, &mut err) };
        let devices = match c.check(code, err) {
            Ok(()) => String::from_utf8_lossy(&c.take_buf(buf))
                .lines()
                .map(String::from)
                .collect(),
            Err(e) => vec![format!("(device query failed: {e})")],
        };
        BackendInfo {
            name: c.name.clone(),
            version: c.version.clone(),
            abi_version: ABI_VERSION,
            devices,
        }
    }

    fn diagnose(&self, what: &Diagnostic) -> Result<DiagnosticReport, EngineError> {
        let c = &self.ctx;
        let req = crate::diagnostic::encode_request(what);
        let mut buf = NsBuf::EMPTY;
        let mut err = std::ptr::null_mut();
        // SAFETY: live context; the request lives for the call; writable out-pointers.
        let code =
            unsafe { (c.table.diagnose)(c.ctx, req.as_ptr(), req.len(), &mut buf, &mut err) };
        c.check(code, err)?;
        let report = String::from_utf8(c.take_buf(buf))
            .map_err(|_| EngineError::Plugin("the diagnostic report is not UTF-8".into()))?;
        crate::diagnostic::decode_report(&report)
    }

    fn from_host(&self, device: usize, t: &HostTensor) -> Result<DeviceTensor, EngineError> {
        let c = &self.ctx;
        let mut out = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: live context; the host buffers live for the call.
        let code = unsafe {
            (c.table.tensor_from_host)(
                c.ctx,
                device as u64,
                t.data.as_ptr(),
                t.data.len(),
                t.shape.as_ptr(),
                t.shape.len(),
                &mut out,
                &mut err,
            )
        };
        c.check(code, err)?;
        Ok(self.wrap(out))
    }

    fn to_host(&self, t: &DeviceTensor) -> Result<HostTensor, EngineError> {
        let c = &self.ctx;
        let ft = self.borrow(t, "to_host")?;
        let mut buf = NsBuf::EMPTY;
        let mut shape = [0usize; MAX_DIMS];
        let mut ndim = 0usize;
        let mut err = std::ptr::null_mut();
        // SAFETY: live handles, writable out-pointers with room for MAX_DIMS.
        let code = unsafe {
            (c.table.tensor_to_host)(
                c.ctx,
                ft.ptr,
                &mut buf,
                shape.as_mut_ptr(),
                &mut ndim,
                &mut err,
            )
        };
        c.check(code, err)?;
        let bytes = c.take_buf(buf);
        let data = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(HostTensor {
            data,
            shape: shape[..ndim.min(MAX_DIMS)].to_vec(),
        })
    }

    fn ready(&self, t: &DeviceTensor) -> Result<(), EngineError> {
        let c = &self.ctx;
        let ft = self.borrow(t, "ready")?;
        let mut err = std::ptr::null_mut();
        // SAFETY: a live handle, borrowed for the call; a writable error out-pointer.
        let code = unsafe { (c.table.tensor_ready)(c.ctx, ft.ptr, &mut err) };
        c.check(code, err)
    }

    fn to_device(&self, t: DeviceTensor, device: usize) -> Result<DeviceTensor, EngineError> {
        let c = &self.ctx;
        let ptr = self.own(t, "to_device")?.into_raw();
        let mut out = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: a live handle we give up (consumed by the plugin), writable out-pointers.
        let code =
            unsafe { (c.table.tensor_to_device)(c.ctx, ptr, device as u64, &mut out, &mut err) };
        c.check(code, err)?;
        Ok(self.wrap(out))
    }

    fn collective_id(&self) -> Result<CollectiveId, EngineError> {
        collective::id(self)
    }

    fn collective_join(
        &self,
        id: &CollectiveId,
        rank: usize,
        size: usize,
        device: usize,
    ) -> Result<Communicator, EngineError> {
        collective::join(self, id, rank, size, device)
    }

    fn all_reduce_sum(
        &self,
        comm: Communicator,
        t: DeviceTensor,
    ) -> Result<DeviceTensor, EngineError> {
        collective::all_reduce(self, comm, t)
    }

    fn open_stage(&self, spec: &StageSpec) -> Result<Box<dyn Stage>, EngineError> {
        let c = &self.ctx;
        let ns = ns_stage_spec(spec);
        let mut out = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: live context; the spec and its text live for the call.
        let code = unsafe { (c.table.stage_open)(c.ctx, &ns, &mut out, &mut err) };
        c.check(code, err)?;
        Ok(Box::new(ForeignStage {
            ptr: out,
            backend: ForeignBackend { ctx: c.clone() },
        }))
    }

    fn prewarm(&self, spec: &StageSpec, batch: usize, seq_len: usize) -> Result<bool, EngineError> {
        let c = &self.ctx;
        let ns = ns_stage_spec(spec);
        let mut did = 0u32;
        let mut err = std::ptr::null_mut();
        // SAFETY: live context; the spec and its text live for the call; writable out-pointers.
        let code = unsafe {
            (c.table.prewarm)(c.ctx, &ns, batch as u64, seq_len as u64, &mut did, &mut err)
        };
        c.check(code, err)?;
        Ok(did != 0)
    }
}

/// `spec` as the C table takes it.
fn ns_stage_spec(spec: &StageSpec) -> NsStageSpec {
    let (kind, layer) = match spec.kind {
        StageKind::Edge => (0, 0),
        StageKind::Layer(i) => (1, i as u64),
    };
    NsStageSpec {
        kind,
        optimizer: match spec.optimizer {
            Some(OptimizerKind::Adam) => 0,
            Some(OptimizerKind::AdamW) => 1,
            None => 2,
        },
        weights: match spec.weights {
            InitialWeights::Seeded => 0,
            InitialWeights::Loaded => 1,
        },
        reserved: 0,
        layer,
        device: spec.device as u64,
        seed: spec.seed,
        model: crate::NsModelConfig::new(&spec.model),
    }
}

/// A plugin stage.
pub struct ForeignStage {
    ptr: *mut c_void,
    backend: ForeignBackend,
}

// SAFETY: a stage may move between threads; the host uses it from one thread at a time
// (`&mut self` on every call).
unsafe impl Send for ForeignStage {}

impl Drop for ForeignStage {
    fn drop(&mut self) {
        let c = &self.backend.ctx;
        // SAFETY: a live handle, freed once.
        unsafe { (c.table.stage_free)(c.ctx, self.ptr) };
    }
}

impl Stage for ForeignStage {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        let op = call.opcode();
        let name = call.name();
        // The C form carries sessions then snapshots in one list, split in half on the other
        // side.
        if let StageCall::StateSave {
            sessions,
            snapshots,
        }
        | StageCall::StateRestore {
            sessions,
            snapshots,
        } = &call
            && sessions.len() != snapshots.len()
        {
            return Err(EngineError::InvalidInput(format!(
                "{name}: {} sessions and {} snapshots",
                sessions.len(),
                snapshots.len()
            )));
        }
        // Backs `a.sessions` for the calls naming sessions or snapshots; lives across the
        // foreign call.
        let mut named = Vec::new();
        // Backs `a.ids` for `GradsIn`'s parameter mask.
        let mut mask = Vec::new();
        let (a, inputs) = call::encode(call, &mut named, &mut mask);
        // Ownership of the inputs moves to the plugin from here on.
        let raw: Vec<*mut c_void> = inputs
            .into_iter()
            .map(|t| Ok(self.backend.own(t, name)?.into_raw()))
            .collect::<Result<_, EngineError>>()?;
        let c = &self.backend.ctx;
        let mut reply = NsReply::empty();
        let mut err = std::ptr::null_mut();
        // SAFETY: live handles; the argument buffers borrowed from `call` outlive this call;
        // the inputs are given up; `reply` is writable.
        let code = unsafe {
            (c.table.stage_call)(
                c.ctx,
                self.ptr,
                op,
                &a,
                raw.as_ptr(),
                raw.len(),
                &mut reply,
                &mut err,
            )
        };
        c.check(code, err)?;
        let nt = (reply.n_tensors as usize).min(MAX_REPLY_TENSORS);
        let ns = (reply.n_scalars as usize).min(MAX_REPLY_SCALARS);
        Ok(Reply {
            tensors: reply.tensors[..nt]
                .iter()
                .map(|&p| self.backend.wrap(p))
                .collect(),
            scalars: reply.scalars[..ns].to_vec(),
        })
    }

    fn save(&self) -> Result<Vec<u8>, EngineError> {
        let c = &self.backend.ctx;
        let mut buf = NsBuf::EMPTY;
        let mut err = std::ptr::null_mut();
        // SAFETY: live handles, writable out-pointers.
        let code = unsafe { (c.table.stage_save)(c.ctx, self.ptr, &mut buf, &mut err) };
        c.check(code, err)?;
        Ok(c.take_buf(buf))
    }

    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        snapshot::take(&self.backend, self.ptr)
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        let c = &self.backend.ctx;
        let mut err = std::ptr::null_mut();
        // SAFETY: live handles; `bytes` lives for the call.
        let code =
            unsafe { (c.table.stage_load)(c.ctx, self.ptr, bytes.as_ptr(), bytes.len(), &mut err) };
        c.check(code, err)
    }

    fn param_count(&self) -> u64 {
        let c = &self.backend.ctx;
        // SAFETY: a live handle.
        unsafe { (c.table.stage_param_count)(c.ctx, self.ptr) }
    }
}
