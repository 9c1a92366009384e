//! One decoder layer as a stage.

use crate::graphs::DecodeGraphs;
use crate::kept::Snapshots;
use crate::sessions::SessionTable;
use crate::state::{
    Trainer, check_call_loaded, check_loaded, count, initial_rng, load_stage, norms, save_stage,
    snapshot_stage, sync,
};
use crate::{Ad, act, wrap};
use burn::tensor::{ElementConversion, Tensor};
use nsactor_kernels::SnnOps;
use nsactor_model::init::Rng;
use nsactor_model::train::{GradSet, MODULATION_BIASES, compensate_phase1};
use nsactor_model::{LayerState, ModelConfig, SnnDecoderLayer};
use nsactor_plugin_api::{
    BiasGradNorms, EngineError, ForwardOut, GradStream, GradSumSquares, MicroBatchId, Reply,
    SessionId, Spread, Stage, StageCall, StageSnapshot, StageSpec,
};
use std::collections::BTreeMap;

/// What a training forward keeps for its backward.
enum Kept<B: SnnOps> {
    /// The input: the backward recomputes the forward under autodiff (activation
    /// checkpointing, the default).
    Input(Tensor<B, 3>),
    /// The forward's autodiff graph (`StageCall::Forward { keep_graph: true }`): the input as
    /// the graph's leaf, the output and the ponder cost, built in the order the recompute
    /// builds them, so the gradients are the same.
    Graph {
        h: Tensor<Ad<B>, 3>,
        out: Tensor<Ad<B>, 3>,
        ponder_cost: Tensor<Ad<B>, 1>,
    },
}

impl<B: SnnOps> Kept<B> {
    fn dims(&self) -> [usize; 3] {
        match self {
            Kept::Input(h) => h.dims(),
            Kept::Graph { h, .. } => h.dims(),
        }
    }
}

/// Decoder layer `index`: parameters `layers.{index}.*`.
pub struct LayerStage<B: SnnOps> {
    index: usize,
    prefix: String,
    cfg: ModelConfig,
    device: B::Device,
    ad: SnnDecoderLayer<Ad<B>>,
    inner: SnnDecoderLayer<B>,
    trainer: Trainer<B>,
    /// Training micro-batches awaiting their backward.
    kept: BTreeMap<MicroBatchId, Kept<B>>,
    sessions: SessionTable<B>,
    /// Copies of sessions' states kept for the prefix cache.
    snapshots: Snapshots<B>,
    /// Decoding steps captured per set of sessions (CUDA graphs).
    graphs: DecodeGraphs<B>,
    /// Opened to load its weights ([`InitialWeights::Loaded`]), which have not come yet:
    /// every call but the load is refused.
    ///
    /// [`InitialWeights::Loaded`]: nsactor_plugin_api::InitialWeights::Loaded
    awaiting_load: bool,
}

impl<B: SnnOps> LayerStage<B> {
    pub fn new(cfg: ModelConfig, index: usize, spec: &StageSpec, device: B::Device) -> Self {
        let ad =
            SnnDecoderLayer::<Ad<B>>::init(&cfg, &mut initial_rng(spec, index as u64 + 1), &device);
        // The untracked twin takes the tracked one's parameters: nothing to draw for it.
        let mut inner = SnnDecoderLayer::<B>::init(&cfg, &mut Rng::blank(), &device);
        sync::<B, _, _>(&ad, &mut inner);
        if index + 1 == cfg.num_layers {
            // The model's last layer: no more draws on this thread (a pipeline stage's process
            // that ends before it keeps its few buffers, `init::recycle`'s cap).
            nsactor_model::init::release_spares();
        }
        let widths = vec![cfg.d, cfg.dn(), cfg.d, 2 * cfg.d_ff];
        LayerStage {
            index,
            prefix: format!("layers.{index}."),
            cfg,
            device,
            ad,
            inner,
            trainer: Trainer::new(spec.optimizer, 1),
            kept: BTreeMap::new(),
            sessions: SessionTable::default(),
            snapshots: Snapshots::new(widths),
            graphs: DecodeGraphs::default(),
            awaiting_load: spec.weights == nsactor_plugin_api::InitialWeights::Loaded,
        }
    }

