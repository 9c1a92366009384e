//! The batcher's session bookkeeping outside cohorts: a close, which may first keep a
//! snapshot of the session's states, and a new session started from a snapshot (the prefix
//! state cache, `crate::snapshot`).

use super::{BatcherMsg, BatcherState, Reply, Waiting};
use crate::cohort::{Answer, close_everywhere};
use crate::kept::{self as snapshot, Kept, Snapshot};
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::state::SaveTally;
use nsactor_pipeline::topology::Children;
use nsactor_plugin_api::{SessionId, SnapshotId};
use ractor::{ActorRef, RpcReplyPort};
use std::sync::atomic::Ordering;

/// A close's request to keep the session's states: the snapshot's id, and where the
/// snapshot (or why not) goes.
pub type Keep = (SnapshotId, RpcReplyPort<Result<Kept, RuntimeError>>);

/// Most restores in one op per stage. A stage restores a batch with one gather per state
/// field, whatever its size (ABI 15; before it, one copy per field and session: 256 restores
/// took 1.77 s on the H200 and batches were kept to 16), so this only bounds the work of one
/// job: as many as a cohort of the largest bucket holds.
const RESTORES_AT_ONCE: usize = 256;

/// A restore waiting to run: the new session, its snapshot, and who waits for it.
pub(super) type Restoring = (
    SessionId,
    SnapshotId,
    RpcReplyPort<Result<bool, RuntimeError>>,
);

/// A closed session whose states are freed in the next close job
/// ([`BatcherState::end_queued`]), after a snapshot of them if asked (with the inputs they
/// have seen).
pub(super) struct Ending {
    session: SessionId,
    keep: Option<(Keep, usize)>,
    reply: RpcReplyPort<()>,
    was_open: bool,
}

/// A close: `session`'s states are freed once it has no cohort in flight (after a snapshot of
/// them is kept, with `keep`); `reply` answers when they are.
pub struct Closing {
    pub session: SessionId,
    pub reply: RpcReplyPort<()>,
    pub keep: Option<Keep>,
}

/// The snapshots a cohort keeps for the feeds that asked (`BatcherMsg::Feed`'s `keep`): each
/// session, its snapshot's id, the inputs it will have seen, and where its [`Kept`] goes.
pub(super) struct Keeps(Vec<(SessionId, Keep, usize)>);

impl Keeps {
    /// The cohort's saves, for `run_cohort`.
    pub(super) fn saves(&self) -> Vec<(SessionId, SnapshotId)> {
        self.0.iter().map(|(s, (id, _), _)| (*s, *id)).collect()
    }

    /// Answers each keep from the cohort's outcome (a snapshot that some stage could not keep
    /// is dropped from the others); hands the sessions' answers on.
    pub(super) fn answer(
        self,
        children: &Children,
        r: Result<(Vec<Answer>, SaveTally), RuntimeError>,
    ) -> Result<Vec<Answer>, RuntimeError> {
        let (answers, tally) = match r {
            Ok((a, t)) => (Ok(a), t.0),
            Err(e) => {
                let each = self.0.iter().map(|_| Err(e.for_each_session())).collect();
                (Err(e), each)
            }
        };
        for ((_, (id, port), fed), saved) in self.0.into_iter().zip(tally) {
            let kept = saved.map(|bytes| Kept {
                snapshot: Snapshot { id, bytes },
                fed,
            });
            if kept.is_err() {
                let children = children.clone();
                tokio::spawn(async move { snapshot::drop_everywhere(&children, id).await });
            }
            let _ = port.send(kept);
        }
        answers
    }
}

impl BatcherState {
    /// Takes the keeps of `cohort`'s feeds (after their inputs are counted in `fed`).
    pub(super) fn keeps(&self, cohort: &mut [Waiting]) -> Keeps {
        let mut out = Vec::new();
        for w in cohort {
            if let Reply::Once { keep, .. } = &mut w.reply
                && let Some(k) = keep.take()
            {
                out.push((w.session, k, self.fed.get(&w.session).copied().unwrap_or(0)));
            }
        }
        Keeps(out)
    }

    pub(super) fn close(&mut self, c: Closing) {
        // An input still waiting is dropped: its caller has gone; so is a restore not begun.
        self.waiting.retain(|w| w.session != c.session);
        self.parked.retain(|p| p.0 != c.session);
        if let Some(k) = self.restoring.iter().position(|r| r.0 == c.session) {
            let (_, _, reply) = self.restoring.remove(k);
            let why = format!("{} was closed before its restore began", c.session);
            let _ = reply.send(Err(RuntimeError::Runtime(why)));
        }
        if self.flying(c.session) {
            self.closing.push(c);
        } else {
            self.close_now(c);
        }
    }

