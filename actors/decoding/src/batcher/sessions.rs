//! The batcher's session bookkeeping outside cohorts: a close, which may first keep a
//! snapshot of the session's states, and a new session started from a snapshot (the prefix
//! state cache, `crate::snapshot`).

use super::BatcherState;
use crate::cohort::close_everywhere;
use crate::snapshot::{self, Kept};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{SessionId, SnapshotId};
use ractor::RpcReplyPort;
use std::sync::atomic::Ordering;

/// A close's request to keep the session's states: the snapshot's id, and where the
/// snapshot (or why not) goes.
pub type Keep = (SnapshotId, RpcReplyPort<Result<Kept, RuntimeError>>);

/// A close: `session`'s states are freed once it has no cohort in flight (after a snapshot of
/// them is kept, with `keep`); `reply` answers when they are.
pub struct Closing {
    pub session: SessionId,
    pub reply: RpcReplyPort<()>,
    pub keep: Option<Keep>,
}

impl BatcherState {
    pub(super) fn close(&mut self, c: Closing) {
        // An input still waiting is dropped: its caller has gone.
        self.waiting.retain(|w| w.session != c.session);
        self.parked.retain(|p| p.0 != c.session);
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
        let children = self.children();
        let stats = self.stats.clone();
        tokio::spawn(async move {
            if let Some((id, port)) = keep {
                let kept = snapshot::save(&children, session, id).await;
                let _ = port.send(kept.map(|snapshot| Kept { snapshot, fed }));
            }
            close_everywhere(&children, session).await;
            if was_open {
                stats.open.fetch_sub(1, Ordering::Relaxed);
            }
            let _ = reply.send(());
        });
    }

    /// New `session` starts from `snapshot` in every stage: from now on it holds states (a
    /// close frees them, a lost stage loses them) and has seen `depth` inputs. Answers `false`,
    /// touching nothing, while decoding is not serving: the stages being rebuilt are not the
    /// ones that kept the snapshot.
    pub(super) fn restore(
        &mut self,
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
        let children = self.children();
        tokio::spawn(async move {
            let r = snapshot::restore(&children, session, snapshot).await;
            let _ = reply.send(r.map(|()| true));
        });
    }
}
