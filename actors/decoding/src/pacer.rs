//! [`ChunkPacer`]: how long a prompt's chunk may be while other sessions decode, set by time.
//!
//! A prompt fed beside decoding streams goes in chunks, and each of the streams' steps waits
//! for one chunk's pass: their inter-token gap is a step plus a chunk. A fixed chunk length
//! makes that gap a property of the model and the card (on the H200 a 128-token chunk of the
//! 0.9B took ~25 ms beside 64 streams whose step takes ~6 ms: their gaps grew 5×). The pacer
//! instead holds a chunk's pass to a share of one decoding step's time: it watches the passes
//! the batcher runs, keeps a running mean of the decoding steps (passes of one token a
//! session), and after each chunk's pass halves the chunk length when the pass took longer
//! than `share` × a step, or doubles it when twice the pass would still fit. A pass is timed
//! from when it holds the devices (not its wait for a state op), and passes that also keep
//! prefix snapshots are not judged. Lengths are powers of two from [`MIN_CHUNK`] up to the
//! configured ceiling, itself at most a pass's budget (the warm-up prefills every length to 16
//! and the powers of two, so no chunk below a ceiling of 1,024 meets a shape the backend has
//! not run). They start at the floor and climb, and start again from the floor when streams
//! come back after a quiet spell, so the streams never wait for a chunk too long while the
//! pacer learns (starting at the ceiling, the first few chunks cost 64 streams ~1 % of their
//! gaps: their p99); a long prompt moves on by at least [`MIN_CHUNK`] tokens a pass (the
//! ceiling, where that is less). Where even the floor's pass takes more than the share, the
//! gaps grow by that pass. Without a decoding step in the last [`STALE`] (or two chunk
//! passes, where those are longer), or while the prompts being fed (now, or in the last chunk
//! pass) outnumber the sessions decoding (a burst of prompts beside a few streams; as many of
//! each is paced), a chunk is the ceiling. With pipeline stages, passes overlap and each pass's time includes its
//! neighbours' (judged as it comes). How a prompt is cut changes none of its numbers (the
//! passes are batch invariant), only when the streams beside it get their tokens.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The shortest chunk the pacer cuts (tokens).
pub const MIN_CHUNK: usize = 8;

/// A chunk's pass may take this share of a decoding step by default, so the streams' gaps
/// stay under twice their value without the prompt (a step plus at most 0.75 of one).
pub const DEFAULT_SHARE: f64 = 0.75;

/// Decoding steps older than this say nothing about the streams now.
pub const STALE: Duration = Duration::from_millis(250);

/// The chunk length of prompts fed beside decoding streams (module docs). Shared by every
/// handle of one pipeline's decoder; the batcher reports each pass to it.
#[derive(Debug)]
pub struct ChunkPacer {
    pace: Mutex<Pace>,
    /// Prompts being fed now ([`ChunkPacer::feeding`]): with the last chunk pass's, what the
    /// streams are weighed against. A burst arriving together is known as it arrives, not
    /// only after its first pass (whose prompts would all have been cut at the floor).
    feeding: AtomicUsize,
}

/// A prompt being fed: counted by its pacer until dropped.
pub struct Feeding<'a>(&'a AtomicUsize);

impl Drop for Feeding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone)]
struct Pace {
    /// The ceiling: the configured chunk length.
    max: usize,
    /// A chunk's pass may take this share of a step; 0 keeps every chunk at `max`.
    share: f64,
    /// The chunk length now.
    chunk: usize,
    /// Running mean of the decoding steps' seconds, and when the last one ended.
    step: Option<(f64, Instant)>,
    /// The last chunk pass's seconds: streams count as running while their last step is no
    /// older than [`STALE`] or two such passes.
    pass: f64,
    /// Sessions of the last decoding step, and prompts of the last chunk pass: chunks are
    /// paced only while the streams are at least as many as the prompts.
    streams: usize,
    prompts: usize,
}

impl Pace {
    /// The shortest chunk: [`MIN_CHUNK`], or the ceiling where that is less.
    fn floor(&self) -> usize {
        MIN_CHUNK.min(self.max)
    }

