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
    /// Keeps a copy of `session`'s states under `snapshot`.
    Save {
        session: SessionId,
        snapshot: SnapshotId,
    },
    /// Each `session`, which holds no states, starts from a copy of its `snapshot`'s; each
    /// one's outcome in [`StateOut::each`].
    Restore(Vec<(SessionId, SnapshotId)>),
    Drop(SnapshotId),
    /// Frees the states of `session` (a decoding session's end; not a snapshot op, but run
    /// the same way, so that no layer actor waits on its worker for it).
    Close(SessionId),
    /// A host copy of `snapshot`'s states.
    Read(SnapshotId),
    /// Keeps the host states under `snapshot` (as `Read` gave them, from the same stage).
    Write(SnapshotId, Vec<HostTensor>),
}

/// What a [`StateOp`] answers.
#[derive(Debug, Default)]
pub struct StateOut {
    /// Device bytes the snapshot holds (`Save`, `Write`).
    pub bytes: u64,
    /// Host copies of the state fields (`Read`).
    pub host: Vec<HostTensor>,
    /// Each item's outcome (`Restore`), in order.
    pub each: Vec<Result<(), EngineError>>,
}

/// Keeps a snapshot of each session of `saves` on `st` as it is now ([`StageCall::StateSave`]),
/// inside a decoding pass's job: each one's device bytes, or why not.
pub(crate) fn save_all(
    st: &mut dyn Stage,
    saves: &[(SessionId, SnapshotId)],
) -> Vec<Result<u64, EngineError>> {
    saves
        .iter()
        .map(|&(session, snapshot)| {
            let r = st.call(StageCall::StateSave { session, snapshot })?;
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
        let bytes = |r: nsactor_plugin_api::Reply, call: &str| -> Result<StateOut, EngineError> {
            Ok(StateOut {
                bytes: r.scalar(0, call)? as u64,
                ..StateOut::default()
            })
        };
        match self {
            StateOp::Save { session, snapshot } => bytes(
                st.call(StageCall::StateSave { session, snapshot })?,
                "StateSave",
            ),
            StateOp::Restore(items) => Ok(StateOut {
                each: items
                    .into_iter()
                    .map(|(session, snapshot)| {
                        st.call(StageCall::StateRestore { session, snapshot })
                            .map(drop)
                    })
                    .collect(),
                ..StateOut::default()
            }),
            StateOp::Close(session) => st
                .call(StageCall::SessionClose { session })
                .map(|_| StateOut::default()),
            StateOp::Drop(snapshot) => st
                .call(StageCall::StateDrop { snapshot })
                .map(|_| StateOut::default()),
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
