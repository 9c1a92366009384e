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
//! stage workers. Across processes ([`super::world`]) replica 0 of rank 0 is the root, and
//! the other ranks' parts come after its own process's. On a backend with collectives (NCCL)
//! under `sum`, replicas on devices of their own all-reduce each stage together, with the
//! other ranks' ([`super::collective`]).

use super::collective::{Collectives, Reduced};
use super::lanes::Lanes;
use super::msg::{GradOp, Hop, StageControl, control_all};
use super::supervisor::SupState;
use super::topology::Children;
use super::world::{Outcome, Remote, StageCopy, exchange_results};
use futures_util::future::join_all;
use nsactor_engine::engine::StepParams;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::optim::{clip_factor, phase2_layer_scales};
use nsactor_plugin_api::{BiasGradNorms, ComputeBackend, GradPart, GradSumSquares, Reply};
use std::sync::Arc;

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

/// Reduces one stage's gradients over its copies (`copies[r]` is replica r's) through replica
/// 0 and, on rank 0 of a world, over the other ranks' (`remote`; through `collectives` when
/// the world has them), leaving the sum in every copy.
async fn reduce_stage(
    who: &str,
    backend: &Arc<dyn ComputeBackend>,
    copies: &[StageCopy],
    remote: Option<&Remote>,
    collectives: Option<&Collectives>,
) -> Result<(), RuntimeError> {
    let (root_copy, rest) = copies.split_first().expect("at least one replica");
    // Every part of the other replicas goes to replica 0, which adds them in key order.
    for c in rest {
        while let Some(part) = c.stage.grads(who, GradOp::Out { keep: false }).await? {
            let part = moved(backend, part, root_copy.device).await?;
            root_copy.stage.grads(who, GradOp::In(part)).await?;
        }
    }
    match (remote, collectives) {
        (Some(r), Some(c)) => r.all_reduce(who, backend, c, root_copy).await?,
        (Some(r), None) => r.gather(who, backend, root_copy).await?,
        (None, _) => {}
    }
    // Through the host, rank 0 sends the sums to the other ranks.
    scatter(
        who,
        backend,
        copies,
        remote.filter(|_| collectives.is_none()),
    )
    .await
}

/// The parts already taken out of every copy (`parts[r]` replica r's) summed through replica
/// 0 as [`reduce_stage`] sums them, and the sums handed back.
async fn through_root(
    who: &str,
    backend: &Arc<dyn ComputeBackend>,
    copies: &[StageCopy],
    parts: Vec<Vec<GradPart>>,
) -> Result<(), RuntimeError> {
    let root = &copies[0];
    // Replica 0's own parts first: they hold the smallest keys.
    for part in parts.into_iter().flatten() {
        let part = moved(backend, part, root.device).await?;
        root.stage.grads(who, GradOp::In(part)).await?;
    }
    scatter(who, backend, copies, None).await
}

/// Replica 0's sums (one per stream): a copy to each other replica and, through the host,
/// to each other rank (`remote`), then back home.
async fn scatter(
    who: &str,
    backend: &Arc<dyn ComputeBackend>,
    copies: &[StageCopy],
    remote: Option<&Remote>,
) -> Result<(), RuntimeError> {
    let (root_copy, rest) = copies.split_first().expect("at least one replica");
    let root = &root_copy.stage;
    let mut sums: Vec<GradPart> = Vec::new();
    loop {
        for c in rest {
            if let Some(copy) = root.grads(who, GradOp::Out { keep: true }).await? {
                let copy = moved(backend, copy, c.device).await?;
                c.stage.grads(who, GradOp::In(copy)).await?;
            }
        }
        if let Some(r) = remote
            && let Some(copy) = root.grads(who, GradOp::Out { keep: true }).await?
        {
            r.broadcast(backend, copy).await?;
        }
        match root.grads(who, GradOp::Out { keep: false }).await? {
            Some(sum) => sums.push(sum),
            None => break,
        }
    }
    if let Some(r) = remote {
        r.end_broadcast()?;
    }
    for sum in sums {
        root.grads(who, GradOp::In(sum)).await?;
    }
    Ok(())
}

