//! The loss-spike guard (`[train] loss_spike_factor`): judges each step's loss against the
//! running mean of the steps before it, before the optimizer runs. A spiking step makes no
//! update; the supervisor then rolls the run back to the newest checkpoint and skips the
//! batches from there through the spike ([`SupState::roll_back_spike`](super::supervisor)).

use std::collections::VecDeque;

/// The running mean of the last `window` updated steps' losses, and the factor over it that
/// counts as a spike (`0`: off).
#[derive(Debug, Clone)]
pub struct SpikeGuard {
    factor: f64,
    window: usize,
    recent: VecDeque<f64>,
    /// Rollbacks to one checkpoint step: (step, count), reset by a rollback elsewhere.
    repeats: (u64, u32),
}

impl SpikeGuard {
    pub fn new(factor: f64, window: usize) -> Self {
        SpikeGuard {
            factor,
            window: window.max(1),
            recent: VecDeque::new(),
            repeats: (u64::MAX, 0),
        }
    }

    /// The running mean when `loss` spikes over it; `None` when the guard is off, has not yet
    /// seen `window` steps, or the loss is within bounds.
    pub fn judge(&self, loss: f64) -> Option<f64> {
        if self.factor <= 0.0 || self.recent.len() < self.window {
            return None;
        }
        let mean = self.recent.iter().sum::<f64>() / self.recent.len() as f64;
        (loss > self.factor * mean).then_some(mean)
    }

    /// Counts the loss of a step that updated the model.
    pub fn record(&mut self, loss: f64) {
        if !loss.is_finite() {
            return;
        }
        self.recent.push_back(loss);
        while self.recent.len() > self.window {
            self.recent.pop_front();
        }
    }

    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// Counts a rollback to `step`; returns how many went back to that step since the last
    /// rollback to another one.
    pub fn rolled_back_to(&mut self, step: u64) -> u32 {
        self.repeats = match self.repeats {
            (s, n) if s == step => (s, n + 1),
            _ => (step, 1),
        };
        self.repeats.1
    }
}

#[cfg(test)]
mod tests {
    use super::SpikeGuard;

    #[test]
    fn judges_only_after_a_full_window_and_only_above_the_factor() {
        let mut g = SpikeGuard::new(3.0, 4);
        for l in [2.0, 2.0, 2.0] {
            assert_eq!(g.judge(100.0), None, "fewer than `window` steps seen");
            g.record(l);
        }
        g.record(f64::NAN);
        assert_eq!(g.judge(100.0), None, "a non-finite loss is not counted");
        g.record(6.0);
        // mean 3.0: 9.0 is the bound, not a spike; 9.5 is.
        assert_eq!(g.judge(9.0), None);
        assert_eq!(g.judge(9.5), Some(3.0));
        // The window slides: the oldest 2.0 leaves.
        g.record(2.0);
        assert_eq!(g.judge(9.5), Some(3.0));
        g.record(10.0);
        assert_eq!(g.judge(15.0), None, "mean 5.0 now");
    }

    #[test]
    fn off_by_default_and_counts_repeated_rollbacks() {
        let mut g = SpikeGuard::new(0.0, 1);
        g.record(1.0);
        assert_eq!(g.judge(1e9), None);
        assert_eq!(g.rolled_back_to(4), 1);
        assert_eq!(g.rolled_back_to(4), 2);
        assert_eq!(g.rolled_back_to(8), 1);
        assert_eq!(g.factor(), 0.0);
    }
}
