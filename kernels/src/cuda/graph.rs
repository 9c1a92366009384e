//! CUDA graphs of a thread's CubeCL work: a decoding step captured once, replayed with one
//! launch.
//!
//! A decoding step at batch 1 is a few hundred small launches whose host cost (burn's op
//! dispatch, CubeCL's server thread, the driver) is ten times their GPU time. [`capture`]
//! records the calling thread's stream while a closure runs — its kernels, its cuBLASLt calls
//! and the copies of [`copy`] — into a CUDA graph; [`Graph::replay`] reruns all of it with one
//! `cuGraphLaunch`, after copying new inputs into the buffers the graph reads.
//!
//! What makes the replay safe (the patched cubecl-cuda, `kernels/vendor/`, does the bookkeeping):
//!
//! * **Addresses are fixed.** Every buffer the captured work allocates or uses is held by the
//!   [`Graph`] until it is dropped, so the memory pool never hands its memory out again while a
//!   replay may write it. The graph's results stay in the same buffers from replay to replay;
//!   its inputs are the buffers it was captured with, and [`Graph::replay`] copies a different
//!   buffer into them first.
//! * **Nothing in the capture is run.** A capture only records: the closure's results are
//!   computed by the first replay. Lazily filled caches must therefore be filled before (the
//!   caller runs the same work uncaptured once first); a kernel metadata upload during the
//!   capture is taken back out of CubeCL's cache and makes the capture fail.
//! * **What cannot be replayed fails the capture** instead of being recorded wrongly: reads to
//!   and writes from the host, synchronisations, flushes, dynamic launch sizes. The caller then
//!   runs the work uncaptured; nothing was executed, so its inputs are unchanged.
//!
//! The stream's memory comes from `cuMemAlloc` during the capture (a stream-ordered allocation
//! would become a node of the graph). Replays and the graph's destruction are tasks queued on
//! CubeCL's server thread in order with the thread's other work, like the queued GEMMs.

use crate::KernelError;
use crate::cuda::server::{Server, device_server, record_queued_failure};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::{CapturedGraph, CudaRuntime};
use cubecl::server::Binding;
use cubecl::stream_id::StreamId;

type CudaTensor = CubeTensor<CudaRuntime>;

/// A captured CUDA graph of one thread's work on one device.
pub struct Graph {
    /// Boxed: replay tasks reach it by address while the `Graph` itself may move.
    graph: Option<Box<CapturedGraph>>,
    device: CudaDevice,
    stream: StreamId,
    nodes: usize,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.device.index)
            .field("nodes", &self.nodes)
            .finish()
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `f` with the calling thread's work on `device` recorded into a graph instead of run.
/// `Ok` holds `f`'s result — tensors whose contents the first [`Graph::replay`] computes — and
/// the graph; `Err` says why nothing can be replayed (then nothing of `f` ran either).
///
/// `inputs` are the tensors made outside `f` that it reads: they are ordered on the calling
/// thread's stream before the capture starts (a wait on another stream cannot be captured).
pub fn capture<R>(
    device: &CudaDevice,
    inputs: &[CudaTensor],
    f: impl FnOnce() -> R,
) -> Result<(R, Graph), KernelError> {
    let server = device_server(device);
    let stream = StreamId::current();
    let inputs: Vec<_> = inputs.iter().map(|t| t.handle.clone().binding()).collect();
    server
        .submit_blocking(move |s: &mut Server| s.nsactor_capture_begin(stream, inputs))
        .map_err(|e| KernelError::device("capture: the device server did not answer", e))?
        .map_err(KernelError::Device)?;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::cuda::gemm_chain_pick::recording(f)
    }));
    let ended = server
        .submit_blocking(move |s: &mut Server| s.nsactor_capture_end(stream))
        .map_err(|e| KernelError::device("capture: the device server did not answer", e))?;
    let graph = ended.map(|g| Graph {
        nodes: g.nodes,
        graph: Some(Box::new(g)),
        device: device.clone(),
        stream,
    });
    match (result, graph) {
        (Ok(r), Ok(g)) => Ok((r, g)),
        (Err(p), _) => Err(KernelError::Panicked {
            what: "the captured work",
            message: panic_message(p),
        }),
        (Ok(_), Err(e)) => Err(KernelError::Device(e)),
    }
}

