//! The cached plan of one cuBLASLt problem ([`PlanKey`] → [`Plan`]: descriptors, layouts and
//! the chosen algorithm), the call itself, and the tuning of a training projection's algorithm
//! on its first call; a decoding pass's GEMM takes its batch-invariant pick instead.

use crate::KernelError;
use crate::cuda::gemm_invariant;
use crate::cuda::gemm_lt::{
    HEURISTIC_WORKSPACE_BYTES, Operand, PlanKey, Queue, algo_fits, check, heuristic, set_pref,
    time_calls, workspace_bytes,
};
use crate::cuda::gemm_store;
use cudarc::cublaslt::{result as lt, sys};
use std::ffi::c_void;

/// Descriptors and the chosen algorithm for one problem; destroyed with the thread.
pub(crate) struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    /// `C`'s layout where the key adds one.
    c: Option<sys::cublasLtMatrixLayout_t>,
    pub(crate) algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's candidates, best guess first; for a decoding pass's GEMM, its
    /// batch-invariant pick alone.
    pub(crate) candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Whether [`Plan::tune`] has run (or was not wanted).
    pub(crate) tuned: bool,
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

impl Plan {
    /// The plan of `key`'s problem. A decoding pass's GEMM takes its problem's batch-invariant
    /// kernel ([`gemm_invariant::pick`], which may time candidates on `queue`); any other
    /// takes cuBLASLt's heuristic candidates.
    ///
    /// # Safety
    /// `queue` as [`Queue`] says.
    pub(crate) unsafe fn new(handle: sys::cublasLtHandle_t, key: &PlanKey, queue: Queue) -> Plan {
        let input = key.input_type();
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
        let d = lt::create_matrix_layout(key.output_type(), key.n, key.m, key.n as i64)
            .unwrap_or_else(|e| panic!("cuBLASLt output layout: {e:?}"));
        let c = key.c_ld.map(|ld| {
            lt::create_matrix_layout(f32t, key.n, key.m, ld as i64)
                .unwrap_or_else(|e| panic!("cuBLASLt addend layout: {e:?}"))
        });
        let pref =
            lt::create_matmul_pref().unwrap_or_else(|e| panic!("cuBLASLt preference: {e:?}"));
        let ws = HEURISTIC_WORKSPACE_BYTES as u64;
        let reference = gemm_invariant::invariant_rows(key);
        let layouts = [a, b, c.unwrap_or(d), d];
        // SAFETY: live handles and descriptors; the preference values outlive the calls; the
        // stream and workspace as the caller's.
        let candidates = unsafe {
            set_pref(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws,
                "workspace preference",
            );
            let found = match reference {
                Some(rows) => {
                    // No in-place split-K reduction (atomic adds, in whatever order they land):
                    // a row's dot products are then summed in one order whatever the cohort.
                    let none =
                        sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                            as u32
                            | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE
                                as u32;
                    set_pref(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                        &none,
                        "reduction-scheme preference",
                    );
                    let pick = gemm_invariant::pick(handle, desc, a, pref, key, rows, queue);
                    match pick.filter(|algo| algo_fits(handle, desc, layouts, algo)) {
                        Some(algo) => vec![algo],
                        None => {
                            eprintln!(
                                "warning: no batch-invariant GEMM kernel fits {key:?}; its results may vary with the cohort"
                            );
                            heuristic(handle, desc, layouts, pref)
                                .into_iter()
                                .map(|h| h.algo)
                                .collect()
                        }
                    }
                }
                None => heuristic(handle, desc, layouts, pref)
                    .into_iter()
                    .map(|h| h.algo)
                    .collect(),
            };
            let _ = lt::destroy_matmul_pref(pref);
            if found.is_empty() {
                panic!("cuBLASLt has no algorithm for {key:?}");
            }
            found
        };
        Plan {
            desc,
            a,
            b,
            d,
            c,
            algo: candidates[0],
            candidates,
            tuned: false,
        }
    }

    /// Runs `D = A · B` (`+ C` where the plan adds one) with `algo` on `stream`.
    ///
    /// # Safety
    /// As `enqueue` ([`crate::cuda::gemm`]): live buffers of the layouts' sizes, a stream of the
    /// current context.
    pub(crate) unsafe fn matmul(
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
                workspace_bytes(),
                stream as sys::cudaStream_t,
            )
        }
    }

    /// [`tune`](Self::tune) unless the pick store ([`gemm_store`], beside the kernel caches)
    /// holds this problem's pick from an earlier tuning and it is still one of the heuristic's
    /// candidates: a run's first step then skips timing its projections, and a run takes the
    /// same algorithms as the run before it on the host. A new pick is stored.
    ///
    /// # Safety
    /// As [`tune`](Self::tune).
    pub(crate) unsafe fn tune_or_stored(
        &mut self,
        key: &PlanKey,
        handle: sys::cublasLtHandle_t,
        ptrs: [u64; 4],
        workspace_ptr: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), KernelError> {
        let stored_as = gemm_invariant::store_key("train ", key);
        let stored = stored_as
            .as_deref()
            .and_then(gemm_store::lookup)
            .and_then(|words| self.candidates.iter().find(|c| c.data == words).copied());
        if let Some(algo) = stored {
            self.algo = algo;
            self.tuned = true;
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { self.tune(handle, ptrs, workspace_ptr, stream) }?;
        if let Some(k) = &stored_as {
            gemm_store::record(k, self.algo.data);
        }
        Ok(())
    }

    /// Times each of the heuristic's candidates on the real operands (`D` is overwritten, and
    /// written again by the caller's call with the pick) and keeps the fastest: what PyTorch's
    /// TunableOp does for its GEMMs. Blocks the calling thread (CubeCL's server thread for
    /// queued GEMMs) once per problem, for a few times the GEMM's duration per candidate.
    ///
    /// # Safety
    /// As [`matmul`](Self::matmul).
    pub(crate) unsafe fn tune(
        &mut self,
        handle: sys::cublasLtHandle_t,
        ptrs: [u64; 4],
        workspace_ptr: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), KernelError> {
        self.tuned = true;
        let mut times = Vec::new();
        for (i, algo) in self.candidates.iter().enumerate() {
            // SAFETY: the matmuls as the caller's, on `stream`.
            let t = unsafe {
                time_calls(stream, TUNE_REPS, || {
                    self.matmul(handle, algo, ptrs, workspace_ptr, stream)
                })
            }
            .map_err(|e| KernelError::device("gemm tuning", e))?;
            if let Some(t) = t {
                times.push((i, t));
            }
        }
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

/// Timed calls per candidate.
const TUNE_REPS: usize = 5;

/// How much faster than the heuristic's first pick a candidate must be to replace it.
const TUNE_MARGIN: f32 = 0.02;

/// Whether GEMMs are tuned ([`Plan::tune`]): the `gemm_tune` knob (`NSACTOR_GEMM_TUNE`; on by
/// default; `off`: the heuristic's first pick everywhere, as before).
pub fn tuning() -> bool {
    crate::tuning::current().gemm_tune
}
