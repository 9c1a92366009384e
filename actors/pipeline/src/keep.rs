//! Which layers keep their forward's autodiff graph until their backward (`[train]
//! keep_activations`), and `auto`'s choice of how many from measured device memory.
//!
//! [`KeepLayers`] is the number every layer actor reads before a training forward: layer `i`
//! keeps its graph when it is among the last `n` of its stage. The supervisor changes it only
//! between steps, so a step runs with one value throughout; a rebuilt actor reads the same one.
//!
//! [`AutoKeep`] chooses `n` the way a user would by hand, from the device memory the driver
//! reports (allocator pools included, so it is each device's high-water mark): the first two
//! steps run with one kept layer per stage, the third with three; the growth between the second
//! and the third is what a kept layer costs on each device at this batch (never taken below
//! [`PESSIMISM`] times the four scan inputs it must hold: a span of two layers can measure
//! less than a layer costs, the pools growing in pages), and from the fourth step on each
//! stage keeps as many layers as fit under the budget with a tenth of a layer's cost to spare
//! per layer (and a whole layer's where a step runs several micro-batches). The second step measures the memory a
//! step holds once it runs steadily: the first step's reading misses what the second adds (on an
//! H100 at 0.9B, batch 14: 42 GiB after the first step, 50.5 GiB during the second, with no
//! kept layer). The third step keeps three layers only where they fit at [`PESSIMISM`] times
//! their scan inputs each; fewer where only fewer do, and where not even a second layer does,
//! `auto` stays at one without trying more: a step that runs out of device memory leaves the
//! CUDA backend unable to go on (an H100 tried three at batch 14 and the run ended). The step after a choice measures again over the longer span
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
pub(crate) const MARGIN: f64 = 1.10;
/// The part of a device left unused by default, and at least [`MIN_RESERVE`].
const RESERVE_SHARE: f64 = 0.02;
const MIN_RESERVE: u64 = 2 << 30;
/// Kept layers per stage in the measured steps: the first two, then the third at most.
const FIRST: usize = 1;
const SECOND: usize = 3;
/// Before a kept layer's cost is measured, it is taken to be at most this many times its four
/// scan inputs (measured at 0.9B, batch 14: 14.4 GiB against 6.1 GiB of scan inputs, 2.4×).
pub const PESSIMISM: f64 = 2.5;

/// What `auto` knows of one device the run uses.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceNeeds {
    pub device: usize,
    /// The least a kept layer per stage can add on this device: its four scan inputs, which
    /// its backward must read (the planner never takes a layer's cost below [`PESSIMISM`]
    /// times it).
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
    /// The second step, with the first's kept layers: what a step holds running steadily.
    Steady,
    /// The third step, with `keep` kept layers, measured against `first` (the second step's).
    Second {
        first: Vec<DeviceMemory>,
        keep: usize,
    },
    /// Running `keep`, chosen from the memory at `from` kept layers (`base`); the next
    /// measurement checks `predicted` and may raise `keep` (a span of more layers measures
    /// their cost better than the measured steps' span of one or two).
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
    /// After the second step: not even one more kept layer per stage fits at [`PESSIMISM`]
    /// times its scan inputs (`devices`' `per_layer`), so `keep` (what ran, or fewer where
    /// the budget is already exceeded) is final without a measurement.
    NoRoom {
        keep: usize,
        devices: Vec<DeviceChoice>,
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

    /// The kept layers per stage of the first measured steps and the most of the third (fewer
    /// where stages are short).
    fn measured(&self) -> (usize, usize) {
        (FIRST.min(self.max_layers), SECOND.min(self.max_layers))
    }

    /// Layers per stage the next step should keep.
    pub fn next(&self) -> usize {
        match &self.phase {
            Phase::First | Phase::Steady => self.measured().0,
            Phase::Second { keep, .. } | Phase::Chosen { keep, .. } | Phase::Done { keep } => *keep,
        }
    }

    /// After a step that failed while choosing (out of memory, say): the number falls back to
    /// the last one that ran a step (none while the first is measured) and stays there.
    pub fn failed(&mut self) -> usize {
        let keep = match &self.phase {
            Phase::First => 0,
            Phase::Steady | Phase::Second { .. } => self.measured().0,
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
                let (k1, k2) = self.measured();
                if k1 == k2 {
                    // Nothing more to measure: keep what fits of the one or no layer.
                    self.phase = Phase::Second {
                        first: mine,
                        keep: k1,
                    };
                    return self.observe(memory);
                }
                self.phase = Phase::Steady;
                Observed::Measuring
            }
            Phase::Steady => self.gate(mine),
            Phase::Second { first, keep } => {
                // The pools grow in pages, so a short span may show less growth than a layer
                // costs (none at all over one layer; an H100 at 4 × 511 × 4 measured 3.09 GiB
                // a layer over two, chose 12 and ran out of memory, where all 20 kept cost
                // 5.1 GiB a layer on an H200): the unmeasured estimate stays the least a
                // layer is taken to cost.
                let k1 = self.measured().0;
                let prior = self.pessimistic();
                self.choose(&first, &mine, k1, keep, &prior, 0)
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

    /// After the second step (`steady`: each device's memory): the third step's kept layers,
    /// as many as fit up to the measured steps' most at [`PESSIMISM`] times their scan inputs
    /// each, or the end of the choice where not even one more does.
    fn gate(&mut self, steady: Vec<DeviceMemory>) -> Observed {
        let (k1, k2) = self.measured();
        let prior = self.pessimistic();
        match self.choose(&steady, &steady, k1, k1, &prior, 0) {
            Observed::Chose { keep, devices, .. } if keep <= k1 => {
                self.phase = Phase::Done { keep };
                Observed::NoRoom { keep, devices }
            }
            Observed::Chose { keep, .. } => {
                self.phase = Phase::Second {
                    first: steady,
                    keep: keep.min(k2),
                };
                Observed::Measuring
            }
            // `choose` answers nothing else.
            other => other,
        }
    }

    /// Each device's cost of a kept layer before one is measured: [`PESSIMISM`] times its
    /// scan inputs.
    fn pessimistic(&self) -> Vec<(usize, u64)> {
        self.needs
            .iter()
            .map(|n| (n.device, (n.floor_per_layer as f64 * PESSIMISM) as u64))
            .collect()
    }

    /// The choice from each device's memory `a` at `k1` kept layers and `b` at `k2`
    /// (`prior`: each device's least cost per layer, the unmeasured estimate or the largest
    /// measured before; all of it when `k1 == k2` measures none).
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
        // `prior` (the unmeasured estimate, or the largest cost before) is at least
        // [`PESSIMISM`] times the scan inputs.
        let per_layer = match k2.abs_diff(k1) {
            0 => 0,
            d => grew / d as u64,
        }
        .max(prior.unwrap_or(0));
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
mod tests;
