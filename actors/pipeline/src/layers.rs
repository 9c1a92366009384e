//! Work on the layer actors' stages, each lent for it: a decoding pass or a held-out
//! evaluation (the layers that share a worker run as one job there) and the prefix cache's
//! state ops ([`state_all`]).

use super::holder::StageHolder;
use super::msg::{EdgeMsg, LayerMsg, ask};
use super::state::{SaveTally, StateOp, StateOut, save_all};
use super::trace;
use super::worker::{JobPanicked, Priority};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{DeviceTensor, EngineError, SessionId, SnapshotId, StageCall};
use ractor::ActorRef;
use std::sync::Arc;

/// What each layer of a lent pass does with its input.
#[derive(Clone)]
enum PassCall {
    /// A decoding pass of these sessions (`StageCall::SessionForward`).
    Sessions(Vec<SessionId>),
    /// A held-out evaluation (`StageCall::Evaluate`): the training forward, nothing kept.
    Evaluate,
}

/// `h` through every layer for a held-out evaluation: each layer's training forward from
/// membranes at rest, keeping nothing (no session, no gradient touched), lent and grouped per
/// worker as a decoding pass is. The kernels are the training step's, already compiled and
/// chosen at its shapes, where a decoding pass's batch-invariant ones would be chosen anew.
///
/// Each worker's job returns only once its layers' work is computed, and the caller hands in
/// an embedding already computed (the edge's `SessionEmbed` with `ready`): under a backend
/// with a queue per thread (the CUDA plugin's per-thread streams, which training uses) a
/// tensor handed from one worker to the next while its work was still queued gave wrong
/// evaluations — 4.84 against 3.96 at 32 rows in session 21, and NaN at 14 rows of the 0.9B
/// in session 53, where a shared stream gave the right figure at any size (HISTORY). A
/// training step does not meet it: each layer keeps its input until the backward. Waiting at
/// the two hand-offs costs an evaluation two device round trips per forward.
pub async fn evaluate_layers(
    layers: &[ActorRef<LayerMsg>],
    h: DeviceTensor,
) -> Result<DeviceTensor, RuntimeError> {
    let holders = share_layers(layers).await?;
    run_pass(&holders, PassCall::Evaluate, h, &[])
        .await
        .map(|(h, _)| h)
}

/// `h` through `layers` for decoding `sessions` (batch rows split evenly among them, in order).
/// Each layer actor lends its stage ([`LayerMsg::Share`], all asked at once), and the layers
/// that share a worker (one pipeline stage's) run as one job there, one after another: a
/// decoding pass makes one round trip per worker instead of two thread hops per layer, which
/// at one token per pass took longer than the layers' own work. The layers' states stay in
/// their stages; an error names the layer it came from.
pub async fn session_layers(
    layers: &[ActorRef<LayerMsg>],
    sessions: &[SessionId],
    h: DeviceTensor,
) -> Result<DeviceTensor, RuntimeError> {
    let holders = share_layers(layers).await?;
    run_layers(&holders, sessions, h).await
}

/// Every layer actor's stage handle, asked all at once (the first half of
/// [`session_layers`], which a cohort overlaps with its embedding).
pub async fn share_layers(layers: &[ActorRef<LayerMsg>]) -> Result<Vec<StageHolder>, RuntimeError> {
    futures_util::future::try_join_all(
        layers
            .iter()
            .enumerate()
            .map(|(i, l)| ask(l, format!("layer {i}"), |reply| LayerMsg::Share { reply })),
    )
    .await
}

/// The second half of [`session_layers`]: `h` through the shared layers, one job per run of
/// layers on the same worker.
pub async fn run_layers(
    holders: &[StageHolder],
    sessions: &[SessionId],
    h: DeviceTensor,
) -> Result<DeviceTensor, RuntimeError> {
    run_layers_saving(holders, sessions, h, &[])
        .await
        .map(|(h, _)| h)
}

/// [`run_layers`], then in the same jobs each layer keeps a snapshot of the sessions of
/// `saves` as the pass left them ([`save_all`]): what each save holds over the layers, or
/// why not (a failed save fails neither the pass nor the other saves).
pub async fn run_layers_saving(
    holders: &[StageHolder],
    sessions: &[SessionId],
    h: DeviceTensor,
    saves: &[(SessionId, SnapshotId)],
) -> Result<(DeviceTensor, SaveTally), RuntimeError> {
    run_pass(holders, PassCall::Sessions(sessions.to_vec()), h, saves).await
}

