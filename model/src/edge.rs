//! The edge of the network: token embedding, the decode path and the tied head (SPEC §2.1, §2.4).

use crate::config::{ModelConfig, consts};
use crate::init::{Rng, xavier};
use crate::neurons::{LateralInhibition, PlifNode, RmsNorm, norm_plif_inputs, param, weight};
use crate::params::{Derived, Linear, as_operand, decoding_pass, impl_params};
use burn::tensor::{Int, Tensor, backend::Backend};
use nsactor_kernels::SnnOps;

/// Output-neuron threshold base `v0 = 0.3`.
const OUTPUT_V_THRESHOLD: f64 = 0.3;

#[derive(Debug, Clone)]
pub struct Embedding<B: Backend> {
    pub weight: Tensor<B, 2>,
    /// The tied head's `Wᵀ` as the GEMM reads it, for untracked passes (decoding): made once
    /// per parameter update, as [`Linear::operand`](crate::params::Linear::operand).
    pub head: Derived<B>,
}
impl_params!(Embedding {
    tensors: [weight],
    modules: [],
    derived: [head]
});

impl<B: SnnOps> Embedding<B> {
    /// `Wᵀ` for the tied head: the transposed view under autodiff, the cached operand otherwise.
    pub fn head_operand(&self) -> Tensor<B, 2> {
        if B::ad_enabled(&self.weight.device()) {
            self.weight.clone().transpose()
        } else {
            self.head
                .get_or_init(|| as_operand(self.weight.clone().transpose()))
        }
    }
}

/// Embedding, decode path and tied head; the top-level reference parameters except the layers.
#[derive(Debug, Clone)]
pub struct Edge<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub norm: LateralInhibition<B>,
    pub decode_proj: Linear<B>,
    pub output_norm: RmsNorm<B>,
    pub output_neuron: PlifNode<B>,
}
impl_params!(Edge {
    tensors: [],
    modules: [embed_tokens, norm, decode_proj, output_norm, output_neuron]
});

impl<B: SnnOps> Edge<B> {
    pub fn init(cfg: &ModelConfig, rng: &mut Rng, device: &B::Device) -> Self {
        let (v, d) = (cfg.vocab_size, cfg.d);
        let embed = rng.normal_vec(v * d, 0.0, 0.02);
        let decode_w = xavier(rng, d, d);
        Edge {
            embed_tokens: Embedding {
                weight: weight(embed, [v, d], device),
                head: Derived::default(),
            },
            norm: LateralInhibition::init(d, device),
            decode_proj: Linear::new(
                weight(decode_w, [d, d], device),
                Some(param(vec![0.0; d], [d], device)),
            ),
            output_norm: RmsNorm::init(d, device),
            output_neuron: PlifNode::init(d, OUTPUT_V_THRESHOLD, rng, device),
        }
    }

    /// Token ids `[B, T]` → residual stream `[T, B, D]` (no scaling, no positional signal; the K
    /// frames of a token share this vector).
    pub fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let d = self.embed_tokens.weight.dims()[1];
        let e = self
            .embed_tokens
            .weight
            .clone()
            .select(0, ids.reshape([b * t]));
        e.reshape([b, t, d]).swap_dims(0, 1)
    }

    /// Decode path: `h` `[T, B, D]` → logits `[B, T, V]`, carrying the output neuron's membrane
    /// `v0` `[B, D]` and returning its final value.
    pub fn decode(
        &self,
        h: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        cfg: &ModelConfig,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [t, b, d] = h.dims();
        let k = cfg.k;
        // A decoding pass on a backend that fuses them: the norm, the output neuron and the
        // K-frame mean in one kernel, the LateralInhibition in another, each writing what the
        // next GEMM reads (four kernels with the GEMMs, where the composition has about 30).
        let fused = decoding_pass::<B>(t * k * b, &h.device());
        let norm = &self.output_norm;
        let neuron = &self.output_neuron;
        let m = fused
            .then(|| {
                nsactor_kernels::norm_plif_mean_fused(norm_plif_inputs(
                    norm,
                    neuron,
                    h.clone(),
                    k,
                    v0.clone(),
                    cfg.plif_out,
                ))
            })
            .flatten();
        let (m, state) = m.unwrap_or_else(|| {
            let (a, state) = neuron.forward_tokens(norm.forward(h), k, v0, cfg.plif_out);
            // Uniform K-frame mean per token.
            (
                a.reshape([t, k, b, d]).mean_dim(1).reshape([t, b, d]),
                state,
            )
        });
        // Batch-major; from here on every GEMM is over tokens.
        let m = m.swap_dims(0, 1).reshape([b * t, d]);
        nsactor_kernels::per_token_gemms(|| self.head(m, fused, [b, t, d], state))
    }

    /// The per-token end of [`decode`](Self::decode): `decode_proj`, LateralInhibition and the
    /// tied head on `m` `[B·T, D]`.
    fn head(
        &self,
        m: Tensor<B, 2>,
        fused: bool,
        [b, t, d]: [usize; 3],
        state: Tensor<B, 2>,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let y = self.decode_proj.forward(m);
        let gain = self.norm.gain.clone();
        let y = fused
            .then(|| nsactor_kernels::rms_norm_fused(y.clone(), gain, consts::LATERAL_EPS))
            .flatten()
            .unwrap_or_else(|| self.norm.forward(y.reshape([b, t, d])).reshape([b * t, d]));
        let logits = nsactor_kernels::matmul(y, self.embed_tokens.head_operand());
        let vocab = self.embed_tokens.weight.dims()[0];
        (logits.reshape([b, t, vocab]), state)
    }
}
