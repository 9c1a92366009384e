//! SNNDecoderLayer: two Pre-LN sublayers, each PLIF input → SNN core → PonderAgg → centred
//! out-projection added to the residual stream (SPEC §2.3).

use crate::config::{ModelConfig, PlifOut, consts};
use crate::init::{Rng, xavier};
use crate::neurons::{PlifNode, RmsNorm, norm_plif_inputs, param, weight};
use crate::params::{Derived, Linear, decoding_pass, impl_params};
use crate::snn_block::SnnBlock;
use crate::snn_ffn::SnnFfn;
use burn::tensor::{Tensor, TensorData, activation::sigmoid, backend::Backend};
use nsactor_kernels::{PonderInputs, SnnOps};

/// Input-neuron threshold base `v0 = 0.5` (τ₀ = 2).
const INPUT_V_THRESHOLD: f64 = 0.5;
const HALT_BIAS: f32 = -3.5;

#[derive(Debug, Clone)]
pub struct SnnDecoderLayer<B: Backend> {
    pub snn_block: SnnBlock<B>,
    pub snn_ffn: SnnFfn<B>,
    pub block_norm: RmsNorm<B>,
    pub ffn_norm: RmsNorm<B>,
    pub input_neuron1: PlifNode<B>,
    pub input_neuron2: PlifNode<B>,
    pub block_out_proj: Linear<B>,
    pub ffn_out_proj: Linear<B>,
    pub block_halt: Linear<B>,
    pub ffn_halt: Linear<B>,
    /// Per input channel, the mean over output channels of each out projection's weight as
    /// its GEMM reads it ([`Linear::operand_row_means`]): a decoding pass subtracts the
    /// output's mean through it ([`residual_update`]).
    pub block_out_mean: Derived<B>,
    pub ffn_out_mean: Derived<B>,
}
impl_params!(SnnDecoderLayer {
    tensors: [],
    modules: [
        snn_block,
        snn_ffn,
        block_norm,
        ffn_norm,
        input_neuron1,
        input_neuron2,
        block_out_proj,
        ffn_out_proj,
        block_halt,
        ffn_halt
    ],
    derived: [block_out_mean, ffn_out_mean]
});

/// The membrane states one layer carries between calls (the "KV cache" of an SNN):
/// `input1`, `input2` `[B, D]`, `hidden` `[B, D·N]`, `ffn` `[B, 2·D_ff]` (gate then up).
#[derive(Debug, Clone)]
pub struct LayerState<B: Backend> {
    pub input1: Tensor<B, 2>,
    pub hidden: Tensor<B, 2>,
    pub input2: Tensor<B, 2>,
    pub ffn: Tensor<B, 2>,
}

impl<B: Backend> LayerState<B> {
    /// All membranes at rest (the state at the start of every training sequence).
    pub fn zeros(cfg: &ModelConfig, batch: usize, device: &B::Device) -> Self {
        LayerState {
            input1: Tensor::zeros([batch, cfg.d], device),
            hidden: Tensor::zeros([batch, cfg.dn()], device),
            input2: Tensor::zeros([batch, cfg.d], device),
            ffn: Tensor::zeros([batch, 2 * cfg.d_ff], device),
        }
    }
}

/// What a layer returns for a sequence.
#[derive(Debug, Clone)]
pub struct LayerOutput<B: Backend> {
    /// Residual stream after the layer, per token `[T, B, D]`.
    pub h: Tensor<B, 3>,
    /// E[K] per token of the two sublayers, `[T, B]` each.
    pub expected_k: [Tensor<B, 2>; 2],
    pub state: LayerState<B>,
}

impl<B: Backend> LayerOutput<B> {
    /// `(pc₁ + pc₂)/2`, each the mean E[K] over `(T, B)` (a scalar `[1]`). Computed on request:
    /// decoding never asks, and its six reductions were a fifth of a decoding step's launches.
    pub fn ponder_cost(&self) -> Tensor<B, 1> {
        let [ek1, ek2] = &self.expected_k;
        (ek1.clone().mean() + ek2.clone().mean()) / 2.0
    }
}

