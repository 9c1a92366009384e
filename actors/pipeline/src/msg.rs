//! The messages of the edge and layer actors, the [`Hop`] a micro-batch takes to its
//! neighbour, and [`ask`], the call that unwraps both the messaging and the engine result.

use super::holder::StageHolder;
use super::step::{Ponder, StepCtx};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{
    Batch, ComputeBackend, DeviceTensor, EngineError, GradPart, MicroBatchId, Reply, SessionId,
    Stage, StageCall, StageSnapshot,
};
use ractor::{ActorRef, RpcReplyPort};
use std::sync::Arc;

/// A stage actor: the neighbour an activation or gradient goes to, or a stage of a replica
/// in the gradient exchange.
#[derive(Clone)]
pub enum Hop {
    Layer(ActorRef<LayerMsg>),
    Edge(ActorRef<EdgeMsg>),
}

impl Hop {
    /// Every stage actor of a pipeline: the edge, then the layers.
    pub(crate) fn all(edge: &ActorRef<EdgeMsg>, layers: &[ActorRef<LayerMsg>]) -> Vec<Hop> {
        std::iter::once(Hop::Edge(edge.clone()))
            .chain(layers.iter().cloned().map(Hop::Layer))
            .collect()
    }

    /// Runs a gradient-exchange op on the stage; `who` names it in errors.
    pub(crate) async fn grads(
        &self,
        who: &str,
        op: GradOp,
    ) -> Result<Option<GradPart>, RuntimeError> {
        match self {
            Hop::Layer(a) => ask(a, who, |reply| LayerMsg::Grads { op, reply }).await,
            Hop::Edge(a) => ask(a, who, |reply| EdgeMsg::Grads { op, reply }).await,
        }
    }

    pub(crate) fn forward(
        &self,
        micro: MicroBatchId,
        h: DeviceTensor,
        ponder: Ponder,
        ctx: StepCtx,
    ) {
        let sent = match self {
            Hop::Layer(a) => a
                .cast(LayerMsg::Forward {
                    micro,
                    h,
                    ponder,
                    ctx,
                })
                .is_ok(),
            Hop::Edge(a) => a
                .cast(EdgeMsg::Head {
                    micro,
                    h,
                    ponder,
                    ctx,
                })
                .is_ok(),
        };
        // A stopped neighbour is the supervisor's to notice; the micro-batch is lost with it.
        if !sent {
            tracing::warn!("{micro}: the next actor has stopped");
        }
    }

    pub(crate) fn backward(
        &self,
        micro: MicroBatchId,
        grad: DeviceTensor,
        ponder_grad: f64,
        ctx: StepCtx,
    ) {
        let sent = match self {
            Hop::Layer(a) => a
                .cast(LayerMsg::Backward {
                    micro,
                    grad,
                    ponder_grad,
                    ctx,
                })
                .is_ok(),
            Hop::Edge(a) => a.cast(EdgeMsg::EmbedBackward { micro, grad, ctx }).is_ok(),
        };
        if !sent {
            tracing::warn!("{micro}: the previous actor has stopped");
        }
    }
}

/// Calls `actor` and unwraps both the messaging and the engine result.
pub async fn ask<M: ractor::Message, T: Send + 'static>(
    actor: &ActorRef<M>,
    who: impl Into<String>,
    build: impl FnOnce(RpcReplyPort<Result<T, EngineError>>) -> M,
) -> Result<T, RuntimeError> {
    match actor.call(build, None).await {
        Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(|error| RuntimeError::Stage {
            who: who.into(),
            error,
        }),
        _ => Err(RuntimeError::Broken(format!("{} stopped", who.into()))),
    }
}

/// Sends `edge_call` to the edge and `layer_call(i)` to layer `i`, all at once; returns the
/// edge's answer and the layers' in layer order.
pub async fn control_all(
    edge: &ActorRef<EdgeMsg>,
    layers: &[ActorRef<LayerMsg>],
    edge_call: StageControl,
    layer_call: impl Fn(usize) -> StageControl,
) -> (
    Result<Reply, RuntimeError>,
    Vec<Result<Reply, RuntimeError>>,
) {
    let e = ask(edge, "edge", |reply| EdgeMsg::Control {
        call: edge_call,
        reply,
    });
    let ls = futures_util::future::join_all(layers.iter().enumerate().map(|(i, l)| {
        let call = layer_call(i);
        ask(l, format!("layer {i}"), move |reply| LayerMsg::Control {
            call,
            reply,
        })
    }));
    futures_util::join!(e, ls)
}

/// The optimizer-phase and session calls a stage actor answers by reply (the edge ignores
/// phase-2 factors and answers `GradStats` with no norms).
#[derive(Debug, Clone, Copy)]
pub enum StageControl {
    GradStats,
    ScaleGrads([f64; 3]),
    Step { lr: f64, neuron_lr: f64, clip: f64 },
    ZeroGrad,
    SessionClose { session: SessionId },
}

