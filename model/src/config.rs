//! Model hyperparameters (SPEC §1.1), named as in the reference checkpoints' `model_config`.

use crate::ModelError;
use serde::{Deserialize, Serialize};

/// What a PLIF input/FFN/output neuron passes on (SPEC §0.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PlifOut {
    /// `(1 − β)·V_post` — the reference HEAD (commit fc6a440) and the golden fixtures.
    #[default]
    Leak,
    /// Raw `V_post` — the code the released 85K-step weights were trained with.
    VPost,
}

/// NeuronSpark hyperparameters. Unknown keys are errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    /// Residual width.
    #[serde(rename = "D")]
    pub d: usize,
    /// Hidden neurons per channel (the SNNBlock state is `D·N` wide).
    #[serde(rename = "N")]
    pub n: usize,
    /// SNN frames per token.
    #[serde(rename = "K")]
    pub k: usize,
    pub num_layers: usize,
    #[serde(rename = "D_ff")]
    pub d_ff: usize,
    /// `V_min` in `V_th = V_min + |·|` (not stored in reference checkpoints; always 0.1 there).
    #[serde(default = "default_v_th_min")]
    pub v_th_min: f64,
    #[serde(default)]
    pub plif_out: PlifOut,
}

fn default_v_th_min() -> f64 {
    0.1
}

/// Hard-coded constants of the reference (SPEC §1.1).
pub mod consts {
    pub const RMS_EPS: f64 = 1e-6;
    pub const LATERAL_EPS: f64 = 1e-6;
    /// PonderAgg: halt probabilities are clamped to `[HALT_CLAMP, 1 − HALT_CLAMP]`.
    pub const HALT_CLAMP: f64 = 1e-7;
    /// PonderAgg: `λ̂ = λ / (Σλ + HALT_NORM_EPS)`.
    pub const HALT_NORM_EPS: f64 = 1e-8;
}

impl ModelConfig {
    /// The released 0.9B configuration.
    pub fn neuronspark_0_9b() -> Self {
        ModelConfig {
            vocab_size: 6144,
            d: 896,
            n: 8,
            k: 16,
            num_layers: 20,
            d_ff: 2688,
            v_th_min: 0.1,
            plif_out: PlifOut::Leak,
        }
    }

    /// Hidden width `D·N` of the SNNBlock.
    pub fn dn(&self) -> usize {
        self.d * self.n
    }

    /// Checks the values make a model; called once wherever a config enters the program.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("D", self.d),
            ("N", self.n),
            ("K", self.k),
            ("num_layers", self.num_layers),
            ("D_ff", self.d_ff),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ModelError::Config(format!("`{name}` must be positive")));
            }
        }
        if !(self.v_th_min.is_finite() && self.v_th_min >= 0.0) {
            return Err(ModelError::Config(format!(
                "`v_th_min` must be finite and ≥ 0, got {}",
                self.v_th_min
            )));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(ModelError::Config("`vocab_size` exceeds u32".into()));
        }
        Ok(())
    }

    /// Parses the `[model]` table of a TOML document (other tables belong to other crates).
    pub fn from_toml_str(text: &str) -> Result<Self, ModelError> {
        #[derive(Deserialize)]
        struct Doc {
            model: toml::Value,
        }
        let doc: Doc =
            toml::from_str(text).map_err(|e| ModelError::Config(format!("TOML: {e}")))?;
        let cfg: ModelConfig = doc
            .model
            .try_into()
            .map_err(|e| ModelError::Config(format!("[model]: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML file's `[model]` table.
    pub fn from_toml_file(path: &std::path::Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        Self::from_toml_str(&text).map_err(|e| e.context(&path.display().to_string()))
    }
}
