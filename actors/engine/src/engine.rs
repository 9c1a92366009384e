//! The model as a set of stages on one backend, driven in order on the calling thread: the
//! reference schedule the actor pipeline must reproduce (one micro-batch at a time through the
//! edge and every layer, then the cross-stage optimizer step).

use crate::decode::{SamplingParams, TokenPicker};
pub use crate::placement::Placement;
use nsactor_plugin_api::optim::{clip_factor, phase2_layer_scales};
use nsactor_plugin_api::{
    Batch, BiasGradNorms, ComputeBackend, DeviceTensor, EngineError, ForwardOut, GradSumSquares,
    HeadOut, IdAllocator, InitialWeights, Loss, ModelConfig, OptimizerKind, SessionId, Stage,
    StageCall, StageKind, StageSnapshot, StageSpec, Tokens,
};
use std::sync::Arc;

/// Hyperparameters of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepParams {
    /// Base learning rate at this step.
    pub lr: f64,
    /// Learning rate of the neuron parameter group.
    pub neuron_lr: f64,
    /// λ of the ponder cost.
    pub ponder_weight: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
}

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Masked CE + λ·ponder, averaged over the micro-batches.
    pub loss: f64,
    /// Masked mean cross entropy, averaged over the micro-batches.
    pub ce: f64,
    /// Mean E[K] over layers, sublayers and tokens (the ponder cost), averaged over micro-batches.
    pub expected_k: f64,
    /// Smallest and largest per-token E[K] seen in the step.
    pub expected_k_min: f64,
    pub expected_k_max: f64,
    /// Global gradient norm after natural-gradient compensation, before clipping.
    pub grad_norm: f64,
    /// Loss-mask tokens in the step.
    pub tokens: u64,
    /// The loss or the gradient norm was not finite: the gradients were dropped and no
    /// parameter or optimizer state changed (the pipeline's bad-step policy).
    pub skipped: bool,
}

impl StepStats {
    /// Nothing accumulated yet.
    pub fn empty() -> Self {
        StepStats {
            loss: 0.0,
            ce: 0.0,
            expected_k: 0.0,
            expected_k_min: f64::INFINITY,
            expected_k_max: f64::NEG_INFINITY,
            grad_norm: 0.0,
            tokens: 0,
            skipped: false,
        }
    }

    /// Adds one of `m` micro-batches: its CE, mean ponder cost and E[K] range. Callers add in
    /// micro-batch order, so every schedule sums the same way.
    pub fn add_micro(
        &mut self,
        ce: f64,
        ponder: f64,
        lo: f64,
        hi: f64,
        m: f64,
        ponder_weight: f64,
    ) {
        self.ce += ce / m;
        self.expected_k += ponder / m;
        self.loss += (ce + ponder_weight * ponder) / m;
        self.expected_k_min = self.expected_k_min.min(lo);
        self.expected_k_max = self.expected_k_max.max(hi);
    }
}

/// Tokens of `b` that count toward the loss.
pub fn scored_tokens(b: &Batch) -> u64 {
    b.loss_mask.iter().filter(|&&v| v > 0.0).count() as u64
}

/// A model's stages taken apart (see [`StagedModel::into_parts`]).
pub struct StageParts {
    pub backend: Arc<dyn ComputeBackend>,
    /// The edge's spec; a layer's differs only in kind and device.
    pub spec: StageSpec,
    pub edge: Box<dyn Stage>,
    pub layers: Vec<Box<dyn Stage>>,
}

/// Every stage of one model on one backend.
pub struct StagedModel {
    backend: Arc<dyn ComputeBackend>,
    /// How every stage was opened (the stage kind and device aside).
    spec: StageSpec,
    placement: Placement,
    edge: Box<dyn Stage>,
    layers: Vec<Box<dyn Stage>>,
    /// Session and micro-batch ids.
    ids: IdAllocator,
    open_seconds: (f64, Vec<f64>),
}

impl StagedModel {
    /// Seconds the edge and each layer (in order) took to open (logged by the launcher).
    pub fn open_seconds(&self) -> (f64, &[f64]) {
        (self.open_seconds.0, &self.open_seconds.1)
    }

