//! One cohort's pass ([`run_cohort`]): the edge's embedding, every layer actor and the edge's
//! decode path for a batch of sessions, with what goes in (a [`PickRequest`] per session when
//! the token is chosen on the device) and what comes out (an [`Answer`] per session), and the
//! time each phase took ([`CohortPhases`]). The batcher runs cohorts; the warm-up runs the
//! same passes before the server is ready.

use nsactor_engine::decode::SamplingParams;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::msg::{EdgeMsg, ask};
use nsactor_pipeline::state::SaveTally;
use nsactor_pipeline::topology::Children;
use nsactor_plugin_api::{PickParams, PicksBuf, RowPick, SessionId, SnapshotId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Where a cohort's time goes, as the batcher sees it: nanoseconds summed over cohorts, each
/// phase from sending its request to holding the answer (actor messages, the worker's queue
/// and the stage call; the device work the call waits for included).
#[derive(Debug, Default)]
pub struct CohortPhases {
    /// The edge's `SessionEmbed`.
    pub embed_ns: AtomicU64,
    /// Every layer (`session_layers`).
    pub layers_ns: AtomicU64,
    /// The edge's `SessionDecode` with the logits' copy to the host.
    pub decode_ns: AtomicU64,
    /// From the launch of a cohort to its answers going out.
    pub cohort_ns: AtomicU64,
}

impl CohortPhases {
    /// `[embed, layers, decode, cohort]` in seconds.
    pub fn seconds(&self) -> [f64; 4] {
        [
            &self.embed_ns,
            &self.layers_ns,
            &self.decode_ns,
            &self.cohort_ns,
        ]
        .map(|a| a.load(Ordering::Relaxed) as f64 * 1e-9)
    }
}

/// How a session's next token is chosen on the device ([`StageCall::SessionSample`]
/// (nsactor_plugin_api::StageCall)): only the token (and its logits, when asked) come back.
///
/// The penalties' token sets are carried only while their penalties are on ([`new`](Self::new)):
/// a stream's request goes to the device at every step, and a prompt of 131,072 tokens carried
/// as the repetition penalty's history would cost every step of that session a megabyte of
/// copies when no penalty reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct PickRequest {
    pub sampling: SamplingParams,
    /// The repetition penalty's set: prompt and generated tokens, each once. Empty while that
    /// penalty is off (1).
    pub history: Vec<i64>,
    /// Generated tokens, for the presence and frequency penalties. Empty while both are off.
    pub generated: Vec<i64>,
    /// Tokens drawn before this one: with the seed, the key of a sampled draw.
    pub step: u64,
    /// Added to logits first; `-inf` bans a token.
    pub bias: Vec<(u32, f32)>,
    /// The logits come back too (for log-probabilities beyond the chosen token's).
    pub want_logits: bool,
    /// The biases from this step on, where they change (the bans of vLLM's `min_tokens`
    /// lifted): `(step, bias)`.
    pub later: Option<(u64, Vec<(u32, f32)>)>,
}

impl PickRequest {
    /// The request for a session that has seen `history` (prompt and generated tokens) and
    /// generated `generated`: the sets kept are those the sampling's penalties read.
    pub fn new(
        sampling: SamplingParams,
        history: &[i64],
        generated: &[i64],
        bias: Vec<(u32, f32)>,
        want_logits: bool,
    ) -> Self {
        let mut history_set = Vec::new();
        if repeats(&sampling) {
            let mut seen = std::collections::HashSet::with_capacity(history.len());
            history_set.extend(history.iter().copied().filter(|t| seen.insert(*t)));
        }
        PickRequest {
            sampling,
            history: history_set,
            generated: if counts(&sampling) {
                generated.to_vec()
            } else {
                Vec::new()
            },
            step: generated.len() as u64,
            bias,
            want_logits,
            later: None,
        }
    }

    /// The same request with `tokens` banned until `steps` tokens have been drawn (vLLM's
    /// `min_tokens`: no end token before then); their biases as they were from then on.
    pub fn banning_until(mut self, tokens: &[u32], steps: u64) -> Self {
        if self.step >= steps || tokens.is_empty() {
            return self;
        }
        self.later = Some((steps, self.bias.clone()));
        for &t in tokens {
            match self.bias.iter_mut().find(|(b, _)| *b == t) {
                Some((_, x)) => *x = f32::NEG_INFINITY,
                None => self.bias.push((t, f32::NEG_INFINITY)),
            }
        }
        self
    }

