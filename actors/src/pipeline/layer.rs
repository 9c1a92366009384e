//! `LayerActor`: one decoder layer. It owns the layer's stage (parameters, optimizer state,
//! kept inputs, session membranes) and runs its compute on its pipeline stage's worker thread;
//! activations arrive in its mailbox and leave for the next hop when the worker is done.

use super::worker::Priority;
use super::{Event, Hop, Ponder, StageHolder, StepCtx};
use nsactor_plugin_api::{DeviceTensor, EngineError, Reply, StageCall};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::Arc;

/// Optimizer-phase and decoding calls, answered by reply.
pub enum LayerControl {
    GradStats,
    ScaleGrads([f64; 3]),
    Step { lr: f64, neuron_lr: f64, clip: f64 },
    ZeroGrad,
    SessionClose { session: u64 },
}

pub enum LayerMsg {
    /// Where activations go next and gradients go back.
    Wire { prev: Hop, next: Hop },
    /// Training forward of micro-batch `micro`; `ponder` accumulates over the layers so far.
    Forward {
        micro: u64,
        h: DeviceTensor,
        ponder: Ponder,
        ctx: StepCtx,
    },
    /// Training backward: recomputes the layer from its kept input, accumulates parameter
    /// gradients, sends the input gradient back.
    Backward {
        micro: u64,
        grad: DeviceTensor,
        ponder_grad: f64,
        ctx: StepCtx,
    },
    Control {
        call: LayerControl,
        reply: RpcReplyPort<Result<Reply, EngineError>>,
    },
    /// `h` through the layer for decoding `sessions` (batch rows split evenly among them, in
    /// order), whose neuron states it keeps.
    SessionForward {
        sessions: Vec<u64>,
        h: DeviceTensor,
        reply: RpcReplyPort<Result<DeviceTensor, EngineError>>,
    },
    Save {
        reply: RpcReplyPort<Result<Vec<u8>, EngineError>>,
    },
    /// Lends the layer's stage (a handle on it and its worker) for a decoding pass that runs
    /// several layers in one worker job ([`super::session_layers`]).
    Share {
        reply: RpcReplyPort<Result<StageHolder, EngineError>>,
    },
    Load {
        bytes: Arc<Vec<u8>>,
        reply: RpcReplyPort<Result<(), EngineError>>,
    },
}

pub struct LayerActor;

pub struct LayerArgs {
    pub index: usize,
    pub stage: StageHolder,
    /// Whether training forwards keep their autodiff graph for the backward
    /// (`[train] keep_activations`) instead of recomputing it.
    pub keep_graph: bool,
}

pub struct LayerState {
    index: usize,
    stage: StageHolder,
    keep_graph: bool,
    prev: Option<Hop>,
    next: Option<Hop>,
}

impl LayerState {
    fn who(&self) -> String {
        format!("layer {}", self.index)
    }
}

