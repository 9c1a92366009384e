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
//! Plans (descriptors, layouts, the algorithm) are cached per thread and shape. A training
//! projection (a large product over a long token axis) is tuned on its first call: each of
//! cuBLASLt's first sixteen heuristic candidates is timed on the real operands and the fastest
//! kept if it beats the first pick by 2 % (`NSACTOR_GEMM_TUNE=off` keeps the first pick). The
//! pick can differ between runs, so two runs' results may differ in their last bits; within a
//! run it is fixed. Decoding steps are not tuned.

use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::{result as lt, sys};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

type CudaTensor = CubeTensor<CudaRuntime>;

/// cuBLASLt workspace per thread and device (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Arithmetic of the projection GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmPrecision {
    /// fp32 inputs, fp32 accumulation (no TF32): parity with the reference's fixtures.
    Fp32,
    /// bf16 inputs, fp32 accumulation and output: the tensor cores' full rate.
    Bf16,
}

impl GemmPrecision {
    pub fn name(self) -> &'static str {
        match self {
            GemmPrecision::Fp32 => "fp32",
            GemmPrecision::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(GemmPrecision::Fp32),
            "bf16" => Ok(GemmPrecision::Bf16),
            other => Err(format!(
                "unknown GEMM precision `{other}` (expected `fp32` or `bf16`)"
            )),
        }
    }
}

static PRECISION: AtomicU8 = AtomicU8::new(0);

/// Sets the precision of every later projection GEMM in this process.
pub fn set_precision(p: GemmPrecision) {
    PRECISION.store(p as u8, Ordering::SeqCst);
}

/// The element type a GEMM in the process's precision reads: kernels whose output only feeds a
/// GEMM write it directly.
pub fn input_dtype() -> burn::tensor::DType {
    match precision() {
        GemmPrecision::Bf16 => burn::tensor::DType::BF16,
        GemmPrecision::Fp32 => burn::tensor::DType::F32,
    }
}

/// The type the scans' large activations are stored in ([`crate::SnnOps::storage_dtype`]):
/// the GEMMs' input type, unless `$NSACTOR_BF16_STORAGE=off` (read once) keeps f32.
pub fn storage_dtype() -> burn::tensor::DType {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("NSACTOR_BF16_STORAGE").as_deref() == Ok("off")) {
        burn::tensor::DType::F32
    } else {
        input_dtype()
    }
}

/// The precision projection GEMMs use now (fp32 until [`set_precision`]).
pub fn precision() -> GemmPrecision {
    match PRECISION.load(Ordering::SeqCst) {
        0 => GemmPrecision::Fp32,
        _ => GemmPrecision::Bf16,
    }
}

/// `lhs · rhs` in the process's [`precision`].
pub fn gemm(lhs: CudaTensor, rhs: CudaTensor) -> CudaTensor {
    gemm_with(precision(), lhs, rhs)
}

/// How cuBLASLt sees one operand: a column-major matrix `rows × cols` with leading dimension
/// `ld`, to be used transposed or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Operand {
    rows: u64,
    cols: u64,
    ld: i64,
    trans: bool,
}

