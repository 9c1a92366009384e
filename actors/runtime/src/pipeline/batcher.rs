//! `BatcherActor`: continuous batching of decoding sessions. Sessions hand it their next
//! input (a prompt or one token); it runs the waiting ones as a **cohort** — one batched
//! `SessionEmbed`, one `SessionForward` per layer actor and one `SessionDecode` for all of
//! them — and answers each session with its logits.
//!
//! When to launch: a cohort starts as soon as a pipeline stage is free (at most one cohort per
//! stage in flight) and every open session that is not already in flight is waiting, or when
//! the oldest waiting input has waited [`Batching::window`]. Sessions resubmit microseconds
//! after their answer, so in the steady state every token step is one cohort of all sessions,
//! without a timer firing; the window only bounds the wait for a session that is slow to come
//! back (its client, or its sampling).
//!
//! A cohort has one input length: the oldest waiting input picks it and every waiting input
//! of that length joins (at most [`Batching::max_batch`]). Decoding tokens (length 1) batch
//! together; a prompt runs with the prompts of its length. A cohort's sessions are ordered by
//! id, so the same sessions arrive at each layer in the same order step after step, and the
//! layers keep their states without copying (`nsactor_backend_core::SessionTable`).
//!
//! A cohort is padded up to its bucket ([`CohortBuckets`]) with pad sessions whose answers are
//! dropped, so a GPU backend meets only the shapes it ran while warming up.
//!
//! Closing a session waits for its cohort in flight, then frees its states in every actor.

use super::buckets::{CohortBuckets, pad_session};
use super::msg::{EdgeMsg, StageControl, ask, control_all};
use super::topology::Children;
use crate::decode::SamplingParams;
use crate::error::RuntimeError;
use nsactor_plugin_api::{PickParams, PicksBuf, RowPick, SessionId};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Most frame rows (input tokens × K) of one batched pass: the row count the decoding GEMMs'
/// batch-invariant plan is referenced at on CUDA (`nsactor_kernels::decoding_gemms`). A pass
/// with more rows would take other GEMM kernels, and a session's logits would depend on its
/// cohort.
pub const PASS_FRAME_ROWS: usize = 4096;

/// Most sessions in one cohort by default.
pub const MAX_BATCH: usize = 256;

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
    /// Nanoseconds of the cohorts' phases, summed over cohorts ([`CohortPhases`]).
    pub phases: CohortPhases,
}

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
    Picked(Picked),
}

type Answered = Result<Answer, RuntimeError>;