impl<B: SnnOps> SnnDecoderLayer<B> {
    pub fn init(cfg: &ModelConfig, rng: &mut Rng, device: &B::Device) -> Self {
        let d = cfg.d;
        let out_std = 0.02 / ((2 * cfg.num_layers) as f64).sqrt();
        let lin = |w, out, inp, bias: Option<Vec<f32>>| {
            Linear::new(
                weight(w, [out, inp], device),
                bias.map(|b| param(b, [out], device)),
            )
        };
        let snn_block = SnnBlock::init(cfg, rng, device);
        let snn_ffn = SnnFfn::init(cfg, rng, device);
        let input_neuron1 = PlifNode::init(d, INPUT_V_THRESHOLD, rng, device);
        let input_neuron2 = PlifNode::init(d, INPUT_V_THRESHOLD, rng, device);
        let block_out_proj = lin(rng.normal_vec(d * d, 0.0, out_std), d, d, None);
        let ffn_out_proj = lin(rng.normal_vec(d * d, 0.0, out_std), d, d, None);
        let halt = |rng: &mut Rng| {
            let w = xavier(rng, 1, d).into_iter().map(|x| x * 0.01).collect();
            lin(w, 1, d, Some(vec![HALT_BIAS]))
        };
        let block_halt = halt(rng);
        let ffn_halt = halt(rng);
        SnnDecoderLayer {
            snn_block,
            snn_ffn,
            block_norm: RmsNorm::init(d, device),
            ffn_norm: RmsNorm::init(d, device),
            input_neuron1,
            input_neuron2,
            block_out_proj,
            ffn_out_proj,
            block_halt,
            ffn_halt,
            block_out_mean: Derived::default(),
            ffn_out_mean: Derived::default(),
        }
    }

    /// Runs the layer over `h` `[T, B, D]` (one vector per token: the residual stream is the same
    /// in all K frames, SPEC §3) from `state`. Training starts from [`LayerState::zeros`]; decoding
    /// passes the state returned by the previous call, so T calls with one token each equal one
    /// call with T tokens.
    pub fn forward(
        &self,
        h: Tensor<B, 3>,
        state: LayerState<B>,
        cfg: &ModelConfig,
    ) -> LayerOutput<B> {
        self.run(h, state, cfg, false).0
    }

    /// [`forward`](Self::forward), and the hidden neurons' selective
    /// β(t) = σ(W_β·a + b_β) of every frame `[T·K, B, D·N]` (what the scan decays by; the
    /// interpretability study's timescales).
    pub fn probe(
        &self,
        h: Tensor<B, 3>,
        state: LayerState<B>,
        cfg: &ModelConfig,
    ) -> (LayerOutput<B>, Tensor<B, 3>) {
        let (out, beta) = self.run(h, state, cfg, true);
        (out, beta.expect("asked for β"))
    }

    fn run(
        &self,
        h: Tensor<B, 3>,
        state: LayerState<B>,
        cfg: &ModelConfig,
        with_beta: bool,
    ) -> (LayerOutput<B>, Option<Tensor<B, 3>>) {
        let k = cfg.k;
        let out = cfg.plif_out;
        // Sublayer 1: SNNBlock.
        let (a1, input1) = norm_plif(
            &self.block_norm,
            &self.input_neuron1,
            h.clone(),
            k,
            state.input1,
            out,
        );
        let beta = with_beta.then(|| self.snn_block.beta(a1.clone()));
        let (c1, hidden) = self.snn_block.forward(a1, state.hidden, cfg.v_th_min);
        let (h, ek1) = residual_update(
            h,
            c1,
            &self.block_halt,
            &self.block_out_proj,
            &self.block_out_mean,
            k,
        );
        // Sublayer 2: SNNFFN.
        let (a2, input2) = norm_plif(
            &self.ffn_norm,
            &self.input_neuron2,
            h.clone(),
            k,
            state.input2,
            out,
        );
        let (c2, ffn) = self.snn_ffn.forward(a2, state.ffn, out);
        let (h, ek2) = residual_update(
            h,
            c2,
            &self.ffn_halt,
            &self.ffn_out_proj,
            &self.ffn_out_mean,
            k,
        );
        let out = LayerOutput {
            h,
            expected_k: [ek1, ek2],
            state: LayerState {
                input1,
                hidden,
                input2,
                ffn,
            },
        };
        (out, beta)
    }

    /// Alias of [`forward`](Self::forward) for one token `[1, B, D]`, named for the streaming path.
    pub fn step(&self, h: Tensor<B, 3>, state: LayerState<B>, cfg: &ModelConfig) -> LayerOutput<B> {
        assert_eq!(h.dims()[0], 1, "step takes one token, got {}", h.dims()[0]);
        self.forward(h, state, cfg)
    }
}

