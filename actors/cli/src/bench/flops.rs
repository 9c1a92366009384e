//! The model's FLOPs per token, for MFU.

/// An integer of the `[model]` table, as f64.
pub fn model_int(model: &toml::Table, k: &str) -> Result<f64, String> {
    model
        .get(k)
        .and_then(|v| v.as_integer())
        .map(|v| v as f64)
        .ok_or_else(|| format!("[model] has no integer `{k}`"))
}

/// Projection multiply-adds of one layer for one frame, from the `[model]` table: the SNNBlock's
/// four `D → D·N` input projections (W_in, W_β, W_α, W_th), W_gate and W_skip (`D → D`) and
/// W_out (`D·N → D`), the FFN's merged gate+up (`D → 2·D_ff`) and down (`D_ff → D`).
pub fn layer_macs_per_frame(model: &toml::Table) -> Result<f64, String> {
    let get = |k| model_int(model, k);
    let (d, n, dff) = (get("D")?, get("N")?, get("D_ff")?);
    let dn = d * n;
    Ok(4.0 * d * dn + 2.0 * d * d + dn * d + d * 2.0 * dff + dff * d)
}

/// Training FLOPs per token: every layer's projections run forward and twice in the backward
/// (`∂x`, `∂W`) for each of the `K` frames, plus the tied head's forward and backward (the
/// model's FLOPs, what MFU counts); with `recomputed` of the layers running their forward again
/// in the backward (activation checkpointing), what the device executes.
pub fn train_flops_per_token(model: &toml::Table, recomputed: usize) -> Result<f64, String> {
    let get = |k| model_int(model, k);
    let (k, l, d, v) = (get("K")?, get("num_layers")?, get("D")?, get("vocab_size")?);
    let passes = 6.0 * l + 2.0 * recomputed as f64;
    Ok(passes * k * layer_macs_per_frame(model)? + 6.0 * d * v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_per_token_of_the_0_9b_config() {
        let cfg = nsactor_runtime::config::RunConfig::from_str(
            include_str!("../../../../configs/neuronspark-0.9b.toml"),
            "0.9b",
        )
        .unwrap();
        // 4·896·7168 + 2·896² + 7168·896 + 896·5376 + 2688·896 multiply-adds per frame and layer.
        assert_eq!(layer_macs_per_frame(&cfg.model).unwrap(), 40_943_616.0);
        // × 8 (fwd, recompute, 2 × bwd) × 16 frames × 20 layers, + 6 · 896 · 6144 for the head.
        assert_eq!(
            train_flops_per_token(&cfg.model, 20).unwrap(),
            8.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        // The model's FLOPs (no recompute), and 6 layers keeping their graphs.
        assert_eq!(
            train_flops_per_token(&cfg.model, 0).unwrap(),
            6.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        assert_eq!(
            train_flops_per_token(&cfg.model, 14).unwrap(),
            (6.0 * 20.0 + 2.0 * 14.0) * 16.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
    }
}
