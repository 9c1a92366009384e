//! Batch-invariant decoding GEMMs: each decoding problem runs cuBLASLt kernels that give the
//! same bits at every row count a decoding pass can have, so a session's logits do not depend on
//! its cohort.
//!
//! A problem is keyed by its weight, shapes and precision at a reference row count (the largest
//! decoding pass: [`INVARIANT_ROWS`] over frames, [`INVARIANT_TOKEN_ROWS`] over tokens). Its
//! kernels (tile, split-K count, reduction scheme; never an in-place split-K reduction, whose
//! atomic adds land in any order) are chosen once per process and device ([`pick`]); every plan
//! of that problem runs the one chosen for its size class ([`Tiers`]).
//!
//! **How the kernels are chosen.** The candidates are cuBLASLt's heuristic picks at five probe
//! row counts (the passes of 1, 4, 16, 64 and 256 sessions), kept where they run at all five and
//! at three odd counts between. Each is timed on scratch operands of random values at the five
//! sizes, and its output's bits are read back ([`crate::cuda::gemm_probe`]): a candidate whose
//! sampled rows differ between row counts is dropped, and candidates that give the same bits
//! form a class. The class whose fastest member at each size has the smallest sum of the squares
//! of its ratios to the fastest candidate at that size wins (ties: the faster at the
//! reference), and each size runs that member. Before s59 every class was one kernel
//! (`NSACTOR_BATCH_INVARIANT=single` keeps that rule): no kernel is good at both ends (the
//! heuristic's reference pick is built for 4,096 frame rows and runs one session's 16 on a
//! handful of multiprocessors; a split-K kernel built for one session's rows is as slow the
//! other way), and the squares kept a balanced one (the plain sum of ratios had kept `W_out`'s
//! one-session split-K kernel, 1.92× the best at 256 sessions for 1.02× at one).
//! `NSACTOR_BATCH_INVARIANT=first` keeps the reference pick; `NSACTOR_GEMM_TRACE=1` prints every
//! candidate's times and class. The chosen kernels are kept with the kernel caches
//! ([`gemm_store`], one line per size class): a restart, or a process started later on the host,
//! takes them instead of probing again, so a request gets the same logits after a restart.
//!
//! A problem whose pass is larger than the reference (a prompt's pass of up to 16,384 frame rows)
//! runs in pieces of the reference's rows with the reference's kernel ([`invariant_rows`]). Until s47
//! such a pass of 8,192 rows or more was tuned like a training projection instead, and a
//! prompt's logits depended on how its passes were cut (issue 60). Probing needs the thread's
//! stream free of a graph capture: a problem first seen while its stream is captured takes its
//! stored kernels, else the reference pick, unprobed
//! (the decoding graphs are captured only after the same work ran once uncaptured, so this does
//! not happen in `serve`).

use crate::cuda::gemm_choice::{Shown, classes};
use crate::cuda::gemm_lt::{PlanKey, Queue, algo_fits, heuristic, reference_key, same};
use crate::cuda::gemm_probe::{Bench, Layouts, PROBES};
use crate::cuda::gemm_split;
use crate::cuda::gemm_store;
use crate::options::GemmRows;
use cudarc::cublaslt::sys;
use cudarc::driver::result as drv;
use std::collections::HashMap;
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
    /// Kernels with the same bits, one per size class, chosen by timing (the default).
    Timed,
    /// One kernel per problem at every row count, chosen by timing.
    Single,
    /// One kernel per problem: the heuristic's first pick at the reference row count.
    First,
    /// The heuristic's pick per row count: faster at some sizes, results vary with the cohort.
    Off,
}

