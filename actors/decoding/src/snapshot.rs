//! Sessions' states kept and given back: the decoding side of the prefix state cache.
//!
//! A [`Snapshot`] is a copy of one session's states that every stage keeps under one id until
//! it is dropped ([`AsyncDecoder::drop_snapshot`]); a new session starts from it
//! ([`AsyncDecoder::restore`], through the batcher, which then counts the session as holding
//! states). [`HostSnapshot`] is the same states on the host: a lower cache tier, and what a
//! conversation's export carries.

use super::batcher::{BatcherMsg, Closing};
use super::decoder::AsyncDecoder;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::layers::state_all;
use nsactor_pipeline::state::{StateOp, StateOut};
use nsactor_pipeline::topology::Children;
use nsactor_plugin_api::{HostTensor, SessionId, SnapshotId};

/// A copy of a session's states that every stage keeps on its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub id: SnapshotId,
    /// Device bytes it holds, over every stage.
    pub bytes: u64,
}

/// A session's states on the host: the edge's state fields, then each layer's.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSnapshot {
    pub edge: Vec<HostTensor>,
    pub layers: Vec<Vec<HostTensor>>,
}

impl HostSnapshot {
    /// Host bytes it holds (f32 values).
    pub fn bytes(&self) -> u64 {
        let all = self.edge.iter().chain(self.layers.iter().flatten());
        all.map(|t| 4 * t.data.len() as u64).sum()
    }
}

/// What a session closed with [`AsyncDecoder::close_keeping`] left: a snapshot of its states
/// and how many inputs they have seen (a restored session counts its snapshot's depth).
#[derive(Debug, Clone, Copy)]
pub struct Kept {
    pub snapshot: Snapshot,
    pub fed: usize,
}

/// Runs one op per stage; all must succeed.
async fn everywhere(
    c: &Children,
    mut op: impl FnMut(Option<usize>) -> StateOp,
) -> Result<Vec<StateOut>, RuntimeError> {
    let edge_op = op(None);
    let (e, ls) = state_all(&c.edge, &c.layers, edge_op, |i| op(Some(i))).await;
    std::iter::once(e).chain(ls).collect()
}

/// Keeps a copy of idle `session`'s states under a new id in every stage; on failure nothing
/// stays kept.
pub(crate) async fn save(
    c: &Children,
    session: SessionId,
    snapshot: SnapshotId,
) -> Result<Snapshot, RuntimeError> {
    match everywhere(c, |_| StateOp::Save { session, snapshot }).await {
        Ok(outs) => Ok(Snapshot {
            id: snapshot,
            bytes: outs.iter().map(|o| o.bytes).sum(),
        }),
        Err(e) => {
            drop_everywhere(c, snapshot).await;
            Err(e)
        }
    }
}

/// Each session of `items` starts from its snapshot in every stage, all in one op per stage:
/// each one's outcome, in order (an item fails where any stage failed it).
pub(crate) async fn restore_many(
    c: &Children,
    items: Vec<(SessionId, SnapshotId)>,
) -> Vec<Result<(), RuntimeError>> {
    let n = items.len();
    let (e, ls) = state_all(&c.edge, &c.layers, StateOp::Restore(items.clone()), |_| {
        StateOp::Restore(items.clone())
    })
    .await;
    let mut out: Vec<Result<(), RuntimeError>> = (0..n).map(|_| Ok(())).collect();
    let stages = std::iter::once(("edge".to_string(), e)).chain(
        ls.into_iter()
            .enumerate()
            .map(|(i, r)| (format!("layer {i}"), r)),
    );
    for (who, r) in stages {
        match r {
            Ok(o) => {
                for (slot, r) in out.iter_mut().zip(o.each) {
                    if let (Ok(()), Err(error)) = (&slot, r) {
                        *slot = Err(RuntimeError::Stage {
                            who: who.clone(),
                            error,
                        });
                    }
                }
            }
            Err(e) => {
                for slot in out.iter_mut().filter(|s| s.is_ok()) {
                    *slot = Err(e.for_each_session());
                }
            }
        }
    }
    out
}

/// Forgets `snapshot` in every stage (errors ignored: a stopped stage keeps nothing).
pub(crate) async fn drop_everywhere(c: &Children, snapshot: SnapshotId) {
    let _ = everywhere(c, |_| StateOp::Drop(snapshot)).await;
}

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
        let ids = self.feed_all_but_last_chunk(session, ids).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let keep = Some((self.ids.snapshot(), tx.into()));
        let pick = Some(crate::cohort::PickRequest::greedy(false));
        self.ask_once(session, ids, pick, false, keep).await?;
        Ok(rx
            .await
            .unwrap_or_else(|_| Err(RuntimeError::Broken("the decode batcher stopped".into()))))
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
            return Err(RuntimeError::Runtime(format!(
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
                Err(e)
            }
        }
    }

    /// [`begin_close`](Self::begin_close), keeping a snapshot of the session's states as they
    /// are once its input in flight is done (before they are freed): the close is queued now;
    /// the future answers with the snapshot and how many inputs it has seen.
    pub fn close_keeping(
        &self,
        session: SessionId,
    ) -> impl Future<Output = Result<Kept, RuntimeError>> + use<> {
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
