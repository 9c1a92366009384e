//! Batch-invariant decoding GEMMs: one cuBLASLt kernel per decoding problem, the same at every
//! row count a decoding pass can have, so a session's logits do not depend on its cohort.
//!
//! A problem is keyed by its weight, shapes and precision at a reference row count (the largest
//! decoding pass: [`INVARIANT_ROWS`] over frames, [`INVARIANT_TOKEN_ROWS`] over tokens). Its
//! kernel (tile, split-K count, reduction scheme; never an in-place split-K reduction, whose
//! atomic adds land in any order) is chosen once per process and device ([`pick`]) and every
//! plan of that problem uses it, whatever its row count.
//!
//! **How the kernel is chosen.** The candidates are cuBLASLt's heuristic picks at five probe
//! row counts (the passes of 1, 4, 16, 64 and 256 sessions), kept where they run at all five.
//! Each is timed on scratch operands at the five sizes; the one with the smallest sum of the
//! squares of its ratios to the fastest candidate at each size wins (ties: the faster at the
//! reference), so a kernel far off at one size loses to one a little off at several. (The plain
//! sum of ratios kept `W_out`'s one-session split-K kernel: 1.92× the best at 256 sessions for
//! 1.02× at one; on the H200 the squares give 1.35× at one session and 1.23× at 256, 1.2 ms
//! less in a 256-session step for 0.23 ms more in one session's; BENCHMARKS.md.) The
//! heuristic's reference pick alone is built for the largest pass (4,096 frame rows, 256 token
//! rows) and runs a single session's few rows on a handful of multiprocessors; a split-K kernel
//! built for one session's rows is as slow the other way. `NSACTOR_BATCH_INVARIANT=first` keeps
//! the reference pick; `NSACTOR_GEMM_TRACE=1` prints every candidate's times. A timed pick is
//! kept with the kernel caches ([`gemm_store`]): a restart, or a process started later on the
//! host, takes it instead of timing again, so a request gets the same logits after a restart.
//!
//! A problem whose pass is larger than the reference (a prompt's pass of up to 16,384 frame rows)
//! runs in pieces of the reference's rows with the same pick ([`invariant_rows`]). Until s47
//! such a pass of 8,192 rows or more was tuned like a training projection instead, and a
//! prompt's logits depended on how its passes were cut (issue 60). Timing needs the thread's stream free of a graph capture: a problem first
//! seen while its stream is captured takes its stored pick, else the reference pick, untimed
//! (the decoding graphs are captured only after the same work ran once uncaptured, so this does
//! not happen in `serve`).

use crate::cuda::gemm_lt::{Operand, PlanKey, Queue, WORKSPACE_BYTES, algo_fits, heuristic};
use crate::cuda::gemm_store;
use crate::options::GemmRows;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::result as drv;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// The row count whose kernel a decoding pass's GEMM over frames uses at every row count up
/// to it: the largest decoding pass, 256 sessions × K = 16 frames ([`GemmRows::DecodeFrames`]).
pub(crate) const INVARIANT_ROWS: u64 = 4096;

/// The same for a decoding pass's GEMMs over tokens ([`GemmRows::DecodeTokens`]): at most
/// 4,096 / K = 256 rows.
pub(crate) const INVARIANT_TOKEN_ROWS: u64 = 256;

/// How a decoding pass's GEMMs choose their kernel (`NSACTOR_BATCH_INVARIANT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Invariance {
    /// One kernel per problem at every row count, chosen by timing (the default).
    Timed,
    /// One kernel per problem: the heuristic's first pick at the reference row count.
    First,
    /// The heuristic's pick per row count: faster at some sizes, results vary with the cohort.
    Off,
}

/// The `batch_invariant` knob (`NSACTOR_BATCH_INVARIANT`): `on` (the default), `first` or
/// `off`.
pub(crate) fn invariance() -> Invariance {
    use nsactor_plugin_api::tuning::BatchInvariance;
    match crate::tuning::current().batch_invariant {
        BatchInvariance::On => Invariance::Timed,
        BatchInvariance::First => Invariance::First,
        BatchInvariance::Off => Invariance::Off,
    }
}

/// Whether a decoding pass's GEMMs are batch-invariant (`NSACTOR_BATCH_INVARIANT` is not `off`).
pub fn batch_invariant() -> bool {
    invariance() != Invariance::Off
}

