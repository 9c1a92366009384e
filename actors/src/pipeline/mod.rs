//! The actor runtime: the model's stages as ractor actors in a pipeline, driven by a
//! supervisor (DESIGN.md, "Actors").
//!
//! ```text
//! Supervisor ─┬─ DataActor   (sampler; prefetches the next step's micro-batches)
//!             ├─ EdgeActor   (embedding + head + loss; owns the tied matrix)
//!             └─ LayerActor 0..L-1, grouped into P pipeline stages
//! BatcherActor    (decoding: batches concurrent sessions into cohorts through the same actors)
//! ```
//!
//! Compute runs only on [`worker`] threads (one per pipeline stage, one for the edge); actors
//! hand their stage to the worker with the job and get it back with the result, so a layer's
//! parameters, optimizer state and neuron states stay owned by its actor. A micro-batch flows
//! edge → layer 0 → … → layer L−1 → edge (loss) → layer L−1 → … → layer 0 → edge, each hop a
//! message. The supervisor admits at most P micro-batches at once, which bounds every mailbox
//! and every worker queue (at most P + 1 messages each), and keeps activation memory to
//! P kept inputs per layer.
//!
//! [`Pipeline`] is the synchronous handle the CLI and tests use.

pub mod batcher;
pub mod checkpoint;
pub mod data;
pub mod edge;
pub mod layer;
pub mod plan;
pub mod supervisor;
pub mod topology;
pub mod trace;
pub mod worker;

use crate::config::TrainConfig;
use crate::engine::{Decoder, StagedModel, StepParams, StepStats};
use batcher::{BatchStats, BatcherActor, BatcherArgs, BatcherMsg, Batching};
use data::{DataActor, DataMsg};
use edge::EdgeMsg;
use layer::LayerMsg;
use nsactor_data::{Cursor, Sampler};
use nsactor_plugin_api::{Batch, ComputeBackend, DeviceTensor, EngineError, Stage};
pub use plan::PipelinePlan;
use ractor::{Actor, ActorCell, ActorRef, RpcReplyPort};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
pub use supervisor::StepReport;
use supervisor::{SupArgs, SupMsg, Supervisor};
use topology::Children;
use worker::{JobPanicked, Priority, Worker};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error("{who}: {error}")]
    Stage { who: String, error: EngineError },
    #[error("data: {0}")]
    Data(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("the pipeline cannot continue: {0}")]
    Broken(String),
    #[error("actor runtime: {0}")]
    Runtime(String),
    /// The step failed, the supervisor rebuilt the actors and rolled the run back to the
    /// newest checkpoint (step `to_step`); the run continues from there.
    #[error("{cause}; recovered in {seconds:.2} s, continuing after step {to_step}")]
    Recovered {
        cause: String,
        to_step: u64,
        seconds: f64,
    },
}

impl From<PipelineError> for EngineError {
    /// The engine error inside, or the pipeline's reason as a backend error.
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::Engine(e) | PipelineError::Stage { error: e, .. } => e,
            other => EngineError::Backend(other.to_string()),
        }
    }
}

/// Ponder statistics accumulated over the layers a micro-batch has passed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ponder {
    /// Σ over layers of the layer's mean E[K].
    pub sum: f64,
    pub min: f64,
    pub max: f64,
}

impl Default for Ponder {
    fn default() -> Self {
        Ponder {
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }
}

impl Ponder {
    fn add(&mut self, mean: f64, min: f64, max: f64) {
        self.sum += mean;
        self.min = self.min.min(min);
        self.max = self.max.max(max);
    }
}

/// How a micro-batch ended.
pub enum Event {
    Done {
        micro: u64,
        ce: f64,
        ponder: Ponder,
    },
    Failed {
        who: String,
        micro: u64,
        error: EngineError,
    },
}

/// Travels with a micro-batch's messages: where its end is reported.
#[derive(Clone)]
pub struct StepCtx {
    events: tokio::sync::mpsc::Sender<Event>,
    /// `depth-first` schedule: workers order jobs by micro-batch within a class.
    depth_first: bool,
}

impl StepCtx {
    /// The worker priority of `class` work on `micro` under this step's schedule.
    fn key(&self, micro: u64) -> u64 {
        if self.depth_first { micro } else { 0 }
    }

