//! The server's registry. Names follow what deployers scrape from vLLM (`vllm:…` there,
//! `nsactor_…` here): requests by outcome, tokens in and out, requests running and waiting,
//! time to first token, inter-token latency and end-to-end latency histograms, plus the
//! connection limits and the decoder's batching.

use crate::registry::{TelemetryError, raise_to, registered, render};
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// Time to first token buckets, seconds (vLLM's).
const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];
/// Inter-token latency buckets, seconds.
const ITL: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
];
/// End-to-end request latency buckets, seconds.
const E2E: &[f64] = &[
    0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
    480.0, 960.0,
];
/// Tokens per request buckets.
const TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];

/// The counters, gauges and histograms behind the server's `GET /metrics`.
pub struct ServingMetrics {
    registry: Registry,
    /// Generations started, one per choice (`nsactor_requests_total`): with the finished
    /// and failed counts, every generation is counted once at its start and once at its end.
    pub requests: IntCounter,
    /// Requests that finished, by `finished_reason` (stop, length, cancelled, …).
    pub request_success: IntCounterVec,
    pub requests_failed: IntCounter,
    /// Requests refused because the server was full.
    pub requests_busy: IntCounter,
    pub requests_too_large: IntCounter,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    /// Requests decoding now.
    pub running: IntGauge,
    /// Requests waiting for a session slot (set at scrape time).
    pub waiting: IntGauge,
    pub connections: IntGauge,
    pub connections_refused: IntCounter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    decode_open_sessions: IntGauge,
    decode_batches: IntCounter,
    decode_batch_inputs: IntCounter,
    decode_window_launches: IntCounter,
    decode_recoveries: IntCounter,
    decode_healthy: IntGauge,
    prefill_chunk_tokens: IntGauge,
    decode_step_seconds: Gauge,
    prefix_counters: [IntCounter; 5],
    prefix_gauges: [IntGauge; 4],
}

/// What the prefix state cache reports at scrape time (`nsactor_decoding::prefix`).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixCacheState {
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens not prefilled thanks to hits.
    pub tokens_saved: u64,
    /// Snapshots dropped, and moved from the devices to the host.
    pub evictions: u64,
    pub to_host: u64,
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub entries: u64,
    /// Host bytes of scored prompts' log-probabilities kept beside snapshots.
    pub score_bytes: u64,
}

/// What the decoder reports at scrape time.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecoderState {
    /// Requests waiting for a session slot.
    pub queued: u64,
    /// Sessions whose neuron states the layer actors hold.
    pub open_sessions: u64,
    /// Batched passes so far and the session inputs they carried.
    pub batches: u64,
    pub batch_inputs: u64,
    /// Passes launched when the launch window ran out with open sessions still away.
    pub window_launches: u64,
    /// Rebuilds after a lost stage that brought decoding back.
    pub recoveries: u64,
    /// Decoding runs (not rebuilding after a lost stage, not failed).
    pub healthy: bool,
    /// Tokens of the next chunk of a prompt fed beside decoding streams
    /// (`nsactor_decoding::pacer`).
    pub chunk_tokens: u64,
    /// Running mean of a decoding step's seconds (0 before the first).
    pub step_seconds: f64,
    pub prefix: PrefixCacheState,
}

impl Default for ServingMetrics {
    /// [`ServingMetrics::new`]: its names are fixed, valid and distinct, so registering
    /// them cannot fail (the crate's tests build one).
    fn default() -> Self {
        Self::new().expect("fixed, valid, distinct metric names")
    }
}