/// A row-major `[r, c]` logical matrix with strides `(s0, s1)`, seen column-major so that the
/// op applied gives its transpose `[c, r]` (what `Dᵀ = rhsᵀ·lhsᵀ` needs). `None` when neither
/// stride is 1 (the caller makes it contiguous).
fn operand(shape: [usize; 2], strides: [usize; 2]) -> Option<Operand> {
    let [r, c] = shape;
    let (r64, c64) = (r as u64, c as u64);
    if strides[1] == 1 && (r <= 1 || strides[0] >= c.max(1)) {
        // Row-major: column-major `c × r` with ld = s0, used as is.
        Some(Operand {
            rows: c64,
            cols: r64,
            ld: strides[0].max(c.max(1)) as i64,
            trans: false,
        })
    } else if strides[0] == 1 && (c <= 1 || strides[1] >= r.max(1)) {
        // Column-major (a transposed view): `r × c` with ld = s1, used transposed.
        Some(Operand {
            rows: r64,
            cols: c64,
            ld: strides[1].max(r.max(1)) as i64,
            trans: true,
        })
    } else {
        None
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    device: usize,
    precision: GemmPrecision,
    /// `D` in bf16 (else f32); never with an addend.
    out_bf16: bool,
    a: Operand,
    b: Operand,
    m: u64,
    n: u64,
    /// The leading dimension of an added `C` (`D = A·B + C`, `C` row-major `[M, N]` with
    /// unit column stride), or `None` for `D = A·B`.
    c_ld: Option<u64>,
}

impl PlanKey {
    /// `K`: `A = rhsᵀ` is `[N, K]` after its op.
    fn k(&self) -> u64 {
        if self.a.trans {
            self.a.rows
        } else {
            self.a.cols
        }
    }

    /// `M·N·K`.
    fn macs(&self) -> u64 {
        self.m * self.n * self.k()
    }

    /// Whether [`Plan::tune`] times this problem's candidates: a large product over a long
    /// token axis (`M` for `x·Wᵀ` and `∂x`, `K` for `∂W`): every projection of a training
    /// micro-batch. Decoding steps (at most 4,096 rows) keep the heuristic's pick, so a new
    /// cohort size never waits for tuning.
    fn tuned(&self) -> bool {
        self.macs() >= TUNE_MIN_MACS && self.m.max(self.k()) >= TUNE_MIN_ROWS
    }
}

/// Descriptors and the chosen algorithm for one problem; destroyed with the thread.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    /// `C`'s layout where the key adds one.
    c: Option<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's candidates, best guess first.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Whether [`Plan::tune`] has run (or was not wanted).
    tuned: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by `Plan::new` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            if let Some(c) = self.c {
                let _ = lt::destroy_matrix_layout(c);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn check(what: &str, r: Result<(), lt::CublasError>) {
    if let Err(e) = r {
        panic!("cuBLASLt {what}: {e:?}");
    }
}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, key: &PlanKey) -> Plan {
        let input = match key.precision {
            GemmPrecision::Fp32 => sys::cudaDataType_t::CUDA_R_32F,
            GemmPrecision::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        };
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let layout = |t, o: &Operand| {
            lt::create_matrix_layout(t, o.rows, o.cols, o.ld)
                .unwrap_or_else(|e| panic!("cuBLASLt layout {o:?}: {e:?}"))
        };
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .unwrap_or_else(|e| panic!("cuBLASLt matmul descriptor: {e:?}"));
        // cublasOperation_t as a 32-bit integer: 0 = N, 1 = T.
        for (attr, trans) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                key.a.trans,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                key.b.trans,
            ),
        ] {
            let op = trans as i32;
            // SAFETY: `desc` is a live descriptor; `op` outlives the call and has its exact size.
            check("transpose attribute", unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &op as *const i32 as *const c_void,
                    std::mem::size_of_val(&op),
                )
            });
        }
        let a = layout(input, &key.a);
        let b = layout(input, &key.b);
        let out = if key.out_bf16 {
            sys::cudaDataType_t::CUDA_R_16BF
        } else {
            f32t
        };
        let d = lt::create_matrix_layout(out, key.n, key.m, key.n as i64)
            .unwrap_or_else(|e| panic!("cuBLASLt output layout: {e:?}"));
        let c = key.c_ld.map(|ld| {
            lt::create_matrix_layout(f32t, key.n, key.m, ld as i64)
                .unwrap_or_else(|e| panic!("cuBLASLt addend layout: {e:?}"))
        });
        let pref =
            lt::create_matmul_pref().unwrap_or_else(|e| panic!("cuBLASLt preference: {e:?}"));
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: live handles and descriptors; `ws` outlives the call.
        let heuristic = unsafe {
            check(
                "workspace preference",
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const _ as *const c_void,
                    std::mem::size_of_val(&ws),
                ),
            );
            let mut found =
                vec![std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); TUNE_CANDIDATES];
            let mut count = 0i32;
            let status = sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                a,
                b,
                c.unwrap_or(d),
                d,
                pref,
                TUNE_CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            let _ = lt::destroy_matmul_pref(pref);
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || count <= 0 {
                panic!("cuBLASLt has no algorithm for {key:?}: {status:?}");
            }
            found.truncate(count as usize);
            found
        };
        Plan {
            desc,
            a,
            b,
            d,
            c,
            algo: heuristic[0].algo,
            candidates: heuristic.into_iter().map(|h| h.algo).collect(),
            tuned: false,
        }
    }

    /// Runs `D = A · B` (`+ C` where the plan adds one) with `algo` on `stream`.
    ///
    /// # Safety
    /// As [`enqueue`]: live buffers of the layouts' sizes, a stream of the current context.
    unsafe fn matmul(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        [a, b, c, d]: [u64; 4],
        workspace_ptr: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), lt::CublasError> {
        let (alpha, beta) = (1.0f32, if self.c.is_some() { 1.0f32 } else { 0.0 });
        let (c, c_layout) = match self.c {
            Some(layout) => (c, layout),
            None => (d, self.d),
        };
        // SAFETY: upheld by the caller.
        unsafe {
            lt::matmul(
                handle,
                self.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a as *const c_void,
                self.a,
                b as *const c_void,
                self.b,
                c as *const c_void,
                c_layout,
                d as *mut c_void,
                self.d,
                algo,
                workspace_ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream as sys::cudaStream_t,
            )
        }
    }

    /// Times each of the heuristic's candidates on the real operands (`D` is overwritten, and
    /// written again by the caller's call with the pick) and keeps the fastest: what PyTorch's
    /// TunableOp does for its GEMMs. Blocks the calling thread (CubeCL's server thread for
    /// queued GEMMs) once per problem, for a few times the GEMM's duration per candidate.
    ///
    /// # Safety
    /// As [`matmul`](Self::matmul).
    unsafe fn tune(
        &mut self,
        handle: sys::cublasLtHandle_t,
        ptrs: [u64; 4],
        workspace_ptr: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), String> {
        use cudarc::driver::result::event;
        self.tuned = true;
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let err = |e: cudarc::driver::DriverError| format!("gemm tuning: {e:?}");
        let (start, end) = (
            event::create(flags).map_err(err)?,
            event::create(flags).map_err(err)?,
        );
        let mut times = Vec::new();
        // SAFETY: the events are live until destroyed below; the matmuls as the caller's.
        let r = (|| unsafe {
            for (i, algo) in self.candidates.iter().enumerate() {
                // One untimed call (cuBLASLt's first use of a kernel loads it), then the timed ones.
                if self
                    .matmul(handle, algo, ptrs, workspace_ptr, stream)
                    .is_err()
                {
                    continue;
                }
                event::record(start, stream).map_err(err)?;
                for _ in 0..TUNE_REPS {
                    self.matmul(handle, algo, ptrs, workspace_ptr, stream)
                        .map_err(|e| format!("gemm tuning: {e:?}"))?;
                }
                event::record(end, stream).map_err(err)?;
                event::synchronize(end).map_err(err)?;
                times.push((
                    i,
                    event::elapsed(start, end).map_err(err)? / TUNE_REPS as f32,
                ));
            }
            Ok::<(), String>(())
        })();
        // SAFETY: created above, destroyed once; the stream has passed both.
        unsafe {
            let _ = event::destroy(start);
            let _ = event::destroy(end);
        }
        r?;
        // The heuristic's first pick stays unless another is clearly faster (timing noise is
        // a percent or so).
        let first = times.iter().find(|t| t.0 == 0).map(|t| t.1);
        if let Some(&(best, t)) = times.iter().min_by(|x, y| x.1.total_cmp(&y.1))
            && first.is_none_or(|f| t < f * (1.0 - TUNE_MARGIN))
        {
            self.algo = self.candidates[best];
        }
        Ok(())
    }
}

