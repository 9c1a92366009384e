//! Self-healing decoding. A stage that panics while it decodes loses its state (its worker
//! keeps the panic in the stage's slot, `super::holder`), and an actor that stops takes its
//! stage with it; until now every later pass failed on it. Now the batcher fails the sessions
//! whose states went with it, stops launching, and asks the supervisor to rebuild every actor
//! over fresh stages and load the weights again from where they first came from
//! ([`WeightSource`]: the serving command's checkpoint, read and verified anew;
//! `SupState::heal` in `super::recovery`). Inputs that
//! arrive meanwhile wait and run on the new actors. [`HealPolicy`] bounds how often this may
//! happen (Erlang's restart intensity); past it, or when a rebuild fails, decoding has
//! [`Health::Failed`] and refuses everything. [`HealthCell`] tells servers where it stands.

use crate::error::RuntimeError;
use nsactor_plugin_api::EngineError;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Where a pipeline's weights come from: its shards in stage order (edge first; one buffer
/// may feed several stages), read again whenever the pipeline is rebuilt.
pub type WeightSource = Arc<dyn Fn() -> Result<Vec<Arc<Vec<u8>>>, RuntimeError> + Send + Sync>;

/// Where decoding stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Health {
    #[default]
    Serving,
    /// A stage was lost (`cause`) and the actors are being rebuilt; new inputs wait.
    Recovering { cause: String },
    /// A rebuild failed, or stages were lost more often than the [`HealPolicy`] allows:
    /// every input is refused.
    Failed { cause: String },
}

/// How long a rebuild took, by phase, and how long decoding was away.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HealTimings {
    /// From the moment the stage was found lost (before any session was answered) until
    /// decoding served again: the phases below and the messages between them.
    pub away_s: f64,
    /// Reading the weights again from their source (a checkpoint: read and verified).
    pub read_s: f64,
    /// Stopping every actor and spawning new ones over freshly opened stages.
    pub rebuild_s: f64,
    /// Loading the weights into the new stages.
    pub load_s: f64,
}

impl HealTimings {
    /// The phases' sum.
    pub fn total_s(&self) -> f64 {
        self.read_s + self.rebuild_s + self.load_s
    }
}

/// The decoder's [`Health`] and how many times it has healed: written by the batcher, read by
/// every [`AsyncDecoder`](super::AsyncDecoder) (a server's `/health` and `/metrics`), and
/// watched by whoever waits for a change ([`subscribe`](Self::subscribe)).
#[derive(Debug)]
pub struct HealthCell {
    state: watch::Sender<Health>,
    record: Mutex<Record>,
}

/// What the cell remembers beside the state.
#[derive(Debug, Default)]
struct Record {
    /// Rebuilds that brought decoding back.
    recoveries: u64,
    last: Option<HealTimings>,
    /// When the state last turned [`Health::Recovering`].
    since: Option<Instant>,
}

impl Default for HealthCell {
    /// Serving.
    fn default() -> Self {
        HealthCell {
            state: watch::Sender::new(Health::Serving),
            record: Mutex::default(),
        }
    }
}

impl HealthCell {
    pub fn state(&self) -> Health {
        self.state.borrow().clone()
    }

    /// Whether decoding runs (nothing cloned: the batcher asks on every message).
    pub fn is_serving(&self) -> bool {
        *self.state.borrow() == Health::Serving
    }

    /// Every change of the state from now on.
    pub fn subscribe(&self) -> watch::Receiver<Health> {
        self.state.subscribe()
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rebuilds that brought decoding back.
    pub fn recoveries(&self) -> u64 {
        self.record().recoveries
    }

    /// The last rebuild that brought decoding back, by phase.
    pub fn last_heal(&self) -> Option<HealTimings> {
        self.record().last
    }

    /// Serving again after a rebuild that took `t` (its `away_s` measured here).
    pub(super) fn healed(&self, t: HealTimings) {
        let mut r = self.record();
        let away_s = r.since.map_or(0.0, |s| s.elapsed().as_secs_f64());
        r.last = Some(HealTimings { away_s, ..t });
        self.set_recorded(&mut r, Health::Serving);
    }

    pub(super) fn set(&self, h: Health) {
        self.set_recorded(&mut self.record(), h);
    }

    fn set_recorded(&self, r: &mut Record, h: Health) {
        if matches!(h, Health::Recovering { .. }) {
            r.since = Some(Instant::now());
        }
        let was = self.state.send_replace(h);
        if matches!(was, Health::Recovering { .. }) && self.is_serving() {
            r.recoveries += 1;
        }
    }
}

/// How often decoding may rebuild itself: at most `max_restarts` rebuilds within any
/// `window`; one more lost stage within it fails decoding for good (a request that kills a
/// stage every time it runs then cannot keep the server rebuilding).
#[derive(Debug, Clone, PartialEq)]
pub struct HealPolicy {
    pub max_restarts: u32,
    pub window: Duration,
}

impl Default for HealPolicy {
    /// Three rebuilds in ten minutes.
    fn default() -> Self {
        HealPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
        }
    }
}

