//! Which layers keep their forward's autodiff graph until their backward (`[train]
//! keep_activations`), and `auto`'s choice of how many from measured device memory.
//!
//! [`KeepLayers`] is the number every layer actor reads before a training forward: layer `i`
//! keeps its graph when it is among the last `n` of its stage. The supervisor changes it only
//! between steps, so a step runs with one value throughout; a rebuilt actor reads the same one.
//!
//! [`AutoKeep`] chooses `n` the way a user would by hand, from the device memory the driver
//! reports (allocator pools included, so it is each device's high-water mark): the first step
//! runs with one kept layer per stage, the second with three; the growth between them is what
//! a kept layer costs on each device at this batch (never taken below the four scan inputs it
//! must hold), and from the third step on each stage keeps as many layers as fit under the
//! budget with a tenth of a layer's cost to spare per layer (and a whole layer's where a step
//! runs several micro-batches). The step after a choice measures again over the longer span
//! and may raise it (never with a cost per layer below the largest measured), at most
//! [`MAX_ROUNDS`] times; a choice below what just ran is final (pools never shrink, so memory
//! measured after it could only lower it again). A step that fails while it chooses sets the
//! number back to the last that ran a step, for good ([`AutoKeep::failed`]). Each choice is
//! logged with its figures, and the last with its prediction beside the memory measured.

use nsactor_plugin_api::DeviceMemory;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The number of layers per stage, counted from its last, whose training forwards keep their
/// graph; shared by the supervisor and every layer actor.
#[derive(Debug, Clone)]
pub struct KeepLayers {
    n: Arc<AtomicUsize>,
    /// `false` while `auto` is still measuring and may change `n`.
    settled: Arc<AtomicBool>,
}

impl KeepLayers {
    /// `n` layers, settled (until [`choosing`](Self::choosing) says otherwise).
    pub fn new(n: usize) -> Self {
        KeepLayers {
            n: Arc::new(AtomicUsize::new(n)),
            settled: Arc::new(AtomicBool::new(true)),
        }
    }

    pub fn get(&self) -> usize {
        self.n.load(Ordering::Acquire)
    }

    pub fn set(&self, n: usize) {
        self.n.store(n, Ordering::Release);
    }

    /// Marks the number as still being chosen (`false`) or final.
    pub fn set_settled(&self, settled: bool) {
        self.settled.store(settled, Ordering::Release);
    }

    /// Whether the number is final: fixed, or `auto` done measuring.
    pub fn settled(&self) -> bool {
        self.settled.load(Ordering::Acquire)
    }

    /// Whether a layer `from_end` places from its stage's end (1: the stage's last layer)
    /// keeps its graph now.
    pub fn keeps(&self, from_end: usize) -> bool {
        from_end <= self.get()
    }
}

/// Each kept layer may take this much more than the measured growth per layer (the measured
/// 0.9B growth rose ~6 % from the first kept layers to the sixth).
const MARGIN: f64 = 1.10;
/// The part of a device left unused by default, and at least [`MIN_RESERVE`].
const RESERVE_SHARE: f64 = 0.02;
const MIN_RESERVE: u64 = 2 << 30;
/// Kept layers per stage in the two measured steps.
const FIRST: usize = 1;
const SECOND: usize = 3;

/// What `auto` knows of one device the run uses.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceNeeds {
    pub device: usize,
    /// The least a kept layer per stage can add on this device: its four scan inputs, which
    /// its backward must read (the planner never takes the measured growth below it).
    pub floor_per_layer: u64,
    /// Bytes to leave free besides the reserve: the stages' parameters and optimizer state on
    /// this device when checkpoints are taken during the run.
    pub held_for_checkpoints: u64,
}

