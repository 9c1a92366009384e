//! Building the actor graph: opening stages on their workers, spawning the edge and layer
//! actors and wiring the chain. The supervisor keeps a [`Topology`] so it can rebuild the graph
//! after a failure; [`Fault`] injects failures to prove that it does.

use super::edge::{EdgeActor, EdgeArgs};
use super::holder::StageHolder;
use super::layer::{LayerActor, LayerArgs};
use super::msg::{EdgeMsg, GradOp, Hop, LayerMsg};
use super::plan::PipelinePlan;
use super::worker::{Priority, Worker};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{
    ComputeBackend, EngineError, InitialWeights, Reply, Stage, StageCall, StageKind, StageSnapshot,
    StageSpec,
};
use ractor::{Actor, ActorCell, ActorRef};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The current edge and layer actors (replaced wholesale by a recovery).
#[derive(Clone)]
pub struct Children {
    pub edge: ActorRef<EdgeMsg>,
    pub layers: Vec<ActorRef<LayerMsg>>,
}

pub use nsactor_engine::fault::Fault;

/// A fault and whether it has fired; the supervisor publishes the step being run.
#[derive(Debug)]
pub struct FaultPlan {
    pub fault: Fault,
    step_now: AtomicU64,
    fired: AtomicBool,
    /// Decoding passes of the faulty layer so far.
    passes: AtomicU64,
}

impl FaultPlan {
    pub fn new(fault: Fault) -> Self {
        FaultPlan {
            fault,
            step_now: AtomicU64::new(0),
            fired: AtomicBool::new(false),
            passes: AtomicU64::new(0),
        }
    }

    pub fn set_step(&self, step: u64) {
        self.step_now.store(step, Ordering::SeqCst);
    }

    /// True once, when `fault` matches the step now running.
    fn fire(&self, f: Fault) -> bool {
        self.fault == f && !self.fired.swap(true, Ordering::SeqCst)
    }

    fn layer_panics(&self, layer: usize) -> bool {
        let step = self.step_now.load(Ordering::SeqCst);
        self.fire(Fault::LayerPanic { layer, step })
    }

    /// Counts a decoding pass of `layer`: whether it panics.
    fn session_panics(&self, layer: usize) -> bool {
        match self.fault {
            Fault::SessionPanic { layer: l, .. } if l == layer => {
                let pass = self.passes.fetch_add(1, Ordering::SeqCst) + 1;
                self.fire(Fault::SessionPanic { layer, pass })
            }
            _ => false,
        }
    }

    /// Whether to crash while checkpointing `step`.
    pub fn crash_in_checkpoint(&self, step: u64) -> bool {
        self.fire(Fault::CrashInCheckpoint { step })
    }

    /// Whether writing the checkpoint of `step` fails as on a full disk.
    pub fn disk_full_in_checkpoint(&self, step: u64) -> bool {
        self.fire(Fault::DiskFullInCheckpoint { step })
    }

    /// Whether the step now running gets NaN gradients.
    pub fn nan_grad_now(&self) -> bool {
        let step = self.step_now.load(Ordering::SeqCst);
        self.fire(Fault::NanGrad { step })
    }

    /// Whether the process of world rank `rank` dies now (during the step now running).
    pub fn kill_rank_now(&self, rank: usize) -> bool {
        let step = self.step_now.load(Ordering::SeqCst);
        self.fire(Fault::KillRank { rank, step })
    }

    /// Whether the step now running measures a spiked loss.
    pub fn loss_spike_now(&self) -> bool {
        let step = self.step_now.load(Ordering::SeqCst);
        self.fire(Fault::LossSpike { step })
    }
}

/// A stage that panics in a forward pass when its fault fires.
struct FaultyStage {
    inner: Box<dyn Stage>,
    layer: usize,
    plan: Arc<FaultPlan>,
}

impl Stage for FaultyStage {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        if matches!(call, StageCall::Forward { .. }) && self.plan.layer_panics(self.layer) {
            panic!("injected fault: layer {} panics", self.layer);
        }
        if matches!(call, StageCall::SessionForward { .. }) && self.plan.session_panics(self.layer)
        {
            panic!("injected fault: layer {} panics while decoding", self.layer);
        }
        self.inner.call(call)
    }
    fn save(&self) -> Result<Vec<u8>, EngineError> {
        self.inner.save()
    }
    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        self.inner.snapshot()
    }
    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        self.inner.load(bytes)
    }
    fn param_count(&self) -> u64 {
        self.inner.param_count()
    }
}

/// One data-parallel replica of the pipeline: its placement and its workers.
pub struct Replica {
    pub plan: PipelinePlan,
    /// The edge's worker, then one per pipeline stage.
    pub workers: Vec<Arc<Worker>>,
}