    /// The most likely token, with no penalties or biases; the logits come back when
    /// `want_logits`.
    pub fn greedy(want_logits: bool) -> Self {
        PickRequest {
            sampling: SamplingParams::greedy(),
            history: Vec::new(),
            generated: Vec::new(),
            step: 0,
            bias: Vec::new(),
            want_logits,
            later: None,
        }
    }

    /// The request for the next token once `token` has been drawn: the step advanced and the
    /// token added to the sets the penalties read.
    pub fn advance(&mut self, token: i64) {
        self.step += 1;
        if self.later.as_ref().is_some_and(|(at, _)| self.step >= *at) {
            self.bias = self.later.take().expect("checked").1;
        }
        if repeats(&self.sampling) && !self.history.contains(&token) {
            self.history.push(token);
        }
        if counts(&self.sampling) {
            self.generated.push(token);
        }
    }
}

/// Whether the repetition penalty reads the history.
fn repeats(s: &SamplingParams) -> bool {
    s.repetition_penalty != 1.0
}

/// Whether the presence or frequency penalty reads the generated tokens.
fn counts(s: &SamplingParams) -> bool {
    s.presence_penalty != 0.0 || s.frequency_penalty != 0.0
}

/// A token chosen on the device.
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    pub token: i64,
    /// Its log-probability under the model's own distribution (before biases and penalties).
    pub logprob: f32,
    pub logits: Option<Vec<f32>>,
}

/// What a fed session gets back.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The last position's logits (a feed without a [`PickRequest`]).
    Logits(Vec<f32>),
    /// Every position's logits, position after position (`len × V`): a prompt scored in one
    /// pass.
    Every(Vec<f32>),
    Picked(Picked),
}

/// A session's answer, or why its cohort failed.
pub type Answered = Result<Answer, RuntimeError>;

/// What every input of a cohort has in common.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CohortShape {
    /// Input tokens of each session.
    pub len: usize,
    /// Every position's logits come back ([`Answer::Every`]), not only the last one's.
    pub every: bool,
}

/// Embedding, every layer and the decode path for `sessions` (each `len` inputs, back to
/// back in `ids`): each session's answer, in order. With any [`PickRequest`] the tokens are
/// chosen on the device (the sessions without one get their logits back beside them).
/// Every stage keeps a snapshot of the sessions of `saves` as the pass leaves them, in the
/// pass's own jobs: the tally says what each holds, or why not.
pub(super) async fn run_cohort(
    children: &Children,
    sessions: &[SessionId],
    ids: Vec<i64>,
    CohortShape { len, every }: CohortShape,
    picks: Vec<Option<PickRequest>>,
    saves: &[(SessionId, SnapshotId)],
    phases: &CohortPhases,
) -> Result<(Vec<Answer>, SaveTally), RuntimeError> {
    use nsactor_pipeline::trace::{Mark, mark};
    nsactor_pipeline::trace::start();
    let t = Instant::now();
    // The layers' handles are asked while the edge embeds: the two round trips overlap.
    let (h, holders) = tokio::join!(
        ask(&children.edge, "edge", |reply| EdgeMsg::SessionEmbed {
            ids,
            batch: sessions.len(),
            seq_len: len,
            ready: false,
            reply,
        }),
        nsactor_pipeline::layers::share_layers(&children.layers)
    );
    let t = add_ns(&phases.embed_ns, t);
    mark(Mark::Embedded);
    let (h, mut tally) =
        nsactor_pipeline::layers::run_layers_saving(&holders?, sessions, h?, saves).await?;
    let t = add_ns(&phases.layers_ns, t);
    mark(Mark::LayersDone);
    let n = sessions.len();
    let answers = if picks.iter().all(Option::is_none) {
        let logits = ask(&children.edge, "edge", |reply| EdgeMsg::SessionDecode {
            sessions: sessions.to_vec(),
            h,
            every,
            saves: saves.to_vec(),
            reply,
        })
        .await;
        logits.and_then(|(all, saved)| {
            tally.add("edge", saved);
            if every {
                return every_position(all, n, len);
            }
            let rows = split_rows(&all, n)?;
            Ok(rows.map(|r| Answer::Logits(r.to_vec())).collect())
        })
    } else {
        let buf = pick_block(&picks);
        let want_logits = picks
            .iter()
            .any(|p| p.as_ref().is_none_or(|p| p.want_logits));
        let sampled = ask(&children.edge, "edge", |reply| EdgeMsg::SessionSample {
            sessions: sessions.to_vec(),
            h,
            picks: buf,
            want_logits,
            saves: saves.to_vec(),
            reply,
        })
        .await;
        sampled.and_then(|((picked, logits), saved)| {
            tally.add("edge", saved);
            answers_of(picks, &picked, logits.as_deref())
        })
    };
    add_ns(&phases.decode_ns, t);
    mark(Mark::Done);
    answers.map(|a| (a, tally))
}

