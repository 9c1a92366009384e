//! [`Pipeline`]: the synchronous handle on a running actor pipeline, which the CLI, the server
//! and the tests use: start, train steps, checkpoints, save/load, evaluation and generation.

mod start;

use super::decoder::AsyncDecoder;
use super::heal::WeightSource;
use nsactor_checkpoint::writer::{CheckpointReport, WriteDone};
use nsactor_data::{Cursor, Sampler};
use nsactor_engine::config::TrainConfig;
use nsactor_engine::engine::{DecodeSession, StagedModel, StepParams, StepStats};
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::data::DataMsg;
use nsactor_pipeline::layers::evaluate_layers;
use nsactor_pipeline::msg::{EdgeMsg, ask};
use nsactor_pipeline::plan::PipelinePlan;
use nsactor_pipeline::supervisor::{StepReport, SupMsg};
use nsactor_pipeline::topology::{Children, children_cells};
use nsactor_pipeline::worker::Worker;
use nsactor_plugin_api::{
    Batch, ComputeBackend, EngineError, SessionId, ShardBytes, StageSnapshot,
};
use ractor::RpcReplyPort;
use ractor::{ActorCell, ActorRef};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

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
    /// Every data-parallel replica's placement, replica 0's (`plan`) first.
    replica_plans: Vec<PipelinePlan>,
    backend: Arc<dyn ComputeBackend>,
    param_count: u64,
    /// Decoding sessions of `generate`/`eval_ce` (and, through [`decoder`](Self::decoder),
    /// of servers), sharing one session counter.
    sessions: AsyncDecoder,
    /// Layers per stage whose training forwards keep their graph (`[train] keep_activations`;
    /// `auto` sets it after its measured steps).
    keep: nsactor_pipeline::keep::KeepLayers,
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
    ) -> Result<Self, RuntimeError> {
        Pipeline::start_in(model, plan, train, sampler, None)
    }

    fn call_sup<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, RuntimeError>>) -> SupMsg,
    ) -> Result<T, RuntimeError> {
        match self.rt.block_on(self.sup.call(build, None)) {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(RuntimeError::Broken("the supervisor stopped".into())),
        }
    }

    /// The run's next step (data from the sampler, LR from the schedule).
    pub fn step(&mut self) -> Result<StepReport, RuntimeError> {
        self.call_sup(|reply| SupMsg::Step { reply })
    }

    /// One step on `batches` with `params`.
    pub fn train_step(
        &mut self,
        batches: &[Batch],
        params: &StepParams,
    ) -> Result<StepStats, RuntimeError> {
        let (batches, params) = (batches.to_vec(), *params);
        self.call_sup(|reply| SupMsg::StepWith {
            batches,
            params,
            reply,
        })
    }

    /// Every stage's parameters and optimizer state as safetensors bytes, edge first.
    pub fn save_stages(&mut self) -> Result<Vec<Vec<u8>>, RuntimeError> {
        let shards = self.call_sup(|reply| SupMsg::SaveStages { reply })?;
        Ok(shards.into_iter().map(ShardBytes::into_vec).collect())
    }

    /// Every stage's snapshot, edge first ([`nsactor_plugin_api::Stage::snapshot`]), taken
    /// once each stage has finished the work queued before it (a step's last updates):
    /// serialised later, from any thread.
    pub fn snapshot_stages(&mut self) -> Result<Vec<Box<dyn StageSnapshot>>, RuntimeError> {
        self.call_sup(|reply| SupMsg::SnapshotStages { reply })
    }

    pub fn load_stages(&mut self, shards: Vec<Vec<u8>>) -> Result<(), RuntimeError> {
        self.load_shared(shards.into_iter().map(Arc::new).collect())
    }

    /// [`Pipeline::load_stages`] from shared buffers: one whole-model file may feed every stage
    /// (each reads its own tensors) without a copy per stage.
    pub fn load_shared(&mut self, shards: Vec<Arc<Vec<u8>>>) -> Result<(), RuntimeError> {
        self.call_sup(|reply| SupMsg::LoadStages { shards, reply })
    }

    /// Loads the shards `source` reads (stage order, edge first) into every stage, and keeps
    /// `source`: decoding that loses a stage rebuilds the actors and reads it again
    /// (`super::heal`).
    pub fn load_from(&mut self, source: WeightSource) -> Result<(), RuntimeError> {
        self.call_sup(|reply| SupMsg::LoadFrom { source, reply })
    }

    /// Loads one whole-model safetensors file (every stage reads its own tensors from it;
    /// Hugging Face `model.`-prefixed names too) into every stage.
    pub fn load_model(&mut self, bytes: Vec<u8>) -> Result<(), RuntimeError> {
        let bytes = Arc::new(bytes);
        let shards = vec![bytes; self.num_layers() + 1];
        self.call_sup(|reply| SupMsg::LoadStages { shards, reply })
    }

    /// Writes a checkpoint of the current step under `root` before returning (after any
    /// background write in flight); keeps the newest `keep`.
    pub fn checkpoint(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
    ) -> Result<PathBuf, RuntimeError> {
        let r = self.checkpoint_with(root, keep, config, tokenizer_sha256, false)?;
        if let Some(Err(e)) = r.previous {
            tracing::warn!("an earlier checkpoint write failed: {e}");
        }
        Ok(r.dir)
    }

    /// [`checkpoint`](Self::checkpoint), also writing the stages' parameters as one
    /// whole-model file at `weights` (a run's final weights) from the same read of the
    /// stages; returns how the write went.
    pub fn checkpoint_exporting(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        weights: &Path,
    ) -> Result<WriteDone, RuntimeError> {
        let r =
            self.request_checkpoint(root, keep, config, tokenizer_sha256, false, Some(weights))?;
        if let Some(Err(e)) = r.previous {
            tracing::warn!("an earlier checkpoint write failed: {e}");
        }
        r.written.ok_or_else(|| {
            RuntimeError::Runtime("a synchronous checkpoint reported no write".into())
        })
    }

    /// A run's final checkpoint under `root` (keeping the newest `keep`) and its whole-model
    /// weights at `weights`, from one read of the stages, written in the background: returns
    /// once every stage is snapshot; [`finish_checkpoint`](Self::finish_checkpoint) waits for
    /// the files and says how the write went.
    pub fn checkpoint_final(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        weights: &Path,
    ) -> Result<CheckpointReport, RuntimeError> {
        self.request_checkpoint(root, keep, config, tokenizer_sha256, true, Some(weights))
    }

    /// Checkpoints the current step under `root`, keeping the newest `keep`: waits for the
    /// write in flight, snapshots every stage, then writes the files in the `background`
    /// (the report's `written` is then `None`; [`finish_checkpoint`](Self::finish_checkpoint)
    /// or the next checkpoint says how it ended) or before returning.
    pub fn checkpoint_with(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        background: bool,
    ) -> Result<CheckpointReport, RuntimeError> {
        self.request_checkpoint(root, keep, config, tokenizer_sha256, background, None)
    }

    /// The supervisor's checkpoint request ([`SupMsg::Checkpoint`]).
    fn request_checkpoint(
        &mut self,
        root: &Path,
        keep: usize,
        config: String,
        tokenizer_sha256: Option<String>,
        background: bool,
        export: Option<&Path>,
    ) -> Result<CheckpointReport, RuntimeError> {
        let (root, export) = (root.to_path_buf(), export.map(Path::to_path_buf));
        self.call_sup(|reply| SupMsg::Checkpoint {
            root,
            keep,
            config,
            tokenizer_sha256,
            background,
            export,
            reply,
        })
    }

    /// Waits for the background checkpoint write in flight, if any, and says how it ended.
    pub fn finish_checkpoint(&mut self) -> Result<Option<WriteDone>, RuntimeError> {
        self.call_sup(|reply| SupMsg::FinishCheckpoint { reply })
    }

    /// Continues after `step` completed steps with the data at `cursor`.
    pub fn set_position(&mut self, step: u64, cursor: Option<Cursor>) -> Result<(), RuntimeError> {
        self.call_sup(|reply| SupMsg::SetPosition {
            step,
            cursor,
            reply,
        })
    }

    pub fn plan(&self) -> &PipelinePlan {
        &self.plan
    }

    /// Every data-parallel replica's placement (one without data parallelism).
    pub fn replica_plans(&self) -> &[PipelinePlan] {
        &self.replica_plans
    }

    pub fn backend(&self) -> &Arc<dyn ComputeBackend> {
        &self.backend
    }

    pub fn param_count(&self) -> u64 {
        self.param_count
    }

    /// Layers per stage, counted from its last, that the next training step keeps the graph
    /// of (`auto`: what it chose, once its two measured steps have run).
    pub fn keep_activations(&self) -> usize {
        self.keep.get()
    }

    /// Whether [`keep_activations`](Self::keep_activations) is final: a fixed number, or
    /// `auto` done measuring.
    pub fn keep_activations_settled(&self) -> bool {
        self.keep.settled()
    }

    /// Sets the layers per stage that keep their graph from the next step on (a fixed
    /// number: `auto`, while it measures, sets its own before each step).
    pub fn set_keep_activations(&self, n: usize) {
        self.keep.set(n);
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

    fn block<T>(&self, f: impl Future<Output = Result<T, RuntimeError>>) -> Result<T, EngineError> {
        self.rt.block_on(f).map_err(EngineError::from)
    }

    /// Greedy continuation of `prompt` through the layer actors (see
    /// [`nsactor_engine::engine::greedy`]).
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
            nsactor_engine::decode::SamplingParams::greedy(),
        )
    }

    /// Continuation of `prompt` through the layer actors, tokens chosen by `sampling` (see
    /// [`nsactor_engine::engine::generate`]).
    pub fn generate(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
        eos: Option<i64>,
        suppress: &[i64],
        sampling: nsactor_engine::decode::SamplingParams,
    ) -> Result<Vec<i64>, EngineError> {
        let mut d = PipelineSession {
            p: self,
            session: self.sessions.session(),
            open: false,
        };
        nsactor_engine::engine::generate(&mut d, prompt, max_new_tokens, eos, suppress, sampling)
    }

    /// Masked mean cross entropy of `b` (no gradients, no session): each layer's training
    /// forward ([`evaluate_layers`]), so a held-out evaluation runs the kernels the training
    /// steps compiled and chose at their shapes.
    pub fn eval_ce(&mut self, b: &Batch) -> Result<f64, EngineError> {
        b.validate()?;
        let d = &self.sessions;
        self.block(async {
            let h = d.embed(b.inputs.clone(), b.batch, b.seq_len).await?;
            let children = d.children();
            let h = evaluate_layers(&children.layers, h).await?;
            let batch = Arc::new(b.clone());
            ask(&children.edge, "edge", |reply| EdgeMsg::HeadEval {
                h,
                batch,
                reply,
            })
            .await
        })
    }
}

impl Pipeline {
    /// One sequence through every layer and the edge for the interpretability study: each
    /// layer's E[K] per token and β(t) distribution, and the surprisal of every next token.
    pub fn probe(&mut self, ids: &[i64]) -> Result<super::probe::SequenceProbe, EngineError> {
        self.block(super::probe::probe_sequence(&self.sessions, ids))
    }
}

struct PipelineSession<'a> {
    p: &'a Pipeline,
    session: SessionId,
    open: bool,
}

impl DecodeSession for PipelineSession<'_> {
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
