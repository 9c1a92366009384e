//! `analysis.json`: every figure of the study with the counts behind it, built from what the
//! runs showed ([`Observed`]) and the weights' static β ([`StaticBetas`]).

use crate::observe::{Observed, TokenSeen};
use crate::stats::{Bin, Summary, binned, pearson};
use crate::tags::Category;
use crate::weights::StaticBetas;
use nsactor_plugin_api::BETA_BINS;
use serde::Serialize;
use std::collections::BTreeMap;

/// β below this is a fast neuron, at or above it a slow one (the paper's split).
pub const FAST_BELOW: f64 = 0.9;
/// Width of the surprisal bins (nats).
pub const SURPRISAL_BIN: f64 = 1.0;

/// The model and where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    pub checkpoint: String,
    pub backend: String,
    pub layers: usize,
    pub d: usize,
    pub n: usize,
    pub k: usize,
    pub d_ff: usize,
    pub vocab_size: usize,
    pub plif_out: String,
}

/// The whole study.
#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    pub model: ModelInfo,
    pub sentences: usize,
    pub tokens: usize,
    pub expected_k: ExpectedK,
    pub surprisal: SurprisalStudy,
    pub beta: BetaStudy,
    /// Every sentence token by token.
    pub per_token: Vec<SentenceOut>,
}

