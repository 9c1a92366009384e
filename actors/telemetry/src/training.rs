//! A training run's registry (served on `--metrics-addr`): the step, loss, held-out loss,
//! learning rate, E[K], gradient norm, throughput and step time, and counters of the tokens
//! seen and of the recoveries, skipped steps and loss spikes. `metrics.jsonl` keeps the
//! per-step history; this is its live view for a dashboard.

use crate::registry::{TelemetryError, registered, render};
use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Registry};

/// Step time buckets, seconds.
const STEP: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0,
];

/// The gauges and counters of one training run.
pub struct TrainingMetrics {
    registry: Registry,
    pub step: IntGauge,
    pub loss: Gauge,
    pub eval_loss: Gauge,
    pub learning_rate: Gauge,
    pub expected_k: Gauge,
    pub grad_norm: Gauge,
    pub tokens_per_second: Gauge,
    pub step_seconds: Histogram,
    pub tokens: IntCounter,
    pub skipped_steps: IntCounter,
    pub recoveries: IntCounter,
    pub loss_spikes: IntCounter,
}

/// What one finished step reports.
#[derive(Debug, Clone, Copy)]
pub struct StepSample {
    pub step: u64,
    /// None when the step scored no token.
    pub loss: Option<f64>,
    pub lr: f64,
    pub expected_k: f64,
    pub grad_norm: f64,
    pub tokens: u64,
    pub tokens_per_second: f64,
    pub seconds: f64,
    pub skipped: bool,
}

impl TrainingMetrics {
    pub fn new() -> Result<Self, TelemetryError> {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| -> Result<Gauge, TelemetryError> {
            registered(&registry, Gauge::new(name, help)?)
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter, TelemetryError> {
            registered(&registry, IntCounter::new(name, help)?)
        };
        let step = IntGauge::new("nsactor_train_step", "The last optimizer step finished.")?;
        registry.register(Box::new(step.clone()))?;
        let step_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "nsactor_train_step_seconds",
                "Wall time of an optimizer step (all its micro-batches).",
            )
            .buckets(STEP.to_vec()),
        )?;
        registry.register(Box::new(step_seconds.clone()))?;
        let eval_loss = gauge(
            "nsactor_train_eval_loss",
            "Held-out cross entropy at the last evaluation (NaN before the first).",
        )?;
        eval_loss.set(f64::NAN);
        Ok(TrainingMetrics {
            step,
            loss: gauge(
                "nsactor_train_loss",
                "Loss of the last step that scored a token (cross entropy plus the ponder term).",
            )?,
            eval_loss,
            learning_rate: gauge(
                "nsactor_train_learning_rate",
                "Learning rate of the last step.",
            )?,
            expected_k: gauge(
                "nsactor_train_expected_k",
                "E[K], PLIF steps per token averaged over layers, at the last step.",
            )?,
            grad_norm: gauge(
                "nsactor_train_grad_norm",
                "Gradient norm of the last step, before clipping.",
            )?,
            tokens_per_second: gauge(
                "nsactor_train_tokens_per_second",
                "Scored tokens per second since the run (or its resume) started.",
            )?,
            step_seconds,
            tokens: counter("nsactor_train_tokens_total", "Scored tokens trained on.")?,
            skipped_steps: counter(
                "nsactor_train_skipped_steps_total",
                "Steps skipped for a non-finite loss or gradient norm.",
            )?,
            recoveries: counter(
                "nsactor_train_recoveries_total",
                "In-process recoveries (actors rebuilt, rolled back to a checkpoint).",
            )?,
            loss_spikes: counter(
                "nsactor_train_loss_spikes_total",
                "Loss spikes the guard rolled back from.",
            )?,
            registry,
        })
    }

    /// Records one finished step.
    pub fn record(&self, s: &StepSample) {
        self.step.set(s.step as i64);
        if let Some(l) = s.loss {
            self.loss.set(l);
        }
        self.learning_rate.set(s.lr);
        self.expected_k.set(s.expected_k);
        self.grad_norm.set(s.grad_norm);
        self.tokens_per_second.set(s.tokens_per_second);
        self.step_seconds.observe(s.seconds);
        self.tokens.inc_by(s.tokens);
        if s.skipped {
            self.skipped_steps.inc();
        }
    }

    /// The registry, for an [`Exporter`](crate::Exporter).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        render(&self.registry)
    }
}
