//! Projection GEMMs through cuBLASLt, enqueued on the stream CubeCL uses.
//!
//! `lhs [M, K] · rhs [K, N]` for the CUDA backend's f32 tensors, in one of two precisions
//! ([`GemmPrecision`], chosen per process by the plugin's `precision` option):
//!
//! * **fp32** — `CUBLAS_COMPUTE_32F`: fp32 inputs and accumulation, never TF32 (the reference ran
//!   with TF32 disabled, and parity with its fixtures needs full fp32 products);
//! * **bf16** — the inputs are rounded to bf16 (one cast kernel each, read in their logical
//!   order), multiplied on the tensor cores with fp32 accumulation, and written as f32. Master
//!   weights, optimizer state, scans and every elementwise op stay fp32, like PyTorch autocast
//!   around a matmul.
//!
//! Strided operands are passed as they are when one of their strides is 1 (transposed views,
//! row slices): cuBLASLt's column-major view of a row-major matrix is its transpose, so the
//! product is computed as `Dᵀ = op(rhs)ᵀ · op(lhs)ᵀ` with the right transpose flag per operand.
//!
//! Ordering: the patched cubecl-cuda (`kernels/vendor/`) reports the stream of the command that
//! hands out a buffer's device pointer, after that stream was made to wait for the buffer's
//! producer; the GEMM is enqueued on it, so it runs after the kernels that wrote its inputs and
//! before any kernel submitted later from the same thread, with no host synchronisation. The
//! output is allocated from that stream's pool, so its memory cannot be reused before the GEMM
//! has run; the workspace is the thread's own, held for the thread's life and used by its GEMMs
//! one after another on its stream.
//!
//! The lookup of the device pointers and the cuBLASLt call run as one task queued on CubeCL's
//! server thread, behind the launches submitted before it and under the submitting thread's
//! stream id ([`Submit::Queued`]), so the calling thread never waits for the server to catch up;
//! `NSACTOR_GEMM_SUBMIT=blocking` makes the lookups from the calling thread instead.
//!
//! Plans (descriptors, layouts, the algorithm: `gemm_plan`) are cached per thread and shape. A
//! training projection (a large product over a long token axis) is tuned on its first call: each
//! of cuBLASLt's first sixteen heuristic candidates is timed on the real operands and the fastest
//! kept if it beats the first pick by 2 % (`NSACTOR_GEMM_TUNE=off` keeps the first pick), and
//! stored with the kernel caches, so a later run on the host takes it without timing
//! (`gemm_store`). Timed anew, the pick can differ, so two runs' results may differ in their
//! last bits; within a run it is fixed. Decoding steps are not tuned: each decoding problem takes one
//! batch-invariant kernel, chosen on the first plan of the problem in the process (stored with
//! the kernel caches, else timed there: that plan's creation blocks for the timing, about 0.1–0.4
//! s, during the server's warm-up; `gemm_invariant`). A decoding pass longer than the pick's
//! reference (a prompt's) runs it in pieces of the reference's rows.

use crate::KernelError;
use crate::cuda::device::make_current;
use crate::cuda::gemm_invariant;
use crate::cuda::gemm_lt::{Operand, PlanKey, Queue, operand, workspace_bytes};
use crate::cuda::gemm_plan::{Plan, tuning};
use crate::cuda::precision::{GemmPrecision, precision};
use crate::cuda::server::{QUEUED_FAILURE, Server, device_server, record_queued_failure};
use crate::cuda::timing;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::{result as lt, sys};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

type CudaTensor = CubeTensor<CudaRuntime>;

/// `lhs · rhs` in the process's [`precision`].
pub fn gemm(lhs: CudaTensor, rhs: CudaTensor) -> CudaTensor {
    gemm_with(precision(), lhs, rhs)
}

fn dims(t: &CudaTensor) -> ([usize; 2], [usize; 2]) {
    let shape = t.meta.shape();
    let strides = t.meta.strides();
    assert_eq!(shape.num_dims(), 2, "gemm takes 2-d tensors, got {shape:?}");
    ([shape[0], shape[1]], [strides[0], strides[1]])
}