/// `keep_activations = "auto"`: see the module documentation.
#[derive(Debug, Clone)]
pub struct AutoKeep {
    /// The most layers any stage has.
    max_layers: usize,
    /// Layers' worth of memory left free besides the budget's reserve: 1 where a step runs
    /// several micro-batches, whose overlap makes the high-water mark swing from step to step
    /// (at 0.9B on an H200, 5 × 511 × 3 ran out of memory at 19 kept layers where the growth
    /// from 10 predicted 129 GiB, and 8 × 511 × 2 at 12 where it predicted 133).
    spare_layers: usize,
    /// The memory the run may have in use on each device (`[train] memory_budget_gib`).
    cap: Option<u64>,
    needs: Vec<DeviceNeeds>,
    phase: Phase,
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    First,
    Second {
        first: Vec<DeviceMemory>,
    },
    /// Running `keep`, chosen from the memory at `from` kept layers (`base`); the next
    /// measurement checks `predicted` and may raise `keep` (a span of more layers measures
    /// their cost better than the first two steps' span of two).
    Chosen {
        keep: usize,
        from: usize,
        base: Vec<DeviceMemory>,
        per_layer: Vec<(usize, u64)>,
        predicted: Vec<(usize, u64)>,
        rounds: usize,
    },
    Done {
        keep: usize,
    },
}

/// Choices after the first before `auto` settles on its latest.
const MAX_ROUNDS: usize = 3;

/// One device's part in a choice: what was measured and what `keep` should take.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceChoice {
    pub device: usize,
    pub first: u64,
    pub second: u64,
    /// Bytes a kept layer per stage is taken to cost here.
    pub per_layer: u64,
    pub allowed: u64,
    pub total: u64,
    /// Layers per stage that fit on this device.
    pub fits: usize,
}

/// What [`AutoKeep::observe`] decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// Still measuring.
    Measuring,
    /// The choice, from the third step on: `keep` layers per stage, and why; `last` when it
    /// is final (no more than what just ran: memory in use never comes back down, so a
    /// measurement after lowering it could only lower it again).
    Chose {
        keep: usize,
        devices: Vec<DeviceChoice>,
        last: bool,
    },
    /// The choice stands: each device's memory in the step that ran it, against its
    /// prediction (`device, used, predicted`). Nothing more is measured.
    Settled(Vec<(usize, u64, u64)>),
    /// Settled before.
    Done,
}

impl AutoKeep {
    pub fn new(max_layers: usize, cap: Option<u64>, needs: Vec<DeviceNeeds>) -> Self {
        AutoKeep {
            max_layers,
            spare_layers: 0,
            cap,
            needs,
            phase: Phase::First,
        }
    }

    /// Leaves `n` layers' worth of memory free besides the reserve (see the field).
    pub fn with_spare_layers(mut self, n: usize) -> Self {
        self.spare_layers = n;
        self
    }

    /// The kept layers per stage of the two measured steps (fewer where stages are short).
    fn measured(&self) -> (usize, usize) {
        (FIRST.min(self.max_layers), SECOND.min(self.max_layers))
    }

    /// Layers per stage the next step should keep.
    pub fn next(&self) -> usize {
        match &self.phase {
            Phase::First => self.measured().0,
            Phase::Second { .. } => self.measured().1,
            Phase::Chosen { keep, .. } | Phase::Done { keep } => *keep,
        }
    }

    /// After a step that failed while choosing (out of memory, say): the number falls back to
    /// the last one that ran a step (none while the first is measured) and stays there.
    pub fn failed(&mut self) -> usize {
        let keep = match &self.phase {
            Phase::First => 0,
            Phase::Second { .. } => self.measured().0,
            Phase::Chosen { keep, from, .. } => (*keep).min(*from),
            Phase::Done { keep } => *keep,
        };
        self.phase = Phase::Done { keep };
        keep
    }

    /// After a step that ran with [`next`](Self::next) kept layers: each device's memory now.
    pub fn observe(&mut self, memory: &[DeviceMemory]) -> Observed {
        let mine: Vec<DeviceMemory> = self
            .needs
            .iter()
            .filter_map(|n| memory.iter().find(|m| m.device == n.device).copied())
            .collect();
        match std::mem::replace(&mut self.phase, Phase::First) {
            Phase::First => {
                self.phase = Phase::Second { first: mine };
                let (k1, k2) = self.measured();
                if k1 == k2 {
                    // Nothing more to measure: keep what fits of the one or no layer.
                    return self.observe(memory);
                }
                Observed::Measuring
            }
            Phase::Second { first } => {
                let (k1, k2) = self.measured();
                self.choose(&first, &mine, k1, k2, &[], 0)
            }
            Phase::Chosen {
                keep,
                from,
                base,
                per_layer,
                predicted,
                rounds,
            } => {
                let check = predicted
                    .iter()
                    .filter_map(|&(d, p)| {
                        let m = mine.iter().find(|m| m.device == d)?;
                        Some((d, m.used_bytes, p))
                    })
                    .collect();
                if rounds < MAX_ROUNDS {
                    let again = self.choose(&base, &mine, from, keep, &per_layer, rounds + 1);
                    if self.next() != keep {
                        return again;
                    }
                }
                self.phase = Phase::Done { keep };
                Observed::Settled(check)
            }
            Phase::Done { keep } => {
                self.phase = Phase::Done { keep };
                Observed::Done
            }
        }
    }

