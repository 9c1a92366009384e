//! One optimizer step's machinery (SPEC §7): gradients by name, natural-gradient compensation,
//! global-norm clipping, and Adam/AdamW with the neuron parameter group at a higher LR.
//!
//! Everything works on named flat gradients ([`GradSet`]) so the same code serves a single
//! process and the layer actors, which each own a slice of the parameters.

use crate::model::NeuronSpark;
use crate::params::{ParamMapper, ParamVisitor, Params, is_neuron_param};
use burn::tensor::{
    Tensor, TensorPrimitive, activation::sigmoid, backend::AutodiffBackend, backend::Backend,
};
use nsactor_kernels::{AdamStep, OptimOps};
use std::collections::BTreeMap;

/// Gradients by parameter name, flattened to 1-D, in the model's parameter order.
#[derive(Debug, Clone)]
pub struct GradSet<B: Backend> {
    pub entries: Vec<(String, Tensor<B, 1>)>,
}

pub use nsactor_kernels::reference::optim::square_sum;

impl<B: Backend> GradSet<B> {
    /// Collects the gradient of every parameter of `module` that received one.
    pub fn collect<AB, P>(module: &P, prefix: &str, grads: &AB::Gradients) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        P: Params<AB>,
    {
        struct Collect<'a, AB: AutodiffBackend> {
            grads: &'a AB::Gradients,
            out: Vec<(String, Tensor<AB::InnerBackend, 1>)>,
        }
        impl<AB: AutodiffBackend> ParamVisitor<AB> for Collect<'_, AB> {
            fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<AB, D>) {
                if let Some(g) = p.grad(self.grads) {
                    let n = g.shape().num_elements();
                    self.out.push((name.to_string(), g.reshape([n])));
                }
            }
        }
        let mut c = Collect::<AB> {
            grads,
            out: Vec::new(),
        };
        module.visit_params(prefix, &mut c);
        GradSet { entries: c.out }
    }

    pub fn get(&self, name: &str) -> Option<&Tensor<B, 1>> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, g)| g)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor<B, 1>> {
        self.entries
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, g)| g)
    }

    /// Adds `other`'s gradients (same parameters, same order) — gradient accumulation.
    pub fn accumulate(&mut self, other: GradSet<B>) {
        assert_eq!(
            self.entries.len(),
            other.entries.len(),
            "accumulating gradients of different parameter sets"
        );
        for ((name, g), (other_name, o)) in self.entries.iter_mut().zip(other.entries) {
            assert_eq!(
                *name, other_name,
                "accumulating gradients in a different order"
            );
            *g = g.clone() + o;
        }
    }
}

impl<B: OptimOps> GradSet<B> {
    /// Sum of squares of every gradient (for the global norm): every gradient's sum on the
    /// device ([`OptimOps::square_sums`]), read back in one transfer, added in f64.
    pub fn sum_squares(&self) -> f64 {
        if self.entries.is_empty() {
            return 0.0;
        }
        let ts = self
            .entries
            .iter()
            .map(|(_, g)| g.clone().into_primitive().tensor())
            .collect();
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::square_sums(ts)))
            .into_data()
            .convert::<f64>()
            .into_vec::<f64>()
            .expect("f64 values")
            .into_iter()
            .sum()
    }
}

use burn::tensor::ElementConversion;

pub use nsactor_plugin_api::optim::{MAX_COMP, MODULATION_BIASES, clip_factor, phase2_scales};

/// Natural-gradient compensation, phase 1 (SPEC §7.4), for one layer's SNNBlock biases:
/// `g_β /= max(σ(b_β)(1−σ(b_β)), 1/100)` and `g_α /= max(σ(b_α), 0.1)` — bias-only β, not β(t).
pub fn compensate_phase1<B: Backend>(
    b_beta: Tensor<B, 1>,
    b_alpha: Tensor<B, 1>,
    g_beta: Option<&mut Tensor<B, 1>>,
    g_alpha: Option<&mut Tensor<B, 1>>,
) {
    if let Some(g) = g_beta {
        let s = sigmoid(b_beta);
        let d = (s.clone() * (s.neg() + 1.0)).clamp_min(1.0 / MAX_COMP);
        *g = g.clone() / d;
    }
    if let Some(g) = g_alpha {
        *g = g.clone() / sigmoid(b_alpha).clamp_min(0.1);
    }
}

/// Applies phases 1 and 2 to the gradients of a whole model (single process).
pub fn natural_gradient<AB: AutodiffBackend>(
    model: &NeuronSpark<AB>,
    grads: &mut GradSet<AB::InnerBackend>,
) {
    let layers = model.layers.len();
    for (i, layer) in model.layers.iter().enumerate() {
        let name = |b: &str| format!("layers.{i}.snn_block.{b}");
        let g_beta = grads.get(&name("b_beta")).cloned();
        let g_alpha = grads.get(&name("b_alpha")).cloned();
        let (mut gb, mut ga) = (g_beta, g_alpha);
        compensate_phase1(
            layer.snn_block.b_beta.clone().inner(),
            layer.snn_block.b_alpha.clone().inner(),
            gb.as_mut(),
            ga.as_mut(),
        );
        if let Some(g) = gb {
            *grads.get_mut(&name("b_beta")).expect("present") = g;
        }
        if let Some(g) = ga {
            *grads.get_mut(&name("b_alpha")).expect("present") = g;
        }
    }
    for bias in MODULATION_BIASES {
        let names: Vec<String> = (0..layers)
            .map(|i| format!("layers.{i}.snn_block.{bias}"))
            .collect();
        let norms: Vec<Option<f64>> = names
            .iter()
            .map(|n| {
                grads
                    .get(n)
                    .map(|g| square_sum(g).sqrt().into_scalar().elem::<f64>())
            })
            .collect();
        for (name, s) in names.iter().zip(phase2_scales(&norms)) {
            if s != 1.0 {
                let g = grads.get_mut(name).expect("a scaled layer has a gradient");
                *g = g.clone() * s;
            }
        }
    }
}

