//! `DeviceOps` (moving tensors between devices, uploading host values, reading them back to the host, handing queued
//! work to the device, timing a stage call's work, submission counters) and `GraphOps`
//! (capturing a decoding step's work once and replaying it with one launch): the backend's
//! devices and its queue of work.

use crate::KernelError;
use crate::ops::types::StepGraph;
use burn::tensor::{
    Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive, backend::Backend, ops::FloatTensor,
};

/// The backend's devices and its submission of work: moves between devices, flushes, timed
/// calls and submission counters. One of the jobs of `SnnOps`; every method has a default.
pub trait DeviceOps: Backend {
    /// Moves a tensor to another device (pipeline stages hand activations and gradients over
    /// with it). Default: the backend's own `to_device`. CUDA overrides it with a peer copy
    /// ordered on both devices' streams (`crate::cuda::device::to_device`, feature `cuda`).
    fn move_to_device(t: FloatTensor<Self>, device: &Self::Device) -> FloatTensor<Self> {
        Self::float_to_device(t, device)
    }

    /// A new communication group's id, for [`collective_join`](Self::collective_join) in every
    /// process of a world (NCCL's unique id on CUDA). Default: no collectives.
    fn collective_id() -> Result<Vec<u8>, KernelError> {
        Err(KernelError::Unsupported(
            "have collectives between processes",
        ))
    }

    /// Joins the group `id` as `rank` of `size` on `device`, once every rank has; the number
    /// names the communicator in this process. Default: no collectives.
    fn collective_join(
        id: &[u8],
        rank: usize,
        size: usize,
        device: &Self::Device,
    ) -> Result<u64, KernelError> {
        let _ = (id, rank, size, device);
        Err(KernelError::Unsupported(
            "have collectives between processes",
        ))
    }

    /// The sum of `t` over the ranks of communicator `comm`, ordered after `t`'s producer on
    /// the calling thread's queue. Default: no collectives.
    fn all_reduce_sum(t: FloatTensor<Self>, comm: u64) -> Result<FloatTensor<Self>, KernelError> {
        let _ = (t, comm);
        Err(KernelError::Unsupported(
            "have collectives between processes",
        ))
    }

    /// Counters of the backend's submission thread, for profiles: `[kernel launches, their
    /// nanoseconds, GEMM tasks, their nanoseconds, of it in the GEMM library]` since the
    /// process started. `None` (the default): the backend keeps none.
    fn submission_stats() -> Option<[u64; 5]> {
        None
    }

    /// Hands the calling thread's queued work on `device` to the device now. A backend that
    /// batches submissions (CubeCL's server thread takes tasks 32 at a time, or at a flush)
    /// would otherwise hold a short burst of work — a decoding step's embedding, a layer's
    /// replay — until more work or a read arrives, with the device idle meanwhile. Default:
    /// nothing to do.
    fn flush(device: &Self::Device) {
        let _ = device;
    }

    /// A tensor of `shape` holding `values` (row-major, `f32`) on `device`: how a stage's
    /// parameters get there, drawn or loaded. Default: the backend's own `from_data`. CUDA
    /// overrides it with transfers through pinned staging buffers kept for the process
    /// ([`crate::cuda::host_write`], feature `cuda`).
    fn upload_f32(values: &[f32], shape: Shape, device: &Self::Device) -> FloatTensor<Self> {
        Self::float_from_data(TensorData::new(values.to_vec(), shape), device)
    }

    /// Copies `t`'s values as little-endian `f32` into `out`, which holds exactly their bytes:
    /// how checkpoints read a stage's state back. Default: the backend's own read, converted to
    /// `f32` where stored otherwise. CUDA overrides it for `f32` tensors with transfers through
    /// pinned staging buffers kept for the process ([`crate::cuda::host_read`], feature `cuda`).
    fn read_f32_into(t: FloatTensor<Self>, out: &mut [u8]) -> Result<(), KernelError> {
        default_read_f32_into::<Self>(t, out)
    }

    /// Puts the calling thread in compile-only mode on `device` (`on`), or back: the kernels it
    /// launches there are compiled (in the background) and not run, GEMMs are skipped, and the
    /// tensors they would write hold whatever their memory held. For warming a cold process's
    /// kernels with a small step of the real model while the run is being set up. Returns
    /// whether the backend has the mode. Default: no (nothing to compile).
    fn compile_only(device: &Self::Device, on: bool) -> bool {
        let _ = (device, on);
        false
    }

    /// Runs `f` — one stage call's work on `device`, the call named `name` — with its device
    /// time measured as a call span when the backend's timing is on (`bench("timing")`,
    /// `nsactor bench train`'s breakdown). Default: just runs it.
    fn timed_call<R>(device: &Self::Device, name: &'static str, f: impl FnOnce() -> R) -> R {
        let _ = (device, name);
        f()
    }
}

/// Work recorded once and replayed with one launch (CUDA graphs on the CUDA backend): one of the
/// jobs of `SnnOps`. The defaults record nothing.
pub trait GraphOps: Backend {
    /// Whether [`capture`](Self::capture) records work on this backend. Default `false`.
    fn captures_steps() -> bool {
        false
    }

    /// Runs `f` with the calling thread's work on `device` recorded instead of run, for
    /// [`replay`](Self::replay); `f`'s result is computed by the first replay. `inputs` are the
    /// tensors made outside `f` that it reads. `Err` (the default: nothing is recorded) says
    /// why the work cannot be replayed; nothing of it ran.
    fn capture<R>(
        device: &Self::Device,
        inputs: &[FloatTensor<Self>],
        f: impl FnOnce() -> R,
    ) -> Result<(R, StepGraph), KernelError> {
        let _ = (device, inputs, f);
        Err(KernelError::Unsupported("capture work"))
    }

    /// `t` laid out contiguously (itself where it is): captured work's input buffers are
    /// copied into whole. Default: `t`.
    fn contiguous(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
    }

    /// Copies `src` into `dst` in place (same shape and type), in order with the calling
    /// thread's work: the one way captured work writes back into its input buffers.
    fn capture_copy(src: FloatTensor<Self>, dst: &FloatTensor<Self>) -> Result<(), KernelError> {
        let _ = (src, dst);
        Err(KernelError::Unsupported("capture work"))
    }

    /// Copies each `(src, dst)` whose buffers differ (`dst` a buffer `graph` was captured
    /// with), then reruns `graph`; `written` are its buffers the rerun rewrites that other
    /// work may read next.
    fn replay(
        graph: &StepGraph,
        inputs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        written: &[FloatTensor<Self>],
    ) -> Result<(), KernelError> {
        let _ = (graph, inputs, written);
        Err(KernelError::Unsupported("capture work"))
    }
}

/// [`DeviceOps::read_f32_into`] through the backend's own `into_data` (a copy, then a copy into
/// `out`): the default, and the fallback of an override for a tensor it does not handle.
pub fn default_read_f32_into<B: Backend>(
    t: FloatTensor<B>,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let n = t.shape().num_elements();
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        t,
        Shape::new([n]),
    )));
    let data = flat
        .try_into_data()
        .map_err(|e| KernelError::Device(format!("read back: {e:?}")))?
        .convert::<f32>();
    let bytes = data.as_bytes();
    if bytes.len() != out.len() {
        return Err(KernelError::Misuse(format!(
            "read back {} bytes into a buffer of {}",
            bytes.len(),
            out.len()
        )));
    }
    out.copy_from_slice(bytes);
    Ok(())
}
