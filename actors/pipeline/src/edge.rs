//! `EdgeActor`: embedding, head and loss, the owner of the tied matrix. It starts each
//! micro-batch (embed → layer 0), turns the last layer's output into the loss and the first
//! gradient (head → last layer), and finishes it (the embedding's backward), reporting the
//! micro-batch's loss to the step.

use super::holder::StageHolder;
use super::layer::{answer, fail};
use super::msg::{EdgeMsg, EdgeSaved, GradOp, Hop, Sampled, StageControl};
use super::state::save_all;
use super::step::{Event, Ponder, StepCtx};
use super::worker::Priority;
use nsactor_plugin_api::{
    Batch, DeviceTensor, EngineError, GradPart, HeadOut, Loss, MicroBatchId, PicksBuf, Reply,
    SessionId, SnapshotId, StageCall, Tokens,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub struct EdgeActor;

pub struct EdgeArgs {
    pub num_layers: usize,
    pub stage: StageHolder,
}

/// A micro-batch between its embedding and the end of its backward pass.
struct InFlight {
    batch: Arc<Batch>,
    loss_scale: f64,
    ponder_weight: f64,
    /// Set by the head: the micro-batch's CE and the layers' ponder statistics.
    result: Option<(f64, Ponder)>,
}

pub struct EdgeState {
    num_layers: usize,
    stage: StageHolder,
    first: Option<Hop>,
    last: Option<Hop>,
    in_flight: HashMap<MicroBatchId, InFlight>,
    /// Last-layer outputs waiting for a smaller micro-batch's: heads run in micro-batch order,
    /// so the head's gradients add up in one order however the layers deliver them (the two
    /// runtime threads can deliver m + 1 first), and a step is reproducible bit for bit.
    pending_heads: BTreeMap<MicroBatchId, (DeviceTensor, Ponder, StepCtx)>,
}

impl EdgeState {
    /// Starts micro-batch `micro`: embeds its tokens and sends them to layer 0.
    async fn embed(
        &mut self,
        micro: MicroBatchId,
        batch: Arc<Batch>,
        loss_scale: f64,
        ponder_weight: f64,
        ctx: StepCtx,
    ) -> Result<(), ActorProcessingErr> {
        let b = batch.clone();
        let r = self
            .stage
            .train_job(true, micro, &ctx, None, move |st, _| {
                b.validate()?;
                let tokens = Tokens {
                    ids: &b.inputs,
                    batch: b.batch,
                    seq_len: b.seq_len,
                };
                let r = st.call(StageCall::Embed { micro, tokens })?;
                Ok((r.into_tensor("Embed")?, ()))
            })
            .await;
        match r {
            Ok((h, ())) => {
                self.in_flight.insert(
                    micro,
                    InFlight {
                        batch,
                        loss_scale,
                        ponder_weight,
                        result: None,
                    },
                );
                let first = self.first.as_ref().ok_or("edge actor not wired")?;
                first.forward(micro, h, Ponder::default(), ctx);
            }
            Err(e) => return fail(WHO.into(), micro, e, &ctx).await,
        }
        Ok(())
    }

    /// The last layer's output of `micro` has come: the heads now due run in micro-batch
    /// order, each sending its gradient back to the last layer.
    async fn head(
        &mut self,
        micro: MicroBatchId,
        h: DeviceTensor,
        ponder: Ponder,
        ctx: StepCtx,
    ) -> Result<(), ActorProcessingErr> {
        if !self.in_flight.contains_key(&micro) {
            let e = EngineError::InvalidInput(format!(
                "Head for {micro}, which has no Embed in flight"
            ));
            return fail(WHO.into(), micro, e, &ctx).await;
        }
        self.pending_heads.insert(micro, (h, ponder, ctx));
        // The smallest micro-batch in flight without a head result goes next, once
        // its last-layer output is here.
        while let Some(micro) = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.result.is_none())
            .map(|(m, _)| *m)
            .min()
        {
            let Some((h, ponder, ctx)) = self.pending_heads.remove(&micro) else {
                break;
            };
            let f = &self.in_flight[&micro];
            let (b, loss_scale) = (f.batch.clone(), f.loss_scale);
            // loss = ce + λ·Σ_l pc_l / L, scaled by `loss_scale`.
            let ponder_grad = f.ponder_weight * loss_scale / self.num_layers as f64;
            let r = self
                .stage
                .train_job(false, micro, &ctx, Some(h), move |st, h| {
                    let r = HeadOut::try_from(st.call(StageCall::Head {
                        micro,
                        h: h.expect("moved"),
                        targets: &b.targets,
                        mask: &b.loss_mask,
                        loss_scale,
                    })?)?;
                    Ok((r.grad, r.loss.ce))
                })
                .await;
            match r {
                Ok((grad, ce)) => {
                    if let Some(f) = self.in_flight.get_mut(&micro) {
                        f.result = Some((ce, ponder));
                    }
                    let last = self.last.as_ref().ok_or("edge actor not wired")?;
                    last.backward(micro, grad, ponder_grad, ctx);
                }
                Err(e) => return fail(WHO.into(), micro, e, &ctx).await,
            }
        }
        Ok(())
    }

    /// Finishes micro-batch `micro`: the embedding's backward, then its loss to the step.
    async fn embed_backward(
        &mut self,
        micro: MicroBatchId,
        grad: DeviceTensor,
        ctx: StepCtx,
    ) -> Result<(), ActorProcessingErr> {
        let r = self
            .stage
            .compute(
                Priority::Backward(ctx.key(micro)),
                Some(grad),
                move |st, g| {
                    st.call(StageCall::EmbedBackward {
                        micro,
                        grad: g.expect("moved"),
                    })
                    .map(drop)
                },
            )
            .await;
        match (r, self.in_flight.remove(&micro)) {
            (
                Ok(()),
                Some(InFlight {
                    result: Some((ce, ponder)),
                    ..
                }),
            ) => ctx.send(Event::Done { micro, ce, ponder }).await,
            (Ok(()), _) => {
                let e = EngineError::InvalidInput(format!(
                    "EmbedBackward for {micro}, which has no Head result"
                ));
                return fail(WHO.into(), micro, e, &ctx).await;
            }
            (Err(e), _) => return fail(WHO.into(), micro, e, &ctx).await,
        }
        Ok(())
    }

    /// A control call on the stage; zeroing the gradients also forgets the micro-batches in
    /// flight.
    async fn control(&mut self, call: StageControl) -> Result<Reply, EngineError> {
        if matches!(call, StageControl::ZeroGrad) {
            self.in_flight.clear();
            self.pending_heads.clear();
        }
        self.stage
            .compute(Priority::Control, None, move |st, _| st.call(call.call()))
            .await
    }

    /// One operation of the gradient exchange of data parallelism.
    async fn grads(&mut self, op: GradOp) -> Result<Option<GradPart>, EngineError> {
        let (job, input) = op.into_job();
        let backend = self.stage.backend().clone();
        self.stage
            .compute(Priority::GRADS, input, move |st, t| {
                job.run(st, t, &*backend)
            })
            .await
    }

    /// Embeds tokens for decoding or evaluation; with `ready`, returns once they are computed.
    async fn session_embed(
        &mut self,
        ids: Vec<i64>,
        batch: usize,
        seq_len: usize,
        ready: bool,
    ) -> Result<DeviceTensor, EngineError> {
        let backend = self.stage.backend().clone();
        self.stage
            .compute(Priority::FORWARD_UNTRAINED, None, move |st, _| {
                use super::trace::{Mark, mark};
                mark(Mark::EmbedJob);
                let h = st
                    .call(StageCall::SessionEmbed {
                        tokens: Tokens {
                            ids: &ids,
                            batch,
                            seq_len,
                        },
                    })?
                    .into_tensor("SessionEmbed")?;
                if ready || super::trace::syncing() {
                    backend.ready(&h)?;
                    mark(Mark::EmbedOnDevice);
                }
                Ok(h)
            })
            .await
    }

    /// Last-position logits of `sessions` (with `every`, every position's), copied to the
    /// host.
    async fn session_decode(
        &mut self,
        sessions: Vec<SessionId>,
        h: DeviceTensor,
        every: bool,
        saves: Vec<(SessionId, SnapshotId)>,
    ) -> Result<(Vec<f32>, EdgeSaved), EngineError> {
        let backend = self.stage.backend().clone();
        self.stage
            .compute(Priority::FORWARD_UNTRAINED, Some(h), move |st, h| {
                use super::trace::{Mark, mark};
                mark(Mark::DecodeJob);
                let (sessions, h) = (&sessions, h.expect("moved"));
                let call = if every {
                    StageCall::SessionDecodeAll { sessions, h }
                } else {
                    StageCall::SessionDecode { sessions, h }
                };
                let logits = st.call(call)?.into_tensor("SessionDecode")?;
                let saved = save_all(st, &saves);
                mark(Mark::DecodeQueued);
                let host = backend.to_host(&logits)?.data;
                mark(Mark::Copied);
                Ok((host, saved))
            })
            .await
    }

    /// Every row's next token of `sessions` chosen on the device as `picks` says, copied to the
    /// host with the logits when `want_logits`.
    async fn session_sample(
        &mut self,
        sessions: Vec<SessionId>,
        h: DeviceTensor,
        mut picks: PicksBuf,
        want_logits: bool,
        saves: Vec<(SessionId, SnapshotId)>,
    ) -> Result<(Sampled, EdgeSaved), EngineError> {
        let backend = self.stage.backend().clone();
        self.stage
            .compute(Priority::FORWARD_UNTRAINED, Some(h), move |st, h| {
                use super::trace::{Mark, mark};
                mark(Mark::DecodeJob);
                let mut out = st
                    .call(StageCall::SessionSample {
                        sessions: &sessions,
                        h: h.expect("moved"),
                        picks: picks.picks(),
                    })?
                    .tensors;
                if out.len() != 2 {
                    return Err(EngineError::Backend(format!(
                        "SessionSample answered {} tensors, not [picked, logits]",
                        out.len()
                    )));
                }
                let saved = save_all(st, &saves);
                mark(Mark::DecodeQueued);
                let logits = out.pop().expect("two");
                let picked = backend.to_host(&out.pop().expect("two"))?.data;
                let logits = if want_logits {
                    Some(backend.to_host(&logits)?.data)
                } else {
                    None
                };
                mark(Mark::Copied);
                Ok(((picked, logits), saved))
            })
            .await
    }

    /// Masked mean CE of `h` against `batch`, without gradients.
    async fn head_eval(&mut self, h: DeviceTensor, batch: Arc<Batch>) -> Result<f64, EngineError> {
        self.stage
            .compute(Priority::FORWARD_UNTRAINED, Some(h), move |st, h| {
                let l = Loss::try_from(st.call(StageCall::HeadEval {
                    h: h.expect("moved"),
                    targets: &batch.targets,
                    mask: &batch.loss_mask,
                })?)?;
                Ok(l.ce)
            })
            .await
    }

    /// `−ln p(target)` of every position of `h`, copied to the host.
    async fn token_losses(
        &mut self,
        h: DeviceTensor,
        targets: Vec<i64>,
    ) -> Result<Vec<f32>, EngineError> {
        let backend = self.stage.backend().clone();
        self.stage
            .compute(Priority::FORWARD_UNTRAINED, Some(h), move |st, h| {
                let ce = st
                    .call(StageCall::TokenLosses {
                        h: h.expect("moved"),
                        targets: &targets,
                    })?
                    .into_tensor("TokenLosses")?;
                Ok(backend.to_host(&ce)?.data)
            })
            .await
    }
}