/// Prepares an operand: rounded to bf16 when asked (the cast writes it contiguous), made
/// contiguous when cuBLASLt cannot read its strides.
fn prepare(t: CudaTensor, p: GemmPrecision) -> (CudaTensor, Operand) {
    let t = round_operand(t, p);
    let (shape, strides) = dims(&t);
    match operand(shape, strides) {
        Some(op) => (t, op),
        None => {
            let t = into_contiguous(t);
            let (shape, strides) = dims(&t);
            let op = operand(shape, strides).expect("a contiguous matrix is row-major");
            (t, op)
        }
    }
}

/// `t` rounded to the GEMM's input type: bf16 in bf16 precision (already-rounded operands pass
/// through, so a tensor used by several products is rounded once), unchanged in fp32.
pub fn round_operand(t: CudaTensor, p: GemmPrecision) -> CudaTensor {
    match p {
        GemmPrecision::Bf16 if t.dtype != burn::tensor::DType::BF16 => {
            let (shape, strides) = dims(&t);
            if matches!(operand(shape, strides), Some(Operand { trans: true, .. })) {
                // A transposed view: round its row-major storage (a contiguous read) and keep
                // the view, instead of a strided transposing copy.
                transpose(cast(transpose(t), burn::tensor::DType::BF16))
            } else {
                cast(t, burn::tensor::DType::BF16)
            }
        }
        _ => t,
    }
}

/// The transposed view (no copy).
fn transpose(t: CudaTensor) -> CudaTensor {
    use burn::tensor::ops::FloatTensorOps;
    <burn_cuda::Cuda<f32, i32> as FloatTensorOps<_>>::float_transpose(t)
}

struct ThreadState {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
}

thread_local! {
    /// This thread's cuBLASLt workspace per device (held, so never recycled). Its GEMMs run in
    /// order on this thread's stream, so one workspace serves them all. Its device address is
    /// looked up on the server thread with the operands': a lookup from this thread would wait
    /// for every launch queued before it (kernels compiled ahead among them).
    static WORKSPACES: RefCell<HashMap<usize, cubecl::server::Handle>> =
        RefCell::new(HashMap::new());
}

