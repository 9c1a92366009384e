//! Choosing the next token from logits: greedy, or sampled with temperature, top-k, top-p
//! (nucleus), a repetition penalty (CTRL / HF `repetition_penalty`) and OpenAI's presence and
//! frequency penalties (over the tokens the picker itself chose), from a seeded RNG so a request
//! with a seed is reproducible.

use crate::error::RuntimeError;
use nsactor_data::SplitMix64;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Keep only tokens at least this fraction as likely as the most likely one (vLLM's and
    /// llama.cpp's `min_p`; 0: all).
    pub min_p: f32,
    /// Divides positive logits of tokens already in the text and multiplies negative ones
    /// (1: off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (OpenAI's
    /// `presence_penalty`, −2..2; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's
    /// `frequency_penalty`, −2..2; 0: off).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// Checks the ranges; the message names the field.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let bad = RuntimeError::Invalid;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(bad(format!(
                "temperature must be ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad(format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        Ok(())
    }
}

/// Picks tokens for one sequence.
pub struct TokenPicker {
    params: SamplingParams,
    rng: SplitMix64,
    /// How often each token was picked (for the presence and frequency penalties).
    picked: std::collections::HashMap<usize, u32>,
}

impl TokenPicker {
    pub fn new(params: SamplingParams) -> Self {
        TokenPicker {
            params,
            rng: SplitMix64(params.seed),
            picked: std::collections::HashMap::new(),
        }
    }

    /// The next token given `logits` and the text so far (`history`, for the penalty).
    /// Tokens whose logit is −∞ (suppressed) are never picked.
    pub fn pick(&mut self, logits: &mut [f32], history: &[i64]) -> i64 {
        let t = self.choose(logits, history);
        if let Ok(i) = usize::try_from(t) {
            *self.picked.entry(i).or_default() += 1;
        }
        t
    }

    fn choose(&mut self, logits: &mut [f32], history: &[i64]) -> i64 {
        let p = self.params;
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&i, &n) in &self.picked {
                if let Some(l) = logits.get_mut(i) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i))
                    && seen.insert(t)
                {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits) as i64;
        }
        let mut order: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .collect();
        if order.is_empty() {
            return argmax(logits) as i64;
        }
        // Most likely first; ties by id so the order is deterministic.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max = logits[order[0]] as f64;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i] as f64 - max) / p.temperature as f64).exp())
            .collect();
        if p.min_p > 0.0 {
            // Relative to the most likely token's (the first, at 1): most likely first.
            let keep = probs.iter().take_while(|&&q| q >= p.min_p as f64).count();
            order.truncate(keep.max(1));
            probs.truncate(keep.max(1));
        }
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    acc += q;
                    acc >= p.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            order.truncate(keep);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        for (&i, &q) in order.iter().zip(&probs) {
            acc += q;
            if u < acc {
                return i as i64;
            }
        }
        *order.last().expect("not empty") as i64
    }
}

/// Index of the largest value (the first on ties, as `torch.argmax`).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, rep: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            repetition_penalty: rep,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 9,
        }
    }

    /// OpenAI's penalties count the picker's own choices: a presence penalty lowers every
    /// generated token once, a frequency penalty once per use, and the prompt is not counted.
    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens() {
        let logits = [0.0f32, 1.0, 0.9, 0.5];
        let greedy = |presence, frequency| {
            let mut s = TokenPicker::new(SamplingParams {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..SamplingParams::greedy()
            });
            (0..4)
                .map(|_| s.pick(&mut logits.clone(), &[1, 1, 1]))
                .collect::<Vec<_>>()
        };
        assert_eq!(greedy(0.0, 0.0), [1, 1, 1, 1]);
        // 1 loses 0.2 once it was picked: 2 leads, then both are penalised once and 1 leads.
        assert_eq!(greedy(0.2, 0.0), [1, 2, 1, 1]);
        // 0.3 per use: 1 (1.0), 2 (0.9 vs 0.7), 1 (0.7 vs 0.6), 2 (0.6 vs 0.4).
        assert_eq!(greedy(0.0, 0.3), [1, 2, 1, 2]);
        let bad = SamplingParams {
            frequency_penalty: 2.5,
            ..SamplingParams::greedy()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("frequency_penalty")
        );
    }

    #[test]
    fn greedy_top_k_top_p_and_penalty_behave() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY, 2.9];
        let mut g = TokenPicker::new(SamplingParams::greedy());
        assert_eq!(g.pick(&mut logits.clone(), &[]), 1);
        // The penalty turns the leader (3.0 → 1.5) below token 4.
        let mut g = TokenPicker::new(params(0.0, 0, 1.0, 2.0));
        assert_eq!(g.pick(&mut logits.clone(), &[1, 1]), 4);
        // top_k = 2 only ever yields the two best; the suppressed token never appears.
        let mut s = TokenPicker::new(params(1.0, 2, 1.0, 1.0));
        let mut counts = [0usize; 5];
        for _ in 0..2000 {
            counts[s.pick(&mut logits.clone(), &[]) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[3], 0, "{counts:?}");
        assert!(counts[1] > 900 && counts[4] > 800, "{counts:?}");
        // top_p small enough keeps only the best token.
        let mut s = TokenPicker::new(params(1.0, 0, 0.1, 1.0));
        assert!((0..200).all(|_| s.pick(&mut logits.clone(), &[]) == 1));
        // min_p: at T = 1, token 4 (e^-0.1 ≈ 0.905 of the best) and 2 (e^-1 ≈ 0.368) stay at
        // 0.3, only 4 beside the best at 0.5, only the best at 0.95.
        for (min_p, kept) in [(0.3, vec![1, 2, 4]), (0.5, vec![1, 4]), (0.95, vec![1])] {
            let mut s = TokenPicker::new(SamplingParams {
                min_p,
                ..params(1.0, 0, 1.0, 1.0)
            });
            let mut seen: Vec<i64> = (0..3000)
                .map(|_| s.pick(&mut logits.clone(), &[]))
                .collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen, kept, "min_p {min_p}");
        }
        let bad = SamplingParams {
            min_p: 1.5,
            ..SamplingParams::greedy()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("min_p"));
        // Same seed, same choices.
        let run = || {
            let mut s = TokenPicker::new(params(0.8, 0, 1.0, 1.0));
            (0..50)
                .map(|_| s.pick(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(params(-1.0, 0, 1.0, 1.0).validate().is_err());
        assert!(
            params(1.0, 0, 0.0, 1.0)
                .validate()
                .unwrap_err()
                .to_string()
                .contains("top_p")
        );
    }
}