/// `h` through the lent layers, `call` at each; the layers of one worker run as one job.
async fn run_pass(
    holders: &[StageHolder],
    call: PassCall,
    mut h: DeviceTensor,
    saves: &[(SessionId, SnapshotId)],
) -> Result<(DeviceTensor, SaveTally), RuntimeError> {
    let mut tally = SaveTally::new(saves.len());
    let mut start = 0;
    while start < holders.len() {
        let worker = &holders[start].worker;
        let end = (start..holders.len())
            .find(|&j| !Arc::ptr_eq(&holders[j].worker, worker))
            .unwrap_or(holders.len());
        let group = holders[start..end].to_vec();
        let call = call.clone();
        let evaluating = matches!(call, PassCall::Evaluate);
        let saves = saves.to_vec();
        let job = worker.run_then(Priority::FORWARD_UNTRAINED, None, move || {
            trace::mark(trace::Mark::LayersJob);
            let mut h = h;
            let mut kept = Vec::with_capacity(if saves.is_empty() { 0 } else { group.len() });
            for holder in &group {
                let (out, saved) = holder
                    .run(Some(h), |st, h| {
                        let h = h.expect("moved");
                        let out = match &call {
                            PassCall::Sessions(sessions) => st
                                .call(StageCall::SessionForward { sessions, h })?
                                .into_tensor("SessionForward")?,
                            PassCall::Evaluate => st
                                .call(StageCall::Evaluate { h })?
                                .into_tensor("Evaluate")?,
                        };
                        Ok((out, save_all(st, &saves)))
                    })
                    .map_err(|error| RuntimeError::Stage {
                        who: holder.who.clone(),
                        error,
                    })?;
                h = out;
                if !saves.is_empty() {
                    kept.push((holder.who.clone(), saved));
                }
            }
            trace::mark(trace::Mark::LayersQueued);
            if (evaluating || trace::syncing())
                && let Some(last) = group.last()
            {
                last.backend
                    .ready(&h)
                    .map_err(|error| RuntimeError::Stage {
                        who: last.who.clone(),
                        error,
                    })?;
                trace::mark(trace::Mark::LayersOnDevice);
            }
            Ok::<_, RuntimeError>((h, kept))
        });
        let kept;
        (h, kept) = match job.await {
            Ok(r) => r?,
            Err(JobPanicked(m)) => {
                return Err(RuntimeError::Stage {
                    who: format!("layers {start}..{end}"),
                    error: EngineError::Panic(m),
                });
            }
        };
        for (who, saved) in kept {
            tally.add(&who, saved);
        }
        start = end;
    }
    Ok((h, tally))
}

/// Runs `edge_op` on the edge and `layer_op(i)` on layer `i`, all at once; the edge's answer
/// and the layers' in layer order. The layers lend their stages ([`share_layers`]) and the
/// ops of the layers that share a worker run as one job there, at a decoding pass's priority
/// and in turn with the passes: no layer actor waits for the worker meanwhile (a waiting
/// actor would hold up the next pass's share).
pub async fn state_all(
    edge: &ActorRef<EdgeMsg>,
    layers: &[ActorRef<LayerMsg>],
    edge_op: StateOp,
    layer_op: impl FnMut(usize) -> StateOp,
) -> (
    Result<StateOut, RuntimeError>,
    Vec<Result<StateOut, RuntimeError>>,
) {
    let e = ask(edge, "edge", |reply| EdgeMsg::State { op: edge_op, reply });
    let ls = async {
        match share_layers(layers).await {
            Ok(holders) => on_layers(&holders, layer_op).await,
            Err(e) => (0..layers.len())
                .map(|_| Err(e.for_each_session()))
                .collect(),
        }
    };
    futures_util::join!(e, ls)
}

/// `layer_op(i)` on layer `i` of `holders`, one job per run of layers on the same worker.
async fn on_layers(
    holders: &[StageHolder],
    mut layer_op: impl FnMut(usize) -> StateOp,
) -> Vec<Result<StateOut, RuntimeError>> {
    let mut jobs = Vec::new();
    let mut start = 0;
    while start < holders.len() {
        let worker = holders[start].worker.clone();
        let end = (start..holders.len())
            .find(|&j| !Arc::ptr_eq(&holders[j].worker, &worker))
            .unwrap_or(holders.len());
        let group: Vec<(StageHolder, StateOp)> = (start..end)
            .map(|i| (holders[i].clone(), layer_op(i)))
            .collect();
        let job = worker.run_then(Priority::FORWARD_UNTRAINED, None, move || {
            group
                .into_iter()
                .map(|(h, op)| {
                    h.run(None, |st, _| op.run(st, &*h.backend, h.device))
                        .map_err(|error| RuntimeError::Stage {
                            who: h.who.clone(),
                            error,
                        })
                })
                .collect::<Vec<_>>()
        });
        jobs.push(async move {
            job.await.unwrap_or_else(|JobPanicked(m)| {
                (start..end)
                    .map(|i| {
                        Err(RuntimeError::Stage {
                            who: format!("layer {i}"),
                            error: EngineError::Panic(m.clone()),
                        })
                    })
                    .collect()
            })
        });
        start = end;
    }
    futures_util::future::join_all(jobs)
        .await
        .into_iter()
        .flatten()
        .collect()
}
