//! The CPU backend: NeuronSpark on burn-ndarray behind the runtime's [`TrainEngine`] contract.
//!
//! This crate is linked into the `nsactor` binary as the embedded default (so `cargo run --release
//! -- train` works on any machine) and will also build the ndarray plugin. The PLIF scans run the
//! exact host reference of `nsactor-kernels`; everything else is burn-ndarray.
//!
//! Depends on burn, `nsactor-kernels`, `nsactor-model` and the burn-free `nsactor-plugin-api`.

use burn::backend::Autodiff;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_ndarray::NdArray;
use nsactor_model::io::{Layout, load_file, save_file};
use nsactor_model::train::{Adam, AdamConfig, GradSet, clip_factor, natural_gradient};
use nsactor_model::{ModelConfig, NeuronSpark, param_shapes};
use nsactor_plugin_api::{Batch, EngineError, StepParams, StepStats, TrainEngine};
use std::path::Path;

pub type Cpu = NdArray<f32>;
pub type CpuAutodiff = Autodiff<Cpu>;

/// Inputs, targets and loss mask of a micro-batch on the device.
type BatchTensors = (
    Tensor<CpuAutodiff, 2, Int>,
    Tensor<CpuAutodiff, 2, Int>,
    Tensor<CpuAutodiff, 2>,
);

/// Which optimizer the engine runs (SPEC §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// Pretraining: Adam, no weight decay.
    Adam,
    /// SFT: AdamW, weight decay 0.01 on the base group.
    AdamW,
}

/// The whole model and its optimizer on the CPU.
pub struct CpuEngine {
    model: NeuronSpark<CpuAutodiff>,
    adam: Adam<Cpu>,
}

impl CpuEngine {
    /// A freshly initialised model from the `[model]` table of a TOML config.
    pub fn new(config_toml: &str, seed: u64, optimizer: Optimizer) -> Result<Self, EngineError> {
        let cfg = ModelConfig::from_toml_str(config_toml)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let model = NeuronSpark::init(&cfg, seed, &Default::default());
        let adam_cfg = match optimizer {
            Optimizer::Adam => AdamConfig::adam(),
            Optimizer::AdamW => AdamConfig::adamw_sft(),
        };
        Ok(CpuEngine {
            model,
            adam: Adam::new(adam_cfg),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn tensors(&self, b: &Batch) -> Result<BatchTensors, EngineError> {
        b.validate()?;
        let vocab = self.model.config.vocab_size as i64;
        if let Some(bad) = b
            .inputs
            .iter()
            .chain(&b.targets)
            .find(|&&id| id < 0 || id >= vocab)
        {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (0..{vocab})"
            )));
        }
        let dev = Default::default();
        let shape = [b.batch, b.seq_len];
        Ok((
            Tensor::from_data(TensorData::new(b.inputs.clone(), shape), &dev),
            Tensor::from_data(TensorData::new(b.targets.clone(), shape), &dev),
            Tensor::from_data(TensorData::new(b.loss_mask.clone(), shape), &dev),
        ))
    }
}

fn scalar(t: Tensor<CpuAutodiff, 1>) -> f64 {
    t.into_scalar().elem::<f64>()
}

impl TrainEngine for CpuEngine {
    fn describe(&self) -> String {
        "ndarray (cpu, f32)".into()
    }

    fn param_count(&self) -> usize {
        param_shapes(&self.model)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    fn train_step(
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
        let mut acc: Option<GradSet<Cpu>> = None;
        let (mut loss, mut ce, mut ek, mut tokens) = (0.0, 0.0, 0.0, 0u64);
        for mb in micro_batches {
            let (x, y, mask) = self.tensors(mb)?;
            tokens += mb.loss_mask.iter().filter(|&&v| v > 0.0).count() as u64;
            let out = self.model.loss(x, y, mask, p.ponder_weight);
            loss += scalar(out.loss.clone()) / m;
            ce += scalar(out.ce_masked_mean) / m;
            ek += scalar(out.ponder_cost) / m;
            // Each micro-batch contributes loss/M, as the reference's accumulation does.
            let grads = (out.loss / m).backward();
            let gs = GradSet::collect::<CpuAutodiff, _>(&self.model, "", &grads);
            match acc.as_mut() {
                Some(a) => a.accumulate(gs),
                None => acc = Some(gs),
            }
        }
        let mut grads = acc.expect("at least one micro-batch");
        natural_gradient(&self.model, &mut grads);
        let grad_norm = grads.sum_squares().sqrt();
        if !grad_norm.is_finite() {
            return Err(EngineError::Backend(format!(
                "non-finite gradient norm {grad_norm}; the step was skipped"
            )));
        }
        grads.scale(clip_factor(grad_norm, p.max_grad_norm));
        self.adam
            .step::<CpuAutodiff, _>(&mut self.model, "", &grads, p.lr, p.neuron_lr);
        Ok(StepStats {
            loss,
            ce,
            expected_k: ek,
            grad_norm,
            tokens,
        })
    }

    fn eval_loss(&mut self, batch: &Batch, ponder_weight: f64) -> Result<f64, EngineError> {
        let (x, y, mask) = self.tensors(batch)?;
        Ok(scalar(
            self.model.loss(x, y, mask, ponder_weight).loss.detach(),
        ))
    }

    fn generate_greedy(
        &mut self,
        prompt: &[i64],
        max_new_tokens: usize,
    ) -> Result<Vec<i64>, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidInput("the prompt is empty".into()));
        }
        let out = self
            .model
            .generate_greedy(&[prompt.to_vec()], max_new_tokens, None);
        Ok(out.into_iter().next().expect("one row"))
    }

    fn save_weights(&self, path: &Path) -> Result<(), EngineError> {
        save_file(&self.model, path, Layout::Plain).map_err(|e| EngineError::Io(e.to_string()))
    }

    fn load_weights(&mut self, path: &Path) -> Result<(), EngineError> {
        load_file(&mut self.model, path)
            .map(|_| ())
            .map_err(|e| EngineError::Io(e.to_string()))
    }
}
