//! The step arithmetic that spans stages (SPEC §7.3–7.4): each stage computes its own gradient
//! statistics; the supervisor combines them with these pure functions and sends back factors.

use crate::BiasGradNorms;

/// `max_comp` of the reference: phase-2 scales are clamped to `[1/100, 100]`.
pub const MAX_COMP: f64 = 100.0;
/// Layers whose gradient norm is at most this are left out of phase 2.
pub const NORM_FLOOR: f64 = 1e-12;

/// The three modulation biases phase 2 equalises across layers, in the order stages report them.
pub const MODULATION_BIASES: [&str; 3] = ["b_beta", "b_alpha", "b_th"];

/// Natural-gradient compensation, phase 2: given one bias's gradient norm per layer, the factor
/// each layer's gradient is multiplied by. Layers with norm ≤ 1e-12 (or no gradient) keep 1;
/// with fewer than two such layers nothing changes; otherwise
/// `scale_i = clamp(exp(mean ln n) / n_i, 1/100, 100)` — the cross-layer geometric mean.
pub fn phase2_scales(norms: &[Option<f64>]) -> Vec<f64> {
    let valid: Vec<f64> = norms
        .iter()
        .flatten()
        .copied()
        .filter(|&n| n > NORM_FLOOR)
        .collect();
    if valid.len() < 2 {
        return vec![1.0; norms.len()];
    }
    let geo = (valid.iter().map(|n| n.ln()).sum::<f64>() / valid.len() as f64).exp();
    norms
        .iter()
        .map(|n| match n {
            Some(n) if *n > NORM_FLOOR => (geo / n).clamp(1.0 / MAX_COMP, MAX_COMP),
            _ => 1.0,
        })
        .collect()
}

/// Phase 2 for every modulation bias at once: given each layer's [`BiasGradNorms`] (layer
/// order), each layer's `ScaleGrads` factors `[b_beta, b_alpha, b_th]`.
pub fn phase2_layer_scales(norms: &[BiasGradNorms]) -> Vec<[f64; 3]> {
    let per_bias: [Vec<f64>; 3] = std::array::from_fn(|j| {
        let of_bias: Vec<Option<f64>> = norms.iter().map(|n| n.as_array()[j]).collect();
        phase2_scales(&of_bias)
    });
    (0..norms.len())
        .map(|i| [per_bias[0][i], per_bias[1][i], per_bias[2][i]])
        .collect()
}

/// Global-norm clipping factor as `torch.nn.utils.clip_grad_norm_`:
/// `min(1, max_norm / (total_norm + 1e-6))`.
pub fn clip_factor(total_norm: f64, max_norm: f64) -> f64 {
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase2_equalises_to_the_geometric_mean() {
        let s = phase2_scales(&[Some(1.0), Some(4.0), None, Some(0.0)]);
        // geo mean of {1, 4} = 2.
        assert_eq!(s, vec![2.0, 0.5, 1.0, 1.0]);
        assert_eq!(phase2_scales(&[Some(3.0), None]), vec![1.0, 1.0]);
        let s = phase2_scales(&[Some(1e-6), Some(1e6)]);
        assert_eq!(s, vec![MAX_COMP, 1.0 / MAX_COMP]);
    }

    #[test]
    fn clip_factor_matches_torch() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert!((clip_factor(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
    }
}
