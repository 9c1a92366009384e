//! `InferOps`: the fused inference and decoding ops (PonderAgg, RMSNorm + input PLIF, the FFN
//! neurons, the SNNBlock's scan on its merged projection, its gate and skip, the centred
//! residual), and their tensor-level wrappers: `Some` where the backend fuses the op (and, for
//! the decoding fusions, [`decode_fusion`] is on), else `None` and the model composes it.

use crate::options::decode_fusion;
use crate::tensor::{prim, wrap};
use burn::tensor::{Tensor, backend::Backend, ops::FloatTensor};

/// Fused ops for inference and decoding only (no backward): each returns `None` by default, and
/// always on autodiff backends, and the model then composes the op from tensor ops. One of the
/// jobs of `SnnOps`.
pub trait InferOps: Backend {
    /// PonderNet halting and aggregation in one kernel, for inference only (no backward):
    /// `frames` `[T·K, B, D]`, the halt projection's weight `[1, D]` and bias `[1]` → the aggregate
    /// `[T, B, D]` and E[K] `[T, B]`, with `p = clamp(σ(logit), c, 1 − c)` and λ normalised by
    /// `Σλ + eps` (SPEC §2.3). `None` (the default, and always on autodiff backends): the model
    /// composes it from tensor ops.
    fn ponder_agg_fused(
        frames: FloatTensor<Self>,
        halt_w: FloatTensor<Self>,
        halt_b: FloatTensor<Self>,
        k: usize,
        clamp: f64,
        eps: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (frames, halt_w, halt_b, k, clamp, eps);
        None
    }

    /// [`ponder_agg_fused`](Self::ponder_agg_fused) that also prepares a sublayer's residual
    /// update, for decoding passes: with `h` `[T, B, D]` and `w_mean` `[1, D]`, `Some((aggregate
    /// [T, B, D] in the GEMM's input type, c = h − round(aggregate)·w_meanᵀ [T, B, D], E[K]
    /// [T, B]))`, so that `aggregate·Wᵀ + c` is `h` plus the centred out projection when
    /// `w_mean` holds the column means of `Wᵀ` as the GEMM reads it. `None` (the default, and
    /// where the backend has no such kernel for these shapes): the model composes it.
    #[allow(clippy::too_many_arguments)]
    fn ponder_residual_fused(
        frames: FloatTensor<Self>,
        halt_w: FloatTensor<Self>,
        halt_b: FloatTensor<Self>,
        h: FloatTensor<Self>,
        w_mean: FloatTensor<Self>,
        k: usize,
        clamp: f64,
        eps: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (frames, halt_w, halt_b, h, w_mean, k, clamp, eps);
        None
    }

    /// RMSNorm then a row-parameter input PLIF over the K frames of each token, for inference
    /// only: `x` `[T, B, D]`, the norm weight `[D]` and `eps`, the neuron's β logits `w` `[D]`
    /// (β = σ(w), input current `(1 − β)·x̂`), `v_th` `[D]`, state `v0` `[B, D]` → the output
    /// `[T·K, B, D]` (`(1 − β)·V_post` if `leak`, else `V_post`) and the final state. The
    /// output may come in the element type the backend's [`gemm`] reads (bf16 on
    /// CUDA in bf16 precision, rounded as the GEMM would round it): its consumers are
    /// projections. `None` (the default, and on autodiff backends): the model composes it.
    ///
    /// [`gemm`]: crate::GemmOps::gemm
    #[allow(clippy::too_many_arguments)]
    fn norm_plif_fused(
        x: FloatTensor<Self>,
        norm_w: FloatTensor<Self>,
        eps: f64,
        w: FloatTensor<Self>,
        v_th: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        k: usize,
        leak: bool,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (x, norm_w, eps, w, v_th, v0, k, leak);
        None
    }

    /// [`norm_plif_fused`](Self::norm_plif_fused) with each token's K outputs averaged:
    /// `Some((mean [T, B, D], final state [B, D]))`, the mean possibly in the GEMM's input
    /// type. `None` (the default, and on autodiff backends): composed.
    #[allow(clippy::too_many_arguments)]
    fn norm_plif_mean_fused(
        x: FloatTensor<Self>,
        norm_w: FloatTensor<Self>,
        eps: f64,
        w: FloatTensor<Self>,
        v_th: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        k: usize,
        leak: bool,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (x, norm_w, eps, w, v_th, v0, k, leak);
        None
    }

