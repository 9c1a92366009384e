//! The edge as a stage: embedding, decode path and the tied head (one matrix, one owner).

use crate::graphs::DecodeGraphs;
use crate::kept::Snapshots;
use crate::layer::session_rows;
use crate::sessions::SessionTable;
use crate::state::{
    Trainer, check_call_loaded, check_loaded, count, initial_rng, load_stage, save_stage,
    snapshot_stage, sync,
};
use crate::{Ad, act, wrap};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use nsactor_kernels::SnnOps;
use nsactor_model::init::Rng;
use nsactor_model::model::cross_entropy_ignore_pad;
use nsactor_model::train::GradSet;
use nsactor_model::{Edge, ModelConfig};
use nsactor_plugin_api::{
    EngineError, GradStream, GradSumSquares, HeadOut, Loss, MicroBatchId, Reply, SessionId, Stage,
    StageCall, StageSnapshot, StageSpec, Tokens,
};
use std::collections::BTreeMap;

/// Frees the autodiff graphs of the process that no tensor refers to any more (the previous
/// parameters, a failed step's kept activations). Our burn-autodiff patch
/// (`kernels/vendor/README.md`) takes this sweep out of every `backward`, where it raced with
/// the graphs other stage threads were building and now and then dropped a step of theirs — a
/// gradient contribution silently lost. The optimizer phase and `ZeroGrad` are the points where
/// no stage of a step builds or differentiates a graph; the edge, one per replica, sweeps there.
fn sweep_graphs() {
    burn_autodiff::sweep_orphaned_graphs();
}

pub struct EdgeStage<B: SnnOps> {
    cfg: ModelConfig,
    device: B::Device,
    ad: Edge<Ad<B>>,
    inner: Edge<B>,
    /// The head's gradients and the embedding's in two streams
    /// ([`GradStream::HEAD`], [`GradStream::EMBEDDING`]), added together only in the optimizer
    /// phase: a pipeline may run micro-batch m + 1's head before m's embedding backward, and
    /// keeping the two sums apart makes the result independent of that interleaving.
    trainer: Trainer<B>,
    /// Token ids of training micro-batches awaiting `EmbedBackward`.
    kept: BTreeMap<MicroBatchId, Tensor<B, 2, Int>>,
    /// Output-neuron membranes of decoding sessions.
    sessions: SessionTable<B>,
    /// Copies of sessions' states kept for the prefix cache.
    snapshots: Snapshots<B>,
    /// Decoding steps of the head captured per set of sessions (CUDA graphs).
    graphs: DecodeGraphs<B>,
    /// Opened to load its weights, which have not come yet: every call but the load is
    /// refused (as [`crate::layer::LayerStage`]'s).
    awaiting_load: bool,
}

impl<B: SnnOps> EdgeStage<B> {
    pub fn new(cfg: ModelConfig, spec: &StageSpec, device: B::Device) -> Self {
        let ad = Edge::<Ad<B>>::init(&cfg, &mut initial_rng(spec, 0), &device);
        // The untracked twin takes the tracked one's parameters: nothing to draw for it.
        let mut inner = Edge::<B>::init(&cfg, &mut Rng::blank(), &device);
        sync::<B, _, _>(&ad, &mut inner);
        let widths = vec![cfg.d];
        EdgeStage {
            cfg,
            device,
            ad,
            inner,
            trainer: Trainer::new(spec.optimizer, 2),
            kept: BTreeMap::new(),
            sessions: SessionTable::default(),
            snapshots: Snapshots::new(widths),
            graphs: DecodeGraphs::default(),
            awaiting_load: spec.weights == nsactor_plugin_api::InitialWeights::Loaded,
        }
    }

