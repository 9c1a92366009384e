//! Warming a decoder up before it serves: every cohort size the batcher will run
//! ([`CohortBuckets`]) goes once through the shapes of serving — a prefill of fresh sessions, a
//! few greedy decoding steps (the second of which a CUDA backend captures as a graph and the
//! third replays), a sampled step that also copies logits (log-probabilities), and the
//! longest prompt chunk a pass takes on held states — so kernel compilation, GEMM plans,
//! graph capture and memory-pool growth are paid before the first client, not by it.
//!
//! One session's prompt runs alone at whatever length it has, so the one-session size also
//! prefills every length from 1 to [`SHORT_PROMPTS`] and the powers of two above it: on a
//! fresh machine (an empty kernel cache) a 3-token prompt otherwise paid 77 ms of kernel
//! tuning in the first request after ready, against 11 ms in the next process (BENCHMARKS.md).
//!
//! Warm-up cohorts go straight to the actors (the batcher's own cohort function), at exactly
//! the bucket sizes, with sessions of their own that are closed afterwards. Nothing else
//! should feed the decoder meanwhile (a server refuses generations until it is ready).

use super::buckets::CohortBuckets;
use super::cohort::{CohortShape, PickRequest, close_everywhere, run_cohort};
use super::decoder::AsyncDecoder;
use nsactor_engine::decode::SamplingParams;
use nsactor_engine::error::RuntimeError;
use std::time::Instant;

/// Greedy decoding steps per size: the first runs as it is, the second is captured, the third
/// replayed.
const GREEDY_STEPS: usize = 3;
/// Prompt length of the fresh sessions' prefill (cut to what a pass holds).
const PROMPT: usize = 8;
/// The one-session size also prefills every prompt length up to this, then the powers of two.
const SHORT_PROMPTS: usize = 16;

/// Extra prefill lengths the one-session size warms: 1 to [`SHORT_PROMPTS`], then powers of
/// two, up to `fits` (what a pass holds), less `done` (the lengths its other passes run).
fn one_session_prompts(fits: usize, done: &[usize]) -> Vec<usize> {
    let pow2 = std::iter::successors(Some(SHORT_PROMPTS * 2), |n| n.checked_mul(2));
    (1..=SHORT_PROMPTS)
        .chain(pow2.take_while(|&n| n <= fits))
        .filter(|&n| n <= fits && !done.contains(&n))
        .collect()
}

/// The kinds of pass a warm-up runs at each size (all of them by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passes {
    /// Greedy decoding steps (the prefill of fresh sessions always runs).
    pub greedy: bool,
    /// A sampled step that also copies logits.
    pub sampled: bool,
    /// The longest prompt chunk a pass takes, on held states.
    pub long: bool,
}

impl Default for Passes {
    fn default() -> Self {
        Passes {
            greedy: true,
            sampled: true,
            long: true,
        }
    }
}

impl Passes {
    /// Parses a comma-separated subset of `greedy,sampled,long` (`prefill` alone: none).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut p = Passes {
            greedy: false,
            sampled: false,
            long: false,
        };
        for w in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match w {
                "prefill" => {}
                "greedy" => p.greedy = true,
                "sampled" => p.sampled = true,
                "long" => p.long = true,
                other => {
                    return Err(format!(
                        "warm-up passes: `{other}` is not one of prefill, greedy, sampled, long"
                    ));
                }
            }
        }
        Ok(p)
    }
}

/// What one warm-up covers.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupPlan {
    /// Cohort sizes, ascending.
    pub sizes: Vec<usize>,
    pub passes: Passes,
}

impl WarmupPlan {
    /// The cohort buckets `spec` names (`--cohort-buckets`) for a server of `max_sessions`
    /// (at most [`MAX_BATCH`](crate::batcher::MAX_BATCH)), and the warm-up over them.
    pub fn for_spec(spec: &str, max_sessions: usize) -> Result<(CohortBuckets, Self), String> {
        let most = max_sessions.clamp(1, crate::batcher::MAX_BATCH);
        let buckets = CohortBuckets::parse(spec, most)
            .map_err(|e| format!("--cohort-buckets: {e}"))?
            .up_to(most);
        let plan = WarmupPlan::for_buckets(&buckets, most);
        Ok((buckets, plan))
    }

    /// Every bucket of `buckets` up to `max_sessions`; exact cohorts get the default ladder's
    /// sizes (the kernels of each code path are compiled once either way).
    pub fn for_buckets(buckets: &CohortBuckets, max_sessions: usize) -> Self {
        let cut = match buckets {
            CohortBuckets::Exact => CohortBuckets::ladder(max_sessions),
            b => b.up_to(max_sessions),
        };
        WarmupPlan {
            sizes: cut.sizes().to_vec(),
            passes: Passes::default(),
        }
    }
}

/// One size warmed.
#[derive(Debug, Clone, PartialEq)]
pub struct Warmed {
    pub size: usize,
    /// Passes run.
    pub passes: usize,
    pub seconds: f64,
}

