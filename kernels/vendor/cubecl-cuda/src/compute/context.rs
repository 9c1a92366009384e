use cubecl_common::backtrace::BackTrace;
use cubecl_cpp::formatter::format_cpp;
use cubecl_cpp::{cuda::arch::CudaArchitecture, shared::CompilationOptions};
use cubecl_runtime::{
    compiler::CompilationError,
    validation::{validate_cube_dim, validate_units},
};

use super::storage::gpu::GpuResource;
use crate::{CudaCompiler, compute::stream::Stream};
use crate::{
    CudaComputeKernel,
    install::{cccl_include_path, include_path},
};
use cubecl_core::{
    compilation_cache::CompilationCache,
    hash::StableHash,
    server::ResourceLimitError,
    {ir::DeviceProperties, prelude::*},
};
use cubecl_runtime::timestamp_profiler::TimestampProfiler;
use cubecl_runtime::{compiler::CubeTask, logging::ServerLogger};
use cudarc::driver::DriverError;
use cudarc::driver::sys::CUfunc_st;
use cudarc::driver::sys::{CUctx_st, CUfunction_attribute, CUtensorMap};
use std::collections::HashMap;
use std::ffi::CString;
use std::ffi::c_char;
use std::str::FromStr;
use std::sync::Arc;
use std::{ffi::CStr, os::raw::c_void};

use cubecl_common::cache::CacheOption;

#[derive(Debug)]
pub(crate) struct CudaContext {
    pub context: *mut CUctx_st,
    pub module_names: HashMap<KernelId, CompiledKernel>,
    ptx_cache: Option<CompilationCache<StableHash, PtxCacheEntry>>,
    pub timestamps: TimestampProfiler,
    pub arch: CudaArchitecture,
    pub compilation_options: CompilationOptions,
    pub properties: DeviceProperties,
}

#[derive(Debug)]
pub struct CompiledKernel {
    cube_dim: CubeDim,
    shared_mem_bytes: usize,
    func: *mut CUfunc_st,
}

#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq, Clone)]
pub struct PtxCacheEntry {
    entrypoint_name: String,
    shared_mem_bytes: usize,
    ptx: Vec<std::ffi::c_char>,
}

impl CudaContext {
    pub fn new(
        compilation_options: CompilationOptions,
        properties: DeviceProperties,
        context: *mut CUctx_st,
        arch: CudaArchitecture,
    ) -> Self {
        Self {
            context,
            module_names: HashMap::new(),
            ptx_cache: {
                use cubecl_runtime::config::RuntimeConfig;
                let config = cubecl_runtime::config::CubeClRuntimeConfig::get();
                if let Some(cache) = &config.compilation.cache {
                    let root = cache.root();
                    // nsactor patch: one cache per architecture. Its entries are CUBINs made for
                    // the device's own architecture (and PTX for `sm_90a` is no more portable),
                    // and their keys do not name it, so a cache directory shared by machines
                    // with other GPUs must not hand one architecture's kernels to another.
                    Some(CompilationCache::new(
                        "ptx",
                        CacheOption::default()
                            .name(format!("cuda-sm{arch}"))
                            .root(root),
                    ))
                } else {
                    None
                }
            },
            arch,
            timestamps: TimestampProfiler::default(),
            compilation_options,
            properties,
        }
    }

    /// Switches the current CUDA context to this context.
    pub fn unsafe_set_current(&self) -> Result<(), DriverError> {
        // SAFETY: `self.context` is a valid CUDA context obtained from `primary_ctx::retain`
        // during server initialization and remains valid for the server's lifetime.
        unsafe { cudarc::driver::result::ctx::set_current(self.context) }
    }

    pub fn compile_kernel(
        &mut self,
        kernel_id: &KernelId,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        mode: ExecutionMode,
        logger: Arc<ServerLogger>,
    ) -> Result<(), LaunchError> {
        // nsactor patch: every kernel brought in is timed and counted (`nsactor_stats`); the
        // cache lookup, the compilation and what follows it are pieces that
        // `server/ahead.rs` also runs apart (the compilation on a worker thread).
        let started = std::time::Instant::now();
        let name = kernel.name();
        if self.load_cached(kernel_id, name, started) {
            return Ok(());
        }
        log::trace!("Compiling kernel");
        self.validate(kernel_id)?;
        let setup = self.nvrtc_setup(logger.compilation_activated());
        let (compiled, image) = setup.compile(&*kernel, kernel_id, mode)?;
        self.finish_compile(kernel_id, name, compiled, image, &logger, started.elapsed())
    }

