//! Recovery of the supervisor: hearing of its children's failures, rebuilding every edge and
//! layer actor after one and rolling the run back to the newest valid checkpoint (or, serving,
//! loading the weights again: `super::heal`), rolling back after a loss spike, checkpointing,
//! and saving or loading every stage at once.

use super::data::DataMsg;
use super::heal::{HealTimings, WeightSource};
use super::msg::{EdgeMsg, LayerMsg, ask};
use super::supervisor::{SupMsg, SupState};
use super::topology::children_cells;
use futures_util::future::join_all;
use nsactor_checkpoint::checkpoint::{self, CheckpointMeta};
use nsactor_checkpoint::writer::{CheckpointReport, Job, serialise};
use nsactor_data::Cursor;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{EngineError, InitialWeights, ShardBytes, StageSnapshot};
use ractor::{ActorCell, ActorRef, SupervisionEvent};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl SupState {
    /// Every child: the edge and layer actors of every replica, and the data actor.
    pub(super) fn children(&self) -> impl Iterator<Item = ActorCell> + '_ {
        std::iter::once(self.edge.get_cell())
            .chain(self.layers.iter().map(|l| l.get_cell()))
            .chain(self.others.iter().flat_map(children_cells))
            .chain(self.data.iter().map(|d| d.get_cell()))
    }

    /// The first child that is no longer running.
    pub(super) fn dead_child(&self) -> Option<String> {
        self.children()
            .find(|c| c.get_status() > ractor::ActorStatus::Running)
            .map(|c| name_of(&c))
    }

    /// Fails when a child has died or stopped: the pipeline must recover first.
    pub(super) fn check(&self) -> Result<(), RuntimeError> {
        if let Some(why) = &self.broken {
            return Err(RuntimeError::Broken(why.clone()));
        }
        if let Some(who) = self.dead_child() {
            return Err(RuntimeError::Broken(format!("{who} stopped")));
        }
        Ok(())
    }

    /// What the supervisor hears of a child: a failure or a stop of a current one breaks the
    /// pipeline; events of actors a recovery has already replaced are history.
    pub(super) fn child_event(&mut self, evt: SupervisionEvent) {
        let current = |c: &ActorCell| self.children().any(|k| k.get_id() == c.get_id());
        match evt {
            SupervisionEvent::ActorFailed(cell, _)
            | SupervisionEvent::ActorTerminated(cell, ..)
                if !current(&cell) => {}
            SupervisionEvent::ActorFailed(cell, err) => {
                let why = format!("{} failed: {err}", name_of(&cell));
                tracing::error!("{why}");
                self.broken.get_or_insert(why);
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let why = format!(
                    "{} stopped{}",
                    name_of(&cell),
                    reason.map(|r| format!(": {r}")).unwrap_or_default()
                );
                tracing::debug!("{why}");
                self.broken.get_or_insert(why);
            }
            _ => {}
        }
    }

    /// Continue after `step` completed steps, with the data at `cursor`.
    pub(super) async fn set_position(
        &mut self,
        step: u64,
        cursor: Option<Cursor>,
    ) -> Result<(), RuntimeError> {
        if let (Some(c), Some(d)) = (cursor, &self.data) {
            match d
                .call(|reply| DataMsg::Seek { cursor: c, reply }, None)
                .await
            {
                Ok(ractor::rpc::CallResult::Success(r)) => r?,
                _ => return Err(RuntimeError::Broken("the data actor stopped".into())),
            }
        }
        self.step = step;
        self.cursor = cursor;
        Ok(())
    }

    /// Rebuilds every edge and layer actor from freshly opened stages, loads the newest valid
    /// checkpoint into them (none: the fresh stages are the step-0 state), rewinds the data
    /// and the step counter. Returns the step the run continues after.
    pub(super) async fn recover(&mut self, myself: &ActorRef<SupMsg>) -> Result<u64, RuntimeError> {
        self.stop_children(myself).await;
        let found = self.newest_checkpoint().await?;
        // Stages that will load a checkpoint draw no initial weights.
        let weights = if found.is_some() {
            InitialWeights::Loaded
        } else {
            InitialWeights::Seeded
        };
        self.respawn(myself, weights).await?;
        let (step, cursor) = match found {
            Some(l) => {
                tracing::warn!("rolling back to {}", l.dir.display());
                self.load_stages(l.shards.into_iter().map(Arc::new).collect())
                    .await?;
                (l.manifest.step, l.manifest.data_cursor)
            }
            None => {
                tracing::warn!("no checkpoint yet: restarting from the initial weights");
                (0, self.initial_cursor)
            }
        };
        self.set_position(step, cursor).await?;
        Ok(step)
    }

    /// Stops every edge and layer actor and spawns new ones over freshly opened stages
    /// ([`respawn`](Self::respawn)); the pipeline is no longer broken.
    pub(super) async fn rebuild(
        &mut self,
        myself: &ActorRef<SupMsg>,
        weights: InitialWeights,
    ) -> Result<(), RuntimeError> {
        self.stop_children(myself).await;
        self.respawn(myself, weights).await
    }

    /// Unlinks and stops every edge and layer actor, all at once: a live actor finishes the job
    /// it is in; a dead one returns at once.
    async fn stop_children(&mut self, myself: &ActorRef<SupMsg>) {
        let me = myself.get_cell();
        let old: Vec<ActorCell> = self.replicas().iter().flat_map(children_cells).collect();
        for c in &old {
            c.unlink(me.clone());
        }
        let wait = Some(Duration::from_secs(600));
        join_all(old.iter().map(|c| c.stop_and_wait(None, wait))).await;
    }

    /// Spawns every edge and layer actor anew over freshly opened stages, linked to the
    /// supervisor: the step-0 weights ([`InitialWeights::Seeded`]), or none until loaded
    /// ([`InitialWeights::Loaded`]).
    async fn respawn(
        &mut self,
        myself: &ActorRef<SupMsg>,
        weights: InitialWeights,
    ) -> Result<(), RuntimeError> {
        self.restarts += 1;
        let me = myself.get_cell();
        let mut rebuilt = Vec::with_capacity(self.topo.replicas.len());
        for r in 0..self.topo.replicas.len() {
            let (edge, layers) = self.topo.open_fresh(r, weights).await?;
            let children = self
                .topo
                .spawn(r, edge, layers, self.restarts as u64)
                .await?;
            for c in super::topology::children_cells(&children) {
                c.link(me.clone());
            }
            rebuilt.push(children);
        }
        let children = rebuilt.remove(0);
        self.others = rebuilt;
        self.edge = children.edge.clone();
        self.layers = children.layers.clone();
        *self.shared.write().unwrap_or_else(|e| e.into_inner()) = children;
        self.broken = None;
        Ok(())
    }

    /// The newest checkpoint of the run that verifies, after finishing a write in flight;
    /// damaged ones are logged by name and skipped.
    async fn newest_checkpoint(&mut self) -> Result<Option<checkpoint::Loaded>, RuntimeError> {
        if let Some(Err(e)) = self.writer.finish().await {
            tracing::warn!("the checkpoint being written was not completed: {e}");
        }
        let root = self.train.out_dir.join("checkpoints");
        let (found, skipped) = tokio::task::spawn_blocking(move || checkpoint::latest_valid(&root))
            .await
            .map_err(|e| RuntimeError::Runtime(format!("checkpoint search: {e}")))?;
        for s in skipped {
            tracing::warn!("{s}");
        }
        Ok(found)
    }

    /// After a loss spike at the step after `self.step`: loads the newest valid checkpoint
    /// (none: the weights stay) and continues with the data at `after`, past the spiking
    /// step's batches, so the batches since the checkpoint are skipped. Returns the step the
    /// run continues after; gives up on a spike after `max_restarts` rollbacks to
    /// the same checkpoint step.
    pub(super) async fn roll_back_spike(&mut self, after: Cursor) -> Result<u64, RuntimeError> {
        let found = self.newest_checkpoint().await?;
        let to = match found {
            Some(l) => {
                tracing::warn!(
                    "rolling back to {} and skipping the batches of steps {}..={}",
                    l.dir.display(),
                    l.manifest.step + 1,
                    self.step + 1
                );
                self.load_stages(l.shards.into_iter().map(Arc::new).collect())
                    .await?;
                l.manifest.step
            }
            None => {
                tracing::warn!("no checkpoint yet: only the spiking step's batches are skipped");
                self.step
            }
        };
        let n = self.guard.rolled_back_to(to);
        if !self.train.restart_policy().rollback(n - 1) {
            return Err(RuntimeError::Broken(format!(
                "the loss spiked {n} times with step {to} as the newest checkpoint; giving up \
                 (max_restarts = {})",
                self.train.max_restarts
            )));
        }
        self.step = to;
        self.cursor = Some(after);
        Ok(to)
    }

    /// Checkpoints the current step under `root` (see [`SupMsg::Checkpoint`]).
    pub(super) async fn checkpoint(
        &mut self,
        root: PathBuf,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        background: bool,
        export: Option<PathBuf>,
    ) -> Result<CheckpointReport, RuntimeError> {
        if self.topo.spec.optimizer.is_none() {
            // Its stages hold no Adam moments: a run resumed from it would restart Adam.
            return Err(RuntimeError::Invalid(
                "this pipeline was opened to serve or evaluate, without an optimizer: a \
                 checkpoint of it would have no optimizer state to resume training from"
                    .into(),
            ));
        }
        let t = Instant::now();
        let previous = self.writer.finish().await;
        let waited_seconds = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let shards = self.snapshot_stages().await?;
        let snapshot_seconds = t.elapsed().as_secs_f64();
        let step = self.step;
        let fault = self.topo.fault.as_ref();
        let (reads_tx, reads_rx) = std::sync::mpsc::channel();
        let job = Job {
            crash: fault.is_some_and(|f| f.crash_in_checkpoint(step)),
            disk_full: fault.is_some_and(|f| f.disk_full_in_checkpoint(step)),
            root: root.clone(),
            keep,
            meta: CheckpointMeta {
                step,
                data_cursor: self.cursor,
                seed: self.train.seed,
                config,
                tokenizer_sha256,
            },
            shards,
            // The run's final checkpoint (with its weights): the run waits for its reads.
            alone: export.is_some(),
            export,
            reads_done: background.then_some(reads_tx),
        };
        let written = self.writer.write(job, background).await?;
        Ok(CheckpointReport {
            step,
            dir: checkpoint::step_dir(&root, step),
            waited_seconds,
            snapshot_seconds,
            previous,
            written,
            reads_done: background.then_some(reads_rx),
        })
    }

    /// Every stage's snapshot (edge first), taken on the stage workers between two of their
    /// jobs: with the burn backends, handles on the device, no copy.
    pub(super) async fn snapshot_stages(
        &self,
    ) -> Result<Vec<Box<dyn StageSnapshot>>, RuntimeError> {
        self.check()?;
        let edge = ask(&self.edge, "edge", |reply| EdgeMsg::Snapshot { reply });
        let layers = join_all(self.layers.iter().enumerate().map(|(i, l)| {
            ask(l, format!("layer {i}"), |reply| LayerMsg::Snapshot {
                reply,
            })
        }));
        let (e, ls) = futures_util::join!(edge, layers);
        let mut out = vec![e?];
        for l in ls {
            out.push(l?);
        }
        Ok(out)
    }

    /// Every stage's bytes (edge first), serialised off the actor threads.
    pub(super) async fn save_stages(&self) -> Result<Vec<ShardBytes>, RuntimeError> {
        let snaps = self.snapshot_stages().await?;
        tokio::task::spawn_blocking(move || serialise(snaps))
            .await
            .map_err(|e| RuntimeError::Runtime(format!("serialising the stages: {e}")))?
    }

    pub(super) async fn load_stages(&self, shards: Vec<Arc<Vec<u8>>>) -> Result<(), RuntimeError> {
        self.check()?;
        if shards.len() != self.layers.len() + 1 {
            return Err(EngineError::InvalidInput(format!(
                "{} shards for {} stages",
                shards.len(),
                self.layers.len() + 1
            ))
            .into());
        }
        // Every replica loads the same shards.
        let loads = self.replicas().into_iter().map(|c| {
            let shards = shards.clone();
            async move {
                let mut shards = shards.into_iter();
                let edge_bytes = shards.next().expect("checked length");
                let edge = ask(&c.edge, "edge", |reply| EdgeMsg::Load {
                    bytes: edge_bytes,
                    reply,
                });
                let layers =
                    join_all(c.layers.iter().zip(shards).enumerate().map(|(i, (l, b))| {
                        ask(l, format!("layer {i}"), |reply| LayerMsg::Load {
                            bytes: b,
                            reply,
                        })
                    }));
                let (e, ls) = futures_util::join!(edge, layers);
                e?;
                ls.into_iter().collect::<Result<Vec<_>, _>>()?;
                Ok::<(), RuntimeError>(())
            }
        });
        join_all(loads).await.into_iter().collect()
    }
}