    async fn send(&self, e: Event) {
        // The supervisor only stops listening once it has given up on the step.
        let _ = self.events.send(e).await;
    }
}

/// The neighbour an activation or gradient goes to.
#[derive(Clone)]
pub enum Hop {
    Layer(ActorRef<LayerMsg>),
    Edge(ActorRef<EdgeMsg>),
}

impl Hop {
    fn forward(&self, micro: u64, h: DeviceTensor, ponder: Ponder, ctx: StepCtx) {
        let sent = match self {
            Hop::Layer(a) => a
                .cast(LayerMsg::Forward {
                    micro,
                    h,
                    ponder,
                    ctx,
                })
                .is_ok(),
            Hop::Edge(a) => a
                .cast(EdgeMsg::Head {
                    micro,
                    h,
                    ponder,
                    ctx,
                })
                .is_ok(),
        };
        // A stopped neighbour is the supervisor's to notice; the micro-batch is lost with it.
        if !sent {
            tracing::warn!("micro-batch {micro}: the next actor has stopped");
        }
    }

    fn backward(&self, micro: u64, grad: DeviceTensor, ponder_grad: f64, ctx: StepCtx) {
        let sent = match self {
            Hop::Layer(a) => a
                .cast(LayerMsg::Backward {
                    micro,
                    grad,
                    ponder_grad,
                    ctx,
                })
                .is_ok(),
            Hop::Edge(a) => a.cast(EdgeMsg::EmbedBackward { micro, grad, ctx }).is_ok(),
        };
        if !sent {
            tracing::warn!("micro-batch {micro}: the previous actor has stopped");
        }
    }
}

/// An actor's stage and where it runs: the stage is locked by its worker's jobs, one at a time.
/// After a panic inside a job the stage is gone and every later call fails, naming that panic,
/// until the actor is rebuilt.
#[derive(Clone)]
pub struct StageHolder {
    who: String,
    /// Locked only by the worker's jobs, one at a time; `Err` holds the message of the panic
    /// that lost the stage.
    stage: Arc<std::sync::Mutex<Result<Box<dyn Stage>, String>>>,
    worker: Arc<Worker>,
    backend: Arc<dyn ComputeBackend>,
    device: usize,
    /// Devices of the stages it hands tensors to: `[backward, forward]` (gradients go back to
    /// the previous hop, activations forward to the next).
    neighbours: [usize; 2],
    /// Whether those neighbours run on this stage's worker (layers of one pipeline stage).
    same_worker: [bool; 2],
}

impl StageHolder {
    pub fn new(
        who: impl Into<String>,
        stage: Box<dyn Stage>,
        worker: Arc<Worker>,
        backend: Arc<dyn ComputeBackend>,
        device: usize,
    ) -> Self {
        StageHolder {
            who: who.into(),
            stage: Arc::new(std::sync::Mutex::new(Ok(stage))),
            worker,
            backend,
            device,
            neighbours: [device, device],
            same_worker: [false, false],
        }
    }

    /// Places the neighbours: `back` receives this stage's gradients, `forward` its activations
    /// (their devices, and whether they share this stage's worker).
    pub fn with_neighbours(mut self, back: (usize, bool), forward: (usize, bool)) -> Self {
        self.neighbours = [back.0, forward.0];
        self.same_worker = [back.1, forward.1];
        self
    }

