//! Runs each sentence, BOS first, through the model ([`Pipeline::probe`]) and keeps per token
//! its text, category, E[K] of every layer's two sublayers and the surprisal of the next
//! token; per layer the β(t) histogram and per-neuron mean over all sentences.

use crate::error::{AnalysisError, Result};
use crate::sentences::Sentence;
use crate::tags::{Category, token_categories};
use nsactor_data::Tokenizer;
use nsactor_data::tokenizer::SPECIALS;
use nsactor_decoding::Pipeline;
use nsactor_plugin_api::BETA_BINS;

/// One token as the model saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenSeen {
    pub id: u32,
    /// The characters of the sentence it stands for (the BOS token's own text for BOS).
    pub text: String,
    pub category: Category,
    /// E[K] of SNNBlock per layer.
    pub block: Vec<f64>,
    /// E[K] of SNNFFN per layer.
    pub ffn: Vec<f64>,
    /// `−ln p(next token)` (nats); `None` for the last token.
    pub surprisal: Option<f64>,
}

impl TokenSeen {
    /// E[K] averaged over layers and both sublayers (the per-token figure of the paper).
    pub fn expected_k(&self) -> f64 {
        let n = (self.block.len() + self.ffn.len()).max(1) as f64;
        (self.block.iter().sum::<f64>() + self.ffn.iter().sum::<f64>()) / n
    }
}

/// One sentence as the model saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceSeen {
    pub text: String,
    pub group: String,
    pub tokens: Vec<TokenSeen>,
}

/// Everything the runs showed.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub sentences: Vec<SentenceSeen>,
    /// Per layer, β(t) counts in [`BETA_BINS`] bins over every frame of every sentence.
    pub beta_hist: Vec<Vec<f64>>,
    /// Per layer, each hidden neuron's mean β(t) over every frame of every sentence.
    pub beta_mean: Vec<Vec<f64>>,
    /// Frames (token × K) the β figures cover.
    pub frames: u64,
}

/// Runs `sentences` (each cut to `max_tokens` tokens after BOS) through `pipeline`, a model
/// of `k` frames per token.
pub fn observe(
    pipeline: &mut Pipeline,
    tok: &Tokenizer,
    sentences: &[Sentence],
    max_tokens: usize,
    k: usize,
) -> Result<Observed> {
    let layers = pipeline.num_layers();
    let special_ids: Vec<u32> = SPECIALS.iter().filter_map(|s| tok.token_to_id(s)).collect();
    let bos = tok.bos_id();
    let bos_text = tok.decode(&[bos], false)?;
    let mut out = Observed {
        sentences: Vec::with_capacity(sentences.len()),
        beta_hist: vec![vec![0.0; BETA_BINS]; layers],
        beta_mean: vec![Vec::new(); layers],
        frames: 0,
    };
    let mut frames_per_layer = 0u64;
    for s in sentences {
        let mut spanned = tok.encode_with_spans(&s.text)?;
        spanned.truncate(max_tokens);
        if spanned.is_empty() {
            return Err(AnalysisError::Invalid(format!(
                "\"{}\" has no token",
                s.text
            )));
        }
        let chars: Vec<char> = s.text.chars().collect();
        let spans: Vec<_> = spanned.iter().map(|(_, r)| r.clone()).collect();
        let special: Vec<bool> = spanned
            .iter()
            .map(|(id, _)| special_ids.contains(id))
            .collect();
        let categories = token_categories(&s.text, &spans, &special);
        let ids: Vec<i64> = std::iter::once(bos)
            .chain(spanned.iter().map(|(id, _)| *id))
            .map(i64::from)
            .collect();
        let probe = pipeline.probe(&ids)?;
        let t = ids.len();
        let mut tokens = Vec::with_capacity(t);
        for pos in 0..t {
            let (id, text, category) = if pos == 0 {
                (bos, bos_text.clone(), Category::Bos)
            } else {
                let (id, span) = &spanned[pos - 1];
                (
                    *id,
                    chars[span.clone()].iter().collect(),
                    categories[pos - 1],
                )
            };
            tokens.push(TokenSeen {
                id,
                text,
                category,
                block: probe
                    .layers
                    .iter()
                    .map(|l| f64::from(l.expected_k[0][pos]))
                    .collect(),
                ffn: probe
                    .layers
                    .iter()
                    .map(|l| f64::from(l.expected_k[1][pos]))
                    .collect(),
                surprisal: probe.surprisal.get(pos).map(|&s| f64::from(s)),
            });
        }
        // Means over frames: each sentence weighs by its frames.
        let frames = (t * k) as u64;
        for (i, l) in probe.layers.iter().enumerate() {
            for (acc, c) in out.beta_hist[i].iter_mut().zip(&l.beta_hist) {
                *acc += c;
            }
            let m = &mut out.beta_mean[i];
            m.resize(l.beta_mean.len(), 0.0);
            for (acc, v) in m.iter_mut().zip(&l.beta_mean) {
                *acc += f64::from(*v) * frames as f64;
            }
        }
        frames_per_layer += frames;
        out.sentences.push(SentenceSeen {
            text: s.text.clone(),
            group: s.group.clone(),
            tokens,
        });
    }
    for m in &mut out.beta_mean {
        m.iter_mut()
            .for_each(|v| *v /= frames_per_layer.max(1) as f64);
    }
    out.frames = frames_per_layer;
    Ok(out)
}