    fn ids(&self, tokens: Tokens<'_>) -> Result<Tensor<B, 2, Int>, EngineError> {
        tokens.validate()?;
        let vocab = self.cfg.vocab_size as i64;
        if let Some(bad) = tokens.ids.iter().find(|&&id| id < 0 || id >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (0..{vocab})"
            )));
        }
        Ok(Tensor::from_data(
            TensorData::new(tokens.ids.to_vec(), [tokens.batch, tokens.seq_len]),
            &self.device,
        ))
    }

    /// Checks `h` `[T, B, D]` against `n` targets and mask values (row-major `[B, T]`).
    fn check_head(
        &self,
        h: &Tensor<B, 3>,
        targets: &[i64],
        mask: &[f32],
    ) -> Result<(), EngineError> {
        let [t, b, d] = h.dims();
        let n = t * b;
        if d != self.cfg.d || n == 0 || targets.len() != n || mask.len() != n {
            return Err(EngineError::InvalidInput(format!(
                "Head: h [{t}, {b}, {d}] needs D = {} and {n} targets and mask values, got {} and {}",
                self.cfg.d,
                targets.len(),
                mask.len()
            )));
        }
        let vocab = self.cfg.vocab_size as i64;
        if let Some(bad) = targets.iter().find(|&&id| id < 0 || id >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "target id {bad} is outside the vocabulary (0..{vocab})"
            )));
        }
        Ok(())
    }

    /// Masked mean CE of `h` (any backend: `Ad<B>` for training, `B` for evaluation).
    fn ce<C: SnnOps<Device = B::Device>>(
        edge: &Edge<C>,
        cfg: &ModelConfig,
        device: &B::Device,
        h: Tensor<C, 3>,
        targets: &[i64],
        mask: &[f32],
    ) -> (Tensor<C, 1>, Tensor<C, 1>) {
        let [t, b, d] = h.dims();
        let (logits, _) = edge.decode(h, Tensor::zeros([b, d], device), cfg);
        let targets =
            Tensor::<C, 2, Int>::from_data(TensorData::new(targets.to_vec(), [b, t]), device);
        let mask = Tensor::<C, 2>::from_data(TensorData::new(mask.to_vec(), [b, t]), device);
        let per_token = cross_entropy_ignore_pad(logits, targets);
        let mask_sum = mask.clone().sum();
        let ce = (per_token * mask).sum() / mask_sum.clone().clamp_min(1.0);
        (ce, mask_sum)
    }

    fn head(
        &mut self,
        micro: MicroBatchId,
        h: Tensor<B, 3>,
        targets: &[i64],
        mask: &[f32],
        loss_scale: f64,
    ) -> Result<Reply, EngineError> {
        self.check_head(&h, targets, mask)?;
        let h = Tensor::<Ad<B>, 3>::from_inner(h).require_grad();
        let (ce, mask_sum) = Self::ce(&self.ad, &self.cfg, &self.device, h.clone(), targets, mask);
        let loss = Loss {
            ce: ce.clone().inner().into_scalar().elem::<f64>(),
            mask_sum: mask_sum.inner().into_scalar().elem::<f64>(),
        };
        let grads = (ce * loss_scale).backward();
        let dh = h
            .grad(&grads)
            .ok_or_else(|| EngineError::Backend("no gradient reached the head input".into()))?;
        let g = GradSet::collect::<Ad<B>, _>(&self.ad, "", &grads);
        // Heads come in micro-batch order (the edge actor runs them so).
        self.trainer
            .streams
            .accumulate(GradStream::HEAD, micro, g, None);
        Ok(HeadOut {
            grad: wrap(dh),
            loss,
        }
        .into())
    }

    fn embed_backward(
        &mut self,
        micro: MicroBatchId,
        grad: Tensor<B, 3>,
    ) -> Result<Reply, EngineError> {
        let ids = self.kept.remove(&micro).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "EmbedBackward for {micro}, which has no Embed in flight"
            ))
        })?;
        let [b, t] = ids.dims();
        if grad.dims() != [t, b, self.cfg.d] {
            return Err(EngineError::InvalidInput(format!(
                "EmbedBackward gradient {:?} does not match the embedding [{t}, {b}, {}]",
                grad.dims(),
                self.cfg.d
            )));
        }
        let e = self.ad.embed(Tensor::from_inner(ids));
        let grads = (e * Tensor::from_inner(grad)).sum().backward();
        let g = GradSet::collect::<Ad<B>, _>(&self.ad, "", &grads);
        let first_in_flight = self.kept.keys().next().copied();
        self.trainer
            .streams
            .accumulate(GradStream::EMBEDDING, micro, g, first_in_flight);
        Ok(Reply::none())
    }

    /// The decode path of `sessions`' rows from their output-neuron states: the last
    /// position's logits `[1, B, V]`, or with `every` every position's `[T, B, V]`.
    fn session_decode(
        &mut self,
        sessions: &[u64],
        h: Tensor<B, 3>,
        every: bool,
    ) -> Result<Tensor<B, 3>, EngineError> {
        let [t, b, d] = h.dims();
        if d != self.cfg.d || t == 0 || b == 0 {
            return Err(EngineError::InvalidInput(format!(
                "SessionDecode: expected [T, B, {}], got [{t}, {b}, {d}]",
                self.cfg.d
            )));
        }
        let rows = session_rows(sessions, b, "SessionDecode")?;
        let device = &self.device;
        let v0 = self
            .sessions
            .take(sessions, rows, |k| vec![Tensor::zeros([k, d], device)])?
            .pop()
            .expect("one field");
        let (inner, cfg) = (&self.inner, &self.cfg);
        let graphs = &mut self.graphs;
        let (logits, v) = nsactor_kernels::decoding_gemms(|| {
            graphs.step(sessions, h, vec![v0], device, |h, mut v| {
                let (logits, v) = inner.decode(h, v.pop().expect("one field"), cfg);
                (logits, vec![v])
            })
        });
        self.sessions.put(sessions, rows, v);
        let vocab = self.cfg.vocab_size;
        if every {
            // `[B, T, V]` → `[T, B, V]`, as the activations run.
            return Ok(logits.reshape([b, t, vocab]).swap_dims(0, 1));
        }
        Ok(logits.narrow(1, t - 1, 1).reshape([1, b, vocab]))
    }

    /// `session_decode`, then every row's next token chosen on the device
    /// ([`crate::sample::pick`]): `[picked [1, 2, B], logits [1, B, V]]`.
    fn session_sample(
        &mut self,
        sessions: &[u64],
        h: Tensor<B, 3>,
        picks: nsactor_plugin_api::Picks<'_>,
    ) -> Result<Reply, EngineError> {
        let b = h.dims()[1];
        let vocab = self.cfg.vocab_size;
        let rows = picks
            .parse(vocab)
            .map_err(|e| EngineError::InvalidInput(format!("SessionSample: {e}")))?;
        if rows.len() != b {
            return Err(EngineError::InvalidInput(format!(
                "SessionSample: {} picks for {b} rows",
                rows.len()
            )));
        }
        let last = self.session_decode(sessions, h, false)?;
        let picked = crate::sample::pick(last.clone().reshape([b, vocab]), &rows);
        Ok(Reply {
            tensors: vec![wrap(picked.unsqueeze::<3>()), wrap(last)],
            scalars: Vec::new(),
        })
    }
}

