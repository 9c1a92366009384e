use super::storage::gpu::{GpuResource, GpuStorage};
use crate::{
    CudaCompiler,
    compute::{
        command::Command,
        communication::{get_nccl_comm_id, get_nccl_dtype_count, to_nccl_op},
        context::CudaContext,
        stream::CudaStreamBackend,
        sync::Fence,
    },
};
use cubecl_common::{
    backtrace::BackTrace, bytes::Bytes, profile::ProfileDuration, stream_id::StreamId,
};
use cubecl_core::{
    MemoryConfiguration,
    device::DeviceId,
    future::{self, DynFut},
    ir::{ElemType, FloatKind, IntKind, MemoryDeviceProperties, StorageType, UIntKind},
    prelude::*,
    server::{
        Binding, CommunicationId, CopyDescriptor, Handle, IoError, KernelArguments, LaunchError,
        ProfileError, ProfilingToken, ReduceOperation, ServerCommunication, ServerError,
        ServerUtilities, StreamErrorMode, TensorMapBinding, TensorMapMeta,
    },
};
use cubecl_runtime::{
    allocator::PitchedMemoryLayoutPolicy,
    compiler::CubeTask,
    config::{CubeClRuntimeConfig, RuntimeConfig},
    logging::ServerLogger,
    memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage},
    server::ComputeServer,
    storage::{ComputeStorage, ManagedResource},
    stream::MultiStream,
};
use cudarc::driver::sys::{
    CUstream_st, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle, cuTensorMapEncodeIm2col, cuTensorMapEncodeTiled,
};
use std::{
    collections::{HashMap, hash_map::Entry},
    ffi::c_void,
    mem::MaybeUninit,
    sync::Arc,
};

pub(crate) const MB: usize = 1024 * 1024;

/// nsactor patch: kernels compiled ahead on worker threads (`server/ahead.rs`).
mod ahead;
/// nsactor patch: the threads that compile ahead, urgent work first (`server/compile_pool.rs`).
mod compile_pool;

#[derive(Debug)]
pub struct CudaServer {
    ctx: CudaContext,
    device_id: DeviceId,
    streams: MultiStream<CudaStreamBackend>,
    utilities: Arc<ServerUtilities<Self>>,
    comm_stream: *mut CUstream_st,
    communicators: HashMap<CommunicationId, *mut cudarc::nccl::sys::ncclComm>,
    /// nsactor patch: device copies of kernels' dynamic metadata (shapes and strides), by
    /// stream and content, so a launch whose metadata was uploaded before on its stream reuses
    /// that buffer instead of staging, copying and fencing a new one (the per-launch cost that
    /// dominates small kernels). The buffers are read-only once written; the cache is cleared
    /// when full, and a cleared buffer is recycled in stream order like any freed tensor.
    metadata_cache: HashMap<u64, HashMap<Vec<u8>, Handle>>,
    /// nsactor patch: the CUDA-graph capture in progress, if any (`nsactor_capture_begin`).
    capture: Option<Capture>,
    /// nsactor patch: launches waiting for kernels compiled ahead (`server/ahead.rs`).
    ahead: ahead::Ahead,
}

/// nsactor patch: a stream being captured into a CUDA graph.
#[derive(Debug)]
struct Capture {
    stream: StreamId,
    /// Every buffer the captured work allocated or used, held by the graph so that its memory
    /// is never handed out again while a replay may read or write it.
    retained: Vec<Binding>,
    /// Metadata uploaded during the capture: the upload was captured, not run, so these
    /// entries leave the cache when the capture ends.
    uploads: Vec<Vec<u8>>,
    /// Why the captured graph must not be used, where something could not be captured.
    taint: Option<String>,
}

/// nsactor patch: an instantiated CUDA graph and the buffers its work uses (see
/// `CudaServer::nsactor_capture_end`). Destroy it on the server thread with
/// `CudaServer::nsactor_graph_destroy`; the buffers return to their pool, in stream order, when
/// it is dropped.
#[derive(Debug)]
pub struct CapturedGraph {
    exec: cudarc::driver::sys::CUgraphExec,
    retained: Vec<Binding>,
    /// Nodes of the captured graph (kernels, copies, GEMMs' kernels).
    pub nodes: usize,
}

// SAFETY: the executable graph is an opaque driver handle, usable from any thread; the server
// thread is the only one that launches or destroys it.
unsafe impl Send for CapturedGraph {}

/// nsactor patch: most distinct metadata buffers kept per server (each a few hundred bytes).
const METADATA_CACHE_ENTRIES: usize = 16_384;

// SAFETY: `CudaServer` is only accessed from one thread at a time via the `DeviceHandle`,
// which serializes all server access. The CUDA context, streams, and NCCL communicators
// it manages are never shared across threads without synchronization.
unsafe impl Send for CudaServer {}