    /// Queues a training job of `micro` whose output tensor goes on in direction `forward`
    /// (activations to the next hop, gradients back to the previous one). The job runs at the
    /// schedule's priority; under depth-first it names its successor when the receiving layer
    /// shares this worker ([`Worker::run_then`]); and when the receiver is on another device it
    /// returns only once the tensor is computed ([`ComputeBackend::ready`]), so the receiver,
    /// whose device runs its queue in order, never enqueues work that would idle it until ours
    /// finishes (on one device the queue orders it).
    fn train_job<X: Send + 'static>(
        &self,
        forward: bool,
        micro: u64,
        ctx: &StepCtx,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<(DeviceTensor, X), EngineError>
        + Send
        + 'static,
    ) -> impl Future<Output = Result<(DeviceTensor, X), EngineError>> + Send + 'static {
        let key = ctx.key(micro);
        let priority = if forward {
            Priority::Forward(key)
        } else {
            Priority::Backward(key)
        };
        let side = usize::from(forward);
        let successor = (ctx.depth_first && self.same_worker[side]).then_some(priority);
        let ready = (self.neighbours[side] != self.device).then(|| self.backend.clone());
        self.submit(priority, successor, h, move |st, h| {
            let (t, x) = f(st, h)?;
            if let Some(backend) = &ready {
                backend.ready(&t)?;
            }
            Ok((t, x))
        })
    }

    pub fn backend(&self) -> &Arc<dyn ComputeBackend> {
        &self.backend
    }

    /// Runs `f` on the stage, on the calling thread (the worker's, inside a job), after moving
    /// `h` (if any) to the stage's device. A panic is caught here, under the lock, and kept in
    /// the slot, so that the jobs queued behind it report what lost the stage (they may reach
    /// the supervisor before the panic itself does); then it goes on to the worker, which
    /// reports it as the job's panic.
    fn run<R>(
        &self,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut slot = self
            .stage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let st = match &mut *slot {
            Ok(st) => st,
            Err(cause) => {
                return Err(EngineError::Panic(format!(
                    "{} lost its state in an earlier panic ({cause}); restart it from a checkpoint",
                    self.who
                )));
            }
        };
        let run = catch_unwind(AssertUnwindSafe(|| {
            let h = h
                .map(|h| {
                    let t = std::time::Instant::now();
                    let r = self.backend.to_device(h, self.device);
                    worker::add_transfer(t.elapsed());
                    r
                })
                .transpose()?;
            f(&mut **st, h)
        }));
        match run {
            Ok(r) => r,
            Err(p) => {
                *slot = Err(worker::panic_message(&*p));
                drop(slot);
                resume_unwind(p)
            }
        }
    }

    /// Runs `f` on the stage, on the worker, after moving `h` (if any) to the stage's device.
    async fn compute<R: Send + 'static>(
        &mut self,
        priority: Priority,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError> + Send + 'static,
    ) -> Result<R, EngineError> {
        self.submit(priority, None, h, f).await
    }

    /// Queues `f` on the worker now and returns its result as a future that does not borrow
    /// the holder, naming the job's `successor` on this worker ([`Worker::run_then`]). Training
    /// messages are answered from a task awaiting it, so the actor takes its next message at
    /// once: an actor that awaited a queued forward could not even queue the backward of an
    /// older micro-batch behind it, and that backward would wait for the forward whatever the
    /// priorities say. Jobs of one stage run in the order the worker picks; a job that panics
    /// loses the stage, and every later job reports that.
    fn submit<R: Send + 'static>(
        &self,
        priority: Priority,
        successor: Option<Priority>,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError> + Send + 'static,
    ) -> impl Future<Output = Result<R, EngineError>> + Send + 'static {
        let holder = self.clone();
        let job = self
            .worker
            .run_then(priority, successor, move || holder.run(h, f));
        let who = self.who.clone();
        async move {
            match job.await {
                Ok(r) => r,
                Err(JobPanicked(m)) => Err(EngineError::Panic(format!("{who}: {m}"))),
            }
        }
    }
}

/// `h` through `layers` for decoding `sessions` (batch rows split evenly among them, in order).
/// Each layer actor lends its stage ([`LayerMsg::Share`], all asked at once), and the layers
/// that share a worker (one pipeline stage's) run as one job there, one after another: a
/// decoding pass makes one round trip per worker instead of two thread hops per layer, which
/// at one token per pass took longer than the layers' own work. The layers' states stay in
/// their stages; an error names the layer it came from.
pub(crate) async fn session_layers(
    layers: &[ActorRef<LayerMsg>],
    sessions: &[u64],
    h: DeviceTensor,
) -> Result<DeviceTensor, PipelineError> {
    let holders = share_layers(layers).await?;
    run_layers(&holders, sessions, h).await
}

