//! `LayerActor`: one decoder layer. It owns the layer's stage (parameters, optimizer state,
//! kept inputs, session membranes) and runs its compute on its pipeline stage's worker thread;
//! activations arrive in its mailbox and leave for the next hop when the worker is done.

use super::holder::StageHolder;
use super::keep::KeepLayers;
use super::msg::{Hop, LayerMsg};
use super::step::{Event, StepCtx};
use super::worker::Priority;
use nsactor_plugin_api::{EngineError, ForwardOut, MicroBatchId, StageCall};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

pub struct LayerActor;

pub struct LayerArgs {
    pub index: usize,
    pub stage: StageHolder,
    /// The layer's place from its stage's end (1: the last).
    pub from_end: usize,
    /// Whether training forwards keep their autodiff graph for the backward instead of
    /// recomputing it (`[train] keep_activations`): read before each forward.
    pub keep: KeepLayers,
}

pub struct LayerActorState {
    index: usize,
    stage: StageHolder,
    from_end: usize,
    keep: KeepLayers,
    prev: Option<Hop>,
    next: Option<Hop>,
}

impl LayerActorState {
    fn who(&self) -> String {
        format!("layer {}", self.index)
    }
}

impl Actor for LayerActor {
    type Msg = LayerMsg;
    type State = LayerActorState;
    type Arguments = LayerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<LayerMsg>,
        a: LayerArgs,
    ) -> Result<LayerActorState, ActorProcessingErr> {
        Ok(LayerActorState {
            index: a.index,
            stage: a.stage,
            from_end: a.from_end,
            keep: a.keep,
            prev: None,
            next: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<LayerMsg>,
        msg: LayerMsg,
        s: &mut LayerActorState,
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
                let keep_graph = s.keep.keeps(s.from_end);
                let job = s.stage.train_job(true, micro, &ctx, Some(h), move |st, h| {
                    let r = ForwardOut::try_from(st.call(StageCall::Forward {
                        micro,
                        h: h.expect("moved"),
                        keep_graph,
                    })?)?;
                    let k = r.expected_k;
                    Ok((r.h, (r.ponder_cost, k.min, k.max)))
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
                let index = s.index;
                tokio::spawn(async move {
                    match job.await {
                        Ok((g, ())) => {
                            // Reported before the gradient moves on: layer 0's report
                            // must reach the supervisor before the edge's `Done` for the
                            // replica's last micro-batch ends the step's event loop.
                            ctx.backward_done(index).await;
                            prev.backward(micro, g, ponder_grad, ctx);
                        }
                        Err(e) => fail_detached(who, micro, e, &ctx, &myself).await,
                    }
                });
            }
            LayerMsg::Control { call, reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, move |st, _| st.call(call.call()))
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
            LayerMsg::Grads { op, reply } => {
                let (job, input) = op.into_job();
                let backend = s.stage.backend().clone();
                let r = s
                    .stage
                    .compute(Priority::GRADS, input, move |st, t| {
                        job.run(st, t, &*backend)
                    })
                    .await;
                return answer(s.who(), reply, r);
            }
            LayerMsg::Share { reply } => {
                let _ = reply.send(Ok(s.stage.clone()));
            }
            LayerMsg::Snapshot { reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, |st, _| st.snapshot())
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
    micro: MicroBatchId,
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
    micro: MicroBatchId,
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
    micro: MicroBatchId,
    error: EngineError,
    ctx: &StepCtx,
    actor: &ActorRef<LayerMsg>,
) {
    if report_failure(&who, micro, error, ctx).await {
        actor.stop(Some(format!("{who} lost its state to a panic")));
    }
}