/// The reference row count of a GEMM of `rows`, or `None` outside decoding passes.
pub(crate) fn reference_rows(rows: GemmRows) -> Option<u64> {
    match rows {
        GemmRows::DecodeFrames => Some(INVARIANT_ROWS),
        GemmRows::DecodeTokens => Some(INVARIANT_TOKEN_ROWS),
        GemmRows::Other => None,
    }
}

/// The reference row count of `key`'s batch-invariant kernel where its GEMM takes one: a
/// decoding pass's, with `NSACTOR_BATCH_INVARIANT` not `off`. Such a GEMM is never tuned, and
/// one longer than its reference (a prompt's pass of up to 16,384 frame rows) runs in pieces of
/// the reference's rows ([`PlanKey::pieces`]), so its kernel is one checked at every size it
/// runs and a prompt's logits do not depend on how its passes were cut.
pub(crate) fn invariant_rows(key: &PlanKey) -> Option<u64> {
    reference_rows(key.rows).filter(|_| batch_invariant())
}

/// How many row counts a candidate is timed at.
const PROBES: usize = 5;

/// The row counts a candidate is timed at: the reference divided by 256, 64, 16 and 4, and the
/// reference (at K = 16 frames, the passes of 1, 4, 16, 64 and 256 sessions).
fn probe_rows(reference: u64) -> [u64; PROBES] {
    [256, 64, 16, 4, 1].map(|d| (reference / d).max(1))
}

/// `key`'s problem at `rows` rows, as [`layouts`] lays it out.
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

/// The layouts of `B`, `D` (and `C`) of `key`'s problem at `rows` rows (`A`, the weight, does
/// not depend on them); destroyed on drop.
struct Layouts {
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    c: Option<sys::cublasLtMatrixLayout_t>,
}

impl Layouts {
    fn new(key: &PlanKey, rows: u64) -> Layouts {
        let make = |t, r: u64, c: u64, ld: i64| {
            lt::create_matrix_layout(t, r, c, ld)
                .unwrap_or_else(|e| panic!("cuBLASLt reference layout: {e:?}"))
        };
        // The problem at `rows`, as a plan of it would lay out `B`, `D` and `C`.
        let k = reference_key(key, rows);
        let b = make(k.input_type(), k.b.rows, k.b.cols, k.b.ld);
        let d = make(k.output_type(), k.n, k.m, k.n as i64);
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let c = k.c_ld.map(|ld| make(f32t, k.n, k.m, ld as i64));
        Layouts { b, d, c }
    }

    /// `[A, B, C, D]` with `a` the weight's layout.
    fn with_a(&self, a: sys::cublasLtMatrixLayout_t) -> [sys::cublasLtMatrixLayout_t; 4] {
        [a, self.b, self.c.unwrap_or(self.d), self.d]
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        // SAFETY: each layout was created once by `Layouts::new` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            if let Some(c) = self.c {
                let _ = lt::destroy_matrix_layout(c);
            }
        }
    }
}

/// What each device's problems were given, by reference key: one pick per process, so every
/// thread's plans of a problem use the same kernel.
static PICKS: Mutex<Option<HashMap<PlanKey, sys::cublasLtMatmulAlgo_t>>> = Mutex::new(None);

