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
//! back (its client, or its sampling). A prompt also waits, at most [`RESTORE_HOLD`] and never
//! while a decoding step waits, for the restores queued or running, so that the sessions they
//! start join its cohort instead of their restore waiting for its pass.
//!
//! A cohort has one input length: the oldest waiting input picks it and every waiting input
//! of that length joins (at most [`Batching::max_batch`]), except that after a cohort of
//! prompts the decoding steps waiting go first (prompts and steps take turns, so a burst of
//! prompts holds no stream's next token, a prompt's last token included, for more than one
//! prompt cohort). Decoding tokens (length 1) batch
//! together; a prompt runs with the prompts of its length. A cohort's sessions are ordered by
//! id, so the same sessions arrive at each layer in the same order step after step, and the
//! layers keep their states without copying (`nsactor_backend_core::SessionTable`).
//!
//! A cohort is padded up to its bucket ([`CohortBuckets`]) with pad sessions whose answers are
//! dropped, so a GPU backend meets only the shapes it ran while warming up.
//!
//! A session either feeds one input at a time ([`BatcherMsg::Feed`]) or streams
//! ([`BatcherMsg::Stream`]): then the batcher queues each chosen token as its next input as
//! soon as its cohort is done (`super::stream`), and the launch never waits for it, nor for a
//! stream that has ended and whose session is not closed yet (its reader is still taking its
//! last tokens).
//!
//! Closing a session waits for its cohort in flight, then frees its states in every actor.
//!
//! A cohort that loses a stage (a panic, a stopped actor) fails every session that has run,
//! and the batcher holds its inputs while the supervisor rebuilds the actors (`super::heal`).

pub use super::batching::{BatchStats, Batching, MAX_BATCH, PASS_FRAME_ROWS, RESTORE_HOLD};
use super::buckets::{CohortBuckets, pad_session};
pub use super::cohort::{Answer, Answered, CohortPhases, PickRequest, Picked};
use super::cohort::{add_ns, run_cohort};
use super::heal::{
    HealTimings, Health, HealthCell, RestartPolicy, Restarts, loses_stage, lost_session,
};
use super::stream::Continuation;
use futures_util::FutureExt;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::supervisor::SupMsg;
use nsactor_pipeline::topology::Children;
use nsactor_plugin_api::{SessionId, SnapshotId};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Instant;

mod loss;
mod reply;
mod sessions;
mod turns;
use reply::Reply;
pub use sessions::{Closing, Keep};