impl ComputeServer for CudaServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Storage = GpuStorage;
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Info = ();

    fn logger(&self) -> Arc<ServerLogger> {
        self.streams.logger.clone()
    }

    fn staging(&mut self, sizes: &[usize], stream_id: StreamId) -> Result<Vec<Bytes>, ServerError> {
        self.drain_for("staging");
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;

        Ok(sizes
            .iter()
            .map(|size| command.reserve_cpu(*size, true, None))
            .collect())
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        self.drain_for("read");
        self.nsactor_taint(stream_id, "a read to the host");
        match self.command(
            stream_id,
            descriptors.iter().map(|d| &d.handle),
            StreamErrorMode {
                ignore: false,
                flush: true,
            },
        ) {
            Ok(mut command) => Box::pin(command.read_async(descriptors)),
            Err(err) => Box::pin(async move { Err(err) }),
        }
    }

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, stream_id: StreamId) {
        // nsactor patch: behind the launches waiting for their kernels, the allocation waits
        // too (`server/ahead.rs`): its stream cursor and the memory it reuses are then those of
        // its place in the submitted order.
        if self.ahead_queued() {
            return self.nsactor_in_order(Box::new(move |server: &mut CudaServer| {
                server.initialize_memory(memory, size, stream_id)
            }));
        }
        // nsactor patch: a buffer allocated during a capture belongs to the graph.
        if let Some(c) = self.capture.as_mut().filter(|c| c.stream == stream_id) {
            c.retained
                .push(Handle::from_memory(memory.clone(), stream_id, size).binding());
        }
        let mut command = match self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        ) {
            Ok(val) => val,
            Err(err) => unreachable!("{err:?}"),
        };

        let reserved = command.reserve(size).unwrap();
        command.bind(reserved, memory);
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: StreamId) {
        self.drain_for("write");
        self.nsactor_taint(stream_id, "a write from the host");
        let mut command = match self.command(
            stream_id,
            descriptors.iter().map(|desc| &desc.0.handle),
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        ) {
            Ok(val) => val,
            Err(err) => unreachable!("{err:?}"),
        };

        for (descriptor, data) in descriptors {
            if let Err(err) = command.write_to_gpu(descriptor, data) {
                command.error(err.into());
                return;
            }
        }
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        // nsactor patch: a kernel not yet compiled is compiled on a worker thread while its
        // launch waits in order (`server/ahead.rs`).
        self.launch_or_queue(kernel, count, bindings, mode, stream_id);
    }

    fn flush(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        self.drain_for("flush");
        // nsactor patch: freeing memory on a captured stream would add nodes to the graph.
        if self.nsactor_taint(stream_id, "a flush") {
            return Ok(());
        }
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: false,
                flush: true,
            },
        )?;

        let current = command.streams.current();
        current.drop_queue.flush(|| Fence::new(current.sys));
        current.memory_management_gpu.storage().flush();

        Ok(())
    }

    fn sync(&mut self, stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        self.drain_for("sync");
        self.nsactor_taint(stream_id, "a synchronisation");
        let command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: false,
                flush: true,
            },
        );

        match command {
            Ok(mut command) => command.sync(),
            Err(err) => Box::pin(async { Err(err) }),
        }
    }

    fn start_profile(&mut self, stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        cubecl_common::future::block_on(self.sync(stream_id))?;
        Ok(self.ctx.timestamps.start())
    }

    fn end_profile(
        &mut self,
        stream_id: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        if let Err(err) = cubecl_common::future::block_on(self.sync(stream_id)) {
            self.ctx
                .timestamps
                .error(ProfileError::Server(Box::new(err)));
        }
        self.ctx.timestamps.stop(token)
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: StreamId,
    ) -> Result<ManagedResource<GpuResource>, ServerError> {
        self.drain_for("get_resource");
        // nsactor patch: work outside CubeCL (cuBLASLt) captured on this buffer keeps it.
        if let Some(c) = self.capture.as_mut().filter(|c| c.stream == stream_id) {
            c.retained.push(binding.clone());
        }
        let mut command = self.command(
            stream_id,
            [&binding].into_iter(),
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;
        let memory = binding.memory.clone();
        let resource = command.resource(binding)?;

        Ok(ManagedResource::new(memory, resource))
    }

    fn memory_usage(&mut self, stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        self.drain_for("memory_usage");
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: false,
                flush: false,
            },
        )?;
        Ok(command.memory_usage())
    }

    fn memory_cleanup(&mut self, stream_id: StreamId) {
        self.drain_for("memory_cleanup");
        if self.nsactor_taint(stream_id, "a memory cleanup") {
            return;
        }
        let mut command = match self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        ) {
            Ok(val) => val,
            Err(err) => unreachable!("{err:?}"),
        };
        command.memory_cleanup()
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, stream_id: StreamId) {
        self.drain_for("allocation_mode");
        self.nsactor_taint(stream_id, "a change of allocation mode");
        let mut command = match self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        ) {
            Ok(val) => val,
            Err(err) => unreachable!("{err:?}"),
        };
        command.allocation_mode(mode)
    }
}

impl ServerCommunication for CudaServer {
    const SERVER_COMM_ENABLED: bool = true;

    fn comm_init(&mut self, device_ids: Vec<DeviceId>) -> Result<(), ServerError> {
        self.drain_for("comm_init");
        let id = CommunicationId::from(device_ids.clone());
        if let Entry::Vacant(e) = self.communicators.entry(id.clone()) {
            let mut comm = MaybeUninit::uninit();
            let mut device_ids = device_ids.clone();
            device_ids.sort();
            let rank = device_ids
                .iter()
                .position(|id| id.index_id == self.device_id.index_id)
                .expect("Device's peer id should be in the list of device ids.");
            let nccl_comm_id = get_nccl_comm_id(device_ids.clone());

            // SAFETY: `comm` is a valid `MaybeUninit`. `nccl_comm_id` is a unique communicator ID
            // shared across all participating ranks. `rank` is this device's position in the
            // group. `comm_init_rank` initializes the communicator, making `assume_init` valid.
            unsafe {
                cudarc::nccl::result::comm_init_rank(
                    comm.as_mut_ptr(),
                    device_ids.len() as i32,
                    nccl_comm_id,
                    rank as i32,
                )
                .map_err(|e| ServerError::Generic {
                    reason: format!("NCCL comm_init_rank failed: {e:?}"),
                    backtrace: BackTrace::capture(),
                })?;
                e.insert(comm.assume_init());
            }

            let mut initialized_comms = self.utilities.initialized_comms.write().unwrap();
            initialized_comms.insert(id);
        }

        Ok(())
    }