    /// Opens the edge and every layer, initialised from `seed`. `placement` defaults to
    /// everything on device 0.
    pub fn open(
        backend: Arc<dyn ComputeBackend>,
        model: &ModelConfig,
        seed: u64,
        optimizer: OptimizerKind,
        placement: Option<Placement>,
    ) -> Result<Self, EngineError> {
        Self::open_with(
            backend,
            model,
            seed,
            Some(optimizer),
            placement,
            InitialWeights::Seeded,
        )
    }

    /// [`open`](Self::open) with the stages' optimizer and first weights chosen: without an
    /// optimizer they serve or evaluate only (a checkpoint's Adam moments stay on disk); with
    /// [`InitialWeights::Loaded`] they draw none and refuse every call until they are loaded
    /// ([`load_stages`](Self::load_stages), or the pipeline's load).
    pub fn open_with(
        backend: Arc<dyn ComputeBackend>,
        model: &ModelConfig,
        seed: u64,
        optimizer: Option<OptimizerKind>,
        placement: Option<Placement>,
        weights: InitialWeights,
    ) -> Result<Self, EngineError> {
        model.validate()?;
        let n = model.num_layers;
        let placement = placement.unwrap_or_else(|| Placement::single(n));
        if placement.layers.len() != n {
            return Err(EngineError::InvalidInput(format!(
                "placement names {} layers, the model has {n}",
                placement.layers.len()
            )));
        }
        let spec = |kind, device| StageSpec {
            kind,
            device,
            model: model.clone(),
            seed,
            optimizer,
            weights,
        };
        let timed = |kind, device| {
            let t = std::time::Instant::now();
            backend
                .open_stage(&spec(kind, device))
                .map(|s| (s, t.elapsed().as_secs_f64()))
        };
        let (edge, edge_took) = timed(StageKind::Edge, placement.edge)?;
        let (layers, took): (Vec<_>, Vec<_>) = (0..n)
            .map(|i| timed(StageKind::Layer(i), placement.layers[i]))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        Ok(StagedModel {
            open_seconds: (edge_took, took),
            backend,
            spec: spec(StageKind::Edge, placement.edge),
            placement,
            edge,
            layers,
            ids: IdAllocator::new(),
        })
    }