/// How many of cuBLASLt's heuristic candidates [`Plan::tune`] times.
const TUNE_CANDIDATES: usize = 16;
/// Timed calls per candidate.
const TUNE_REPS: usize = 5;
/// How much faster than the heuristic's first pick a candidate must be to replace it.
const TUNE_MARGIN: f32 = 0.02;
/// Problems of at least this many multiply-adds may be tuned (a training projection is
/// 2.6·10¹⁰ or more): below it the tuning would cost more than it could save.
const TUNE_MIN_MACS: u64 = 1 << 32;
/// ... and only over a token axis at least this long (a training micro-batch's `T·K·B` is
/// 32,704 at the 0.9B shape; a decoding step has at most 4,096 rows).
const TUNE_MIN_ROWS: u64 = 8192;

/// Whether GEMMs are tuned ([`Plan::tune`]), read once from `NSACTOR_GEMM_TUNE` (`on`, the
/// default; `off`: the heuristic's first pick everywhere, as before).
pub fn tuning() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NSACTOR_GEMM_TUNE").as_deref() != Ok("off"))
}

struct ThreadState {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
}

thread_local! {
    /// This thread's cuBLASLt workspace per device: the buffer (held, so never recycled) and
    /// its device address. Its GEMMs run in order on this thread's stream, so one workspace
    /// serves them all, and a GEMM needs no allocation or address lookup for it.
    static WORKSPACES: RefCell<HashMap<usize, (cubecl::server::Handle, u64)>> =
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

/// The process's [`Submit`] mode, read once from `NSACTOR_GEMM_SUBMIT` (`queued`, `blocking`).
pub fn submit_mode() -> Submit {
    static MODE: std::sync::OnceLock<Submit> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("NSACTOR_GEMM_SUBMIT").as_deref() {
        Ok("blocking") => Submit::Blocking,
        _ => Submit::Queued,
    })
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

/// The first failure of a queued GEMM: it happened on the server thread, where a panic would
/// only be logged, so the next GEMM of any thread raises it.
static QUEUED_FAILURE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

pub(crate) type Server = <CudaRuntime as cubecl::Runtime>::Server;

thread_local! {
    /// CubeCL's handle of each device's server (the same one the tensors' clients use).
    static SERVERS: RefCell<HashMap<usize, cubecl::device_handle::DeviceHandle<Server>>> =
        RefCell::new(HashMap::new());
}

/// CubeCL's handle of `device`'s server, to queue tasks on its thread.
pub(crate) fn device_server(device: &CudaDevice) -> cubecl::device_handle::DeviceHandle<Server> {
    SERVERS.with(|s| {
        s.borrow_mut()
            .entry(device.index)
            .or_insert_with(|| {
                cubecl::device_handle::DeviceHandle::new(cubecl::device::Device::to_id(device))
            })
            .clone()
    })
}

/// Records the first failure of a task queued on a server thread; the next GEMM raises it.
pub(crate) fn record_queued_failure(e: String) {
    QUEUED_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert(e);
}

/// The cuBLASLt call on prepared operands, enqueued on the stream of the calling thread's
/// CubeCL work (see [`Submit`] for how).
pub fn run(op: &Prepared) -> CudaTensor {
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
    let key = PlanKey {
        device: device.index,
        precision: op.precision,
        out_bf16: op.out_bf16,
        a: op.a,
        b: op.b,
        m: m as u64,
        n: n as u64,
        c_ld: op.add.as_ref().map(|c| dims(c).1[0].max(n) as u64),
    };
    // The addend's buffer, or the output's where there is none (then unused).
    let addend = op.add.as_ref().unwrap_or(&out);
    let resource = |h: &cubecl::server::Handle| {
        client
            .get_resource(h.clone())
            .unwrap_or_else(|e| panic!("gemm: device buffer unavailable: {e:?}"))
    };
    // Looked up once per thread and device (the only blocking round trip of queued GEMMs).
    let workspace_ptr = WORKSPACES.with(|w| {
        w.borrow_mut()
            .entry(device.index)
            .or_insert_with(|| {
                let h = client.empty(WORKSPACE_BYTES);
                let ptr = resource(&h).resource().ptr;
                (h, ptr)
            })
            .1
    });
    if submit_mode() == Submit::Blocking {
        let (ra, rb, rc, rd) = (
            resource(&op.rhs.handle),
            resource(&op.lhs.handle),
            resource(&addend.handle),
            resource(&out.handle),
        );
        let (ra, rb, rc, rd) = (ra.resource(), rb.resource(), rc.resource(), rd.resource());
        enqueue(
            &key,
            [ra.ptr, rb.ptr, rc.ptr, rd.ptr],
            workspace_ptr,
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
    ];
    let server = device_server(&device);
    server.submit(move |server: &mut Server| {
        use cubecl::server::ComputeServer;
        // The task runs under the submitting thread's stream id.
        let stream_id = cubecl::stream_id::StreamId::current();
        let started = std::time::Instant::now();
        let task = || -> Result<(), String> {
            // Held until the GEMM is enqueued, like the blocking path's resources.
            let held = bindings
                .into_iter()
                .map(|b| server.get_resource(b, stream_id))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("gemm: device buffer unavailable: {e:?}"))?;
            let [a, b, c, d] = [0, 1, 2, 3].map(|i| held[i].resource());
            let lt = std::time::Instant::now();
            let r = enqueue(&key, [a.ptr, b.ptr, c.ptr, d.ptr], workspace_ptr, d.stream);
            QUEUED_LT_NS.fetch_add(lt.elapsed().as_nanos() as u64, Ordering::Relaxed);
            r
        };
        // A panic (a plan cuBLASLt refuses) is recorded too, not only logged by the server.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)).unwrap_or_else(|p| {
            Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into()))
        });
        QUEUED_TASKS.fetch_add(1, Ordering::Relaxed);
        QUEUED_TASK_NS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // A GEMM that failed while its stream was captured only fails the capture.
        if let Err(e) = r
            && !server.nsactor_capture_taint(stream_id, &e)
        {
            record_queued_failure(e);
        }
    });
    out
}

