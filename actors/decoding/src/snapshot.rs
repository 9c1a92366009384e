//! Sessions' states kept and given back: the decoding side of the prefix state cache.
//!
//! A [`Snapshot`] is a copy of one session's states that every stage keeps under one id until
//! it is dropped ([`AsyncDecoder::drop_snapshot`]); a new session starts from it
//! ([`AsyncDecoder::restore`], through the batcher, which then counts the session as holding
//! states). [`HostSnapshot`] is the same states on the host: a lower cache tier, and what a
//! conversation's export carries.

use super::batcher::{BatcherMsg, Closing};
use super::decoder::AsyncDecoder;
pub use super::kept::{HostSnapshot, Kept, Snapshot};
use super::kept::{drop_everywhere, everywhere, save};
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::state::StateOp;
use nsactor_plugin_api::SessionId;

impl AsyncDecoder {
    /// Feeds `ids` to `session` as [`feed`](Self::feed) does (its next token is not asked
    /// for) and keeps a snapshot of its states as that leaves them, taken by each stage in
    /// the last pass's own job: no round trip of its own, and no other pass runs between.
    /// The outer error is the feed's; the inner one says why only the snapshot was not kept.
    pub async fn feed_keeping(
        &self,
        session: SessionId,
        ids: Vec<i64>,
    ) -> Result<Result<Kept, RuntimeError>, RuntimeError> {
        // Counted by the pacer as a prompt being fed until its last pass is answered.
        let _feeding = (ids.len() > 1).then(|| self.stats.pacer.feeding());
        let ids = self.feed_all_but_last_chunk(session, ids).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let keep = Some((self.ids.snapshot(), tx.into()));
        let pick = Some(crate::cohort::PickRequest::greedy(false));
        self.ask_once(session, ids, pick, false, keep).await?;
        Ok(rx
            .await
            .unwrap_or_else(|_| Err(RuntimeError::Broken("the decode batcher stopped".into()))))
    }

    /// [`feed_every`](Self::feed_every) (every position's logits, one pass of at most
    /// [`pass_tokens`](Self::pass_tokens)) that also keeps a snapshot of the session's
    /// states as the pass leaves them, in the pass's own jobs. The outer error is the feed's;
    /// the inner one says why only the snapshot was not kept.
    pub async fn feed_every_keeping(
        &self,
        session: SessionId,
        ids: Vec<i64>,
    ) -> Result<(Vec<f32>, Result<Kept, RuntimeError>), RuntimeError> {
        if ids.len() > self.pass_tokens() {
            return Err(RuntimeError::Runtime(format!(
                "{} inputs to score in one pass; a pass takes at most {}",
                ids.len(),
                self.pass_tokens()
            )));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let keep = Some((self.ids.snapshot(), tx.into()));
        let answer = self.ask_once(session, ids, None, true, keep).await?;
        let kept = rx
            .await
            .unwrap_or_else(|_| Err(RuntimeError::Broken("the decode batcher stopped".into())));
        match answer {
            crate::batcher::Answer::Every(l) => Ok((l, kept)),
            _ => {
                if let Ok(k) = kept {
                    self.drop_snapshot(&k.snapshot).await;
                }
                Err(RuntimeError::Runtime(
                    "a scoring pass answered no logits".into(),
                ))
            }
        }
    }

    /// A copy of `session`'s states, kept by every stage until
    /// [`drop_snapshot`](Self::drop_snapshot). The session must be idle (no input of its in
    /// flight: its last feed answered); it goes on unchanged.
    pub async fn save(&self, session: SessionId) -> Result<Snapshot, RuntimeError> {
        save(&self.children(), session, self.ids.snapshot()).await
    }

    /// New `session` (never fed) starts from `snapshot`, having seen `depth` inputs (what
    /// [`close_keeping`](Self::close_keeping) counts from). `false`, with nothing done, while
    /// decoding rebuilds its stages (they will not have the snapshot).
    pub async fn restore(
        &self,
        session: SessionId,
        snapshot: &Snapshot,
        depth: usize,
    ) -> Result<bool, RuntimeError> {
        let r = self
            .batcher
            .call(
                |reply| BatcherMsg::Restore {
                    session,
                    snapshot: snapshot.id,
                    depth,
                    reply,
                },
                None,
            )
            .await;
        match r {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(RuntimeError::Broken("the decode batcher stopped".into())),
        }
    }

    /// Forgets `snapshot` in every stage.
    pub async fn drop_snapshot(&self, snapshot: &Snapshot) {
        drop_everywhere(&self.children(), snapshot.id).await;
    }

    /// A host copy of `snapshot`.
    pub async fn read_snapshot(&self, snapshot: &Snapshot) -> Result<HostSnapshot, RuntimeError> {
        let mut outs = everywhere(&self.children(), |_| StateOp::Read(snapshot.id))
            .await?
            .into_iter()
            .map(|o| o.host);
        let edge = outs.next().unwrap_or_default();
        Ok(HostSnapshot {
            edge,
            layers: outs.collect(),
        })
    }

    /// `host` kept on the stages' devices again, under a new id.
    pub async fn write_snapshot(&self, host: &HostSnapshot) -> Result<Snapshot, RuntimeError> {
        let c = self.children();
        if host.layers.len() != c.layers.len() {
            // The file's fault (checked before any device work), not the server's.
            return Err(RuntimeError::Invalid(format!(
                "a snapshot of {} layers; this model has {}",
                host.layers.len(),
                c.layers.len()
            )));
        }
        let id = self.ids.snapshot();
        let r = everywhere(&c, |stage| {
            let fields = match stage {
                None => host.edge.clone(),
                Some(i) => host.layers[i].clone(),
            };
            StateOp::Write(id, fields)
        })
        .await;
        match r {
            Ok(outs) => Ok(Snapshot {
                id,
                bytes: outs.iter().map(|o| o.bytes).sum(),
            }),
            Err(e) => {
                drop_everywhere(&c, id).await;
                Err(misfit(e))
            }
        }
    }

    /// [`begin_close`](Self::begin_close), keeping a snapshot of the session's states as they
    /// are once its input in flight is done (before they are freed): the close is queued now;
    /// the future answers with the snapshot and how many inputs it has seen, once the states
    /// are freed too.
    pub fn close_keeping(
        &self,
        session: SessionId,
    ) -> impl Future<Output = Result<Kept, RuntimeError>> + use<> {
        self.given_up.forget(session);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (done, _) = tokio::sync::oneshot::channel();
        let _ = self.batcher.cast(BatcherMsg::Close(Closing {
            session,
            reply: done.into(),
            keep: Some((self.ids.snapshot(), tx.into())),
        }));
        async move {
            rx.await
                .unwrap_or_else(|_| Err(RuntimeError::Broken("the decode batcher stopped".into())))
        }
    }
}

/// A stage's refusal of a snapshot's fields (their count or widths) is the snapshot's fault: a
/// file made by another model, said as such; any other failure stays the server's.
fn misfit(e: RuntimeError) -> RuntimeError {
    use nsactor_plugin_api::EngineError;
    match e {
        RuntimeError::Stage {
            who,
            error: EngineError::InvalidInput(m),
        } => RuntimeError::Invalid(format!(
            "a snapshot whose state fields do not fit this model's ({who}: {m})"
        )),
        RuntimeError::Engine(EngineError::InvalidInput(m)) => RuntimeError::Invalid(format!(
            "a snapshot whose state fields do not fit this model's ({m})"
        )),
        other => other,
    }
}