/// The bindings and byte count of a copy of `src` into `dst`: the same shape and type, `dst`
/// contiguous (`src` is made contiguous where it is strided).
fn copy_operands(
    src: CudaTensor,
    dst: &CudaTensor,
    what: &str,
) -> Result<(Binding, Binding, u64), KernelError> {
    if src.meta.shape() != dst.meta.shape() || src.dtype != dst.dtype {
        return Err(KernelError::Misuse(format!(
            "{what}: {:?} {:?} into {:?} {:?}",
            src.meta.shape(),
            src.dtype,
            dst.meta.shape(),
            dst.dtype
        )));
    }
    if !dst.is_contiguous() {
        return Err(KernelError::Misuse(format!(
            "{what}: a strided destination {:?}",
            dst.meta.shape()
        )));
    }
    let bytes = (dst.meta.shape().num_elements() * dst.dtype.size()) as u64;
    let src = into_contiguous(src);
    Ok((src.handle.binding(), dst.handle.clone().binding(), bytes))
}

/// Enqueues a copy of `src` into `dst` on the calling thread's stream: the two must have the
/// same shape and type and `dst` must be contiguous; a strided `src` is made contiguous first.
/// Inside a [`capture`] the copy becomes a node of the graph.
pub fn copy(src: CudaTensor, dst: &CudaTensor) -> Result<(), KernelError> {
    let (s, d, bytes) = copy_operands(src, dst, "copy")?;
    device_server(&dst.device).submit(move |server: &mut Server| {
        let stream = StreamId::current();
        if let Err(e) = server.nsactor_copy(s, d, bytes, stream) {
            record_queued_failure(format!("graph input copy: {e}"));
        }
    });
    Ok(())
}

/// Hands the tasks queued on `device`'s server to its thread now (CubeCL's server thread takes
/// them 32 at a time or at a flush). The `flush` knob off (`NSACTOR_FLUSH=off`) leaves them
/// queued, for comparison.
pub fn flush(device: &CudaDevice) {
    if crate::tuning::current().flush {
        device_server(device).flush_queue();
    }
}

impl Graph {
    /// Kernel, copy and other nodes in the graph.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Whether the calling thread can replay it (graphs are replayed on the stream whose
    /// buffers they hold).
    pub fn replayable_here(&self) -> bool {
        StreamId::current() == self.stream
    }

    /// Copies each `(src, dst)` whose buffers differ (`dst` being a buffer the graph was
    /// captured with), then enqueues one replay, all on the calling thread's stream. `written`
    /// are the graph's buffers the replay rewrites that another thread's work may read next
    /// (its outputs): they are ordered after the replay for it.
    pub fn replay(
        &self,
        inputs: Vec<(CudaTensor, CudaTensor)>,
        written: &[CudaTensor],
    ) -> Result<(), KernelError> {
        if !self.replayable_here() {
            return Err(KernelError::Misuse(
                "a graph is replayed from the thread that captured it".into(),
            ));
        }
        let copies = inputs
            .into_iter()
            .map(|(src, dst)| copy_operands(src, &dst, "replay input"))
            .collect::<Result<Vec<_>, _>>()?;
        let written: Vec<_> = written.iter().map(|t| t.handle.clone()).collect();
        let exec: *const CapturedGraph = &**self.graph.as_ref().expect("a live graph");
        // The graph outlives the task: it is destroyed by a task queued behind this one.
        let exec = exec as usize;
        device_server(&self.device).submit(move |server: &mut Server| {
            let stream = StreamId::current();
            for (s, d, bytes) in copies {
                if let Err(e) = server.nsactor_copy(s, d, bytes, stream) {
                    record_queued_failure(format!("graph input copy: {e}"));
                    return;
                }
            }
            // SAFETY: see above: the graph is dropped only by a later task on this server.
            let graph = unsafe { &*(exec as *const CapturedGraph) };
            if let Err(e) = server.nsactor_graph_launch(graph, &written, stream) {
                record_queued_failure(e);
            }
        });
        // The next layer's replay may be a job of another thread: the device starts this one now.
        flush(&self.device);
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Some(g) = self.graph.take() {
            // Behind every replay already queued (the server runs tasks in order).
            device_server(&self.device).submit(move |server: &mut Server| {
                server.nsactor_graph_destroy(*g);
            });
        }
    }
}