/// E[K] (PLIF steps per token, the PonderNet expectation) over tokens.
#[derive(Debug, Clone, Serialize)]
pub struct ExpectedK {
    /// Per-token E[K] (mean over layers and sublayers) of every token.
    pub all_tokens: Summary,
    /// The same by token category (`tags`).
    pub by_category: BTreeMap<&'static str, Summary>,
    /// By sentence group (language of the bundled set, or the JSONL `category`).
    pub by_group: BTreeMap<String, GroupStudy>,
    /// Per layer, SNNBlock and SNNFFN over every token.
    pub per_layer: Vec<LayerK>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GroupStudy {
    pub sentences: usize,
    pub expected_k: Summary,
    pub surprisal: Option<Summary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerK {
    pub layer: usize,
    pub block: Summary,
    pub ffn: Summary,
}

/// Surprisal of the next token against the per-token E[K].
#[derive(Debug, Clone, Serialize)]
pub struct SurprisalStudy {
    /// Tokens with a next token (every token but each sentence's last).
    pub pairs: usize,
    pub r_with_bos: Option<f64>,
    pub r_without_bos: Option<f64>,
    pub bos: Option<BosStudy>,
    /// Mean E[K] in surprisal bins of [`SURPRISAL_BIN`] nats, BOS left out.
    pub bins: Vec<Bin>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BosStudy {
    pub expected_k: Summary,
    pub surprisal: Summary,
}

/// The learned timescales.
#[derive(Debug, Clone, Serialize)]
pub struct BetaStudy {
    pub fast_below: f64,
    /// σ(b_β) of every selective hidden neuron (D·N per layer): the paper's figure.
    pub hidden_static: BetaSplit,
    /// β(t) = σ(W_β·x + b_β) of the hidden neurons over every frame of the sentences.
    pub hidden_over_data: BetaSplit,
    /// Per layer: the static and data-mean β of its hidden neurons.
    pub per_layer: Vec<LayerBeta>,
    /// The row-parameter neurons' σ(w): `input1`, `input2`, `ffn_gate`, `ffn_up` (all
    /// layers) and `output`.
    pub row_neurons: BTreeMap<&'static str, BetaSplit>,
}

/// How many values fall below [`FAST_BELOW`] and at or above it, and their distribution.
#[derive(Debug, Clone, Serialize)]
pub struct BetaSplit {
    pub count: f64,
    pub fast: f64,
    pub slow: f64,
    pub fast_percent: f64,
    pub slow_percent: f64,
    /// Counts in [`BETA_BINS`] equal bins of `[0, 1]`.
    pub histogram: Vec<f64>,
    /// Mean, spread and range (absent for the data distribution, known only by bins).
    pub summary: Option<Summary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerBeta {
    pub layer: usize,
    pub static_mean: f64,
    pub static_fast_percent: f64,
    pub data_mean: f64,
    pub data_fast_percent: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SentenceOut {
    pub text: String,
    pub group: String,
    pub tokens: Vec<TokenOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenOut {
    pub id: u32,
    pub text: String,
    pub category: Category,
    pub expected_k: f64,
    /// Mean over layers of SNNBlock's and of SNNFFN's E[K].
    pub block: f64,
    pub ffn: f64,
    pub surprisal: Option<f64>,
}

/// The bin of `[0, 1]` a β falls in (the last bin closed).
fn bin_of(b: f64) -> usize {
    ((b * BETA_BINS as f64).floor().max(0.0) as usize).min(BETA_BINS - 1)
}

impl BetaSplit {
    /// From single values.
    pub fn of_values(v: &[f64]) -> BetaSplit {
        let mut histogram = vec![0.0; BETA_BINS];
        for &b in v {
            histogram[bin_of(b)] += 1.0;
        }
        let fast = v.iter().filter(|&&b| b < FAST_BELOW).count() as f64;
        BetaSplit::new(
            histogram,
            fast,
            v.len() as f64,
            Summary::of(v.iter().copied()),
        )
    }

    /// From bin counts; [`FAST_BELOW`] lies on a bin edge.
    pub fn of_histogram(histogram: Vec<f64>) -> BetaSplit {
        let edge = (FAST_BELOW * BETA_BINS as f64).round() as usize;
        let fast = histogram[..edge].iter().sum();
        let count = histogram.iter().sum();
        BetaSplit::new(histogram, fast, count, None)
    }

    fn new(histogram: Vec<f64>, fast: f64, count: f64, summary: Option<Summary>) -> BetaSplit {
        let pct = |x: f64| if count > 0.0 { 100.0 * x / count } else { 0.0 };
        BetaSplit {
            count,
            fast,
            slow: count - fast,
            fast_percent: pct(fast),
            slow_percent: pct(count - fast),
            histogram,
            summary,
        }
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn token_out(t: &TokenSeen) -> TokenOut {
    TokenOut {
        id: t.id,
        text: t.text.clone(),
        category: t.category,
        expected_k: t.expected_k(),
        block: mean(&t.block),
        ffn: mean(&t.ffn),
        surprisal: t.surprisal,
    }
}

/// Builds the study.
pub fn build(model: ModelInfo, seen: &Observed, betas: &StaticBetas) -> Analysis {
    let tokens: Vec<&TokenSeen> = seen.sentences.iter().flat_map(|s| &s.tokens).collect();
    let ek = |ts: &[&TokenSeen]| Summary::of(ts.iter().map(|t| t.expected_k()));
    let empty = Summary::of([f64::NAN]).expect("one value");
    let by_category = Category::ALL
        .iter()
        .filter_map(|&c| {
            let ts: Vec<&TokenSeen> = tokens.iter().copied().filter(|t| t.category == c).collect();
            Some((c.name(), ek(&ts)?))
        })
        .collect();
    let mut by_group: BTreeMap<String, GroupStudy> = BTreeMap::new();
    for g in seen.sentences.iter().map(|s| s.group.clone()) {
        if by_group.contains_key(&g) {
            continue;
        }
        let ss: Vec<_> = seen.sentences.iter().filter(|s| s.group == g).collect();
        let ts: Vec<&TokenSeen> = ss.iter().flat_map(|s| &s.tokens).collect();
        by_group.insert(
            g,
            GroupStudy {
                sentences: ss.len(),
                expected_k: ek(&ts).unwrap_or(empty),
                surprisal: Summary::of(ts.iter().filter_map(|t| t.surprisal)),
            },
        );
    }
    let layers = model.layers;
    let per_layer = (0..layers)
        .map(|l| LayerK {
            layer: l,
            block: Summary::of(tokens.iter().map(|t| t.block[l])).unwrap_or(empty),
            ffn: Summary::of(tokens.iter().map(|t| t.ffn[l])).unwrap_or(empty),
        })
        .collect();
    let pairs: Vec<(f64, f64, bool)> = tokens
        .iter()
        .filter_map(|t| Some((t.surprisal?, t.expected_k(), t.category == Category::Bos)))
        .collect();
    let xy = |keep: &dyn Fn(bool) -> bool| -> Vec<(f64, f64)> {
        pairs
            .iter()
            .filter(|p| keep(p.2))
            .map(|p| (p.0, p.1))
            .collect()
    };
    let bos_pairs = xy(&|b| b);
    let rest = xy(&|b| !b);
    let surprisal = SurprisalStudy {
        pairs: pairs.len(),
        r_with_bos: pearson(&xy(&|_| true)),
        r_without_bos: pearson(&rest),
        bos: Summary::of(bos_pairs.iter().map(|p| p.1)).map(|e| BosStudy {
            expected_k: e,
            surprisal: Summary::of(bos_pairs.iter().map(|p| p.0)).expect("same count"),
        }),
        bins: binned(&rest, SURPRISAL_BIN),
    };
    let hidden: Vec<f64> = betas
        .layers
        .iter()
        .flat_map(|l| l.hidden.iter().copied())
        .collect();
    let mut data_hist = vec![0.0; BETA_BINS];
    for h in &seen.beta_hist {
        data_hist.iter_mut().zip(h).for_each(|(a, c)| *a += c);
    }
    let row = |f: &dyn Fn(&crate::weights::LayerBetas) -> &Vec<f64>| {
        BetaSplit::of_values(
            &betas
                .layers
                .iter()
                .flat_map(|l| f(l).iter().copied())
                .collect::<Vec<_>>(),
        )
    };
    let mut row_neurons = BTreeMap::new();
    row_neurons.insert("input1", row(&|l| &l.input1));
    row_neurons.insert("input2", row(&|l| &l.input2));
    row_neurons.insert("ffn_gate", row(&|l| &l.ffn_gate));
    row_neurons.insert("ffn_up", row(&|l| &l.ffn_up));
    row_neurons.insert("output", BetaSplit::of_values(&betas.output));
    let per_layer_beta = betas
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let data = BetaSplit::of_histogram(seen.beta_hist.get(i).cloned().unwrap_or_default());
            LayerBeta {
                layer: i,
                static_mean: mean(&l.hidden),
                static_fast_percent: BetaSplit::of_values(&l.hidden).fast_percent,
                data_mean: seen.beta_mean.get(i).map_or(f64::NAN, |m| mean(m)),
                data_fast_percent: data.fast_percent,
            }
        })
        .collect();
    Analysis {
        model,
        sentences: seen.sentences.len(),
        tokens: tokens.len(),
        expected_k: ExpectedK {
            all_tokens: ek(&tokens).unwrap_or(empty),
            by_category,
            by_group,
            per_layer,
        },
        surprisal,
        beta: BetaStudy {
            fast_below: FAST_BELOW,
            hidden_static: BetaSplit::of_values(&hidden),
            hidden_over_data: BetaSplit::of_histogram(data_hist),
            per_layer: per_layer_beta,
            row_neurons,
        },
        per_token: seen
            .sentences
            .iter()
            .map(|s| SentenceOut {
                text: s.text.clone(),
                group: s.group.clone(),
                tokens: s.tokens.iter().map(token_out).collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beta_splits_count_both_sides_of_the_threshold() {
        let s = BetaSplit::of_values(&[0.1, 0.5, 0.89, 0.9, 0.99, 1.0]);
        assert_eq!((s.count, s.fast, s.slow), (6.0, 3.0, 3.0));
        assert_eq!(s.histogram.iter().sum::<f64>(), 6.0);
        assert_eq!(
            s.histogram[BETA_BINS - 1],
            2.0,
            "0.99 and 1.0 share the closed last bin"
        );
        let h = BetaSplit::of_histogram(s.histogram.clone());
        assert_eq!((h.fast, h.slow), (3.0, 3.0), "0.9 is a bin edge");
        assert!((h.fast_percent + h.slow_percent - 100.0).abs() < 1e-12);
    }
}