    /// nsactor patch: loads `kernel_id` from the on-disk cache; false where the cache lacks it
    /// or the driver refuses the entry (made by another toolkit, say: it is compiled again).
    pub(crate) fn load_cached(
        &mut self,
        kernel_id: &KernelId,
        name: &str,
        started: std::time::Instant,
    ) -> bool {
        let Some(entry) = self
            .ptx_cache
            .as_ref()
            .and_then(|cache| cache.get(&kernel_id.stable_hash()).cloned())
        else {
            return false;
        };
        log::trace!("Using PTX cache");
        match self.load_ptx(
            entry.ptx,
            kernel_id.clone(),
            entry.entrypoint_name,
            kernel_id.cube_dim,
            entry.shared_mem_bytes,
        ) {
            Ok(()) => {
                crate::nsactor_stats::record_compile(name, true, started.elapsed());
                true
            }
            Err(err) => {
                log::warn!("the cached kernel {name} did not load ({err:?}); compiling it");
                false
            }
        }
    }

    /// nsactor patch: whether the on-disk cache holds an entry for `kernel_id`.
    pub(crate) fn in_cache(&self, kernel_id: &KernelId) -> bool {
        self.ptx_cache
            .as_ref()
            .is_some_and(|cache| cache.get(&kernel_id.stable_hash()).is_some())
    }

    /// nsactor patch: the checks made before compiling `kernel_id` for this device.
    pub(crate) fn validate(&self, kernel_id: &KernelId) -> Result<(), LaunchError> {
        validate_cube_dim(&self.properties, kernel_id)?;
        validate_units(&self.properties, kernel_id)?;
        Ok(())
    }

    /// nsactor patch: what a compilation for this device needs, apart from the device (so a
    /// worker thread can run it).
    pub(crate) fn nvrtc_setup(&self, debug: bool) -> NvrtcSetup {
        let arch = if self.arch.version >= 90 {
            format!("--gpu-architecture=sm_{}a", self.arch)
        } else {
            format!("--gpu-architecture=sm_{}", self.arch)
        };
        let include_path = include_path();
        let cccl_include_path = cccl_include_path();
        let mut flags = vec![
            arch,
            format!("--include-path={}", include_path.to_str().unwrap()),
            "-lineinfo".to_string(),
        ];
        if cccl_include_path.exists() {
            flags.push(format!(
                "--include-path={}",
                cccl_include_path.to_str().unwrap()
            ));
        }
        // nsactor patch: NVRTC's automatic precompiled headers. Every kernel's source begins
        // with the same CUDA headers (`cuda_runtime.h`, `cuda_bf16.h`, …); with `--pch` NVRTC
        // parses them once per process and reuses the result, instead of once per kernel.
        // `CUBECL_NVRTC_PCH=0` turns it off.
        if nvrtc_pch() {
            flags.push("--pch".to_string());
        }
        // nsactor patch: `CUBECL_NVRTC_SPLIT=N` lets NVRTC run its optimisation passes on N
        // threads (`--split-compile`; 0: as many as the host has). Off by default.
        if let Some(n) = nvrtc_split() {
            flags.push(format!("--split-compile={n}"));
        }
        NvrtcSetup {
            options: self.compilation_options.clone(),
            flags,
            debug,
        }
    }

    /// nsactor patch: the end of a compilation, on the server thread: the shared-memory check,
    /// the compilation log, the on-disk cache and the module load.
    pub(crate) fn finish_compile(
        &mut self,
        kernel_id: &KernelId,
        name: &str,
        compiled: KernelSource,
        image: Vec<c_char>,
        logger: &ServerLogger,
        took: std::time::Duration,
    ) -> Result<(), LaunchError> {
        self.validate_shared(&compiled.repr)?;
        logger.log_compilation(&compiled);
        let repr = compiled.repr.unwrap();
        if let Some(cache) = &mut self.ptx_cache {
            let result = cache.insert(
                kernel_id.stable_hash(),
                PtxCacheEntry {
                    entrypoint_name: compiled.entrypoint_name.clone(),
                    shared_mem_bytes: repr.shared_memory_size(),
                    ptx: image.clone(),
                },
            );
            if let Err(err) = result {
                log::warn!("Unable to save the ptx {err:?}");
            }
        }
        self.load_ptx(
            image,
            kernel_id.clone(),
            compiled.entrypoint_name,
            compiled.cube_dim,
            repr.shared_memory_size(),
        )?;
        crate::nsactor_stats::record_compile(name, false, took);
        Ok(())
    }

