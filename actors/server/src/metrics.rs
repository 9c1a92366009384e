//! The counters and latency histograms behind `GET /metrics` (Prometheus text).

use crate::protocol::Finished;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Request latency buckets, seconds.
pub const BUCKETS: [f64; 9] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Counters behind `GET /metrics`.
#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub busy: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub active_sessions: AtomicI64,
    /// Connections open now, and those refused at the connection cap.
    pub connections: AtomicI64,
    pub connections_refused: AtomicU64,
    /// Bodies refused as too large.
    pub too_large: AtomicU64,
    ttft: Mutex<Histogram>,
    duration: Mutex<Histogram>,
}

#[derive(Default)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (b, le) in self.buckets.iter_mut().zip(BUCKETS) {
            if v <= le {
                *b += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (b, le) in self.buckets.iter().zip(BUCKETS) {
            out.push_str(&format!("{name}_bucket{{le=\"{le}\"}} {b}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {c}\n{name}_sum {s}\n{name}_count {c}\n",
            c = self.count,
            s = self.sum
        ));
    }
}

impl Metrics {
    pub fn record(&self, f: &Finished) {
        self.prompt_tokens
            .fetch_add(f.usage.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(f.usage.completion_tokens as u64, Ordering::Relaxed);
        if let Ok(mut h) = self.ttft.lock() {
            h.observe(f.timing.time_to_first_token_ms / 1e3);
        }
        if let Ok(mut h) = self.duration.lock() {
            h.observe(f.timing.total_ms / 1e3);
        }
    }

    /// Prometheus text exposition.
    /// `batches` is the decoder's (cohorts, session inputs) so far, `open` its open sessions.
    pub fn render(&self, queued: usize, batches: (u64, u64), open: u64) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, v: String| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        counter(
            "nsactor_requests_total",
            "Generation requests received.",
            "counter",
            get(&self.requests),
        );
        counter(
            "nsactor_requests_failed_total",
            "Requests that ended in an error.",
            "counter",
            get(&self.failed),
        );
        counter(
            "nsactor_requests_busy_total",
            "Requests refused because the server was full.",
            "counter",
            get(&self.busy),
        );
        counter(
            "nsactor_prompt_tokens_total",
            "Prompt tokens prefilled.",
            "counter",
            get(&self.prompt_tokens),
        );
        counter(
            "nsactor_completion_tokens_total",
            "Tokens generated.",
            "counter",
            get(&self.completion_tokens),
        );
        counter(
            "nsactor_active_sessions",
            "Sessions decoding now (their neuron states are held by the layer actors).",
            "gauge",
            self.active_sessions.load(Ordering::SeqCst).to_string(),
        );
        counter(
            "nsactor_connections",
            "Client connections open now.",
            "gauge",
            self.connections.load(Ordering::SeqCst).to_string(),
        );
        counter(
            "nsactor_connections_refused_total",
            "Connections refused because the connection cap was reached.",
            "counter",
            get(&self.connections_refused),
        );
        counter(
            "nsactor_requests_too_large_total",
            "Request bodies refused as larger than the limit (413).",
            "counter",
            get(&self.too_large),
        );
        counter(
            "nsactor_queued_sessions",
            "Requests waiting for a session slot.",
            "gauge",
            queued.to_string(),
        );
        counter(
            "nsactor_decode_open_sessions",
            "Sessions whose neuron states the layer actors hold.",
            "gauge",
            open.to_string(),
        );
        counter(
            "nsactor_decode_batches_total",
            "Batched passes through the layers (prompts and tokens of several sessions each).",
            "counter",
            batches.0.to_string(),
        );
        counter(
            "nsactor_decode_batch_inputs_total",
            "Session inputs carried by those passes (divided by the batches: the mean batch).",
            "counter",
            batches.1.to_string(),
        );
        if let Ok(h) = self.ttft.lock() {
            h.render(
                "nsactor_time_to_first_token_seconds",
                "Request received to first token.",
                &mut out,
            );
        }
        if let Ok(h) = self.duration.lock() {
            h.render(
                "nsactor_request_duration_seconds",
                "Request received to last token.",
                &mut out,
            );
        }
        out
    }
}