impl<B: SnnOps> SnnDecoderLayer<B> {
    /// The layer computed the way the reference lays it out: on all `T·K` frames of the residual
    /// stream `[T·K, B, D]`, norms and input currents per frame, residual increments broadcast
    /// back over each token's K frames (SPEC §2.3). It exists to check SPEC §3 — that the frames
    /// of a token stay identical, so [`forward`](Self::forward) may work per token.
    pub fn forward_frames(&self, h: Tensor<B, 3>, cfg: &ModelConfig) -> Tensor<B, 3> {
        let [tk, b, d] = h.dims();
        let (k, out) = (cfg.k, cfg.plif_out);
        let device = h.device();
        let zeros = |w| Tensor::<B, 2>::zeros([b, w], &device);
        let frames = |x: Tensor<B, 3>| crate::neurons::repeat_frames(x, k);
        let (a1, _) =
            self.input_neuron1
                .forward_frames(self.block_norm.forward(h.clone()), zeros(d), out);
        let (c1, _) = self.snn_block.forward(a1, zeros(cfg.dn()), cfg.v_th_min);
        let (agg1, _) = ponder_agg(c1, &self.block_halt, k);
        let h = h + frames(centred(&self.block_out_proj, agg1));
        let (a2, _) =
            self.input_neuron2
                .forward_frames(self.ffn_norm.forward(h.clone()), zeros(d), out);
        let (c2, _) = self.snn_ffn.forward(a2, zeros(2 * cfg.d_ff), out);
        let (agg2, _) = ponder_agg(c2, &self.ffn_halt, k);
        let h = h + frames(centred(&self.ffn_out_proj, agg2));
        debug_assert_eq!(h.dims(), [tk, b, d]);
        h
    }
}

/// The start of each sublayer: RMSNorm, then the input PLIF over the K frames of each token
/// (`[T, B, D]` → `[T·K, B, D]` and the final state). Two kernels where the backend fuses them
/// for inference ([`nsactor_kernels::InferOps::norm_plif_fused`]), one differentiable op where it
/// fuses them for training ([`nsactor_kernels::norm_plif_train`]), else composed.
pub fn norm_plif<B: SnnOps>(
    norm: &RmsNorm<B>,
    neuron: &PlifNode<B>,
    h: Tensor<B, 3>,
    k: usize,
    v0: Tensor<B, 2>,
    out: PlifOut,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let inputs = || norm_plif_inputs(norm, neuron, h.clone(), k, v0.clone(), out);
    if let Some(fused) = nsactor_kernels::norm_plif_fused(inputs()) {
        return fused;
    }
    if B::fuses_norm_plif() {
        return nsactor_kernels::norm_plif_train(inputs());
    }
    norm_plif_composed(norm, neuron, h, k, v0, out)
}

/// The fused kernels' inputs for PonderAgg over `frames` `[T·K, B, D]` with the halt projection
/// `halt` (weight `[1, D]`) and its bias `[1]`.
pub fn ponder_inputs<B: SnnOps>(
    frames: Tensor<B, 3>,
    halt: &Linear<B>,
    bias: &Tensor<B, 1>,
    k: usize,
) -> PonderInputs<B> {
    PonderInputs::new(
        frames,
        halt.weight.clone(),
        bias.clone(),
        k,
        consts::HALT_CLAMP,
        consts::HALT_NORM_EPS,
    )
}

/// [`norm_plif`] composed from tensor ops (autodiff's path and the fused kernels' reference).
pub fn norm_plif_composed<B: SnnOps>(
    norm: &RmsNorm<B>,
    neuron: &PlifNode<B>,
    h: Tensor<B, 3>,
    k: usize,
    v0: Tensor<B, 2>,
    out: PlifOut,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    neuron.forward_tokens(norm.forward(h), k, v0, out)
}

/// A sublayer's end: PonderAgg over its `frames`, then `h + centred(proj, agg)`, with E[K].
///
/// In a decoding pass where the backend fuses it
/// ([`nsactor_kernels::InferOps::ponder_residual_fused`]), the PonderAgg kernel also writes
/// `c = h − agg·w̄` (`w̄` = [`Linear::operand_row_means`], so `agg·w̄` is the mean over the
/// output channels of `agg·Wᵀ`) and the out projection's GEMM adds `c` in its epilogue: two
/// kernels where the composition has four (the aggregate's cast, the centring kernel).
fn residual_update<B: SnnOps>(
    h: Tensor<B, 3>,
    frames: Tensor<B, 3>,
    halt: &Linear<B>,
    proj: &Linear<B>,
    mean: &Derived<B>,
    k: usize,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [t, b, d] = h.dims();
    if decoding_pass::<B>(t * b, &h.device())
        && proj.bias.is_none()
        && let Some(bias) = &halt.bias
        && let Some((agg, c, ek)) = nsactor_kernels::ponder_residual_fused(
            ponder_inputs(frames.clone(), halt, bias, k),
            h.clone(),
            mean.get_or_init(|| proj.operand_row_means()),
        )
    {
        // Over tokens, as every GEMM of the residual update.
        let x = nsactor_kernels::per_token_gemms(|| {
            proj.forward_add(agg.reshape([t * b, d]), c.reshape([t * b, d]))
        });
        return (x.reshape([t, b, d]), ek);
    }
    let (agg, ek) = ponder_agg(frames, halt, k);
    (
        nsactor_kernels::per_token_gemms(|| add_centred(h, proj, agg)),
        ek,
    )
}