    fn load_ptx(
        &mut self,
        ptx: Vec<c_char>,
        kernel_id: KernelId,
        entrypoint_name: String,
        cube_dim: CubeDim,
        shared_mem_bytes: usize,
    ) -> Result<(), CompilationError> {
        let func_name = CString::new(entrypoint_name).unwrap();
        // SAFETY: `ptx` is an image from NVRTC: a null-terminated PTX text or (nsactor patch) a
        // CUBIN, whose ELF header gives its size. `func_name` is a
        // null-terminated `CString` matching the kernel entry point in the compiled module.
        let func = unsafe {
            let module = cudarc::driver::result::module::load_data(ptx.as_ptr() as *const _)
                .map_err(|err| CompilationError::Generic {
                    reason: format!("Unable to load the kernel image: {err:?}"),
                    backtrace: BackTrace::capture(),
                })?;

            cudarc::driver::result::module::get_function(module, func_name).map_err(|err| {
                CompilationError::Generic {
                    reason: format!("Unable to fetch the function from the module: {err:?}"),
                    backtrace: BackTrace::capture(),
                }
            })?
        };

        self.module_names.insert(
            kernel_id.clone(),
            CompiledKernel {
                cube_dim,
                shared_mem_bytes,
                func,
            },
        );

        Ok(())
    }

    pub fn execute_task(
        &mut self,
        stream: &mut Stream,
        kernel_id: KernelId,
        dispatch_count: (u32, u32, u32),
        tensor_maps: &[CUtensorMap],
        resources: &[GpuResource],
        const_info: Option<*mut c_void>,
    ) -> Result<(), LaunchError> {
        let mut bindings = tensor_maps
            .iter()
            .map(|map| map as *const _ as *mut c_void)
            .collect::<Vec<_>>();
        bindings.extend(resources.iter().map(|memory| memory.binding));
        bindings.extend(const_info);

        let kernel = self.module_names.get(&kernel_id).unwrap();
        let cube_dim = kernel.cube_dim;
        // SAFETY: `kernel.func` is a valid function handle from a loaded module.
        // `stream.sys` is a valid CUDA stream. `bindings` contains valid device pointers
        // for all kernel arguments. The dispatch and cube dimensions are validated by
        // the caller.
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                kernel.func,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernel.shared_mem_bytes as i32,
            )
            .map_err(|err| LaunchError::Unknown {
                reason: format!("{err:?}"),
                backtrace: BackTrace::capture(),
            })?;
            cudarc::driver::result::launch_kernel(
                kernel.func,
                dispatch_count,
                (cube_dim.x, cube_dim.y, cube_dim.z),
                // Shared memory is collected into a single buffer, with each shared memory being
                // an offset pointer
                kernel.shared_mem_bytes as u32,
                stream.sys,
                &mut bindings,
            )
            .map_err(|err| LaunchError::Unknown {
                reason: format!("{err:?}"),
                backtrace: BackTrace::capture(),
            })?;
        };

        Ok(())
    }

    fn validate_shared(&self, repr: &Option<CudaComputeKernel>) -> Result<(), LaunchError> {
        let requested = repr.as_ref().map(|repr| repr.shared_memory_size());
        let max = self.properties.hardware.max_shared_memory_size;
        if let Some(requested) = requested
            && requested > max
        {
            Err(ResourceLimitError::SharedMemory {
                requested,
                max,
                backtrace: BackTrace::capture(),
            }
            .into())
        } else {
            Ok(())
        }
    }
}

/// nsactor patch: a kernel compiled by CubeCL, before NVRTC.
pub(crate) type KernelSource = cubecl_runtime::kernel::CompiledKernel<CudaCompiler>;

/// nsactor patch: how kernels are compiled for one device (CubeCL's options, NVRTC's flags),
/// apart from the device, so that a worker thread can compile (`server/ahead.rs`).
#[derive(Clone, Debug)]
pub(crate) struct NvrtcSetup {
    options: CompilationOptions,
    flags: Vec<String>,
    /// Whether the source is formatted and carries debug information (compilation logging).
    debug: bool,
}

impl NvrtcSetup {
    /// CubeCL's source for `kernel`, then NVRTC's image of it (a CUBIN, or PTX with
    /// `CUBECL_NVRTC_CUBIN=0`).
    pub(crate) fn compile(
        &self,
        kernel: &dyn CubeTask<CudaCompiler>,
        kernel_id: &KernelId,
        mode: ExecutionMode,
    ) -> Result<(KernelSource, Vec<c_char>), LaunchError> {
        let mut compiled = kernel.compile(
            &mut Default::default(),
            &self.options,
            mode,
            kernel.address_type(),
        )?;
        if self.debug {
            compiled.debug_info = Some(DebugInformation::new("cpp", kernel_id.clone()));
            if let Ok(formatted) = format_cpp(&compiled.source) {
                compiled.source = formatted;
            }
        }
        let image = nvrtc_image(&compiled.source, &self.flags)?;
        Ok((compiled, image))
    }
}