    /// The choice from each device's memory `a` at `k1` kept layers and `b` at `k2`
    /// (`prior`: each device's cost per layer when `k1 == k2` measures none).
    fn choose(
        &mut self,
        a: &[DeviceMemory],
        b: &[DeviceMemory],
        k1: usize,
        k2: usize,
        prior: &[(usize, u64)],
        rounds: usize,
    ) -> Observed {
        let devices: Vec<DeviceChoice> = self
            .needs
            .iter()
            .filter_map(|n| {
                let a = a.iter().find(|m| m.device == n.device)?;
                let b = b.iter().find(|m| m.device == n.device)?;
                let prior = prior.iter().find(|p| p.0 == n.device).map(|p| p.1);
                Some(self.fit(n, a, b, (k1, k2), prior))
            })
            .collect();
        let keep = devices
            .iter()
            .map(|d| d.fits)
            .min()
            .unwrap_or(0)
            .min(self.max_layers);
        let predicted = devices
            .iter()
            .map(|d| {
                let grow = keep.saturating_sub(k2) as u64 * d.per_layer;
                (d.device, d.second + grow)
            })
            .collect();
        let last = keep <= k2;
        self.phase = if last {
            Phase::Done { keep }
        } else {
            Phase::Chosen {
                keep,
                from: k2,
                base: b.to_vec(),
                per_layer: devices.iter().map(|d| (d.device, d.per_layer)).collect(),
                predicted,
                rounds,
            }
        };
        Observed::Chose {
            keep,
            devices,
            last,
        }
    }

    /// How many layers per stage fit on one device, from its memory after `k1` and `k2` kept
    /// layers per stage.
    fn fit(
        &self,
        n: &DeviceNeeds,
        a: &DeviceMemory,
        b: &DeviceMemory,
        (k1, k2): (usize, usize),
        prior: Option<u64>,
    ) -> DeviceChoice {
        let total = b.total_bytes;
        let reserve = ((total as f64 * RESERVE_SHARE) as u64).max(MIN_RESERVE);
        let allowed = self
            .cap
            .unwrap_or(u64::MAX)
            .min(total.saturating_sub(reserve))
            .saturating_sub(n.held_for_checkpoints);
        let grew = b.used_bytes.saturating_sub(a.used_bytes);
        // The largest cost measured so far: the pools grow in pages, so a span's growth
        // swings, and the first span sees micro-batches overlapping that later spans may not.
        let per_layer = match k2.abs_diff(k1) {
            0 => 0,
            d => grew / d as u64,
        }
        .max(prior.unwrap_or(0))
        .max(n.floor_per_layer);
        let step = ((per_layer as f64 * MARGIN) as u64).max(1);
        let spare = self.spare_layers as u64 * per_layer;
        let fits = if b.used_bytes + spare <= allowed {
            k2 + ((allowed - b.used_bytes - spare) / step) as usize
        } else if b.used_bytes <= allowed {
            k2
        } else {
            // Over the budget already: give back what the excess takes, in whole layers.
            let over = (b.used_bytes - allowed).div_ceil(per_layer.max(1));
            k2.saturating_sub(over as usize)
        };
        DeviceChoice {
            device: n.device,
            first: a.used_bytes,
            second: b.used_bytes,
            per_layer,
            allowed,
            total,
            fits,
        }
    }
}

