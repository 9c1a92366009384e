//! `InferOps`: the fused inference and decoding ops (PonderAgg, RMSNorm + input PLIF, the FFN
//! neurons, the SNNBlock's scan on its merged projection, its gate and skip, the centred
//! residual), and their tensor-level wrappers: `Some` where the backend fuses the op (and, for
//! the decoding fusions, [`decode_fusion`] is on), else `None` and the model composes it.

use crate::ops::types::{FfnInputs, NormPlifInputs, PonderInputs};
use crate::options::decode_fusion;
use crate::tensor::{prim, wrap};
use burn::tensor::{Tensor, backend::Backend, ops::FloatTensor};

/// Fused ops for inference and decoding only (no backward): each returns `None` by default, and
/// always on autodiff backends, and the model then composes the op from tensor ops. One of the
/// jobs of `SnnOps`.
pub trait InferOps: Backend {
    /// PonderNet halting and aggregation in one kernel, for inference only (no backward):
    /// [`PonderInputs`] → the aggregate `[T, B, D]` and E[K] `[T, B]`, with
    /// `p = clamp(σ(logit), c, 1 − c)` and λ normalised by `Σλ + eps` (SPEC §2.3). `None` (the
    /// default, and always on autodiff backends): the model composes it from tensor ops.
    fn ponder_agg_fused(inp: PonderInputs<Self>) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = inp;
        None
    }

    /// [`ponder_agg_fused`](Self::ponder_agg_fused) that also prepares a sublayer's residual
    /// update, for decoding passes: with `h` `[T, B, D]` and `w_mean` `[1, D]`, `Some((aggregate
    /// [T, B, D] in the GEMM's input type, c = h − round(aggregate)·w_meanᵀ [T, B, D], E[K]
    /// [T, B]))`, so that `aggregate·Wᵀ + c` is `h` plus the centred out projection when
    /// `w_mean` holds the column means of `Wᵀ` as the GEMM reads it. `None` (the default, and
    /// where the backend has no such kernel for these shapes): the model composes it.
    fn ponder_residual_fused(
        inp: PonderInputs<Self>,
        h: FloatTensor<Self>,
        w_mean: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (inp, h, w_mean);
        None
    }

    /// RMSNorm then a row-parameter input PLIF over the K frames of each token, for inference
    /// only ([`NormPlifInputs`]: β = σ(w), input current `(1 − β)·x̂`) → the output
    /// `[T·K, B, D]` (`(1 − β)·V_post` if `leak`, else `V_post`) and the final state. The
    /// output may come in the element type the backend's [`gemm`] reads (bf16 on
    /// CUDA in bf16 precision, rounded as the GEMM would round it): its consumers are
    /// projections. `None` (the default, and on autodiff backends): the model composes it.
    ///
    /// [`gemm`]: crate::GemmOps::gemm
    fn norm_plif_fused(
        inp: NormPlifInputs<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = inp;
        None
    }

    /// [`norm_plif_fused`](Self::norm_plif_fused) with each token's K outputs averaged:
    /// `Some((mean [T, B, D], final state [B, D]))`, the mean possibly in the GEMM's input
    /// type. `None` (the default, and on autodiff backends): composed.
    fn norm_plif_mean_fused(
        inp: NormPlifInputs<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = inp;
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

    /// The SNNFFN's gate and up neurons after its merged projection, for inference only
    /// ([`FfnInputs`]; `i_gu` `[TK, B, 2·D_ff]` (gate then up), or a 2-D `[TK·B, W ≥ 2·D_ff]`
    /// whose first 2·D_ff columns are the currents, read in place from a wider product) →
    /// `g·v` `[TK, B, D_ff]` (each `(1 − β)·V_post` if `leak`, else
    /// `V_post`; like [`norm_plif_fused`](Self::norm_plif_fused)'s output, possibly in the
    /// GEMM's input type: the down projection reads it) and the final state. `None` (the
    /// default, and on autodiff backends): composed.
    fn ffn_plif_fused(inp: FfnInputs<Self>) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = inp;
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
/// backend fuses it, else `None`.
pub fn ponder_agg_fused<B: InferOps>(inp: PonderInputs<B>) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    B::ponder_agg_fused(inp).map(|(agg, ek)| (wrap(agg), wrap(ek)))
}

/// [`InferOps::ponder_residual_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((aggregate, c, E[K]))`.
pub fn ponder_residual_fused<B: InferOps>(
    inp: PonderInputs<B>,
    h: Tensor<B, 3>,
    w_mean: Tensor<B, 2>,
) -> Option<(Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    B::ponder_residual_fused(inp, prim(h), prim(w_mean))
        .map(|(agg, c, ek)| (wrap(agg), wrap(c), wrap(ek)))
}

/// [`InferOps::norm_plif_fused`] on tensors: `Some((output [T·K, B, D], final state [B, D]))`
/// where the backend fuses it, else `None`.
pub fn norm_plif_fused<B: InferOps>(
    inp: NormPlifInputs<B>,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    B::norm_plif_fused(inp).map(|(y, last)| (wrap(y), wrap(last)))
}

/// [`InferOps::norm_plif_mean_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((mean over each token's K outputs [T, B, D], final state
/// [B, D]))`.
pub fn norm_plif_mean_fused<B: InferOps>(
    inp: NormPlifInputs<B>,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    B::norm_plif_mean_fused(inp).map(|(y, last)| (wrap(y), wrap(last)))
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
/// where the backend fuses it, else `None`. `i_gu` `[TK, B, 2·D_ff]`; see
/// [`ffn_plif_fused_rows`] for a column slice of a wider product.
pub fn ffn_plif_fused<B: InferOps>(inp: FfnInputs<B>) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    B::ffn_plif_fused(inp).map(|(gv, last)| (wrap(gv), wrap(last)))
}

/// [`ffn_plif_fused`] on the first `2·D_ff` columns of a 2-D `i_gu` `[TK·B, W]` read in place
/// (the merged gate/up/skip product of a decoding step), where the backend fuses it and
/// [`decode_fusion`] is on: `g·v` `[TK, B, D_ff]` and the final state.
pub fn ffn_plif_fused_rows<B: InferOps>(inp: FfnInputs<B>) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    if !decode_fusion() {
        return None;
    }
    ffn_plif_fused(inp)
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