    pub(super) fn close_now(&mut self, c: Closing) {
        let Closing {
            session,
            reply,
            keep,
        } = c;
        self.ended.remove(&session);
        self.steppers.remove(&session);
        let fed = self.fed.remove(&session).unwrap_or(0);
        let never_ran = self.fresh.remove(&session);
        if never_ran && self.open.remove(&session) {
            self.stats.open.fetch_sub(1, Ordering::Relaxed);
        }
        let lost = self.lost.remove(&session);
        if never_ran || lost.is_some() {
            // No actor holds states for it: it never ran, or they went with the old actors
            // (and the actors now may be the old ones, being stopped).
            if let Some((_, port)) = keep {
                let why = lost.unwrap_or_else(|| "it never ran".into());
                let _ = port.send(Err(RuntimeError::Runtime(format!(
                    "{session} has no states to keep: {why}"
                ))));
            }
            let _ = reply.send(());
            return;
        }
        let was_open = self.open.remove(&session);
        self.ending.push(Ending {
            session,
            keep: keep.map(|k| (k, fed)),
            reply,
            was_open,
        });
    }

    /// Frees the states of the sessions closed so far, after keeping the snapshots asked for,
    /// as one save and one close op per stage, unless such a job is running (then they go
    /// when it is done: `BatcherMsg::Ended`). Many sessions that end together (a cohort's
    /// last tokens) cost a few ops, not two each.
    pub(super) fn end_queued(&mut self, myself: &ActorRef<BatcherMsg>) {
        if self.ending_now || self.ending.is_empty() {
            return;
        }
        self.ending_now = true;
        let batch = std::mem::take(&mut self.ending);
        let (children, stats, me) = (self.children(), self.stats.clone(), myself.clone());
        tokio::spawn(async move {
            let saves: Vec<(SessionId, SnapshotId)> = batch
                .iter()
                .filter_map(|e| e.keep.as_ref().map(|((id, _), _)| (e.session, *id)))
                .collect();
            let mut saved = if saves.is_empty() {
                Vec::new()
            } else {
                snapshot::save_many(&children, saves).await
            }
            .into_iter();
            let sessions: Vec<SessionId> = batch.iter().map(|e| e.session).collect();
            close_everywhere(&children, &sessions).await;
            let _ = me.cast(BatcherMsg::Ended);
            for e in batch {
                if e.was_open {
                    stats.open.fetch_sub(1, Ordering::Relaxed);
                }
                // A snapshot is answered once the states are freed too: a caller that waits
                // for it (the server, before a request's place is given back) sees the
                // session gone.
                if let Some(((_, port), fed)) = e.keep {
                    let k = saved.next().expect("one snapshot per keep");
                    let _ = port.send(k.map(|snapshot| Kept { snapshot, fed }));
                }
                let _ = e.reply.send(());
            }
        });
    }

    /// New `session` starts from `snapshot` in every stage: from now on it holds states (a
    /// close frees them, a lost stage loses them) and has seen `depth` inputs. Answers `false`,
    /// touching nothing, while decoding is not serving: the stages being rebuilt are not the
    /// ones that kept the snapshot.
    pub(super) fn restore(
        &mut self,
        myself: &ActorRef<BatcherMsg>,
        session: SessionId,
        snapshot: SnapshotId,
        depth: usize,
        reply: RpcReplyPort<Result<bool, RuntimeError>>,
    ) {
        if !self.health.is_serving() {
            let _ = reply.send(Ok(false));
            return;
        }
        if self.open.contains(&session) || self.lost.contains_key(&session) {
            let _ = reply.send(Err(RuntimeError::Runtime(format!(
                "{session} has already run: only a new session starts from a snapshot"
            ))));
            return;
        }
        if let Err(e) = self.admit(session, &[0]) {
            let _ = reply.send(Err(e));
            return;
        }
        self.open.insert(session);
        self.stats.open.fetch_add(1, Ordering::Relaxed);
        self.fed.insert(session, depth);
        self.restoring.push((session, snapshot, reply));
        self.restore_queued(myself);
    }

    /// Runs the restores queued so far (at most [`RESTORES_AT_ONCE`]) as one op per stage,
    /// unless one is running (then they go when it is done: `BatcherMsg::Restored`; a close
    /// of one of its sessions waits for it, as for a cohort). Many
    /// requests that arrive at once (a shared system prompt) restore in a few ops, not one
    /// each.
    pub(super) fn restore_queued(&mut self, myself: &ActorRef<BatcherMsg>) {
        if !self.restoring_now.is_empty() || self.restoring.is_empty() {
            return;
        }
        let n = self.restoring.len().min(RESTORES_AT_ONCE);
        let batch: Vec<Restoring> = self.restoring.drain(..n).collect();
        self.restoring_now = batch.iter().map(|r| r.0).collect();
        let (children, me) = (self.children(), myself.clone());
        tokio::spawn(async move {
            let items = batch.iter().map(|(s, id, _)| (*s, *id)).collect();
            let outcomes = snapshot::restore_many(&children, items).await;
            // The batcher hears first: a session's next input, sent once it has its answer,
            // then finds its restore done.
            let _ = me.cast(BatcherMsg::Restored);
            for ((_, _, reply), r) in batch.into_iter().zip(outcomes) {
                let _ = reply.send(r.map(|()| true));
            }
        });
    }
}