/// `all` as `n` equal rows.
fn split_rows(all: &[f32], n: usize) -> Result<std::slice::Chunks<'_, f32>, RuntimeError> {
    if n == 0 || !all.len().is_multiple_of(n) {
        return Err(RuntimeError::Runtime(format!(
            "a cohort of {n} sessions returned {} values",
            all.len()
        )));
    }
    Ok(all.chunks(all.len() / n))
}

/// Each of `n` sessions' logits of its `len` positions, out of `all` laid `[len, n, V]`.
fn every_position(all: Vec<f32>, n: usize, len: usize) -> Result<Vec<Answer>, RuntimeError> {
    let rows = split_rows(&all, n * len)?;
    if n == 1 {
        // One session (a scored prompt alone): its rows are the whole answer, in order; no
        // copy of its `len × V` logits (12.6 MB for 512 positions of the 0.9B).
        return Ok(vec![Answer::Every(all)]);
    }
    let rows: Vec<&[f32]> = rows.collect();
    Ok((0..n)
        .map(|i| Answer::Every((0..len).flat_map(|t| rows[t * n + i]).copied().collect()))
        .collect())
}

/// The block a cohort's picks cross to the device in, one row per session: the host's work
/// for every decoding step (`nsactor bench host` times it).
pub fn pick_block(picks: &[Option<PickRequest>]) -> PicksBuf {
    let mut buf = PicksBuf::new();
    for p in picks {
        buf.push(&row_pick(p.as_ref()));
    }
    buf
}

/// The device's row for a pick; a session without one is greedy and wants its logits.
pub(crate) fn row_pick(p: Option<&PickRequest>) -> RowPick<'_> {
    let greedy = SamplingParams::greedy();
    let (s, want_logits) = p.map_or((&greedy, true), |p| (&p.sampling, p.want_logits));
    let params = PickParams {
        temperature: s.temperature,
        top_k: u32::try_from(s.top_k).unwrap_or(u32::MAX),
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        step: p.map_or(0, |p| p.step),
        want_logits,
    };
    match p {
        // A set no penalty reads stays behind, however the request was made.
        Some(p) => RowPick {
            params,
            history: if repeats(s) { &p.history } else { &[] },
            generated: if counts(s) { &p.generated } else { &[] },
            bias: &p.bias,
        },
        None => RowPick {
            params,
            history: &[],
            generated: &[],
            bias: &[],
        },
    }
}

/// Each session's answer from the device's `[ids, logprobs]` and the logits, if copied.
fn answers_of(
    picks: Vec<Option<PickRequest>>,
    picked: &[f32],
    logits: Option<&[f32]>,
) -> Result<Vec<Answer>, RuntimeError> {
    let n = picks.len();
    if picked.len() != 2 * n {
        return Err(RuntimeError::Runtime(format!(
            "a cohort of {n} sessions returned {} picked values",
            picked.len()
        )));
    }
    let mut rows = logits.map(|l| split_rows(l, n)).transpose()?;
    let mut out = Vec::with_capacity(n);
    for (i, p) in picks.into_iter().enumerate() {
        let row = rows.as_mut().and_then(|r| r.next()).map(<[f32]>::to_vec);
        out.push(match p {
            Some(p) => Answer::Picked(Picked {
                token: picked[i] as i64,
                logprob: picked[n + i],
                logits: row.filter(|_| p.want_logits),
            }),
            None => Answer::Logits(row.ok_or_else(|| {
                RuntimeError::Runtime("the device's logits were not copied".into())
            })?),
        });
    }
    Ok(out)
}