/// Enqueues `D = A · B (+ C)` of `key` on `stream` (pointers `[A, B, C, D]`; `C` unused where
/// the key adds none), with this thread's cuBLASLt handle and plan cache.
fn enqueue(
    key: &PlanKey,
    [a, b, c, d]: [u64; 4],
    workspace_ptr: u64,
    stream: cudarc::driver::sys::CUstream,
) -> Result<(), String> {
    if stream.is_null() {
        return Err("gemm: the patched cubecl-cuda reports no stream".into());
    }
    crate::cuda_device::make_current(key.device);
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let state = state.get_or_insert_with(|| ThreadState {
            handle: lt::create_handle().unwrap_or_else(|e| panic!("cuBLASLt handle: {e:?}")),
            plans: HashMap::new(),
        });
        let handle = state.handle;
        let plan = state
            .plans
            .entry(*key)
            .or_insert_with(|| Plan::new(handle, key));
        let ptrs = [a, b, c, d];
        // SAFETY (both calls): the pointers are live device buffers of the sizes the layouts
        // describe (the caller holds their resources or bindings until after the call, and
        // their memory is recycled only in order on `stream`); `stream` is CubeCL's stream of
        // the submitting thread on the device whose context is current.
        if !plan.tuned {
            if tuning() && key.tuned() && plan.candidates.len() > 1 {
                unsafe { plan.tune(handle, ptrs, workspace_ptr, stream) }?;
            }
            plan.tuned = true;
        }
        let algo = plan.algo;
        // Timed (`bench train`'s breakdown) with events on the GEMM's own stream.
        let span = crate::cuda_timing::on().then(crate::cuda_timing::next_id);
        if let Some(id) = span {
            crate::cuda_timing::begin_on(key.device, id, crate::cuda_timing::Kind::Gemm, stream);
        }
        let r = unsafe { plan.matmul(handle, &algo, ptrs, workspace_ptr, stream) }
            .map_err(|e| format!("cuBLASLt matmul {key:?}: {e:?}"));
        if let Some(id) = span {
            crate::cuda_timing::end_on(key.device, id, stream);
        }
        r
    })
}