/// Adam / AdamW hyperparameters (PyTorch semantics; eps 1e-8, not burn's 1e-5).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Weight decay of the base group.
    pub weight_decay: f64,
    /// Weight decay of the neuron group.
    pub neuron_weight_decay: f64,
    /// `true`: AdamW (decoupled decay); `false`: Adam (L2 added to the gradient).
    pub decoupled: bool,
}

impl AdamConfig {
    /// Pretraining: `torch.optim.Adam` defaults.
    pub fn adam() -> Self {
        AdamConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            neuron_weight_decay: 0.0,
            decoupled: false,
        }
    }

    /// SFT: AdamW with wd 0.01 on the base group, 0 on neuron parameters.
    pub fn adamw_sft() -> Self {
        AdamConfig {
            weight_decay: 0.01,
            decoupled: true,
            ..Self::adam()
        }
    }
}

/// Per-parameter Adam moments and step count, keyed by name.
#[derive(Debug, Clone)]
pub struct AdamState<B: Backend> {
    pub exp_avg: Tensor<B, 1>,
    pub exp_avg_sq: Tensor<B, 1>,
    pub step: u64,
}

#[derive(Debug, Clone)]
pub struct Adam<B: Backend> {
    pub config: AdamConfig,
    pub state: BTreeMap<String, AdamState<B>>,
}

impl<B: Backend> Adam<B> {
    pub fn new(config: AdamConfig) -> Self {
        Adam {
            config,
            state: BTreeMap::new(),
        }
    }
}

impl<B: OptimOps> Adam<B> {
    /// Updates every parameter of `module` that has a gradient in `grads`, each gradient first
    /// multiplied by `clip` (the global-norm clip's factor; 1 for none): base LR `lr`, neuron
    /// parameters (see [`is_neuron_param`]) at `neuron_lr`.
    pub fn step<AB, P>(
        &mut self,
        module: &mut P,
        prefix: &str,
        grads: &GradSet<B>,
        lr: f64,
        neuron_lr: f64,
        clip: f64,
    ) where
        AB: AutodiffBackend<InnerBackend = B>,
        P: Params<AB>,
    {
        struct Update<'a, B: Backend> {
            opt: &'a mut Adam<B>,
            grads: BTreeMap<&'a str, &'a Tensor<B, 1>>,
            lr: f64,
            neuron_lr: f64,
            clip: f64,
        }
        impl<AB: AutodiffBackend<InnerBackend: OptimOps>> ParamMapper<AB> for Update<'_, AB::InnerBackend> {
            fn map<const D: usize>(&mut self, name: &str, p: Tensor<AB, D>) -> Tensor<AB, D> {
                let Some(g) = self.grads.get(name) else {
                    return p;
                };
                let neuron = is_neuron_param(name);
                let (lr, wd) = if neuron {
                    (self.neuron_lr, self.opt.config.neuron_weight_decay)
                } else {
                    (self.lr, self.opt.config.weight_decay)
                };
                let dims = p.dims();
                let n = p.shape().num_elements();
                let flat = p.inner().reshape([n]);
                let updated = self.opt.update(name, flat, (*g).clone(), lr, wd, self.clip);
                Tensor::from_inner(updated.reshape(dims)).require_grad()
            }
        }
        let grads_map = grads.entries.iter().map(|(n, g)| (n.as_str(), g)).collect();
        let mut u = Update {
            opt: self,
            grads: grads_map,
            lr,
            neuron_lr,
            clip,
        };
        module.map_params(prefix, &mut u);
    }

    /// One Adam update of a flat parameter, as `torch.optim.Adam(W)` (single-tensor path),
    /// through the backend's [`OptimOps::adam_update`] (one kernel on CUDA, the composition
    /// [`nsactor_kernels::reference::optim::adam`] elsewhere).
    fn update(
        &mut self,
        name: &str,
        p: Tensor<B, 1>,
        g: Tensor<B, 1>,
        lr: f64,
        wd: f64,
        grad_scale: f64,
    ) -> Tensor<B, 1> {
        let c = &self.config;
        let st = self
            .state
            .entry(name.to_string())
            .or_insert_with(|| AdamState {
                exp_avg: g.zeros_like(),
                exp_avg_sq: g.zeros_like(),
                step: 0,
            });
        st.step += 1;
        let s = AdamStep {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            lr,
            wd,
            decoupled: c.decoupled,
            step: st.step as i32,
            grad_scale,
        };
        let prim = |t: Tensor<B, 1>| t.into_primitive().tensor();
        let [p, m, v] = B::adam_update(
            prim(p),
            prim(g),
            prim(st.exp_avg.clone()),
            prim(st.exp_avg_sq.clone()),
            &s,
        )
        .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)));
        st.exp_avg = m;
        st.exp_avg_sq = v;
        p
    }
}
