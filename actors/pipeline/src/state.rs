//! The prefix cache's snapshot calls on a stage: a session's states copied into a snapshot
//! each stage keeps, given to a new session, taken to the host and back
//! ([`StageCall::StateSave`] and after), as [`StateOp`]s, and the saves a decoding pass makes
//! in its own jobs ([`save_all`], [`SaveTally`]). `layers::state_all` runs one op on every
//! stage at once.

use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{
    ComputeBackend, EngineError, HostTensor, SessionId, SnapshotId, Stage, StageCall,
};
use ractor::RpcReplyPort;

/// One snapshot op on one stage.
#[derive(Debug)]
pub enum StateOp {
    /// Keeps a copy of each `session`'s states under its `snapshot`; each one's device bytes
    /// in [`StateOut::saved`].
    Save(Vec<(SessionId, SnapshotId)>),
    /// Each `session`, which holds no states, starts from a copy of its `snapshot`'s; each
    /// one's outcome in [`StateOut::each`].
    Restore(Vec<(SessionId, SnapshotId)>),
    /// Forgets these snapshots.
    Drop(Vec<SnapshotId>),
    /// Frees the states of these sessions (decoding sessions' ends; not a snapshot op, but
    /// run the same way, so that no layer actor waits on its worker for it).
    Close(Vec<SessionId>),
    /// A host copy of `snapshot`'s states.
    Read(SnapshotId),
    /// Keeps the host states under `snapshot` (as `Read` gave them, from the same stage).
    Write(SnapshotId, Vec<HostTensor>),
}

/// What a [`StateOp`] answers.
#[derive(Debug, Default)]
pub struct StateOut {
    /// Device bytes the snapshot holds (`Write`).
    pub bytes: u64,
    /// Each item's device bytes, or why it was not kept (`Save`), in order.
    pub saved: Vec<Result<u64, EngineError>>,
    /// Host copies of the state fields (`Read`).
    pub host: Vec<HostTensor>,
    /// Each item's outcome (`Restore`), in order.
    pub each: Vec<Result<(), EngineError>>,
}

/// Keeps a snapshot of each session of `saves` on `st` as it is now ([`StageCall::StateSave`]),
/// inside a decoding pass's job: each one's device bytes, or why not. One call for all of
/// them; where it fails (it then keeps nothing), one call each, for each one's own answer.
pub(crate) fn save_all(
    st: &mut dyn Stage,
    saves: &[(SessionId, SnapshotId)],
) -> Vec<Result<u64, EngineError>> {
    if saves.is_empty() {
        return Vec::new();
    }
    let (sessions, snapshots): (Vec<SessionId>, Vec<SnapshotId>) = saves.iter().copied().unzip();
    let all = st.call(StageCall::StateSave {
        sessions: &sessions,
        snapshots: &snapshots,
    });
    match all.and_then(|r| r.scalar(0, "StateSave")) {
        Ok(bytes) => return saves.iter().map(|_| Ok(bytes as u64)).collect(),
        Err(e) => tracing::warn!(
            "StateSave of {} sessions at once failed ({e}); saving one at a time",
            saves.len()
        ),
    }
    saves
        .iter()
        .map(|(session, snapshot)| {
            let r = st.call(StageCall::StateSave {
                sessions: std::slice::from_ref(session),
                snapshots: std::slice::from_ref(snapshot),
            })?;
            Ok(r.scalar(0, "StateSave")? as u64)
        })
        .collect()
}

/// What the stages of a pass said of each of its saves, in order: the device bytes the
/// snapshot holds over those stages, or the first stage's error (its id must then be
/// dropped everywhere: other stages may keep it).
#[derive(Debug)]
pub struct SaveTally(pub Vec<Result<u64, RuntimeError>>);

impl SaveTally {
    pub fn new(saves: usize) -> Self {
        SaveTally((0..saves).map(|_| Ok(0)).collect())
    }

    /// Adds stage `who`'s answers (one per save, in order).
    pub fn add(&mut self, who: &str, answers: Vec<Result<u64, EngineError>>) {
        for (t, r) in self.0.iter_mut().zip(answers) {
            match (&mut *t, r) {
                (Ok(sum), Ok(bytes)) => *sum += bytes,
                (Ok(_), Err(error)) => {
                    *t = Err(RuntimeError::Stage {
                        who: who.into(),
                        error,
                    })
                }
                (Err(_), _) => {}
            }
        }
    }
}

