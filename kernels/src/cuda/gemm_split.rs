//! Split-K variants of a batch-invariant decoding GEMM's candidates (`NSACTOR_GEMM_SPLITS`).
//!
//! cuBLASLt's heuristic offers split-K kernels only where it thinks they pay, which at a
//! decoding problem means kernels built for one session's rows. The probes of s59 found that a
//! kernel's sums run in the same order whatever its tile unless it splits K, and that the
//! classes of equal bits follow the split count: a kernel built for 4,096 rows that splits K
//! in two gives the bits of any other kernel that splits it in two. So a class with one split
//! count may have a fast member at every size only if kernels built for many rows are also
//! offered with that split. Here every split-1 candidate that supports split-K is offered
//! again at each count asked, its partial sums reduced in f32 by a separate pass (never in
//! place, whose atomic adds land in any order). Whether a variant's bits really are the same
//! at every row count is not assumed: the probes check it like any candidate's.

use cudarc::cublaslt::sys;
use std::ffi::c_void;

type Algo = sys::cublasLtMatmulAlgo_t;

/// The split-K counts tried for a largest count `max`: the powers of two from 2 to `max`.
pub(crate) fn split_counts(max: usize) -> Vec<u32> {
    std::iter::successors(Some(2usize), |s| s.checked_mul(2))
        .take_while(|&s| s <= max)
        .map(|s| s as u32)
        .collect()
}

/// One attribute of `algo` read by `get` (cuBLASLt's configuration or capability getter, with
/// the attribute bound), if it can be read.
fn read<T: Copy + Default>(
    get: impl FnOnce(*mut c_void, usize, *mut usize) -> sys::cublasStatus_t,
) -> Option<T> {
    let mut value = T::default();
    let mut written = 0usize;
    let status = get(
        &mut value as *mut T as *mut c_void,
        std::mem::size_of::<T>(),
        &mut written,
    );
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(value)
}

/// One configuration attribute of `algo`, if it can be read.
pub(crate) fn config<T: Copy + Default>(
    algo: &Algo,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<T> {
    // SAFETY: reads one attribute of a plain algorithm structure into a buffer of its size.
    read(|buf, size, written| unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, buf, size, written)
    })
}

/// One capability attribute of `algo`, if it can be read.
fn capability<T: Copy + Default>(
    algo: &Algo,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Option<T> {
    // SAFETY: as `config`, for a capability attribute.
    read(|buf, size, written| unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, buf, size, written)
    })
}

/// Sets one 32-bit configuration attribute of `algo`; whether cuBLASLt took it.
fn set_config(
    algo: &mut Algo,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
    value: u32,
) -> bool {
    // SAFETY: writes one attribute of a plain algorithm structure from a live `u32`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attr,
            &value as *const u32 as *const c_void,
            std::mem::size_of::<u32>(),
        )
    };
    status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
}

/// The variants of `algos` at each of `counts`: every candidate that does not split K and
/// supports split-K with an f32 (compute-type) reduction, once per count. Whether a variant
/// runs a problem is for the caller to check (`cublasLtMatmulAlgoCheck`).
pub(crate) fn variants(algos: &[Algo], counts: &[u32]) -> Vec<Algo> {
    use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
    use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
    let compute = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    let mut out = Vec::new();
    for algo in algos {
        let unsplit = config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == Some(1);
        let splits =
            capability::<i32>(algo, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT).is_some_and(|s| s != 0);
        let reduces = capability::<u32>(algo, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK)
            .is_some_and(|m| m & compute != 0);
        if !(unsplit && splits && reduces) {
            continue;
        }
        for &count in counts {
            let mut v = *algo;
            if set_config(&mut v, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, count)
                && set_config(
                    &mut v,
                    Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                    compute,
                )
                && !out.iter().any(|o: &Algo| o.data == v.data)
            {
                out.push(v);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::split_counts;

    #[test]
    fn split_counts_are_the_powers_of_two_up_to_the_largest() {
        assert_eq!(split_counts(0), Vec::<u32>::new());
        assert_eq!(split_counts(1), Vec::<u32>::new());
        assert_eq!(split_counts(2), [2]);
        assert_eq!(split_counts(12), [2, 4, 8]);
        assert_eq!(split_counts(64), [2, 4, 8, 16, 32, 64]);
    }
}