/// Erlang's restart intensity: the restarts within the last `window`, and whether one more
/// is allowed (decoding's rebuilds here, `nsactor train --max-restarts`'s process restarts).
#[derive(Debug, Default)]
pub struct Restarts {
    times: VecDeque<Instant>,
}

impl Restarts {
    /// Counts a restart at `now` if fewer than `max` were counted within the `window` before
    /// it; false (and nothing counted) otherwise.
    pub fn allow(&mut self, max: u32, window: Duration, now: Instant) -> bool {
        while self
            .times
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= window)
        {
            self.times.pop_front();
        }
        if self.times.len() >= max as usize {
            return false;
        }
        self.times.push_back(now);
        true
    }

    /// Restarts counted within the window (as of the last [`allow`](Self::allow)).
    pub fn len(&self) -> usize {
        self.times.len()
    }

    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }
}

/// Whether `e` means the pipeline lost a stage (one panicked and its state is gone, or an
/// actor stopped), so it must be rebuilt before it decodes again.
pub fn loses_stage(e: &RuntimeError) -> bool {
    matches!(
        e,
        RuntimeError::Stage {
            error: EngineError::Panic(_),
            ..
        } | RuntimeError::Broken(_)
    )
}

/// What a session whose states were lost gets from then on.
pub(super) fn lost_session(cause: &str) -> RuntimeError {
    RuntimeError::Broken(format!(
        "this session's states were lost with a stage ({cause}); the pipeline was rebuilt, \
         start a new generation"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_are_allowed_up_to_the_intensity_within_the_window() {
        let (mut r, t0) = (Restarts::default(), Instant::now());
        let mut allow = |at: u64| r.allow(2, Duration::from_secs(10), t0 + Duration::from_secs(at));
        assert!(allow(0));
        assert!(allow(1));
        assert!(!allow(9), "a third within 10 s");
        // The refused one was not counted: the first leaves the window at 10 s.
        assert!(allow(10));
        assert!(!allow(10));
        assert!(allow(30));
        assert_eq!(r.len(), 1);
        assert!(!Restarts::default().allow(0, Duration::from_secs(10), t0));
    }

    #[test]
    fn a_panic_or_a_stopped_actor_loses_a_stage_and_other_errors_do_not() {
        let stage = |error| RuntimeError::Stage {
            who: "layer 1".into(),
            error,
        };
        assert!(loses_stage(&stage(EngineError::Panic("boom".into()))));
        assert!(loses_stage(&RuntimeError::Broken("edge stopped".into())));
        assert!(!loses_stage(&stage(EngineError::InvalidInput(
            "bad".into()
        ))));
        assert!(!loses_stage(&RuntimeError::Invalid("bad".into())));
    }

    #[test]
    fn health_counts_a_recovery_when_it_is_serving_again() {
        let h = HealthCell::default();
        assert_eq!(h.state(), Health::Serving);
        h.set(Health::Recovering {
            cause: "layer 1 panicked".into(),
        });
        assert_eq!((h.recoveries(), h.last_heal()), (0, None));
        std::thread::sleep(Duration::from_millis(20));
        let phases = HealTimings {
            away_s: 0.0,
            read_s: 0.001,
            rebuild_s: 0.002,
            load_s: 0.003,
        };
        h.healed(phases);
        assert_eq!((h.state(), h.recoveries()), (Health::Serving, 1));
        let last = h.last_heal().unwrap();
        assert!(
            last.away_s >= 0.02,
            "away since it turned recovering: {last:?}"
        );
        assert_eq!(
            HealTimings {
                away_s: 0.0,
                ..last
            },
            phases
        );
        h.set(Health::Serving);
        assert_eq!(
            h.recoveries(),
            1,
            "serving again without a rebuild counts nothing"
        );
    }
}
