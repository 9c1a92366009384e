//! Starting a [`Pipeline`]: the runtime, every data-parallel replica's workers, the topology
//! (fault plan, gradient reduction, collectives), then the actors — edge and layers of every
//! replica, the data actor, the supervisor linked to all of them — and the decoding batcher.

use super::Pipeline;
use crate::batcher::{BatchStats, BatcherActor, BatcherArgs, Batching};
use crate::decoder::AsyncDecoder;
use crate::heal::HealthCell;
use nsactor_data::Sampler;
use nsactor_engine::config::TrainConfig;
use nsactor_engine::engine::StagedModel;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::data::{DataActor, DataMsg};
use nsactor_pipeline::keep::KeepLayers;
use nsactor_pipeline::plan::PipelinePlan;
use nsactor_pipeline::supervisor::{SupArgs, SupMsg, Supervisor};
use nsactor_pipeline::topology::{self, Children, children_cells};
use nsactor_pipeline::worker::Worker;
use nsactor_pipeline::{trace, worker};
use nsactor_plugin_api::{IdAllocator, Stage};
use ractor::{Actor, ActorRef};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Distinguishes the actor names of pipelines living in one process (ractor names are global).
static PIPELINES: AtomicU64 = AtomicU64::new(0);

impl Pipeline {
    /// [`Pipeline::start`] as one rank of a world of processes: `train.data_parallel`
    /// replicas here, reduced with the other ranks' ([`nsactor_pipeline::world`]).
    pub fn start_in(
        model: StagedModel,
        plan: PipelinePlan,
        train: TrainConfig,
        sampler: Option<Sampler>,
        world: Option<Arc<nsactor_pipeline::world::WorldLink>>,
    ) -> Result<Self, RuntimeError> {
        if plan.num_layers() != model.num_layers() {
            return Err(RuntimeError::Runtime(format!(
                "the plan places {} layers, the model has {}",
                plan.num_layers(),
                model.num_layers()
            )));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("nsactor-rt")
            .enable_all()
            .build()
            .map_err(|e| RuntimeError::Runtime(e.to_string()))?;
        let param_count = model.param_count();
        let mut train = train;
        train.schedule = train.schedule.resolve(&model.backend().info().name);
        let nsactor_engine::engine::StageParts {
            backend,
            spec,
            edge: edge_stage,
            layers: layer_stages,
        } = model.into_parts();
        // Frames per token: a pass's GEMM rows are its input tokens × K.
        let frames = spec.model.k.max(1);
        let spin = worker::idle_spin(&backend.info().name);
        let replicas = spawn_replicas(&plan, &train, spin)?;
        let workers = replicas[0].workers.clone();
        let replica_plans = replicas.iter().map(|r| r.plan.clone()).collect();
        let fault = train
            .inject_fault
            .as_deref()
            .map(|f| f.parse::<topology::Fault>())
            .transpose()?
            .map(|f| Arc::new(topology::FaultPlan::new(f)));
        let id = PIPELINES.fetch_add(1, Ordering::Relaxed);
        let dp_reduce = train.dp_reduce.resolve(&backend.info().name);
        let collectives = match &world {
            Some(w) => w.collectives(),
            None => {
                replicas.len() > 1
                    && !nsactor_pipeline::world::host_forced()?
                    && rt.block_on(nsactor_pipeline::world::collectives_available(&backend))
            }
        };
        let keep = KeepLayers::new(train.keep_activations.fixed().unwrap_or(0));
        let topo = topology::Topology {
            backend: backend.clone(),
            spec,
            replicas,
            hold_grads: dp_reduce == nsactor_engine::schedule::DpReduce::Ordered,
            prefix: format!("pipeline{id}"),
            fault,
            keep: keep.clone(),
            world,
            collectives: collectives.then(Default::default),
        };
        let ids = Arc::new(IdAllocator::new());
        let (sup, children, data) = rt.block_on(
            Spawn {
                topo,
                edge_stage,
                layer_stages,
                sampler,
                train,
                ids: ids.clone(),
                id,
                param_count,
            }
            .actors(),
        )?;
        trace::init();
        let batching = Batching {
            max_in_flight: plan.num_stages(),
            max_tokens: (crate::batching::PREFILL_PASS_FRAME_ROWS / frames).max(1),
            ..Batching::default()
        };
        // While other sessions decode, a prompt goes in smaller chunks.
        let chunk = (crate::batching::CHUNK_FRAME_ROWS / frames).max(1);
        let sessions = start_sessions(&rt, &children, &sup, ids, (batching, chunk), id)?;
        Ok(Pipeline {
            rt,
            sup,
            children,
            data,
            workers,
            plan,
            replica_plans,
            backend,
            param_count,
            sessions,
            keep,
        })
    }
}

/// Every data-parallel replica's placement and workers (the edge's, then one per pipeline
/// stage), replica 0 first.
fn spawn_replicas(
    plan: &PipelinePlan,
    train: &TrainConfig,
    spin: std::time::Duration,
) -> Result<Vec<topology::Replica>, RuntimeError> {
    let spawn = |name: String| {
        Worker::spawn_spinning(name, spin)
            .map(Arc::new)
            .map_err(|e| RuntimeError::Runtime(format!("worker thread: {e}")))
    };
    // Replica r ≥ 1 runs on its own block of devices (`[train] devices`), with its own
    // workers; replica 0 is `plan`.
    let plans = match train.data_parallel {
        1 => vec![plan.clone()],
        d => PipelinePlan::replicas(
            plan.num_layers(),
            plan.num_stages(),
            d,
            &train.devices.clone().unwrap_or_else(|| vec![0]),
        )?,
    };
    if plans[0] != *plan {
        return Err(RuntimeError::Runtime(format!(
            "replica 0 is placed {}, `[train] devices` puts it at {}",
            plan.describe(),
            plans[0].describe()
        )));
    }
    let mut replicas = Vec::with_capacity(plans.len());
    for (r, plan) in plans.into_iter().enumerate() {
        let tag = if r == 0 {
            String::new()
        } else {
            format!("r{r}-")
        };
        let mut workers = vec![spawn(format!("nsactor-{tag}edge"))?];
        for s in 0..plan.num_stages() {
            workers.push(spawn(format!("nsactor-{tag}stage{s}"))?);
        }
        replicas.push(topology::Replica { plan, workers });
    }
    Ok(replicas)
}

/// What the pipeline's actors are spawned from: the topology, replica 0's opened stages, the
/// data, the run's configuration, the pipeline's id allocator and its number in the process.
struct Spawn {
    topo: topology::Topology,
    edge_stage: Box<dyn Stage>,
    layer_stages: Vec<Box<dyn Stage>>,
    sampler: Option<Sampler>,
    train: TrainConfig,
    ids: Arc<IdAllocator>,
    id: u64,
    param_count: u64,
}

/// The supervisor, the current edge and layer actors (shared with it), and the data actor.
type Actors = (
    ActorRef<SupMsg>,
    Arc<RwLock<Children>>,
    Option<ActorRef<DataMsg>>,
);

impl Spawn {
    /// Spawns every replica's edge and layer actors, the data actor and the supervisor, and
    /// links every child to the supervisor.
    async fn actors(self) -> Result<Actors, RuntimeError> {
        let Spawn {
            topo,
            edge_stage,
            layer_stages,
            sampler,
            train,
            ids,
            id,
            param_count,
        } = self;
        let rt_err = |e: ractor::SpawnErr| RuntimeError::Runtime(e.to_string());
        let children = topo.spawn(0, edge_stage, layer_stages, 0).await?;
        let mut others = Vec::new();
        for r in 1..topo.replicas.len() {
            // As replica 0 was opened: seeded, or waiting for the weights loaded next.
            let (edge, layers) = topo.open_fresh(r, topo.spec.weights).await?;
            others.push(topo.spawn(r, edge, layers, 0).await?);
        }
        let data = match sampler {
            Some(sampler) => Some(
                Actor::spawn(Some(format!("pipeline{id}/data")), DataActor, sampler)
                    .await
                    .map_err(rt_err)?
                    .0,
            ),
            None => None,
        };
        let shared = Arc::new(RwLock::new(children.clone()));
        let (sup, _) = Actor::spawn(
            Some(format!("pipeline{id}/supervisor")),
            Supervisor,
            SupArgs {
                topo,
                children: shared.clone(),
                others: others.clone(),
                data: data.clone(),
                train,
                ids,
                param_count,
            },
        )
        .await
        .map_err(rt_err)?;
        // The supervisor hears of every child's failure.
        let cells = children_cells(&children)
            .chain(others.iter().flat_map(children_cells))
            .chain(data.iter().map(|d| d.get_cell()));
        for c in cells {
            c.link(sup.get_cell());
        }
        Ok((sup, shared, data))
    }
}

/// The decoding batcher over `children`, and the sessions' decoder on it.
fn start_sessions(
    rt: &tokio::runtime::Runtime,
    children: &Arc<RwLock<Children>>,
    sup: &ActorRef<SupMsg>,
    ids: Arc<IdAllocator>,
    (batching, chunk_tokens): (Batching, usize),
    id: u64,
) -> Result<AsyncDecoder, RuntimeError> {
    let stats = Arc::new(BatchStats::default());
    stats.pacer.set_max(chunk_tokens);
    stats.pacer.cap(batching.max_tokens);
    let health = Arc::new(HealthCell::default());
    let batcher = rt
        .block_on(Actor::spawn(
            Some(format!("pipeline{id}/batcher")),
            BatcherActor,
            BatcherArgs {
                children: children.clone(),
                batching: batching.clone(),
                stats: stats.clone(),
                sup: sup.clone(),
                health: health.clone(),
            },
        ))
        .map_err(|e| RuntimeError::Runtime(e.to_string()))?
        .0;
    Ok(AsyncDecoder {
        children: children.clone(),
        batcher,
        stats,
        health,
        ids,
        vocab: 0,
        max_tokens: batching.max_tokens,
        given_up: Default::default(),
    })
}