    /// RMSNorm of the rows of `x` `[rows, D]` with `gain` `[D]`, for inference only:
    /// `x / √(mean_D(x²) + eps) · gain`, possibly in the GEMM's input type. `None` (the
    /// default, and on autodiff backends): composed.
    fn rms_norm_fused(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        eps: f64,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, gain, eps);
        None
    }

    /// The SNNFFN's gate and up neurons after its merged projection, for inference only:
    /// `i_gu` `[TK, B, 2·D_ff]` (gate then up), or a 2-D `[TK·B, W ≥ 2·D_ff]` whose first
    /// 2·D_ff columns are the currents (read in place from a wider product), each neuron's β
    /// logits and thresholds `[D_ff]`,
    /// state `v0` `[B, 2·D_ff]` → `g·v` `[TK, B, D_ff]` (each `(1 − β)·V_post` if `leak`, else
    /// `V_post`; like [`norm_plif_fused`](Self::norm_plif_fused)'s output, possibly in the
    /// GEMM's input type: the down projection reads it) and the final state. `None` (the
    /// default, and on autodiff backends): composed.
    #[allow(clippy::too_many_arguments)]
    fn ffn_plif_fused(
        i_gu: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        th_gate: FloatTensor<Self>,
        th_up: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        leak: bool,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (i_gu, w_gate, w_up, th_gate, th_up, v0, leak);
        None
    }

    /// The SNNBlock's selective scan for inference on its merged projection `y` `[TK·B, W]`
    /// (columns `[0, DN)` the input current, then `r_β, r_α, r_th`; the modulation of
    /// [`plif_selective_forward`]), read in place: `(V_post [TK·B, DN], final state [B, DN])`, no
    /// spikes, `V_post` possibly in the GEMM's input type (the out-projection reads it). Biases
    /// `[DN]`, `v0` `[B, DN]`. `None` (the default, and on autodiff backends): the model slices
    /// `y` and calls the scan.
    ///
    /// [`plif_selective_forward`]: crate::SnnOps::plif_selective_forward
    fn block_scan_fused(
        y: FloatTensor<Self>,
        b_beta: FloatTensor<Self>,
        b_alpha: FloatTensor<Self>,
        b_th: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        v_th_min: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (y, b_beta, b_alpha, b_th, v0, v_th_min);
        None
    }

    /// `out·σ(y[:, gate_col..gate_col + D]) + y[:, skip_col..skip_col + D]` for `out`
    /// `[rows, D]`, for inference: the SNNBlock's gated output with its skip path, read from
    /// the merged projection. `None` (the default): composed.
    fn gate_skip_fused(
        out: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gate_col: usize,
        skip_col: usize,
    ) -> Option<FloatTensor<Self>> {
        let _ = (out, y, gate_col, skip_col);
        None
    }

    /// `h + (r − mean_D(r))` for `h`, `r` `[rows, D]`, for inference: a sublayer's residual
    /// update with its centred out-projection. `None` (the default): composed.
    fn centred_residual_fused(
        h: FloatTensor<Self>,
        r: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let _ = (h, r);
        None
    }
}

/// [`InferOps::ponder_agg_fused`] on tensors: `Some((aggregate [T, B, D], E[K] [T, B]))` where the
/// backend fuses it, else `None`. `halt_w` `[1, D]`, `halt_b` `[1]`.
pub fn ponder_agg_fused<B: InferOps>(
    frames: Tensor<B, 3>,
    halt_w: Tensor<B, 2>,
    halt_b: Tensor<B, 1>,
    k: usize,
    clamp: f64,
    eps: f64,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    B::ponder_agg_fused(prim(frames), prim(halt_w), prim(halt_b), k, clamp, eps)
        .map(|(agg, ek)| (wrap(agg), wrap(ek)))
}

/// [`InferOps::ponder_residual_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((aggregate, c, E[K]))`.
#[allow(clippy::too_many_arguments)]
pub fn ponder_residual_fused<B: InferOps>(
    frames: Tensor<B, 3>,
    halt_w: Tensor<B, 2>,
    halt_b: Tensor<B, 1>,
    h: Tensor<B, 3>,
    w_mean: Tensor<B, 2>,
    k: usize,
    clamp: f64,
    eps: f64,
) -> Option<(Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    B::ponder_residual_fused(
        prim(frames),
        prim(halt_w),
        prim(halt_b),
        prim(h),
        prim(w_mean),
        k,
        clamp,
        eps,
    )
    .map(|(agg, c, ek)| (wrap(agg), wrap(c), wrap(ek)))
}