    fn label(&self) -> String {
        format!("layer {}", self.index)
    }

    fn check_h(&self, h: &Tensor<B, 3>, what: &str) -> Result<(), EngineError> {
        let [t, b, d] = h.dims();
        if d != self.cfg.d || t == 0 || b == 0 {
            return Err(EngineError::InvalidInput(format!(
                "layer {} {what}: expected [T, B, {}], got [{t}, {b}, {d}]",
                self.index, self.cfg.d
            )));
        }
        Ok(())
    }

    fn forward(
        &mut self,
        micro: MicroBatchId,
        h: Tensor<B, 3>,
        keep_graph: bool,
    ) -> Result<Reply, EngineError> {
        self.check_h(&h, "Forward")?;
        if self.kept.contains_key(&micro) {
            return Err(EngineError::InvalidInput(format!(
                "layer {}: {micro} is already in flight",
                self.index
            )));
        }
        if keep_graph {
            return self.forward_kept(micro, h);
        }
        let out = self.forward_at_rest(h.clone());
        self.kept.insert(micro, Kept::Input(h));
        Self::forward_reply(out.ponder_cost(), &out.expected_k, out.h)
    }

    /// The untracked forward of `h` from membranes at rest (a training forward that keeps its
    /// input, or an evaluation).
    fn forward_at_rest(&self, h: Tensor<B, 3>) -> nsactor_model::LayerOutput<B> {
        let state = LayerState::zeros(&self.cfg, h.dims()[1], &self.device);
        self.inner.forward(h, state, &self.cfg)
    }

    /// [`forward`](Self::forward) under autodiff, keeping the graph for the backward.
    fn forward_kept(&mut self, micro: MicroBatchId, h: Tensor<B, 3>) -> Result<Reply, EngineError> {
        let b = h.dims()[1];
        let h = Tensor::<Ad<B>, 3>::from_inner(h).require_grad();
        let state = LayerState::zeros(&self.cfg, b, &self.device);
        let out = self.ad.forward(h.clone(), state, &self.cfg);
        // Right after the forward, as the recompute builds it (the same graph).
        let ponder_cost = out.ponder_cost();
        let expected_k: Vec<_> = out.expected_k.iter().map(|e| e.clone().inner()).collect();
        let reply = Self::forward_reply(
            ponder_cost.clone().inner(),
            &expected_k,
            out.h.clone().inner(),
        );
        self.kept.insert(
            micro,
            Kept::Graph {
                h,
                out: out.h,
                ponder_cost,
            },
        );
        reply
    }

    /// A training forward's reply: the output and `[ponder_cost, E[K] mean, min, max]`.
    fn forward_reply(
        ponder_cost: Tensor<B, 1>,
        expected_k: &[Tensor<B, 2>],
        out: Tensor<B, 3>,
    ) -> Result<Reply, EngineError> {
        let ek = flat_expected_k(expected_k);
        Ok(ForwardOut {
            h: wrap(out),
            ponder_cost: ponder_cost.into_scalar().elem::<f64>(),
            expected_k: Spread {
                mean: ek.clone().mean().into_scalar().elem::<f64>(),
                min: ek.clone().min().into_scalar().elem::<f64>(),
                max: ek.max().into_scalar().elem::<f64>(),
            },
        }
        .into())
    }

