//! Draining on shutdown: once [`Drain::shutdown`] starts, new generations are refused (503,
//! "shutting down"), running ones may finish within the grace period, and those still running
//! then end within one token with the finish reason `shutdown`, their final event sent.

use crate::error::ServeError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

/// The finish reason of a generation the shutdown ended.
pub const FINISH_SHUTDOWN: &str = "shutdown";

/// The shutdown state every generation checks.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    /// `true` from the start of the shutdown (WebSocket connections close when idle then).
    draining_tx: watch::Sender<bool>,
    stopping: AtomicBool,
    running: AtomicUsize,
    changed: Notify,
}

/// A running generation, counted until dropped.
pub struct Running<'a>(&'a Drain);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Generations running when the shutdown began.
    pub running_at_start: usize,
    /// Of those, ended by the shutdown at the end of the grace period.
    pub stopped: usize,
    /// Still running when the wait for them gave up.
    pub left: usize,
}

impl Drain {
    /// Counts a new generation, or refuses it while shutting down.
    pub fn enter(&self) -> Result<Running<'_>, ServeError> {
        self.running.fetch_add(1, Ordering::SeqCst);
        let guard = Running(self);
        if self.draining.load(Ordering::SeqCst) {
            return Err(ServeError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        Ok(guard)
    }

    /// Whether the shutdown has begun (new generations are refused).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Turns `true` when the shutdown begins.
    pub fn draining_changes(&self) -> watch::Receiver<bool> {
        self.draining_tx.subscribe()
    }

    /// Whether running generations must end now.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Refuses new generations, waits up to `grace` for the running ones, then ends the rest
    /// (each within one token) and waits up to `stop_wait` for them.
    pub async fn shutdown(&self, grace: Duration, stop_wait: Duration) -> Drained {
        self.draining.store(true, Ordering::SeqCst);
        self.draining_tx.send_replace(true);
        let running_at_start = self.running();
        let idle = self.wait_idle(grace).await;
        let stopped = if idle { 0 } else { self.running() };
        if !idle {
            self.stopping.store(true, Ordering::SeqCst);
            self.wait_idle(stop_wait).await;
        }
        Drained {
            running_at_start,
            stopped,
            left: self.running(),
        }
    }

    /// Waits until no generation runs, up to `limit`; whether none does.
    async fn wait_idle(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            if self.running() == 0 {
                return true;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Woken by each end; the timeout also covers a wake-up lost to a race.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), changed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shutdown_refuses_new_work_waits_for_running_work_then_stops_it() {
        let d = std::sync::Arc::new(Drain::default());
        // Nothing running: done at once.
        let quick = Drain::default();
        let r = quick
            .shutdown(Duration::from_secs(5), Duration::from_secs(1))
            .await;
        assert_eq!((r.running_at_start, r.stopped, r.left), (0, 0, 0));
        assert!(matches!(quick.enter(), Err(ServeError::Unavailable(_))));
        assert_eq!(quick.running(), 0, "a refused entry is not counted");
        // One generation that finishes within the grace period, one that only stops when told.
        let finishing = {
            let d = d.clone();
            tokio::spawn(async move {
                let _g = d.enter().unwrap();
                tokio::time::sleep(Duration::from_millis(200)).await;
            })
        };
        let endless = {
            let d = d.clone();
            tokio::spawn(async move {
                let _g = d.enter().unwrap();
                while !d.stopping() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        };
        while d.running() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t = Instant::now();
        let r = d
            .shutdown(Duration::from_millis(600), Duration::from_secs(5))
            .await;
        assert_eq!((r.running_at_start, r.stopped, r.left), (2, 1, 0));
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(600) && took < Duration::from_secs(3),
            "{took:?}"
        );
        finishing.await.unwrap();
        endless.await.unwrap();
    }
}