/// GiB, for the log.
pub fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn mem(device: usize, used_gib: f64) -> DeviceMemory {
        DeviceMemory {
            device,
            used_bytes: (used_gib * GIB as f64) as u64,
            total_bytes: (139.8 * GIB as f64) as u64,
        }
    }

    fn needs(device: usize, held: u64) -> DeviceNeeds {
        DeviceNeeds {
            device,
            floor_per_layer: 6 * GIB,
            held_for_checkpoints: held,
        }
    }

    fn chose(a: &mut AutoKeep, first: &[DeviceMemory], second: &[DeviceMemory]) -> usize {
        assert_eq!(a.next(), 1);
        assert_eq!(a.observe(first), Observed::Measuring);
        assert_eq!(a.next(), 3);
        match a.observe(second) {
            Observed::Chose { keep, .. } => {
                assert_eq!(a.next(), keep);
                keep
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_measured_0_9b_at_batch_14_keeps_the_six_layers_that_fitted_on_an_h200() {
        // Session 52 on an H200: 53.46 GiB with one kept layer, ~14.4 GiB for each more; six
        // ran in 127.24 GiB and eight ran out of memory.
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 6);
        // The step with six measures 15.0 GiB a layer over three: a seventh does not fit, and
        // the choice settles with its prediction (82.26 + 3 × 14.4 GiB) beside the figure.
        match a.observe(&[mem(0, 127.24)]) {
            Observed::Settled(v) => {
                let (d, used, predicted) = v[0];
                assert_eq!(d, 0);
                assert_eq!(used, mem(0, 127.24).used_bytes);
                assert!((gib(predicted) - 125.46).abs() < 0.01, "{}", gib(predicted));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.observe(&[mem(0, 127.24)]), Observed::Done);
        assert_eq!(a.next(), 6);
    }

    /// The choices `a` makes from `steps` (each step's memory after the first two), and
    /// whether it settled.
    fn rounds(a: &mut AutoKeep, steps: &[f64]) -> (Vec<usize>, bool) {
        let mut kept = Vec::new();
        for &used in steps {
            match a.observe(&[mem(0, used)]) {
                Observed::Chose { keep, last, .. } => {
                    kept.push(keep);
                    if last {
                        return (kept, true);
                    }
                }
                Observed::Settled(_) => return (kept, true),
                other => panic!("{other:?}"),
            }
        }
        (kept, false)
    }

    #[test]
    fn a_longer_span_measures_a_layer_better_and_raises_the_choice() {
        // This session's H200 at batch 14: 48.55 → 85.71 GiB from one kept layer to three
        // (18.6 GiB a layer: the pools' first growth), 116.30 with five (15.3 a layer).
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        // Five left 20.7 GiB: one more layer at the first span's 18.58 GiB (the largest
        // measured is what a layer is taken to cost); six took 127.24 GiB.
        assert_eq!(chose(&mut a, &[mem(0, 48.55)], &[mem(0, 85.71)]), 5);
        assert_eq!(rounds(&mut a, &[116.30, 127.24]), (vec![6], true));
        assert_eq!(a.next(), 6);
        // At 4 × 511 × 4, without the spare layer: 33.43 → 47.77 GiB (7.2 a layer) chose 14;
        // 99.24 GiB with 14 leaves room for 18 at 7.2 a layer; 118 with 18 for all 20, which
        // ran in 131.05 GiB when asked for by hand.
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        a.needs[0].floor_per_layer = GIB;
        assert_eq!(chose(&mut a, &[mem(0, 33.43)], &[mem(0, 47.77)]), 14);
        assert_eq!(
            rounds(&mut a, &[99.24, 118.0, 131.05]),
            (vec![18, 20], true)
        );
        // A choice that keeps rising (each layer costing less than the first span measured)
        // settles after a few rounds.
        let mut a = AutoKeep::new(10_000, None, vec![needs(0, 0)]);
        a.needs[0].floor_per_layer = GIB / 1024;
        assert_eq!(chose(&mut a, &[mem(0, 10.0)], &[mem(0, 12.0)]), 116);
        let (kept, settled) = rounds(&mut a, &[68.5, 99.5, 116.5, 125.0]);
        assert!(kept.windows(2).all(|w| w[0] < w[1]), "{kept:?}");
        assert_eq!((kept.len(), settled), (MAX_ROUNDS, true), "{kept:?}");
    }

    #[test]
    fn a_choice_below_what_ran_is_final_and_a_failed_step_falls_back_to_what_ran() {
        // Under a 100 GiB cap the 0.9B at batch 14 chooses 4 (96.7 GiB predicted); 101 GiB
        // measured gives one layer back, and that is the end: the pools never shrink, so the
        // same reading would otherwise take another layer each round.
        let mut a = AutoKeep::new(20, Some(100 * GIB), vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 4);
        assert_eq!(rounds(&mut a, &[101.0]), (vec![3], true));
        assert_eq!(a.observe(&[mem(0, 101.0)]), Observed::Done);
        assert_eq!(a.next(), 3);
        // A failed step while measuring, or at a raised number, goes back to what last ran.
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        assert_eq!(a.failed(), 0);
        assert_eq!(a.next(), 0);
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        a.observe(&[mem(0, 53.46)]);
        assert_eq!((a.failed(), a.next()), (1, 1));
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 6);
        assert_eq!((a.failed(), a.next()), (3, 3));
        assert_eq!(a.observe(&[mem(0, 90.0)]), Observed::Done);
    }

    #[test]
    fn steps_of_several_micro_batches_leave_a_layer_spare() {
        // 5 × 511 × 3 on an H200: 30.33 → 50.96 GiB from one kept layer to three. Without
        // the spare layer this chose 10 and then 19, which ran out of memory.
        let spare = |n| AutoKeep::new(20, None, vec![needs(0, 0)]).with_spare_layers(n);
        assert_eq!(chose(&mut spare(0), &[mem(0, 30.33)], &[mem(0, 50.96)]), 10);
        let mut a = spare(1);
        assert_eq!(chose(&mut a, &[mem(0, 30.33)], &[mem(0, 50.96)]), 9);
        // Within a layer of the budget it stays where it is rather than give layers back.
        assert_eq!(rounds(&mut a, &[128.0]), (vec![], true));
        assert_eq!(a.next(), 9);
    }

    #[test]
    fn checkpoints_during_the_run_and_a_cap_leave_room_and_keep_fewer() {
        let ckpt = (9.77 * GIB as f64) as u64;
        let mut a = AutoKeep::new(20, None, vec![needs(0, ckpt)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 5);
        let mut a = AutoKeep::new(20, Some(100 * GIB), vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 4);
        // A cap below what three layers took gives layers back (one layer's 14.4 GiB covers
        // 12.26 over); below what one took, all of them.
        let mut a = AutoKeep::new(20, Some(70 * GIB), vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 2);
        let mut a = AutoKeep::new(20, Some(40 * GIB), vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 0);
    }

    #[test]
    fn growth_under_the_scan_inputs_is_not_believed_and_every_layer_fits_a_roomy_device() {
        // The pools had room: no growth measured. The floor (6 GiB a layer) decides.
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
        // (137.0 − 50) GiB / 6.6 GiB = 13 layers past the three measured.
        assert_eq!(chose(&mut a, &[mem(0, 50.0)], &[mem(0, 50.0)]), 16);
        // A small model: all of its layers.
        let mut a = AutoKeep::new(4, None, vec![needs(0, 0)]);
        assert_eq!(chose(&mut a, &[mem(0, 5.0)], &[mem(0, 5.1)]), 4);
    }

    #[test]
    fn the_tightest_device_decides_and_other_devices_reports_are_ignored() {
        let mut a = AutoKeep::new(10, None, vec![needs(0, 0), needs(1, 0)]);
        let first = [mem(0, 40.0), mem(1, 60.0), mem(7, 1.0)];
        let second = [mem(0, 60.0), mem(1, 100.0), mem(7, 139.0)];
        // Device 0: 10 GiB a layer, 77 GiB free → 3 + 7 = 10; device 1: 20 GiB, 37 free → 4.
        match (a.observe(&first), a.observe(&second)) {
            (Observed::Measuring, Observed::Chose { keep, devices, .. }) => {
                assert_eq!(keep, 4);
                assert_eq!(devices.iter().map(|d| d.fits).collect::<Vec<_>>(), [10, 4]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stage_of_one_layer_is_measured_once() {
        let mut a = AutoKeep::new(1, None, vec![needs(0, 0)]);
        assert_eq!(a.next(), 1);
        match a.observe(&[mem(0, 10.0)]) {
            Observed::Chose { keep, .. } => assert_eq!(keep, 1),
            other => panic!("{other:?}"),
        }
        let mut a = AutoKeep::new(1, Some(5 * GIB), vec![needs(0, 0)]);
        match a.observe(&[mem(0, 10.0)]) {
            Observed::Chose { keep, .. } => assert_eq!(keep, 0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_shared_number_is_read_per_layer() {
        let k = KeepLayers::new(2);
        assert!(k.keeps(1) && k.keeps(2) && !k.keeps(3));
        k.clone().set(0);
        assert!(!k.keeps(1));
    }
}