pub enum BatcherMsg {
    /// Runs `ids` through `session`; answers the last position's logits, or with `pick` the
    /// token chosen on the device.
    Feed {
        session: SessionId,
        ids: Vec<i64>,
        pick: Option<PickRequest>,
        reply: RpcReplyPort<Answered>,
    },
    /// Frees `session`'s states (after its cohort in flight, if any); answers when done.
    Close {
        session: SessionId,
        reply: RpcReplyPort<()>,
    },
    /// A cohort finished: `sessions` in cohort order, and their answers in that order.
    Done {
        sessions: Vec<SessionId>,
        answers: Result<Vec<Answer>, RuntimeError>,
    },
    /// The launch window of the oldest waiting input may have passed.
    Tick,
    /// From now on, cohorts are padded up to these sizes.
    Buckets(CohortBuckets),
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for BatcherMsg {}

struct Waiting {
    session: SessionId,
    ids: Vec<i64>,
    pick: Option<PickRequest>,
    reply: RpcReplyPort<Answered>,
    since: Instant,
}

pub struct BatcherActor;

pub struct BatcherArgs {
    pub children: Arc<RwLock<Children>>,
    pub batching: Batching,
    pub stats: Arc<BatchStats>,
}

pub struct BatcherState {
    children: Arc<RwLock<Children>>,
    batching: Batching,
    stats: Arc<BatchStats>,
    /// Sessions that have fed and not closed.
    open: HashSet<SessionId>,
    waiting: VecDeque<Waiting>,
    /// Sessions in cohorts in flight, with the replies they are owed.
    in_flight: Vec<(SessionId, RpcReplyPort<Answered>)>,
    cohorts: usize,
    /// Closes waiting for their session's cohort.
    closing: Vec<(SessionId, RpcReplyPort<()>)>,
    tick_armed: bool,
    /// When a cohort last finished: the sessions it answered get a window from then to come
    /// back, even if inputs have been waiting longer (else two halves of the sessions
    /// alternate in two cohorts forever).
    freed_at: Instant,
}

impl BatcherState {
    fn children(&self) -> Children {
        self.children
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn flying(&self, session: SessionId) -> bool {
        self.in_flight.iter().any(|(s, _)| *s == session)
    }

    /// Launches every cohort that may start now; arms the window timer otherwise.
    fn pump(&mut self, myself: &ActorRef<BatcherMsg>) {
        while self.cohorts < self.batching.max_in_flight.max(1) && !self.waiting.is_empty() {
            let absent = self
                .open
                .len()
                .saturating_sub(self.in_flight.len() + self.waiting.len());
            let since = self.waiting.front().expect("non-empty").since;
            let age = since.max(self.freed_at).elapsed();
            if absent > 0 && age < self.batching.window {
                if !self.tick_armed {
                    self.tick_armed = true;
                    myself.send_after(self.batching.window - age, || BatcherMsg::Tick);
                }
                return;
            }
            self.launch(myself);
        }
    }

    fn launch(&mut self, myself: &ActorRef<BatcherMsg>) {
        let len = self.waiting.front().expect("non-empty").ids.len();
        let mut cohort = Vec::new();
        let mut rest = VecDeque::with_capacity(self.waiting.len());
        let fits = |n: usize| n == 0 || (n + 1) * len <= self.batching.max_tokens;
        for w in self.waiting.drain(..) {
            if w.ids.len() == len
                && cohort.len() < self.batching.max_batch.max(1)
                && fits(cohort.len())
            {
                cohort.push(w);
            } else {
                rest.push_back(w);
            }
        }
        self.waiting = rest;
        cohort.sort_by_key(|w| w.session);
        let mut sessions: Vec<SessionId> = cohort.iter().map(|w| w.session).collect();
        let mut ids: Vec<i64> = cohort.iter().flat_map(|w| w.ids.iter().copied()).collect();
        let mut picks: Vec<Option<PickRequest>> =
            cohort.iter_mut().map(|w| w.pick.take()).collect();
        let real = sessions.len();
        let size = self
            .batching
            .buckets
            .size_for(real, len, self.batching.max_tokens);
        // Pad sessions: token 0, greedy on the device without logits when the others pick
        // there; their answers find no reply and are dropped.
        let pad_pick = (size > real && picks.iter().any(Option::is_some)).then(|| PickRequest {
            sampling: SamplingParams::greedy(),
            history: Vec::new(),
            generated: Vec::new(),
            bias: Vec::new(),
            want_logits: false,
        });
        for i in (0..size - real).rev() {
            sessions.push(pad_session(i));
            ids.extend(std::iter::repeat_n(0, len));
            picks.push(pad_pick.clone());
        }
        self.in_flight
            .extend(cohort.into_iter().map(|w| (w.session, w.reply)));
        self.cohorts += 1;
        self.stats.cohorts.fetch_add(1, Ordering::Relaxed);
        self.stats.inputs.fetch_add(real as u64, Ordering::Relaxed);
        self.stats
            .padded
            .fetch_add((size - real) as u64, Ordering::Relaxed);
        let children = self.children();
        let me = myself.clone();
        let stats = self.stats.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let answers = run_cohort(&children, &sessions, ids, len, picks, &stats.phases).await;
            add_ns(&stats.phases.cohort_ns, start);
            // The answers go out from the batcher, after it has counted the cohort done, so a
            // session's next input always finds it no longer in flight.
            let _ = me.cast(BatcherMsg::Done { sessions, answers });
        });
    }

    fn done(&mut self, sessions: Vec<SessionId>, answers: Result<Vec<Answer>, RuntimeError>) {
        self.cohorts -= 1;
        self.freed_at = Instant::now();
        let mut answers = answers.map(|a| a.into_iter().map(Some).collect::<Vec<_>>());
        for (i, s) in sessions.into_iter().enumerate() {
            let Some(k) = self.in_flight.iter().position(|(f, _)| *f == s) else {
                continue;
            };
            let (_, reply) = self.in_flight.swap_remove(k);
            let r = match &mut answers {
                Ok(all) => all[i].take().ok_or_else(|| {
                    RuntimeError::Runtime(format!("{s}: answered twice in one cohort"))
                }),
                Err(e) => Err(e.for_each_session()),
            };
            let _ = reply.send(r);
        }
        let ready: Vec<(SessionId, RpcReplyPort<()>)> = {
            let (ready, wait) = std::mem::take(&mut self.closing)
                .into_iter()
                .partition(|(s, _)| !self.flying(*s));
            self.closing = wait;
            ready
        };
        for (s, reply) in ready {
            self.close_now(s, reply);
        }
    }