/// Every layer actor's stage handle, asked all at once (the first half of
/// [`session_layers`], which a cohort overlaps with its embedding).
pub(crate) async fn share_layers(
    layers: &[ActorRef<LayerMsg>],
) -> Result<Vec<StageHolder>, PipelineError> {
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
pub(crate) async fn run_layers(
    holders: &[StageHolder],
    sessions: &[u64],
    mut h: DeviceTensor,
) -> Result<DeviceTensor, PipelineError> {
    let mut start = 0;
    while start < holders.len() {
        let worker = &holders[start].worker;
        let end = (start..holders.len())
            .find(|&j| !Arc::ptr_eq(&holders[j].worker, worker))
            .unwrap_or(holders.len());
        let group = holders[start..end].to_vec();
        let sessions = sessions.to_vec();
        let job = worker.run_then(Priority::FORWARD_UNTRAINED, None, move || {
            trace::mark(trace::Mark::LayersJob);
            let mut h = h;
            for holder in &group {
                h = holder
                    .run(Some(h), |st, h| {
                        st.call(nsactor_plugin_api::StageCall::SessionForward {
                            sessions: &sessions,
                            h: h.expect("moved"),
                        })?
                        .into_tensor("SessionForward")
                    })
                    .map_err(|error| PipelineError::Stage {
                        who: holder.who.clone(),
                        error,
                    })?;
            }
            trace::mark(trace::Mark::LayersQueued);
            if trace::syncing()
                && let Some(last) = group.last()
            {
                last.backend
                    .ready(&h)
                    .map_err(|error| PipelineError::Stage {
                        who: last.who.clone(),
                        error,
                    })?;
                trace::mark(trace::Mark::LayersOnDevice);
            }
            Ok::<_, PipelineError>(h)
        });
        h = match job.await {
            Ok(r) => r?,
            Err(JobPanicked(m)) => {
                return Err(PipelineError::Stage {
                    who: format!("layers {start}..{end}"),
                    error: EngineError::Panic(m),
                });
            }
        };
        start = end;
    }
    Ok(h)
}

/// Calls `actor` and unwraps both the messaging and the engine result.
pub(crate) async fn ask<M: ractor::Message, T: Send + 'static>(
    actor: &ActorRef<M>,
    who: impl Into<String>,
    build: impl FnOnce(RpcReplyPort<Result<T, EngineError>>) -> M,
) -> Result<T, PipelineError> {
    match actor.call(build, None).await {
        Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(|error| PipelineError::Stage {
            who: who.into(),
            error,
        }),
        _ => Err(PipelineError::Broken(format!("{} stopped", who.into()))),
    }
}

/// Every actor cell of `c`: the edge, then the layers.
pub(crate) fn children_cells(c: &Children) -> impl Iterator<Item = ActorCell> + '_ {
    std::iter::once(c.edge.get_cell()).chain(c.layers.iter().map(|l| l.get_cell()))
}

/// Distinguishes the actor names of pipelines living in one process (ractor names are global).
static PIPELINES: AtomicU64 = AtomicU64::new(0);

/// A running actor pipeline: supervisor, data, edge and layer actors, and their workers.
pub struct Pipeline {
    rt: tokio::runtime::Runtime,
    sup: ActorRef<SupMsg>,
    /// The current edge and layer actors, shared with the supervisor, which replaces them
    /// when it recovers from a failure.
    children: Arc<RwLock<Children>>,
    data: Option<ActorRef<DataMsg>>,
    /// The edge's worker, then one per pipeline stage.
    workers: Vec<Arc<Worker>>,
    plan: PipelinePlan,
    backend: Arc<dyn ComputeBackend>,
    param_count: u64,
    /// Decoding sessions of `generate`/`eval_ce` (and, through [`decoder`](Self::decoder),
    /// of servers), sharing one session counter.
    sessions: AsyncDecoder,
}