/// The projection GEMMs of one 0.9B layer (`y = x · Wᵀ`, weight `[out, in]`), by name, `in`
/// and `out` features.
const PROJECTIONS: [(&str, usize, usize); 5] = [
    ("block in (W_in, W_β, W_α, W_th)", 896, 7168),
    ("block out (W_out)", 7168, 896),
    ("block gate/skip", 896, 896),
    ("ffn gate+up", 896, 5376),
    ("ffn down", 2688, 896),
];

/// Options of the GEMM benchmark (`gemm_rows`, `gemm_reps`, `gemm_precision` in
/// `nsactor bench kernels --options`).
#[derive(Debug, Clone)]
pub struct GemmBench {
    /// Rows of the activations: `T·K·B` (0.9B: 511·16·4 = 32704).
    pub rows: usize,
    pub reps: usize,
    pub precisions: Vec<GemmPrecision>,
}

impl GemmBench {
    pub fn model_0_9b() -> Self {
        GemmBench {
            rows: 32704,
            reps: 10,
            precisions: vec![GemmPrecision::Bf16, GemmPrecision::Fp32],
        }
    }

    /// `rows=`, `reps=`, `precision=bf16|fp32|both` (the `gemm_` prefix already stripped).
    pub fn with_options(mut self, options: &str) -> Result<Self, String> {
        for kv in crate::bench::option_items(options) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("option `gemm_{kv}` is not key=value"))?;
            let num = || -> Result<usize, String> {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("option gemm_{k}: `{v}` is not a positive whole number"))
            };
            match k {
                "rows" => self.rows = num()?,
                "reps" => self.reps = num()?,
                "precision" => {
                    self.precisions = match v {
                        "both" => vec![GemmPrecision::Bf16, GemmPrecision::Fp32],
                        p => vec![GemmPrecision::parse(p)?],
                    }
                }
                other => {
                    return Err(format!(
                        "unknown option `gemm_{other}` (gemm_rows, gemm_reps, gemm_precision)"
                    ));
                }
            }
        }
        Ok(self)
    }
}