pub enum BatcherMsg {
    /// Runs `ids` through `session`; answers the last position's logits, with `every` every
    /// position's ([`Answer::Every`]), or with `pick` the token chosen on the device. With
    /// `keep`, every stage keeps a snapshot of the session's states as the pass leaves them,
    /// in the pass's own jobs.
    Feed {
        session: SessionId,
        ids: Vec<i64>,
        pick: Option<PickRequest>,
        every: bool,
        keep: Option<Keep>,
        port: RpcReplyPort<Answered>,
    },
    /// Runs `ids` through `session`, then every token the stream chooses, each fed back as
    /// the session's next input until the stream ends (`super::stream`).
    Stream {
        session: SessionId,
        ids: Vec<i64>,
        cont: Continuation,
    },
    /// A parked stream's reader has caught up: queue its next input (`super::stream`).
    Resume { session: SessionId },
    /// Frees a session's states (after its cohort in flight, if any), keeping a snapshot of
    /// them first if asked ([`Closing`]).
    Close(Closing),
    /// New `session` starts from `snapshot`, having seen `depth` inputs.
    Restore {
        session: SessionId,
        snapshot: SnapshotId,
        depth: usize,
        reply: RpcReplyPort<Result<bool, RuntimeError>>,
    },
    /// The restores in flight are done: the next queued ones go.
    Restored,
    /// The close job in flight is done: the next closes go.
    Ended,
    /// A cohort finished: `sessions` in cohort order, and their answers in that order;
    /// `generation` is how many times the stages had been lost when it launched.
    Done {
        generation: u64,
        sessions: Vec<SessionId>,
        answers: Result<Vec<Answer>, RuntimeError>,
    },
    /// The launch window of the oldest waiting input may have passed.
    Tick,
    /// From now on, cohorts are padded up to these sizes.
    Buckets(CohortBuckets),
    /// From now on, a cohort carries at most this many input tokens ([`Batching::max_tokens`]).
    PassTokens(usize),
    /// From now on, a cohort holds at most this many sessions ([`Batching::max_batch`]).
    PassSessions(usize),
    /// From now on, lost stages are rebuilt as often as this allows.
    Policy(RestartPolicy),
    /// The supervisor's rebuild after a lost stage ended: how long it took, or why not.
    Healed(Result<HealTimings, RuntimeError>),
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for BatcherMsg {}

struct Waiting {
    session: SessionId,
    ids: Vec<i64>,
    reply: Reply,
    since: Instant,
}

pub struct BatcherActor;

pub struct BatcherArgs {
    pub children: Arc<RwLock<Children>>,
    pub batching: Batching,
    pub stats: Arc<BatchStats>,
    /// Rebuilds the actors after a lost stage.
    pub sup: ActorRef<SupMsg>,
    pub health: Arc<HealthCell>,
}

pub struct BatcherState {
    children: Arc<RwLock<Children>>,
    batching: Batching,
    stats: Arc<BatchStats>,
    /// Sessions that have fed and not closed.
    open: HashSet<SessionId>,
    waiting: VecDeque<Waiting>,
    /// Sessions in cohorts in flight, with the replies they are owed.
    in_flight: Vec<(SessionId, Reply)>,
    /// Streams whose readers lag, with their next inputs held until they catch up.
    parked: Vec<(SessionId, Vec<i64>, Continuation)>,
    /// Open sessions whose stream has ended: not expected back until they feed or close.
    ended: HashSet<SessionId>,
    /// Open sessions whose caller feeds them one token at a time (its last input was one
    /// token of a single feed): the launch window waits for these, and only these, when they
    /// are away. A stream is queued again by the batcher itself; a prompt's caller, between
    /// its pieces or busy with the prefix cache, may be away longer than the window.
    steppers: HashSet<SessionId>,
    cohorts: usize,
    /// Closes waiting for their session's cohort.
    closing: Vec<Closing>,
    /// Inputs each open session has seen (the prefix cache's snapshots say how deep they are).
    fed: HashMap<SessionId, usize>,
    /// Restores waiting for the one running (`restoring_now`) to finish.
    restoring: Vec<sessions::Restoring>,
    /// The sessions of the restore running now (a close waits for it).
    restoring_now: Vec<SessionId>,
    /// Closed sessions whose states the next close job frees.
    ending: Vec<sessions::Ending>,
    /// Whether a close job runs.
    ending_now: bool,
    tick_armed: bool,
    /// Whether the last cohort launched was of prompts (inputs of more than one token): the
    /// decoding steps waiting then go next, whatever their age.
    after_prompts: bool,
    /// When a cohort last finished: the sessions it answered get a window from then to come
    /// back, even if inputs have been waiting longer (else two halves of the sessions
    /// alternate in two cohorts forever).
    freed_at: Instant,
    /// Open sessions that have not run yet (they have no states to lose).
    fresh: HashSet<SessionId>,
    /// Sessions whose states were lost with a stage, and how: refused until closed.
    lost: HashMap<SessionId, String>,
    sup: ActorRef<SupMsg>,
    health: Arc<HealthCell>,
    policy: RestartPolicy,
    restarts: Restarts,
    /// Times the stages have been lost: a cohort launched before the last loss ran on actors
    /// that are gone.
    generation: u64,
}

impl BatcherState {
    fn children(&self) -> Children {
        self.children
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Steppers not back yet ([`BatcherState::steppers`]).
    fn absent(&self) -> usize {
        if self.steppers.is_empty() {
            return 0;
        }
        let flying = self.in_flight.iter().map(|f| &f.0);
        let queued = self.waiting.iter().map(|w| &w.session);
        let here: HashSet<&SessionId> = flying
            .chain(queued)
            .chain(self.parked.iter().map(|p| &p.0))
            .collect();
        let away = self.steppers.iter().filter(|s| !here.contains(s));
        away.filter(|s| !self.ended.contains(s)).count()
    }

    /// Whether `session` is in a cohort or a restore now running.
    fn flying(&self, session: SessionId) -> bool {
        self.in_flight.iter().any(|(s, _)| *s == session) || self.restoring_now.contains(&session)
    }

    /// Whether `session` may queue `ids`: something to feed, nothing of its in flight, its
    /// states not lost, decoding not failed.
    fn admit(&self, session: SessionId, ids: &[i64]) -> Result<(), RuntimeError> {
        if let Some(cause) = self.lost.get(&session) {
            Err(lost_session(cause))
        } else if !self.health.is_serving()
            && let Health::Failed { cause } = self.health.state()
        {
            Err(RuntimeError::Broken(format!(
                "decoding has failed: {cause}"
            )))
        } else if ids.is_empty() {
            Err(RuntimeError::Runtime(format!("{session}: nothing to feed")))
        } else if self.flying(session)
            || self.waiting.iter().any(|w| w.session == session)
            || self.parked.iter().any(|p| p.0 == session)
        {
            Err(RuntimeError::Runtime(format!(
                "{session} already has an input in flight"
            )))
        } else {
            Ok(())
        }
    }

    fn queue(&mut self, session: SessionId, ids: Vec<i64>, reply: Reply) {
        self.ended.remove(&session);
        if self.open.insert(session) {
            self.stats.open.fetch_add(1, Ordering::Relaxed);
            self.fresh.insert(session);
        }
        self.waiting.push_back(Waiting {
            session,
            ids,
            reply,
            since: Instant::now(),
        });
    }

    /// Launches every cohort that may start now; arms the window timer otherwise.
    fn pump(&mut self, myself: &ActorRef<BatcherMsg>) {
        if !self.health.is_serving() {
            return;
        }
        while self.cohorts < self.batching.max_in_flight.max(1) && !self.waiting.is_empty() {
            let absent = self.absent();
            let front = self.waiting.front().expect("non-empty");
            let since = front.since;
            // A prompt waits a moment for the restores queued or running: the sessions they
            // start send their prompts right after, and a restore would wait for the pass in
            // flight (`crate::order`) while every session it starts waits with it.
            // Never while a decoding step waits: running streams are not held up.
            let restores = !self.restoring.is_empty() || !self.restoring_now.is_empty();
            let held = since.elapsed();
            if restores
                && front.ids.len() > 1
                && held < RESTORE_HOLD
                && !self.waiting.iter().any(|w| w.ids.len() == 1)
            {
                if !self.tick_armed {
                    self.tick_armed = true;
                    myself.send_after(RESTORE_HOLD - held, || BatcherMsg::Tick);
                }
                return;
            }
            let age = since.max(self.freed_at).elapsed();
            if absent > 0 && age < self.batching.window {
                if !self.tick_armed {
                    self.tick_armed = true;
                    myself.send_after(self.batching.window - age, || BatcherMsg::Tick);
                }
                return;
            }
            if absent > 0 {
                self.stats.window_launches.fetch_add(1, Ordering::Relaxed);
            }
            self.launch(myself);
        }
    }

    fn launch(&mut self, myself: &ActorRef<BatcherMsg>) {
        let (len, every) = turns::next_input(&self.waiting, self.after_prompts);
        self.after_prompts = len > 1;
        let mut cohort = Vec::new();
        let mut rest = VecDeque::with_capacity(self.waiting.len());
        let fits = |n: usize| n == 0 || (n + 1) * len <= self.batching.max_tokens;
        for w in self.waiting.drain(..) {
            if w.ids.len() == len
                && w.reply.every() == every
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
        for w in &cohort {
            self.fresh.remove(&w.session);
            if matches!(w.reply, Reply::Once { .. }) && len == 1 {
                self.steppers.insert(w.session);
            } else {
                self.steppers.remove(&w.session);
            }
            let fed = self.fed.entry(w.session).or_default();
            *fed = fed.saturating_add(w.ids.len());
        }
        let mut sessions: Vec<SessionId> = cohort.iter().map(|w| w.session).collect();
        let mut ids: Vec<i64> = cohort.iter().flat_map(|w| w.ids.iter().copied()).collect();
        let mut picks: Vec<Option<PickRequest>> =
            cohort.iter_mut().map(|w| w.reply.pick()).collect();
        let keeps = self.keeps(&mut cohort);
        let real = sessions.len();
        let size = self
            .batching
            .buckets
            .size_for(real, len, self.batching.max_tokens);
        // Pad sessions: token 0, greedy on the device without logits when the others pick
        // there; their answers find no reply and are dropped.
        let pad_pick =
            (size > real && picks.iter().any(Option::is_some)).then(|| PickRequest::greedy(false));
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
        let generation = self.generation;
        tokio::spawn(async move {
            let start = Instant::now();
            // A panic in the cohort's own task still answers its sessions (and, as a lost
            // stage, rebuilds the actors), never leaves them waiting.
            let shape = super::cohort::CohortShape { len, every };
            let saves = keeps.saves();
            // The pass's own time, from when it holds the devices (not its wait for a state
            // op), for the chunk pacer.
            let run = crate::order::pass(async {
                let t = Instant::now();
                let r = run_cohort(
                    &children,
                    &sessions,
                    ids,
                    shape,
                    picks,
                    &saves,
                    &stats.phases,
                )
                .await;
                (r, Some(t.elapsed()))
            });
            let (answers, ran) = AssertUnwindSafe(run)
                .catch_unwind()
                .await
                .unwrap_or_else(|p| {
                    let why = nsactor_pipeline::worker::panic_message(&*p);
                    let e = RuntimeError::Broken(format!("a cohort's task panicked: {why}"));
                    (Err(e), None)
                });
            let answers = keeps.answer(&children, answers);
            add_ns(&stats.phases.cohort_ns, start);
            // Scoring passes, and passes that also kept snapshots (longer than their tokens),
            // teach the pacer nothing.
            if let Some(took) = ran
                && answers.is_ok()
                && !every
                && saves.is_empty()
            {
                stats.pacer.observe(len, real, took);
            }
            tracing::trace!(
                "cohort of {real} (padded to {size}) × {len} inputs: {:.2} ms ({:.2} ms holding the devices)",
                start.elapsed().as_secs_f64() * 1e3,
                ran.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
            );
            // The answers go out from the batcher, after it has counted the cohort done, so a
            // session's next input always finds it no longer in flight.
            let _ = me.cast(BatcherMsg::Done {
                generation,
                sessions,
                answers,
            });
        });
    }

    fn done(
        &mut self,
        myself: &ActorRef<BatcherMsg>,
        generation: u64,
        sessions: Vec<SessionId>,
        answers: Result<Vec<Answer>, RuntimeError>,
    ) {
        self.cohorts -= 1;
        // A cohort of actors already replaced (it ran on while they were rebuilt) loses
        // nothing more.
        let lost_now = answers
            .as_ref()
            .err()
            .filter(|e| generation == self.generation && loses_stage(e))
            .map(|e| e.to_string());
        // Before anyone is answered: a client that has its error sees decoding recovering.
        if let Some(cause) = lost_now {
            self.lose_stage(myself, cause);
        }
        self.freed_at = Instant::now();
        let mut answers = answers.map(|a| a.into_iter().map(Some).collect::<Vec<_>>());
        for (i, s) in sessions.into_iter().enumerate() {
            let Some(k) = self.in_flight.iter().position(|(f, _)| *f == s) else {
                continue;
            };
            let (_, reply) = self.in_flight.swap_remove(k);
            let r = match (&mut answers, self.lost.get(&s)) {
                (Err(e), _) => Err(e.for_each_session()),
                // Answered by actors that are gone: it cannot go on.
                (Ok(_), Some(cause)) => Err(lost_session(cause)),
                (Ok(all), None) => all[i].take().ok_or_else(|| {
                    RuntimeError::Runtime(format!("{s}: answered twice in one cohort"))
                }),
            };
            if r.is_err() {
                // Its states may have moved in some stages and not in others: never kept.
                self.fed.insert(s, usize::MAX);
            }
            match reply {
                Reply::Once { port, .. } => {
                    let _ = port.send(r);
                }
                Reply::Stream(c) => {
                    let closing = self.closing.iter().any(|c| c.session == s);
                    match c.answer(r).filter(|_| !closing) {
                        Some((ids, c)) if c.lagging() => self.parked.push((s, ids, c)),
                        Some((ids, c)) => self.queue(s, ids, Reply::Stream(c)),
                        // Ended (its budget, an end token, an error, a close): the session
                        // stays open until its reader closes it, but will not feed.
                        None if self.open.contains(&s) => {
                            self.ended.insert(s);
                        }
                        None => {}
                    }
                }
            }
        }
        self.close_ready();
    }

    /// Closes the sessions whose close waited for a cohort or a restore that is now done.
    fn close_ready(&mut self) {
        let ready: Vec<Closing> = {
            let (ready, wait) = std::mem::take(&mut self.closing)
                .into_iter()
                .partition(|c| !self.flying(c.session));
            self.closing = wait;
            ready
        };
        for c in ready {
            self.close_now(c);
        }
    }
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
            parked: Vec::new(),
            ended: HashSet::new(),
            steppers: HashSet::new(),
            cohorts: 0,
            closing: Vec::new(),
            fed: HashMap::new(),
            restoring: Vec::new(),
            restoring_now: Vec::new(),
            ending: Vec::new(),
            ending_now: false,
            tick_armed: false,
            after_prompts: false,
            freed_at: Instant::now(),
            fresh: HashSet::new(),
            lost: HashMap::new(),
            sup: a.sup,
            health: a.health,
            policy: RestartPolicy::default(),
            restarts: Restarts::default(),
            generation: 0,
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
                every,
                keep,
                port,
            } => {
                let reply = Reply::Once {
                    port,
                    pick,
                    every,
                    keep,
                };
                match s.admit(session, &ids) {
                    Ok(()) => s.queue(session, ids, reply),
                    Err(e) => reply.refuse(e),
                }
            }
            BatcherMsg::Stream { session, ids, cont } => match s.admit(session, &ids) {
                Ok(()) => s.queue(session, ids, Reply::Stream(cont)),
                Err(e) => cont.refuse(e),
            },
            BatcherMsg::Close(c) => s.close(c),
            BatcherMsg::Restore {
                session,
                snapshot,
                depth,
                reply,
            } => s.restore(&myself, session, snapshot, depth, reply),
            BatcherMsg::Restored => {
                s.restoring_now.clear();
                s.close_ready();
                s.restore_queued(&myself);
            }
            BatcherMsg::Ended => s.ending_now = false,
            BatcherMsg::Done {
                generation,
                sessions,
                answers,
            } => s.done(&myself, generation, sessions, answers),
            BatcherMsg::Resume { session } => {
                if let Some(k) = s.parked.iter().position(|p| p.0 == session) {
                    let (_, ids, c) = s.parked.swap_remove(k);
                    s.queue(session, ids, Reply::Stream(c));
                }
            }
            BatcherMsg::Tick => s.tick_armed = false,
            BatcherMsg::Buckets(b) => s.batching.buckets = b,
            BatcherMsg::PassTokens(n) => s.batching.max_tokens = n.max(1),
            BatcherMsg::PassSessions(n) => s.batching.max_batch = n.max(1),
            BatcherMsg::Policy(p) => s.policy = p,
            BatcherMsg::Healed(r) => s.healed(r),
        }
        s.end_queued(&myself);
        s.pump(&myself);
        Ok(())
    }
}
