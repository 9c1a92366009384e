//! Data parallelism inside the supervisor: which replica runs which micro-batch, the gradient
//! reduction across replicas, and the optimizer-phase calls sent to every replica.
//!
//! A step's M micro-batches are split into D contiguous shares, replica r taking
//! `r·M/D .. (r+1)·M/D`. Once every micro-batch is done, each stage's gradients are reduced
//! onto replica 0's copy of the stage and the sum is handed back to every replica, stage by
//! stage and all stages at once. Under `ordered` the replicas after the first hold each
//! micro-batch's gradients apart, and replica 0 adds them after its own (which come first) in
//! micro-batch order: the sum one replica would make, bit for bit. Under `sum` each replica
//! sums its own share and replica 0 adds the replicas' sums in replica order. A layer's
//! reduction starts as soon as every replica has run that layer's backward passes, while the
//! other layers go on. Tensors cross devices through
//! [`ComputeBackend::to_device`] (peer copies between GPUs) on the blocking pool, off the
//! stage workers.

use super::msg::{GradOp, Hop, StageControl, control_all};
use super::supervisor::SupState;
use super::topology::Children;
use crate::engine::StepParams;
use crate::error::RuntimeError;
use futures_util::future::join_all;
use nsactor_plugin_api::optim::{clip_factor, phase2_layer_scales};
use nsactor_plugin_api::{BiasGradNorms, ComputeBackend, GradPart, GradSumSquares, Reply};
use std::sync::Arc;

/// Stage reductions running at once. Each holds up to two extra copies of its stage's
/// gradients on replica 0's device; with every stage at once, the end of a step's backward
/// asked 0.9B on an H100 for gigabytes more than one replica's training needs and ran out.
pub(crate) const REDUCTION_LANES: usize = 2;

/// One copy of a stage in a reduction: its actor and its device.
struct StageCopy {
    stage: Hop,
    device: usize,
}

/// `part` on `device`, moved on the blocking pool: a copy between GPUs waits on the host for
/// both devices' queues, and a stage worker that waited there would stop issuing its
/// replica's compute (measured: 0.3 s of a 2.5 s step on two H100s).
async fn moved(
    backend: &Arc<dyn ComputeBackend>,
    mut part: GradPart,
    device: usize,
) -> Result<GradPart, RuntimeError> {
    let backend = backend.clone();
    tokio::task::spawn_blocking(move || {
        part.flat = backend.to_device(part.flat, device)?;
        Ok(part)
    })
    .await
    .map_err(|e| RuntimeError::Runtime(format!("moving gradients: {e}")))?
}

/// Reduces one stage's gradients over its copies (`copies[r]` is replica r's), leaving the
/// sum in every copy.
async fn reduce_stage(
    who: &str,
    backend: &Arc<dyn ComputeBackend>,
    copies: &[StageCopy],
) -> Result<(), RuntimeError> {
    let (root, rest) = copies.split_first().expect("at least one replica");
    // Every part of the other replicas goes to replica 0, which adds them in key order.
    for c in rest {
        while let Some(part) = c.stage.grads(who, GradOp::Out { keep: false }).await? {
            let part = moved(backend, part, root.device).await?;
            root.stage.grads(who, GradOp::In(part)).await?;
        }
    }
    let root = &root.stage;
    // Replica 0's sums (one per stream): a copy to each other replica, then back home.
    let mut sums: Vec<GradPart> = Vec::new();
    loop {
        for c in rest {
            if let Some(copy) = root.grads(who, GradOp::Out { keep: true }).await? {
                let copy = moved(backend, copy, c.device).await?;
                c.stage.grads(who, GradOp::In(copy)).await?;
            }
        }
        match root.grads(who, GradOp::Out { keep: false }).await? {
            Some(sum) => sums.push(sum),
            None => break,
        }
    }
    for sum in sums {
        root.grads(who, GradOp::In(sum)).await?;
    }
    Ok(())
}

