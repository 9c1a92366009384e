//! What the metric families share: the crate's error, registering a metric in a registry,
//! raising a counter to a total kept elsewhere, and rendering a registry in the Prometheus text
//! exposition format.

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
