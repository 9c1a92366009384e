//! The prefix cache's snapshot calls on the stage actors: a session's states copied into a
//! snapshot each stage keeps, given to a new session, taken to the host and back
//! ([`StageCall::StateSave`] and after), and [`state_all`], one op on every stage at once.

use super::msg::{EdgeMsg, LayerMsg, ask};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{
    ComputeBackend, EngineError, HostTensor, SessionId, SnapshotId, Stage, StageCall,
};
use ractor::{ActorRef, RpcReplyPort};

/// One snapshot op on one stage.
#[derive(Debug)]
pub enum StateOp {
    /// Keeps a copy of `session`'s states under `snapshot`.
    Save {
        session: SessionId,
        snapshot: SnapshotId,
    },
    /// `session`, which holds no states, starts from a copy of `snapshot`'s.
    Restore {
        session: SessionId,
        snapshot: SnapshotId,
    },
    Drop(SnapshotId),
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
                host: Vec::new(),
            })
        };
        match self {
            StateOp::Save { session, snapshot } => bytes(
                st.call(StageCall::StateSave { session, snapshot })?,
                "StateSave",
            ),
            StateOp::Restore { session, snapshot } => st
                .call(StageCall::StateRestore { session, snapshot })
                .map(|_| StateOut::default()),
            StateOp::Drop(snapshot) => st
                .call(StageCall::StateDrop { snapshot })
                .map(|_| StateOut::default()),
            StateOp::Read(snapshot) => {
                let r = st.call(StageCall::StateRead { snapshot })?;
                Ok(StateOut {
                    bytes: 0,
                    host: r
                        .tensors
                        .iter()
                        .map(|t| backend.to_host(t))
                        .collect::<Result<_, _>>()?,
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

/// Runs `edge_op` on the edge and `layer_op(i)` on layer `i`, all at once; the edge's answer
/// and the layers' in layer order.
pub async fn state_all(
    edge: &ActorRef<EdgeMsg>,
    layers: &[ActorRef<LayerMsg>],
    edge_op: StateOp,
    mut layer_op: impl FnMut(usize) -> StateOp,
) -> (
    Result<StateOut, RuntimeError>,
    Vec<Result<StateOut, RuntimeError>>,
) {
    let e = ask(edge, "edge", |reply| EdgeMsg::State { op: edge_op, reply });
    let ls = futures_util::future::join_all(layers.iter().enumerate().map(|(i, l)| {
        let op = layer_op(i);
        ask(l, format!("layer {i}"), move |reply| LayerMsg::State {
            op,
            reply,
        })
    }));
    futures_util::join!(e, ls)
}
