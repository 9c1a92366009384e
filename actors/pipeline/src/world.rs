//! Data parallelism across processes: the supervisor's side of a world of ranks.
//!
//! Every rank runs the whole run's data the same way (the same sampler from the same cursor)
//! and the same local replicas; the world's replicas are numbered rank by rank, so rank `k`
//! holds replicas `k·d .. (k+1)·d` of `size·d`, and a step's micro-batches are shared among
//! them exactly as among one process's replicas. Rank 0's replica 0 is the root of every
//! stage's reduction: after its own process's replicas it takes the other ranks' gradient
//! parts in rank order (their keys are micro-batch indices within the step, mapped onto its
//! own ids), and it sends every sum back. The arithmetic is the one-process reduction's, so
//! the result does not depend on how the replicas are spread over processes. The ranks then
//! exchange their micro-batches' losses (every rank needs the whole step's loss for the
//! spike guard and the non-finite check) and run the optimizer phase on identical gradients
//! each on its own. On a backend with collectives (NCCL on GPUs) the ranks all-reduce each
//! stage device to device instead ([`super::collective`]); otherwise parts cross as f32 values
//! through the control plane's connection (TCP), which `NSACTOR_COLLECTIVES=host` also
//! forces.

use super::msg::{GradOp, Hop};
use super::step::Ponder;
use nsactor_cluster::{Body, ClusterError, Kind, MicroResult, Peers, WirePart};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{
    ComputeBackend, GradPart, GradStream, HostTensor, MicroBatchId, ParamMask,
};
use std::sync::Arc;

/// The stage number of the packet in which rank 0 says whether the world uses collectives.
const PROBE: u32 = u32::MAX;

/// Whether `NSACTOR_COLLECTIVES` asks for the host path (`host`) rather than the backend's
/// collectives (`auto`, the default).
pub fn host_forced() -> Result<bool, RuntimeError> {
    match std::env::var("NSACTOR_COLLECTIVES").as_deref() {
        Ok("host") => Ok(true),
        Ok("auto") | Err(_) => Ok(false),
        Ok(other) => Err(RuntimeError::Runtime(format!(
            "NSACTOR_COLLECTIVES={other}: give `auto` (the backend's collectives when it has \
             them) or `host`"
        ))),
    }
}

/// Whether `backend` has collectives (it can make a group id).
pub async fn collectives_available(backend: &Arc<dyn ComputeBackend>) -> bool {
    let b = backend.clone();
    tokio::task::spawn_blocking(move || b.collective_id().is_ok())
        .await
        .unwrap_or(false)
}

/// This process's place in a world of several, as the pipeline sees it.
pub struct WorldLink {
    pub peers: Arc<Peers>,
    /// Stages reduce through the backend's collectives (else through the host).
    collectives: bool,
}

/// A control-plane failure, as the pipeline reports it.
pub fn broken(e: ClusterError) -> RuntimeError {
    RuntimeError::Broken(e.to_string())
}

impl WorldLink {
    /// A link whose gradients cross through the host.
    pub fn new(peers: Arc<Peers>) -> Self {
        WorldLink {
            peers,
            collectives: false,
        }
    }

    /// A link that uses `backend`'s collectives when rank 0's has them and
    /// `NSACTOR_COLLECTIVES` is not `host`; every rank takes rank 0's answer.
    pub async fn negotiate(
        peers: Arc<Peers>,
        backend: &Arc<dyn ComputeBackend>,
    ) -> Result<Self, RuntimeError> {
        let collectives = if peers.rank() == 0 {
            let has = !host_forced()? && collectives_available(backend).await;
            for k in 1..peers.size() {
                peers
                    .send(k, 0, PROBE, Body::Collective(vec![u8::from(has)]))
                    .map_err(broken)?;
            }
            has
        } else {
            match peers
                .recv(0, Kind::Collective(PROBE))
                .await
                .map_err(broken)?
                .body
            {
                Body::Collective(v) => v == [1],
                b => return Err(unexpected(&b, 0)),
            }
        };
        Ok(WorldLink {
            collectives,
            ..WorldLink::new(peers)
        })
    }

    /// Whether stages reduce through the backend's collectives.
    pub fn collectives(&self) -> bool {
        self.collectives
    }

    pub fn rank(&self) -> usize {
        self.peers.rank()
    }

    pub fn size(&self) -> usize {
        self.peers.size()
    }
}