    fn all_reduce(
        &mut self,
        src: Binding,
        dst: Binding,
        dtype: ElemType,
        stream_id: StreamId,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> Result<(), ServerError> {
        self.drain_for("all_reduce");
        // We create a command on the server to retrieve the correct resource of the source and the destination
        // from the memory pools.
        if src.stream != dst.stream {
            for stream in [src.stream, dst.stream].iter() {
                let mut command = self.command_no_inputs(
                    *stream,
                    StreamErrorMode {
                        ignore: false,
                        flush: false,
                    },
                )?;
                command.error(ServerError::Generic {
                    reason: "Source and destination should be on the same stream.".into(),
                    backtrace: BackTrace::capture(),
                });
            }
        }

        let mut command_src = self.command(
            stream_id,
            [&src, &dst].into_iter(),
            StreamErrorMode {
                ignore: false,
                flush: false,
            },
        )?;
        let resource_src = command_src.resource(src)?;
        let resource_dst = command_src.resource(dst)?;

        let stream = command_src.streams.current().sys;

        // We need to free the command before accessing communicators.
        core::mem::drop(command_src);

        // Wait for data to be ready on compute stream.
        Fence::new(stream).wait_async(self.comm_stream);

        // Get the communicator.
        let comm = self
            .communicators
            .get(&CommunicationId::from(device_ids))
            .expect("Communicator for this ID should be initialized");

        // Perform the `cudarc::nccl::result::all_reduce` operation.
        let (nccl_dtype, count) = get_nccl_dtype_count(dtype, resource_src.size);
        // SAFETY: `resource_src.ptr` and `resource_dst.ptr` are valid device pointers.
        // `comm` is a valid NCCL communicator initialized via `comm_init_rank`.
        // `self.comm_stream` is a valid CUDA stream dedicated to collective operations.

        unsafe {
            cudarc::nccl::result::all_reduce(
                resource_src.ptr as *const _,
                resource_dst.ptr as *mut _,
                count,
                nccl_dtype,
                to_nccl_op(op),
                *comm,
                self.comm_stream as _,
            )
            .map_err(|e| ServerError::Generic {
                reason: format!("NCCL all_reduce failed: {e:?}"),
                backtrace: BackTrace::capture(),
            })?;
        }

        Ok(())
    }

    fn sync_collective(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        self.drain_for("sync_collective");
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;
        let stream = command.streams.current().sys;

        drop(command);

        Fence::new(self.comm_stream).wait_async(stream);

        Ok(())
    }

    #[cfg_attr(feature = "tracing", tracing::instrument(level = "trace", skip(desc)))]
    fn send(
        &mut self,
        desc: CopyDescriptor,
        dtype: ElemType,
        stream_id: StreamId,
        device_id_dst: DeviceId,
    ) -> Result<(), ServerError> {
        self.drain_for("send");
        let binding = desc.handle.clone();

        // We create a command on the source server to retrieve the correct resource from the
        // source memory pools. We also make sure the current stream is aligned with the stream of
        // the binding, where the data was first allocated.
        let mut command = self.command(
            stream_id,
            [&desc.handle].into_iter(),
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;
        let resource = command.resource(binding.clone())?;
        let stream = command.streams.current().sys;

        // We need to free the command before creating another one.
        core::mem::drop(command);

        // Wait for data to be ready on compute stream.
        Fence::new(stream).wait_async(self.comm_stream);

        // Get the communicator.
        let mut device_ids = vec![device_id_dst, self.device_id];
        device_ids.sort();
        let comm_id = CommunicationId::from(device_ids.clone());
        let comm = self
            .communicators
            .get(&comm_id)
            .expect("Communicator for this ID should exist");

        let rank_dst = device_ids
            .iter()
            .position(|id| id.index_id != self.device_id.index_id)
            .unwrap() as i32;

        // Perform the `send` operation.
        let (nccl_dtype, count) = get_nccl_dtype_count(dtype, resource.size);
        // SAFETY: `resource.ptr` is a valid device pointer.
        // `comm` is a valid NCCL communicator initialized via `comm_init_rank`.
        // `self.comm_stream` is a valid CUDA stream dedicated to collective operations.
        unsafe {
            cudarc::nccl::result::send(
                resource.ptr as *const _,
                count,
                nccl_dtype,
                rank_dst,
                *comm,
                self.comm_stream as _,
            )
            .map_err(|e| ServerError::Generic {
                reason: format!("NCCL send failed: {e:?}"),
                backtrace: BackTrace::capture(),
            })?;
        }

        Ok(())
    }

    #[cfg_attr(feature = "tracing", tracing::instrument(level = "trace"))]
    fn recv(
        &mut self,
        handle: Handle,
        dtype: ElemType,
        stream_id: StreamId,
        device_id_src: DeviceId,
    ) -> Result<(), ServerError> {
        self.drain_for("recv");
        // We create a new command on the destination server to reserve the necessary GPU memory.
        let mut command_dst = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;

        let memory = command_dst.reserve(handle.size()).unwrap();
        command_dst.bind(memory, handle.memory.clone());

        let resource_dst = command_dst.resource(handle.binding())?;

        core::mem::drop(command_dst);

        // Get the communicator.
        let mut device_ids = vec![device_id_src, self.device_id];
        device_ids.sort();
        let comm_id = CommunicationId::from(device_ids.clone());
        let comm = self
            .communicators
            .get(&comm_id)
            .expect("Communicator for this ID should exist");

        let rank_src = device_ids
            .iter()
            .position(|id| id.index_id != self.device_id.index_id)
            .unwrap() as i32;

        // Perform the `recv` operation.
        let (nccl_dtype, count) = get_nccl_dtype_count(dtype, resource_dst.size);
        // SAFETY: `resource.ptr` is a valid device pointer.
        // `comm` is a valid NCCL communicator initialized via `comm_init_rank`.
        // `self.comm_stream` is a valid CUDA stream dedicated to collective operations.
        unsafe {
            cudarc::nccl::result::recv(
                resource_dst.ptr as *mut _,
                count,
                nccl_dtype,
                rank_src,
                *comm,
                self.comm_stream as _,
            )
            .map_err(|e| ServerError::Generic {
                reason: format!("NCCL recv failed: {e:?}"),
                backtrace: BackTrace::capture(),
            })?;
        }

        Ok(())
    }
}

impl CudaServer {
    /// Create a new cuda server.
    pub(crate) fn new(
        ctx: CudaContext,
        mem_props: MemoryDeviceProperties,
        mem_config: MemoryConfiguration,
        mem_alignment: usize,
        device_id: DeviceId,
        utilities: ServerUtilities<Self>,
    ) -> Self {
        let config = CubeClRuntimeConfig::get();
        let max_streams = config.streaming.max_streams;

        ctx.unsafe_set_current().unwrap();

        let comm_stream = cudarc::driver::result::stream::create(
            cudarc::driver::result::stream::StreamKind::NonBlocking,
        )
        .expect("Can create a new stream.");

        Self {
            ctx,
            device_id,
            streams: MultiStream::new(
                utilities.logger.clone(),
                CudaStreamBackend::new(
                    mem_props,
                    mem_config,
                    mem_alignment,
                    utilities.logger.clone(),
                ),
                max_streams,
            ),
            utilities: Arc::new(utilities),
            comm_stream,
            communicators: HashMap::default(),
            metadata_cache: HashMap::default(),
            capture: None,
            ahead: ahead::Ahead::from_env(),
        }
    }

    fn command_no_inputs(
        &mut self,
        stream_id: StreamId,
        mode: StreamErrorMode,
    ) -> Result<Command<'_>, ServerError> {
        self.command(stream_id, [].into_iter(), mode)
    }

    fn unsafe_set_current(&self) {
        // TODO: Should check if on the same thread before calling it, since now we don't switch
        // thread except for device memory transfer.
        self.ctx.unsafe_set_current().unwrap();
    }

    fn command<'a>(
        &mut self,
        stream_id: StreamId,
        handles: impl Iterator<Item = &'a Binding>,
        mode: StreamErrorMode,
    ) -> Result<Command<'_>, ServerError> {
        self.unsafe_set_current();