/// Adds the nanoseconds since `since` to `to`; returns now.
pub(super) fn add_ns(to: &AtomicU64, since: Instant) -> Instant {
    let now = Instant::now();
    to.fetch_add((now - since).as_nanos() as u64, Ordering::Relaxed);
    now
}

/// Frees `session`'s neuron states in every actor (errors ignored: a stopped actor has none).
pub(crate) async fn close_everywhere(c: &Children, sessions: &[SessionId]) {
    use nsactor_pipeline::layers::state_all;
    use nsactor_pipeline::state::StateOp;
    let close = || StateOp::Close(sessions.to_vec());
    let _ = crate::order::state(state_all(&c.edge, &c.layers, close(), |_| close())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(repetition: f32, presence: f32, frequency: f32) -> SamplingParams {
        SamplingParams {
            repetition_penalty: repetition,
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn a_request_carries_only_the_sets_its_penalties_read() {
        let prompt: Vec<i64> = (0..100_000).map(|i| i % 7).collect();
        // No penalty: nothing of the prompt is carried, however long; the step still counts.
        let mut off = PickRequest::new(sampling(1.0, 0.0, 0.0), &prompt, &[3, 4], vec![], false);
        assert!(off.history.is_empty() && off.generated.is_empty());
        assert_eq!(off.step, 2);
        off.advance(5);
        assert!(off.history.is_empty() && off.generated.is_empty());
        assert_eq!(off.step, 3);
        let row = row_pick(Some(&off));
        assert_eq!((row.params.step, row.history.len()), (3, 0));
        // The repetition penalty reads each token once: the set, not the text.
        let mut rep = PickRequest::new(sampling(1.2, 0.0, 0.0), &prompt, &[3], vec![], false);
        assert_eq!(rep.history, [0, 1, 2, 3, 4, 5, 6]);
        assert!(rep.generated.is_empty());
        rep.advance(3);
        rep.advance(9);
        assert_eq!(rep.history, [0, 1, 2, 3, 4, 5, 6, 9]);
        assert_eq!(rep.step, 3);
        // Presence and frequency count every generated token.
        let mut freq = PickRequest::new(sampling(1.0, 0.0, 0.3), &prompt, &[3, 3], vec![], false);
        assert!(freq.history.is_empty());
        freq.advance(3);
        assert_eq!(freq.generated, [3, 3, 3]);
        let row = row_pick(Some(&freq));
        assert_eq!((row.params.step, row.generated.len()), (3, 3));
        // A request built by hand with a set its penalty does not read sends none of it.
        let by_hand = PickRequest {
            history: prompt.clone(),
            generated: vec![1, 2],
            ..PickRequest::greedy(false)
        };
        let row = row_pick(Some(&by_hand));
        assert!(row.history.is_empty() && row.generated.is_empty());
    }

    /// `min_tokens`' bans hold for the first steps only, and the request's own biases (one
    /// on a banned token among them) come back after.
    #[test]
    fn bans_until_a_step_lift_to_the_biases_as_they_were() {
        let own = vec![(4, 2.0), (9, -1.0)];
        let mut p = PickRequest::new(sampling(1.0, 0.0, 0.0), &[], &[], own.clone(), false)
            .banning_until(&[2, 4], 2);
        let banned = |p: &PickRequest, t: u32| {
            p.bias
                .iter()
                .any(|&(b, x)| b == t && x == f32::NEG_INFINITY)
        };
        assert!(banned(&p, 2) && banned(&p, 4) && !banned(&p, 9));
        p.advance(7);
        assert!(banned(&p, 2) && banned(&p, 4), "one token drawn of two");
        p.advance(8);
        assert_eq!(p.bias, own);
        assert!(p.later.is_none());
        // Already past the step: nothing banned.
        let q = PickRequest::new(sampling(1.0, 0.0, 0.0), &[], &[1, 2, 3], own.clone(), false)
            .banning_until(&[2], 3);
        assert_eq!(q.bias, own);
    }
}