/// Everything needed to (re)build the actor graph.
pub struct Topology {
    pub backend: Arc<dyn ComputeBackend>,
    /// The edge's spec; layers differ in kind and device.
    pub spec: StageSpec,
    /// The data-parallel replicas (one without data parallelism); replica 0 also decodes.
    pub replicas: Vec<Replica>,
    /// Replicas after the first keep each micro-batch's gradients apart
    /// ([`DpReduce::Ordered`](nsactor_engine::schedule::DpReduce::Ordered)).
    pub hold_grads: bool,
    /// Actor-name prefix unique to this pipeline.
    pub prefix: String,
    pub fault: Option<Arc<FaultPlan>>,
    /// Layers per stage, counted from its last, whose training forwards keep their autodiff
    /// graph (`[train] keep_activations`; the supervisor may change it between steps).
    pub keep: super::keep::KeepLayers,
    /// The other processes of the run, when it has several ([`super::world`]).
    pub world: Option<Arc<super::world::WorldLink>>,
    /// Stage reductions go through the backend's collectives ([`super::collective`]): with a
    /// world when it negotiated them, alone with several replicas where the backend has them.
    pub collectives: Option<Arc<super::collective::Collectives>>,
}

/// Logs where the opening of a model's stages went (`what` names them): the first layer pays
/// the device's first allocations and kernel compiles, the others their own parameters.
pub fn log_open_times(what: &str, weights: InitialWeights, edge: f64, layers: &[f64]) {
    if let Some((first, rest)) = layers.split_first() {
        tracing::info!(
            "{what} opened ({weights:?}): edge {edge:.3} s, layer 0 {first:.3} s, the other {} \
             layers {:.3} s each on average",
            rest.len(),
            rest.iter().sum::<f64>() / rest.len().max(1) as f64
        );
    }
}

fn rt(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Runtime(e.to_string())
}

impl Topology {
    /// Replica `r`'s number among the world's replicas (numbered rank by rank).
    pub fn global_replica(&self, r: usize) -> usize {
        self.world
            .as_ref()
            .map_or(0, |w| w.rank() * self.replicas.len())
            + r
    }

    /// Replica `r`'s freshly opened stages, each on its own worker: the step-0 state (the same
    /// in every replica) with [`InitialWeights::Seeded`], or stages that draw nothing and wait
    /// for weights to be loaded with [`InitialWeights::Loaded`].
    pub async fn open_fresh(
        &self,
        r: usize,
        weights: InitialWeights,
    ) -> Result<(Box<dyn Stage>, Vec<Box<dyn Stage>>), RuntimeError> {
        let Replica { plan, workers } = &self.replicas[r];
        let open = |kind: StageKind, device: usize, worker: &Arc<Worker>| {
            let backend = self.backend.clone();
            let spec = StageSpec {
                kind,
                device,
                weights,
                ..self.spec.clone()
            };
            worker.run(Priority::Control, move || {
                let t = std::time::Instant::now();
                backend.open_stage(&spec).map(|s| (s, t.elapsed()))
            })
        };
        let edge = open(StageKind::Edge, plan.edge_device(), &workers[0]);
        let devices = plan.layer_devices();
        let layers: Vec<_> = (0..plan.num_layers())
            .map(|i| {
                open(
                    StageKind::Layer(i),
                    devices[i],
                    &workers[1 + plan.stage_of(i)],
                )
            })
            .collect();
        let (edge, edge_took) = edge.await.map_err(|p| rt(p.0))??;
        let mut out = Vec::with_capacity(layers.len());
        let mut took = Vec::with_capacity(layers.len());
        for l in layers {
            let (stage, t) = l.await.map_err(|p| rt(p.0))??;
            out.push(stage);
            took.push(t.as_secs_f64());
        }
        log_open_times(
            &format!("replica {r}'s stages"),
            weights,
            edge_took.as_secs_f64(),
            &took,
        );
        Ok((edge, out))
    }

