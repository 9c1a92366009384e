//! How a batch-invariant decoding GEMM's kernels are chosen from their probes
//! ([`crate::cuda::gemm_probe`]): candidates grouped into classes by the bits they give
//! ([`classes`]), the class that is fastest over the probe sizes and the member each size runs
//! ([`best_tiers`]), and the line that says what was chosen ([`Shown`]).

use crate::cuda::gemm_lt::{PlanKey, same};
use crate::cuda::gemm_probe::{PROBES, Times};
use cudarc::cublaslt::sys;

/// The class of each candidate from its signature: equal signatures, equal class; `None` for
/// a candidate without one (it failed somewhere or its bits depend on the row count).
pub(crate) fn classes(signatures: &[Option<u64>]) -> Vec<Option<usize>> {
    signatures
        .iter()
        .map(|s| {
            let s = s.as_ref()?;
            signatures.iter().position(|o| o.as_ref() == Some(s))
        })
        .collect()
}

/// The classes that have a member, ascending.
fn class_ids(classes: &[Option<usize>]) -> Vec<usize> {
    let mut ids: Vec<usize> = classes.iter().flatten().copied().collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// For each probe size, the candidate to run there: all of one class, the class whose fastest
/// member at each size has the smallest sum over sizes of the square of its ratio to the fastest
/// usable candidate at the size (ties: the faster at the reference, the last size). Candidates
/// without a class, or that failed at some size, are never chosen; a class needs a member that
/// ran at every size.
pub(crate) fn best_tiers(
    times: &Times<PROBES>,
    classes: &[Option<usize>],
) -> Option<[usize; PROBES]> {
    let usable = |i: usize| classes.get(i).copied().flatten().is_some();
    let best: [f32; PROBES] = std::array::from_fn(|s| {
        (0..times.len())
            .filter(|&i| usable(i))
            .filter_map(|i| times[i][s])
            .fold(f32::INFINITY, f32::min)
    });
    class_ids(classes)
        .into_iter()
        .filter_map(|class| {
            let members: Vec<usize> = (0..times.len())
                .filter(|&i| classes.get(i) == Some(&Some(class)))
                .collect();
            let mut tiers = [0usize; PROBES];
            let mut score = 0f32;
            for (s, tier) in tiers.iter_mut().enumerate() {
                let (i, t) = members
                    .iter()
                    .filter_map(|&i| Some((i, times[i][s]?)))
                    .min_by(|x, y| x.1.total_cmp(&y.1))?;
                *tier = i;
                score += (t / best[s]).powi(2);
            }
            let at_reference = times[tiers[PROBES - 1]][PROBES - 1]?;
            Some((tiers, score, at_reference))
        })
        .min_by(|x, y| x.1.total_cmp(&y.1).then(x.2.total_cmp(&y.2)))
        .map(|(tiers, ..)| tiers)
}

/// A problem's probes, for [`Shown::choose`].
pub(crate) struct Shown<'a> {
    pub(crate) key: &'a PlanKey,
    pub(crate) sizes: [u64; PROBES],
    pub(crate) candidates: &'a [sys::cublasLtMatmulAlgo_t],
    pub(crate) times: &'a Times<PROBES>,
    pub(crate) classes: &'a [Option<usize>],
    pub(crate) first: Option<&'a sys::cublasLtMatmulAlgo_t>,
    pub(crate) started: std::time::Instant,
}