/// The kernel every row count of `key`'s problem uses (see the module's text), chosen on the
/// first call for the problem. `desc` and `a` are the calling plan's descriptor and weight
/// layout (the same for every row count); `pref` has the workspace and reduction limits.
///
/// # Safety
/// Live handle, descriptor, layout and preference; `queue` as [`Queue`] says.
pub(crate) unsafe fn pick(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    pref: sys::cublasLtMatmulPreference_t,
    key: &PlanKey,
    reference: u64,
    queue: Queue,
) -> Option<sys::cublasLtMatmulAlgo_t> {
    let Queue {
        stream,
        workspace_ptr,
    } = queue;
    let rkey = reference_key(key, reference);
    let mut picks = PICKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(algo) = picks.get_or_insert_with(HashMap::new).get(&rkey) {
        return Some(*algo);
    }
    let sizes = probe_rows(reference);
    let started = std::time::Instant::now();
    let layouts = sizes.map(|r| Layouts::new(key, r));
    // SAFETY: upheld by the caller; the layouts are live until dropped at the end.
    let chosen = unsafe {
        let fits = |algo: &sys::cublasLtMatmulAlgo_t| {
            layouts
                .iter()
                .all(|l| algo_fits(handle, desc, l.with_a(a), algo))
        };
        let first = heuristic(handle, desc, layouts[PROBES - 1].with_a(a), pref)
            .into_iter()
            .map(|h| h.algo)
            .find(|algo| fits(algo));
        let stored_as = store_key("", &rkey);
        let stored = stored_as
            .as_deref()
            .and_then(gemm_store::lookup)
            .map(|data| sys::cublasLtMatmulAlgo_t { data })
            .filter(|algo| not_in_place(algo) && fits(algo));
        let capturing = !matches!(
            drv::stream::is_capturing(stream),
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if invariance() == Invariance::First {
            first?
        } else if let Some(algo) = stored {
            algo
        } else if capturing {
            first?
        } else {
            let mut candidates: Vec<sys::cublasLtMatmulAlgo_t> = Vec::new();
            for l in &layouts {
                for h in heuristic(handle, desc, l.with_a(a), pref) {
                    if !candidates.iter().any(|c| same(c, &h.algo)) && fits(&h.algo) {
                        candidates.push(h.algo);
                    }
                }
            }
            let timed = time_candidates(
                handle,
                desc,
                a,
                &layouts,
                key,
                sizes,
                &candidates,
                workspace_ptr,
                stream,
            );
            match timed {
                Ok(times) => {
                    match choose(key, sizes, &candidates, &times, first.as_ref(), started) {
                        Some(algo) => {
                            if let Some(k) = &stored_as {
                                gemm_store::record(k, algo.data);
                            }
                            algo
                        }
                        None => first?,
                    }
                }
                Err(e) => {
                    eprintln!(
                        "nsactor: batch-invariant GEMM {key:?}: timing failed ({e}); taking the heuristic's pick"
                    );
                    first?
                }
            }
        }
    };
    picks.get_or_insert_with(HashMap::new).insert(rkey, chosen);
    Some(chosen)
}

/// The stored picks' key of the problem `rkey`: `kind` (empty for a batch-invariant pick,
/// `train ` for a tuned training projection's), the device's name and cuBLASLt's version (a
/// stored algorithm is valid for that library only), then the problem without the device's
/// ordinal (which may name another GPU in another process). `None` if the device's name
/// cannot be read.
pub(crate) fn store_key(kind: &str, rkey: &PlanKey) -> Option<String> {
    let device = drv::device::get(rkey.device as i32).ok()?;
    let name = drv::device::get_name(device).ok()?;
    // SAFETY: a query of the loaded library's version, no arguments.
    let version = unsafe { sys::cublasLtGetVersion() };
    Some(format!(
        "v1 {kind}{name} cublasLt {version} {:?}",
        PlanKey { device: 0, ..*rkey }
    ))
}

/// Whether `algo` reduces its split-K partial sums other than in place (atomic adds in
/// whatever order they land would make a row's sum depend on timing): checked on stored
/// picks, which come from a file.
fn not_in_place(algo: &sys::cublasLtMatmulAlgo_t) -> bool {
    let mut scheme = 0u32;
    let mut written = 0usize;
    // SAFETY: reads one 32-bit attribute of a plain algorithm structure into `scheme`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
            &mut scheme as *mut u32 as *mut c_void,
            std::mem::size_of_val(&scheme),
            &mut written,
        )
    };
    status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        && scheme != sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32
}

fn same(x: &sys::cublasLtMatmulAlgo_t, y: &sys::cublasLtMatmulAlgo_t) -> bool {
    x.data == y.data
}

/// Microseconds per call of each candidate (rows) at each probe size (columns); `None` where a
/// call failed.
type Times = Vec<[Option<f32>; PROBES]>;