impl Drop for ThreadState {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created once by `lt::create_handle` for this thread.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

thread_local! {
    static STATE: RefCell<Option<ThreadState>> = const { RefCell::new(None) };
}

/// Operands ready for cuBLASLt: rounded to the GEMM's input type and in a layout it reads.
pub struct Prepared {
    precision: GemmPrecision,
    lhs: CudaTensor,
    rhs: CudaTensor,
    a: Operand,
    b: Operand,
    m: usize,
    n: usize,
    /// An f32 `[M, N]` with unit column stride added to the product ([`gemm_add`]).
    add: Option<CudaTensor>,
    /// Whether the product is written in bf16 ([`gemm_out`]) instead of f32.
    out_bf16: bool,
}

impl Prepared {
    /// The same product of other activations: `lhs` of `self`'s `K` columns, in its input
    /// type, contiguous; no addend.
    fn with_lhs(&self, lhs: CudaTensor) -> Prepared {
        let (shape, strides) = dims(&lhs);
        let b = operand(shape, strides).expect("a contiguous matrix is row-major");
        Prepared {
            precision: self.precision,
            lhs,
            rhs: self.rhs.clone(),
            a: self.a,
            b,
            m: shape[0],
            n: self.n,
            add: None,
            out_bf16: self.out_bf16,
        }
    }
}

/// Checks the shapes and prepares both operands of a non-empty `lhs [M, K] · rhs [K, N]`.
pub fn prepare_operands(p: GemmPrecision, lhs: CudaTensor, rhs: CudaTensor) -> Prepared {
    let ([m, k], _) = dims(&lhs);
    let ([k2, n], _) = dims(&rhs);
    assert_eq!(
        k, k2,
        "gemm: inner dimensions differ ([{m}, {k}] · [{k2}, {n}])"
    );
    for t in [&lhs, &rhs] {
        let ok = t.dtype == burn::tensor::DType::F32
            || (p == GemmPrecision::Bf16 && t.dtype == burn::tensor::DType::BF16);
        assert!(
            ok,
            "gemm takes f32 tensors (or bf16 ones rounded for a bf16 GEMM), got {:?} in {}",
            t.dtype,
            p.name()
        );
    }
    // cuBLASLt computes Dᵀ [N, M] = A · B with A = rhsᵀ [N, K], B = lhsᵀ [K, M].
    let (rhs, a) = prepare(rhs, p);
    let (lhs, b) = prepare(lhs, p);
    Prepared {
        precision: p,
        lhs,
        rhs,
        a,
        b,
        m,
        n,
        add: None,
        out_bf16: false,
    }
}

/// `lhs [M, K] · rhs [K, N]` with the given precision; the output is a contiguous f32 `[M, N]`.
pub fn gemm_with(p: GemmPrecision, lhs: CudaTensor, rhs: CudaTensor) -> CudaTensor {
    gemm_out(p, lhs, rhs, burn::tensor::DType::F32)
}

/// `lhs [M, K] · rhs [K, N]` with the given precision, written contiguous in `out`: bf16 (the
/// fp32 accumulators rounded once, in cuBLASLt's epilogue) only in bf16 precision, where a
/// product that only feeds a bf16 reader (a scan kernel storing bf16, another GEMM) saves
/// half its write and the reader's cast; f32 otherwise.
pub fn gemm_out(
    p: GemmPrecision,
    lhs: CudaTensor,
    rhs: CudaTensor,
    out: burn::tensor::DType,
) -> CudaTensor {
    let out_bf16 = p == GemmPrecision::Bf16 && out == burn::tensor::DType::BF16;
    let k = dims(&lhs).0[1];
    if k == 0 || dims(&lhs).0[0] == 0 || dims(&rhs).0[1] == 0 {
        let (m, n) = (dims(&lhs).0[0], dims(&rhs).0[1]);
        return burn_cubecl::ops::numeric::zeros_client(
            lhs.client.clone(),
            lhs.device.clone(),
            [m, n].into(),
            if out_bf16 {
                burn::tensor::DType::BF16
            } else {
                burn::tensor::DType::F32
            },
        );
    }
    let mut op = prepare_operands(p, lhs, rhs);
    op.out_bf16 = out_bf16;
    run(&op)
}

/// `lhs [M, K] · rhs [K, N] + c` with the given precision, the addition in cuBLASLt's epilogue
/// (`β = 1`): one call instead of a GEMM and an elementwise add. `c` is an f32 `[M, N]`, read
/// in place where its columns are contiguous (a column slice of a wider product).
pub fn gemm_add(p: GemmPrecision, lhs: CudaTensor, rhs: CudaTensor, c: CudaTensor) -> CudaTensor {
    let (m, n) = (dims(&lhs).0[0], dims(&rhs).0[1]);
    let ([cm, cn], [_, cs1]) = dims(&c);
    assert_eq!(
        (cm, cn),
        (m, n),
        "gemm_add: the addend is [{cm}, {cn}], the product [{m}, {n}]"
    );
    assert_eq!(
        c.dtype,
        burn::tensor::DType::F32,
        "gemm_add: the addend is f32"
    );
    if dims(&lhs).0[1] == 0 || m == 0 || n == 0 {
        return into_contiguous(c);
    }
    let c = if cs1 == 1 || n <= 1 {
        c
    } else {
        into_contiguous(c)
    };
    let mut op = prepare_operands(p, lhs, rhs);
    op.add = Some(c);
    run(&op)
}

/// How [`run`] hands the cuBLASLt call to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submit {
    /// As a task queued on CubeCL's server thread, in order with the kernel launches, which
    /// looks the buffers' device pointers up and enqueues the GEMM there: the calling thread
    /// never waits (the default).
    Queued,
    /// From the calling thread, after three blocking `get_resource` round trips to the server
    /// thread (each waits for every launch queued before it): `NSACTOR_GEMM_SUBMIT=blocking`.
    Blocking,
}

/// The process's [`Submit`] mode: the `gemm_submit` knob (`NSACTOR_GEMM_SUBMIT`: `queued`,
/// `blocking`).
pub fn submit_mode() -> Submit {
    match crate::tuning::current().gemm_submit {
        nsactor_plugin_api::tuning::GemmSubmit::Queued => Submit::Queued,
        nsactor_plugin_api::tuning::GemmSubmit::Blocking => Submit::Blocking,
    }
}

/// Queued GEMM tasks run on CubeCL's server thread, and their time there (the whole task, and
/// of it the cuBLASLt call), for profiles ([`queued_stats`]).
static QUEUED_TASKS: AtomicU64 = AtomicU64::new(0);
static QUEUED_TASK_NS: AtomicU64 = AtomicU64::new(0);
static QUEUED_LT_NS: AtomicU64 = AtomicU64::new(0);

