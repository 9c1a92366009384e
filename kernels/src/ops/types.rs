//! The inputs and outputs of the `SnnOps` methods: the scans' outputs and gradients, the fused
//! ops' input bundles and gradients, and [`StepGraph`], a backend's captured work.

use crate::tensor::prim;
use burn::tensor::{Tensor, backend::Backend, ops::FloatTensor};

/// Which PLIF scan: per-element parameters (β and V_th `[TK, B, dim]`, one per step: the
/// selective scan) or row parameters (β and V_th `[B, dim]`, held for all `TK` steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScanKind {
    Elem,
    Row,
}

/// Forward outputs of a PLIF scan, both `[TK, B, dim]`: spikes (0/1) and `V_post`, and the
/// final membrane state `[B, dim]` in f32 where the kernel writes it apart (its `V_post` may
/// be stored in bf16); `None`: it is `V_post`'s last step.
#[derive(Debug, Clone)]
pub struct PlifOutput<B: Backend> {
    pub spike: FloatTensor<B>,
    pub vpost: FloatTensor<B>,
    pub last: Option<FloatTensor<B>>,
}

/// Gradients of a PLIF scan with respect to `(beta, u, vth, v0)`, shaped like those inputs.
#[derive(Debug, Clone)]
pub struct PlifGrads<B: Backend> {
    pub beta: FloatTensor<B>,
    pub u: FloatTensor<B>,
    pub vth: FloatTensor<B>,
    pub v0: FloatTensor<B>,
}

/// Gradients of the selective scan with its modulation fused in ([`plif_selective`]), with
/// respect to `(i, r_beta, r_alpha, r_th, b_beta, b_alpha, b_th, v0)`, shaped like those inputs.
///
/// [`plif_selective`]: crate::plif_selective
#[derive(Debug, Clone)]
pub struct SelectiveGrads<B: Backend> {
    pub i: FloatTensor<B>,
    pub r_beta: FloatTensor<B>,
    pub r_alpha: FloatTensor<B>,
    pub r_th: FloatTensor<B>,
    pub b_beta: FloatTensor<B>,
    pub b_alpha: FloatTensor<B>,
    pub b_th: FloatTensor<B>,
    pub v0: FloatTensor<B>,
}

/// The inputs of the fused selective scan: the four projections `[TK, B, DN]`, the three
/// biases `[DN]`, `V_min` and the state `v0` `[B, DN]`.
#[derive(Debug, Clone)]
pub struct SelectiveInputs<B: Backend> {
    pub i: FloatTensor<B>,
    pub r_beta: FloatTensor<B>,
    pub r_alpha: FloatTensor<B>,
    pub r_th: FloatTensor<B>,
    pub b_beta: FloatTensor<B>,
    pub b_alpha: FloatTensor<B>,
    pub b_th: FloatTensor<B>,
    pub v_th_min: f32,
    pub v0: FloatTensor<B>,
}

/// The inputs of the SNNFFN's gate and up neurons after the merged projection: `i_gu`
/// `[TK, B, 2·D_ff]` (gate channels first), each neuron's β logits `w_*` and thresholds `th_*`
/// `[D_ff]`, the state `v0` `[B, 2·D_ff]`, and whether each neuron outputs `(1 − β)·V_post`
/// (`leak`) or `V_post`.
#[derive(Debug, Clone)]
pub struct FfnInputs<B: Backend> {
    pub i_gu: FloatTensor<B>,
    pub w_gate: FloatTensor<B>,
    pub w_up: FloatTensor<B>,
    pub th_gate: FloatTensor<B>,
    pub th_up: FloatTensor<B>,
    pub v0: FloatTensor<B>,
    pub leak: bool,
}

impl<B: Backend> FfnInputs<B> {
    /// From tensors: `i_gu` `[TK, B, 2·D_ff]` (or a 2-D `[TK·B, W]` whose first 2·D_ff columns
    /// are the currents, for [`crate::ffn_plif_fused_rows`]), `params` the gate and up neurons'
    /// β logits then their thresholds (`[D_ff]` each), `v0` `[B, 2·D_ff]`.
    pub fn new<const D: usize>(
        i_gu: Tensor<B, D>,
        params: [Tensor<B, 1>; 4],
        v0: Tensor<B, 2>,
        leak: bool,
    ) -> Self {
        let [w_gate, w_up, th_gate, th_up] = params.map(prim);
        FfnInputs {
            i_gu: prim(i_gu),
            w_gate,
            w_up,
            th_gate,
            th_up,
            v0: prim(v0),
            leak,
        }
    }
}