impl StageControl {
    /// The stage call it makes.
    pub(crate) fn call(self) -> StageCall<'static> {
        match self {
            StageControl::GradStats => StageCall::GradStats,
            StageControl::ScaleGrads(scales) => StageCall::ScaleGrads { scales },
            StageControl::Step {
                lr,
                neuron_lr,
                clip,
            } => StageCall::Step {
                lr,
                neuron_lr,
                clip,
            },
            StageControl::ZeroGrad => StageCall::ZeroGrad,
            StageControl::SessionClose { session } => StageCall::SessionClose { session },
        }
    }
}

/// The data-parallel gradient exchange on one stage ([`StageCall::HoldGrads`],
/// [`StageCall::GradsOut`], [`StageCall::GradsIn`]).
#[derive(Debug)]
pub enum GradOp {
    Hold(bool),
    /// Takes the first part (`keep`: a copy of it, left in place).
    Out {
        keep: bool,
    },
    In(GradPart),
    /// The parts `Out` took from this stage, summed over `comm`'s ranks and put back under
    /// their keys, all on the stage's worker: the all-reduce runs on the stream that made its
    /// input and that uses its output, between the stage's other work, so no other stream can
    /// reuse or read a buffer it has not finished with.
    AllReduce {
        parts: Vec<GradPart>,
        comm: nsactor_plugin_api::Communicator,
    },
}

/// What a [`GradOp`] answers: the part `Out` took, if any.
pub type GradReply = RpcReplyPort<Result<Option<GradPart>, EngineError>>;

impl GradOp {
    /// The op as a stage job, and its input tensor (to be moved to the stage's device first).
    pub(crate) fn into_job(self) -> (GradJob, Option<DeviceTensor>) {
        match self {
            GradOp::Hold(hold) => (GradJob::Hold(hold), None),
            GradOp::Out { keep } => (GradJob::Out { keep }, None),
            GradOp::In(p) => (
                GradJob::In {
                    stream: p.stream,
                    key: p.key,
                    mask: p.mask,
                },
                Some(p.flat),
            ),
            GradOp::AllReduce { parts, comm } => (GradJob::AllReduce { parts, comm }, None),
        }
    }
}

/// A [`GradOp`] without its tensor, run on the stage's worker.
pub(crate) enum GradJob {
    Hold(bool),
    Out {
        keep: bool,
    },
    In {
        stream: nsactor_plugin_api::GradStream,
        key: MicroBatchId,
        mask: nsactor_plugin_api::ParamMask,
    },
    AllReduce {
        parts: Vec<GradPart>,
        comm: nsactor_plugin_api::Communicator,
    },
}

impl GradJob {
    /// Runs the job on `st` (whose device `backend`'s collectives use); `input` is the op's
    /// tensor, on the stage's device.
    pub(crate) fn run(
        self,
        st: &mut dyn Stage,
        input: Option<DeviceTensor>,
        backend: &dyn ComputeBackend,
    ) -> Result<Option<GradPart>, EngineError> {
        match self {
            GradJob::AllReduce { parts, comm } => {
                for p in parts {
                    let grad = backend.all_reduce_sum(comm, p.flat)?;
                    st.call(StageCall::GradsIn {
                        stream: p.stream,
                        micro: p.key,
                        mask: &p.mask,
                        grad,
                    })?;
                }
                Ok(None)
            }
            GradJob::Hold(hold) => st.call(StageCall::HoldGrads { hold }).map(|_| None),
            GradJob::Out { keep } => GradPart::from_reply(st.call(StageCall::GradsOut { keep })?),
            GradJob::In { stream, key, mask } => st
                .call(StageCall::GradsIn {
                    stream,
                    micro: key,
                    mask: &mask,
                    grad: input.ok_or_else(|| {
                        EngineError::InvalidInput("GradsIn without its tensor".into())
                    })?,
                })
                .map(|_| None),
        }
    }
}

