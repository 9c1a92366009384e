//! What travels with a training micro-batch: its ponder statistics so far ([`Ponder`]), how it
//! ended ([`Event`]), and where that is reported ([`StepCtx`]).

use nsactor_plugin_api::{EngineError, MicroBatchId};

/// Ponder statistics accumulated over the layers a micro-batch has passed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ponder {
    /// Σ over layers of the layer's mean E[K].
    pub sum: f64,
    pub min: f64,
    pub max: f64,
}

impl Default for Ponder {
    fn default() -> Self {
        Ponder {
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }
}

impl Ponder {
    pub(crate) fn add(&mut self, mean: f64, min: f64, max: f64) {
        self.sum += mean;
        self.min = self.min.min(min);
        self.max = self.max.max(max);
    }
}

/// How a micro-batch ended, or (data parallelism) that a replica's layer has finished the
/// step's backward passes.
pub enum Event {
    Done {
        micro: MicroBatchId,
        ce: f64,
        ponder: Ponder,
    },
    Failed {
        who: String,
        micro: MicroBatchId,
        error: EngineError,
    },
    /// Replica `replica`'s layer `layer` has run the backward of every micro-batch of its
    /// share: its gradients can be reduced while the other layers go on.
    LayerReady { replica: usize, layer: usize },
}

/// Counts a replica's backward passes per layer during a step, so that each layer can say
/// when it has done its share ([`Event::LayerReady`]).
pub struct Tally {
    replica: usize,
    /// Micro-batches of the replica's share.
    expected: usize,
    done: Vec<std::sync::atomic::AtomicUsize>,
}

impl Tally {
    pub fn new(replica: usize, expected: usize, layers: usize) -> Self {
        Tally {
            replica,
            expected,
            done: (0..layers).map(|_| Default::default()).collect(),
        }
    }
}

/// Travels with a micro-batch's messages: where its end is reported.
#[derive(Clone)]
pub struct StepCtx {
    pub(crate) events: tokio::sync::mpsc::Sender<Event>,
    /// `depth-first` schedule: workers order jobs by micro-batch within a class.
    pub(crate) depth_first: bool,
    /// Data parallelism: the replica's backward passes per layer.
    pub(crate) tally: Option<std::sync::Arc<Tally>>,
}

impl StepCtx {
    /// The worker priority of `class` work on `micro` under this step's schedule.
    pub(crate) fn key(&self, micro: MicroBatchId) -> u64 {
        if self.depth_first { micro.0 } else { 0 }
    }

    pub(crate) async fn send(&self, e: Event) {
        // The supervisor only stops listening once it has given up on the step.
        let _ = self.events.send(e).await;
    }

    /// Layer `layer` finished a backward pass of this step; the last of its replica's share
    /// reports [`Event::LayerReady`].
    pub(crate) async fn backward_done(&self, layer: usize) {
        let Some(t) = &self.tally else { return };
        let n = t.done[layer].fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n == t.expected {
            self.send(Event::LayerReady {
                replica: t.replica,
                layer,
            })
            .await;
        }
    }
}

/// The replica that runs micro-batch `i` of `m` when `d` replicas share them (contiguous
/// shares of ⌊m/d⌋ or ⌈m/d⌉).
pub(crate) fn owner(i: usize, m: usize, d: usize) -> usize {
    // Replica r starts at r·m/d; the owner is the last replica starting at or before i.
    (0..d).rev().find(|&r| r * m / d <= i).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::owner;

    #[test]
    fn shares_are_contiguous_and_even() {
        let who: Vec<usize> = (0..7).map(|i| owner(i, 7, 3)).collect();
        assert_eq!(who, [0, 0, 1, 1, 2, 2, 2]);
        let who: Vec<usize> = (0..4).map(|i| owner(i, 4, 2)).collect();
        assert_eq!(who, [0, 0, 1, 1]);
        assert!((0..5).all(|i| owner(i, 5, 1) == 0));
    }
}
