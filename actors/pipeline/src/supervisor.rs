//! The `Supervisor`: runs training steps over the actor pipeline and watches its children.
//!
//! A step draws M micro-batches from the `DataActor`, admits at most P of them into the
//! pipeline at once (1F1B: micro-batch m + P enters when m has finished its backward pass, and
//! workers run backward work before forward work; with `schedule = "depth-first"`, 2P and the
//! oldest micro-batch first within each class), and once all M are done runs the optimizer
//! phase: per-layer gradient statistics → natural-gradient compensation (phase 2 across
//! layers) → one global clip factor → the optimizer on every actor. Losses are summed in
//! micro-batch order and every layer accumulates its gradients in micro-batch order, so the
//! result does not depend on P.

use super::data::{DataMsg, Shape};
use super::guard::SpikeGuard;
use super::heal::{HealTimings, WeightSource};
use super::keep::AutoKeep;
use super::keep_run;
use super::msg::{EdgeMsg, LayerMsg, StageControl};
use super::topology::{Children, Topology};
use nsactor_checkpoint::writer::{CheckpointReport, WriteDone, Writer};
use nsactor_data::Cursor;
use nsactor_engine::config::TrainConfig;
use nsactor_engine::engine::{StepParams, StepStats};
use nsactor_engine::error::RuntimeError;
use nsactor_engine::supervision::Restarts;
use nsactor_plugin_api::{Batch, IdAllocator, ShardBytes, StageSnapshot};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// What one step of the run reported.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// 1-based step number.
    pub step: u64,
    pub lr: f64,
    pub stats: StepStats,
    /// Where the data continues after this step.
    pub cursor: Option<Cursor>,
    /// Seconds the step waited for its batches from the `DataActor` (about 0 when they were
    /// drawn ahead in time), as torchtitan logs its data-loading time.
    pub data_wait_s: f64,
}

pub enum SupMsg {
    /// The run's next step: data from the `DataActor`, LR from the schedule.
    Step {
        reply: RpcReplyPort<Result<StepReport, RuntimeError>>,
    },
    /// One step on given micro-batches with given hyperparameters (replays, tests).
    StepWith {
        batches: Vec<Batch>,
        params: StepParams,
        reply: RpcReplyPort<Result<StepStats, RuntimeError>>,
    },
    /// Every stage's bytes, edge first, in the buffers they were serialised into.
    SaveStages {
        reply: RpcReplyPort<Result<Vec<ShardBytes>, RuntimeError>>,
    },
    /// Every stage's snapshot, edge first, taken once each stage has finished its queued work.
    SnapshotStages {
        reply: RpcReplyPort<Result<Vec<Box<dyn StageSnapshot>>, RuntimeError>>,
    },
    /// Every stage's bytes, edge first (one buffer may feed several stages).
    LoadStages {
        shards: Vec<Arc<Vec<u8>>>,
        reply: RpcReplyPort<Result<(), RuntimeError>>,
    },
    /// Checkpoints the current step under `root`, keeping the newest `keep`: waits for the
    /// write in flight, snapshots every stage, then writes it, in the `background` or before
    /// replying.
    Checkpoint {
        root: PathBuf,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        background: bool,
        /// Also write the stages' parameters as one whole-model file here, from the same read.
        export: Option<PathBuf>,
        reply: RpcReplyPort<Result<CheckpointReport, RuntimeError>>,
    },
    /// Waits for the checkpoint write in flight, if any, and says how it ended.
    FinishCheckpoint {
        reply: RpcReplyPort<Result<Option<WriteDone>, RuntimeError>>,
    },
    /// Loads what `source` reads into every stage, and keeps `source` for [`SupMsg::Heal`].
    LoadFrom {
        source: WeightSource,
        reply: RpcReplyPort<Result<(), RuntimeError>>,
    },
    /// Rebuilds every actor after a lost stage and loads the weights of the last
    /// [`SupMsg::LoadFrom`] again (`super::heal`); answers how long each phase took.
    Heal {
        reply: RpcReplyPort<Result<HealTimings, RuntimeError>>,
    },
    /// Continue after `step` completed steps, with the data at `cursor` (resume).
    SetPosition {
        step: u64,
        cursor: Option<Cursor>,
        reply: RpcReplyPort<Result<(), RuntimeError>>,
    },
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for SupMsg {}

pub struct Supervisor;

/// What the supervisor starts from: the graph it can rebuild, the actors now in it, the data.
pub struct SupArgs {
    pub topo: Topology,
    pub children: Arc<RwLock<Children>>,
    /// Data-parallel replicas 1.. (none without data parallelism).
    pub others: Vec<Children>,
    pub data: Option<ActorRef<DataMsg>>,
    pub train: TrainConfig,
    /// The pipeline's one source of micro-batch (and session) ids.
    pub ids: Arc<IdAllocator>,
    /// The model's parameters (what a checkpoint holds, for `keep_activations = "auto"`).
    pub param_count: u64,
}

pub struct SupState {
    pub(super) topo: Topology,
    pub(super) edge: ActorRef<EdgeMsg>,
    pub(super) layers: Vec<ActorRef<LayerMsg>>,
    /// Data-parallel replicas 1.. (replica 0 is `edge` and `layers`).
    pub(super) others: Vec<Children>,
    /// The same actors, for the [`Pipeline`](nsactor_decoding::handle::Pipeline) handle.
    pub(super) shared: Arc<RwLock<Children>>,
    pub(super) data: Option<ActorRef<DataMsg>>,
    /// P: micro-batches admitted into the pipeline at once.
    pub(super) stages: usize,
    pub(super) train: TrainConfig,
    /// Steps completed.
    pub(super) step: u64,
    pub(super) cursor: Option<Cursor>,
    pub(super) ids: Arc<IdAllocator>,
    /// Why the pipeline can no longer run, once a child has died.
    pub(super) broken: Option<String>,
    /// Where the data stood before the first step (the rollback target without a checkpoint).
    pub(super) initial_cursor: Option<Cursor>,
    /// Recoveries so far, and actor generations spawned.
    pub(super) restarts: u32,
    /// The recoveries within `[train] restart_window_s`, against `[train] max_restarts`.
    pub(super) recent: Restarts,
    /// The checkpoint write in flight.
    pub(super) writer: Writer,
    /// The loss-spike guard and its running mean.
    pub(super) guard: SpikeGuard,
    /// Where the weights came from, to load them again after a rebuild (serving).
    pub(super) weights: Option<WeightSource>,
    /// `keep_activations = "auto"` while it measures and checks ([`keep_run`]).
    pub(super) auto_keep: Option<AutoKeep>,
}

impl SupState {
    /// Clears every replica's accumulated gradients.
    pub(super) async fn zero_grad(&self) -> Result<(), RuntimeError> {
        let zero = StageControl::ZeroGrad;
        self.control_replicas(zero, |_| zero).await.map(drop)
    }