    /// Whether the decoding streams ran a step recently enough, at `now`, that a pass is
    /// judged against it and chunks are paced.
    fn streaming(&self, now: Instant, feeding: usize) -> Option<f64> {
        let (step, _) = self.step?;
        let prompts = self.prompts.max(feeding);
        (self.share > 0.0 && self.streams >= prompts && self.recent(now)).then_some(step)
    }

    /// Whether the last decoding step ended at most [`STALE`] (or two chunk passes) before
    /// `now`.
    fn recent(&self, now: Instant) -> bool {
        let within = STALE.as_secs_f64().max(2.0 * self.pass);
        self.step
            .is_some_and(|(_, at)| now.saturating_duration_since(at).as_secs_f64() <= within)
    }
}

impl Default for ChunkPacer {
    fn default() -> Self {
        ChunkPacer::new(128, DEFAULT_SHARE)
    }
}

impl ChunkPacer {
    /// Chunks of at most `max` tokens, a chunk's pass held to `share` of a step (0: always
    /// `max`).
    pub fn new(max: usize, share: f64) -> Self {
        let max = max.max(1);
        ChunkPacer {
            pace: Mutex::new(Pace {
                max,
                share: share.max(0.0),
                chunk: MIN_CHUNK.min(max),
                step: None,
                pass: 0.0,
                streams: 0,
                prompts: 0,
            }),
            feeding: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pace> {
        self.pace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Chunks of at most `max` tokens from now on (the pacer starts again from the floor).
    pub fn set_max(&self, max: usize) {
        let mut p = self.lock();
        p.max = max.max(1);
        p.chunk = p.floor();
    }

    /// Chunks of at most `limit` tokens (a pass's budget), whatever the ceiling asked: a chunk
    /// longer than a pass would be cut, and its passes would never be judged.
    pub fn cap(&self, limit: usize) {
        let mut p = self.lock();
        p.max = p.max.min(limit.max(1));
        p.chunk = p.chunk.min(p.max);
    }

    /// A chunk's pass held to `share` of a decoding step from now on (0: chunks of the
    /// ceiling, as configured).
    pub fn set_share(&self, share: f64) {
        self.lock().share = share.max(0.0);
    }

    /// The ceiling ([`set_max`](Self::set_max)).
    pub fn max(&self) -> usize {
        self.lock().max
    }

    /// The share of a step a chunk may take ([`set_share`](Self::set_share)).
    pub fn share(&self) -> f64 {
        self.lock().share
    }

    /// The length of the next chunk of a prompt fed beside other sessions.
    pub fn chunk(&self) -> usize {
        self.chunk_at(Instant::now())
    }

    fn chunk_at(&self, now: Instant) -> usize {
        let p = self.lock();
        match p.streaming(now, self.feeding.load(Ordering::Relaxed)) {
            Some(_) => p.chunk,
            None => p.max,
        }
    }

    /// Counts a prompt as being fed until the guard drops.
    pub fn feeding(&self) -> Feeding<'_> {
        self.feeding.fetch_add(1, Ordering::Relaxed);
        Feeding(&self.feeding)
    }

    /// The running mean of the decoding steps, in seconds (none seen yet: `None`).
    pub fn step_seconds(&self) -> Option<f64> {
        self.lock().step.map(|(s, _)| s)
    }

    /// One pass of `len` input tokens for each of `sessions` sessions took `took`, ending now.
    pub fn observe(&self, len: usize, sessions: usize, took: Duration) {
        self.observe_at(len, sessions, took, Instant::now());
    }

    fn observe_at(&self, len: usize, sessions: usize, took: Duration, now: Instant) {
        let t = took.as_secs_f64();
        let began = now.checked_sub(took).unwrap_or(now);
        let mut p = self.lock();
        if len == 1 {
            // After a quiet spell the streams are new: their mean starts again, and so do the
            // chunks, from the floor.
            let quiet = !p.recent(began);
            let mean = match p.step {
                Some((s, _)) if !quiet => 0.8 * s + 0.2 * t,
                _ => t,
            };
            if quiet {
                p.chunk = p.floor();
            }
            p.step = Some((mean, now));
            p.streams = sessions;
            return;
        }
        // Only a pass of the chunk length now, while the streams are running (a step ended
        // shortly before it began) and outnumber the prompts, says whether that length fits.
        // Prompts that outnumber the streams (a burst arriving beside a few) go in chunks of
        // the ceiling: slowing many prompts to spare a few streams would be the worse trade.
        if len != p.chunk && len != p.max {
            return;
        }
        p.prompts = sessions;
        if len != p.chunk {
            return;
        }
        let Some(step) = p.streaming(began, self.feeding.load(Ordering::Relaxed)) else {
            return;
        };
        p.pass = t;
        let target = p.share * step;
        let (before, floor) = (p.chunk, p.floor());
        if t > target && p.chunk > floor {
            p.chunk = below(p.chunk).max(floor);
        } else if 2.0 * t <= target && p.chunk < p.max {
            p.chunk = above(p.chunk).min(p.max);
        }
        if p.chunk != before {
            tracing::debug!(
                "prefill chunks beside decoding: {before} → {} tokens (a {before}-token pass \
                 took {:.2} ms, a decoding step {:.2} ms, the share {:.2})",
                p.chunk,
                t * 1e3,
                step * 1e3,
                p.share
            );
        }
    }
}

/// The largest power of two below `n` (1 for 1).
fn below(n: usize) -> usize {
    if n <= 1 {
        1
    } else {
        1 << (usize::BITS - 1 - (n - 1).leading_zeros())
    }
}

/// The smallest power of two above `n`.
fn above(n: usize) -> usize {
    (n + 1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn powers_of_two_either_side() {
        assert_eq!(
            [1, 2, 3, 64, 100, 128].map(below),
            [1, 1, 2, 32, 64, 64],
            "below"
        );
        assert_eq!([1, 2, 3, 64, 100].map(above), [2, 4, 4, 128, 128], "above");
    }

    #[test]
    fn without_decoding_steps_a_chunk_is_the_ceiling() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        assert_eq!(p.chunk_at(t0), 128);
        // A chunk's pass with no step seen changes nothing.
        p.observe_at(128, 1, MS(50), t0);
        assert_eq!(p.chunk_at(t0), 128);
        assert_eq!(p.step_seconds(), None);
    }

    /// A burst of prompts beside one stream is known as it arrives: while more prompts are
    /// being fed than sessions decode, a chunk is the ceiling, before any of their passes.
    #[test]
    fn prompts_being_fed_that_outnumber_the_streams_take_the_ceiling_at_once() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 1, MS(5), t0);
        let one = p.feeding();
        assert_eq!(
            p.chunk_at(t0),
            MIN_CHUNK,
            "one prompt beside one stream: paced"
        );
        let burst: Vec<_> = (0..4).map(|_| p.feeding()).collect();
        assert_eq!(
            p.chunk_at(t0),
            128,
            "five prompts beside one stream: the ceiling"
        );
        drop(burst);
        assert_eq!(p.chunk_at(t0), MIN_CHUNK, "paced again once they are fed");
        drop(one);
        assert_eq!(p.feeding.load(Ordering::Relaxed), 0);
    }

