//! The per-step [`Lanes`] every stage reduction runs under: a bound on the reductions in
//! flight, and, where stages all-reduce through the backend's collectives, the turns that give
//! every rank of a communicator the same order of calls.
//!
//! Every rank must issue its all-reduces on a communicator in the same order, while the
//! stages' reductions start as their layers finish the backward, in whatever order the
//! replicas' and ranks' timing gives; so each step has a fixed order, the last layer first and
//! the edge last (the backward's own order), and a reduction waits for its turn
//! ([`Lanes::turn`]) before it all-reduces. A step that fails before every stage was started
//! abandons the turns ([`Lanes::abandon`]) so that no reduction waits for one that never comes.

use nsactor_engine::error::RuntimeError;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, Semaphore};

/// Stage reductions running at once. Each holds up to two extra copies of its stage's
/// gradients on replica 0's device; with every stage at once, the end of a step's backward
/// asked 0.9B on an H100 for gigabytes more than one replica's training needs and ran out.
pub(crate) const REDUCTION_LANES: usize = 2;

/// One step's reduction permits and all-reduce turns (module docs).
pub(super) struct Lanes {
    permits: Arc<Semaphore>,
    /// Position in the step's order of the all-reduce that may run now.
    turn: Mutex<usize>,
    bell: Notify,
    abandoned: AtomicBool,
    layers: usize,
}

/// Holds a turn; the next stage's comes when it is dropped.
pub(super) struct Turn<'a>(&'a Lanes);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self.0.turn.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.bell.notify_waiters();
    }
}

impl Lanes {
    pub fn new(layers: usize) -> Arc<Lanes> {
        Arc::new(Lanes {
            permits: Arc::new(Semaphore::new(REDUCTION_LANES)),
            turn: Mutex::new(0),
            bell: Notify::new(),
            abandoned: AtomicBool::new(false),
            layers,
        })
    }

    /// Stage `k`'s place in the order: layer `L - 1` (stage `L`) first, the edge (stage 0)
    /// last.
    fn position(&self, k: usize) -> usize {
        match k {
            0 => self.layers,
            k => self.layers - k,
        }
    }

    /// Waits until stage `k` may all-reduce.
    pub async fn turn(&self, k: usize) -> Result<Turn<'_>, RuntimeError> {
        let mine = self.position(k);
        loop {
            let mut rung = pin!(self.bell.notified());
            rung.as_mut().enable();
            if self.abandoned.load(Ordering::SeqCst) {
                return Err(RuntimeError::Runtime(
                    "the step failed before every stage's reduction started".into(),
                ));
            }
            if *self.turn.lock().unwrap_or_else(|e| e.into_inner()) == mine {
                return Ok(Turn(self));
            }
            rung.await;
        }
    }

    /// One of the step's reduction permits, held until dropped.
    pub async fn lane(&self) -> Result<tokio::sync::OwnedSemaphorePermit, RuntimeError> {
        self.permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| RuntimeError::Runtime(format!("reduction lanes: {e}")))
    }

    /// The step failed before every reduction was started: the waiting ones give up.
    pub fn abandon(&self) {
        self.abandoned.store(true, Ordering::SeqCst);
        self.bell.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stages_take_their_turns_last_layer_first_and_the_edge_last_whatever_order_they_ask() {
        let lanes = Lanes::new(4);
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Asked edge first, then layers in a scrambled order.
        for k in [0, 2, 4, 1, 3] {
            let (lanes, order) = (lanes.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _turn = lanes.turn(k).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
                order.lock().unwrap().push(k);
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![4, 3, 2, 1, 0]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_step_releases_the_stages_waiting_for_a_turn_that_never_comes() {
        let lanes = Lanes::new(3);
        // Layer 1's stage (2) waits for layer 2's (3), which never starts.
        let waiting = {
            let lanes = lanes.clone();
            tokio::spawn(async move { lanes.turn(2).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "it must wait for layer 2's turn");
        lanes.abandon();
        let r = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("released")
            .unwrap();
        assert!(r.unwrap_err().to_string().contains("step failed"));
    }
}
