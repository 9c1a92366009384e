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

/// How a micro-batch ended.
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
}

/// Travels with a micro-batch's messages: where its end is reported.
#[derive(Clone)]
pub struct StepCtx {
    pub(crate) events: tokio::sync::mpsc::Sender<Event>,
    /// `depth-first` schedule: workers order jobs by micro-batch within a class.
    pub(crate) depth_first: bool,
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
}