impl Pipeline {
    /// Starts the actors over `model`'s stages, grouped and placed as `plan` says (open
    /// `model` with `plan.placement()`). `train` gives the LR schedule and step shape of
    /// [`step`](Self::step); `sampler` feeds it.
    pub fn start(
        model: StagedModel,
        plan: PipelinePlan,
        train: TrainConfig,
        sampler: Option<Sampler>,
    ) -> Result<Self, PipelineError> {
        if plan.num_layers() != model.num_layers() {
            return Err(PipelineError::Runtime(format!(
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
            .map_err(|e| PipelineError::Runtime(e.to_string()))?;
        let param_count = model.param_count();
        let mut train = train;
        train.schedule = train.schedule.resolve(&model.backend().info().name);
        let crate::engine::StageParts {
            backend,
            spec,
            edge: edge_stage,
            layers: layer_stages,
        } = model.into_parts();
        let spin = worker::idle_spin(&backend.info().name);
        let spawn = |name: String| {
            Worker::spawn_spinning(name, spin)
                .map(Arc::new)
                .map_err(|e| PipelineError::Runtime(format!("worker thread: {e}")))
        };
        let mut workers = vec![spawn("nsactor-edge".into())?];
        for s in 0..plan.num_stages() {
            workers.push(spawn(format!("nsactor-stage{s}"))?);
        }
        let fault = train
            .inject_fault
            .as_deref()
            .map(|f| f.parse::<topology::Fault>())
            .transpose()
            .map_err(PipelineError::Runtime)?
            .map(|f| Arc::new(topology::FaultPlan::new(f)));
        let id = PIPELINES.fetch_add(1, Ordering::Relaxed);
        let topo = topology::Topology {
            backend: backend.clone(),
            spec,
            plan: plan.clone(),
            workers: workers.clone(),
            prefix: format!("pipeline{id}"),
            fault,
            keep_activations: train.keep_activations,
        };
        let (sup, children, data) = rt.block_on(async {
            let rt_err = |e: ractor::SpawnErr| PipelineError::Runtime(e.to_string());
            let children = topo.spawn(edge_stage, layer_stages, 0).await?;
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
                    data: data.clone(),
                    train,
                },
            )
            .await
            .map_err(rt_err)?;
            // The supervisor hears of every child's failure.
            for c in children_cells(&children).chain(data.iter().map(|d| d.get_cell())) {
                c.link(sup.get_cell());
            }
            Ok::<_, PipelineError>((sup, shared, data))
        })?;
        trace::init();
        let stats = Arc::new(BatchStats::default());
        let batcher = rt
            .block_on(Actor::spawn(
                Some(format!("pipeline{id}/batcher")),
                BatcherActor,
                BatcherArgs {
                    children: children.clone(),
                    batching: Batching {
                        max_in_flight: plan.num_stages(),
                        ..Batching::default()
                    },
                    stats: stats.clone(),
                },
            ))
            .map_err(|e| PipelineError::Runtime(e.to_string()))?
            .0;
        let sessions = AsyncDecoder {
            children: children.clone(),
            batcher,
            stats,
            next_session: Arc::new(AtomicU64::new(0)),
            vocab: 0,
        };
        Ok(Pipeline {
            rt,
            sup,
            children,
            data,
            workers,
            plan,
            backend,
            param_count,
            sessions,
        })
    }

    fn call_sup<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, PipelineError>>) -> SupMsg,
    ) -> Result<T, PipelineError> {
        match self.rt.block_on(self.sup.call(build, None)) {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(PipelineError::Broken("the supervisor stopped".into())),
        }
    }

    /// The run's next step (data from the sampler, LR from the schedule).
    pub fn step(&mut self) -> Result<StepReport, PipelineError> {
        self.call_sup(|reply| SupMsg::Step { reply })
    }

    /// One step on `batches` with `params`.
    pub fn train_step(
        &mut self,
        batches: &[Batch],
        params: &StepParams,
    ) -> Result<StepStats, PipelineError> {
        let (batches, params) = (batches.to_vec(), *params);
        self.call_sup(|reply| SupMsg::StepWith {
            batches,
            params,
            reply,
        })
    }

    pub fn save_stages(&mut self) -> Result<Vec<Vec<u8>>, PipelineError> {
        self.call_sup(|reply| SupMsg::SaveStages { reply })
    }