    /// One step; `guarded` runs the loss-spike guard on it (the run's own steps, not replays).
    async fn train_step(
        &mut self,
        batches: Vec<Batch>,
        p: &StepParams,
        guarded: bool,
    ) -> Result<StepStats, RuntimeError> {
        self.check()?;
        keep_run::before_step(&self.auto_keep, &self.topo);
        let r = self.train_step_inner(batches, p, guarded).await;
        match &r {
            Ok(_) => keep_run::after_step(&mut self.auto_keep, &self.topo),
            Err(e) => {
                keep_run::step_failed(&mut self.auto_keep, &self.topo);
                self.world_failed(e);
            }
        }
        if r.is_err() && self.dead_child().is_none() && self.broken.is_none() {
            // Leave no half-accumulated gradients behind; the step is skipped.
            if let Err(e) = self.zero_grad().await {
                tracing::warn!("could not clear gradients after a failed step: {e}");
            }
        }
        r
    }

    async fn next_step(&mut self, myself: &ActorRef<SupMsg>) -> Result<StepReport, RuntimeError> {
        self.check()?;
        let data = self
            .data
            .as_ref()
            .ok_or_else(|| RuntimeError::Invalid("this pipeline has no data source".into()))?;
        let t = &self.train;
        let shape = Shape {
            micro_batches: t.accumulation,
            batch_size: t.batch_size,
            seq_len: t.seq_len,
        };
        let waited = std::time::Instant::now();
        let rows = match data
            .call(|reply| DataMsg::Next { shape, reply }, None)
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r?,
            _ => return Err(RuntimeError::Broken("the data actor stopped".into())),
        };
        let data_wait_s = waited.elapsed().as_secs_f64();
        // The step uses the LR of the last micro-step of its window (SPEC §7.2).
        let total_micro = t.steps * t.accumulation as u64;
        let lr = t.lr_at((self.step + 1) * t.accumulation as u64 - 1, total_micro);
        let params = StepParams {
            lr,
            neuron_lr: lr * t.neuron_lr_mult,
            ponder_weight: t.ponder_weight,
            max_grad_norm: t.max_grad_norm,
        };
        let data = data.clone();
        self.initial_cursor.get_or_insert(rows.before);
        if let Some(f) = &self.topo.fault {
            f.set_step(self.step + 1);
        }
        let r = self.train_step(rows.batches, &params, true).await;
        match r {
            Ok(stats) => {
                self.step += 1;
                self.cursor = Some(rows.after);
                Ok(StepReport {
                    step: self.step,
                    lr,
                    stats,
                    cursor: self.cursor,
                    data_wait_s,
                })
            }
            Err(e) if self.broken.is_some() || self.dead_child().is_some() => {
                let cause = format!("step {} failed: {e}", self.step + 1);
                tracing::error!("{cause}");
                if self.topo.world.is_some() {
                    // One rank alone cannot roll back: the launcher restarts them all.
                    return Err(RuntimeError::Broken(format!(
                        "{cause}; the ranks restart together (--max-restarts) from the newest \
                         checkpoint"
                    )));
                }
                let policy = self.train.restart_policy();
                if self
                    .recent
                    .allow(&policy, std::time::Instant::now())
                    .is_none()
                {
                    return Err(RuntimeError::Broken(format!(
                        "{cause}; giving up: more than {} (max_restarts, restart_window_s)",
                        policy.describe("restart")
                    )));
                }
                let t = std::time::Instant::now();
                let to_step = self
                    .recover(myself)
                    .await
                    .map_err(|r| RuntimeError::Broken(format!("{cause}; recovery failed: {r}")))?;
                Err(RuntimeError::Recovered {
                    cause,
                    to_step,
                    seconds: t.elapsed().as_secs_f64(),
                })
            }
            Err(RuntimeError::LossSpike {
                step,
                loss,
                mean,
                factor,
                ..
            }) => {
                // The training loop reports the spike; the rollback logs where it went.
                let to_step = self.roll_back_spike(rows.after).await?;
                Err(RuntimeError::LossSpike {
                    step,
                    loss,
                    mean,
                    factor,
                    to_step,
                })
            }
            Err(e) => {
                // The batches were not used: put the data back where the step began.
                let c = rows.before;
                let _ = data
                    .call(|reply| DataMsg::Seek { cursor: c, reply }, None)
                    .await;
                Err(e)
            }
        }
    }
}

