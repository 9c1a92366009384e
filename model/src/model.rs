//! The whole NeuronSpark language model: edge + decoder layers, forward, loss and stateful decoding.

use crate::config::ModelConfig;
use crate::edge::Edge;
use crate::init::{Rng, part_seed};
use crate::layer::{LayerState, SnnDecoderLayer};
use crate::params::{ParamMapper, ParamVisitor, Params};
use burn::tensor::{Int, Tensor, activation::log_softmax, backend::Backend};
use nsactor_kernels::SnnOps;

#[derive(Debug, Clone)]
pub struct NeuronSpark<B: Backend> {
    pub config: ModelConfig,
    pub edge: Edge<B>,
    pub layers: Vec<SnnDecoderLayer<B>>,
}

impl<B: Backend> Params<B> for NeuronSpark<B> {
    fn visit_params<V: ParamVisitor<B>>(&self, prefix: &str, v: &mut V) {
        self.edge.visit_params(prefix, v);
        self.layers.visit_params(&format!("{prefix}layers."), v);
    }
    fn map_params<M: ParamMapper<B>>(&mut self, prefix: &str, m: &mut M) {
        self.edge.map_params(prefix, m);
        self.layers.map_params(&format!("{prefix}layers."), m);
    }
}

/// Everything decoding carries between tokens: one [`LayerState`] per layer plus the output neuron.
#[derive(Debug, Clone)]
pub struct ModelState<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    pub output: Tensor<B, 2>,
}

impl<B: Backend> ModelState<B> {
    pub fn zeros(cfg: &ModelConfig, batch: usize, device: &B::Device) -> Self {
        ModelState {
            layers: (0..cfg.num_layers)
                .map(|_| LayerState::zeros(cfg, batch, device))
                .collect(),
            output: Tensor::zeros([batch, cfg.d], device),
        }
    }
}

/// A full forward pass.
#[derive(Debug, Clone)]
pub struct ForwardOutput<B: Backend> {
    /// `[B, T, V]`.
    pub logits: Tensor<B, 3>,
    /// `Σ_l pc_l / L` (scalar `[1]`).
    pub ponder_cost: Tensor<B, 1>,
    pub state: ModelState<B>,
}

/// Loss terms of one batch.
#[derive(Debug, Clone)]
pub struct LossOutput<B: Backend> {
    /// `Σ(ce·mask)/Σmask + λ·ponder_cost` (scalar `[1]`).
    pub loss: Tensor<B, 1>,
    /// Cross entropy per target `[B, T]`, 0 where the target is the pad id 0.
    pub per_token_ce: Tensor<B, 2>,
    pub ce_masked_mean: Tensor<B, 1>,
    pub ponder_cost: Tensor<B, 1>,
}

impl<B: SnnOps> NeuronSpark<B> {
    /// A freshly initialised model (SPEC §5) from `seed`.
    pub fn init(config: &ModelConfig, seed: u64, device: &B::Device) -> Self {
        let edge = Edge::init(config, &mut Rng::new(part_seed(seed, 0)), device);
        let layers = (0..config.num_layers)
            .map(|i| {
                let mut rng = Rng::new(part_seed(seed, i as u64 + 1));
                SnnDecoderLayer::init(config, &mut rng, device)
            })
            .collect();
        NeuronSpark {
            config: config.clone(),
            edge,
            layers,
        }
    }

    /// Forward over `ids` `[B, T]` from `state` (all zeros for training).
    pub fn forward_from(&self, ids: Tensor<B, 2, Int>, state: ModelState<B>) -> ForwardOutput<B> {
        let cfg = &self.config;
        let mut h = self.edge.embed(ids);
        let mut ponder = Vec::with_capacity(self.layers.len());
        let mut states = Vec::with_capacity(self.layers.len());
        for (layer, st) in self.layers.iter().zip(state.layers) {
            let out = layer.forward(h, st, cfg);
            ponder.push(out.ponder_cost());
            h = out.h;
            states.push(out.state);
        }
        let (logits, output) = self.edge.decode(h, state.output, cfg);
        let ponder_cost = Tensor::cat(ponder, 0).mean();
        ForwardOutput {
            logits,
            ponder_cost,
            state: ModelState {
                layers: states,
                output,
            },
        }
    }

    /// Training forward: all membranes start at rest.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> ForwardOutput<B> {
        let [b, _] = ids.dims();
        let state = ModelState::zeros(&self.config, b, &ids.device());
        self.forward_from(ids, state)
    }

    /// Loss of SPEC §2.5: masked mean cross entropy (ignore id 0) plus `ponder_weight · E[K]`.
    /// `targets` `[B, T]`, `mask` `[B, T]` (1 where the target counts). An all-zero mask gives a
    /// zero CE term instead of the reference's NaN.
    pub fn loss(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        mask: Tensor<B, 2>,
        ponder_weight: f64,
    ) -> LossOutput<B> {
        let out = self.forward(ids);
        let per_token_ce = cross_entropy_ignore_pad(out.logits, targets);
        let denom = mask.clone().sum().clamp_min(1.0);
        let ce_masked_mean = (per_token_ce.clone() * mask).sum() / denom;
        let loss = ce_masked_mean.clone() + out.ponder_cost.clone() * ponder_weight;
        LossOutput {
            loss,
            per_token_ce,
            ce_masked_mean,
            ponder_cost: out.ponder_cost,
        }
    }
}

/// Per-target cross entropy `[B, T]` with `ignore_index = 0`.
pub fn cross_entropy_ignore_pad<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 2> {
    let [b, t, _] = logits.dims();
    let logp = log_softmax(logits, 2);
    let picked = logp
        .gather(2, targets.clone().reshape([b, t, 1]))
        .reshape([b, t]);
    let keep = targets.not_equal_elem(0).float();
    picked.neg() * keep
}