/// What a stage reduction across processes needs to know about its step.
#[derive(Clone)]
pub(super) struct Remote {
    pub link: Arc<WorldLink>,
    pub step: u64,
    pub stage: u32,
    /// This process's id of the step's first micro-batch.
    pub base: u64,
}

/// A stage copy in a reduction: its actor and its device.
pub(super) struct StageCopy {
    pub stage: Hop,
    pub device: usize,
}

impl StageCopy {
    /// Every gradient part the copy holds, taken out in its order.
    pub async fn take_parts(&self, who: &str) -> Result<Vec<GradPart>, RuntimeError> {
        let mut parts = Vec::new();
        while let Some(p) = self.stage.grads(who, GradOp::Out { keep: false }).await? {
            parts.push(p);
        }
        Ok(parts)
    }
}

fn check_step(r: &Remote, step: u64, from: usize) -> Result<(), RuntimeError> {
    match step == r.step {
        true => Ok(()),
        false => Err(RuntimeError::Broken(format!(
            "rank {from} sent gradients of step {step} during step {}",
            r.step
        ))),
    }
}

impl Remote {
    /// `part` off its device, keyed by its index within the step.
    async fn onto_wire(
        &self,
        backend: &Arc<dyn ComputeBackend>,
        part: GradPart,
    ) -> Result<WirePart, RuntimeError> {
        let backend = backend.clone();
        let host = tokio::task::spawn_blocking(move || backend.to_host(&part.flat))
            .await
            .map_err(|e| RuntimeError::Runtime(format!("copying gradients to the host: {e}")))??;
        let mask = part.mask.words().into_iter().map(|w| w as u32).collect();
        Ok(WirePart {
            stream: part.stream.0,
            index: part.key.0.checked_sub(self.base).ok_or_else(|| {
                RuntimeError::Runtime(format!("a gradient part of {} before the step", part.key))
            })?,
            mask,
            values: host.data,
        })
    }

    /// `w` on `device`, keyed by this process's id of its micro-batch (its values move to
    /// the host tensor uncopied).
    async fn off_wire(
        &self,
        backend: &Arc<dyn ComputeBackend>,
        w: WirePart,
        device: usize,
    ) -> Result<GradPart, RuntimeError> {
        let mask: Vec<i64> = w.mask.iter().map(|&m| i64::from(m)).collect();
        let mask = ParamMask::from_words(&mask)?;
        let host = HostTensor {
            shape: vec![1, 1, w.values.len()],
            data: w.values,
        };
        let backend = backend.clone();
        let flat = tokio::task::spawn_blocking(move || backend.from_host(device, &host))
            .await
            .map_err(|e| RuntimeError::Runtime(format!("copying gradients to a device: {e}")))??;
        Ok(GradPart {
            stream: GradStream(w.stream),
            key: MicroBatchId(self.base + w.index),
            flat,
            mask,
        })
    }

    /// Rank 0: every other rank's parts of the stage, in rank order, into `root`.
    pub(super) async fn gather(
        &self,
        who: &str,
        backend: &Arc<dyn ComputeBackend>,
        root: &StageCopy,
    ) -> Result<(), RuntimeError> {
        let peers = &self.link.peers;
        for k in 1..peers.size() {
            loop {
                let p = peers
                    .recv(k, Kind::Grads(self.stage))
                    .await
                    .map_err(broken)?;
                check_step(self, p.step, k)?;
                match p.body {
                    Body::Part(w) => {
                        let part = self.off_wire(backend, w, root.device).await?;
                        root.stage.grads(who, GradOp::In(part)).await?;
                    }
                    Body::PartsEnd => break,
                    b => return Err(unexpected(&b, k)),
                }
            }
        }
        Ok(())
    }

    /// Rank 0: a sum of the stage to every other rank.
    pub(super) async fn broadcast(
        &self,
        backend: &Arc<dyn ComputeBackend>,
        sum: GradPart,
    ) -> Result<(), RuntimeError> {
        let w = self.onto_wire(backend, sum).await?;
        for k in 1..self.link.size() {
            let body = Body::Part(w.clone());
            self.link
                .peers
                .send(k, self.step, self.stage, body)
                .map_err(broken)?;
        }
        Ok(())
    }

    /// Rank 0: the stage's sums are all sent.
    pub(super) fn end_broadcast(&self) -> Result<(), RuntimeError> {
        for k in 1..self.link.size() {
            let body = Body::PartsEnd;
            self.link
                .peers
                .send(k, self.step, self.stage, body)
                .map_err(broken)?;
        }
        Ok(())
    }

