//! How the [`BatcherActor`](super::batcher::BatcherActor) batches decoding sessions
//! ([`Batching`]: cohort size, tokens per pass, cohorts in flight, the launch window, the
//! buckets) and what it counts ([`BatchStats`]).

use super::buckets::CohortBuckets;
use super::cohort::CohortPhases;
use super::pacer::ChunkPacer;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Most frame rows (input tokens × K) of one batched pass: the row count the decoding GEMMs'
/// batch-invariant plan is referenced at on CUDA (`nsactor_kernels::decoding_gemms`). A pass
/// with more rows would take other GEMM kernels, and a session's logits would depend on its
/// cohort.
pub const PASS_FRAME_ROWS: usize = 4096;

/// Most frame rows of one pass by default ([`Batching::max_tokens`] = this / K): a prompt
/// prefilled alone goes in passes this large (on the H200 a 4,000-token prompt of the 0.9B
/// took 708 ms in passes of 4,096 rows and 459 ms in passes of 16,384; BENCHMARKS.md). The
/// GEMMs of a pass past [`PASS_FRAME_ROWS`] run the kernels chosen there where they fit, so a
/// prompt's logits stay those of any other way of cutting it.
pub const PREFILL_PASS_FRAME_ROWS: usize = 16_384;

/// Most frame rows of one chunk of a prompt prefilled while other sessions decode, by default
/// (this / K tokens): each of their steps waits for one chunk at most, and the
/// [`ChunkPacer`] shortens the chunks to a share of a step's time. On the H200, 64 streams
/// of the 0.9B beside a 32k-token prompt had an inter-token p99 of 52.7 ms in chunks of 4,096
/// rows, 30.8 ms in chunks of 2,048 and 19.8 ms (p50 too) in chunks of 1,024, against 6.6 ms
/// alone (BENCHMARKS.md).
pub const CHUNK_FRAME_ROWS: usize = 2048;

/// Most sessions in one cohort by default.
pub const MAX_BATCH: usize = 256;

/// Longest a prompt waits for the restores queued or running before its cohort launches
/// anyway. A restore of 256 sessions takes ~8 ms on an H200, but waits for the pass in flight;
/// when 256 clients sharing a system prompt arrived together, the first few restored launched a
/// 200 ms pass and the other 248 restores waited for it (BENCHMARKS.md, session 47).
pub const RESTORE_HOLD: Duration = Duration::from_millis(20);

/// How sessions are batched.
#[derive(Debug, Clone, PartialEq)]
pub struct Batching {
    /// Most sessions in one cohort.
    pub max_batch: usize,
    /// Most input tokens in one cohort (sessions × input length; at least one session's
    /// input): [`PASS_FRAME_ROWS`] / K. Longer prompts are fed in chunks of this size
    /// ([`AsyncDecoder`](super::AsyncDecoder)).
    pub max_tokens: usize,
    /// Most cohorts in flight (one per pipeline stage keeps every stage busy).
    pub max_in_flight: usize,
    /// Longest an input waits for the sessions not yet back.
    pub window: Duration,
    /// The cohort sizes passes run at (padded up to).
    pub buckets: CohortBuckets,
}

impl Default for Batching {
    fn default() -> Self {
        Batching {
            max_batch: MAX_BATCH,
            max_tokens: usize::MAX,
            max_in_flight: 1,
            window: Duration::from_millis(2),
            buckets: CohortBuckets::default(),
        }
    }
}

/// Counters for benchmarks and metrics.
#[derive(Debug, Default)]
pub struct BatchStats {
    /// Cohorts run.
    pub cohorts: AtomicU64,
    /// Session inputs run, summed over cohorts.
    pub inputs: AtomicU64,
    /// Pad rows run to fill cohorts up to their bucket, summed over cohorts.
    pub padded: AtomicU64,
    /// Sessions that have fed and are not closed yet (their states are held by the actors).
    pub open: AtomicU64,
    /// Cohorts launched when the window ran out with open sessions still away: each made the
    /// sessions that were waiting wait [`Batching::window`] for them.
    pub window_launches: AtomicU64,
    /// Nanoseconds of the cohorts' phases, summed over cohorts ([`CohortPhases`]).
    pub phases: CohortPhases,
    /// The chunk length of prompts fed beside decoding streams, paced by the passes' times.
    pub pacer: ChunkPacer,
}