impl ServingMetrics {
    pub fn new() -> Result<Self, TelemetryError> {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| -> Result<IntCounter, TelemetryError> {
            registered(&registry, IntCounter::new(name, help)?)
        };
        let gauge = |name: &str, help: &str| -> Result<IntGauge, TelemetryError> {
            registered(&registry, IntGauge::new(name, help)?)
        };
        let histogram =
            |name: &str, help: &str, buckets: &[f64]| -> Result<Histogram, TelemetryError> {
                let h =
                    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let request_success = IntCounterVec::new(
            Opts::new(
                "nsactor_request_success_total",
                "Requests that finished, by finish reason.",
            ),
            &["finished_reason"],
        )?;
        registry.register(Box::new(request_success.clone()))?;
        Ok(ServingMetrics {
            requests: counter(
                "nsactor_requests_total",
                "Generations started (one per choice: an OpenAI request with n = 4 or a batch of 4 prompts counts 4; one per WebSocket generate).",
            )?,
            request_success,
            requests_failed: counter(
                "nsactor_requests_failed_total",
                "Requests that ended in an error.",
            )?,
            requests_busy: counter(
                "nsactor_requests_busy_total",
                "Requests refused because the server was full.",
            )?,
            requests_too_large: counter(
                "nsactor_requests_too_large_total",
                "Request bodies refused as larger than the limit (413).",
            )?,
            prompt_tokens: counter("nsactor_prompt_tokens_total", "Prompt tokens prefilled.")?,
            generation_tokens: counter("nsactor_generation_tokens_total", "Tokens generated.")?,
            running: gauge("nsactor_num_requests_running", "Requests decoding now.")?,
            waiting: gauge(
                "nsactor_num_requests_waiting",
                "Requests waiting for a session slot.",
            )?,
            connections: gauge("nsactor_connections", "Client connections open now.")?,
            connections_refused: counter(
                "nsactor_connections_refused_total",
                "Connections refused because the connection cap was reached.",
            )?,
            time_to_first_token: histogram(
                "nsactor_time_to_first_token_seconds",
                "Request received to first token.",
                TTFT,
            )?,
            inter_token_latency: histogram(
                "nsactor_inter_token_latency_seconds",
                "Time between two consecutive generated tokens of a request.",
                ITL,
            )?,
            e2e_latency: histogram(
                "nsactor_e2e_request_latency_seconds",
                "Request received to last token.",
                E2E,
            )?,
            request_prompt_tokens: histogram(
                "nsactor_request_prompt_tokens",
                "Prompt tokens per finished request.",
                TOKENS,
            )?,
            request_generation_tokens: histogram(
                "nsactor_request_generation_tokens",
                "Generated tokens per finished request.",
                TOKENS,
            )?,
            decode_open_sessions: gauge(
                "nsactor_decode_open_sessions",
                "Sessions whose neuron states the layer actors hold.",
            )?,
            decode_batches: counter(
                "nsactor_decode_batches_total",
                "Batched passes through the layers (prompts and tokens of several sessions each).",
            )?,
            decode_batch_inputs: counter(
                "nsactor_decode_batch_inputs_total",
                "Session inputs carried by those passes (divided by the batches: the mean batch).",
            )?,
            decode_window_launches: counter(
                "nsactor_decode_window_launches_total",
                "Passes launched only when the launch window ran out, with open sessions still away \
                 (each made the waiting sessions wait the window for them).",
            )?,
            decode_recoveries: counter(
                "nsactor_decode_recoveries_total",
                "Times decoding lost a stage (a panic, a stopped actor), rebuilt every actor and \
                 reloaded its weights.",
            )?,
            decode_healthy: gauge(
                "nsactor_decode_healthy",
                "1 while decoding runs; 0 while it rebuilds after a lost stage, or has failed.",
            )?,
            prefill_chunk_tokens: gauge(
                "nsactor_prefill_chunk_tokens",
                "Tokens of the next chunk of a prompt fed beside decoding streams: paced so its \
                 pass takes at most --prefill-chunk-share of a decoding step.",
            )?,
            decode_step_seconds: registered(
                &registry,
                Gauge::new(
                    "nsactor_decode_step_seconds",
                    "Running mean of one decoding step's seconds (a pass of one token for every \
                     running session).",
                )?,
            )?,
            prefix_counters: [
                counter(
                    "nsactor_prefix_cache_hits_total",
                    "Requests that started from a cached snapshot of their prompt's prefix.",
                )?,
                counter(
                    "nsactor_prefix_cache_misses_total",
                    "Requests through the prefix cache that found no snapshot.",
                )?,
                counter(
                    "nsactor_prefix_cache_tokens_saved_total",
                    "Prompt tokens not prefilled because a snapshot covered them.",
                )?,
                counter(
                    "nsactor_prefix_cache_evictions_total",
                    "Snapshots dropped to stay within the cache's budgets.",
                )?,
                counter(
                    "nsactor_prefix_cache_to_host_total",
                    "Snapshots moved from the devices to the host tier.",
                )?,
            ],
            prefix_gauges: [
                gauge(
                    "nsactor_prefix_cache_device_bytes",
                    "Device bytes the prefix cache's snapshots hold.",
                )?,
                gauge(
                    "nsactor_prefix_cache_host_bytes",
                    "Host bytes the prefix cache's snapshots hold.",
                )?,
                gauge(
                    "nsactor_prefix_cache_entries",
                    "Snapshots the prefix cache holds.",
                )?,
                gauge(
                    "nsactor_prefix_cache_score_bytes",
                    "Host bytes of scored prompts' log-probabilities kept beside snapshots.",
                )?,
            ],
            registry,
        })
    }

    /// Records a finished request: its tokens, latencies and finish reason.
    pub fn finished(
        &self,
        reason: &str,
        (prompt, generated): (u64, u64),
        (ttft, total): (f64, f64),
    ) {
        self.prompt_tokens.inc_by(prompt);
        self.generation_tokens.inc_by(generated);
        self.request_prompt_tokens.observe(prompt as f64);
        self.request_generation_tokens.observe(generated as f64);
        self.time_to_first_token.observe(ttft);
        self.e2e_latency.observe(total);
        self.request_success.with_label_values(&[reason]).inc();
    }

    /// The text exposition, with the decoder's state read now.
    pub fn render(&self, d: DecoderState) -> String {
        self.waiting.set(d.queued as i64);
        self.decode_open_sessions.set(d.open_sessions as i64);
        raise_to(&self.decode_batches, d.batches);
        raise_to(&self.decode_batch_inputs, d.batch_inputs);
        raise_to(&self.decode_window_launches, d.window_launches);
        raise_to(&self.decode_recoveries, d.recoveries);
        self.decode_healthy.set(i64::from(d.healthy));
        self.prefill_chunk_tokens.set(d.chunk_tokens as i64);
        self.decode_step_seconds.set(d.step_seconds);
        let p = d.prefix;
        let counts = [p.hits, p.misses, p.tokens_saved, p.evictions, p.to_host];
        for (c, v) in self.prefix_counters.iter().zip(counts) {
            raise_to(c, v);
        }
        for (g, v) in
            self.prefix_gauges
                .iter()
                .zip([p.device_bytes, p.host_bytes, p.entries, p.score_bytes])
        {
            g.set(v as i64);
        }
        render(&self.registry)
    }
}