    /// Spawns and wires replica `r`'s edge and layer actors over the given stages;
    /// `generation` keeps the names of rebuilt actors apart from their predecessors'.
    pub async fn spawn(
        &self,
        r: usize,
        edge_stage: Box<dyn Stage>,
        layer_stages: Vec<Box<dyn Stage>>,
        generation: u64,
    ) -> Result<Children, RuntimeError> {
        let Replica { plan, workers } = &self.replicas[r];
        let name = |n: &str| {
            let replica = if r == 0 {
                String::new()
            } else {
                format!("r{r}/")
            };
            if generation == 0 {
                format!("{}/{replica}{n}", self.prefix)
            } else {
                format!("{}/{replica}{n}.{generation}", self.prefix)
            }
        };
        let devices = plan.layer_devices();
        let edge_device = plan.edge_device();
        let stage_of = |i| plan.stage_of(i);
        let (edge, _) = Actor::spawn(
            Some(name("edge")),
            EdgeActor,
            EdgeArgs {
                num_layers: layer_stages.len(),
                stage: StageHolder::new(
                    "edge",
                    edge_stage,
                    workers[0].clone(),
                    self.backend.clone(),
                    edge_device,
                )
                .with_neighbours(
                    (*devices.last().expect("a pipeline has layers"), false),
                    (devices[0], false),
                ),
            },
        )
        .await
        .map_err(rt)?;
        let mut layers = Vec::with_capacity(layer_stages.len());
        for (i, stage) in layer_stages.into_iter().enumerate() {
            let stage = match &self.fault {
                Some(plan)
                    if r == 0
                        && matches!(plan.fault, Fault::LayerPanic { layer, .. }
                            | Fault::SessionPanic { layer, .. } if layer == i) =>
                {
                    Box::new(FaultyStage {
                        inner: stage,
                        layer: i,
                        plan: plan.clone(),
                    })
                }
                _ => stage,
            };
            let (l, _) = Actor::spawn(
                Some(name(&format!("layer-{i}"))),
                LayerActor,
                LayerArgs {
                    index: i,
                    from_end: plan.stages[stage_of(i)].layers.end - i,
                    keep: self.keep.clone(),
                    stage: StageHolder::new(
                        format!("layer {i}"),
                        stage,
                        workers[1 + stage_of(i)].clone(),
                        self.backend.clone(),
                        devices[i],
                    )
                    .with_neighbours(
                        match i {
                            0 => (edge_device, false),
                            _ => (devices[i - 1], stage_of(i - 1) == stage_of(i)),
                        },
                        match devices.get(i + 1) {
                            Some(&d) => (d, stage_of(i + 1) == stage_of(i)),
                            None => (edge_device, false),
                        },
                    ),
                },
            )
            .await
            .map_err(rt)?;
            layers.push(l);
        }
        // Wire the chain: edge → 0 → … → L−1 → edge.
        let n = layers.len();
        let stopped = |_| rt("an actor stopped while starting");
        for (i, l) in layers.iter().enumerate() {
            let prev = if i == 0 {
                Hop::Edge(edge.clone())
            } else {
                Hop::Layer(layers[i - 1].clone())
            };
            let next = if i + 1 == n {
                Hop::Edge(edge.clone())
            } else {
                Hop::Layer(layers[i + 1].clone())
            };
            l.cast(LayerMsg::Wire { prev, next }).map_err(stopped)?;
        }
        edge.cast(EdgeMsg::Wire {
            first: Hop::Layer(layers[0].clone()),
            last: Hop::Layer(layers[n - 1].clone()),
        })
        .map_err(|_| rt("the edge stopped while starting"))?;
        let children = Children { edge, layers };
        if self.global_replica(r) > 0 && self.hold_grads {
            for (i, stage) in Hop::all(&children.edge, &children.layers)
                .iter()
                .enumerate()
            {
                stage
                    .grads(&format!("replica {r} stage {i}"), GradOp::Hold(true))
                    .await?;
            }
        }
        Ok(children)
    }
}

/// Every actor cell of `c`: the edge, then the layers.
pub fn children_cells(c: &Children) -> impl Iterator<Item = ActorCell> + '_ {
    std::iter::once(c.edge.get_cell()).chain(c.layers.iter().map(|l| l.get_cell()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_fire_once() {
        let f: Fault = "layer-panic:3:7".parse().unwrap();
        assert_eq!(f, Fault::LayerPanic { layer: 3, step: 7 });
        assert_eq!(
            "crash-in-checkpoint:4".parse::<Fault>().unwrap(),
            Fault::CrashInCheckpoint { step: 4 }
        );
        let sf: Fault = "session-panic:1:3".parse().unwrap();
        assert_eq!(sf, Fault::SessionPanic { layer: 1, pass: 3 });
        let plan = FaultPlan::new(sf);
        let fired: Vec<bool> = (0..5).map(|_| plan.session_panics(1)).collect();
        assert_eq!(
            fired,
            [false, false, true, false, false],
            "the third pass, once"
        );
        assert!(!plan.session_panics(0), "another layer never");
        assert!(
            "layer-panic:x:1"
                .parse::<Fault>()
                .unwrap_err()
                .to_string()
                .contains("`x`")
        );
        assert!(
            "explode"
                .parse::<Fault>()
                .unwrap_err()
                .to_string()
                .contains("expected")
        );
        let plan = FaultPlan::new(f);
        plan.set_step(6);
        assert!(!plan.layer_panics(3));
        plan.set_step(7);
        assert!(!plan.layer_panics(2));
        assert!(plan.layer_panics(3));
        assert!(!plan.layer_panics(3), "fires once");
    }
}