    /// The lengths after each pass of the chunk length, at `ms_per_token` (1 ms more a pass).
    fn climb(p: &ChunkPacer, t0: Instant, passes: usize, ms_per_token: f64) -> Vec<usize> {
        (0..passes)
            .map(|_| {
                let c = p.chunk_at(t0);
                let took = Duration::from_secs_f64((1.0 + c as f64 * ms_per_token) * 1e-3);
                p.observe_at(c, 1, took, t0);
                p.chunk_at(t0)
            })
            .collect()
    }

    #[test]
    fn beside_streams_chunks_start_at_the_floor_and_double_while_twice_a_pass_fits() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 64, MS(20), t0);
        assert_eq!(p.chunk_at(t0), MIN_CHUNK);
        // Target 15 ms: 8 tokens 1.8 ms, 16 2.6, 32 4.2, 64 7.4 (twice fits), 128 13.8 (stays).
        assert_eq!(climb(&p, t0, 5, 0.1), [16, 32, 64, 128, 128]);
        // A ceiling that is no power of two is reached too.
        let p = ChunkPacer::new(100, 0.75);
        p.observe_at(1, 64, MS(20), t0);
        assert_eq!(climb(&p, t0, 5, 0.1), [16, 32, 64, 100, 100]);
        // Passes of other lengths (a prompt's last piece, a whole short prompt) say nothing.
        p.observe_at(37, 1, MS(900), t0);
        assert_eq!(p.chunk_at(t0), 100);
    }

    #[test]
    fn a_chunk_slower_than_its_share_of_a_step_halves_down_to_the_floor() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 64, MS(400), t0);
        assert_eq!(climb(&p, t0, 4, 0.4), [16, 32, 64, 128]);
        // The steps get fast: the running mean follows them to ~8 ms, a target of ~6.
        for _ in 0..40 {
            p.observe_at(1, 64, MS(8), t0);
        }
        assert!((p.step_seconds().unwrap() - 0.008).abs() < 1e-4);
        // 128 tokens 52.2 ms, 64 26.6, 32 13.8, 16 7.4: down; 8 4.2 fits, twice it does not.
        assert_eq!(climb(&p, t0, 5, 0.4), [64, 32, 16, 8, 8]);
        assert_eq!(MIN_CHUNK, 8);
    }

    #[test]
    fn the_step_is_a_running_mean_and_after_a_quiet_spell_everything_starts_again() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 1, MS(10), t0);
        p.observe_at(1, 1, MS(20), t0);
        assert!((p.step_seconds().unwrap() - 0.012).abs() < 1e-12);
        assert_eq!(climb(&p, t0, 2, 0.1), [16, 32]);
        // Streams gone quiet: the ceiling, and a pass then teaches nothing.
        let later = t0 + STALE + MS(50);
        assert_eq!(p.chunk_at(later), 128);
        p.observe_at(32, 1, MS(1), later);
        assert_eq!(p.chunk_at(t0), 32, "a stale pass changed the length");
        // New streams: their own mean, and chunks from the floor again.
        p.observe_at(1, 1, MS(40), later);
        assert!((p.step_seconds().unwrap() - 0.040).abs() < 1e-12);
        assert_eq!(p.chunk_at(later), MIN_CHUNK);
    }

    #[test]
    fn the_ceiling_is_capped_by_the_pass_budget() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 1, MS(100), t0);
        assert_eq!(climb(&p, t0, 4, 0.1), [16, 32, 64, 128]);
        p.cap(48);
        assert_eq!((p.max(), p.chunk_at(t0)), (48, 48));
        assert_eq!(
            p.chunk_at(t0 + STALE * 3),
            48,
            "the ceiling without streams"
        );
        // Judged at 48 tokens, it can still halve.
        p.observe_at(48, 1, MS(200), t0);
        assert_eq!(p.chunk_at(t0), 32);
    }

    #[test]
    fn prompts_that_outnumber_the_streams_go_in_chunks_of_the_ceiling() {
        let p = ChunkPacer::new(128, 0.75);
        let t0 = Instant::now();
        p.observe_at(1, 64, MS(6), t0);
        assert_eq!(
            p.chunk_at(t0),
            MIN_CHUNK,
            "a prompt beside 64 streams: paced"
        );
        // Seven prompts' chunks beside one stream: the ceiling, and their passes (fast enough
        // to double the length, were they judged) teach nothing.
        p.observe_at(1, 1, MS(2), t0);
        p.observe_at(MIN_CHUNK, 7, Duration::from_micros(100), t0);
        assert_eq!(p.chunk_at(t0), 128);
        p.observe_at(128, 7, MS(60), t0);
        assert_eq!(p.chunk_at(t0), 128);
        // One prompt again beside 64 streams: paced from where it was.
        p.observe_at(1, 64, MS(6), t0);
        p.observe_at(128, 1, MS(25), t0);
        assert_eq!(p.chunk_at(t0), MIN_CHUNK);
    }

    #[test]
    fn share_zero_keeps_the_configured_chunk() {
        let p = ChunkPacer::new(128, 0.0);
        let t0 = Instant::now();
        p.observe_at(1, 1, MS(5), t0);
        // Passes of the paced length (the floor) or of the ceiling, fast or slow: unjudged.
        p.observe_at(MIN_CHUNK, 1, Duration::from_micros(10), t0);
        p.observe_at(128, 1, MS(500), t0);
        assert_eq!(p.chunk_at(t0), 128);
        p.set_share(0.5);
        assert_eq!(p.chunk_at(t0), MIN_CHUNK);
        p.set_max(32);
        assert_eq!((p.chunk_at(t0), p.max()), (MIN_CHUNK, 32));
        p.set_share(0.0);
        assert_eq!(p.chunk_at(t0), 32);
    }
}