pub enum LayerMsg {
    /// Where activations go next and gradients go back.
    Wire { prev: Hop, next: Hop },
    /// Training forward of micro-batch `micro`; `ponder` accumulates over the layers so far.
    Forward {
        micro: MicroBatchId,
        h: DeviceTensor,
        ponder: Ponder,
        ctx: StepCtx,
    },
    /// Training backward: recomputes the layer from its kept input, accumulates parameter
    /// gradients, sends the input gradient back.
    Backward {
        micro: MicroBatchId,
        grad: DeviceTensor,
        ponder_grad: f64,
        ctx: StepCtx,
    },
    Control {
        call: StageControl,
        reply: RpcReplyPort<Result<Reply, EngineError>>,
    },
    /// `h` through the layer for decoding `sessions` (batch rows split evenly among them, in
    /// order), whose neuron states it keeps.
    SessionForward {
        sessions: Vec<SessionId>,
        h: DeviceTensor,
        reply: RpcReplyPort<Result<DeviceTensor, EngineError>>,
    },
    /// The stage's [`snapshot`](nsactor_plugin_api::Stage::snapshot), serialised by the caller.
    Snapshot {
        reply: RpcReplyPort<Result<Box<dyn StageSnapshot>, EngineError>>,
    },
    /// The gradient exchange of data parallelism.
    Grads { op: GradOp, reply: GradReply },
    /// Lends the layer's stage (a handle on it and its worker) for a decoding pass that runs
    /// several layers in one worker job ([`super::layers::session_layers`]).
    Share {
        reply: RpcReplyPort<Result<StageHolder, EngineError>>,
    },
    Load {
        bytes: Arc<Vec<u8>>,
        reply: RpcReplyPort<Result<(), EngineError>>,
    },
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for LayerMsg {}

/// What `SessionSample` brings to the host: `[ids, logprobs]` (`2·B` values) and the logits
/// when they were asked for.
pub type Sampled = (Vec<f32>, Option<Vec<f32>>);

/// The edge's answer for each save of a decoding pass: the bytes it keeps, or why not.
pub type EdgeSaved = Vec<Result<u64, EngineError>>;

/// Optimizer-phase and decoding calls, answered by reply.
pub enum EdgeMsg {
    Wire {
        first: Hop,
        last: Hop,
    },
    /// Starts micro-batch `micro`; its loss counts `loss_scale` of the step's, its ponder cost
    /// `ponder_weight`.
    Embed {
        micro: MicroBatchId,
        batch: Arc<Batch>,
        loss_scale: f64,
        ponder_weight: f64,
        ctx: StepCtx,
    },
    /// The last layer's output of `micro`.
    Head {
        micro: MicroBatchId,
        h: DeviceTensor,
        ponder: Ponder,
        ctx: StepCtx,
    },
    /// Layer 0's input gradient of `micro`.
    EmbedBackward {
        micro: MicroBatchId,
        grad: DeviceTensor,
        ctx: StepCtx,
    },
    Control {
        call: StageControl,
        reply: RpcReplyPort<Result<Reply, EngineError>>,
    },
    /// The gradient exchange of data parallelism.
    Grads {
        op: GradOp,
        reply: GradReply,
    },
    /// A prefix-cache snapshot op ([`super::state`]).
    State {
        op: super::state::StateOp,
        reply: super::state::StateReply,
    },
    /// Embeds tokens for decoding or evaluation (row-major `[batch, seq_len]`). With `ready`
    /// the reply waits until the embedding is computed ([`crate::layers::evaluate_layers`]
    /// says why an evaluation asks for it).
    SessionEmbed {
        ids: Vec<i64>,
        batch: usize,
        seq_len: usize,
        ready: bool,
        reply: RpcReplyPort<Result<DeviceTensor, EngineError>>,
    },
    /// Last-position logits `[1, B, V]` of `sessions` (batch rows split evenly among them, in
    /// order), or with `every` every position's `[T, B, V]`, copied to the host.
    SessionDecode {
        sessions: Vec<SessionId>,
        h: DeviceTensor,
        every: bool,
        /// Snapshots kept once the pass has run (the stage's answer per save beside the
        /// logits; [`super::state::save_all`]).
        saves: Vec<(SessionId, nsactor_plugin_api::SnapshotId)>,
        reply: RpcReplyPort<Result<(Vec<f32>, EdgeSaved), EngineError>>,
    },
    /// `SessionDecode` with every row's next token chosen on the device as `picks` says:
    /// `[ids, logprobs]` back to back (`2·B` values), and the logits when `want_logits`.
    SessionSample {
        sessions: Vec<SessionId>,
        h: DeviceTensor,
        picks: nsactor_plugin_api::PicksBuf,
        want_logits: bool,
        /// As in `SessionDecode`.
        saves: Vec<(SessionId, nsactor_plugin_api::SnapshotId)>,
        reply: RpcReplyPort<Result<(Sampled, EdgeSaved), EngineError>>,
    },
    /// Masked mean CE of `h` against `batch` (no gradients).
    HeadEval {
        h: DeviceTensor,
        batch: Arc<Batch>,
        reply: RpcReplyPort<Result<f64, EngineError>>,
    },
    /// `−ln p(target)` of every position of `h` (one row), copied to the host.
    TokenLosses {
        h: DeviceTensor,
        targets: Vec<i64>,
        reply: RpcReplyPort<Result<Vec<f32>, EngineError>>,
    },
    /// The stage's [`snapshot`](nsactor_plugin_api::Stage::snapshot), serialised by the caller.
    Snapshot {
        reply: RpcReplyPort<Result<Box<dyn StageSnapshot>, EngineError>>,
    },
    Load {
        bytes: Arc<Vec<u8>>,
        reply: RpcReplyPort<Result<(), EngineError>>,
    },
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for EdgeMsg {}
