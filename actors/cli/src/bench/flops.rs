//! The model's FLOPs per token, for MFU.

use nsactor_plugin_api::ModelConfig;

/// Projection multiply-adds of one layer for one frame: the SNNBlock's four `D → D·N` input
/// projections (W_in, W_β, W_α, W_th), W_gate and W_skip (`D → D`) and W_out (`D·N → D`), the
/// FFN's merged gate+up (`D → 2·D_ff`) and down (`D_ff → D`).
pub fn layer_macs_per_frame(model: &ModelConfig) -> f64 {
    let (d, dn, dff) = (model.d as f64, model.dn() as f64, model.d_ff as f64);
    4.0 * d * dn + 2.0 * d * d + dn * d + d * 2.0 * dff + dff * d
}

/// Training FLOPs per token: every layer's projections run forward and twice in the backward
/// (`∂x`, `∂W`) for each of the `K` frames, plus the tied head's forward and backward (the
/// model's FLOPs, what MFU counts); with `recomputed` of the layers running their forward again
/// in the backward (activation checkpointing), what the device executes.
pub fn train_flops_per_token(model: &ModelConfig, recomputed: usize) -> f64 {
    let (k, l) = (model.k as f64, model.num_layers as f64);
    let (d, v) = (model.d as f64, model.vocab_size as f64);
    let passes = 6.0 * l + 2.0 * recomputed as f64;
    passes * k * layer_macs_per_frame(model) + 6.0 * d * v
}

/// Forward FLOPs per token (a prompt's prefill): every layer's projections for each of the `K`
/// frames, and the tied head.
pub fn forward_flops_per_token(model: &ModelConfig) -> f64 {
    let (k, l) = (model.k as f64, model.num_layers as f64);
    let (d, v) = (model.d as f64, model.vocab_size as f64);
    2.0 * l * k * layer_macs_per_frame(model) + 2.0 * d * v
}

/// What a throughput is compared against: FLOPs per token and the device's dense peak.
pub struct Ceiling {
    pub flops_per_token: f64,
    pub peak_tflops: Option<f64>,
}

impl Ceiling {
    /// A forward pass's FLOPs per token against `peak_tflops`, else, on a CUDA backend (by its
    /// name, `backend`), 989 TFLOP/s in bf16 and 67 in fp32 (an H100/H200 SXM's dense peaks);
    /// none on the CPU.
    pub fn forward(
        model: &ModelConfig,
        peak_tflops: Option<f64>,
        backend: &str,
        bf16: bool,
    ) -> Self {
        let cuda = backend.to_lowercase().contains("cuda");
        Ceiling {
            flops_per_token: forward_flops_per_token(model),
            peak_tflops: peak_tflops.or(cuda.then_some(if bf16 { 989.0 } else { 67.0 })),
        }
    }

    /// `tokens/s` as TFLOP/s and, where the peak is known, its share of it.
    pub fn describe(&self, tokens_per_s: f64) -> String {
        let tflops = tokens_per_s * self.flops_per_token / 1e12;
        match self.peak_tflops {
            Some(p) => format!("{tflops:.1} TFLOP/s, {:.1}% of {p}", 100.0 * tflops / p),
            None => format!("{tflops:.3} TFLOP/s"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_per_token_of_the_0_9b_config() {
        let cfg = nsactor_engine::config::RunConfig::from_str(
            include_str!("../../../../configs/neuronspark-0.9b.toml"),
            "0.9b",
        )
        .unwrap();
        // 4·896·7168 + 2·896² + 7168·896 + 896·5376 + 2688·896 multiply-adds per frame and layer.
        assert_eq!(layer_macs_per_frame(&cfg.model), 40_943_616.0);
        // × 8 (fwd, recompute, 2 × bwd) × 16 frames × 20 layers, + 6 · 896 · 6144 for the head.
        assert_eq!(
            train_flops_per_token(&cfg.model, 20),
            8.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        // The model's FLOPs (no recompute), and 6 layers keeping their graphs.
        assert_eq!(
            train_flops_per_token(&cfg.model, 0),
            6.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        // A prefill's forward: 26.2 GFLOP per token.
        let fwd = forward_flops_per_token(&cfg.model);
        assert_eq!(fwd, 2.0 * 16.0 * 20.0 * 40_943_616.0 + 2.0 * 896.0 * 6144.0);
        assert!((fwd / 1e9 - 26.21).abs() < 0.01, "{fwd}");
        assert_eq!(
            train_flops_per_token(&cfg.model, 14),
            (6.0 * 20.0 + 2.0 * 14.0) * 16.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
    }
}