/// Largest accepted `max|gemm − naive fp32| / max|naive fp32|`: fp32 differs only in summation
/// order; bf16 rounds each input to 8 mantissa bits (relative 2⁻⁹ per input).
fn tolerance(p: GemmPrecision) -> f32 {
    match p {
        GemmPrecision::Fp32 => 1e-5,
        GemmPrecision::Bf16 => 2e-2,
    }
}

/// Checks each projection GEMM of the 0.9B layer (forward `x·Wᵀ`, `∂x = g·W`, `∂W = xᵀ·g`, in
/// the layouts autodiff hands them over) against cubek's naive fp32 kernel on the device, then
/// times the ones that agree. A GEMM that disagrees is reported and not timed.
pub fn bench(device: &CudaDevice, cfg: &GemmBench) -> Result<String, String> {
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use std::fmt::Write;
    type B = burn_cuda::Cuda<f32, i32>;
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let wrap = |t: CudaTensor| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let sync = || <B as burn::tensor::backend::Backend>::sync(device).expect("device sync");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<9} {:>4} {:>22} {:>11} {:>10} {:>9} {:>10}",
        "GEMM (0.9B layer, M = rows)",
        "product",
        "prec",
        "M×K×N",
        "max rel err",
        "time (ms)",
        "TFLOP/s",
        "GEMM only"
    );
    let mut failed = Vec::new();
    let m = cfg.rows;
    for (name, inf, outf) in PROJECTIONS {
        let x = Tensor::<B, 2>::random([m, inf], Distribution::Normal(0.0, 1.0), device);
        let w = Tensor::<B, 2>::random([outf, inf], Distribution::Normal(0.0, 1.0), device)
            .div_scalar((inf as f32).sqrt());
        let g = Tensor::<B, 2>::random([m, outf], Distribution::Normal(0.0, 1.0), device);
        // (label, lhs, rhs, M, K, N) in the layouts the model and its backward use.
        let products = [
            ("x·Wᵀ", x.clone(), w.clone().transpose(), m, inf, outf),
            ("∂x=g·W", g.clone(), w.clone(), m, outf, inf),
            ("∂W=xᵀ·g", x.clone().transpose(), g.clone(), inf, m, outf),
        ];
        for (label, lhs, rhs, pm, pk, pn) in products {
            let want = wrap(crate::cuda::matmul_naive(prim(&lhs), prim(&rhs)));
            let scale = want.clone().abs().max().into_scalar();
            for &p in &cfg.precisions {
                let got = wrap(gemm_with(p, prim(&lhs), prim(&rhs)));
                let err = (got - want.clone()).abs().max().into_scalar() / scale.max(1e-30);
                let dims = format!("{pm}×{pk}×{pn}");
                if err.is_nan() || err > tolerance(p) {
                    let _ = writeln!(
                        out,
                        "{name:<32} {label:<9} {:>4} {dims:>22} {err:>11.2e}  WRONG: differs from the naive fp32 GEMM; not timed",
                        p.name()
                    );
                    failed.push(format!("{name} {label} {}", p.name()));
                    continue;
                }
                let time = |f: &dyn Fn()| {
                    f();
                    sync();
                    let t = std::time::Instant::now();
                    for _ in 0..cfg.reps {
                        f();
                    }
                    sync();
                    t.elapsed().as_secs_f64() / cfg.reps as f64
                };
                let s = time(&|| {
                    let _ = gemm_with(p, prim(&lhs), prim(&rhs));
                });
                let ready = prepare_operands(p, prim(&lhs), prim(&rhs));
                let s_gemm = time(&|| {
                    let _ = run(&ready);
                });
                drop(ready);
                let flops = 2.0 * pm as f64 * pk as f64 * pn as f64;
                let _ = writeln!(
                    out,
                    "{name:<32} {label:<9} {:>4} {dims:>22} {err:>11.2e} {:>10.3} {:>9.1} {:>10.1}",
                    p.name(),
                    s * 1e3,
                    flops / s / 1e12,
                    flops / s_gemm / 1e12
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "(time and TFLOP/s include rounding both f32 operands to bf16; `GEMM only` times the cuBLASLt call on operands already in its input type; fp32 never uses TF32)"
    );

    if failed.is_empty() {
        Ok(out)
    } else {
        Err(format!("{out}wrong GEMMs: {}", failed.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_and_transposed_views_map_to_column_major_operands() {
        // Contiguous [3, 5]: column-major 5 × 3, ld 5, not transposed.
        let o = operand([3, 5], [5, 1]).unwrap();
        assert_eq!((o.rows, o.cols, o.ld, o.trans), (5, 3, 5, false));
        // Transpose view of a contiguous [5, 3] → logical [3, 5] with strides [1, 3].
        let o = operand([3, 5], [1, 3]).unwrap();
        assert_eq!((o.rows, o.cols, o.ld, o.trans), (3, 5, 3, true));
        // Column slice of a [3, 8] row-major matrix: ld stays 8.
        let o = operand([3, 5], [8, 1]).unwrap();
        assert_eq!((o.rows, o.cols, o.ld, o.trans), (5, 3, 8, false));
        // A single row broadcast or any other stride pattern is refused (made contiguous).
        assert!(operand([3, 5], [10, 2]).is_none());
        assert!(operand([3, 5], [1, 1]).is_none());
    }

    /// The key of `lhs [m, k] · rhs [k, n]` with `rhs` a transposed weight view (`x·Wᵀ`).
    fn projection_key(m: usize, k: usize, n: usize) -> PlanKey {
        PlanKey {
            device: 0,
            precision: GemmPrecision::Bf16,
            out_bf16: false,
            a: operand([k, n], [1, k]).unwrap(),
            b: operand([m, k], [k, 1]).unwrap(),
            m: m as u64,
            n: n as u64,
            c_ld: None,
        }
    }

    #[test]
    fn training_projections_are_tuned_and_decoding_steps_are_not() {
        // The inner dimension is read from either layout of A = rhsᵀ.
        assert_eq!(projection_key(32704, 896, 7168).macs(), 32704 * 896 * 7168);
        let contiguous_rhs = PlanKey {
            a: operand([896, 7168], [7168, 1]).unwrap(),
            ..projection_key(16, 896, 7168)
        };
        assert_eq!(contiguous_rhs.macs(), 16 * 896 * 7168);
        // Every product of a training micro-batch (T·K·B = 32,704 rows) is tuned, the
        // smallest (D × D) too; no decoding step is, however many sessions.
        for (k, n) in [
            (896, 7168),
            (7168, 896),
            (896, 896),
            (896, 5376),
            (2688, 896),
        ] {
            assert!(projection_key(32704, k, n).tuned(), "x·Wᵀ {k}×{n}");
            // ∂W = xᵀ·g: the token axis is K.
            assert!(projection_key(k, 32704, n).tuned(), "∂W {k}×{n}");
        }
        // Decoding: up to 4,096 rows, through the widest merged projection (4·DN + 2·D).
        for rows in [16, 256, 1024, 4096] {
            assert!(
                !projection_key(rows, 896, 4 * 7168 + 2 * 896).tuned(),
                "{rows} rows"
            );
            assert!(!projection_key(rows, 7168, 896).tuned(), "{rows} rows");
        }
    }

    #[test]
    fn precision_names_round_trip_and_unknown_names_are_errors() {
        for p in [GemmPrecision::Fp32, GemmPrecision::Bf16] {
            assert_eq!(GemmPrecision::parse(p.name()), Ok(p));
        }
        assert!(GemmPrecision::parse("fp16").unwrap_err().contains("fp16"));
    }
}
