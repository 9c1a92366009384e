//! The stages' side of sessions' states kept and given back: what a snapshot is ([`Snapshot`]
//! on the devices, [`HostSnapshot`] on the host, [`Kept`] by a close) and the ops that run on
//! every stage at once (save, restore, drop). `crate::snapshot` puts them behind the decoder.

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

/// What a session closed with `AsyncDecoder::close_keeping` left: a snapshot of its states
/// and how many inputs they have seen (a restored session counts its snapshot's depth).
#[derive(Debug, Clone, Copy)]
pub struct Kept {
    pub snapshot: Snapshot,
    pub fed: usize,
}

/// Runs one op per stage; all must succeed.
pub(crate) async fn everywhere(
    c: &Children,
    mut op: impl FnMut(Option<usize>) -> StateOp,
) -> Result<Vec<StateOut>, RuntimeError> {
    let edge_op = op(None);
    let (e, ls) =
        crate::order::state(state_all(&c.edge, &c.layers, edge_op, |i| op(Some(i)))).await;
    std::iter::once(e).chain(ls).collect()
}

/// Keeps a copy of idle `session`'s states under a new id in every stage; on failure nothing
/// stays kept.
pub(crate) async fn save(
    c: &Children,
    session: SessionId,
    snapshot: SnapshotId,
) -> Result<Snapshot, RuntimeError> {
    save_many(c, vec![(session, snapshot)])
        .await
        .pop()
        .expect("one answer")
}

/// Keeps a copy of each idle session of `items` under its snapshot id in every stage, all in
/// one op per stage: each one's snapshot, in order; one that some stage could not keep is
/// dropped from the others.
pub(crate) async fn save_many(
    c: &Children,
    items: Vec<(SessionId, SnapshotId)>,
) -> Vec<Result<Snapshot, RuntimeError>> {
    let (e, ls) = crate::order::state(state_all(
        &c.edge,
        &c.layers,
        StateOp::Save(items.clone()),
        |_| StateOp::Save(items.clone()),
    ))
    .await;
    let mut out: Vec<Result<Snapshot, RuntimeError>> = items
        .iter()
        .map(|&(_, id)| Ok(Snapshot { id, bytes: 0 }))
        .collect();
    for (who, r) in stages(e, ls) {
        match r {
            Ok(o) => {
                for (slot, r) in out.iter_mut().zip(o.saved) {
                    match (&mut *slot, r) {
                        (Ok(s), Ok(bytes)) => s.bytes += bytes,
                        (Ok(_), Err(error)) => {
                            *slot = Err(RuntimeError::Stage {
                                who: who.clone(),
                                error,
                            })
                        }
                        (Err(_), _) => {}
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
    for ((_, id), r) in items.iter().zip(&out) {
        if r.is_err() {
            drop_everywhere(c, *id).await;
        }
    }
    out
}

/// Each stage's answer to one op, named: the edge's, then each layer's.
fn stages(
    e: Result<StateOut, RuntimeError>,
    ls: Vec<Result<StateOut, RuntimeError>>,
) -> impl Iterator<Item = (String, Result<StateOut, RuntimeError>)> {
    std::iter::once(("edge".to_string(), e)).chain(
        ls.into_iter()
            .enumerate()
            .map(|(i, r)| (format!("layer {i}"), r)),
    )
}

/// Each session of `items` starts from its snapshot in every stage, all in one op per stage:
/// each one's outcome, in order (an item fails where any stage failed it).
pub(crate) async fn restore_many(
    c: &Children,
    items: Vec<(SessionId, SnapshotId)>,
) -> Vec<Result<(), RuntimeError>> {
    let n = items.len();
    let (e, ls) = crate::order::state(state_all(
        &c.edge,
        &c.layers,
        StateOp::Restore(items.clone()),
        |_| StateOp::Restore(items.clone()),
    ))
    .await;
    let mut out: Vec<Result<(), RuntimeError>> = (0..n).map(|_| Ok(())).collect();
    for (who, r) in stages(e, ls) {
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
    drop_many(c, vec![snapshot]).await;
}

/// Forgets `snapshots` in every stage, in one op per stage (errors ignored).
pub(crate) async fn drop_many(c: &Children, snapshots: Vec<SnapshotId>) {
    let _ = everywhere(c, |_| StateOp::Drop(snapshots.clone())).await;
}