/// NVRTC's image of `source` compiled with `flags`; a failed compilation's error holds
/// NVRTC's log and the source.
fn nvrtc_image(source: &str, flags: &[String]) -> Result<Vec<c_char>, CompilationError> {
    let generic = |err: &dyn std::fmt::Debug| CompilationError::Generic {
        reason: format!("{err:?}"),
        backtrace: BackTrace::capture(),
    };
    let options: Vec<&str> = flags.iter().map(String::as_str).collect();
    let text = CString::from_str(source).map_err(|e| generic(&e))?;
    // SAFETY: NVRTC FFI: the null-terminated source outlives the program, which is destroyed
    // once its output is taken (or its log read).
    unsafe {
        // I'd like to set the name to the kernel name, but keep getting UTF-8 errors so let's
        // leave it `None` for now
        let program =
            cudarc::nvrtc::result::create_program(text.as_c_str(), None).map_err(|e| generic(&e))?;
        if cudarc::nvrtc::result::compile_program(program, &options).is_err() {
            let log_raw = cudarc::nvrtc::result::get_program_log(program);
            let _ = cudarc::nvrtc::result::destroy_program(program);
            let log_raw = log_raw.map_err(|e| generic(&e))?;
            let log = CStr::from_ptr(log_raw.as_ptr()).to_string_lossy();
            let mut message = "[Compilation Error] ".to_string();
            for line in log.split('\n') {
                if !line.is_empty() {
                    message += format!("\n    {line}").as_str();
                }
            }
            return Err(CompilationError::Generic {
                reason: format!("{message}\n[Source]  \n{source}"),
                backtrace: BackTrace::capture(),
            });
        }
        // nsactor patch: for a real architecture NVRTC has already run the assembler and
        // holds the machine code (CUBIN); loading that skips the driver's second assembly
        // of the PTX (its JIT), which an empty driver cache pays for every kernel.
        // `CUBECL_NVRTC_CUBIN=0` loads the PTX as upstream does.
        let image = if nvrtc_cubin() { get_cubin(program) } else { None };
        let image = match image {
            Some(cubin) => Ok(cubin),
            None => cudarc::nvrtc::result::get_ptx(program).map_err(|e| generic(&e)),
        };
        // nsactor patch: the program is released once its output is taken (upstream kept
        // every program of the process).
        let _ = cudarc::nvrtc::result::destroy_program(program);
        image
    }
}

/// nsactor patch: the CUBIN NVRTC made for `program` (compiled for a real architecture), or
/// `None` where it made none (a virtual architecture). NVRTC has had `nvrtcGetCUBIN` since
/// CUDA 11.1; cudarc panics on an NVRTC without it.
///
/// # Safety
///
/// `program` must be a program NVRTC compiled and that has not been destroyed.
unsafe fn get_cubin(program: cudarc::nvrtc::sys::nvrtcProgram) -> Option<Vec<c_char>> {
    use cudarc::nvrtc::sys::{nvrtcGetCUBIN, nvrtcGetCUBINSize, nvrtcResult};
    let mut size = 0usize;
    // SAFETY: `program` is live (the caller's contract); `size` is a valid out-pointer.
    let sized = unsafe { nvrtcGetCUBINSize(program, &mut size) };
    if sized != nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return None;
    }
    let mut cubin: Vec<c_char> = vec![0; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC reported for this program.
    let got = unsafe { nvrtcGetCUBIN(program, cubin.as_mut_ptr()) };
    (got == nvrtcResult::NVRTC_SUCCESS).then_some(cubin)
}

/// nsactor patch: whether kernels are loaded from NVRTC's CUBIN rather than its PTX
/// (`CUBECL_NVRTC_CUBIN`, on unless `0`).
fn nvrtc_cubin() -> bool {
    static CUBIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CUBIN.get_or_init(|| std::env::var("CUBECL_NVRTC_CUBIN").map_or(true, |v| v != "0"))
}

/// nsactor patch: whether NVRTC compiles with automatic precompiled headers
/// (`CUBECL_NVRTC_PCH`, on unless `0`).
fn nvrtc_pch() -> bool {
    static PCH: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PCH.get_or_init(|| std::env::var("CUBECL_NVRTC_PCH").map_or(true, |v| v != "0"))
}

/// nsactor patch: NVRTC's `--split-compile` thread count (`CUBECL_NVRTC_SPLIT`), if set.
fn nvrtc_split() -> Option<u32> {
    static SPLIT: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *SPLIT.get_or_init(|| {
        std::env::var("CUBECL_NVRTC_SPLIT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
}
