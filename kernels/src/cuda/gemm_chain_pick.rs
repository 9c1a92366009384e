//! Which decoding GEMMs run the one-chain MMA kernel ([`crate::cuda::gemm_chain`]) instead of
//! cuBLASLt's: a batch-invariant GEMM over frames of at most `gemm_chain_rows` rows
//! (`NSACTOR_GEMM_CHAIN_ROWS`, 0 = never), bf16 operands laid out as the kernel reads them, an
//! f32 output without an addend, and a problem on which the kernel was seen to give cuBLASLt's
//! bits.
//!
//! **The bits are checked, per problem and device.** The first time a problem (device, `K`,
//! `N`, weight layout) comes here, its cuBLASLt kernels (the batch-invariant class chosen for
//! it, `gemm_invariant`: one member per size tier) and the chain kernel both run on pseudo-random
//! activations at each tier up to `gemm_chain_rows` rows against the problem's real weight, and
//! the outputs are read back: the chain kernel is taken for the problem only if every value's
//! bits agree (a failure to build or run it counts as a disagreement). A class that sums `K` in another
//! order (a split-K class) differs in some of those values almost surely, so a session's bits
//! stay those of the class at every cohort size. A problem first seen while its thread records
//! a graph is not checked (nothing can be read back there): it keeps cuBLASLt's kernel until a
//! later call outside a capture checks it (the decoding graphs are captured only after the
//! same work ran once uncaptured, so `serve` checks every problem during its warm-up).

use crate::cuda::gemm_chain::{WeightLayout, chain_gemm};
use crate::cuda::gemm_invariant::{INVARIANT_ROWS, probe_rows};
use crate::cuda::gemm_probe::random_bytes;
use crate::cuda::precision::GemmPrecision;
use crate::options::GemmRows;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Mutex;

type CudaTensor = CubeTensor<CudaRuntime>;

/// A GEMM as [`try_chain`] sees it (from `gemm`'s prepared operands), with a way to run the
/// same product through cuBLASLt on other activations.
pub(crate) struct Candidate<'a> {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) precision: GemmPrecision,
    /// An f32 output and no addend.
    pub(crate) plain: bool,
    /// The activations and the weight, in the GEMM's input type.
    pub(crate) lhs: &'a CudaTensor,
    pub(crate) rhs: &'a CudaTensor,
    /// cuBLASLt's product of other activations (`[rows, K]`, bf16, contiguous) with `rhs`.
    pub(crate) cublaslt: &'a dyn Fn(CudaTensor) -> CudaTensor,
}

/// A problem whose verdict is kept: the chain kernel's bits depend on nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Problem {
    device: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
}

/// Each checked problem: whether the chain kernel gave cuBLASLt's bits.
static VERDICTS: Mutex<Option<HashMap<Problem, bool>>> = Mutex::new(None);

thread_local! {
    /// Set while the thread records a graph ([`recording`]): no read-back is possible.
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's GEMMs marked as recorded into a graph (the mark is taken off
/// however `f` ends, a panic included).
pub(crate) fn recording<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            RECORDING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(RECORDING.with(|c| c.replace(true)));
    f()
}

/// The `gemm_chain_rows` knob, 0 or at least one session's 16 rows.
fn chain_rows() -> usize {
    match crate::tuning::current().gemm_chain_rows {
        0 => 0,
        n => n.max(16),
    }
}

/// Whether a buffer starts where the kernel's fragment loads may read it: 32-byte aligned.
fn aligned(t: &CudaTensor) -> bool {
    t.handle.offset_start.unwrap_or(0).is_multiple_of(32)
}

/// How the kernel reads `rhs` (`[K, N]`): as a contiguous `[K, N]`, or as the transposed view
/// of a contiguous `[N, K]`.
fn layout_of(rhs: &CudaTensor) -> Option<WeightLayout> {
    let shape = rhs.meta.shape();
    let strides = rhs.meta.strides();
    let (k, n) = (shape[0], shape[1]);
    if strides[0] == n && strides[1] == 1 {
        Some(WeightLayout::KByN)
    } else if strides[0] == 1 && strides[1] == k {
        Some(WeightLayout::NByK)
    } else {
        None
    }
}