        if mode.flush {
            let errors = self.flush_errors(stream_id);

            if !mode.ignore && !errors.is_empty() {
                return Err(ServerError::ServerUnhealthy {
                    errors,
                    backtrace: BackTrace::capture(),
                });
            }
        }

        let streams = self.streams.resolve(stream_id, handles, !mode.ignore)?;
        Ok(Command::new(&mut self.ctx, streams))
    }

    fn flush_errors(&mut self, stream_id: StreamId) -> Vec<ServerError> {
        let mut stream = match self.streams.resolve(stream_id, [].into_iter(), false) {
            Ok(stream) => stream,
            Err(_) => return Vec::new(),
        };
        let errors = core::mem::take(&mut stream.current().errors);

        // It is very important to tag current profiles as being wrong.
        if !errors.is_empty() {
            self.ctx.timestamps.error(ProfileError::Unknown {
                reason: alloc::format!("{errors:?}"),
                backtrace: BackTrace::capture(),
            });
            stream.current().memory_management_gpu.cleanup(false);
        }

        core::mem::drop(stream);
        errors
    }

    /// nsactor patch: upstream's `launch` (the launch of a kernel, compiled here if needed);
    /// `id`: the kernel's id with `mode` applied, where the caller has it.
    fn launch_now(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        id: Option<KernelId>,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        // nsactor patch: the server thread's time in launches (`crate::nsactor_stats`).
        let started = std::time::Instant::now();
        let launched = self.launch_checked(kernel, id, count, bindings, mode, stream_id);
        crate::nsactor_stats::record_launch(started.elapsed());
        if let Err(err) = launched {
            let mut stream = match self.streams.resolve(stream_id, [].into_iter(), false) {
                Ok(stream) => stream,
                Err(err) => unreachable!("{err:?}"),
            };
            stream.current().errors.push(err);
        }
    }

    /// nsactor patch: `launch_unpatched`, and while the stream is captured, the buffers the
    /// kernel uses kept for the graph (its metadata's too), and what cannot be replayed noted.
    fn launch_checked(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        id: Option<KernelId>,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        if !self.capture.as_ref().is_some_and(|c| c.stream == stream_id) {
            return self.launch_unpatched(kernel, id, count, bindings, mode, stream_id);
        }
        let mut retained: Vec<Binding> = bindings.buffers.to_vec();
        retained.extend(bindings.tensor_maps.iter().map(|t| t.binding.clone()));
        let grid_constants = self
            .ctx
            .compilation_options
            .supports_features
            .grid_constants;
        let info = &bindings.info;
        let metadata: Option<Vec<u8>> = if grid_constants {
            (info.dynamic_metadata_offset < info.data.len())
                .then(|| bytemuck::cast_slice(&info.data[info.dynamic_metadata_offset..]).to_vec())
        } else {
            (!info.data.is_empty()).then(|| bytemuck::cast_slice(&info.data).to_vec())
        };
        let cached = |server: &Self, m: &Vec<u8>| {
            server
                .metadata_cache
                .get(&stream_id.value)
                .and_then(|c| c.get(m))
                .cloned()
        };
        let hit = metadata.as_ref().is_none_or(|m| cached(self, m).is_some());
        if matches!(count, CubeCount::Dynamic(_)) {
            self.nsactor_taint(stream_id, "a kernel with a dynamic cube count");
        }
        let launched = self.launch_unpatched(kernel, id, count, bindings, mode, stream_id);
        if let Some(m) = metadata {
            if let Some(h) = cached(self, &m) {
                retained.push(h.binding());
            }
            if !hit {
                self.nsactor_taint(stream_id, "a kernel's metadata uploaded during the capture");
                if let Some(c) = self.capture.as_mut() {
                    c.uploads.push(m);
                }
            }
        }
        if let Some(c) = self.capture.as_mut() {
            c.retained.extend(retained);
        }
        launched
    }

    fn launch_unpatched(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        id: Option<KernelId>,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        // nsactor patch: the id the compile-ahead queue already made, where it made one.
        let kernel_id = id.unwrap_or_else(|| {
            let mut id = kernel.id();
            id.mode(mode);
            id
        });
        let logger = self.streams.logger.clone();
        // nsactor patch: taken out of `self` while `command` borrows it; put back below.
        let mut metadata_cache = core::mem::take(&mut self.metadata_cache);
        if metadata_cache.values().map(HashMap::len).sum::<usize>() >= METADATA_CACHE_ENTRIES {
            metadata_cache.clear();
        }
        let grid_constants = self
            .ctx
            .compilation_options
            .supports_features
            .grid_constants;
        let mut command = self.command(
            stream_id,
            bindings.buffers.iter(),
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;

        let count = match count {
            CubeCount::Static(x, y, z) => (x, y, z),
            // TODO: CUDA doesn't have an exact equivalent of dynamic dispatch. Instead, kernels are free to launch other kernels.
            // One option is to create a dummy kernel with 1 thread that launches the real kernel with the dynamic dispatch settings.
            // For now, just read the dispatch settings from the buffer.
            CubeCount::Dynamic(binding) => {
                let data = future::block_on(command.read_async(vec![CopyDescriptor::new(
                    binding,
                    [3].into(),
                    [1].into(),
                    4,
                )]))?;
                let data = bytemuck::cast_slice(&data[0]);
                assert!(
                    data.len() == 3,
                    "Dynamic cube count should contain 3 values"
                );
                (data[0], data[1], data[2])
            }
        };

        let (info_const, info_binding) = if grid_constants {
            let info = &bindings.info;

            let mut handle = Option::None;
            if info.dynamic_metadata_offset < info.data.len() {
                let dyn_meta: &[u8] =
                    bytemuck::cast_slice(&info.data[info.dynamic_metadata_offset..]);
                handle = Some(cached_metadata(
                    &mut metadata_cache,
                    &mut command,
                    stream_id,
                    dyn_meta,
                )?);
            }

            (Some(info.data.as_ptr() as *mut c_void), handle)
        } else {
            let mut handle = Option::None;
            if !bindings.info.data.is_empty() {
                handle = Some(cached_metadata(
                    &mut metadata_cache,
                    &mut command,
                    stream_id,
                    bytemuck::cast_slice(&bindings.info.data),
                )?);
            }
            (None, handle)
        };

        let mut resources = bindings
            .tensor_maps
            .iter()
            .map(|it| it.binding.clone())
            .chain(bindings.buffers)
            .map(|binding| command.resource(binding).expect("Resource to exist."))
            .collect::<Vec<_>>();

        let mut tensor_maps = Vec::with_capacity(bindings.tensor_maps.len());

        for TensorMapBinding { map, binding } in bindings.tensor_maps.into_iter() {
            let resource = command
                .resource(binding)
                .expect("Tensor map resource exists.");
            let device_ptr = resource.ptr as *mut c_void;

            let mut map_ptr = MaybeUninit::zeroed();

            let shape: Vec<_> = map
                .metadata
                .shape()
                .iter()
                .rev()
                .map(|s| *s as u64)
                .collect();
            let strides: Vec<_> = map
                .metadata
                .strides()
                .iter()
                .rev()
                .skip(1)
                .map(|s| *s as u64 * map.storage_ty.size() as u64)
                .collect();
            let elem_stride: Vec<_> = map.elem_stride.iter().rev().map(|s| *s as u32).collect();

            match &map.format {
                // SAFETY: `map_ptr` is a zeroed `MaybeUninit<CUtensorMap>`. `device_ptr` is a
                // valid device pointer. Shape, strides, tile_size, and elem_stride vectors
                // are constructed from validated metadata and outlive this call.
                TensorMapFormat::Tiled(TiledArgs { tile_size }) => unsafe {
                    let tile_size: Vec<_> =
                        tile_size.iter().rev().copied().map(|s| s as u32).collect();

                    cuTensorMapEncodeTiled(
                        map_ptr.as_mut_ptr(),
                        elem_to_tensor_map_type(map.storage_ty),
                        map.metadata.rank() as u32,
                        device_ptr,
                        shape.as_ptr(),
                        strides.as_ptr(),
                        tile_size.as_ptr(),
                        elem_stride.as_ptr(),
                        interleave_to_cuda(map.interleave),
                        swizzle_to_cuda(map.swizzle),
                        prefetch_to_cuda(map.prefetch),
                        oob_to_cuda(map.oob_fill),
                    )
                    .result()
                    .map_err(|err| {
                        let generic_err =
                            check_tma_generic(&map, device_ptr, &shape, &strides, &elem_stride)
                                .err();
                        let tiled_err = check_tma_tiled(&map, &tile_size).err();
                        generic_err
                            .or(tiled_err)
                            .unwrap_or_else(|| LaunchError::Unknown {
                                reason: format!("{err}"),
                                backtrace: BackTrace::capture(),
                            })
                    })?;
                },
                // SAFETY: Same invariants as `Tiled` above. Additionally, `lower_corner` and
                // `upper_corner` are valid pixel box bounds derived from the tensor map args.
                TensorMapFormat::Im2col(args) => unsafe {
                    let lower_corner: Vec<_> =
                        args.pixel_box_lower_corner.iter().rev().copied().collect();
                    let upper_corner: Vec<_> =
                        args.pixel_box_upper_corner.iter().rev().copied().collect();

                    cuTensorMapEncodeIm2col(
                        map_ptr.as_mut_ptr(),
                        elem_to_tensor_map_type(map.storage_ty),
                        map.metadata.rank() as u32,
                        device_ptr,
                        shape.as_ptr(),
                        strides.as_ptr(),
                        lower_corner.as_ptr(),
                        upper_corner.as_ptr(),
                        args.channels_per_pixel,
                        args.pixels_per_column,
                        elem_stride.as_ptr(),
                        interleave_to_cuda(map.interleave),
                        swizzle_to_cuda(map.swizzle),
                        prefetch_to_cuda(map.prefetch),
                        oob_to_cuda(map.oob_fill),
                    )
                    .result()
                    .map_err(|err| {
                        let generic_err =
                            check_tma_generic(&map, device_ptr, &shape, &strides, &elem_stride)
                                .err();
                        let tiled_err = check_tma_im2col(
                            &map,
                            &lower_corner,
                            &upper_corner,
                            args.channels_per_pixel,
                            args.pixels_per_column,
                        )
                        .err();
                        generic_err
                            .or(tiled_err)
                            .unwrap_or_else(|| LaunchError::Unknown {
                                reason: format!("{err}"),
                                backtrace: BackTrace::capture(),
                            })
                    })?;
                },
                // SAFETY: Same invariants as `Im2col` above. Requires CUDA 12.8+.
                #[cfg(cuda_12080)]
                TensorMapFormat::Im2colWide(args) => unsafe {
                    use cudarc::driver::sys::{
                        CUtensorMapIm2ColWideMode, cuTensorMapEncodeIm2colWide,
                    };
                    cuTensorMapEncodeIm2colWide(
                        map_ptr.as_mut_ptr(),
                        elem_to_tensor_map_type(map.storage_ty),
                        map.metadata.rank() as u32,
                        device_ptr,
                        shape.as_ptr(),
                        strides.as_ptr(),
                        args.pixel_box_lower_corner_width,
                        args.pixel_box_upper_corner_width,
                        args.channels_per_pixel,
                        args.pixels_per_column,
                        elem_stride.as_ptr(),
                        interleave_to_cuda(map.interleave),
                        CUtensorMapIm2ColWideMode::CU_TENSOR_MAP_IM2COL_WIDE_MODE_W,
                        swizzle_to_cuda(map.swizzle),
                        prefetch_to_cuda(map.prefetch),
                        oob_to_cuda(map.oob_fill),
                    )
                    .result()
                    .map_err(|err| {
                        let generic_err =
                            check_tma_generic(&map, device_ptr, &shape, &strides, &elem_stride)
                                .err();
                        generic_err.unwrap_or_else(|| LaunchError::Unknown {
                            reason: format!("{err}"),
                            backtrace: BackTrace::capture(),
                        })
                    })?;
                },
                #[cfg(not(cuda_12080))]
                TensorMapFormat::Im2colWide(_) => {
                    return Err(LaunchError::Unknown {
                        reason: "CUDA version 12.8 required for tensor map format Im2colWide"
                            .into(),
                        backtrace: BackTrace::capture(),
                    }
                    .into());
                }
            };
            // SAFETY: `map_ptr` was fully initialized by one of the `cuTensorMapEncode*`
            // calls above, which all succeeded (errors are propagated before reaching here).
            let binding = unsafe { map_ptr.assume_init() };
            tensor_maps.push(binding);
        }

        resources.extend(
            info_binding
                .into_iter()
                .map(|s| command.resource(s.binding()).expect("Resource to exist")),
        );

        let launched = command.kernel(
            kernel_id,
            kernel,
            mode,
            count,
            &tensor_maps,
            &resources,
            info_const,
            logger,
        );
        core::mem::drop(command);
        self.metadata_cache = metadata_cache;
        launched?;

        Ok(())
    }

    pub(crate) fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    /// nsactor patch: notes why a capture on `stream_id` cannot be replayed (work outside
    /// CubeCL that failed while captured); true when one is in progress there.
    pub fn nsactor_capture_taint(&mut self, stream_id: StreamId, what: &str) -> bool {
        self.nsactor_taint(stream_id, what)
    }

    /// nsactor patch: notes why a capture on `stream_id` cannot be replayed; true when one
    /// is in progress there.
    fn nsactor_taint(&mut self, stream_id: StreamId, what: &str) -> bool {
        match self.capture.as_mut().filter(|c| c.stream == stream_id) {
            Some(c) => {
                c.taint
                    .get_or_insert_with(|| format!("{what} on the captured stream"));
                true
            }
            None => false,
        }
    }

    /// nsactor patch: the CUDA stream of `stream_id` on this device.
    pub fn nsactor_stream(
        &mut self,
        stream_id: StreamId,
    ) -> Result<cudarc::driver::sys::CUstream, ServerError> {
        self.drain_for("nsactor_stream");
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;
        Ok(command.streams.current().sys)
    }

    /// nsactor patch: starts capturing the work of `stream_id` into a CUDA graph (relaxed
    /// mode). Until `nsactor_capture_end`, that stream's launches are recorded, not run; its
    /// memory comes from `cuMemAlloc`; every buffer its work allocates or uses is kept for the
    /// graph; and what cannot be replayed (host reads and writes, synchronisations, metadata
    /// uploads, flushes) marks the capture unusable.
    ///
    /// `inputs` (the buffers the work reads that other streams may have written) are ordered
    /// on the stream first: a wait on another stream's work cannot be captured.
    pub fn nsactor_capture_begin(
        &mut self,
        stream_id: StreamId,
        inputs: Vec<Binding>,
    ) -> Result<(), String> {
        self.drain_for("nsactor_capture_begin");
        if self.capture.is_some() {
            return Err("a CUDA-graph capture is already in progress on this device".into());
        }
        for b in inputs {
            self.get_resource(b, stream_id)
                .map_err(|e| format!("capture input: {e:?}"))?;
        }
        let mut command = self
            .command_no_inputs(
                stream_id,
                StreamErrorMode {
                    ignore: true,
                    flush: false,
                },
            )
            .map_err(|e| format!("{e:?}"))?;
        let stream = command.streams.current();
        let sys = stream.sys;
        // Other streams' fences on this one stand for its work before the capture.
        crate::compute::sync::capture::begin(sys)?;
        // SAFETY: `sys` is this server's live stream; capture is ended by
        // `nsactor_capture_end` before anything else is asked of it by nsactor.
        unsafe {
            cudarc::driver::sys::cuStreamBeginCapture_v2(
                sys,
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .result()
        .map_err(|e| {
            crate::compute::sync::capture::end(sys);
            format!("cuStreamBeginCapture: {e:?}")
        })?;
        stream.memory_management_gpu.storage().sync_alloc = true;
        core::mem::drop(command);
        self.capture = Some(Capture {
            stream: stream_id,
            retained: Vec::new(),
            uploads: Vec::new(),
            taint: None,
        });
        Ok(())
    }

    /// nsactor patch: ends the capture begun by `nsactor_capture_begin` and instantiates its
    /// graph; an error (nothing to launch) when the capture was invalidated or noted something
    /// it cannot replay. Either way, the stream runs work again.
    pub fn nsactor_capture_end(&mut self, stream_id: StreamId) -> Result<CapturedGraph, String> {
        self.drain_for("nsactor_capture_end");
        let capture = match self.capture.take() {
            Some(c) if c.stream == stream_id => c,
            other => {
                self.capture = other;
                return Err("no CUDA-graph capture in progress on this stream".into());
            }
        };
        let mut command = self
            .command_no_inputs(
                stream_id,
                StreamErrorMode {
                    ignore: true,
                    flush: false,
                },
            )
            .map_err(|e| format!("{e:?}"))?;
        let stream = command.streams.current();
        stream.memory_management_gpu.storage().sync_alloc = false;
        let sys = stream.sys;
        core::mem::drop(command);
        let mut graph: cudarc::driver::sys::CUgraph = core::ptr::null_mut();
        // SAFETY: ends the capture begun on `sys` by `nsactor_capture_begin`.
        let ended =
            unsafe { cudarc::driver::sys::cuStreamEndCapture(sys, &mut graph) }.result();
        crate::compute::sync::capture::end(sys);
        // Uploads captured but never run must not be found by later launches.
        if let Some(cache) = self.metadata_cache.get_mut(&stream_id.value) {
            for m in &capture.uploads {
                cache.remove(m);
            }
        }
        let errors = self.flush_errors(stream_id);
        let destroy = |graph: cudarc::driver::sys::CUgraph| {
            if !graph.is_null() {
                // SAFETY: a graph returned by `cuStreamEndCapture`, destroyed once.
                unsafe { cudarc::driver::sys::cuGraphDestroy(graph) };
            }
        };
        let failure = match (&ended, &capture.taint) {
            (Err(e), _) => Some(format!("cuStreamEndCapture: {e:?}")),
            (_, Some(t)) => Some(t.clone()),
            _ if !errors.is_empty() => Some(format!("launches failed: {errors:?}")),
            _ if graph.is_null() => Some("the capture produced no graph".into()),
            _ => None,
        };
        if let Some(f) = failure {
            destroy(graph);
            return Err(f);
        }
        let mut nodes = 0usize;
        let mut exec: cudarc::driver::sys::CUgraphExec = core::ptr::null_mut();
        // SAFETY: `graph` is the live graph just captured; `exec` is written by the driver.
        let made = unsafe {
            cudarc::driver::sys::cuGraphGetNodes(graph, core::ptr::null_mut(), &mut nodes);
            cudarc::driver::sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        }
        .result();
        destroy(graph);
        made.map_err(|e| format!("cuGraphInstantiate: {e:?}"))?;
        Ok(CapturedGraph {
            exec,
            retained: capture.retained,
            nodes,
        })
    }

    /// nsactor patch: enqueues one replay of `graph` on the stream of `stream_id`. `written`
    /// are the buffers the replay rewrites that other streams may read: CubeCL orders readers
    /// by the position of a buffer's allocation in its stream, so each is marked as allocated
    /// anew here, after the replay.
    pub fn nsactor_graph_launch(
        &mut self,
        graph: &CapturedGraph,
        written: &[Handle],
        stream_id: StreamId,
    ) -> Result<(), String> {
        self.drain_for("nsactor_graph_launch");
        let mut command = self
            .command_no_inputs(
                stream_id,
                StreamErrorMode {
                    ignore: true,
                    flush: false,
                },
            )
            .map_err(|e| format!("{e:?}"))?;
        let sys = command.streams.current().sys;
        // SAFETY: a live executable graph, launched on this server's stream.
        unsafe { cudarc::driver::sys::cuGraphLaunch(graph.exec, sys) }
            .result()
            .map_err(|e| format!("cuGraphLaunch: {e:?}"))?;
        for h in written {
            if h.stream != stream_id {
                return Err("a graph rewrites a buffer of another stream".into());
            }
            command.bind(h.memory.clone(), h.memory.clone());
        }
        Ok(())
    }

    /// nsactor patch: enqueues a device-to-device copy of `bytes` bytes on the stream of
    /// `stream_id` (both buffers ordered on it, as for a kernel).
    pub fn nsactor_copy(
        &mut self,
        src: Binding,
        dst: Binding,
        bytes: u64,
        stream_id: StreamId,
    ) -> Result<(), String> {
        self.drain_for("nsactor_copy");
        let s = self
            .get_resource(src, stream_id)
            .map_err(|e| format!("{e:?}"))?;
        let d = self
            .get_resource(dst, stream_id)
            .map_err(|e| format!("{e:?}"))?;
        let (s, d) = (s.resource(), d.resource());
        if s.size < bytes || d.size < bytes {
            return Err(format!(
                "copy of {bytes} bytes between buffers of {} and {} bytes",
                s.size, d.size
            ));
        }
        if s.ptr == d.ptr {
            return Ok(());
        }
        // SAFETY: both are live device buffers of at least `bytes` bytes, held until after the
        // copy is enqueued and recycled only in order on `d.stream`, the current stream.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(d.ptr, s.ptr, bytes as usize, d.stream)
        }
        .result()
        .map_err(|e| format!("cuMemcpyDtoDAsync: {e:?}"))
    }

    /// nsactor patch: destroys `graph` (after the replays enqueued before, which the driver
    /// lets finish); its buffers return to their pool in stream order.
    pub fn nsactor_graph_destroy(&mut self, graph: CapturedGraph) {
        self.drain_for("nsactor_graph_destroy");
        // SAFETY: destroyed once, on the thread that launches it.
        unsafe { cudarc::driver::sys::cuGraphExecDestroy(graph.exec) };
        core::mem::drop(graph.retained);
    }
}

/// nsactor patch: the device buffer holding `data` on `stream_id`, uploaded on first use (the
/// lookup borrows `data`: no allocation on a hit).
fn cached_metadata(
    cache: &mut HashMap<u64, HashMap<Vec<u8>, Handle>>,
    command: &mut Command<'_>,
    stream_id: StreamId,
    data: &[u8],
) -> Result<Handle, IoError> {
    let stream = cache.entry(stream_id.value).or_default();
    if let Some(h) = stream.get(data) {
        return Ok(h.clone());
    }
    let h = command.create_with_data(data)?;
    stream.insert(data.to_vec(), h.clone());
    Ok(h)
}

fn elem_to_tensor_map_type(ty: StorageType) -> CUtensorMapDataType {
    use cudarc::driver::sys::CUtensorMapDataType::*;
    match ty {
        // packed fp4 should be treated as single 4-bit values to simplify indexing/shape handling
        // So a tile of width 16 with fp4 elements is 8 x fp4x2 elements wide.
        #[cfg(cuda_12080)]
        StorageType::Packed(ty, 2) if ty.size_bits() == 4 => CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B,
        StorageType::Scalar(ElemType::Float(kind)) => match kind {
            // There's no special handling for FP8, so load as u8. `0u8 == 0.0` when reinterpreting.
            FloatKind::E2M1 // single fp4s are padded to a full byte
            | FloatKind::E4M3
            | FloatKind::E5M2
            | FloatKind::UE8M0
            | FloatKind::E2M3
            | FloatKind::E3M2 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            FloatKind::F16 => CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            FloatKind::BF16 => CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            FloatKind::Flex32 | FloatKind::F32 => CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            FloatKind::TF32 => CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
            FloatKind::F64 => CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
        },
        StorageType::Scalar(ElemType::Int(kind)) => match kind {
            // UInt is fine because zero bits and size is the same between both
            IntKind::I8 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            IntKind::I16 => CU_TENSOR_MAP_DATA_TYPE_UINT16,
            IntKind::I32 => CU_TENSOR_MAP_DATA_TYPE_INT32,
            IntKind::I64 => CU_TENSOR_MAP_DATA_TYPE_INT64,
        },
        StorageType::Scalar(ElemType::UInt(kind)) => match kind {
            UIntKind::U8 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            UIntKind::U16 => CU_TENSOR_MAP_DATA_TYPE_UINT16,
            UIntKind::U32 => CU_TENSOR_MAP_DATA_TYPE_UINT32,
            UIntKind::U64 => CU_TENSOR_MAP_DATA_TYPE_UINT64,
        },
        _ => unimplemented!("Not supported for tensor map type"),
    }
}

fn interleave_to_cuda(interleave: TensorMapInterleave) -> CUtensorMapInterleave {
    use cudarc::driver::sys::CUtensorMapInterleave::*;
    match interleave {
        TensorMapInterleave::None => CU_TENSOR_MAP_INTERLEAVE_NONE,
        TensorMapInterleave::B16 => CU_TENSOR_MAP_INTERLEAVE_16B,
        TensorMapInterleave::B32 => CU_TENSOR_MAP_INTERLEAVE_32B,
    }
}

fn swizzle_to_cuda(swizzle: TensorMapSwizzle) -> CUtensorMapSwizzle {
    use cudarc::driver::sys::CUtensorMapSwizzle::*;
    match swizzle {
        TensorMapSwizzle::None => CU_TENSOR_MAP_SWIZZLE_NONE,
        TensorMapSwizzle::B32 => CU_TENSOR_MAP_SWIZZLE_32B,
        TensorMapSwizzle::B64 => CU_TENSOR_MAP_SWIZZLE_64B,
        TensorMapSwizzle::B128 => CU_TENSOR_MAP_SWIZZLE_128B,
        #[cfg(cuda_12080)]
        TensorMapSwizzle::B128Atom32B => CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B,
        #[cfg(cuda_12080)]
        TensorMapSwizzle::B128Atom32BFlip8B => CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B_FLIP_8B,
        #[cfg(cuda_12080)]
        TensorMapSwizzle::B128Atom64B => CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B,
        #[cfg(not(cuda_12080))]
        _ => unimplemented!("Swizzle atomicity requires CUDA 12.8 or higher"),
    }
}

fn prefetch_to_cuda(prefetch: TensorMapPrefetch) -> CUtensorMapL2promotion {
    use cudarc::driver::sys::CUtensorMapL2promotion::*;
    match prefetch {
        TensorMapPrefetch::None => CU_TENSOR_MAP_L2_PROMOTION_NONE,
        TensorMapPrefetch::B64 => CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        TensorMapPrefetch::B128 => CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        TensorMapPrefetch::B256 => CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    }
}

fn oob_to_cuda(fill: OobFill) -> CUtensorMapFloatOOBfill {
    use cudarc::driver::sys::CUtensorMapFloatOOBfill::*;
    match fill {
        OobFill::Zero => CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        OobFill::NaN => CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
    }
}

macro_rules! launch_check {
    ($assertion: expr, $($arg:tt)+) => {
        if $assertion {
            Ok(())
        } else {
            Err(LaunchError::Unknown {
                reason: format!($($arg)*),
                backtrace: BackTrace::capture(),
            })
        }
    };
}

fn check_tma_generic(
    map: &TensorMapMeta,
    device_ptr: *mut c_void,
    shape: &[u64],
    strides: &[u64],
    elem_strides: &[u32],
) -> Result<(), LaunchError> {
    // globalAddress invariants
    launch_check!(
        (device_ptr as usize).is_multiple_of(16),
        "Tensor pointer must be 16 byte aligned"
    )?;
    if !matches!(map.interleave, TensorMapInterleave::None) {
        launch_check!(
            (device_ptr as usize).is_multiple_of(32),
            "Tensor pointer must be 32 byte aligned"
        )?;
    }

    // tensorRank invariants
    launch_check!(
        (1..=5).contains(&map.metadata.rank()),
        "Rank must be between 1 and 5"
    )?;
    launch_check!(
        matches!(map.interleave, TensorMapInterleave::None) || map.metadata.rank() >= 3,
        "When interleave is enabled, rank must be >= 3"
    )?;

    // globalDim invariants
    launch_check!(
        shape.iter().all(|it| *it <= u32::MAX as u64),
        "Shape must be <= u32::MAX"
    )?;
    #[cfg(cuda_12080)]
    if matches!(map.storage_ty, StorageType::Packed(ty, 2) if ty.size_bits() == 4) {
        launch_check!(
            shape[0].is_multiple_of(2),
            "Packed tensor map must have multiple of 2 for the innermost dimension"
        )?;
    }

    // globalStrides invariants
    launch_check!(
        strides.iter().all(|it| it.is_multiple_of(16)),
        "Strides must be 16 byte aligned"
    )?;
    if matches!(map.interleave, TensorMapInterleave::B32) {
        launch_check!(
            strides.iter().all(|it| it.is_multiple_of(32)),
            "Strides must be 32 byte aligned when interleave is B32"
        )?;
    }

    // elementStrides invariants
    launch_check!(
        elem_strides.iter().all(|it| *it > 0 && *it <= 8),
        "Element strides must be non-zero and <= 8"
    )?;
    if matches!(map.interleave, TensorMapInterleave::None) {
        launch_check!(
            elem_strides[0] == 1,
            "Innermost element stride is ignored without interleaving"
        )?;
    }

    // oobFill invariants
    if matches!(map.oob_fill, OobFill::NaN) {
        launch_check!(
            map.storage_ty.is_float(),
            "NaN fill is only supported for float types"
        )?;
    }

    Ok(())
}

fn check_tma_tiled(map: &TensorMapMeta, tile_size: &[u32]) -> Result<(), LaunchError> {
    launch_check!(
        tile_size.len() == map.metadata.rank(),
        "Tile shape should match rank"
    )?;
    launch_check!(
        tile_size.iter().all(|it| *it > 0 && *it <= 256),
        "Tile shape must be non-zero and <= 256"
    )?;
    let tile_size_0_bytes = tile_size[0] as usize * map.storage_ty.size();
    if matches!(map.interleave, TensorMapInterleave::None) {
        let max_tile_bytes = match map.swizzle {
            TensorMapSwizzle::None => usize::MAX,
            TensorMapSwizzle::B32 => 32,
            TensorMapSwizzle::B64 => 64,
            TensorMapSwizzle::B128
            | TensorMapSwizzle::B128Atom32B
            | TensorMapSwizzle::B128Atom32BFlip8B
            | TensorMapSwizzle::B128Atom64B => 128,
        };
        launch_check!(
            tile_size_0_bytes <= max_tile_bytes,
            "Innermost tile dim must be <= swizzle size"
        )?;
    }
    if matches!(map.interleave, TensorMapInterleave::B32) {
        launch_check!(
            map.swizzle == TensorMapSwizzle::B32,
            "If interleave is B32, swizzle must be B32"
        )?;
    }

    Ok(())
}

fn check_tma_im2col(
    map: &TensorMapMeta,
    lower_corner: &[i32],
    upper_corner: &[i32],
    channels_per_pixel: u32,
    pixels_per_column: u32,
) -> Result<(), LaunchError> {
    launch_check!(
        lower_corner.len() == map.metadata.rank() - 2,
        "Lower corner must be rank - 2 elements"
    )?;
    launch_check!(
        upper_corner.len() == map.metadata.rank() - 2,
        "Upper corner must be rank - 2 elements"
    )?;

    launch_check!(
        map.metadata.rank() >= 3 && map.metadata.rank() <= 5,
        "im2col requires rank to be between 3 and 5"
    )?;

    let (range_lower, range_upper) = match map.metadata.rank() {
        3 => (-32768, 32767),
        4 => (-128, 127),
        5 => (-16, 15),
        _ => unreachable!(),
    };
    launch_check!(
        lower_corner
            .iter()
            .all(|it| *it >= range_lower && *it <= range_upper),
        "Lower corner must be in range [{range_lower}, {range_upper}] for {}D im2col",
        map.metadata.rank()
    )?;
    launch_check!(
        upper_corner
            .iter()
            .all(|it| *it >= range_lower && *it <= range_upper),
        "Upper corner must be in range [{range_lower}, {range_upper}] for {}D im2col",
        map.metadata.rank()
    )?;

    launch_check!(
        channels_per_pixel <= 256,
        "Channels per pixel must be <= 256"
    )?;
    launch_check!(
        pixels_per_column <= 1024,
        "Pixels per column must be <= 1024"
    )?;

    Ok(())
}