    fn backward(
        &mut self,
        micro: MicroBatchId,
        grad: Tensor<B, 3>,
        ponder_grad: f64,
    ) -> Result<Reply, EngineError> {
        let kept = self.kept.remove(&micro).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "layer {}: Backward for {micro}, which has no Forward in flight",
                self.index
            ))
        })?;
        if grad.dims() != kept.dims() {
            return Err(EngineError::InvalidInput(format!(
                "layer {}: Backward gradient {:?} does not match the input {:?}",
                self.index,
                grad.dims(),
                kept.dims()
            )));
        }
        let (h, out, ponder_cost) = match kept {
            Kept::Graph {
                h,
                out,
                ponder_cost,
            } => (h, out, ponder_cost),
            Kept::Input(h) => {
                let b = h.dims()[1];
                let h = Tensor::<Ad<B>, 3>::from_inner(h).require_grad();
                let state = LayerState::zeros(&self.cfg, b, &self.device);
                let out = self.ad.forward(h.clone(), state, &self.cfg);
                // Built right after the forward, as the layer built it before it became a
                // method: the same graph order, so the same gradients bit for bit.
                let ponder_cost = out.ponder_cost();
                (h, out.h, ponder_cost)
            }
        };
        let mut objective = (out * Tensor::from_inner(grad)).sum();
        if ponder_grad != 0.0 {
            objective = objective + ponder_cost * ponder_grad;
        }
        let grads = objective.backward();
        let dh = h
            .grad(&grads)
            .ok_or_else(|| EngineError::Backend("no gradient reached the layer input".into()))?;
        let g = GradSet::collect::<Ad<B>, _>(&self.ad, &self.prefix, &grads);
        let first_in_flight = self.kept.keys().next().copied();
        self.trainer
            .streams
            .accumulate(GradStream::LAYER, micro, g, first_in_flight);
        Ok(Reply::tensor(wrap(dh)))
    }

    fn bias_name(&self, bias: &str) -> String {
        format!("{}snn_block.{bias}", self.prefix)
    }

    /// Phase 1, then the norms phase 2 needs.
    fn grad_stats(&mut self) -> Result<Reply, EngineError> {
        let names = [self.bias_name("b_beta"), self.bias_name("b_alpha")];
        let all = MODULATION_BIASES.map(|b| self.bias_name(b));
        self.trainer.flush();
        let grads = self.trainer.grads.as_mut().ok_or_else(|| {
            EngineError::InvalidInput(format!("layer {}: GradStats without gradients", self.index))
        })?;
        let mut gb = grads.get(&names[0]).cloned();
        let mut ga = grads.get(&names[1]).cloned();
        compensate_phase1(
            self.inner.snn_block.b_beta.clone(),
            self.inner.snn_block.b_alpha.clone(),
            gb.as_mut(),
            ga.as_mut(),
        );
        for (name, g) in names.iter().zip([gb, ga]) {
            if let Some(g) = g {
                *grads.get_mut(name).expect("present") = g;
            }
        }
        let [b_beta, b_alpha, b_th] = norms(all.each_ref().map(|n| grads.get(n)));
        Ok(BiasGradNorms {
            b_beta,
            b_alpha,
            b_th,
        }
        .into())
    }

    fn scale_grads(&mut self, scales: [f64; 3]) -> Result<Reply, EngineError> {
        let names: Vec<String> = MODULATION_BIASES
            .iter()
            .map(|b| self.bias_name(b))
            .collect();
        if let Some(grads) = self.trainer.grads.as_mut() {
            for (name, s) in names.iter().zip(scales) {
                if s != 1.0
                    && let Some(g) = grads.get_mut(name)
                {
                    *g = g.clone() * s;
                }
            }
        }
        Ok(GradSumSquares(self.trainer.sum_squares()).into())
    }

    fn session_forward(&mut self, sessions: &[u64], h: Tensor<B, 3>) -> Result<Reply, EngineError> {
        self.check_h(&h, "SessionForward")?;
        let rows = session_rows(sessions, h.dims()[1], "SessionForward")?;
        let (cfg, device) = (&self.cfg, &self.device);
        let state = self.sessions.take(sessions, rows, |k| {
            state_fields(LayerState::zeros(cfg, k, device))
        })?;
        let (inner, cfg) = (&self.inner, &self.cfg);
        let graphs = &mut self.graphs;
        let device = &self.device;
        let (h, state) = nsactor_kernels::decoding_gemms(|| {
            graphs.step(sessions, h, state, device, |h, state| {
                let [input1, hidden, input2, ffn]: [Tensor<B, 2>; 4] =
                    state.try_into().expect("layer states have four fields");
                let state = LayerState {
                    input1,
                    hidden,
                    input2,
                    ffn,
                };
                let out = inner.forward(h, state, cfg);
                (out.h, state_fields(out.state))
            })
        });
        self.sessions.put(sessions, rows, state);
        Ok(Reply::tensor(wrap(h)))
    }
}

fn state_fields<B: SnnOps>(s: LayerState<B>) -> Vec<Tensor<B, 2>> {
    vec![s.input1, s.hidden, s.input2, s.ffn]
}