impl<B: SnnOps> Stage for EdgeStage<B> {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        let name = call.name();
        check_call_loaded(self.awaiting_load, || "the edge".into(), &call)?;
        let call = match self.trainer.exchange(&self.ad, "", call) {
            Ok(r) => return r,
            Err(other) => other,
        };
        let call = match self.snapshots.call(&mut self.sessions, call) {
            Ok(r) => return r,
            Err(other) => other,
        };
        match call {
            StageCall::Embed { micro, tokens } => {
                if self.kept.contains_key(&micro) {
                    return Err(EngineError::InvalidInput(format!(
                        "{micro} is already in flight"
                    )));
                }
                let ids = self.ids(tokens)?;
                let h = self.inner.embed(ids.clone());
                self.kept.insert(micro, ids);
                Ok(Reply::tensor(wrap(h)))
            }
            StageCall::Head {
                micro,
                h,
                targets,
                mask,
                loss_scale,
            } => self.head(micro, act(h, name)?, targets, mask, loss_scale),
            StageCall::HeadEval { h, targets, mask } => {
                let h = act::<B>(h, name)?;
                self.check_head(&h, targets, mask)?;
                let (ce, n) = Self::ce(&self.inner, &self.cfg, &self.device, h, targets, mask);
                Ok(Loss {
                    ce: ce.into_scalar().elem::<f64>(),
                    mask_sum: n.into_scalar().elem::<f64>(),
                }
                .into())
            }
            StageCall::EmbedBackward { micro, grad } => {
                self.embed_backward(micro, act(grad, name)?)
            }
            StageCall::GradStats => Ok(Reply::none()),
            StageCall::ScaleGrads { .. } => {
                self.trainer.flush();
                Ok(GradSumSquares(self.trainer.sum_squares()).into())
            }
            StageCall::Step {
                lr,
                neuron_lr,
                clip,
            } => {
                self.trainer.flush();
                self.trainer.step(&mut self.ad, "", lr, neuron_lr, clip)?;
                sync::<B, _, _>(&self.ad, &mut self.inner);
                self.graphs.clear();
                sweep_graphs();
                Ok(Reply::none())
            }
            StageCall::ZeroGrad => {
                self.trainer.clear();
                self.kept.clear();
                sweep_graphs();
                Ok(Reply::none())
            }
            StageCall::SessionEmbed { tokens } => {
                let ids = self.ids(tokens)?;
                let h = self.inner.embed(ids);
                // The layers that read it are another thread's work: the device starts now.
                B::flush(&self.device);
                Ok(Reply::tensor(wrap(h)))
            }
            StageCall::SessionDecode { sessions, h } => Ok(Reply::tensor(wrap(
                self.session_decode(SessionId::raw(sessions), act(h, name)?, false)?,
            ))),
            StageCall::SessionDecodeAll { sessions, h } => Ok(Reply::tensor(wrap(
                self.session_decode(SessionId::raw(sessions), act(h, name)?, true)?,
            ))),
            StageCall::SessionSample { sessions, h, picks } => {
                self.session_sample(SessionId::raw(sessions), act(h, name)?, picks)
            }
            StageCall::SessionClose { session } => {
                self.sessions.close(session.0);
                self.graphs.close(session.0);
                Ok(Reply::none())
            }
            StageCall::TokenLosses { h, targets } => {
                crate::probe::token_losses(&self.inner, &self.cfg, act(h, name)?, targets)
            }
            other => Err(EngineError::InvalidInput(format!(
                "{} is a layer call; the edge cannot serve it",
                other.name()
            ))),
        }
    }

    fn save(&self) -> Result<Vec<u8>, EngineError> {
        check_loaded(self.awaiting_load, || "the edge".into(), "save")?;
        save_stage(&self.inner, "", self.trainer.adam.as_ref(), "edge")
    }

    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        check_loaded(self.awaiting_load, || "the edge".into(), "snapshot")?;
        Ok(Box::new(snapshot_stage(
            &self.inner,
            "",
            self.trainer.adam.as_ref(),
            "edge",
        )))
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        load_stage::<B, _>(&mut self.ad, "", self.trainer.adam.as_mut(), bytes, "edge")?;
        sync::<B, _, _>(&self.ad, &mut self.inner);
        self.trainer.clear();
        self.kept.clear();
        self.sessions.clear();
        self.snapshots.clear();
        self.graphs.clear();
        self.awaiting_load = false;
        Ok(())
    }

    fn param_count(&self) -> u64 {
        count(&self.inner)
    }
}