/// The weight as the kernel takes it: `[K, N]` as it is, `[N, K]` by transposing the view back.
fn weight(rhs: &CudaTensor, layout: WeightLayout) -> CudaTensor {
    match layout {
        WeightLayout::KByN => rhs.clone(),
        WeightLayout::NByK => {
            use burn::tensor::ops::FloatTensorOps;
            <burn_cuda::Cuda<f32, i32> as FloatTensorOps<_>>::float_transpose(rhs.clone())
        }
    }
}

/// The chain kernel's product of `op`, where `op` may take it (see the module); `None` sends
/// it to cuBLASLt.
pub(crate) fn try_chain(op: &Candidate, rows: GemmRows) -> Option<CudaTensor> {
    let max = chain_rows();
    let (m, n, k) = (op.m, op.n, op.k);
    let fits = max > 0
        && m <= max
        && rows == GemmRows::DecodeFrames
        && crate::cuda::gemm_invariant::batch_invariant()
        && op.precision == GemmPrecision::Bf16
        && op.plain
        && [m, n, k].iter().all(|d| d.is_multiple_of(16))
        && op.lhs.dtype == DType::BF16
        && op.rhs.dtype == DType::BF16
        && op.lhs.is_contiguous()
        && aligned(op.lhs)
        && aligned(op.rhs);
    if !fits {
        return None;
    }
    let layout = layout_of(op.rhs)?;
    let problem = Problem {
        device: op.lhs.device.index,
        k,
        n,
        layout,
    };
    if !checked(problem, op, max)? {
        return None;
    }
    Some(chain_gemm(op.lhs.clone(), weight(op.rhs, layout), layout))
}

/// The problem's verdict, checked now where it has none (`None`: not checkable here).
fn checked(problem: Problem, op: &Candidate, rows: usize) -> Option<bool> {
    let known = VERDICTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .and_then(|v| v.get(&problem).copied());
    if let Some(v) = known {
        return Some(v);
    }
    if RECORDING.with(Cell::get) || cubecl::cuda::nsactor_compile_only::active() {
        return None;
    }
    // A kernel that cannot be built or run here (a device without bf16 MMA) is a "no".
    let same = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        same_bits(op, problem.layout, rows)
    }))
    .unwrap_or(false);
    eprintln!(
        "nsactor: one-chain MMA kernel for the decoding GEMM K = {} × N = {} ({:?}) on cuda:{}: {}",
        problem.k,
        problem.n,
        problem.layout,
        problem.device,
        if same {
            "the same bits as its cuBLASLt class; taken up to the knob's rows"
        } else {
            "other bits than its cuBLASLt class; not taken"
        }
    );
    VERDICTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(problem, same);
    Some(same)
}

/// Whether the chain kernel and cuBLASLt give the same bits against `op`'s weight at each
/// size tier of the batch-invariant kernels up to `rows` (16, 64, 256, … rows, each running its
/// own member of the class) and at `rows`. The activations come from a fixed-seed generator on
/// the host, so a check draws nothing from the backend's seeded random stream.
fn same_bits(op: &Candidate, layout: WeightLayout, rows: usize) -> bool {
    let mut sizes: Vec<usize> = probe_rows(INVARIANT_ROWS)
        .into_iter()
        .map(|r| r as usize)
        .filter(|&r| r < rows)
        .collect();
    sizes.push(rows.next_multiple_of(16));
    sizes.into_iter().all(|r| same_bits_at(op, layout, r))
}

fn same_bits_at(op: &Candidate, layout: WeightLayout, rows: usize) -> bool {
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};
    type B = burn_cuda::Cuda<f32, i32>;
    let k = op.k;
    // bf16 values uniform in [−1, 1) from a fixed seed (the GEMM probes' generator).
    let seed = ((rows as u64) << 32) ^ (k as u64);
    let bytes = random_bytes(rows * k * 2, 2, seed);
    let x = Tensor::<B, 2>::from_data(
        TensorData::from_bytes_vec(bytes, [rows, k], DType::BF16),
        &op.lhs.device,
    )
    .into_primitive()
    .tensor();
    let lt = (op.cublaslt)(x.clone());
    let chain = chain_gemm(x, weight(op.rhs, layout), layout);
    let read = |t: CudaTensor| {
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap_or_default()
    };
    let (a, b) = (read(lt), read(chain));
    !a.is_empty() && a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
}