/// Batch rows per session of a call batching `sessions` over `batch` rows.
pub(crate) fn session_rows(
    sessions: &[u64],
    batch: usize,
    call: &str,
) -> Result<usize, EngineError> {
    if sessions.is_empty() || !batch.is_multiple_of(sessions.len()) {
        return Err(EngineError::InvalidInput(format!(
            "{call}: {} sessions cannot share a batch of {batch} rows",
            sessions.len()
        )));
    }
    Ok(batch / sessions.len())
}

impl<B: SnnOps> Stage for LayerStage<B> {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        let name = call.name();
        check_call_loaded(self.awaiting_load, || self.label(), &call)?;
        let call = match self.trainer.exchange(&self.ad, &self.prefix, call) {
            Ok(r) => return r,
            Err(other) => other,
        };
        let call = match self.snapshots.call(&mut self.sessions, call) {
            Ok(r) => return r,
            Err(other) => other,
        };
        match call {
            StageCall::Forward {
                micro,
                h,
                keep_graph,
            } => self.forward(micro, act(h, name)?, keep_graph),
            StageCall::Backward {
                micro,
                grad,
                ponder_grad,
            } => self.backward(micro, act(grad, name)?, ponder_grad),
            StageCall::GradStats => self.grad_stats(),
            StageCall::ScaleGrads { scales } => self.scale_grads(scales),
            StageCall::Step {
                lr,
                neuron_lr,
                clip,
            } => {
                self.trainer
                    .step(&mut self.ad, &self.prefix, lr, neuron_lr, clip)?;
                sync::<B, _, _>(&self.ad, &mut self.inner);
                self.graphs.clear();
                Ok(Reply::none())
            }
            StageCall::ZeroGrad => {
                self.trainer.clear();
                self.kept.clear();
                Ok(Reply::none())
            }
            StageCall::SessionForward { sessions, h } => {
                self.session_forward(SessionId::raw(sessions), act(h, name)?)
            }
            StageCall::SessionClose { session } => {
                self.sessions.close(session.0);
                self.graphs.close(session.0);
                Ok(Reply::none())
            }
            StageCall::Evaluate { h } => {
                let h = act(h, name)?;
                self.check_h(&h, "Evaluate")?;
                Ok(Reply::tensor(wrap(self.forward_at_rest(h).h)))
            }
            StageCall::Probe { h } => {
                let h = act(h, name)?;
                self.check_h(&h, "Probe")?;
                Ok(crate::probe::probe_layer(&self.inner, &self.cfg, h))
            }
            other => Err(EngineError::InvalidInput(format!(
                "{} is an edge call; layer {} cannot serve it",
                other.name(),
                self.index
            ))),
        }
    }

    fn save(&self) -> Result<Vec<u8>, EngineError> {
        check_loaded(self.awaiting_load, || self.label(), "save")?;
        save_stage(
            &self.inner,
            &self.prefix,
            self.trainer.adam.as_ref(),
            &format!("layer {}", self.index),
        )
    }

    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        check_loaded(self.awaiting_load, || self.label(), "snapshot")?;
        Ok(Box::new(snapshot_stage(
            &self.inner,
            &self.prefix,
            self.trainer.adam.as_ref(),
            &format!("layer {}", self.index),
        )))
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        let label = self.label();
        load_stage::<B, _>(
            &mut self.ad,
            &self.prefix,
            self.trainer.adam.as_mut(),
            bytes,
            &label,
        )?;
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

/// Every `E[K]` of a layer's forward in one vector (what its reply's spread is taken over).
pub(crate) fn flat_expected_k<B: burn::tensor::backend::Backend>(
    expected_k: &[Tensor<B, 2>],
) -> Tensor<B, 1> {
    Tensor::cat(
        expected_k
            .iter()
            .map(|e| {
                let n = e.shape().num_elements();
                e.clone().reshape([n])
            })
            .collect(),
        0,
    )
}

/// Refuses a layer the model does not have.
pub(crate) fn check_layer(cfg: &ModelConfig, i: usize) -> Result<(), EngineError> {
    if i >= cfg.num_layers {
        return Err(EngineError::InvalidInput(format!(
            "layer {i} does not exist; the model has {} layers",
            cfg.num_layers
        )));
    }
    Ok(())
}