/// Gradients of the FFN neurons ([`ffn_neurons`]) with respect to [`FfnInputs`]' tensors.
///
/// [`ffn_neurons`]: crate::ffn_neurons
#[derive(Debug, Clone)]
pub struct FfnGrads<B: Backend> {
    pub i_gu: FloatTensor<B>,
    pub w_gate: FloatTensor<B>,
    pub w_up: FloatTensor<B>,
    pub th_gate: FloatTensor<B>,
    pub th_up: FloatTensor<B>,
    pub v0: FloatTensor<B>,
}

/// The inputs of PonderNet's halting and aggregation: the frames `[T·K, B, D]`, the halt
/// projection's weight `[1, D]` and bias `[1]`, K, the clamp `c` of `p` to `[c, 1 − c]` and the
/// normalisation's `eps` (SPEC §2.3).
#[derive(Debug, Clone)]
pub struct PonderInputs<B: Backend> {
    pub frames: FloatTensor<B>,
    pub halt_w: FloatTensor<B>,
    pub halt_b: FloatTensor<B>,
    pub k: usize,
    pub clamp: f64,
    pub eps: f64,
}

impl<B: Backend> PonderInputs<B> {
    /// From tensors: `frames` `[T·K, B, D]`, `halt_w` `[1, D]`, `halt_b` `[1]`.
    pub fn new(
        frames: Tensor<B, 3>,
        halt_w: Tensor<B, 2>,
        halt_b: Tensor<B, 1>,
        k: usize,
        clamp: f64,
        eps: f64,
    ) -> Self {
        PonderInputs {
            frames: prim(frames),
            halt_w: prim(halt_w),
            halt_b: prim(halt_b),
            k,
            clamp,
            eps,
        }
    }
}

/// The inputs of a sublayer's start: RMSNorm of `x` `[T, B, D]` (weight `norm_w` `[D]`, `eps`),
/// then the input PLIF (β logits `w`, thresholds `v_th` `[D]`, state `v0` `[B, D]`) over the K
/// frames of each token with input current `(1 − β)·x̂`, output `(1 − β)·V_post` if `leak`.
#[derive(Debug, Clone)]
pub struct NormPlifInputs<B: Backend> {
    pub x: FloatTensor<B>,
    pub norm_w: FloatTensor<B>,
    pub eps: f64,
    pub w: FloatTensor<B>,
    pub v_th: FloatTensor<B>,
    pub v0: FloatTensor<B>,
    pub k: usize,
    pub leak: bool,
}

impl<B: Backend> NormPlifInputs<B> {
    /// From tensors: `x` `[T, B, D]`, the norm's weight `[D]` and `eps`, the neuron's β logits
    /// `w` and thresholds `v_th` `[D]`, the state `v0` `[B, D]`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        x: Tensor<B, 3>,
        norm_w: Tensor<B, 1>,
        eps: f64,
        w: Tensor<B, 1>,
        v_th: Tensor<B, 1>,
        v0: Tensor<B, 2>,
        k: usize,
        leak: bool,
    ) -> Self {
        NormPlifInputs {
            x: prim(x),
            norm_w: prim(norm_w),
            eps,
            w: prim(w),
            v_th: prim(v_th),
            v0: prim(v0),
            k,
            leak,
        }
    }
}

/// Work recorded once and replayed with one launch ([`GraphOps::capture`]; CUDA graphs on the CUDA
/// backend). Dropping it releases what it holds.
///
/// [`GraphOps::capture`]: crate::GraphOps::capture
pub struct StepGraph(Box<dyn std::any::Any + Send>);

impl StepGraph {
    /// Wraps a backend's captured work.
    pub fn new<G: std::any::Any + Send>(graph: G) -> Self {
        StepGraph(Box::new(graph))
    }

    /// The backend's captured work, if it is a `G`.
    pub fn get<G: std::any::Any>(&self) -> Option<&G> {
        self.0.downcast_ref()
    }
}

/// One Adam update's hyperparameters (PyTorch's `torch.optim.Adam`/`AdamW` single-tensor
/// semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub lr: f64,
    /// Weight decay; `decoupled` (AdamW) shrinks the parameter, otherwise it is added to the
    /// gradient as `wd·p` (Adam's L2).
    pub wd: f64,
    pub decoupled: bool,
    /// The update's number, from 1 (bias corrections `1 − βᵗ`).
    pub step: i32,
    /// The gradient is multiplied by it first: the global-norm clip's factor (1: none).
    pub grad_scale: f64,
}
