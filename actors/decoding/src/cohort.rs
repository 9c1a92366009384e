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
#[derive(Debug, Clone, PartialEq)]
pub struct PickRequest {
    pub sampling: SamplingParams,
    /// Prompt and generated tokens (the repetition penalty's set).
    pub history: Vec<i64>,
    /// Generated tokens (the presence and frequency penalties; their count is the draw's step).
    pub generated: Vec<i64>,
    /// Added to logits first; `-inf` bans a token.
    pub bias: Vec<(u32, f32)>,
    /// The logits come back too (for log-probabilities beyond the chosen token's).
    pub want_logits: bool,
}

impl PickRequest {
    /// The most likely token, with no penalties or biases; the logits come back when
    /// `want_logits`.
    pub fn greedy(want_logits: bool) -> Self {
        PickRequest {
            sampling: SamplingParams::greedy(),
            history: Vec::new(),
            generated: Vec::new(),
            bias: Vec::new(),
            want_logits,
        }
    }
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
        let mut buf = PicksBuf::new();
        for p in &picks {
            buf.push(&row_pick(p.as_ref()));
        }
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

/// The device's row for a pick; a session without one is greedy and wants its logits.
pub(crate) fn row_pick(p: Option<&PickRequest>) -> RowPick<'_> {
    let greedy = SamplingParams::greedy();
    let (s, want_logits) = p.map_or((&greedy, true), |p| (&p.sampling, p.want_logits));
    let params = PickParams {
        temperature: s.temperature,
        top_k: u32::try_from(s.top_k).unwrap_or(u32::MAX),
        top_p: s.top_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        step: p.map_or(0, |p| p.generated.len() as u64),
        want_logits,
    };
    match p {
        Some(p) => RowPick {
            params,
            history: &p.history,
            generated: &p.generated,
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
