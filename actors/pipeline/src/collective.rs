//! Gradient reduction through the backend's collectives (NCCL on GPUs): the communicators a
//! stage's copies join, and the all-reduce of a stage over them.
//!
//! Where every local replica's copy of a stage sits on a device of its own, all of them join
//! one communicator (with a world, every rank's copies too: replica `r` of rank `k` is rank
//! `k·d + r` of `size·d`), and a stage reduction is one all-reduce per gradient part on every
//! copy at once ([`Collectives::reduce`]): each GPU sends and receives `2·(n−1)/n` of the
//! stage's gradients on NVLink rings instead of replica 0 receiving every other replica's
//! gradients and sending the sum back. Each copy's all-reduce runs as a job of its stage's
//! worker ([`GradOp::AllReduce`]), on the stream that made the gradients and goes on using
//! them: from another thread's stream the collective raced the stage's next work for its
//! buffers (on two H200s the losses drifted from one GPU's as soon as the reductions overlapped
//! the backward). The calls of one stage are issued in its turn ([`super::lanes`]), on every
//! copy at once, since a collective may wait for the whole group. Where
//! two local replicas share a device (NCCL takes one rank per GPU), or replicas hold their
//! micro-batches apart (`ordered`), a process reduces over its replicas first and only replica
//! 0's copy joins the world's group ([`Remote::all_reduce`]).
//!
//! A communicator is joined the first time its devices reduce: rank 0 of a world makes the
//! group's id and sends it over the control plane; one process alone makes its own. Sums are
//! not bit-identical to the hub's (`sum`: NCCL adds in its own order); the CPU, which has no
//! collectives, takes the hub and host paths and keeps the bit-exactness.

use super::lanes::Lanes;
use super::msg::GradOp;
use super::world::{Remote, StageCopy, broken};
use futures_util::future::{join_all, try_join_all};
use nsactor_cluster::{Body, Kind};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{CollectiveId, Communicator, ComputeBackend, GradPart};
use std::collections::HashMap;
use std::sync::Arc;

/// One part's place in a stage's reduction; every copy must offer the same ones.
fn shape(p: &GradPart) -> (u32, Vec<i64>, Vec<usize>) {
    (p.stream.0, p.mask.words(), p.flat.shape())
}

/// How [`Collectives::reduce`] left a stage.
pub(super) enum Reduced {
    /// Every copy holds the sums.
    Done,
    /// The copies offered different parts (`parts[r]` replica r's, taken out of them).
    Uneven(Vec<Vec<GradPart>>),
}

/// The communicators this process has joined, by the devices that joined them (in local
/// replica order).
#[derive(Default)]
pub struct Collectives {
    groups: tokio::sync::Mutex<HashMap<Vec<usize>, Vec<Communicator>>>,
}

impl Collectives {
    /// Whether a stage whose copies sit on `devices` reduces with every copy in the group
    /// ([`Collectives::reduce`]): one rank per GPU, and each copy holding one sum per stream.
    pub fn joins_every_copy(devices: &[usize], hold_grads: bool) -> bool {
        let mut seen = devices.to_vec();
        seen.sort_unstable();
        seen.dedup();
        !hold_grads && seen.len() == devices.len()
    }

    /// The communicators of `devices` (one per local copy), joined the first time: with a
    /// world, in `remote`'s turn and with rank 0's id.
    pub(super) async fn group(
        &self,
        backend: &Arc<dyn ComputeBackend>,
        devices: &[usize],
        remote: Option<&Remote>,
    ) -> Result<Vec<Communicator>, RuntimeError> {
        let mut groups = self.groups.lock().await;
        if let Some(c) = groups.get(devices) {
            return Ok(c.clone());
        }
        let id = match remote {
            Some(r) => r.group_id(backend).await?,
            None => {
                let b = backend.clone();
                tokio::task::spawn_blocking(move || b.collective_id())
                    .await
                    .map_err(|e| RuntimeError::Runtime(format!("a collective id: {e}")))??
            }
        };
        let d = devices.len();
        let (rank, size) = remote.map_or((0, 1), |r| (r.link.rank(), r.link.size()));
        // Every rank of the group joins at once: a join returns when all have.
        let joins = devices.iter().enumerate().map(|(i, &device)| {
            let (b, id) = (backend.clone(), id.clone());
            tokio::task::spawn_blocking(move || {
                b.collective_join(&id, rank * d + i, size * d, device)
            })
        });
        let mut comms = Vec::with_capacity(d);
        for c in join_all(joins).await {
            comms
                .push(c.map_err(|e| RuntimeError::Runtime(format!("joining a collective: {e}")))??);
        }
        tracing::info!(
            "collective group of devices {devices:?} joined ({} ranks)",
            size * d
        );
        groups.insert(devices.to_vec(), comms.clone());
        Ok(comms)
    }