impl SupState {
    /// A step's permits for [`REDUCTION_LANES`] stage reductions at once.
    pub(super) fn reduction_lanes() -> Arc<tokio::sync::Semaphore> {
        Arc::new(tokio::sync::Semaphore::new(REDUCTION_LANES))
    }

    /// Every replica's actors, replica 0 first.
    pub(super) fn replicas(&self) -> Vec<Children> {
        std::iter::once(Children {
            edge: self.edge.clone(),
            layers: self.layers.clone(),
        })
        .chain(self.others.iter().cloned())
        .collect()
    }

    /// Starts the reduction of stage `k` (0 the edge, 1 + i layer i) over the replicas
    /// (module docs) as a task of its own.
    pub(super) fn spawn_reduce(
        &self,
        k: usize,
        lanes: Arc<tokio::sync::Semaphore>,
    ) -> tokio::task::JoinHandle<Result<(), RuntimeError>> {
        let copies: Vec<StageCopy> = self
            .replicas()
            .iter()
            .zip(&self.topo.replicas)
            .map(|(c, r)| match k {
                0 => StageCopy {
                    stage: Hop::Edge(c.edge.clone()),
                    device: r.plan.edge_device(),
                },
                k => StageCopy {
                    stage: Hop::Layer(c.layers[k - 1].clone()),
                    device: r.plan.layer_devices()[k - 1],
                },
            })
            .collect();
        let who = match k {
            0 => "edge".to_string(),
            k => format!("layer {}", k - 1),
        };
        let backend = self.topo.backend.clone();
        tokio::spawn(async move {
            let _lane = lanes
                .acquire_owned()
                .await
                .map_err(|e| RuntimeError::Runtime(format!("reduction lanes: {e}")))?;
            reduce_stage(&who, &backend, &copies).await
        })
    }

    /// The optimizer phase; returns the gradient norm before clipping, or `None` (and no
    /// step taken) when that norm is not finite.
    pub(super) async fn apply_step(&self, p: &StepParams) -> Result<Option<f64>, RuntimeError> {
        // Every replica runs the optimizer phase on the same reduced gradients; replica 0's
        // figures are the step's.
        let stats = StageControl::GradStats;
        let (_, stats) = self.control_replicas(stats, |_| stats).await?;
        let norms = stats
            .into_iter()
            .map(|r| Ok(BiasGradNorms::try_from(r)?))
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let scales = phase2_layer_scales(&norms);
        let (e, ls) = self
            .control_replicas(StageControl::ScaleGrads([1.0; 3]), |i| {
                StageControl::ScaleGrads(scales[i])
            })
            .await?;
        // Summed in stage order (edge, then layers) whatever order the replies came in.
        let GradSumSquares(mut sum_sq) = e.try_into()?;
        for r in ls {
            let GradSumSquares(s) = r.try_into()?;
            sum_sq += s;
        }
        let norm = sum_sq.sqrt();
        if !norm.is_finite() {
            return Ok(None);
        }
        let clip = clip_factor(norm, p.max_grad_norm);
        let (lr, neuron_lr) = (p.lr, p.neuron_lr);
        let step = StageControl::Step {
            lr,
            neuron_lr,
            clip,
        };
        self.control_replicas(step, |_| step).await?;
        Ok(Some(norm))
    }

    /// [`control_all`] on every replica at once; replica 0's answers, after checking the
    /// others' for errors.
    pub(super) async fn control_replicas(
        &self,
        edge_call: StageControl,
        layer_call: impl Fn(usize) -> StageControl + Copy,
    ) -> Result<(Reply, Vec<Reply>), RuntimeError> {
        let replicas = self.replicas();
        let answers = join_all(
            replicas
                .iter()
                .map(|c| control_all(&c.edge, &c.layers, edge_call, layer_call)),
        )
        .await;
        let mut first = None;
        for (e, ls) in answers {
            let e = e?;
            let ls = ls.into_iter().collect::<Result<Vec<_>, _>>()?;
            first.get_or_insert((e, ls));
        }
        Ok(first.expect("at least one replica"))
    }
}
