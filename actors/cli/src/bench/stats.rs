//! Repeated timings and their spread, and the figures of one `bench serve` level.

use nsactor_plugin_api::EngineError;
use std::time::Instant;

/// Median and spread of repeated timings, in nanoseconds per call.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median_ns: f64,
    pub p10_ns: f64,
    pub p90_ns: f64,
}

pub fn time<F: FnMut() -> Result<(), EngineError>>(
    iters: usize,
    reps: usize,
    mut f: F,
) -> Result<Spread, EngineError> {
    for _ in 0..iters.min(1000) {
        f()?;
    }
    let mut per_call: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            Ok(t.elapsed().as_nanos() as f64 / iters as f64)
        })
        .collect::<Result<_, EngineError>>()?;
    per_call.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| per_call[((per_call.len() - 1) as f64 * q).round() as usize];
    Ok(Spread {
        median_ns: at(0.5),
        p10_ns: at(0.1),
        p90_ns: at(0.9),
    })
}

pub fn pct(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One concurrency level of `nsactor bench serve`.
#[derive(Debug, Clone)]
pub struct ServeTimings {
    pub sessions: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Generated tokens over the wall time of the whole batch of requests.
    pub tokens_per_s: f64,
    /// Different outputs among the clients (1 when greedy clients agree).
    pub distinct: usize,
    /// The median wait for the first chunk with text, where it can differ from the first
    /// token's (an OpenAI stream sends a chunk per token, its text empty while held back).
    pub first_text_p50_ms: Option<f64>,
    /// The long prompt sent beside the clients, where one was
    /// ([`serve_load_with`](super::serve::serve_load_with)).
    pub long: Option<super::long::LongPrompt>,
}

impl ServeTimings {
    /// The figures of `sessions` clients: their times to first token and inter-token gaps (s),
    /// the tokens they got, how many different outputs, over `wall` seconds.
    pub fn of(
        sessions: usize,
        mut ttfts: Vec<f64>,
        mut gaps: Vec<f64>,
        tokens: usize,
        distinct: usize,
        wall: f64,
    ) -> Self {
        ServeTimings {
            sessions,
            ttft_p50_ms: pct(&mut ttfts, 0.5) * 1e3,
            ttft_p99_ms: pct(&mut ttfts, 0.99) * 1e3,
            itl_p50_ms: pct(&mut gaps, 0.5) * 1e3,
            itl_p99_ms: pct(&mut gaps, 0.99) * 1e3,
            tokens_per_s: tokens as f64 / wall,
            distinct,
            first_text_p50_ms: None,
            long: None,
        }
    }
}