/// The residual update `h + centred(proj, agg)`: one kernel after the GEMM in a decoding pass
/// where the backend fuses it ([`nsactor_kernels::InferOps::centred_residual_fused`]).
fn add_centred<B: SnnOps>(h: Tensor<B, 3>, proj: &Linear<B>, agg: Tensor<B, 3>) -> Tensor<B, 3> {
    let [t, b, d] = agg.dims();
    let r = proj.forward(agg.reshape([t * b, d]));
    if decoding_pass::<B>(t * b, &r.device())
        && let Some(x) =
            nsactor_kernels::centred_residual_fused(h.clone().reshape([t * b, d]), r.clone())
    {
        return x.reshape([t, b, d]);
    }
    h + centre(r.reshape([t, b, d]))
}

/// Out-projection with residual centering: `r − mean_D(r)` per token.
fn centred<B: SnnOps>(proj: &Linear<B>, agg: Tensor<B, 3>) -> Tensor<B, 3> {
    let [t, b, d] = agg.dims();
    centre(proj.forward(agg.reshape([t * b, d])).reshape([t, b, d]))
}

/// `r − mean_D(r)` per token.
fn centre<B: Backend>(r: Tensor<B, 3>) -> Tensor<B, 3> {
    r.clone() - r.mean_dim(2)
}

/// PonderNet aggregation over the K frames of each token (SPEC §2.3): geometric halting
/// `λ_k = p_k·Π_{j<k}(1 − p_j)`, normalised by `Σλ` (not PonderNet's remainder-to-last-step).
/// `frames` `[T·K, B, D]` → aggregate `[T, B, D]` and E[K] `[T, B]`. One kernel where the
/// backend fuses it for inference ([`nsactor_kernels::InferOps::ponder_agg_fused`]), one
/// differentiable op where it fuses it for training ([`nsactor_kernels::ponder_agg_train`]),
/// else composed.
pub fn ponder_agg<B: SnnOps>(
    frames: Tensor<B, 3>,
    halt: &Linear<B>,
    k: usize,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    if let Some(bias) = &halt.bias
        && let Some(fused) =
            nsactor_kernels::ponder_agg_fused(ponder_inputs(frames.clone(), halt, bias, k))
    {
        return fused;
    }
    if B::fuses_ponder()
        && let Some(bias) = &halt.bias
    {
        return nsactor_kernels::ponder_agg_train(ponder_inputs(frames, halt, bias, k));
    }
    ponder_agg_composed(frames, halt, k)
}

/// [`ponder_agg`] composed from tensor ops (what autodiff differentiates, and the reference the
/// fused kernel is checked against).
pub fn ponder_agg_composed<B: SnnOps>(
    frames: Tensor<B, 3>,
    halt: &Linear<B>,
    k: usize,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [tk, b, d] = frames.dims();
    let t = tk / k;
    let logit = halt
        .forward(frames.clone().reshape([tk * b, d]))
        .reshape([t, k, b]);
    let p = sigmoid(logit).clamp(consts::HALT_CLAMP, 1.0 - consts::HALT_CLAMP);
    let log_stay = p.clone().neg().log1p(); // log(1 − p_j)
    // Exclusive cumsum over k: logS_0 = 0, logS_k = Σ_{j<k} log(1 − p_j).
    let log_survive = Tensor::cat(
        vec![
            Tensor::zeros([t, 1, b], &log_stay.device()),
            log_stay.slice([0..t, 0..k - 1]).cumsum(1),
        ],
        1,
    );
    let lambda = p * log_survive.exp();
    let lambda_hat = lambda.clone() / (lambda.sum_dim(1) + consts::HALT_NORM_EPS); // [T, K, B]
    let agg = (frames.reshape([t, k, b, d]) * lambda_hat.clone().unsqueeze_dim::<4>(3)).sum_dim(1);
    let steps: Vec<f32> = (1..=k).map(|i| i as f32).collect();
    let steps = Tensor::<B, 1>::from_data(TensorData::new(steps, [k]), &lambda_hat.device())
        .reshape([1, k, 1]);
    let ek = (lambda_hat * steps).sum_dim(1).reshape([t, b]);
    (agg.reshape([t, b, d]), ek)
}
