//! nsactor's metrics on the [`prometheus`] crate: one registry per server
//! ([`ServingMetrics`], named as deployers scrape vLLM: `nsactor_num_requests_running`,
//! `nsactor_time_to_first_token_seconds`, …) and one per training run ([`TrainingMetrics`]:
//! loss, tokens/s, E[K], step time), exposed in the Prometheus text format by the server's
//! `GET /metrics` and, for training, by the small exporter of [`exporter`] on
//! `--metrics-addr`. The names and their meaning are listed in `docs/GUIDE.md` (Metrics).

pub mod exporter;
pub mod serving;
pub mod training;

pub use exporter::Exporter;
pub use serving::ServingMetrics;
pub use training::TrainingMetrics;

use prometheus::{Encoder, Registry, TextEncoder};

/// Why a metric could not be registered or exposed.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metric registration: {0}")]
    Register(#[from] prometheus::Error),
    #[error("cannot listen for metrics on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything `registry` holds, in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .expect("the text encoder writes into memory");
    String::from_utf8(out).expect("the text format is UTF-8")
}

/// Registers `metric` in `registry` and hands it back (the handle the caller keeps).
pub(crate) fn registered<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: M,
) -> Result<M, TelemetryError> {
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

/// Raises `counter` to `total` (a monotonic count kept elsewhere, read at scrape time).
pub(crate) fn raise_to(counter: &prometheus::IntCounter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}