/// [`InferOps::norm_plif_fused`] on tensors: `Some((output [T·K, B, D], final state [B, D]))`
/// where the backend fuses it, else `None`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_fused<B: InferOps>(
    x: Tensor<B, 3>,
    norm_w: Tensor<B, 1>,
    eps: f64,
    w: Tensor<B, 1>,
    v_th: Tensor<B, 1>,
    v0: Tensor<B, 2>,
    k: usize,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    B::norm_plif_fused(
        prim(x),
        prim(norm_w),
        eps,
        prim(w),
        prim(v_th),
        prim(v0),
        k,
        leak,
    )
    .map(|(y, last)| (wrap(y), wrap(last)))
}

/// [`InferOps::norm_plif_mean_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((mean over each token's K outputs [T, B, D], final state
/// [B, D]))`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_mean_fused<B: InferOps>(
    x: Tensor<B, 3>,
    norm_w: Tensor<B, 1>,
    eps: f64,
    w: Tensor<B, 1>,
    v_th: Tensor<B, 1>,
    v0: Tensor<B, 2>,
    k: usize,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    B::norm_plif_mean_fused(
        prim(x),
        prim(norm_w),
        eps,
        prim(w),
        prim(v_th),
        prim(v0),
        k,
        leak,
    )
    .map(|(y, last)| (wrap(y), wrap(last)))
}

/// [`InferOps::rms_norm_fused`] on tensors, where the backend fuses it and [`decode_fusion`]
/// is on.
pub fn rms_norm_fused<B: InferOps>(
    x: Tensor<B, 2>,
    gain: Tensor<B, 1>,
    eps: f64,
) -> Option<Tensor<B, 2>> {
    if !decode_fusion() {
        return None;
    }
    B::rms_norm_fused(prim(x), prim(gain), eps).map(wrap)
}

/// [`InferOps::ffn_plif_fused`] on tensors: `Some((g·v [TK, B, D_ff], final state [B, 2·D_ff]))`
/// where the backend fuses it, else `None`. `i_gu` `[TK, B, 2·D_ff]`; `params` the gate and up
/// neurons' β logits, then their thresholds (`[D_ff]` each); see [`ffn_plif_fused_rows`] for a
/// column slice of a wider product.
pub fn ffn_plif_fused<B: InferOps>(
    i_gu: Tensor<B, 3>,
    params: [Tensor<B, 1>; 4],
    v0: Tensor<B, 2>,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    ffn_plif_call(prim(i_gu), params, v0, leak)
}

/// [`ffn_plif_fused`] on the first `2·D_ff` columns of a 2-D `i_gu` `[TK·B, W]` read in place
/// (the merged gate/up/skip product of a decoding step), where the backend fuses it and
/// [`decode_fusion`] is on: `g·v` `[TK, B, D_ff]` and the final state.
pub fn ffn_plif_fused_rows<B: InferOps>(
    i_gu: Tensor<B, 2>,
    params: [Tensor<B, 1>; 4],
    v0: Tensor<B, 2>,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    ffn_plif_call(prim(i_gu), params, v0, leak)
}

fn ffn_plif_call<B: InferOps>(
    i_gu: FloatTensor<B>,
    params: [Tensor<B, 1>; 4],
    v0: Tensor<B, 2>,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    let [w_gate, w_up, th_gate, th_up] = params.map(prim);
    B::ffn_plif_fused(i_gu, w_gate, w_up, th_gate, th_up, prim(v0), leak)
        .map(|(gv, last)| (wrap(gv), wrap(last)))
}

/// [`InferOps::block_scan_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on.
pub fn block_scan_fused<B: InferOps>(
    y: Tensor<B, 2>,
    b_beta: Tensor<B, 1>,
    b_alpha: Tensor<B, 1>,
    b_th: Tensor<B, 1>,
    v0: Tensor<B, 2>,
    v_th_min: f64,
) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    B::block_scan_fused(
        prim(y),
        prim(b_beta),
        prim(b_alpha),
        prim(b_th),
        prim(v0),
        v_th_min,
    )
    .map(|(vpost, last)| (wrap(vpost), wrap(last)))
}

/// [`InferOps::gate_skip_fused`] on tensors, where the backend fuses it and [`decode_fusion`]
/// is on.
pub fn gate_skip_fused<B: InferOps>(
    out: Tensor<B, 2>,
    y: Tensor<B, 2>,
    gate_col: usize,
    skip_col: usize,
) -> Option<Tensor<B, 2>> {
    if !decode_fusion() {
        return None;
    }
    B::gate_skip_fused(prim(out), prim(y), gate_col, skip_col).map(wrap)
}

/// [`InferOps::centred_residual_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on.
pub fn centred_residual_fused<B: InferOps>(
    h: Tensor<B, 2>,
    r: Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    if !decode_fusion() {
        return None;
    }
    B::centred_residual_fused(prim(h), prim(r)).map(wrap)
}