/// Times every candidate at the probe sizes on scratch operands (inputs filled with a small
/// constant; the weight's values do not change a kernel's speed).
///
/// # Safety
/// As [`pick`]; the layouts are `key`'s at `sizes`.
#[allow(clippy::too_many_arguments)]
unsafe fn time_candidates(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    layouts: &[Layouts; PROBES],
    key: &PlanKey,
    sizes: [u64; PROBES],
    candidates: &[sys::cublasLtMatmulAlgo_t],
    workspace_ptr: u64,
    stream: cudarc::driver::sys::CUstream,
) -> Result<Times, String> {
    let rows = sizes[PROBES - 1];
    let input = key.input_bytes();
    let bytes = [
        key.a.elements() * input,
        reference_key(key, rows).b.elements() * input,
        key.c_ld.map_or(0, |ld| (ld * rows) as usize * 4),
        (key.n * rows) as usize * key.output_bytes(),
    ];
    let scratch = Scratch::new(bytes)?;
    let err = |e: cudarc::driver::DriverError| format!("{e:?}");
    let mut times = Vec::with_capacity(candidates.len());
    for algo in candidates {
        let mut row = [None; PROBES];
        for (i, l) in layouts.iter().enumerate() {
            let [la, lb, lc, ld] = l.with_a(a);
            let c = if l.c.is_some() {
                scratch.ptr[2]
            } else {
                scratch.ptr[3]
            };
            let beta = if l.c.is_some() { 1.0f32 } else { 0.0 };
            let call = || {
                // SAFETY: the scratch buffers hold the reference size, the largest probe.
                unsafe {
                    lt::matmul(
                        handle,
                        desc,
                        &1.0f32 as *const f32 as *const c_void,
                        &beta as *const f32 as *const c_void,
                        scratch.ptr[0] as *const c_void,
                        la,
                        scratch.ptr[1] as *const c_void,
                        lb,
                        c as *const c_void,
                        lc,
                        scratch.ptr[3] as *mut c_void,
                        ld,
                        algo,
                        workspace_ptr as *mut c_void,
                        WORKSPACE_BYTES,
                        stream as sys::cudaStream_t,
                    )
                }
            };
            // SAFETY: the stream as the caller's, not captured (checked by `pick`).
            row[i] = unsafe { crate::cuda::gemm_lt::time_calls(stream, PROBE_REPS, call) }
                .map_err(err)?
                .map(|ms| ms * 1000.0);
        }
        times.push(row);
    }
    Ok(times)
}

/// Timed calls per candidate and size.
const PROBE_REPS: usize = 5;

/// The index of the candidate with the smallest sum over sizes of the square of its ratio to
/// the fastest candidate at the size (ties: the faster at the reference, the last size);
/// candidates that failed at some size are never chosen.
fn best_candidate(times: &Times) -> Option<usize> {
    let best: [f32; PROBES] = std::array::from_fn(|i| {
        times
            .iter()
            .filter_map(|t| t[i])
            .fold(f32::INFINITY, f32::min)
    });
    let regret = |t: &[Option<f32>; PROBES]| -> Option<f32> {
        (0..PROBES).try_fold(0f32, |w, i| t[i].map(|x| w + (x / best[i]).powi(2)))
    };
    times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, regret(t)?, t[PROBES - 1]?)))
        .min_by(|x, y| x.1.total_cmp(&y.1).then(x.2.total_cmp(&y.2)))
        .map(|(i, ..)| i)
}

/// [`best_candidate`]'s algorithm; printed with every candidate's times under
/// `NSACTOR_GEMM_TRACE`, and in one line where it is not the heuristic's `first`.
fn choose(
    key: &PlanKey,
    sizes: [u64; PROBES],
    candidates: &[sys::cublasLtMatmulAlgo_t],
    times: &Times,
    first: Option<&sys::cublasLtMatmulAlgo_t>,
    started: std::time::Instant,
) -> Option<sys::cublasLtMatmulAlgo_t> {
    let chosen = best_candidate(times)?;
    let trace = crate::tuning::current().gemm_trace;
    let first_at = first.and_then(|f| candidates.iter().position(|c| same(c, f)));
    if trace || first_at != Some(chosen) {
        let show = |i: usize| {
            let t = &times[i];
            format!(
                "{} µs",
                t.map(|x| x.map_or("–".into(), |x| format!("{x:.1}")))
                    .join(" / ")
            )
        };
        eprintln!(
            "nsactor: batch-invariant GEMM n={} k={} ({} candidates timed in {} ms): at {:?} rows {} (heuristic's reference pick: {})",
            key.n,
            key.k(),
            candidates.len(),
            started.elapsed().as_millis(),
            sizes,
            show(chosen),
            first_at.map_or("not timed".into(), show),
        );
    }
    if trace {
        for (i, c) in candidates.iter().enumerate() {
            eprintln!(
                "    candidate {i:2}: {}  {:x?}",
                {
                    let t = &times[i];
                    t.map(|x| x.map_or("–".into(), |x| format!("{x:8.1}")))
                        .join(" ")
                },
                &c.data[..4]
            );
        }
    }
    Some(candidates[chosen])
}