/// The `batch_invariant` knob (`NSACTOR_BATCH_INVARIANT`): `on` (the default), `single`,
/// `first` or `off`.
pub(crate) fn invariance() -> Invariance {
    use nsactor_plugin_api::tuning::BatchInvariance;
    match crate::tuning::current().batch_invariant {
        BatchInvariance::On => Invariance::Timed,
        BatchInvariance::Single => Invariance::Single,
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

/// The row counts a candidate is timed at: the reference divided by 256, 64, 16 and 4, and the
/// reference (at K = 16 frames, the passes of 1, 4, 16, 64 and 256 sessions).
pub(crate) fn probe_rows(reference: u64) -> [u64; PROBES] {
    [256, 64, 16, 4, 1].map(|d| (reference / d).max(1))
}

/// A problem's kernels: the one each probe row count runs, all giving the same bits (one
/// kernel everywhere under `single`, `first`, or when nothing else was checked). A row count
/// runs the kernel of the smallest probe at or above it (the largest probe's past it).
#[derive(Clone, Copy)]
pub(crate) struct Tiers {
    algos: [sys::cublasLtMatmulAlgo_t; PROBES],
    sizes: [u64; PROBES],
}

impl Tiers {
    fn one(algo: sys::cublasLtMatmulAlgo_t, sizes: [u64; PROBES]) -> Tiers {
        Tiers {
            algos: [algo; PROBES],
            sizes,
        }
    }

    /// The kernel of a pass of `rows` rows.
    pub(crate) fn at(&self, rows: u64) -> sys::cublasLtMatmulAlgo_t {
        self.algos[tier_of(&self.sizes, rows)]
    }
}

/// The index of the smallest of `sizes` (ascending) at or above `rows`, else the last.
fn tier_of(sizes: &[u64; PROBES], rows: u64) -> usize {
    sizes.iter().position(|&s| rows <= s).unwrap_or(PROBES - 1)
}

/// The odd row counts a candidate's bits are also checked at: the passes of 3, 17 and 100
/// sessions (at K = 16 frames), between the probes.
fn odd_rows(reference: u64) -> [u64; 3] {
    [3u64, 17, 100].map(|s| (reference * s / 256).max(1))
}

/// What each device's problems were given, by reference key: one pick per process, so every
/// thread's plans of a problem use the same kernels.
static PICKS: Mutex<Option<HashMap<PlanKey, Tiers>>> = Mutex::new(None);

/// The kernel `key`'s problem runs at `key.m` rows (see the module's text); the problem's
/// kernels are chosen on its first call. `desc` and `a` are the calling plan's descriptor and
/// weight layout (the same for every row count); `pref` has the workspace and reduction limits.
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
    let rkey = reference_key(key, reference);
    let mut picks = PICKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let picks = picks.get_or_insert_with(HashMap::new);
    if let Some(tiers) = picks.get(&rkey) {
        return Some(tiers.at(key.m));
    }
    // SAFETY: upheld by the caller.
    let chosen = unsafe { choose_tiers(handle, desc, a, pref, key, &rkey, reference, queue) }?;
    picks.insert(rkey, chosen);
    Some(chosen.at(key.m))
}

/// [`pick`]'s choice for the problem `rkey` (`key` at its reference row count): stored, the
/// heuristic's first, or timed and checked on the device.
///
/// # Safety
/// As [`pick`].
#[allow(clippy::too_many_arguments)]
unsafe fn choose_tiers(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    pref: sys::cublasLtMatmulPreference_t,
    key: &PlanKey,
    rkey: &PlanKey,
    reference: u64,
    queue: Queue,
) -> Option<Tiers> {
    let Queue {
        stream,
        workspace_ptr,
    } = queue;
    let sizes = probe_rows(reference);
    let started = std::time::Instant::now();
    // Every row count the candidates must run at, ascending, the reference last: the probes
    // (timed) and the odd counts between them (their bits checked too).
    let checked: Vec<Layouts> = odd_rows(reference)
        .into_iter()
        .chain(sizes)
        .collect::<std::collections::BTreeSet<u64>>()
        .into_iter()
        .map(|r| Layouts::new(key, r))
        .collect();
    let probes: [&Layouts; PROBES] = sizes.map(|r| {
        checked
            .iter()
            .find(|l| l.rows == r)
            .expect("every probe size is checked")
    });
    let tiered = invariance() == Invariance::Timed;
    // SAFETY: upheld by the caller; the layouts are live until dropped at the end.
    unsafe {
        let fits = |algo: &sys::cublasLtMatmulAlgo_t| {
            checked
                .iter()
                .all(|l| algo_fits(handle, desc, l.with_a(a), algo))
        };
        let first = heuristic(handle, desc, probes[PROBES - 1].with_a(a), pref)
            .into_iter()
            .map(|h| h.algo)
            .find(|algo| fits(algo));
        let fallback = || first.map(|f| Tiers::one(f, sizes));
        if invariance() == Invariance::First {
            return fallback();
        }
        let usable = |algo: &sys::cublasLtMatmulAlgo_t| not_in_place(algo) && fits(algo);
        if let Some(algos) = stored_tiers(rkey, tiered, &usable) {
            return Some(Tiers { algos, sizes });
        }
        let capturing = !matches!(
            drv::stream::is_capturing(stream),
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if capturing {
            return fallback();
        }
        let mut candidates: Vec<sys::cublasLtMatmulAlgo_t> = Vec::new();
        for l in probes {
            for h in heuristic(handle, desc, l.with_a(a), pref) {
                if !candidates.iter().any(|c| same(c, &h.algo)) && fits(&h.algo) {
                    candidates.push(h.algo);
                }
            }
        }
        // Kernels built for many rows, offered again with K split (`NSACTOR_GEMM_SPLITS`).
        for v in gemm_split::variants(&candidates, &split_counts()) {
            if !candidates.iter().any(|c| same(c, &v)) && usable(&v) {
                candidates.push(v);
            }
        }
        let probed = Bench::new(handle, desc, a, key, reference, (workspace_ptr, stream)).and_then(
            |bench| {
                let times = bench.time_candidates(&probes, &candidates)?;
                let classes = if tiered {
                    classes(&bench.signatures(&checked, &candidates)?)
                } else {
                    (0..candidates.len()).map(Some).collect()
                };
                Ok((times, classes))
            },
        );
        match probed {
            Ok((times, classes)) => {
                let shown = Shown {
                    key,
                    sizes,
                    candidates: &candidates,
                    times: &times,
                    classes: &classes,
                    first: first.as_ref(),
                    started,
                };
                match shown.choose() {
                    Some(algos) => {
                        record_tiers(rkey, tiered, &algos);
                        Some(Tiers { algos, sizes })
                    }
                    None => fallback(),
                }
            }
            Err(e) => {
                eprintln!(
                    "nsactor: batch-invariant GEMM {key:?}: probing failed ({e}); taking the heuristic's pick"
                );
                fallback()
            }
        }
    }
}

/// The store's lines of a problem's kernels: one per size class (`tiered`), or one kernel's.
fn store_lines(tiered: bool) -> usize {
    if tiered { PROBES } else { 1 }
}

/// The store's kind of line `i` (`tiered`), or of the one kernel's (`single`: the line the
/// rule before tiers wrote).
fn store_kind(tiered: bool, i: usize) -> String {
    let splits = match split_counts().last() {
        Some(max) => format!("splits{max} "),
        None => String::new(),
    };
    if tiered {
        format!("tier{i} {splits}")
    } else {
        splits
    }
}

/// The split-K counts offered beside the heuristic's picks (`NSACTOR_GEMM_SPLITS`).
fn split_counts() -> Vec<u32> {
    gemm_split::split_counts(crate::tuning::current().gemm_splits)
}

/// The stored kernels of `rkey`, where every line is there and `usable` (one kernel fills
/// every size class).
fn stored_tiers(
    rkey: &PlanKey,
    tiered: bool,
    usable: &dyn Fn(&sys::cublasLtMatmulAlgo_t) -> bool,
) -> Option<[sys::cublasLtMatmulAlgo_t; PROBES]> {
    let lines = store_lines(tiered);
    let mut found = Vec::with_capacity(lines);
    for i in 0..lines {
        let k = store_key(&store_kind(tiered, i), rkey)?;
        let algo = sys::cublasLtMatmulAlgo_t {
            data: gemm_store::lookup(&k)?,
        };
        if !usable(&algo) {
            return None;
        }
        found.push(algo);
    }
    Some(std::array::from_fn(|i| found[i.min(lines - 1)]))
}

/// Keeps `algos` as `rkey`'s kernels in the store.
fn record_tiers(rkey: &PlanKey, tiered: bool, algos: &[sys::cublasLtMatmulAlgo_t; PROBES]) {
    for (i, algo) in algos.iter().enumerate().take(store_lines(tiered)) {
        if let Some(k) = store_key(&store_kind(tiered, i), rkey) {
            gemm_store::record(&k, algo.data);
        }
    }
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
    gemm_split::config::<u32>(
        algo,
        sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
    )
    .is_some_and(|scheme| {
        scheme != sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_run_from_one_session_to_the_reference() {
        assert_eq!(probe_rows(INVARIANT_ROWS), [16, 64, 256, 1024, 4096]);
        assert_eq!(probe_rows(INVARIANT_TOKEN_ROWS), [1, 4, 16, 64, 256]);
        // A pass larger than the reference (its own reference) keeps the same ladder.
        assert_eq!(probe_rows(8192), [32, 128, 512, 2048, 8192]);
    }

    #[test]
    fn a_row_count_runs_the_tier_at_or_above_it() {
        let sizes = probe_rows(INVARIANT_ROWS);
        assert_eq!(tier_of(&sizes, 1), 0);
        assert_eq!(tier_of(&sizes, 16), 0);
        assert_eq!(tier_of(&sizes, 17), 1);
        assert_eq!(tier_of(&sizes, 1024), 3);
        assert_eq!(tier_of(&sizes, 1025), 4);
        assert_eq!(tier_of(&sizes, 16384), 4);
        assert_eq!(odd_rows(INVARIANT_ROWS), [48, 272, 1600]);
        assert_eq!(odd_rows(INVARIANT_TOKEN_ROWS), [3, 17, 100]);
    }
}