/// Starts each session of `items` from its snapshot on `st`: one call for all of them, and
/// where it fails (it then starts none), one call each, for each one's own outcome.
fn restore_all(
    st: &mut dyn Stage,
    items: &[(SessionId, SnapshotId)],
) -> Vec<Result<(), EngineError>> {
    if items.is_empty() {
        return Vec::new();
    }
    let (sessions, snapshots): (Vec<SessionId>, Vec<SnapshotId>) = items.iter().copied().unzip();
    let all = st.call(StageCall::StateRestore {
        sessions: &sessions,
        snapshots: &snapshots,
    });
    match all {
        Ok(_) => return items.iter().map(|_| Ok(())).collect(),
        Err(e) => tracing::warn!(
            "StateRestore of {} sessions at once failed ({e}); restoring one at a time",
            items.len()
        ),
    }
    items
        .iter()
        .map(|(session, snapshot)| {
            st.call(StageCall::StateRestore {
                sessions: std::slice::from_ref(session),
                snapshots: std::slice::from_ref(snapshot),
            })
            .map(drop)
        })
        .collect()
}

/// A stage actor's reply port for a [`StateOp`].
pub type StateReply = RpcReplyPort<Result<StateOut, EngineError>>;

impl StateOp {
    /// Runs the op on `st`, whose device is `device` of `backend` (on the stage's worker).
    pub(crate) fn run(
        self,
        st: &mut dyn Stage,
        backend: &dyn ComputeBackend,
        device: usize,
    ) -> Result<StateOut, EngineError> {
        let what = match &self {
            StateOp::Save(items) => format!("save of {}", items.len()),
            StateOp::Restore(items) => format!("restore of {}", items.len()),
            StateOp::Drop(ids) => format!("drop of {}", ids.len()),
            StateOp::Close(ids) => format!("close of {}", ids.len()),
            StateOp::Read(_) => "read".into(),
            StateOp::Write(..) => "write".into(),
        };
        let started = std::time::Instant::now();
        let out = self.run_here(st, backend, device);
        tracing::debug!(
            "a stage's {what}: {:.2} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
        out
    }

    fn run_here(
        self,
        st: &mut dyn Stage,
        backend: &dyn ComputeBackend,
        device: usize,
    ) -> Result<StateOut, EngineError> {
        let bytes = |r: nsactor_plugin_api::Reply, call: &str| -> Result<StateOut, EngineError> {
            Ok(StateOut {
                bytes: r.scalar(0, call)? as u64,
                ..StateOut::default()
            })
        };
        match self {
            StateOp::Save(items) => Ok(StateOut {
                saved: save_all(st, &items),
                ..StateOut::default()
            }),
            StateOp::Restore(items) => Ok(StateOut {
                each: restore_all(st, &items),
                ..StateOut::default()
            }),
            StateOp::Close(sessions) => {
                // Every one is closed; the first failure is told.
                let outs: Vec<_> = sessions
                    .into_iter()
                    .map(|session| st.call(StageCall::SessionClose { session }))
                    .collect();
                outs.into_iter()
                    .find_map(Result::err)
                    .map_or(Ok(StateOut::default()), Err)
            }
            StateOp::Drop(snapshots) => {
                for snapshot in snapshots {
                    st.call(StageCall::StateDrop { snapshot })?;
                }
                Ok(StateOut::default())
            }
            StateOp::Read(snapshot) => {
                let r = st.call(StageCall::StateRead { snapshot })?;
                Ok(StateOut {
                    host: r
                        .tensors
                        .iter()
                        .map(|t| backend.to_host(t))
                        .collect::<Result<_, _>>()?,
                    ..StateOut::default()
                })
            }
            StateOp::Write(snapshot, host) => {
                let states = host
                    .iter()
                    .map(|t| backend.from_host(device, t))
                    .collect::<Result<_, _>>()?;
                bytes(
                    st.call(StageCall::StateWrite { snapshot, states })?,
                    "StateWrite",
                )
            }
        }
    }
}
