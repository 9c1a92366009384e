//! One restart policy for everything in nsactor that restarts something, Erlang's way: at most
//! `max_restarts` restarts within any `window` (a supervisor's intensity and period), each after
//! a backoff that doubles with the restarts already in the window. One more within the window
//! and the supervisor gives up, saying why. What is restarted is each user's own:
//!
//! * training's in-process recovery rebuilds the actors after one fails
//!   (`[train] max_restarts` within `[train] restart_window_s`), and rolls back to the newest
//!   checkpoint after a loss spike ([`RestartPolicy::rollback`]: the same count per checkpoint);
//! * decoding rebuilds the actors after a lost stage (`nsactor serve --max-rebuilds` within
//!   `--rebuild-window`);
//! * the process agent starts a dead training process again (`nsactor train --max-restarts`
//!   within `--restart-window`, after `--restart-backoff`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The longest backoff a doubling may reach.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How often something may be restarted, and how long to wait before each restart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window`.
    pub max_restarts: u32,
    pub window: Duration,
    /// The wait before the first restart in the window; it doubles with each further one, up to
    /// [`MAX_BACKOFF`]. Zero: restart at once.
    pub backoff: Duration,
}

impl Default for RestartPolicy {
    /// Three restarts within ten minutes, at once.
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
            backoff: Duration::ZERO,
        }
    }
}

impl RestartPolicy {
    /// At most `max_restarts` within `window`, at once.
    pub fn new(max_restarts: u32, window: Duration) -> Self {
        RestartPolicy {
            max_restarts,
            window,
            backoff: Duration::ZERO,
        }
    }

    /// The wait before a restart that is the `nth` (1-based) within the window.
    pub fn delay(&self, nth: usize) -> Duration {
        let doublings = nth.saturating_sub(1).min(16) as u32;
        (self.backoff * 2u32.pow(doublings)).min(MAX_BACKOFF)
    }

    /// Whether a run may roll back to the same checkpoint once more after `rollbacks` rollbacks
    /// to it (loss spikes): the same bound as restarts, counted per checkpoint.
    pub fn rollback(&self, rollbacks: u32) -> bool {
        rollbacks < self.max_restarts
    }

    /// What the policy allows, for messages: "3 restart(s) within 600 s".
    pub fn describe(&self, what: &str) -> String {
        format!(
            "{} {what}(s) within {} s",
            self.max_restarts,
            self.window.as_secs_f64()
        )
    }
}

/// The restarts within the last window, and whether one more is allowed.
#[derive(Debug, Default)]
pub struct Restarts {
    times: VecDeque<Instant>,
}

/// A restart the policy allows: its place in the window and the wait before it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allowed {
    /// 1 for the first restart within the window.
    pub nth: usize,
    pub delay: Duration,
}

impl Restarts {
    /// Counts a restart at `now` if `policy` allows one more within its window (and says how
    /// long to wait before it); `None` (and nothing counted) otherwise.
    pub fn allow(&mut self, policy: &RestartPolicy, now: Instant) -> Option<Allowed> {
        while self
            .times
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= policy.window)
        {
            self.times.pop_front();
        }
        if self.times.len() >= policy.max_restarts as usize {
            return None;
        }
        self.times.push_back(now);
        let nth = self.times.len();
        Some(Allowed {
            nth,
            delay: policy.delay(nth),
        })
    }

    /// Restarts counted within the window (as of the last [`allow`](Self::allow)).
    pub fn len(&self) -> usize {
        self.times.len()
    }

    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_n_restarts_within_the_window_each_after_a_doubling_backoff() {
        let p = RestartPolicy {
            max_restarts: 2,
            window: Duration::from_secs(10),
            backoff: Duration::from_secs(1),
        };
        let mut r = Restarts::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(r.allow(&p, t0).map(|a| (a.nth, a.delay)), Some((1, s(1))));
        assert_eq!(
            r.allow(&p, t0 + s(1)).map(|a| (a.nth, a.delay)),
            Some((2, s(2)))
        );
        // A third within ten seconds of the first: refused, and not counted.
        assert_eq!(r.allow(&p, t0 + s(9)), None);
        assert_eq!(r.len(), 2);
        // Once the first has left the window, one more.
        assert_eq!(r.allow(&p, t0 + s(10)).map(|a| a.nth), Some(2));
        // Zero allowed: never.
        assert_eq!(
            Restarts::default().allow(&RestartPolicy::new(0, s(5)), t0),
            None
        );
        // The backoff stops doubling at a minute.
        assert_eq!(p.delay(30), MAX_BACKOFF);
        assert!(p.rollback(1) && !p.rollback(2));
    }

    #[test]
    fn the_backoff_doubles_up_to_a_minute() {
        let p = RestartPolicy {
            max_restarts: 9,
            window: Duration::from_secs(60),
            backoff: Duration::from_secs(1),
        };
        let d: Vec<u64> = (1..=8).map(|n| p.delay(n).as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 8, 16, 32, 60, 60]);
    }
}
