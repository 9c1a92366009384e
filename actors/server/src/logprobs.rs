//! Log-probabilities of tokens: the chosen token's and the most likely alternatives, from the
//! model's own distribution (the log-softmax of its raw logits, before temperature, penalties,
//! biases and the special-token mask: what vLLM reports by default), computed in f64.

use serde::{Deserialize, Serialize};

/// One token's log-probability and the `top` most likely tokens at its position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token_id: i64,
    pub logprob: f32,
    /// `(token id, log-probability)`, most likely first (ties by id).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub top: Vec<(i64, f32)>,
}

/// `token`'s log-probability under `logits`, with the `top` most likely tokens.
pub fn token_logprob(logits: &[f32], token: i64, top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    let norm = max + sum.ln();
    let lp = |i: usize| {
        logits
            .get(i)
            .map_or(f64::NEG_INFINITY, |&l| l as f64 - norm) as f32
    };
    let mut best: Vec<usize> = Vec::new();
    if top > 0 {
        best = (0..logits.len()).collect();
        let k = top.min(best.len());
        let by_rank = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        if k < best.len() {
            best.select_nth_unstable_by(k, by_rank);
            best.truncate(k);
        }
        best.sort_by(by_rank);
    }
    TokenLogprob {
        token_id: token,
        logprob: usize::try_from(token).map_or(f32::NEG_INFINITY, lp),
        top: best.into_iter().map(|i| (i as i64, lp(i))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_tokens_come_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let t = token_logprob(&logits, 2, 3);
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6, "{t:?}");
        let ids: Vec<i64> = t.top.iter().map(|p| p.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        let total: f64 = (0..4)
            .map(|i| (token_logprob(&logits, i, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        // More alternatives than tokens: all of them; a suppressed token has −∞.
        let masked = [0.0f32, f32::NEG_INFINITY];
        let t = token_logprob(&masked, 1, 5);
        assert_eq!(t.top.len(), 2);
        assert_eq!(t.logprob, f32::NEG_INFINITY);
        assert_eq!(token_logprob(&masked, 0, 0).logprob, 0.0);
    }
}
