//! cuBLASLt's vocabulary, shared by the plans ([`crate::cuda::gemm_plan`]) and the
//! batch-invariant picks ([`crate::cuda::gemm_invariant`]): how it sees a row-major operand
//! ([`Operand`]), the key of one problem ([`PlanKey`]), the heuristic's candidates, whether an
//! algorithm runs a problem, and the timing of a candidate on a stream.

use crate::cuda::precision::GemmPrecision;
use cudarc::cublaslt::{result as lt, sys};
use std::ffi::c_void;

/// cuBLASLt workspace the heuristic may ask for (NVIDIA's recommendation for Hopper).
pub(crate) const HEURISTIC_WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt workspace per thread and device: the heuristic's, or twice it where split-K
/// variants of the decoding GEMMs are offered (`NSACTOR_GEMM_SPLITS`: a split's f32 partial
/// sums of 4,096 rows × 896 columns take 14.7 MB each).
pub(crate) fn workspace_bytes() -> usize {
    if crate::tuning::current().gemm_splits >= 2 {
        2 * HEURISTIC_WORKSPACE_BYTES
    } else {
        HEURISTIC_WORKSPACE_BYTES
    }
}

/// How cuBLASLt sees one operand: a column-major matrix `rows × cols` with leading dimension
/// `ld`, to be used transposed or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Operand {
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) ld: i64,
    pub(crate) trans: bool,
}

impl Operand {
    /// Elements its storage spans (`ld` per column).
    pub(crate) fn elements(&self) -> usize {
        (self.ld.max(0) as u64 * self.cols) as usize
    }
}

/// A row-major `[r, c]` logical matrix with strides `(s0, s1)`, seen column-major so that the
/// op applied gives its transpose `[c, r]` (what `Dᵀ = rhsᵀ·lhsᵀ` needs). `None` when neither
/// stride is 1 (the caller makes it contiguous).
pub(crate) fn operand(shape: [usize; 2], strides: [usize; 2]) -> Option<Operand> {
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

/// Where a plan's setup may run GEMMs of its own (the batch-invariant kernel's timing).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Queue {
    /// A live stream of the current context.
    pub(crate) stream: cudarc::driver::sys::CUstream,
    /// A live buffer of [`workspace_bytes`], used in order on `stream`.
    pub(crate) workspace_ptr: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub(crate) device: usize,
    pub(crate) precision: GemmPrecision,
    /// `D` in bf16 (else f32); never with an addend.
    pub(crate) out_bf16: bool,
    pub(crate) a: Operand,
    pub(crate) b: Operand,
    pub(crate) m: u64,
    pub(crate) n: u64,
    /// The leading dimension of an added `C` (`D = A·B + C`, `C` row-major `[M, N]` with
    /// unit column stride), or `None` for `D = A·B`.
    pub(crate) c_ld: Option<u64>,
    /// What the GEMM belongs to: a decoding pass's GEMMs get batch-invariant kernels.
    pub(crate) rows: crate::options::GemmRows,
}

impl PlanKey {
    /// `K`: `A = rhsᵀ` is `[N, K]` after its op.
    pub(crate) fn k(&self) -> u64 {
        if self.a.trans {
            self.a.rows
        } else {
            self.a.cols
        }
    }