    /// Rank > 0: hands the stage's gradients of every local replica (in replica order) to
    /// rank 0, then puts each sum it sends back into every local replica.
    pub(super) async fn send_stage(
        &self,
        who: &str,
        backend: &Arc<dyn ComputeBackend>,
        copies: &[StageCopy],
    ) -> Result<(), RuntimeError> {
        let peers = &self.link.peers;
        for c in copies {
            while let Some(part) = c.stage.grads(who, GradOp::Out { keep: false }).await? {
                let w = self.onto_wire(backend, part).await?;
                peers
                    .send(0, self.step, self.stage, Body::Part(w))
                    .map_err(broken)?;
            }
        }
        peers
            .send(0, self.step, self.stage, Body::PartsEnd)
            .map_err(broken)?;
        loop {
            let p = peers
                .recv(0, Kind::Grads(self.stage))
                .await
                .map_err(broken)?;
            check_step(self, p.step, 0)?;
            match p.body {
                Body::Part(w) => {
                    // A copy for each local replica but the last, which takes the part itself.
                    let mut w = Some(w);
                    for (i, c) in copies.iter().enumerate() {
                        let mine = match i + 1 == copies.len() {
                            true => w.take(),
                            false => w.clone(),
                        };
                        let mine = mine.expect("the part is taken by the last replica only");
                        let part = self.off_wire(backend, mine, c.device).await?;
                        c.stage.grads(who, GradOp::In(part)).await?;
                    }
                }
                Body::PartsEnd => return Ok(()),
                b => return Err(unexpected(&b, 0)),
            }
        }
    }
}

fn unexpected(b: &Body, from: usize) -> RuntimeError {
    RuntimeError::Broken(format!(
        "rank {from} sent {} during a gradient reduction",
        match b {
            Body::Part(_) => "a part".to_string(),
            b => format!("{b:?}"),
        }
    ))
}

/// One micro-batch's loss and ponder statistics, by index within the step.
pub(super) type Outcome = Option<(f64, Ponder)>;

/// Every rank's micro-batch results of `step` for every rank: each sends its own to rank 0,
/// which answers with the whole step's. `mine[i]` is set for this rank's micro-batches.
pub(super) async fn exchange_results(
    link: &WorldLink,
    step: u64,
    mine: &[Outcome],
) -> Result<Vec<Outcome>, RuntimeError> {
    let peers = &link.peers;
    let pack = |all: &[Outcome]| -> Vec<MicroResult> {
        all.iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.map(|(ce, p)| MicroResult {
                    index: i as u64,
                    ce,
                    ponder_sum: p.sum,
                    ponder_min: p.min,
                    ponder_max: p.max,
                })
            })
            .collect()
    };
    let unpack = |into: &mut Vec<Outcome>, micro: Vec<MicroResult>, from: usize| {
        for m in micro {
            let slot = into.get_mut(m.index as usize).ok_or_else(|| {
                RuntimeError::Broken(format!(
                    "rank {from} reported micro-batch {} of a step of {}",
                    m.index,
                    mine.len()
                ))
            })?;
            *slot = Some((
                m.ce,
                Ponder {
                    sum: m.ponder_sum,
                    min: m.ponder_min,
                    max: m.ponder_max,
                },
            ));
        }
        Ok::<_, RuntimeError>(())
    };
    let recv = |from: usize| async move {
        let p = peers.recv(from, Kind::Results).await.map_err(broken)?;
        match p.body {
            Body::Results {
                failed: None,
                micro,
            } if p.step == step => Ok(micro),
            Body::Results {
                failed: Some(why), ..
            } => Err(RuntimeError::Broken(format!("rank {from}: {why}"))),
            b => Err(RuntimeError::Broken(format!(
                "rank {from} sent {b:?} of step {} for the results of step {step}",
                p.step
            ))),
        }
    };
    let mut all = mine.to_vec();
    if link.rank() == 0 {
        for k in 1..link.size() {
            let micro = recv(k).await?;
            unpack(&mut all, micro, k)?;
        }
        let packed = pack(&all);
        for k in 1..link.size() {
            let body = Body::Results {
                failed: None,
                micro: packed.clone(),
            };
            peers.send(k, step, 0, body).map_err(broken)?;
        }
    } else {
        let body = Body::Results {
            failed: None,
            micro: pack(mine),
        };
        peers.send(0, step, 0, body).map_err(broken)?;
        let micro = recv(0).await?;
        unpack(&mut all, micro, 0)?;
    }
    Ok(all)
}