    pub fn backend(&self) -> &Arc<dyn ComputeBackend> {
        &self.backend
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn param_count(&self) -> u64 {
        self.edge.param_count() + self.layers.iter().map(|l| l.param_count()).sum::<u64>()
    }

    fn to(&self, t: DeviceTensor, device: usize) -> Result<DeviceTensor, EngineError> {
        self.backend.to_device(t, device)
    }

    /// Forward and backward of one micro-batch; gradients accumulate in the stages. Returns
    /// `(ce, mean ponder cost, E[K] min, E[K] max)`.
    fn micro_batch(
        &mut self,
        b: &Batch,
        loss_scale: f64,
        ponder_weight: f64,
    ) -> Result<(f64, f64, f64, f64), EngineError> {
        b.validate()?;
        let m = self.ids.micro_batch();
        let tokens = Tokens {
            ids: &b.inputs,
            batch: b.batch,
            seq_len: b.seq_len,
        };
        let mut h = self
            .edge
            .call(StageCall::Embed { micro: m, tokens })?
            .into_tensor("Embed")?;
        let (mut ponder, mut ek_min, mut ek_max) = (0.0, f64::INFINITY, f64::NEG_INFINITY);
        for i in 0..self.layers.len() {
            let h_in = self.to(h, self.placement.layers[i])?;
            let r = ForwardOut::try_from(self.layers[i].call(StageCall::Forward {
                micro: m,
                h: h_in,
                keep_graph: false,
            })?)?;
            ponder += r.ponder_cost;
            ek_min = ek_min.min(r.expected_k.min);
            ek_max = ek_max.max(r.expected_k.max);
            h = r.h;
        }
        let l = self.layers.len() as f64;
        let h = self.to(h, self.placement.edge)?;
        let HeadOut { mut grad, loss } = self
            .edge
            .call(StageCall::Head {
                micro: m,
                h,
                targets: &b.targets,
                mask: &b.loss_mask,
                loss_scale,
            })?
            .try_into()?;
        let ce = loss.ce;
        // loss = ce + λ·Σ_l pc_l / L, scaled by `loss_scale`.
        let ponder_grad = ponder_weight * loss_scale / l;
        for i in (0..self.layers.len()).rev() {
            let g = self.to(grad, self.placement.layers[i])?;
            grad = self.layers[i]
                .call(StageCall::Backward {
                    micro: m,
                    grad: g,
                    ponder_grad,
                })?
                .into_tensor("Backward")?;
        }
        let grad = self.to(grad, self.placement.edge)?;
        self.edge
            .call(StageCall::EmbedBackward { micro: m, grad })?;
        Ok((ce, ponder / l, ek_min, ek_max))
    }

    /// Drops every stage's gradients and kept inputs.
    pub fn zero_grad(&mut self) -> Result<(), EngineError> {
        self.edge.call(StageCall::ZeroGrad)?;
        for l in &mut self.layers {
            l.call(StageCall::ZeroGrad)?;
        }
        Ok(())
    }

    /// One optimizer step over `micro_batches` (gradients averaged over them): forward and
    /// backward of each, natural-gradient compensation (phase 1 in each layer, phase 2 across
    /// layers), one global clip factor, then the optimizer on every stage.
    pub fn train_step(
        &mut self,
        micro_batches: &[Batch],
        p: &StepParams,
    ) -> Result<StepStats, EngineError> {
        let result = self.train_step_inner(micro_batches, p);
        if result.is_err() {
            // Leave no half-accumulated gradients behind; the step is skipped.
            let _ = self.zero_grad();
        }
        result
    }

    fn train_step_inner(
        &mut self,
        micro_batches: &[Batch],
        p: &StepParams,
    ) -> Result<StepStats, EngineError> {
        if micro_batches.is_empty() {
            return Err(EngineError::InvalidInput(
                "a step needs at least one micro-batch".into(),
            ));
        }
        let m = micro_batches.len() as f64;
        let mut s = StepStats::empty();
        for b in micro_batches {
            let (ce, ponder, lo, hi) = self.micro_batch(b, 1.0 / m, p.ponder_weight)?;
            s.add_micro(ce, ponder, lo, hi, m, p.ponder_weight);
            s.tokens += scored_tokens(b);
        }
        s.grad_norm = self.apply_step(p)?;
        Ok(s)
    }

    /// The cross-stage part of a step; returns the gradient norm before clipping.
    fn apply_step(&mut self, p: &StepParams) -> Result<f64, EngineError> {
        let norms = self
            .layers
            .iter_mut()
            .map(|l| BiasGradNorms::try_from(l.call(StageCall::GradStats)?))
            .collect::<Result<Vec<_>, EngineError>>()?;
        let scales = phase2_layer_scales(&norms);
        let GradSumSquares(mut sum_sq) = self
            .edge
            .call(StageCall::ScaleGrads { scales: [1.0; 3] })?
            .try_into()?;
        for (l, scales) in self.layers.iter_mut().zip(scales) {
            let GradSumSquares(s) = l.call(StageCall::ScaleGrads { scales })?.try_into()?;
            sum_sq += s;
        }
        let norm = sum_sq.sqrt();
        if !norm.is_finite() {
            return Err(EngineError::Backend(format!(
                "non-finite gradient norm {norm}; the step was skipped"
            )));
        }
        let clip = clip_factor(norm, p.max_grad_norm);
        let step = |s: &mut Box<dyn Stage>| {
            s.call(StageCall::Step {
                lr: p.lr,
                neuron_lr: p.neuron_lr,
                clip,
            })
        };
        step(&mut self.edge)?;
        for l in &mut self.layers {
            step(l)?;
        }
        Ok(norm)
    }

    /// Runs `tokens` through a fresh session of every stage and returns the last position's
    /// logits; the session stays open under the returned id.
    fn session_start(&mut self, tokens: Tokens<'_>) -> Result<(SessionId, Vec<f32>), EngineError> {
        let s = self.ids.session();
        let h = self.session_embed(tokens)?;
        let logits = self.session_run(s, h)?;
        Ok((s, logits))
    }

    /// Embeds `tokens` for decoding (nothing kept).
    fn session_embed(&mut self, tokens: Tokens<'_>) -> Result<DeviceTensor, EngineError> {
        self.edge
            .call(StageCall::SessionEmbed { tokens })?
            .into_tensor("SessionEmbed")
    }

    /// `h` through every layer of session `s`, returned on the edge's device.
    fn session_layers(
        &mut self,
        s: SessionId,
        mut h: DeviceTensor,
    ) -> Result<DeviceTensor, EngineError> {
        for i in 0..self.layers.len() {
            let h_in = self.to(h, self.placement.layers[i])?;
            h = self.layers[i]
                .call(StageCall::SessionForward {
                    sessions: &[s],
                    h: h_in,
                })?
                .into_tensor("SessionForward")?;
        }
        self.to(h, self.placement.edge)
    }

    /// `h` through every layer and the decode path of session `s`: last-position logits.
    fn session_run(&mut self, s: SessionId, h: DeviceTensor) -> Result<Vec<f32>, EngineError> {
        let h = self.session_layers(s, h)?;
        let logits = self
            .edge
            .call(StageCall::SessionDecode { sessions: &[s], h })?
            .into_tensor("SessionDecode")?;
        Ok(self.backend.to_host(&logits)?.data)
    }

    fn session_close(&mut self, s: SessionId) {
        let _ = self.edge.call(StageCall::SessionClose { session: s });
        for l in &mut self.layers {
            let _ = l.call(StageCall::SessionClose { session: s });
        }
    }

    /// Greedy continuation of `prompt` (see [`greedy`]).
    pub fn generate_greedy(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
        eos: Option<i64>,
        suppress: &[i64],
    ) -> Result<Vec<i64>, EngineError> {
        let mut d = StagedSession {
            model: self,
            session: None,
        };
        greedy(&mut d, prompt, max_new_tokens, eos, suppress)
    }

    /// Masked mean cross entropy of `b`, no gradients or sessions: each layer's training
    /// forward (`StageCall::Evaluate`).
    pub fn eval_ce(&mut self, b: &Batch) -> Result<f64, EngineError> {
        b.validate()?;
        let mut h = self.session_embed(Tokens {
            ids: &b.inputs,
            batch: b.batch,
            seq_len: b.seq_len,
        })?;
        for i in 0..self.layers.len() {
            let h_in = self.to(h, self.placement.layers[i])?;
            h = self.layers[i]
                .call(StageCall::Evaluate { h: h_in })?
                .into_tensor("Evaluate")?;
        }
        let h = self.to(h, self.placement.edge)?;
        self.edge
            .call(StageCall::HeadEval {
                h,
                targets: &b.targets,
                mask: &b.loss_mask,
            })?
            .try_into()
            .map(|l: Loss| l.ce)
    }

    /// Every stage's parameters and optimizer state (none for stages opened without an
    /// optimizer): the edge first, then layer 0, 1, ….
    pub fn save_stages(&self) -> Result<Vec<Vec<u8>>, EngineError> {
        let mut out = vec![self.edge.save()?];
        for l in &self.layers {
            out.push(l.save()?);
        }
        Ok(out)
    }

    /// Every stage's [`snapshot`](nsactor_plugin_api::Stage::snapshot), in the order of
    /// [`save_stages`](Self::save_stages): serialised later, from any thread.
    pub fn snapshot_stages(&self) -> Result<Vec<Box<dyn StageSnapshot>>, EngineError> {
        let mut out = vec![self.edge.snapshot()?];
        for l in &self.layers {
            out.push(l.snapshot()?);
        }
        Ok(out)
    }

    /// Restores from per-stage bytes as [`save_stages`](Self::save_stages) wrote them.
    pub fn load_stages(&mut self, shards: &[Vec<u8>]) -> Result<(), EngineError> {
        if shards.len() != self.layers.len() + 1 {
            return Err(EngineError::InvalidInput(format!(
                "{} shards for {} stages",
                shards.len(),
                self.layers.len() + 1
            )));
        }
        self.edge.load(&shards[0])?;
        for (l, b) in self.layers.iter_mut().zip(&shards[1..]) {
            l.load(b)?;
        }
        Ok(())
    }

    /// The backend, the edge stage and the layer stages, for the actor runtime to own.
    pub fn into_parts(self) -> StageParts {
        StageParts {
            backend: self.backend,
            spec: self.spec,
            edge: self.edge,
            layers: self.layers,
        }
    }

    /// Loads one whole-model file's bytes (plain or HF names) into every stage.
    pub fn load_model_bytes(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        self.edge.load(bytes)?;
        for l in &mut self.layers {
            l.load(bytes)?;
        }
        Ok(())
    }
}

/// A decoding session: prompt prefill, then one token at a time.
pub trait DecodeSession {
    /// Runs `prompt` through a new session; the last position's logits.
    fn prefill(&mut self, prompt: &[i64]) -> Result<Vec<f32>, EngineError>;
    /// Feeds one token to the session; its logits.
    fn next(&mut self, token: i64) -> Result<Vec<f32>, EngineError>;
    /// Frees the session's state.
    fn close(&mut self);
}

/// Greedy (temperature 0) continuation of `prompt` by up to `max_new_tokens`, stopping after
/// `eos`; ids in `suppress` are never picked (HF's `suppress_tokens`). Returns prompt +
/// generated ids. Stateful: the prompt is prefilled once, then each token is one step through
/// every layer. The session is closed whatever happens.
pub fn greedy(
    d: &mut impl DecodeSession,
    prompt: &[i64],
    max_new_tokens: usize,
    eos: Option<i64>,
    suppress: &[i64],
) -> Result<Vec<i64>, EngineError> {
    generate(
        d,
        prompt,
        max_new_tokens,
        eos,
        suppress,
        SamplingParams::greedy(),
    )
}

/// [`greedy`] with any [`SamplingParams`].
pub fn generate(
    d: &mut impl DecodeSession,
    prompt: &[i64],
    max_new_tokens: usize,
    eos: Option<i64>,
    suppress: &[i64],
    sampling: SamplingParams,
) -> Result<Vec<i64>, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidInput("the prompt is empty".into()));
    }
    sampling
        .validate()
        .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    let mut picker = TokenPicker::new(sampling);
    let mut out = prompt.to_vec();
    let result = (|| {
        let mut logits = d.prefill(prompt)?;
        for i in 0..max_new_tokens {
            for &id in suppress {
                if let Some(l) = usize::try_from(id).ok().and_then(|i| logits.get_mut(i)) {
                    *l = f32::NEG_INFINITY;
                }
            }
            let next = picker.pick(&mut logits, &out);
            out.push(next);
            if Some(next) == eos || i + 1 == max_new_tokens {
                break;
            }
            logits = d.next(next)?;
        }
        Ok(())
    })();
    d.close();
    result.map(|()| out)
}

struct StagedSession<'a> {
    model: &'a mut StagedModel,
    session: Option<SessionId>,
}

impl DecodeSession for StagedSession<'_> {
    fn prefill(&mut self, prompt: &[i64]) -> Result<Vec<f32>, EngineError> {
        let (s, logits) = self.model.session_start(Tokens {
            ids: prompt,
            batch: 1,
            seq_len: prompt.len(),
        })?;
        self.session = Some(s);
        Ok(logits)
    }

    fn next(&mut self, token: i64) -> Result<Vec<f32>, EngineError> {
        let s = self.session.expect("prefill first");
        let h = self.model.session_embed(Tokens {
            ids: &[token],
            batch: 1,
            seq_len: 1,
        })?;
        self.model.session_run(s, h)
    }

    fn close(&mut self) {
        if let Some(s) = self.session.take() {
            self.model.session_close(s);
        }
    }
}

#[cfg(all(test, feature = "embedded-cpu"))]
mod tests;