    /// The inputs' element type.
    pub(crate) fn input_type(&self) -> sys::cudaDataType_t {
        match self.precision {
            GemmPrecision::Fp32 => sys::cudaDataType_t::CUDA_R_32F,
            GemmPrecision::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// Bytes per input element.
    pub(crate) fn input_bytes(&self) -> usize {
        match self.precision {
            GemmPrecision::Fp32 => 4,
            GemmPrecision::Bf16 => 2,
        }
    }

    /// `D`'s element type.
    pub(crate) fn output_type(&self) -> sys::cudaDataType_t {
        if self.out_bf16 {
            sys::cudaDataType_t::CUDA_R_16BF
        } else {
            sys::cudaDataType_t::CUDA_R_32F
        }
    }

    /// Bytes per `D` element.
    pub(crate) fn output_bytes(&self) -> usize {
        if self.out_bf16 { 2 } else { 4 }
    }

    /// This problem as problems of at most `limit` rows of `M`, one after another, each with
    /// its pointers `[A, B, C, D]` moved to its first row (`ptrs` are the whole problem's; `C`
    /// is `D`'s where the key adds none, and moves with it). A decoding pass longer than its
    /// batch-invariant reference runs so ([`crate::cuda::gemm_invariant`]): every piece is a
    /// problem its kernel was checked at, so a row's result is the same in a prompt's long
    /// pass as in a one-token step.
    pub(crate) fn pieces(
        &self,
        limit: u64,
        ptrs: [u64; 4],
    ) -> impl Iterator<Item = (PlanKey, [u64; 4])> + use<> {
        let (whole, limit) = (*self, limit.max(1));
        let [a, b, c, d] = ptrs;
        (0..whole.m.div_ceil(limit)).map(move |i| {
            let start = i * limit;
            let rows = limit.min(whole.m - start);
            // `B` is `lhsᵀ`: a row of `lhs` is a column of `B` (ld apart), or, used transposed,
            // a row of it (one element apart).
            let (operand, b_step) = if whole.b.trans {
                (Operand { rows, ..whole.b }, 1)
            } else {
                (
                    Operand {
                        cols: rows,
                        ..whole.b
                    },
                    whole.b.ld.max(0) as u64,
                )
            };
            let b_off = start * b_step * whole.input_bytes() as u64;
            let d_off = start * whole.n * whole.output_bytes() as u64;
            // An addend is f32 with rows `c_ld` apart.
            let c_off = whole.c_ld.map_or(d_off, |ld| start * ld * 4);
            let key = PlanKey {
                m: rows,
                b: operand,
                ..whole
            };
            (key, [a, b + b_off, c + c_off, d + d_off])
        })
    }

    /// `M·N·K`.
    fn macs(&self) -> u64 {
        self.m * self.n * self.k()
    }

    /// Whether [`crate::cuda::gemm_plan::Plan::tune`] times this problem's candidates: a large
    /// product over a long token axis (`M` for `x·Wᵀ` and `∂x`, `K` for `∂W`): every projection
    /// of a training micro-batch. A decoding pass's GEMMs are not, however long (a prompt's
    /// pass has up to 16,384 rows): they take their problem's batch-invariant pick, timed once
    /// per problem ([`crate::cuda::gemm_invariant`]), so a new cohort size never waits for
    /// tuning and a row's result does not depend on the pass's length.
    pub(crate) fn tuned(&self) -> bool {
        self.macs() >= TUNE_MIN_MACS && self.m.max(self.k()) >= TUNE_MIN_ROWS
    }
}

/// `key`'s problem at `rows` rows of `M` (`B`'s rows or columns with it), as a plan of that
/// many rows lays it out.
pub(crate) fn reference_key(key: &PlanKey, rows: u64) -> PlanKey {
    let o = key.b;
    let b = if o.trans {
        Operand {
            rows,
            ld: o.ld.max(rows as i64),
            ..o
        }
    } else {
        Operand { cols: rows, ..o }
    };
    PlanKey { m: rows, b, ..*key }
}

/// Whether two algorithms are the same (their words equal).
pub(crate) fn same(x: &sys::cublasLtMatmulAlgo_t, y: &sys::cublasLtMatmulAlgo_t) -> bool {
    x.data == y.data
}

pub(crate) fn check(what: &str, r: Result<(), lt::CublasError>) {
    if let Err(e) = r {
        panic!("cuBLASLt {what}: {e:?}");
    }
}

/// Sets one attribute of a matmul preference to `value` (panics with `what` if refused).
///
/// # Safety
/// `pref` is a live preference and `T` the attribute's type.
pub(crate) unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
    what: &str,
) {
    // SAFETY: upheld by the caller; `value` outlives the call and has the size passed.
    check(what, unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of_val(value),
        )
    });
}

/// Milliseconds per call of `call`, which enqueues one GEMM on `stream`: one untimed call first
/// (cuBLASLt's first use of a kernel loads it), then `reps` between two events. `None` where a
/// call fails (a candidate that does not run).
///
/// # Safety
/// `stream` is a live stream of the current context, not being captured.
pub(crate) unsafe fn time_calls(
    stream: cudarc::driver::sys::CUstream,
    reps: usize,
    mut call: impl FnMut() -> Result<(), lt::CublasError>,
) -> Result<Option<f32>, cudarc::driver::DriverError> {
    use cudarc::driver::result::event;
    let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let (start, end) = (event::create(flags)?, event::create(flags)?);
    // SAFETY: the events are live until destroyed below; the stream as the caller's.
    let r = (|| unsafe {
        if call().is_err() {
            return Ok(None);
        }
        event::record(start, stream)?;
        for _ in 0..reps {
            if call().is_err() {
                cudarc::driver::result::stream::synchronize(stream)?;
                return Ok(None);
            }
        }
        event::record(end, stream)?;
        event::synchronize(end)?;
        Ok(Some(event::elapsed(start, end)? / reps as f32))
    })();
    // SAFETY: created above, destroyed once; the stream has passed both or was drained.
    unsafe {
        let _ = event::destroy(start);
        let _ = event::destroy(end);
    }
    r
}

