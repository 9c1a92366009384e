//! The model's hyperparameters (SPEC §1.1), named as in the reference checkpoints'
//! `model_config`: the one burn-free [`ModelConfig`] the runtime, the server, the backends and
//! the model share. A stage is opened with one ([`StageSpec::model`](crate::StageSpec)).
//!
//! This crate has no serde; the TOML form (`[model]`, with `D`, `N`, `K`, `D_ff`) lives in
//! `nsactor-model-config`.

use crate::EngineError;

/// What a PLIF input/FFN/output neuron passes on (SPEC §0.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlifOut {
    /// `(1 − β)·V_post` — the reference HEAD (commit fc6a440) and the golden fixtures.
    #[default]
    Leak,
    /// Raw `V_post` — the code the released 85K-step weights were trained with.
    VPost,
}

/// NeuronSpark hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    /// Residual width `D`.
    pub d: usize,
    /// Hidden neurons per channel `N` (the SNNBlock state is `D·N` wide).
    pub n: usize,
    /// SNN frames per token `K`.
    pub k: usize,
    pub num_layers: usize,
    /// FFN width `D_ff`.
    pub d_ff: usize,
    /// `V_min` in `V_th = V_min + |·|` (not stored in reference checkpoints; always 0.1 there).
    pub v_th_min: f64,
    pub plif_out: PlifOut,
}

/// `v_th_min` where a config does not name it.
pub const DEFAULT_V_TH_MIN: f64 = 0.1;

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
            v_th_min: DEFAULT_V_TH_MIN,
            plif_out: PlifOut::Leak,
        }
    }

    /// Hidden width `D·N` of the SNNBlock.
    pub fn dn(&self) -> usize {
        self.d * self.n
    }

    /// Values of one decoding session's state: every layer's four membranes (input neurons
    /// `D` before each sublayer, hidden `D·N`, the FFN's gate and up `2·D_ff`) and the output
    /// neurons' `D` (~288k at 0.9B, whatever the context).
    pub fn session_state_values(&self) -> usize {
        self.num_layers * (2 * self.d + self.dn() + 2 * self.d_ff) + self.d
    }

    /// Checks the values make a model; called once wherever a config enters the program.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| {
            Err(EngineError::InvalidInput(format!(
                "invalid model config: {m}"
            )))
        };
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
                return bad(format!("`{name}` must be positive"));
            }
        }
        if !(self.v_th_min.is_finite() && self.v_th_min >= 0.0) {
            return bad(format!(
                "`v_th_min` must be finite and ≥ 0, got {}",
                self.v_th_min
            ));
        }
        if self.vocab_size > u32::MAX as usize {
            return bad("`vocab_size` exceeds u32".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_bad_key() {
        assert!(ModelConfig::neuronspark_0_9b().validate().is_ok());
        let mut c = ModelConfig::neuronspark_0_9b();
        c.k = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("`K` must be positive"), "{e}");
        let mut c = ModelConfig::neuronspark_0_9b();
        c.v_th_min = f64::NAN;
        assert!(c.validate().unwrap_err().to_string().contains("v_th_min"));
    }
}
