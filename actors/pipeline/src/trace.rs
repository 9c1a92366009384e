//! Timelines of decoding cohorts, for finding where a step's time goes between the actors, the
//! worker threads and the device: with `NSACTOR_TRACE_COHORTS=1` every cohort records when it
//! passes each [`Mark`], and `bench generate` prints the median offset of each mark from the
//! cohort's start. Off (the default) a mark costs one relaxed load. With
//! `NSACTOR_TRACE_COHORTS=sync` the embedding's and the layers' jobs also wait for the device
//! to finish their work and mark when it has, which shows the device's share of the step (and
//! slows the step by the waits).
//!
//! The timeline being recorded is the latest cohort's: with more than one cohort in flight
//! (`max_in_flight > 1`) their marks mix, so trace with one.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Points of a cohort's life, in the order a cohort passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mark {
    /// The edge's worker starts the embedding job.
    EmbedJob,
    /// The device has finished the embedding (`sync` tracing only).
    EmbedOnDevice,
    /// The cohort holds the embedding (and the layers' handles).
    Embedded,
    /// A stage's worker starts its layers' job.
    LayersJob,
    /// That job has queued its last layer's work.
    LayersQueued,
    /// The device has finished the layers' work (`sync` tracing only).
    LayersOnDevice,
    /// The cohort holds the last layer's output.
    LayersDone,
    /// The edge's worker starts the decode job.
    DecodeJob,
    /// The head's work is queued.
    DecodeQueued,
    /// The logits are on the host.
    Copied,
    /// The cohort holds the logits.
    Done,
}

impl Mark {
    pub const ALL: [Mark; 11] = [
        Mark::EmbedJob,
        Mark::EmbedOnDevice,
        Mark::Embedded,
        Mark::LayersJob,
        Mark::LayersQueued,
        Mark::LayersOnDevice,
        Mark::LayersDone,
        Mark::DecodeJob,
        Mark::DecodeQueued,
        Mark::Copied,
        Mark::Done,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mark::EmbedJob => "edge worker starts the embedding",
            Mark::EmbedOnDevice => "device has finished the embedding",
            Mark::Embedded => "cohort holds the embedding and the layer handles",
            Mark::LayersJob => "stage worker starts the layers",
            Mark::LayersQueued => "stage worker has queued the layers",
            Mark::LayersOnDevice => "device has finished the layers",
            Mark::LayersDone => "cohort holds the layers' output",
            Mark::DecodeJob => "edge worker starts the decode",
            Mark::DecodeQueued => "edge worker has queued the head",
            Mark::Copied => "logits on the host",
            Mark::Done => "cohort holds the logits",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static SYNC: AtomicBool = AtomicBool::new(false);
/// A cohort's start and the marks it has passed.
type Timeline = (Instant, Vec<(Mark, Instant)>);
static TIMELINES: Mutex<Vec<Timeline>> = Mutex::new(Vec::new());

/// Whether cohorts are traced: `NSACTOR_TRACE_COHORTS=1`, read by [`init`].
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether jobs wait for the device to mark its completions: `NSACTOR_TRACE_COHORTS=sync`.
pub fn syncing() -> bool {
    SYNC.load(Ordering::Relaxed)
}

/// Reads `NSACTOR_TRACE_COHORTS` (once per pipeline start): `1` traces, `sync` traces and
/// waits for the device.
pub fn init() {
    match std::env::var("NSACTOR_TRACE_COHORTS").as_deref() {
        Ok("1") => ON.store(true, Ordering::Relaxed),
        Ok("sync") => {
            ON.store(true, Ordering::Relaxed);
            SYNC.store(true, Ordering::Relaxed);
        }
        _ => {}
    }
}

/// A cohort starts: a new timeline.
pub fn start() {
    if enabled() {
        let mut t = TIMELINES.lock().unwrap_or_else(|e| e.into_inner());
        t.push((Instant::now(), Vec::new()));
    }
}

/// The current cohort passes `m`.
pub fn mark(m: Mark) {
    if enabled() {
        let now = Instant::now();
        let mut t = TIMELINES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, marks)) = t.last_mut() {
            marks.push((m, now));
        }
    }
}

/// The timelines recorded since the last call (each: its marks' offsets from its start, µs).
pub fn take() -> Vec<Vec<(Mark, f64)>> {
    let mut t = TIMELINES.lock().unwrap_or_else(|e| e.into_inner());
    std::mem::take(&mut *t)
        .into_iter()
        .map(|(start, marks)| {
            marks
                .into_iter()
                .map(|(m, at)| (m, (at - start).as_secs_f64() * 1e6))
                .collect()
        })
        .collect()
}

/// Per mark, the median offset from the cohort's start over `timelines` (µs) and how many
/// cohorts passed it; marks no cohort passed are left out.
pub fn medians(timelines: &[Vec<(Mark, f64)>]) -> Vec<(Mark, f64, usize)> {
    Mark::ALL
        .iter()
        .filter_map(|&m| {
            let mut v: Vec<f64> = timelines
                .iter()
                .filter_map(|tl| tl.iter().find(|(x, _)| *x == m).map(|(_, us)| *us))
                .collect();
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            Some((m, v[v.len() / 2], v.len()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_take_each_marks_middle_offset() {
        let tl = |a: f64, b: f64| vec![(Mark::EmbedJob, a), (Mark::Done, b)];
        let m = medians(&[tl(10.0, 300.0), tl(30.0, 100.0), tl(20.0, 200.0)]);
        assert_eq!(m, vec![(Mark::EmbedJob, 20.0, 3), (Mark::Done, 200.0, 3)]);
        assert!(medians(&[]).is_empty());
    }
}