/// The heuristic's candidates (best first) for the problem of `[a, b, c, d]`; empty if none.
///
/// # Safety
/// Live handle, descriptor, layouts and preference.
pub(crate) unsafe fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    [a, b, c, d]: [sys::cublasLtMatrixLayout_t; 4],
    pref: sys::cublasLtMatmulPreference_t,
) -> Vec<sys::cublasLtMatmulHeuristicResult_t> {
    // SAFETY: upheld by the caller; `found` has room for the count asked.
    unsafe {
        let mut found =
            vec![std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); TUNE_CANDIDATES];
        let mut count = 0i32;
        let status = sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            a,
            b,
            c,
            d,
            pref,
            TUNE_CANDIDATES as i32,
            found.as_mut_ptr(),
            &mut count,
        );
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || count <= 0 {
            return Vec::new();
        }
        found.truncate(count as usize);
        found
    }
}

/// Whether `algo` runs the problem of `[a, b, c, d]`.
///
/// # Safety
/// Live handle, descriptor and layouts.
pub(crate) unsafe fn algo_fits(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    [a, b, c, d]: [sys::cublasLtMatrixLayout_t; 4],
    algo: &sys::cublasLtMatmulAlgo_t,
) -> bool {
    // SAFETY: upheld by the caller; `result` is written by the call.
    unsafe {
        let mut result = std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>();
        sys::cublasLtMatmulAlgoCheck(handle, desc, a, b, c, d, algo, &mut result)
            == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.workspaceSize <= workspace_bytes()
    }
}

/// How many of cuBLASLt's heuristic candidates [`heuristic`] returns ([`crate::cuda::gemm_plan`]
/// times that many for a training projection).
pub(crate) const TUNE_CANDIDATES: usize = 16;

/// Problems of at least this many multiply-adds may be tuned (a training projection is
/// 2.6·10¹⁰ or more): below it the tuning would cost more than it could save.
const TUNE_MIN_MACS: u64 = 1 << 32;

/// ... and only over a token axis at least this long (a training micro-batch's `T·K·B` is
/// 32,704 at the 0.9B shape; a decoding step has at most 4,096 rows).
const TUNE_MIN_ROWS: u64 = 8192;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::GemmRows;

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
            rows: GemmRows::Other,
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
    fn a_long_problem_runs_as_pieces_of_the_reference_rows() {
        let ptrs = [1 << 40, 2 << 40, 3 << 40, 3 << 40];
        // Row-major lhs [10,000, 896] in bf16, f32 output [10,000, 7168]: three pieces.
        let key = projection_key(10_000, 896, 7168);
        let p: Vec<_> = key.pieces(4096, ptrs).collect();
        assert_eq!(
            p.iter().map(|(k, _)| k.m).collect::<Vec<_>>(),
            [4096, 4096, 1808]
        );
        for (i, (k, [a, b, c, d])) in p.iter().enumerate() {
            let start = 4096 * i as u64;
            assert_eq!((k.b.cols, k.b.rows, k.b.ld), (k.m, 896, 896));
            assert_eq!((k.a, k.n, k.c_ld), (key.a, key.n, None));
            assert_eq!(*a, ptrs[0], "the weight does not move");
            assert_eq!(*b, ptrs[1] + start * 896 * 2);
            assert_eq!(*d, ptrs[3] + start * 7168 * 4);
            assert_eq!(c, d, "without an addend C is D");
        }
        // lhs used transposed (column-major, ld 12,000), a bf16 output and an f32 addend
        // whose rows are 8,000 apart.
        let key = PlanKey {
            b: operand([10_000, 896], [1, 12_000]).unwrap(),
            out_bf16: true,
            c_ld: Some(8000),
            ..projection_key(10_000, 896, 7168)
        };
        let p: Vec<_> = key.pieces(4096, ptrs).collect();
        let (k, [_, b, c, d]) = p[2];
        assert_eq!(
            (k.b.rows, k.b.cols, k.b.ld, k.b.trans),
            (1808, 896, 12_000, true)
        );
        assert_eq!(b, ptrs[1] + 8192 * 2);
        assert_eq!(c, ptrs[2] + 8192 * 8000 * 4);
        assert_eq!(d, ptrs[3] + 8192 * 7168 * 2);
        // A problem within the limit is itself.
        let key = projection_key(4096, 896, 7168);
        assert_eq!(
            key.pieces(4096, ptrs).collect::<Vec<_>>(),
            vec![(key, ptrs)]
        );
    }
}
