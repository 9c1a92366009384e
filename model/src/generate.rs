//! Stateful incremental decoding (SPEC §4, §10): the prompt is prefilled once, then each new
//! token is one K-frame step through every layer, continuing from the carried membrane states.
//! No prefix is ever recomputed, and the logits equal those of a full-sequence forward.

use crate::model::{ModelState, NeuronSpark};
use burn::tensor::{Int, Tensor, TensorData};
use nsactor_kernels::SnnOps;

/// A decoding session over a batch of equal-length prompts.
#[derive(Debug, Clone)]
pub struct Decoder<B: SnnOps> {
    state: ModelState<B>,
    /// Logits `[B, V]` for the next token.
    pub next_logits: Tensor<B, 2>,
}

impl<B: SnnOps> NeuronSpark<B> {
    /// Prefills `prompt` `[B, T]` (T ≥ 1) and returns a decoder positioned after it.
    pub fn prefill(&self, prompt: Tensor<B, 2, Int>) -> Decoder<B> {
        let [b, t] = prompt.dims();
        assert!(t > 0, "prefill needs at least one token");
        let out = self.forward_from(
            prompt.clone(),
            ModelState::zeros(&self.config, b, &prompt.device()),
        );
        Decoder {
            state: out.state,
            next_logits: last_position(out.logits),
        }
    }

    /// Feeds one token per row `[B]` and updates `next_logits`.
    pub fn feed(&self, dec: &mut Decoder<B>, tokens: &[i64]) {
        let device = dec.next_logits.device();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(tokens.to_vec(), [tokens.len(), 1]),
            &device,
        );
        let out = self.forward_from(ids, dec.state.clone());
        dec.state = out.state;
        dec.next_logits = last_position(out.logits);
    }

    /// Greedy (temperature 0) generation of up to `max_new_tokens` for each row of `prompt`.
    /// Returns prompt + generated ids per row. Stops early once every row has produced `eos`
    /// (checked before each new step and kept in the output, as the reference does).
    pub fn generate_greedy(
        &self,
        prompt: &[Vec<i64>],
        max_new_tokens: usize,
        eos: Option<i64>,
    ) -> Vec<Vec<i64>> {
        let b = prompt.len();
        assert!(b > 0, "no prompts");
        let t = prompt[0].len();
        assert!(
            prompt.iter().all(|p| p.len() == t),
            "prompts in one batch must have equal length"
        );
        let device = self.edge.embed_tokens.weight.device();
        let flat: Vec<i64> = prompt.iter().flatten().copied().collect();
        let mut dec = self.prefill(Tensor::from_data(TensorData::new(flat, [b, t]), &device));
        let mut out: Vec<Vec<i64>> = prompt.to_vec();
        for i in 0..max_new_tokens {
            let next = argmax_rows(&dec.next_logits);
            for (row, tok) in out.iter_mut().zip(&next) {
                row.push(*tok);
            }
            let done = eos.is_some_and(|e| next.iter().all(|&x| x == e));
            if done || i + 1 == max_new_tokens {
                break;
            }
            self.feed(&mut dec, &next);
        }
        out
    }
}

fn last_position<B: SnnOps>(logits: Tensor<B, 3>) -> Tensor<B, 2> {
    let [b, t, v] = logits.dims();
    logits.slice([0..b, t - 1..t]).reshape([b, v])
}

/// Row-wise argmax on the host (first index wins on ties, like `torch.argmax`).
pub fn argmax_rows<B: SnnOps>(logits: &Tensor<B, 2>) -> Vec<i64> {
    let [_, v] = logits.dims();
    let data = logits
        .to_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 logits");
    data.chunks_exact(v)
        .map(|row| {
            let mut best = 0;
            for (i, &x) in row.iter().enumerate() {
                if x > row[best] {
                    best = i;
                }
            }
            best as i64
        })
        .collect()
}