/// Device buffers for the timing, freed on drop.
struct Scratch {
    ptr: [u64; 4],
}

impl Scratch {
    fn new(bytes: [usize; 4]) -> Result<Scratch, String> {
        let mut s = Scratch { ptr: [0; 4] };
        for (i, n) in bytes.into_iter().enumerate() {
            if n == 0 {
                continue;
            }
            // SAFETY: a fresh allocation of `n` bytes, filled before any read.
            unsafe {
                let p = drv::malloc_sync(n).map_err(|e| format!("scratch of {n} bytes: {e:?}"))?;
                s.ptr[i] = p;
                // 0x3c3c: about 0.0115 in bf16 and in f32; outputs are overwritten.
                drv::memset_d8_sync(p, 0x3c, n).map_err(|e| format!("{e:?}"))?;
            }
        }
        Ok(s)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in self.ptr {
            if p != 0 {
                // SAFETY: allocated by `Scratch::new`, freed once, after `time_calls` waited for
                // the calls that used it (on its error paths the stream may still hold some:
                // `cuMemFree` of device memory synchronises the device in practice, which is not
                // a documented guarantee).
                let _ = unsafe { drv::free_sync(p) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(rows: &[[f32; PROBES]]) -> Times {
        rows.iter().map(|r| r.map(Some)).collect()
    }

    #[test]
    fn probes_run_from_one_session_to_the_reference() {
        assert_eq!(probe_rows(INVARIANT_ROWS), [16, 64, 256, 1024, 4096]);
        assert_eq!(probe_rows(INVARIANT_TOKEN_ROWS), [1, 4, 16, 64, 256]);
        // A pass larger than the reference (its own reference) keeps the same ladder.
        assert_eq!(probe_rows(8192), [32, 128, 512, 2048, 8192]);
    }

    #[test]
    fn the_balanced_kernel_beats_one_built_for_either_end() {
        // Shaped like the H100's times for the block's out projection (n = 896, k = 7168, µs):
        // the reference pick is 2.3x slower for one session, a split-K pick for one session
        // is 2.2x slower at 256 sessions, and a middle one is within 1.7x everywhere.
        let t = times(&[
            [31.4, 31.6, 31.9, 40.0, 72.0],
            [13.5, 13.4, 13.4, 45.0, 157.5],
            [18.4, 18.0, 12.7, 35.0, 119.3],
        ]);
        assert_eq!(best_candidate(&t), Some(2));
        // The same kernel everywhere wins when it is fastest everywhere.
        let t = times(&[
            [10.0, 11.0, 12.0, 20.0, 70.0],
            [9.0, 10.0, 11.0, 19.0, 69.0],
        ]);
        assert_eq!(best_candidate(&t), Some(1));
    }

    #[test]
    fn a_kernel_far_off_at_one_size_loses_to_one_a_little_off_at_several() {
        // The H200's times for `W_out` (n = 896, k = 7168, µs), three of its 19 candidates: the
        // one-session split-K kernel (1.02× the best at 16 rows, 1.92× at 4,096), the balanced
        // one (at most 1.51×) and the reference pick (at most 2.39×). Summed plainly, the
        // ratios put the first ahead (6.52 against 6.58); their squares do not.
        let t = times(&[
            [16.8, 14.6, 15.2, 29.7, 120.1],
            [22.2, 20.4, 20.3, 21.6, 77.4],
            [31.9, 32.2, 32.3, 33.3, 62.7],
            [16.4, 13.5, 13.8, 45.5, 157.6],
            [35.9, 35.3, 25.1, 21.2, 86.3],
        ]);
        assert_eq!(best_candidate(&t), Some(1));
    }

    #[test]
    fn a_candidate_that_failed_at_a_size_is_never_chosen() {
        let mut t = times(&[[1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]]);
        t[0][3] = None;
        assert_eq!(best_candidate(&t), Some(1));
        t[1][0] = None;
        assert_eq!(best_candidate(&t), None);
        assert_eq!(best_candidate(&Vec::new()), None);
    }

    #[test]
    fn ties_go_to_the_faster_at_the_reference() {
        // Equal sums of squared ratios (1 + 4 against 4 + 1 at the two ends, equal between).
        let t = times(&[[1.0, 1.0, 1.0, 1.0, 2.0], [2.0, 1.0, 1.0, 1.0, 1.0]]);
        assert_eq!(best_candidate(&t), Some(1));
    }
}