impl SupState {
    /// This rank's first replica among the world's, and the world's replicas; without a
    /// world, `(0, local replicas)`.
    pub(super) fn world_replicas(&self) -> (usize, usize) {
        let d = 1 + self.others.len();
        match &self.topo.world {
            Some(w) => (w.rank() * d, w.size() * d),
            None => (0, d),
        }
    }

    /// The whole step's micro-batch results: `mine` alone without a world, else every rank's
    /// ([`exchange_results`]).
    pub(super) async fn world_results(
        &self,
        step: u64,
        mine: Vec<Outcome>,
    ) -> Result<Vec<Outcome>, RuntimeError> {
        match &self.topo.world {
            Some(w) => exchange_results(w, step, &mine).await,
            None => Ok(mine),
        }
    }

    /// A step of a world failed here: the other ranks are told, and this pipeline is broken
    /// (the ranks restart together). A loss spike is every rank's verdict alike: no failure.
    pub(super) fn world_failed(&mut self, e: &RuntimeError) {
        let Some(w) = &self.topo.world else { return };
        if matches!(e, RuntimeError::LossSpike { .. }) {
            return;
        }
        w.peers.abort(&e.to_string());
        self.broken
            .get_or_insert_with(|| format!("{} failed a step: {e}", w.peers.world.describe()));
    }

    /// `kill-rank:RANK:STEP`: this process dies here, as from `kill -9`.
    pub(super) fn die_if_injected(&self) {
        if let (Some(f), Some(w)) = (&self.topo.fault, &self.topo.world)
            && f.kill_rank_now(w.rank())
        {
            tracing::error!(
                "injected fault: {} kills itself (SIGKILL)",
                w.peers.world.describe()
            );
            // SAFETY: kill(2) on this process's own pid.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }

    /// A step's reduction permits and all-reduce turns for `layers` layers.
    pub(super) fn reduction_lanes(layers: usize) -> Arc<Lanes> {
        Lanes::new(layers)
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
    /// (module docs) as a task of its own; `step` and `base` (the id of its first
    /// micro-batch) place it for the other ranks of a world.
    pub(super) fn spawn_reduce(
        &self,
        k: usize,
        lanes: Arc<Lanes>,
        step: u64,
        base: u64,
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
        let remote = self.topo.world.as_ref().map(|link| Remote {
            link: link.clone(),
            step,
            stage: k as u32,
            base,
        });
        let collectives = self.topo.collectives.clone();
        let hold = self.topo.hold_grads;
        tokio::spawn(async move {
            if collectives.is_none()
                && let Some(r) = remote.as_ref().filter(|r| r.link.rank() > 0)
            {
                // Through the host, without a lane: rank 0's reductions wait for these parts,
                // whatever order the ranks' layers finished in.
                return r.send_stage(&who, &backend, &copies).await;
            }
            let devices: Vec<usize> = copies.iter().map(|c| c.device).collect();
            if let Some(c) = &collectives
                && Collectives::joins_every_copy(&devices, hold)
            {
                let reduced = c.reduce(&who, &backend, &copies, remote.as_ref(), &lanes, k);
                return match reduced.await? {
                    Reduced::Done => Ok(()),
                    Reduced::Uneven(parts) => through_root(&who, &backend, &copies, parts).await,
                };
            }
            // Replica 0 of every rank all-reduces over the world: the stages take turns (in
            // the same order on every rank) before they take a lane, so no lane waits on a
            // turn.
            let world = collectives.as_deref().filter(|_| remote.is_some());
            let _turn = match world {
                Some(_) => Some(lanes.turn(k).await?),
                None => None,
            };
            let _lane = lanes.lane().await?;
            reduce_stage(&who, &backend, &copies, remote.as_ref(), world).await
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