impl Actor for Supervisor {
    type Msg = SupMsg;
    type State = SupState;
    type Arguments = SupArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SupMsg>,
        a: SupArgs,
    ) -> Result<SupState, ActorProcessingErr> {
        let c = a.children.read().unwrap_or_else(|e| e.into_inner()).clone();
        let others = a.others;
        let guard = SpikeGuard::new(a.train.loss_spike_factor, a.train.loss_spike_window);
        let auto_keep = keep_run::auto_keep(&a.topo, &a.train, a.param_count);
        a.topo.keep.set_settled(auto_keep.is_none());
        Ok(SupState {
            stages: a.topo.replicas[0].plan.num_stages(),
            topo: a.topo,
            edge: c.edge,
            layers: c.layers,
            others,
            shared: a.children,
            data: a.data,
            train: a.train,
            step: 0,
            cursor: None,
            ids: a.ids,
            broken: None,
            initial_cursor: None,
            restarts: 0,
            recent: Restarts::default(),
            writer: Writer::default(),
            guard,
            weights: None,
            auto_keep,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupMsg>,
        msg: SupMsg,
        s: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupMsg::Step { reply } => {
                let _ = reply.send(s.next_step(&myself).await);
            }
            SupMsg::StepWith {
                batches,
                params,
                reply,
            } => {
                let _ = reply.send(s.train_step(batches, &params, false).await);
            }
            SupMsg::SaveStages { reply } => {
                let _ = reply.send(s.save_stages().await);
            }
            SupMsg::SnapshotStages { reply } => {
                let _ = reply.send(s.snapshot_stages().await);
            }
            SupMsg::LoadStages { shards, reply } => {
                let _ = reply.send(s.load_stages(shards).await);
            }
            SupMsg::Checkpoint {
                root,
                keep,
                config,
                tokenizer_sha256,
                background,
                export,
                reply,
            } => {
                let r = s
                    .checkpoint(root, keep, config, tokenizer_sha256, background, export)
                    .await;
                let _ = reply.send(r);
            }
            SupMsg::FinishCheckpoint { reply } => {
                let _ = reply.send(s.writer.finish().await.transpose());
            }
            SupMsg::LoadFrom { source, reply } => {
                let _ = reply.send(s.load_from(source).await);
            }
            SupMsg::Heal { reply } => {
                let _ = reply.send(s.heal(&myself).await);
            }
            SupMsg::SetPosition {
                step,
                cursor,
                reply,
            } => {
                let _ = reply.send(s.set_position(step, cursor).await);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<SupMsg>,
        evt: SupervisionEvent,
        s: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        s.child_event(evt);
        Ok(())
    }
}
