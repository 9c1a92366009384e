//! `SnnOps`: the union of the ops traits the model bounds its backends by, with its own methods,
//! the fused training ops (the selective scan with its modulation, RMSNorm + the input PLIF,
//! PonderAgg, the SNNFFN's neurons, the SNNBlock's gated output), whose defaults run the
//! compositions of [`crate::reference`]; and their tensor-level wrappers ([`plif_selective`],
//! [`norm_plif_train`], [`ponder_agg_train`], [`ffn_neurons`], [`gated_out`]).

use crate::ops::device::{DeviceOps, GraphOps};
use crate::ops::gemm::GemmOps;
use crate::ops::infer::InferOps;
use crate::ops::optim::OptimOps;
use crate::ops::scan::{ScanOps, plif_elem};
use crate::ops::types::{
    FfnGrads, FfnInputs, NormPlifInputs, PlifOutput, PonderInputs, SelectiveGrads, SelectiveInputs,
};
use crate::reference::ffn::{ffn_backward_reference, ffn_forward_reference};
use crate::reference::gated::{gated_out_backward_reference, gated_out_forward_reference};
use crate::reference::norm_plif::{norm_plif_backward_reference, norm_plif_forward_reference};
use crate::reference::ponder::{ponder_backward_reference, ponder_forward_reference};
use crate::reference::selective::{
    selective_backward_reference, selective_forward_reference, selective_modulation,
};
use crate::tensor::{last_frame, prim, wrap};
use burn::tensor::{Tensor, ops::FloatTensor};

/// Backend extension with the PLIF scans and everything the model runs through its backend
/// (DESIGN "The seams", point 1): the union of [`GemmOps`] (the GEMM hook), [`ScanOps`] (the
/// scans), [`InferOps`] (the inference fusions), [`DeviceOps`] and [`GraphOps`] (devices, queued
/// work, captured steps), and its own methods: the fused training ops, each a forward and a
/// backward that `Autodiff<B>` ties into one differentiable op.
///
/// Every method of the family has a default (the exact host scans of [`crate::reference`], the
/// compositions from tensor ops, burn's own matmul), so any burn backend is correct with no extra
/// code; a backend overrides a method only with a kernel that computes the same thing, tested
/// against these defaults.
pub trait SnnOps: GemmOps + ScanOps + InferOps + DeviceOps + GraphOps + OptimOps {
    /// Whether the backend fuses the selective modulation into its scan kernels: then
    /// [`plif_selective`] calls the two methods below; otherwise it composes the modulation
    /// from tensor ops (as their defaults do) and leaves the gradients to autodiff.
    fn fuses_modulation() -> bool {
        false
    }

    /// The selective scan with the SNNBlock modulation fused in (SPEC §2.3, Eq. 5–7):
    /// `β = σ(r_β + b_β)`, `α = softplus(r_α + b_α)`, `V_th = V_min + |r_th + b_th|`,
    /// `u = α·i`, then the per-element scan. Default: [`selective_forward_reference`].
    fn plif_selective_forward(inp: SelectiveInputs<Self>) -> PlifOutput<Self> {
        selective_forward_reference(inp)
    }

    /// [`plif_selective_forward`](Self::plif_selective_forward) where no gradient will be
    /// taken (an untracked pass, as the pipeline's training forward before its recompute):
    /// `(V_post, final state)`, no spikes, which only the backward reads. Default: the
    /// forward, its spikes dropped.
    fn plif_selective_untracked(
        inp: SelectiveInputs<Self>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let out = Self::plif_selective_forward(inp);
        (out.vpost, out.last)
    }