    fn close_now(&mut self, session: SessionId, reply: RpcReplyPort<()>) {
        let was_open = self.open.remove(&session);
        let children = self.children();
        let stats = self.stats.clone();
        tokio::spawn(async move {
            close_everywhere(&children, session).await;
            if was_open {
                stats.open.fetch_sub(1, Ordering::Relaxed);
            }
            let _ = reply.send(());
        });
    }
}

/// Embedding, every layer and the decode path for `sessions` (each `len` inputs, back to
/// back in `ids`): each session's answer, in order. With any [`PickRequest`] the tokens are
/// chosen on the device (the sessions without one get their logits back beside them).
pub(super) async fn run_cohort(
    children: &Children,
    sessions: &[SessionId],
    ids: Vec<i64>,
    len: usize,
    picks: Vec<Option<PickRequest>>,
    phases: &CohortPhases,
) -> Result<Vec<Answer>, RuntimeError> {
    use super::trace::{Mark, mark};
    super::trace::start();
    let t = Instant::now();
    // The layers' handles are asked while the edge embeds: the two round trips overlap.
    let (h, holders) = tokio::join!(
        ask(&children.edge, "edge", |reply| EdgeMsg::SessionEmbed {
            ids,
            batch: sessions.len(),
            seq_len: len,
            reply,
        }),
        super::layers::share_layers(&children.layers)
    );
    let t = add_ns(&phases.embed_ns, t);
    mark(Mark::Embedded);
    let h = super::layers::run_layers(&holders?, sessions, h?).await?;
    let t = add_ns(&phases.layers_ns, t);
    mark(Mark::LayersDone);
    let n = sessions.len();
    let answers = if picks.iter().all(Option::is_none) {
        let logits = ask(&children.edge, "edge", |reply| EdgeMsg::SessionDecode {
            sessions: sessions.to_vec(),
            h,
            reply,
        })
        .await;
        logits.and_then(|all| {
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
            reply,
        })
        .await;
        sampled.and_then(|(picked, logits)| answers_of(picks, &picked, logits.as_deref()))
    };
    add_ns(&phases.decode_ns, t);
    mark(Mark::Done);
    answers
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
fn add_ns(to: &AtomicU64, since: Instant) -> Instant {
    let now = Instant::now();
    to.fetch_add((now - since).as_nanos() as u64, Ordering::Relaxed);
    now
}

/// Frees `session`'s neuron states in every actor (errors ignored: a stopped actor has none).
pub(crate) async fn close_everywhere(c: &Children, session: SessionId) {
    let close = StageControl::SessionClose { session };
    let _ = control_all(&c.edge, &c.layers, close, |_| close).await;
}

impl Actor for BatcherActor {
    type Msg = BatcherMsg;
    type State = BatcherState;
    type Arguments = BatcherArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<BatcherMsg>,
        a: BatcherArgs,
    ) -> Result<BatcherState, ActorProcessingErr> {
        Ok(BatcherState {
            children: a.children,
            batching: a.batching,
            stats: a.stats,
            open: HashSet::new(),
            waiting: VecDeque::new(),
            in_flight: Vec::new(),
            cohorts: 0,
            closing: Vec::new(),
            tick_armed: false,
            freed_at: Instant::now(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<BatcherMsg>,
        msg: BatcherMsg,
        s: &mut BatcherState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BatcherMsg::Feed {
                session,
                ids,
                pick,
                reply,
            } => {
                if ids.is_empty() {
                    let _ = reply.send(Err(RuntimeError::Runtime(format!(
                        "{session}: nothing to feed"
                    ))));
                } else if s.flying(session) || s.waiting.iter().any(|w| w.session == session) {
                    let _ = reply.send(Err(RuntimeError::Runtime(format!(
                        "{session} already has an input in flight"
                    ))));
                } else {
                    if s.open.insert(session) {
                        s.stats.open.fetch_add(1, Ordering::Relaxed);
                    }
                    s.waiting.push_back(Waiting {
                        session,
                        ids,
                        pick,
                        reply,
                        since: Instant::now(),
                    });
                }
            }
            BatcherMsg::Close { session, reply } => {
                // An input still waiting is dropped: its caller has gone.
                s.waiting.retain(|w| w.session != session);
                if s.flying(session) {
                    s.closing.push((session, reply));
                } else {
                    s.close_now(session, reply);
                }
            }
            BatcherMsg::Done { sessions, answers } => s.done(sessions, answers),
            BatcherMsg::Tick => s.tick_armed = false,
            BatcherMsg::Buckets(b) => s.batching.buckets = b,
        }
        s.pump(&myself);
        Ok(())
    }
}
