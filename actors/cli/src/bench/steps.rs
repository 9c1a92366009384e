//! What `bench train` measured per timed step, and the means over them.

use nsactor_plugin_api::timing::DeviceTime;

/// One timed training step of `nsactor bench train`.
#[derive(Debug, Clone)]
pub struct TrainStepTiming {
    pub seconds: f64,
    pub loss: f64,
    /// Per worker (edge, then stages): seconds spent in stage calls during this step.
    pub busy: Vec<f64>,
    /// Per worker: of `busy`, seconds spent issuing the moves of its inputs from another device.
    pub transfer: Vec<f64>,
    /// Per device: where this step's device time went (empty where not measured).
    pub device: Vec<DeviceTime>,
}

/// What `nsactor bench train` measured.
#[derive(Debug, Clone)]
pub struct TrainBench {
    pub tokens_per_step: usize,
    pub warmup: Vec<TrainStepTiming>,
    pub steps: Vec<TrainStepTiming>,
    /// Worker names, in the order of [`TrainStepTiming::busy`].
    pub workers: Vec<String>,
    /// Why the device-time breakdown is missing, where it is.
    pub device_note: Option<String>,
}

impl TrainBench {
    /// Median step time of the timed steps.
    pub fn median_step_s(&self) -> f64 {
        let mut t: Vec<f64> = self.steps.iter().map(|s| s.seconds).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_step as f64 / self.median_step_s()
    }

    /// Mean busy seconds per timed step of each worker.
    pub fn mean_busy(&self) -> Vec<f64> {
        self.mean_per_worker(|s| &s.busy)
    }

    /// Mean transfer seconds per timed step of each worker.
    pub fn mean_transfer(&self) -> Vec<f64> {
        self.mean_per_worker(|s| &s.transfer)
    }

    /// Each device's breakdown summed over the timed steps, divided by their number; empty
    /// where it was not measured.
    pub fn mean_device(&self) -> Vec<DeviceTime> {
        let mut sum: Vec<DeviceTime> = Vec::new();
        for s in &self.steps {
            for d in &s.device {
                match sum.iter_mut().find(|x| x.device == d.device) {
                    Some(x) => x.add(d),
                    None => sum.push(d.clone()),
                }
            }
        }
        let n = self.steps.len().max(1) as f64;
        sum.iter_mut().for_each(|d| d.scale(1.0 / n));
        sum
    }

    fn mean_per_worker(&self, field: impl Fn(&TrainStepTiming) -> &Vec<f64>) -> Vec<f64> {
        (0..self.workers.len())
            .map(|w| self.steps.iter().map(|s| field(s)[w]).sum::<f64>() / self.steps.len() as f64)
            .collect()
    }
}