/// Serving's side of recovery: loading from a [`WeightSource`] and rebuilding from it
/// (`super::heal`).
impl SupState {
    /// Loads what `source` reads into every stage and keeps `source` for [`heal`](Self::heal).
    pub(super) async fn load_from(&mut self, source: WeightSource) -> Result<(), RuntimeError> {
        let shards = read(source.clone()).await?;
        self.load_stages(shards).await?;
        self.weights = Some(source);
        Ok(())
    }

    /// Reads the weights again from their source, then rebuilds every actor and loads them;
    /// how long each took.
    pub(super) async fn heal(
        &mut self,
        myself: &ActorRef<SupMsg>,
    ) -> Result<HealTimings, RuntimeError> {
        let t = Instant::now();
        let source = self.weights.clone().ok_or_else(|| {
            RuntimeError::Broken(
                "the pipeline's weights were not loaded from a source it can read again".into(),
            )
        })?;
        // Read first: a source that fails leaves nothing half rebuilt.
        let shards = read(source).await?;
        let read_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        self.rebuild(myself, InitialWeights::Loaded).await?;
        let rebuild_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        self.load_stages(shards).await?;
        let took = HealTimings {
            away_s: 0.0, // the decoder's to say
            read_s,
            rebuild_s,
            load_s: t.elapsed().as_secs_f64(),
        };
        tracing::warn!(
            "decoding rebuilt every actor and reloaded its weights in {:.2} s (read {:.2} s, \
             rebuild {:.2} s, load {:.2} s)",
            took.total_s(),
            took.read_s,
            took.rebuild_s,
            took.load_s
        );
        Ok(took)
    }
}

async fn read(source: WeightSource) -> Result<Vec<Arc<Vec<u8>>>, RuntimeError> {
    tokio::task::spawn_blocking(move || source())
        .await
        .map_err(|e| RuntimeError::Runtime(format!("reading the weights: {e}")))?
}

fn name_of(cell: &ActorCell) -> String {
    cell.get_name()
        .unwrap_or_else(|| format!("actor {}", cell.get_id()))
}