const WHO: &str = "edge";

impl Actor for EdgeActor {
    type Msg = EdgeMsg;
    type State = EdgeState;
    type Arguments = EdgeArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<EdgeMsg>,
        a: EdgeArgs,
    ) -> Result<EdgeState, ActorProcessingErr> {
        Ok(EdgeState {
            num_layers: a.num_layers,
            stage: a.stage,
            first: None,
            last: None,
            in_flight: HashMap::new(),
            pending_heads: BTreeMap::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<EdgeMsg>,
        msg: EdgeMsg,
        s: &mut EdgeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EdgeMsg::Wire { first, last } => {
                s.first = Some(first);
                s.last = Some(last);
            }
            EdgeMsg::Embed {
                micro,
                batch,
                loss_scale,
                ponder_weight,
                ctx,
            } => {
                return s.embed(micro, batch, loss_scale, ponder_weight, ctx).await;
            }
            EdgeMsg::Head {
                micro,
                h,
                ponder,
                ctx,
            } => return s.head(micro, h, ponder, ctx).await,
            EdgeMsg::EmbedBackward { micro, grad, ctx } => {
                return s.embed_backward(micro, grad, ctx).await;
            }
            EdgeMsg::Control { call, reply } => {
                let r = s.control(call).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::Grads { op, reply } => {
                let r = s.grads(op).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::State { op, reply } => {
                let (backend, device) = (s.stage.backend().clone(), s.stage.device);
                // At a decoding pass's priority, in turn with them: a snapshot op takes
                // microseconds, and at the lowest priority it waited for a gap between a
                // busy server's passes.
                let r = s
                    .stage
                    .compute(Priority::FORWARD_UNTRAINED, None, move |st, _| {
                        op.run(st, &*backend, device)
                    })
                    .await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::SessionEmbed {
                ids,
                batch,
                seq_len,
                ready,
                reply,
            } => {
                let r = s.session_embed(ids, batch, seq_len, ready).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::SessionDecode {
                sessions,
                h,
                every,
                saves,
                reply,
            } => {
                let r = s.session_decode(sessions, h, every, saves).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::SessionSample {
                sessions,
                h,
                picks,
                want_logits,
                saves,
                reply,
            } => {
                let r = s
                    .session_sample(sessions, h, picks, want_logits, saves)
                    .await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::HeadEval { h, batch, reply } => {
                let r = s.head_eval(h, batch).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::TokenLosses { h, targets, reply } => {
                let r = s.token_losses(h, targets).await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::Snapshot { reply } => {
                let r = s
                    .stage
                    .compute(Priority::Control, None, |st, _| st.snapshot())
                    .await;
                return answer(WHO.into(), reply, r);
            }
            EdgeMsg::Load { bytes, reply } => {
                s.in_flight.clear();
                s.pending_heads.clear();
                let r = s
                    .stage
                    .compute(Priority::Control, None, move |st, _| st.load(&bytes))
                    .await;
                return answer(WHO.into(), reply, r);
            }
        }
        Ok(())
    }
}