impl Shown<'_> {
    /// [`best_tiers`]' kernels; printed beside the best single kernel and the heuristic's
    /// reference pick (with every candidate's times and class under `NSACTOR_GEMM_TRACE`), and
    /// in one line wherever the choice is not the heuristic's `first` alone.
    pub(crate) fn choose(&self) -> Option<[sys::cublasLtMatmulAlgo_t; PROBES]> {
        let tiers = best_tiers(self.times, self.classes)?;
        // The best one kernel among the same candidates, each its own class.
        let alone: Vec<Option<usize>> = (0..self.candidates.len())
            .map(|i| self.classes[i].map(|_| i))
            .collect();
        let single = best_tiers(self.times, &alone);
        let trace = crate::tuning::current().gemm_trace;
        let first_at = self
            .first
            .and_then(|f| self.candidates.iter().position(|c| same(c, f)));
        let show = |t: [Option<f32>; PROBES]| {
            format!(
                "{} µs",
                t.map(|x| x.map_or("–".into(), |x| format!("{x:.1}")))
                    .join(" / ")
            )
        };
        let at = |tiers: [usize; PROBES]| show(std::array::from_fn(|s| self.times[tiers[s]][s]));
        let mut kernels = tiers.to_vec();
        kernels.sort_unstable();
        kernels.dedup();
        let kept = self.classes.iter().flatten().count();
        let count = class_ids(self.classes).len();
        if trace || first_at.is_none_or(|f| tiers != [f; PROBES]) {
            eprintln!(
                "nsactor: batch-invariant GEMM n={} k={} ({} candidates, {kept} with row-count-free bits in {count} classes, probed in {} ms): at {:?} rows {} with {} kernel(s) (one kernel: {}; heuristic's reference pick: {})",
                self.key.n,
                self.key.k(),
                self.candidates.len(),
                self.started.elapsed().as_millis(),
                self.sizes,
                at(tiers),
                kernels.len(),
                single.map_or("none".into(), at),
                first_at.map_or("not timed".into(), |f| show(self.times[f])),
            );
        }
        if trace {
            for (i, c) in self.candidates.iter().enumerate() {
                eprintln!(
                    "    candidate {i:2}: {}  class {}  {:x?}",
                    self.times[i]
                        .map(|x| x.map_or("–".into(), |x| format!("{x:8.1}")))
                        .join(" "),
                    self.classes[i].map_or("–".into(), |c| c.to_string()),
                    &c.data[..4]
                );
            }
        }
        Some(tiers.map(|i| self.candidates[i]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(rows: &[[f32; PROBES]]) -> Times<PROBES> {
        rows.iter().map(|r| r.map(Some)).collect()
    }

    /// The one-kernel rule: every candidate its own class; the chosen candidate, where the
    /// tiers are one kernel.
    fn best_candidate(times: &Times<PROBES>) -> Option<usize> {
        let alone: Vec<Option<usize>> = (0..times.len()).map(Some).collect();
        best_tiers(times, &alone).map(|t| {
            assert!(t.iter().all(|&i| i == t[0]), "one kernel per class: {t:?}");
            t[0]
        })
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

    #[test]
    fn kernels_with_the_same_bits_split_the_sizes_between_them() {
        // `W_out`-like: candidate 0 fast for few rows, 1 fast for many, 2 between; 0 and 1 give
        // the same bits, so the problem runs 0 up to 64 rows and 1 from 256.
        let t = times(&[
            [13.5, 13.4, 13.4, 45.0, 157.5],
            [31.4, 31.6, 31.9, 40.0, 72.0],
            [18.4, 18.0, 12.7, 35.0, 119.3],
        ]);
        assert_eq!(
            best_tiers(&t, &[Some(0), Some(0), Some(2)]),
            Some([0, 0, 0, 1, 1])
        );
        // Without the shared class the balanced one kernel wins, as before.
        assert_eq!(
            best_tiers(&t, &[Some(0), Some(1), Some(2)]),
            Some([2; PROBES])
        );
        // A candidate whose bits depend on the row count (no class) is never run.
        assert_eq!(best_tiers(&t, &[None, Some(1), None]), Some([1; PROBES]));
        assert_eq!(best_tiers(&t, &[None, None, None]), None);
    }

    #[test]
    fn a_class_runs_at_every_size_or_not_at_all() {
        let mut t = times(&[
            [1.0, 1.0, 1.0, 1.0, 9.0],
            [5.0, 5.0, 5.0, 5.0, 2.0],
            [3.0; PROBES],
        ]);
        t[0][4] = None;
        // 0 failed at the reference; its class mate 1 runs there.
        assert_eq!(
            best_tiers(&t, &[Some(0), Some(0), Some(2)]),
            Some([0, 0, 0, 0, 1])
        );
        t[1][4] = None;
        assert_eq!(
            best_tiers(&t, &[Some(0), Some(0), Some(2)]),
            Some([2; PROBES])
        );
    }

    #[test]
    fn equal_signatures_make_one_class() {
        assert_eq!(
            classes(&[Some(12), None, Some(3), Some(12)]),
            vec![Some(0), None, Some(2), Some(0)]
        );
    }
}