/// `(queued GEMM tasks, their nanoseconds on the server thread, of it in cuBLASLt)` so far.
pub fn queued_stats() -> (u64, u64, u64) {
    (
        QUEUED_TASKS.load(Ordering::Relaxed),
        QUEUED_TASK_NS.load(Ordering::Relaxed),
        QUEUED_LT_NS.load(Ordering::Relaxed),
    )
}

/// The product of prepared operands: the one-chain MMA kernel where a decoding GEMM may take
/// it (`gemm_chain_pick`), else cuBLASLt ([`run_lt`]).
pub fn run(op: &Prepared) -> CudaTensor {
    use crate::cuda::gemm_chain_pick::{Candidate, try_chain};
    let candidate = Candidate {
        m: op.m,
        n: op.n,
        k: dims(&op.lhs).0[1],
        precision: op.precision,
        plain: !op.out_bf16 && op.add.is_none(),
        lhs: &op.lhs,
        rhs: &op.rhs,
        cublaslt: &|x| run_lt(&op.with_lhs(x)),
    };
    try_chain(&candidate, crate::options::gemm_rows()).unwrap_or_else(|| run_lt(op))
}

/// The cuBLASLt call on prepared operands, enqueued on the stream of the calling thread's
/// CubeCL work (see [`Submit`] for how).
pub(crate) fn run_lt(op: &Prepared) -> CudaTensor {
    if let Some(e) = QUEUED_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
    {
        panic!("gemm: an earlier GEMM failed on CubeCL's server thread: {e}");
    }
    let (m, n) = (op.m, op.n);
    let client = op.lhs.client.clone();
    let device: CudaDevice = op.lhs.device.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        [m, n].into(),
        if op.out_bf16 {
            burn::tensor::DType::BF16
        } else {
            burn::tensor::DType::F32
        },
    );
    if cubecl::cuda::nsactor_compile_only::active() {
        // Nothing runs on a compile-only thread (`DeviceOps::compile_only`); cuBLASLt
        // compiles nothing, so its call is left out, plans and probes with it.
        return out;
    }
    let key = PlanKey {
        device: device.index,
        precision: op.precision,
        out_bf16: op.out_bf16,
        a: op.a,
        b: op.b,
        m: m as u64,
        n: n as u64,
        c_ld: op.add.as_ref().map(|c| dims(c).1[0].max(n) as u64),
        rows: crate::options::gemm_rows(),
    };
    // The addend's buffer, or the output's where there is none (then unused).
    let addend = op.add.as_ref().unwrap_or(&out);
    let resource = |h: &cubecl::server::Handle| {
        client
            .get_resource(h.clone())
            .unwrap_or_else(|e| panic!("gemm: device buffer unavailable: {e:?}"))
    };
    let workspace = WORKSPACES.with(|w| {
        w.borrow_mut()
            .entry(device.index)
            .or_insert_with(|| client.empty(workspace_bytes()))
            .clone()
    });
    if submit_mode() == Submit::Blocking {
        let (ra, rb, rc, rd) = (
            resource(&op.rhs.handle),
            resource(&op.lhs.handle),
            resource(&addend.handle),
            resource(&out.handle),
        );
        let rw = resource(&workspace);
        let (ra, rb, rc, rd) = (ra.resource(), rb.resource(), rc.resource(), rd.resource());
        enqueue(
            &key,
            [ra.ptr, rb.ptr, rc.ptr, rd.ptr],
            rw.resource().ptr,
            rd.stream,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        return out;
    }
    // The bindings hold the buffers until the task has run: memory is recycled only when no
    // binding is left, and then in stream order after the GEMM.
    let bindings = [
        op.rhs.handle.clone().binding(),
        op.lhs.handle.clone().binding(),
        addend.handle.clone().binding(),
        out.handle.clone().binding(),
        workspace.binding(),
    ];
    let server = device_server(&device);
    server.submit(move |server: &mut Server| {
        // The task runs under the submitting thread's stream id; in order with the launches
        // that wait for kernels compiled ahead, so maybe later, during another thread's call.
        let stream_id = cubecl::stream_id::StreamId::current();
        server.nsactor_in_order(Box::new(move |server: &mut Server| {
            queued_gemm(server, stream_id, bindings, key)
        }));
    });
    out
}