    /// Stage `k`'s gradients summed over every copy (and with a world every rank's), the sum
    /// left in every copy: each copy's parts out, all-reduced together in `k`'s turn, and put
    /// back under their own keys. Copies that offer different parts (a parameter without a
    /// gradient in one of them) are handed back ([`Reduced::Uneven`]) for the caller to reduce
    /// through replica 0, which a world cannot do: there they are an error.
    pub(super) async fn reduce(
        &self,
        who: &str,
        backend: &Arc<dyn ComputeBackend>,
        copies: &[StageCopy],
        remote: Option<&Remote>,
        lanes: &Lanes,
        k: usize,
    ) -> Result<Reduced, RuntimeError> {
        let turn = lanes.turn(k).await?;
        let _lane = lanes.lane().await?;
        let parts = try_join_all(copies.iter().map(|c| c.take_parts(who))).await?;
        let first: Vec<_> = parts[0].iter().map(shape).collect();
        if parts
            .iter()
            .any(|p| p.iter().map(shape).ne(first.iter().cloned()))
        {
            drop(turn);
            if remote.is_some() {
                return Err(RuntimeError::Runtime(format!(
                    "{who}: the replicas hold different gradient parts, which an all-reduce \
                     across processes cannot sum; NSACTOR_COLLECTIVES=host reduces them"
                )));
            }
            return Ok(Reduced::Uneven(parts));
        }
        let devices: Vec<usize> = copies.iter().map(|c| c.device).collect();
        let comms = self.group(backend, &devices, remote).await?;
        // Each copy's worker all-reduces its parts and puts the sums back; the next stage's
        // calls are queued on the workers only once these have been issued.
        try_join_all(
            copies
                .iter()
                .zip(parts)
                .zip(comms)
                .map(|((c, parts), comm)| c.stage.grads(who, GradOp::AllReduce { parts, comm })),
        )
        .await?;
        drop(turn);
        Ok(Reduced::Done)
    }
}

impl Remote {
    /// The sums in `root` (replica 0's copy, every stream's), summed over the world's ranks in
    /// place; called in this stage's turn.
    pub(super) async fn all_reduce(
        &self,
        who: &str,
        backend: &Arc<dyn ComputeBackend>,
        collectives: &Collectives,
        root: &StageCopy,
    ) -> Result<(), RuntimeError> {
        let comm = collectives
            .group(backend, &[root.device], Some(self))
            .await?[0];
        let parts = root.take_parts(who).await?;
        root.stage
            .grads(who, GradOp::AllReduce { parts, comm })
            .await?;
        Ok(())
    }

    /// Rank 0: a new group's id, sent to every rank; others: rank 0's.
    pub(super) async fn group_id(
        &self,
        backend: &Arc<dyn ComputeBackend>,
    ) -> Result<CollectiveId, RuntimeError> {
        let peers = &self.link.peers;
        if peers.rank() == 0 {
            let b = backend.clone();
            let id = tokio::task::spawn_blocking(move || b.collective_id())
                .await
                .map_err(|e| RuntimeError::Runtime(format!("a collective id: {e}")))??;
            for k in 1..peers.size() {
                peers
                    .send(k, self.step, self.stage, Body::Collective(id.0.clone()))
                    .map_err(broken)?;
            }
            return Ok(id);
        }
        let p = peers
            .recv(0, Kind::Collective(self.stage))
            .await
            .map_err(broken)?;
        match p.body {
            Body::Collective(id) => Ok(CollectiveId(id)),
            b => Err(RuntimeError::Broken(format!(
                "rank 0 sent {b:?} for a collective id"
            ))),
        }
    }
}