    pub fn load_stages(&mut self, shards: Vec<Vec<u8>>) -> Result<(), PipelineError> {
        self.call_sup(|reply| SupMsg::LoadStages { shards, reply })
    }

    /// Writes a checkpoint of the current step under `root`; keeps the newest `keep`.
    pub fn checkpoint(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
    ) -> Result<PathBuf, PipelineError> {
        let root = root.to_path_buf();
        self.call_sup(|reply| SupMsg::Checkpoint {
            root,
            keep,
            config,
            tokenizer_sha256,
            reply,
        })
    }

    /// Continues after `step` completed steps with the data at `cursor`.
    pub fn set_position(&mut self, step: u64, cursor: Option<Cursor>) -> Result<(), PipelineError> {
        self.call_sup(|reply| SupMsg::SetPosition {
            step,
            cursor,
            reply,
        })
    }

    pub fn plan(&self) -> &PipelinePlan {
        &self.plan
    }

    pub fn backend(&self) -> &Arc<dyn ComputeBackend> {
        &self.backend
    }

    pub fn param_count(&self) -> u64 {
        self.param_count
    }

    pub fn num_layers(&self) -> usize {
        self.plan.num_layers()
    }

    fn children(&self) -> Children {
        self.children
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// An asynchronous decoder over this pipeline's actors; `vocab` is the model's vocabulary.
    pub fn decoder(&self, vocab: usize) -> AsyncDecoder {
        AsyncDecoder {
            vocab,
            ..self.sessions.clone()
        }
    }

    /// Runs `f` on the pipeline's runtime (where its actors live).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// Seconds each worker has spent in `to_device` of its inputs (edge first, then stages).
    pub fn transfers(&self) -> Vec<f64> {
        self.workers.iter().map(|w| w.transfer_s()).collect()
    }

    /// Seconds each worker has spent computing (edge first, then stages), and its job count.
    pub fn busy(&self) -> Vec<(String, f64, u64)> {
        self.workers
            .iter()
            .map(|w| {
                let (s, n) = w.busy();
                (w.name().to_string(), s, n)
            })
            .collect()
    }

    fn block<T>(
        &self,
        f: impl Future<Output = Result<T, PipelineError>>,
    ) -> Result<T, EngineError> {
        self.rt.block_on(f).map_err(EngineError::from)
    }

    /// Greedy continuation of `prompt` through the layer actors (see
    /// [`crate::engine::greedy`]).
    pub fn generate_greedy(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
        eos: Option<i64>,
        suppress: &[i64],
    ) -> Result<Vec<i64>, EngineError> {
        self.generate(
            prompt,
            max_new_tokens,
            eos,
            suppress,
            crate::decode::SamplingParams::greedy(),
        )
    }

    /// Continuation of `prompt` through the layer actors, tokens chosen by `sampling` (see
    /// [`crate::engine::generate`]).
    pub fn generate(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
        eos: Option<i64>,
        suppress: &[i64],
        sampling: crate::decode::SamplingParams,
    ) -> Result<Vec<i64>, EngineError> {
        let mut d = PipelineSession {
            p: self,
            session: self.sessions.session(),
            open: false,
        };
        crate::engine::generate(&mut d, prompt, max_new_tokens, eos, suppress, sampling)
    }

    /// Masked mean cross entropy of `b` (no gradients).
    pub fn eval_ce(&mut self, b: &Batch) -> Result<f64, EngineError> {
        b.validate()?;
        let d = &self.sessions;
        let session = d.session();
        let r = self.block(async {
            let h = d.embed(b.inputs.clone(), b.batch, b.seq_len).await?;
            let h = d.layers(session, h).await?;
            let batch = Arc::new(b.clone());
            ask(&d.children().edge, "edge", |reply| EdgeMsg::HeadEval {
                h,
                batch,
                reply,
            })
            .await
        });
        self.rt.block_on(d.close(session));
        r
    }
}

/// Asynchronous decoding through the layer actors, for servers running on the pipeline's
/// runtime ([`Pipeline::decoder`]). Cheap to clone; every method is a chain of actor calls, so
/// many sessions decode concurrently, each at its own layer.
#[derive(Clone)]
pub struct AsyncDecoder {
    children: Arc<RwLock<Children>>,
    batcher: ActorRef<BatcherMsg>,
    stats: Arc<BatchStats>,
    next_session: Arc<AtomicU64>,
    vocab: usize,
}

impl AsyncDecoder {
    fn children(&self) -> Children {
        self.children
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Vocabulary size of the model (length of a logits vector).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A new session id.
    pub fn session(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Embeds `ids` (row-major `[batch, seq_len]`) for decoding or evaluation.
    async fn embed(
        &self,
        ids: Vec<i64>,
        batch: usize,
        seq_len: usize,
    ) -> Result<DeviceTensor, PipelineError> {
        ask(&self.children().edge, "edge", |reply| {
            EdgeMsg::SessionEmbed {
                ids,
                batch,
                seq_len,
                reply,
            }
        })
        .await
    }

    /// `h` through every layer of `session` (all of `h`'s rows), outside any cohort.
    async fn layers(&self, session: u64, h: DeviceTensor) -> Result<DeviceTensor, PipelineError> {
        let layers = self.children().layers.clone();
        session_layers(&layers, &[session], h).await
    }

    /// Runs `ids` through `session` (a prompt, or one token); the last position's logits.
    /// Concurrent sessions are batched together at every layer (see [`batcher`]).
    pub async fn feed(&self, session: u64, ids: Vec<i64>) -> Result<Vec<f32>, PipelineError> {
        match self
            .batcher
            .call(
                |reply| BatcherMsg::Feed {
                    session,
                    ids,
                    reply,
                },
                None,
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(PipelineError::Broken("the decode batcher stopped".into())),
        }
    }

    /// Sessions whose neuron states the actors hold (fed, and not closed yet).
    pub fn open_sessions(&self) -> u64 {
        self.stats.open.load(Ordering::Relaxed)
    }

    /// Seconds the cohorts have spent so far in `[embed, layers, decode, whole cohort]`, as the
    /// batcher sees them ([`batcher::CohortPhases`]).
    pub fn cohort_phases(&self) -> [f64; 4] {
        self.stats.phases.seconds()
    }

    /// Cohorts run so far and the session inputs they carried (their ratio is the mean batch).
    pub fn batch_counts(&self) -> (u64, u64) {
        (
            self.stats.cohorts.load(Ordering::Relaxed),
            self.stats.inputs.load(Ordering::Relaxed),
        )
    }

    /// Frees `session`'s neuron states in every actor (after its input in flight, if any).
    pub async fn close(&self, session: u64) {
        let _ = self
            .batcher
            .call(|reply| BatcherMsg::Close { session, reply }, None)
            .await;
    }
}

struct PipelineSession<'a> {
    p: &'a Pipeline,
    session: u64,
    open: bool,
}

impl Decoder for PipelineSession<'_> {
    fn prefill(&mut self, prompt: &[i64]) -> Result<Vec<f32>, EngineError> {
        self.open = true;
        self.p
            .block(self.p.sessions.feed(self.session, prompt.to_vec()))
    }

    fn next(&mut self, token: i64) -> Result<Vec<f32>, EngineError> {
        self.p
            .block(self.p.sessions.feed(self.session, vec![token]))
    }

    fn close(&mut self) {
        if self.open {
            self.p.rt.block_on(self.p.sessions.close(self.session));
        }
    }
}

impl Drop for Pipeline {
    /// Stops every actor, then joins the worker threads.
    fn drop(&mut self) {
        // The supervisor first, so no recovery starts while the children stop.
        let _ = self
            .rt
            .block_on(self.sup.get_cell().stop_and_wait(None, None));
        let children = self.children();
        let cells: Vec<ActorCell> = std::iter::once(self.sessions.batcher.get_cell())
            .chain(children_cells(&children))
            .chain(self.data.iter().map(|d| d.get_cell()))
            .chain(std::iter::once(self.sup.get_cell()))
            .collect();
        self.rt.block_on(async {
            for c in &cells {
                let _ = c.stop_and_wait(None, None).await;
            }
        });
        self.workers.clear();
    }
}