impl AsyncDecoder {
    /// Runs `plan` (module docs); `progress(done, total, size)` after each size.
    pub async fn warm_up(
        &self,
        plan: &WarmupPlan,
        mut progress: impl FnMut(usize, usize, &Warmed),
    ) -> Result<Vec<Warmed>, RuntimeError> {
        let mut out = Vec::with_capacity(plan.sizes.len());
        for (i, &size) in plan.sizes.iter().enumerate() {
            let w = self.warm_size(size, plan.passes).await?;
            progress(i + 1, plan.sizes.len(), &w);
            out.push(w);
        }
        Ok(out)
    }

    async fn warm_size(&self, size: usize, kinds: Passes) -> Result<Warmed, RuntimeError> {
        let start = Instant::now();
        let children = self.children();
        let sessions: Vec<_> = (0..size).map(|_| self.session()).collect();
        let vocab = self.vocab.max(2) as i64;
        let phases = super::cohort::CohortPhases::default();
        let fits = (self.max_tokens / size).max(1);
        let greedy = PickRequest::greedy;
        let sampled = |i: usize| {
            let sampling = SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.0,
                repetition_penalty: 1.1,
                presence_penalty: 0.1,
                frequency_penalty: 0.1,
                seed: i as u64,
            };
            PickRequest::new(
                sampling,
                &[1, 2, 3],
                &[2],
                vec![(1, 0.5)],
                i.is_multiple_of(2),
            )
        };
        let prompt = PROMPT.min(fits);
        // (input length, picks) of each pass, in order.
        let mut passes: Vec<(usize, Vec<PickRequest>)> = vec![(prompt, vec![greedy(false); size])];
        for _ in 0..GREEDY_STEPS * usize::from(kinds.greedy) {
            passes.push((1, vec![greedy(false); size]));
        }
        if kinds.sampled {
            passes.push((1, (0..size).map(sampled).collect()));
        }
        if kinds.long && fits > prompt {
            passes.push((fits, vec![greedy(false); size]));
        }
        if size == 1 {
            let done: Vec<usize> = passes.iter().map(|p| p.0).collect();
            for len in one_session_prompts(fits, &done) {
                passes.push((len, vec![greedy(false); size]));
            }
        }
        let mut result = Ok(());
        for (k, (len, picks)) in passes.iter().enumerate() {
            let ids: Vec<i64> = (0..size * len)
                .map(|j| ((j * 31 + k * 7 + 3) as i64) % vocab)
                .collect();
            let picks = picks.iter().cloned().map(Some).collect();
            let shape = CohortShape {
                len: *len,
                every: false,
            };
            let run = run_cohort(&children, &sessions, ids, shape, picks, &[], &phases);
            if let Err(e) = crate::order::pass(run).await {
                result = Err(e);
                break;
            }
        }
        let mut restored = Vec::new();
        if result.is_ok() {
            result = self.warm_states(&sessions, &mut restored).await;
        }
        close_everywhere(&children, &sessions).await;
        close_everywhere(&children, &restored).await;
        result.map(|()| Warmed {
            size,
            passes: passes.len(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

impl AsyncDecoder {
    /// The prefix cache's state ops at this size: `sessions` saved together, new sessions
    /// (put in `restored`, for the caller to close) started from those snapshots, the
    /// snapshots dropped; so their kernels are compiled before the first client.
    async fn warm_states(
        &self,
        sessions: &[nsactor_plugin_api::SessionId],
        restored: &mut Vec<nsactor_plugin_api::SessionId>,
    ) -> Result<(), RuntimeError> {
        let children = self.children();
        let saves: Vec<_> = sessions.iter().map(|&s| (s, self.ids.snapshot())).collect();
        let saved = crate::kept::save_many(&children, saves.clone()).await;
        let mut result = saved.into_iter().collect::<Result<Vec<_>, _>>().map(drop);
        if result.is_ok() {
            let items: Vec<_> = saves.iter().map(|&(_, id)| (self.session(), id)).collect();
            restored.extend(items.iter().map(|&(s, _)| s));
            result = crate::kept::restore_many(&children, items)
                .await
                .into_iter()
                .collect();
        }
        crate::kept::drop_many(&children, saves.iter().map(|&(_, id)| id).collect()).await;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_session_prefills_every_short_length_and_the_powers_of_two() {
        let got = one_session_prompts(256, &[8, 1, 256]);
        let mut want: Vec<usize> = (2..=16).filter(|&n| n != 8).collect();
        want.extend([32, 64, 128]);
        assert_eq!(got, want);
        assert_eq!(one_session_prompts(5, &[5, 1]), vec![2, 3, 4]);
    }

    #[test]
    fn a_plan_covers_every_bucket_up_to_the_server_s_sessions() {
        let p = WarmupPlan::for_buckets(&CohortBuckets::ladder(4096), 20);
        assert_eq!(p.sizes, vec![1, 2, 3, 4, 8, 12, 16, 20]);
        let p = WarmupPlan::for_buckets(&CohortBuckets::Exact, 4);
        assert_eq!(p.sizes, vec![1, 2, 3, 4]);
    }
}
