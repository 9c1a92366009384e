//! Self-healing decoding. A stage that panics while it decodes loses its state (its worker
//! keeps the panic in the stage's slot, `nsactor_pipeline::holder`), and an actor that stops takes its
//! stage with it; until now every later pass failed on it. Now the batcher fails the sessions
//! whose states went with it, stops launching, and asks the supervisor to rebuild every actor
//! over fresh stages and load the weights again from where they first came from
//! ([`WeightSource`]: the serving command's checkpoint, read and verified anew;
//! `SupState::heal` in `nsactor_pipeline::recovery`). Inputs that
//! arrive meanwhile wait and run on the new actors. [`RestartPolicy`] bounds how often this may
//! happen (Erlang's restart intensity); past it, or when a rebuild fails, decoding has
//! [`Health::Failed`] and refuses everything. [`HealthCell`] tells servers where it stands.

use nsactor_engine::RuntimeError;
pub use nsactor_engine::supervision::{RestartPolicy, Restarts};
pub use nsactor_pipeline::heal::{HealTimings, WeightSource};
use nsactor_plugin_api::EngineError;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::watch;

/// Where decoding stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Health {
    #[default]
    Serving,
    /// A stage was lost (`cause`) and the actors are being rebuilt; new inputs wait.
    Recovering { cause: String },
    /// A rebuild failed, or stages were lost more often than the [`RestartPolicy`] allows:
    /// every input is refused.
    Failed { cause: String },
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
    use std::time::Duration;

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