impl Actor for LayerActor {
    type Msg = LayerMsg;
    type State = LayerState;
    type Arguments = LayerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<LayerMsg>,
        a: LayerArgs,
    ) -> Result<LayerState, ActorProcessingErr> {
        Ok(LayerState {
            index: a.index,
            stage: a.stage,
            keep_graph: a.keep_graph,
            prev: None,
            next: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<LayerMsg>,
        msg: LayerMsg,
        s: &mut LayerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            LayerMsg::Wire { prev, next } => {
                s.prev = Some(prev);
                s.next = Some(next);
            }
            LayerMsg::Forward {
                micro,
                h,
                mut ponder,
                ctx,
            } => {
                let next = s.next.clone().ok_or("layer actor not wired")?;
                let keep_graph = s.keep_graph;
                let job = s.stage.train_job(true, micro, &ctx, Some(h), move |st, h| {
                    let r = st.call(StageCall::Forward {
                        micro,
                        h: h.expect("moved"),
                        keep_graph,
                    })?;
                    let p = (
                        r.scalar(0, "Forward")?,
                        r.scalar(2, "Forward")?,
                        r.scalar(3, "Forward")?,
                    );
                    Ok((r.into_tensor("Forward")?, p))
                });
                let who = s.who();
                // Answered from a task: the actor takes its next message at once (`submit`).
                tokio::spawn(async move {
                    match job.await {
                        Ok((h, (pc, lo, hi))) => {
                            ponder.add(pc, lo, hi);
                            next.forward(micro, h, ponder, ctx);
                        }
                        Err(e) => fail_detached(who, micro, e, &ctx, &myself).await,
                    }
                });
            }
            LayerMsg::Backward {
                micro,
                grad,
                ponder_grad,
                ctx,
            } => {
                let prev = s.prev.clone().ok_or("layer actor not wired")?;
                let job = s
                    .stage
                    .train_job(false, micro, &ctx, Some(grad), move |st, g| {
                        let r = st.call(StageCall::Backward {
                            micro,
                            grad: g.expect("moved"),
                            ponder_grad,
                        })?;
                        Ok((r.into_tensor("Backward")?, ()))
                    });
                let who = s.who();
                tokio::spawn(async move {
                    match job.await {
                        Ok((g, ())) => prev.backward(micro, g, ponder_grad, ctx),
                        Err(e) => fail_detached(who, micro, e, &ctx, &myself).await,
                    }
                });
            }
            LayerMsg::Control { call, reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, move |st, _| {
                        st.call(match call {
                            LayerControl::GradStats => StageCall::GradStats,
                            LayerControl::ScaleGrads(scales) => StageCall::ScaleGrads { scales },
                            LayerControl::Step {
                                lr,
                                neuron_lr,
                                clip,
                            } => StageCall::Step {
                                lr,
                                neuron_lr,
                                clip,
                            },
                            LayerControl::ZeroGrad => StageCall::ZeroGrad,
                            LayerControl::SessionClose { session } => {
                                StageCall::SessionClose { session }
                            }
                        })
                    })
                    .await;
                return answer(s.who(), reply, r);
            }
            LayerMsg::SessionForward { sessions, h, reply } => {
                let r = s
                    .stage
                    .compute(Priority::FORWARD_UNTRAINED, Some(h), move |st, h| {
                        st.call(StageCall::SessionForward {
                            sessions: &sessions,
                            h: h.expect("moved"),
                        })?
                        .into_tensor("SessionForward")
                    })
                    .await;
                return answer(s.who(), reply, r);
            }
            LayerMsg::Share { reply } => {
                let _ = reply.send(Ok(s.stage.clone()));
            }
            LayerMsg::Save { reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, |st, _| st.save())
                    .await;
                return answer(s.who(), reply, r);
            }
            LayerMsg::Load { bytes, reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, move |st, _| st.load(&bytes))
                    .await;
                return answer(s.who(), reply, r);
            }
        }
        Ok(())
    }
}

/// Replies; a panic also stops the actor (its stage is gone).
pub(super) fn answer<T: Send + 'static>(
    who: String,
    reply: RpcReplyPort<Result<T, EngineError>>,
    r: Result<T, EngineError>,
) -> Result<(), ActorProcessingErr> {
    let lost = matches!(r, Err(EngineError::Panic(_)));
    let _ = reply.send(r);
    if lost {
        Err(format!("{who} lost its state to a panic").into())
    } else {
        Ok(())
    }
}

/// Reports a failed training job of `micro` to the step; true when a panic lost the stage.
pub(super) async fn report_failure(
    who: &str,
    micro: u64,
    error: EngineError,
    ctx: &StepCtx,
) -> bool {
    let lost = matches!(error, EngineError::Panic(_));
    ctx.send(Event::Failed {
        who: who.to_string(),
        micro,
        error,
    })
    .await;
    lost
}

/// [`report_failure`] from inside an actor's handler: a lost stage stops the actor.
pub(super) async fn fail(
    who: String,
    micro: u64,
    error: EngineError,
    ctx: &StepCtx,
) -> Result<(), ActorProcessingErr> {
    if report_failure(&who, micro, error, ctx).await {
        Err(format!("{who} lost its state to a panic").into())
    } else {
        Ok(())
    }
}

/// [`report_failure`] from a task answering a training message: a lost stage stops the actor.
async fn fail_detached(
    who: String,
    micro: u64,
    error: EngineError,
    ctx: &StepCtx,
    actor: &ActorRef<LayerMsg>,
) {
    if report_failure(&who, micro, error, ctx).await {
        actor.stop(Some(format!("{who} lost its state to a panic")));
    }
}