/// The body of a queued GEMM, on CubeCL's server thread: the operands' device pointers looked
/// up on `stream_id` (`[A, B, C, D, workspace]`) and the cuBLASLt call enqueued there.
fn queued_gemm(
    server: &mut Server,
    stream_id: cubecl::stream_id::StreamId,
    bindings: [cubecl::server::Binding; 5],
    key: PlanKey,
) {
    use cubecl::server::ComputeServer;
    let started = std::time::Instant::now();
    let task = || -> Result<(), KernelError> {
        // Held until the GEMM is enqueued, like the blocking path's resources.
        let held = bindings
            .into_iter()
            .map(|b| server.get_resource(b, stream_id))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| KernelError::device("gemm: device buffer unavailable", e))?;
        let [a, b, c, d, w] = [0, 1, 2, 3, 4].map(|i| held[i].resource());
        let lt = std::time::Instant::now();
        let r = enqueue(&key, [a.ptr, b.ptr, c.ptr, d.ptr], w.ptr, d.stream);
        QUEUED_LT_NS.fetch_add(lt.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    };
    // A panic (a plan cuBLASLt refuses) is recorded too, not only logged by the server.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)).unwrap_or_else(|p| {
        Err(KernelError::Panicked {
            what: "a queued GEMM",
            message: p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into()),
        })
    });
    QUEUED_TASKS.fetch_add(1, Ordering::Relaxed);
    QUEUED_TASK_NS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    // A GEMM that failed while its stream was captured only fails the capture.
    if let Err(e) = r.map_err(|e| e.to_string())
        && !server.nsactor_capture_taint(stream_id, &e)
    {
        record_queued_failure(e);
    }
}

/// Enqueues `D = A · B (+ C)` of `key` on `stream` (pointers `[A, B, C, D]`; `C` unused where
/// the key adds none), with this thread's cuBLASLt handle and plan cache.
fn enqueue(
    key: &PlanKey,
    ptrs: [u64; 4],
    workspace_ptr: u64,
    stream: cudarc::driver::sys::CUstream,
) -> Result<(), KernelError> {
    if stream.is_null() {
        return Err(KernelError::Device(
            "gemm: the patched cubecl-cuda reports no stream".into(),
        ));
    }
    make_current(key.device);
    // A decoding GEMM longer than its batch-invariant reference runs in pieces of it; any
    // other GEMM is one piece.
    let limit = gemm_invariant::invariant_rows(key).unwrap_or(key.m);
    let pieces = key.pieces(limit, ptrs);
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let state = state.get_or_insert_with(|| ThreadState {
            handle: lt::create_handle().unwrap_or_else(|e| panic!("cuBLASLt handle: {e:?}")),
            plans: HashMap::new(),
        });
        let handle = state.handle;
        // Timed (`bench train`'s breakdown) with events on the GEMM's own stream.
        let span = timing::on().then(timing::next_id);
        if let Some(id) = span {
            timing::begin_on(key.device, id, timing::Kind::Gemm, stream);
        }
        let mut r = Ok(());
        for (key, ptrs) in pieces {
            let plan = state
                .plans
                .entry(key)
                // SAFETY: `stream` is CubeCL's live stream of the current context (checked
                // non-null above) and the workspace is this thread's, as for the calls below.
                .or_insert_with(|| unsafe {
                    let queue = Queue {
                        stream,
                        workspace_ptr,
                    };
                    Plan::new(handle, &key, queue)
                });
            // SAFETY (both calls): the pointers are live device buffers of the sizes the
            // layouts describe (the caller holds their resources or bindings until after the
            // call, and their memory is recycled only in order on `stream`; a piece's pointers
            // lie inside the whole problem's buffers); `stream` is CubeCL's stream of the
            // submitting thread on the device whose context is current.
            if !plan.tuned {
                if tuning() && key.tuned() && plan.candidates.len() > 1 {
                    unsafe { plan.tune_or_stored(&key, handle, ptrs, workspace_ptr, stream) }?;
                }
                plan.tuned = true;
            }
            let algo = plan.algo;
            r = unsafe { plan.matmul(handle, &algo, ptrs, workspace_ptr, stream) }
                .map_err(|e| KernelError::Device(format!("cuBLASLt matmul {key:?}: {e:?}")));
            if r.is_err() {
                break;
            }
        }
        if let Some(id) = span {
            timing::end_on(key.device, id, stream);
        }
        r
    })
}