    /// Its backward: gradients of `Σ V_post·grad_vpost` for every input. Default:
    /// [`selective_backward_reference`].
    fn plif_selective_backward(
        inp: SelectiveInputs<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> SelectiveGrads<Self> {
        selective_backward_reference(inp, vpost, spike, grad_vpost)
    }

    /// Whether the backend runs RMSNorm and the input PLIF in training as one differentiable op
    /// ([`norm_plif_train`]: the two methods below).
    fn fuses_norm_plif() -> bool {
        false
    }

    /// Their forward: `(output [T·K, B, D], V_post [T·K, B, D])`. The output may come in
    /// [`GemmOps::storage_dtype`] (the projections that read it round it so; CUDA in bf16),
    /// and then its gradient comes in that type to the backward. Default:
    /// [`norm_plif_forward_reference`] (f32).
    fn norm_plif_forward(inp: NormPlifInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        norm_plif_forward_reference(&inp)
    }

    /// Their backward: `[∂x, ∂norm_w, ∂w, ∂v_th, ∂v0]`. Default:
    /// [`norm_plif_backward_reference`].
    fn norm_plif_backward(
        inp: NormPlifInputs<Self>,
        vpost: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 5] {
        norm_plif_backward_reference(inp, vpost, grad)
    }

    /// Whether the backend runs PonderNet's halting and aggregation in training as one
    /// differentiable op ([`ponder_agg_train`]: the two methods below).
    fn fuses_ponder() -> bool {
        false
    }

    /// PonderAgg's forward: the aggregate `[T, B, D]` and E[K] packed as `[T, B, D + 1]`.
    /// Default: [`ponder_forward_reference`].
    fn ponder_forward(inp: PonderInputs<Self>) -> FloatTensor<Self> {
        ponder_forward_reference(&inp)
    }

    /// Its backward from the packed gradient: `[∂frames, ∂halt_w [1, D], ∂halt_b [1]]`.
    /// Default: [`ponder_backward_reference`].
    fn ponder_backward(inp: PonderInputs<Self>, grad: FloatTensor<Self>) -> [FloatTensor<Self>; 3] {
        ponder_backward_reference(inp, grad)
    }

    /// Whether the backend runs the SNNFFN's neurons in training as one differentiable op
    /// ([`ffn_neurons`]: the two methods below) instead of the composition autodiff derives.
    fn fuses_ffn_neurons() -> bool {
        false
    }

    /// The FFN neurons' forward for training: `(g·v [TK, B, D_ff], V_post [TK, B, 2·D_ff])`.
    /// Default: [`ffn_forward_reference`].
    fn ffn_neurons_forward(inp: FfnInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        ffn_forward_reference(&inp)
    }

    /// Their backward from the saved `V_post` and the gradient of `g·v`. Default:
    /// [`ffn_backward_reference`].
    fn ffn_neurons_backward(
        inp: FfnInputs<Self>,
        vpost: FloatTensor<Self>,
        grad_gv: FloatTensor<Self>,
    ) -> FfnGrads<Self> {
        ffn_backward_reference(inp, vpost, grad_gv)
    }

    /// Whether the backend runs the SNNBlock's gated output `r·σ(g) + s` as one op
    /// ([`gated_out`]: the two methods below) instead of the sigmoid, product and sum autodiff
    /// derives (burn composes σ from five element-wise kernels and recomputes it backward).
    fn fuses_gated_out() -> bool {
        false
    }

    /// Its forward on `[rows, D]` tensors. Default: [`gated_out_forward_reference`].
    fn gated_out_forward(
        r: FloatTensor<Self>,
        g: FloatTensor<Self>,
        s: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gated_out_forward_reference::<Self>(r, g, s)
    }

    /// Its backward: `[∂r, ∂g, ∂s]`. A backend may write them in the type its GEMMs read
    /// ([`GemmOps::gemm_operand`]: the three are the gradients of GEMM outputs, rounded there
    /// anyway). Default: [`gated_out_backward_reference`] (f32).
    fn gated_out_backward(
        r: FloatTensor<Self>,
        g: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        gated_out_backward_reference::<Self>(r, g, dy)
    }
}

/// The selective scan with its modulation (SPEC §2.3, Eq. 5–7), differentiable in every input:
/// fused into the scan kernels where the backend has them ([`SnnOps::fuses_modulation`],
/// [`SnnOps::plif_selective_forward`]), else composed from tensor ops
/// ([`selective_modulation`]) and [`plif_elem`], whose gradients autodiff derives.
/// `i, r_beta, r_alpha, r_th`: `[TK, B, DN]`; the biases `[DN]`; `v0`: `[B, DN]`. Returns
/// `(V_post, last)`; `V_post` carries the gradient. With bf16 inputs
/// ([`GemmOps::storage_dtype`]) `V_post` comes in bf16 too, while `last`, the final membrane
/// state `[B, DN]` (detached), is always f32. An untracked pass
/// ([`SnnOps::plif_selective_untracked`]) writes no spikes: only the backward reads them.
#[allow(clippy::too_many_arguments)]
pub fn plif_selective<B: SnnOps>(
    i: Tensor<B, 3>,
    r_beta: Tensor<B, 3>,
    r_alpha: Tensor<B, 3>,
    r_th: Tensor<B, 3>,
    b_beta: Tensor<B, 1>,
    b_alpha: Tensor<B, 1>,
    b_th: Tensor<B, 1>,
    v_th_min: f64,
    v0: Tensor<B, 2>,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let device = i.device();
    let inp = SelectiveInputs {
        i: prim(i),
        r_beta: prim(r_beta),
        r_alpha: prim(r_alpha),
        r_th: prim(r_th),
        b_beta: prim(b_beta),
        b_alpha: prim(b_alpha),
        b_th: prim(b_th),
        v_th_min: v_th_min as f32,
        v0: prim(v0),
    };
    if !B::fuses_modulation() {
        let [beta, _, vth, u] = selective_modulation(&inp);
        let (_, vpost) = plif_elem(beta, u, vth, wrap(inp.v0));
        let last = last_frame(&vpost);
        return (vpost, last);
    }
    let (vpost, last) = if B::ad_enabled(&device) {
        let out = B::plif_selective_forward(inp);
        (out.vpost, out.last)
    } else {
        B::plif_selective_untracked(inp)
    };
    let vpost = wrap::<B, 3>(vpost);
    let last = match last {
        Some(last) => wrap::<B, 2>(last).detach(),
        None => last_frame(&vpost),
    };
    (vpost, last)
}

/// RMSNorm then the input PLIF over the K frames of each token (SPEC §2.3) as one
/// differentiable op: `x` `[T, B, D]` → `(output [T·K, B, D], final state [B, D])`, the state
/// detached. Through [`SnnOps::norm_plif_forward`] / [`SnnOps::norm_plif_backward`]; the model
/// calls it where [`SnnOps::fuses_norm_plif`].
pub fn norm_plif_train<B: SnnOps>(inp: NormPlifInputs<B>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (y, vpost) = B::norm_plif_forward(inp);
    (wrap(y), detached_last(vpost))
}

/// The last frame of `vpost` `[TK, B, C]`, detached: a fused op's final state.
fn detached_last<B: SnnOps>(vpost: FloatTensor<B>) -> Tensor<B, 2> {
    let vpost = wrap::<B, 3>(vpost);
    let [tk, b, c] = vpost.dims();
    vpost.narrow(0, tk - 1, 1).reshape([b, c]).detach()
}

/// PonderNet's halting and aggregation (SPEC §2.3) as one differentiable op: `frames`
/// `[T·K, B, D]` → aggregate `[T, B, D]` and E[K] `[T, B]`, through [`SnnOps::ponder_forward`]
/// and [`SnnOps::ponder_backward`]; the model calls it where [`SnnOps::fuses_ponder`].
pub fn ponder_agg_train<B: SnnOps>(inp: PonderInputs<B>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    // `[T, B, D + 1]`: the aggregate, then E[K].
    let packed = wrap::<B, 3>(B::ponder_forward(inp));
    let [t, b, d1] = packed.dims();
    let d = d1 - 1;
    let agg = packed.clone().slice([0..t, 0..b, 0..d]);
    let ek = packed.slice([0..t, 0..b, d..d + 1]).reshape([t, b]);
    (agg, ek)
}

/// The SNNFFN's gate and up neurons as one differentiable op (SPEC §2.3): input currents
/// `(1 − β)·i` from the merged projection `i_gu` `[TK, B, 2·D_ff]`, one merged row-parameter
/// scan, `(1 − β)·V_post` (or `V_post`) of each, and their product → `(g·v [TK, B, D_ff], final
/// state [B, 2·D_ff])`, the state detached. Through [`SnnOps::ffn_neurons_forward`] and
/// [`SnnOps::ffn_neurons_backward`]; the model calls it where [`SnnOps::fuses_ffn_neurons`].
pub fn ffn_neurons<B: SnnOps>(inp: FfnInputs<B>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (gv, vpost) = B::ffn_neurons_forward(inp);
    (wrap(gv), detached_last(vpost))
}

/// The SNNBlock's output `r·σ(g) + s` (`r` the out projection, `g` the gate logits, `s` the skip
/// path, each `[rows, D]`), differentiable in all three: one op where the backend fuses it
/// ([`SnnOps::fuses_gated_out`]), else composed from tensor ops.
pub fn gated_out<B: SnnOps>(r: Tensor<B, 2>, g: Tensor<B, 2>, s: Tensor<B, 2>) -> Tensor<B, 2> {
    let (r, g, s) = (prim(r), prim(g), prim(s));
    wrap(if B::fuses_gated_out() {
        B::gated_out_forward(r, g, s)
    } else {
        gated_out_forward_reference::<B>(r, g, s)
    })
}
