//! The `SnnOps` backend extension trait and the tensor-level scan API.

use crate::reference::{self, ScanGrads, ScanOut};
use burn::tensor::{
    DType, Shape, Tensor, TensorData, TensorPrimitive, activation::sigmoid, backend::Backend,
    ops::FloatTensor,
};

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

/// Gradients of the FFN neurons ([`ffn_neurons`]) with respect to [`FfnInputs`]' tensors.
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

/// Work recorded once and replayed with one launch ([`SnnOps::capture`]; CUDA graphs on the CUDA
/// backend). Dropping it releases what it holds.
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

/// Backend extension with the PLIF scans (DESIGN "The seams", point 1).
///
/// ## Design
///
/// Every method has a default: the exact sequential scan of [`crate::reference`], run on the host
/// after reading the inputs back. That makes any burn backend correct with no extra code, and it
/// is the reference every fused kernel is tested against. A backend overrides a method only with
/// a kernel that computes the same recurrence (same `≥` test, same fused multiply-add, `f32`
/// state). The backward methods receive the saved forward outputs, never `u` or `V_pre`, which
/// lets a kernel skip storing them (SPEC §6.1).
///
/// Shapes: `u` is `[TK, B, dim]`; `v0` is `[B, dim]`; per-element `beta, vth` are `[TK, B, dim]`,
/// row-parameter `beta, vth` are `[B, dim]` (held for all `TK` steps).
pub trait SnnOps: Backend {
    /// `lhs [M, K] · rhs [K, N]`: the GEMM of every projection. Default: the backend's own
    /// matmul, exact fp32 on the CPU. The CUDA backend runs cuBLASLt in the process's GEMM
    /// precision: exact fp32 (no TF32, so parity with the reference holds) or bf16 inputs with
    /// fp32 accumulation (`crate::cuda_gemm`).
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `lhs · rhs + c` (`c` `[M, N]`, possibly a column slice of a wider tensor), for untracked
    /// passes. Default: [`gemm`](Self::gemm) then an add. CUDA adds `c` in cuBLASLt's
    /// epilogue (one call instead of two).
    fn gemm_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(Self::gemm(lhs, rhs), c)
    }

    /// `lhs · rhs` written in `out` where the backend stores that type: a product read only by
    /// a kernel that takes [`storage_dtype`](Self::storage_dtype) inputs (the selective scan's
    /// four projections) is asked for in it, and a gradient in its tensor's type. Default:
    /// [`gemm`](Self::gemm), f32 whatever is asked (the backend stores f32 only).
    fn gemm_out(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: DType) -> FloatTensor<Self> {
        let _ = out;
        Self::gemm(lhs, rhs)
    }

    /// The type the scans' large activations are stored in: the selective scan's four input
    /// projections, its `V_post` and spikes, and the gradients of those projections. The
    /// arithmetic and the membrane state stay f32 whatever it is. Default f32; CUDA in bf16
    /// precision: bf16 (`$NSACTOR_BF16_STORAGE=off` keeps f32 for comparison).
    fn storage_dtype() -> DType {
        DType::F32
    }

    /// Rounds a GEMM operand to the type [`gemm`](Self::gemm) reads, so that an operand used by
    /// several products is rounded once: the autodiff node keeps its operands rounded for the
    /// backward products and rounds the incoming gradient once for both. Default: unchanged
    /// (the GEMM reads f32). CUDA in bf16 precision: the bf16 copy.
    fn gemm_operand(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
    }

    /// Moves a tensor to another device (pipeline stages hand activations and gradients over
    /// with it). Default: the backend's own `to_device`. CUDA overrides it with a peer copy
    /// ordered on both devices' streams (`crate::cuda_device::to_device`).
    fn move_to_device(t: FloatTensor<Self>, device: &Self::Device) -> FloatTensor<Self> {
        Self::float_to_device(t, device)
    }

    /// Counters of the backend's submission thread, for profiles: `[kernel launches, their
    /// nanoseconds, GEMM tasks, their nanoseconds, of it in the GEMM library]` since the
    /// process started. `None` (the default): the backend keeps none.
    fn submission_stats() -> Option<[u64; 5]> {
        None
    }

    /// Hands the calling thread's queued work on `device` to the device now. A backend that
    /// batches submissions (CubeCL's server thread takes tasks 32 at a time, or at a flush)
    /// would otherwise hold a short burst of work — a decoding step's embedding, a layer's
    /// replay — until more work or a read arrives, with the device idle meanwhile. Default:
    /// nothing to do.
    fn flush(device: &Self::Device) {
        let _ = device;
    }

    /// Runs `f` — one stage call's work on `device` — with its device time measured as a call
    /// span when the backend's timing is on (`bench("timing")`, `nsactor bench train`'s
    /// breakdown). Default: just runs it.
    fn timed_call<R>(device: &Self::Device, f: impl FnOnce() -> R) -> R {
        let _ = device;
        f()
    }

    /// Whether [`capture`](Self::capture) records work on this backend. Default `false`.
    fn captures_steps() -> bool {
        false
    }

    /// Runs `f` with the calling thread's work on `device` recorded instead of run, for
    /// [`replay`](Self::replay); `f`'s result is computed by the first replay. `inputs` are the
    /// tensors made outside `f` that it reads. `Err` (the default: nothing is recorded) says
    /// why the work cannot be replayed; nothing of it ran.
    fn capture<R>(
        device: &Self::Device,
        inputs: &[FloatTensor<Self>],
        f: impl FnOnce() -> R,
    ) -> Result<(R, StepGraph), String> {
        let _ = (device, inputs, f);
        Err("this backend does not capture work".into())
    }

    /// `t` laid out contiguously (itself where it is): captured work's input buffers are
    /// copied into whole. Default: `t`.
    fn contiguous(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
    }

    /// Copies `src` into `dst` in place (same shape and type), in order with the calling
    /// thread's work: the one way captured work writes back into its input buffers.
    fn capture_copy(src: FloatTensor<Self>, dst: &FloatTensor<Self>) -> Result<(), String> {
        let _ = (src, dst);
        Err("this backend does not capture work".into())
    }

    /// Copies each `(src, dst)` whose buffers differ (`dst` a buffer `graph` was captured
    /// with), then reruns `graph`; `written` are its buffers the rerun rewrites that other
    /// work may read next.
    fn replay(
        graph: &StepGraph,
        inputs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        written: &[FloatTensor<Self>],
    ) -> Result<(), String> {
        let _ = (graph, inputs, written);
        Err("this backend does not capture work".into())
    }

    /// Whether the backend fuses the selective modulation into its scan kernels: then
    /// [`plif_selective`] calls the two methods below; otherwise it composes the modulation
    /// from tensor ops (as their defaults do) and leaves the gradients to autodiff.
    fn fuses_modulation() -> bool {
        false
    }

    /// Whether the model should compute projections that share an input as one GEMM on
    /// concatenated weights when the call is small and not differentiated (decoding): the
    /// CUDA backend pays ≈ 100 µs of host time per GEMM call, far more than the GPU time of a
    /// decoding step's projections. Default `false` (autodiff backends and the CPU).
    fn merges_small_gemms() -> bool {
        false
    }

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
    /// output may come in the element type the backend's [`gemm`](Self::gemm) reads (bf16 on
    /// CUDA in bf16 precision, rounded as the GEMM would round it): its consumers are
    /// projections. `None` (the default, and on autodiff backends): the model composes it.
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
    /// [`plif_selective_forward`](Self::plif_selective_forward)), read in place: `(V_post
    /// [TK·B, DN], final state [B, DN])`, no spikes, `V_post` possibly in the GEMM's input type
    /// (the out-projection reads it). Biases `[DN]`, `v0` `[B, DN]`. `None` (the default, and
    /// on autodiff backends): the model slices `y` and calls the scan.
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

    /// The selective scan with the SNNBlock modulation fused in (SPEC §2.3, Eq. 5–7):
    /// `β = σ(r_β + b_β)`, `α = softplus(r_α + b_α)`, `V_th = V_min + |r_th + b_th|`,
    /// `u = α·i`, then the per-element scan. Default: [`selective_forward_reference`].
    fn plif_selective_forward(inp: SelectiveInputs<Self>) -> PlifOutput<Self> {
        selective_forward_reference(inp)
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

    /// Their forward: `(output [T·K, B, D], V_post [T·K, B, D])`. Default:
    /// [`norm_plif_forward_reference`].
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

    /// Per-element (selective) scan forward.
    fn plif_elem_forward(
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        let (shape, cols) = scan_shape::<Self>(&u, &v0);
        let out = reference::elem_forward(
            &host::<Self>(beta),
            &host::<Self>(u.clone()),
            &host::<Self>(vth),
            &host::<Self>(v0),
            cols,
        );
        scan_out::<Self>(out, shape, &u)
    }

    /// Per-element scan backward: gradients of `Σ V_post·grad_vpost`.
    fn plif_elem_backward(
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        let (shape, cols) = scan_shape::<Self>(&grad_vpost, &v0);
        let g = reference::elem_backward(
            &host::<Self>(beta),
            &host::<Self>(v0),
            &host::<Self>(vpost),
            &host::<Self>(spike),
            &host::<Self>(grad_vpost.clone()),
            cols,
        );
        scan_grads::<Self>(g, shape.clone(), shape, &grad_vpost)
    }

    /// Row-parameter scan forward.
    fn plif_row_forward(
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        let (shape, cols) = scan_shape::<Self>(&u, &v0);
        let out = reference::row_forward(
            &host::<Self>(beta),
            &host::<Self>(u.clone()),
            &host::<Self>(vth),
            &host::<Self>(v0),
            cols,
        );
        scan_out::<Self>(out, shape, &u)
    }

    /// Row-parameter scan backward; `beta`/`vth` gradients are `[B, dim]` sums over time.
    fn plif_row_backward(
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        let (shape, cols) = scan_shape::<Self>(&grad_vpost, &v0);
        let row_shape = Shape::new([shape[1], shape[2]]);
        let g = reference::row_backward(
            &host::<Self>(beta),
            &host::<Self>(v0),
            &host::<Self>(vpost),
            &host::<Self>(spike),
            &host::<Self>(grad_vpost.clone()),
            cols,
        );
        scan_grads::<Self>(g, row_shape, shape, &grad_vpost)
    }
}

/// Per-element PLIF scan. `beta, u, vth`: `[TK, B, dim]`; `v0`: `[B, dim]`.
/// Returns `(spike, V_post)`, both `[TK, B, dim]`; only `V_post` carries gradient.
pub fn plif_elem<B: SnnOps>(
    beta: Tensor<B, 3>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 3>,
    v0: Tensor<B, 2>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let out = B::plif_elem_forward(prim(beta), prim(u), prim(vth), prim(v0));
    (wrap(out.spike), wrap(out.vpost))
}

/// Row-parameter PLIF scan. `beta, vth`: `[B, dim]`; `u`: `[TK, B, dim]`; `v0`: `[B, dim]`.
/// Returns `(spike, V_post)`, both `[TK, B, dim]`; only `V_post` carries gradient.
pub fn plif_row<B: SnnOps>(
    beta: Tensor<B, 2>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 2>,
    v0: Tensor<B, 2>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let out = B::plif_row_forward(prim(beta), prim(u), prim(vth), prim(v0));
    (wrap(out.spike), wrap(out.vpost))
}

/// PyTorch's softplus (β = 1) in the overflow-free form `max(x, 0) + log1p(e^{−|x|})`; its
/// gradient is `σ(x)` like the reference's.
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone().clamp_min(0.0) + x.abs().neg().exp().log1p()
}

/// The three pre-activations `r_β + b_β`, `r_α + b_α`, `r_th + b_th`.
fn preactivations<B: Backend>(inp: &SelectiveInputs<B>) -> [Tensor<B, 3>; 3] {
    let add = |r: &FloatTensor<B>, b: &FloatTensor<B>| {
        wrap::<B, 3>(r.clone()) + wrap::<B, 1>(b.clone()).unsqueeze::<3>()
    };
    [
        add(&inp.r_beta, &inp.b_beta),
        add(&inp.r_alpha, &inp.b_alpha),
        add(&inp.r_th, &inp.b_th),
    ]
}

/// `β, α, V_th, u` of the fused selective scan from its inputs, with the tensor ops the model
/// composes them from (burn's `sigmoid`, [`softplus`], `abs`): the reference the fused kernels
/// repeat op for op.
pub fn selective_modulation<B: Backend>(inp: &SelectiveInputs<B>) -> [Tensor<B, 3>; 4] {
    let [x_beta, x_alpha, x_th] = preactivations(inp);
    let alpha = softplus(x_alpha);
    let u = alpha.clone() * wrap::<B, 3>(inp.i.clone());
    [sigmoid(x_beta), alpha, x_th.abs() + inp.v_th_min as f64, u]
}

/// A gradient with respect to `β = σ(x)` taken back to `x`: `∂x = ∂β·β(1 − β)`.
fn through_sigmoid<B: Backend, const D: usize>(
    d_beta: Tensor<B, D>,
    beta: Tensor<B, D>,
) -> Tensor<B, D> {
    d_beta * (beta.clone() * (beta.neg() + 1.0))
}

/// The fused selective scan composed from tensor ops and [`SnnOps::plif_elem_forward`].
pub fn selective_forward_reference<B: SnnOps>(inp: SelectiveInputs<B>) -> PlifOutput<B> {
    let [beta, _, vth, u] = selective_modulation(&inp);
    B::plif_elem_forward(prim(beta), prim(u), prim(vth), inp.v0)
}

/// Its backward composed from tensor ops and [`SnnOps::plif_elem_backward`]: `∂r_β = ∂β·β(1−β)`,
/// `∂r_α = ∂u·i·σ(r_α + b_α)` (softplus′ = σ), `∂i = ∂u·α`, `∂r_th = ∂V_th·sign(r_th + b_th)`;
/// each bias gradient sums its projection's over `TK` and `B`.
pub fn selective_backward_reference<B: SnnOps>(
    inp: SelectiveInputs<B>,
    vpost: FloatTensor<B>,
    spike: FloatTensor<B>,
    grad_vpost: FloatTensor<B>,
) -> SelectiveGrads<B> {
    let [x_beta, x_alpha, x_th] = preactivations(&inp);
    let beta = sigmoid(x_beta);
    let alpha = softplus(x_alpha.clone());
    let g = B::plif_elem_backward(prim(beta.clone()), inp.v0, vpost, spike, grad_vpost);
    let dn = beta.dims()[2];
    let g_u = wrap::<B, 3>(g.u);
    let r_beta = through_sigmoid(wrap::<B, 3>(g.beta), beta);
    let r_alpha = g_u.clone() * wrap::<B, 3>(inp.i) * sigmoid(x_alpha);
    let i = g_u * alpha;
    let r_th = wrap::<B, 3>(g.vth) * x_th.sign();
    let sum = |t: &Tensor<B, 3>| prim(t.clone().sum_dim(0).sum_dim(1).reshape([dn]));
    SelectiveGrads {
        b_beta: sum(&r_beta),
        b_alpha: sum(&r_alpha),
        b_th: sum(&r_th),
        i: prim(i),
        r_beta: prim(r_beta),
        r_alpha: prim(r_alpha),
        r_th: prim(r_th),
        v0: g.v0,
    }
}

/// The selective scan with its modulation (SPEC §2.3, Eq. 5–7), differentiable in every input:
/// fused into the scan kernels where the backend has them ([`SnnOps::fuses_modulation`],
/// [`SnnOps::plif_selective_forward`]), else composed from tensor ops
/// ([`selective_modulation`]) and [`plif_elem`], whose gradients autodiff derives.
/// `i, r_beta, r_alpha, r_th`: `[TK, B, DN]`; the biases `[DN]`; `v0`: `[B, DN]`. Returns
/// `(spike, V_post, last)`; only `V_post` carries gradient. With bf16 inputs
/// ([`SnnOps::storage_dtype`]) spikes and `V_post` come in bf16 too, while `last`, the final
/// membrane state `[B, DN]` (detached), is always f32.
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
) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 2>) {
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
        let (spike, vpost) = plif_elem(beta, u, vth, wrap(inp.v0));
        let last = last_frame(&vpost);
        return (spike, vpost, last);
    }
    let out = B::plif_selective_forward(inp);
    let vpost = wrap::<B, 3>(out.vpost);
    let last = match out.last {
        Some(last) => wrap::<B, 2>(last).detach(),
        None => last_frame(&vpost),
    };
    (wrap(out.spike), vpost, last)
}

/// The last frame `[B, C]` of a `[TK, B, C]` sequence, detached (the state a scan carries on).
pub fn last_frame<B: Backend>(x: &Tensor<B, 3>) -> Tensor<B, 2> {
    let [tk, b, c] = x.dims();
    x.clone().narrow(0, tk - 1, 1).reshape([b, c]).detach()
}

/// What the input neuron's reference computes from its inputs: `r = 1/√(mean_D(x²) + eps)`
/// `[T, B, 1]` and `x̂ = x·r·w_norm`; `β = σ(w)` and `1 − β` `[D]`; the scan's inputs `β`,
/// `u = (1 − β)·x̂` repeated over the K frames, and `V_th`, as the model composes them.
struct NormPlifParts<B: Backend> {
    r: Tensor<B, 3>,
    xh: Tensor<B, 3>,
    beta: Tensor<B, 1>,
    one_minus: Tensor<B, 1>,
    scan: [FloatTensor<B>; 3],
}

fn norm_plif_parts<B: SnnOps>(inp: &NormPlifInputs<B>) -> NormPlifParts<B> {
    let x = wrap::<B, 3>(inp.x.clone());
    let [t, b, d] = x.dims();
    let r = (x.clone().square().mean_dim(2) + inp.eps).sqrt().recip();
    let xh = x * r.clone() * wrap::<B, 1>(inp.norm_w.clone()).unsqueeze::<3>();
    let beta = sigmoid(wrap::<B, 1>(inp.w.clone()));
    let one_minus = beta.clone().neg() + 1.0;
    let u = (xh.clone() * one_minus.clone().unsqueeze::<3>())
        .unsqueeze_dim::<4>(1)
        .expand([t, inp.k, b, d])
        .reshape([t * inp.k, b, d]);
    let scan = [
        prim(beta.clone().unsqueeze::<2>().expand([b, d])),
        prim(u),
        prim(
            wrap::<B, 1>(inp.v_th.clone())
                .unsqueeze::<2>()
                .expand([b, d]),
        ),
    ];
    NormPlifParts {
        r,
        xh,
        beta,
        one_minus,
        scan,
    }
}

/// RMSNorm and the input PLIF composed from tensor ops and [`SnnOps::plif_row_forward`]:
/// `(output, V_post)`.
pub fn norm_plif_forward_reference<B: SnnOps>(
    inp: &NormPlifInputs<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let NormPlifParts {
        one_minus,
        scan: [beta, u, vth],
        ..
    } = norm_plif_parts(inp);
    let vpost = wrap::<B, 3>(B::plif_row_forward(beta, u, vth, inp.v0.clone()).vpost);
    let y = if inp.leak {
        vpost.clone() * one_minus.unsqueeze::<3>()
    } else {
        vpost.clone()
    };
    (prim(y), prim(vpost))
}

/// Their backward composed from tensor ops and [`SnnOps::plif_row_backward`] (spikes
/// recomputed): `∂V_post = ∂y·(1 − β)` with leak; the scan's backward; `∂x̂ = (1 − β)·Σ_k ∂u`;
/// `∂β` = the scan's term less `Σ ∂y·V_post` (leak) and `Σ ∂u·x̂`, `∂w = ∂β·β(1 − β)`; the
/// norm's backward `∂x = r·g − x·r³·mean_D(g·x)` with `g = ∂x̂·w_norm`, `∂w_norm = Σ ∂x̂·x·r`.
pub fn norm_plif_backward_reference<B: SnnOps>(
    inp: NormPlifInputs<B>,
    vpost: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 5] {
    let NormPlifParts {
        r,
        xh,
        beta,
        one_minus,
        scan: [beta_e, u, vth_e],
    } = norm_plif_parts(&inp);
    let x = wrap::<B, 3>(inp.x.clone());
    let [t, b, d] = x.dims();
    let k = inp.k;
    let spike = B::plif_row_forward(beta_e.clone(), u, vth_e, inp.v0.clone()).spike;
    let vpost = wrap::<B, 3>(vpost);
    let g = wrap::<B, 3>(grad);
    let om3 = one_minus.clone().unsqueeze::<3>();
    let cols = |t: Tensor<B, 3>| t.sum_dim(0).reshape([b, d]);
    let (g_v, om_leak) = if inp.leak {
        (g.clone() * om3.clone(), cols(g * vpost.clone()))
    } else {
        (g, Tensor::zeros([b, d], &x.device()))
    };
    let sg = B::plif_row_backward(beta_e, inp.v0.clone(), prim(vpost), spike, prim(g_v));
    let du = wrap::<B, 3>(sg.u)
        .reshape([t, k, b, d])
        .sum_dim(1)
        .reshape([t, b, d]);
    let dxh = du.clone() * om3;
    let om_in = cols(du * xh);
    let d_beta = (wrap::<B, 2>(sg.beta) - om_leak - om_in)
        .sum_dim(0)
        .reshape([d]);
    let d_w = through_sigmoid(d_beta, beta);
    let d_th = wrap::<B, 2>(sg.vth).sum_dim(0).reshape([d]);
    let nw = wrap::<B, 1>(inp.norm_w.clone()).unsqueeze::<3>();
    let gx = dxh.clone() * nw;
    let m = (gx.clone() * x.clone()).mean_dim(2);
    let r3 = r.clone() * r.clone() * r.clone();
    let dx = gx * r.clone() - x.clone() * r3 * m;
    let d_nw = (dxh * x * r).sum_dim(0).sum_dim(1).reshape([d]);
    [prim(dx), prim(d_nw), prim(d_w), prim(d_th), sg.v0]
}

/// RMSNorm then the input PLIF over the K frames of each token (SPEC §2.3) as one
/// differentiable op: `x` `[T, B, D]` → `(output [T·K, B, D], final state [B, D])`, the state
/// detached. Through [`SnnOps::norm_plif_forward`] / [`SnnOps::norm_plif_backward`]; the model
/// calls it where [`SnnOps::fuses_norm_plif`].
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_train<B: SnnOps>(
    x: Tensor<B, 3>,
    norm_w: Tensor<B, 1>,
    eps: f64,
    w: Tensor<B, 1>,
    v_th: Tensor<B, 1>,
    v0: Tensor<B, 2>,
    k: usize,
    leak: bool,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (y, vpost) = B::norm_plif_forward(NormPlifInputs {
        x: prim(x),
        norm_w: prim(norm_w),
        eps,
        w: prim(w),
        v_th: prim(v_th),
        v0: prim(v0),
        k,
        leak,
    });
    let vpost = wrap::<B, 3>(vpost);
    let [tk, b, d] = vpost.dims();
    let last = vpost.narrow(0, tk - 1, 1).reshape([b, d]).detach();
    (wrap(y), last)
}

/// The halting distribution of [`PonderInputs`] from tensor ops: `σ(logit)`, `p`, the survival
/// `S_k = Π_{j<k}(1 − p_j)`, `λ = p·S` and `Σλ + eps`, all `[T, K, B]` (the last `[T, 1, B]`).
/// The logits are exact f32 dot products (`Σ_D x·w`), as the fused kernels compute them.
fn ponder_halting<B: Backend>(inp: &PonderInputs<B>) -> [Tensor<B, 3>; 5] {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let w = wrap::<B, 2>(inp.halt_w.clone()).reshape([1, 1, d]);
    let bias = wrap::<B, 1>(inp.halt_b.clone()).reshape([1, 1, 1]);
    let logit = ((frames * w).sum_dim(2) + bias).reshape([t, k, b]);
    let sig = sigmoid(logit);
    let p = sig.clone().clamp(inp.clamp, 1.0 - inp.clamp);
    let log_stay = p.clone().neg().log1p();
    let survive = Tensor::cat(
        vec![
            Tensor::zeros([t, 1, b], &log_stay.device()),
            log_stay.slice([0..t, 0..k - 1]).cumsum(1),
        ],
        1,
    )
    .exp();
    let lambda = p.clone() * survive.clone();
    let norm = lambda.clone().sum_dim(1) + inp.eps;
    [sig, p, survive, lambda, norm]
}

/// `1, 2, …, K` shaped `[1, K, 1]`.
fn ponder_steps<B: Backend>(k: usize, device: &B::Device) -> Tensor<B, 3> {
    let steps: Vec<f32> = (1..=k).map(|i| i as f32).collect();
    Tensor::<B, 1>::from_data(TensorData::new(steps, [k]), device).reshape([1, k, 1])
}

/// PonderAgg composed from tensor ops: `Σ_k λ̂_k·x_k` and `E[K] = Σ_k k·λ̂_k`, packed `[T, B, D + 1]`.
pub fn ponder_forward_reference<B: Backend>(inp: &PonderInputs<B>) -> FloatTensor<B> {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let [_, _, _, lambda, norm] = ponder_halting(inp);
    let lh = lambda / norm;
    let agg = (frames.reshape([t, k, b, d]) * lh.clone().unsqueeze_dim::<4>(3))
        .sum_dim(1)
        .reshape([t, b, d]);
    let ek = (lh * ponder_steps::<B>(k, &agg.device()))
        .sum_dim(1)
        .reshape([t, b, 1]);
    prim(Tensor::cat(vec![agg, ek], 2))
}

/// Its backward composed from tensor ops: `∂λ̂_k = ∂agg·x_k + k·∂E[K]`; `∂λ_k = (∂λ̂_k −
/// Σ_j ∂λ̂_j·λ̂_j)/(Σλ + eps)`; `∂p_k = ∂λ_k·S_k − (Σ_{m>k} ∂λ_m·λ_m)/(1 − p_k)`; the clamp
/// passes it where `c ≤ σ ≤ 1 − c`; `∂logit = ∂σ·σ(1 − σ)`; `∂x_k = λ̂_k·∂agg + ∂logit_k·w`,
/// `∂w = Σ ∂logit·x`, `∂b = Σ ∂logit`.
pub fn ponder_backward_reference<B: Backend>(
    inp: PonderInputs<B>,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 3] {
    let frames = wrap::<B, 3>(inp.frames.clone());
    let [tk, b, d] = frames.dims();
    let (k, t) = (inp.k, tk / inp.k);
    let [sig, p, survive, lambda, norm] = ponder_halting(&inp);
    let lh = lambda.clone() / norm.clone();
    let grad = wrap::<B, 3>(grad);
    let g_agg = grad.clone().slice([0..t, 0..b, 0..d]).unsqueeze_dim::<4>(1); // [T, 1, B, D]
    let g_ek = grad.slice([0..t, 0..b, d..d + 1]).reshape([t, 1, b]);
    let x4 = frames.reshape([t, k, b, d]);
    let dlh = (x4.clone() * g_agg.clone()).sum_dim(3).reshape([t, k, b])
        + ponder_steps::<B>(k, &g_ek.device()) * g_ek;
    let dot = (dlh.clone() * lh.clone()).sum_dim(1);
    let dlam = (dlh - dot) / norm;
    let dlog_s = dlam.clone() * lambda;
    // Σ_{m>k} ∂log S_m: the total less the inclusive running sum.
    let suffix = dlog_s.clone().sum_dim(1) - dlog_s.cumsum(1);
    let dp = dlam * survive + suffix * (p - 1.0).recip();
    let inside = sig
        .clone()
        .greater_equal_elem(inp.clamp)
        .bool_and(sig.clone().lower_equal_elem(1.0 - inp.clamp));
    let dsig = dp.mask_fill(inside.bool_not(), 0.0);
    let dlogit = dsig * sig.clone() * (sig.neg() + 1.0); // [T, K, B]
    let w = wrap::<B, 2>(inp.halt_w.clone()).reshape([1, 1, 1, d]);
    let dl4 = dlogit.clone().unsqueeze_dim::<4>(3);
    let dx = lh.unsqueeze_dim::<4>(3) * g_agg + dl4.clone() * w;
    let dw = (x4 * dl4).sum_dim(0).sum_dim(1).sum_dim(2).reshape([1, d]);
    let db = dlogit.sum().reshape([1]);
    [prim(dx.reshape([tk, b, d])), prim(dw), prim(db)]
}

/// PonderNet's halting and aggregation (SPEC §2.3) as one differentiable op: `frames`
/// `[T·K, B, D]` → aggregate `[T, B, D]` and E[K] `[T, B]`, through [`SnnOps::ponder_forward`]
/// and [`SnnOps::ponder_backward`]; the model calls it where [`SnnOps::fuses_ponder`].
pub fn ponder_agg_train<B: SnnOps>(
    frames: Tensor<B, 3>,
    halt_w: Tensor<B, 2>,
    halt_b: Tensor<B, 1>,
    k: usize,
    clamp: f64,
    eps: f64,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [tk, b, d] = frames.dims();
    let t = tk / k;
    let packed = wrap::<B, 3>(B::ponder_forward(PonderInputs {
        frames: prim(frames),
        halt_w: prim(halt_w),
        halt_b: prim(halt_b),
        k,
        clamp,
        eps,
    }));
    let agg = packed.clone().slice([0..t, 0..b, 0..d]);
    let ek = packed.slice([0..t, 0..b, d..d + 1]).reshape([t, b]);
    (agg, ek)
}

/// `β = σ(w)` of both neurons `[2·D_ff]`, `1 − β`, and the thresholds `[2·D_ff]` (gate first),
/// with the tensor ops the model composes them from.
fn ffn_params<B: Backend>(inp: &FfnInputs<B>) -> [Tensor<B, 1>; 3] {
    let beta = Tensor::cat(
        vec![
            sigmoid(wrap::<B, 1>(inp.w_gate.clone())),
            sigmoid(wrap::<B, 1>(inp.w_up.clone())),
        ],
        0,
    );
    let one_minus = beta.clone().neg() + 1.0;
    let vth = Tensor::cat(
        vec![
            wrap::<B, 1>(inp.th_gate.clone()),
            wrap::<B, 1>(inp.th_up.clone()),
        ],
        0,
    );
    [beta, one_minus, vth]
}

/// The input current `u = (1 − β)·i` on the flattened rows, and the scan's row parameters
/// expanded to `[B, 2·D_ff]`, as the model composes them.
fn ffn_scan_inputs<B: SnnOps>(
    inp: &FfnInputs<B>,
    beta: &Tensor<B, 1>,
    one_minus: &Tensor<B, 1>,
    vth: &Tensor<B, 1>,
) -> [FloatTensor<B>; 3] {
    let i_gu = wrap::<B, 3>(inp.i_gu.clone());
    let [tk, b, two_f] = i_gu.dims();
    let u = (i_gu.reshape([tk * b, two_f]) * one_minus.clone().unsqueeze::<2>())
        .reshape([tk, b, two_f]);
    [
        prim(beta.clone().unsqueeze::<2>().expand([b, two_f])),
        prim(u),
        prim(vth.clone().unsqueeze::<2>().expand([b, two_f])),
    ]
}

/// The FFN neurons composed from tensor ops and [`SnnOps::plif_row_forward`], op for op as the
/// model's composition: `(g·v, V_post)`.
pub fn ffn_forward_reference<B: SnnOps>(inp: &FfnInputs<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let [beta, one_minus, vth] = ffn_params(inp);
    let [beta_e, u, vth_e] = ffn_scan_inputs(inp, &beta, &one_minus, &vth);
    let vpost = wrap::<B, 3>(B::plif_row_forward(beta_e, u, vth_e, inp.v0.clone()).vpost);
    let [tk, b, two_f] = vpost.dims();
    let f = two_f / 2;
    let act = if inp.leak {
        vpost.clone() * one_minus.unsqueeze::<3>()
    } else {
        vpost.clone()
    };
    let gv = act.clone().slice([0..tk, 0..b, 0..f]) * act.slice([0..tk, 0..b, f..two_f]);
    (prim(gv), prim(vpost))
}

/// The parameter gradients of the FFN neurons from per-batch-row sums `[B, 2·D_ff]`: `∂β` (the
/// scan's `Σ gv·V_{k−1}` minus the `(1 − β)` terms' `Σ ∂(1−β)`) and `∂V_th`; `∂w = ∂β·β(1 − β)`.
/// Returns `(∂w_gate, ∂w_up, ∂th_gate, ∂th_up)`.
pub fn ffn_param_grads<B: Backend>(
    inp: &FfnInputs<B>,
    d_beta_rows: FloatTensor<B>,
    d_th_rows: FloatTensor<B>,
) -> [FloatTensor<B>; 4] {
    let [beta, _, _] = ffn_params(inp);
    let two_f = beta.dims()[0];
    let f = two_f / 2;
    let d_beta = wrap::<B, 2>(d_beta_rows).sum_dim(0).reshape([two_f]);
    let d_w = through_sigmoid(d_beta, beta);
    let d_th = wrap::<B, 2>(d_th_rows).sum_dim(0).reshape([two_f]);
    [
        prim(d_w.clone().narrow(0, 0, f)),
        prim(d_w.narrow(0, f, f)),
        prim(d_th.clone().narrow(0, 0, f)),
        prim(d_th.narrow(0, f, f)),
    ]
}

/// Their backward composed from tensor ops and [`SnnOps::plif_row_backward`] (the spikes are
/// recomputed by the forward scan): `∂act` from the gating, `∂V_post = ∂act·(1 − β)` with
/// leak, the scan's backward, `∂i = ∂u·(1 − β)`, and `∂β` collecting the scan's term and both
/// `(1 − β)` factors' (`−Σ ∂act·V_post`, `−Σ ∂u·i`).
pub fn ffn_backward_reference<B: SnnOps>(
    inp: FfnInputs<B>,
    vpost: FloatTensor<B>,
    grad_gv: FloatTensor<B>,
) -> FfnGrads<B> {
    let [beta, one_minus, vth] = ffn_params(&inp);
    let [beta_e, u, vth_e] = ffn_scan_inputs(&inp, &beta, &one_minus, &vth);
    let spike = B::plif_row_forward(beta_e.clone(), u, vth_e, inp.v0.clone()).spike;
    let vpost = wrap::<B, 3>(vpost);
    let [tk, b, two_f] = vpost.dims();
    let f = two_f / 2;
    let om3 = one_minus.clone().unsqueeze::<3>();
    let act = if inp.leak {
        vpost.clone() * om3.clone()
    } else {
        vpost.clone()
    };
    let grad = wrap::<B, 3>(grad_gv);
    let d_act = Tensor::cat(
        vec![
            grad.clone() * act.clone().slice([0..tk, 0..b, f..two_f]),
            grad * act.slice([0..tk, 0..b, 0..f]),
        ],
        2,
    );
    let rows = |t: Tensor<B, 3>| t.sum_dim(0).reshape([b, two_f]);
    let (d_vpost, d_om_leak) = if inp.leak {
        (d_act.clone() * om3, rows(d_act * vpost.clone()))
    } else {
        (d_act, Tensor::zeros([b, two_f], &vpost.device()))
    };
    let g = B::plif_row_backward(beta_e, inp.v0.clone(), prim(vpost), spike, prim(d_vpost));
    let g_u = wrap::<B, 3>(g.u);
    let i_gu = wrap::<B, 3>(inp.i_gu.clone());
    let d_i =
        (g_u.clone().reshape([tk * b, two_f]) * one_minus.unsqueeze::<2>()).reshape([tk, b, two_f]);
    let d_om_in = rows(g_u * i_gu);
    let d_beta_rows = wrap::<B, 2>(g.beta) - d_om_leak - d_om_in;
    let [w_gate, w_up, th_gate, th_up] = ffn_param_grads(&inp, prim(d_beta_rows), g.vth);
    FfnGrads {
        i_gu: prim(d_i),
        w_gate,
        w_up,
        th_gate,
        th_up,
        v0: g.v0,
    }
}

/// The SNNFFN's gate and up neurons as one differentiable op (SPEC §2.3): input currents
/// `(1 − β)·i` from the merged projection `i_gu` `[TK, B, 2·D_ff]`, one merged row-parameter
/// scan, `(1 − β)·V_post` (or `V_post`) of each, and their product → `(g·v [TK, B, D_ff], final
/// state [B, 2·D_ff])`, the state detached. Through [`SnnOps::ffn_neurons_forward`] and
/// [`SnnOps::ffn_neurons_backward`]; the model calls it where [`SnnOps::fuses_ffn_neurons`].
#[allow(clippy::too_many_arguments)]
pub fn ffn_neurons<B: SnnOps>(
    i_gu: Tensor<B, 3>,
    w_gate: Tensor<B, 1>,
    w_up: Tensor<B, 1>,
    th_gate: Tensor<B, 1>,
    th_up: Tensor<B, 1>,
    v0: Tensor<B, 2>,
    leak: bool,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (gv, vpost) = B::ffn_neurons_forward(FfnInputs {
        i_gu: prim(i_gu),
        w_gate: prim(w_gate),
        w_up: prim(w_up),
        th_gate: prim(th_gate),
        th_up: prim(th_up),
        v0: prim(v0),
        leak,
    });
    let vpost = wrap::<B, 3>(vpost);
    let [tk, b, two_f] = vpost.dims();
    let last = vpost.narrow(0, tk - 1, 1).reshape([b, two_f]).detach();
    (wrap(gv), last)
}

/// [`SnnOps::ponder_agg_fused`] on tensors: `Some((aggregate [T, B, D], E[K] [T, B]))` where the
/// backend fuses it, else `None`. `halt_w` `[1, D]`, `halt_b` `[1]`.
pub fn ponder_agg_fused<B: SnnOps>(
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

/// [`SnnOps::ponder_residual_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((aggregate, c, E[K]))`.
#[allow(clippy::too_many_arguments)]
pub fn ponder_residual_fused<B: SnnOps>(
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

/// [`SnnOps::norm_plif_fused`] on tensors: `Some((output [T·K, B, D], final state [B, D]))`
/// where the backend fuses it, else `None`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_fused<B: SnnOps>(
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

/// [`SnnOps::norm_plif_mean_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on: `Some((mean over each token's K outputs [T, B, D], final state
/// [B, D]))`.
#[allow(clippy::too_many_arguments)]
pub fn norm_plif_mean_fused<B: SnnOps>(
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

/// [`SnnOps::rms_norm_fused`] on tensors, where the backend fuses it and [`decode_fusion`]
/// is on.
pub fn rms_norm_fused<B: SnnOps>(
    x: Tensor<B, 2>,
    gain: Tensor<B, 1>,
    eps: f64,
) -> Option<Tensor<B, 2>> {
    if !decode_fusion() {
        return None;
    }
    B::rms_norm_fused(prim(x), prim(gain), eps).map(wrap)
}

/// [`SnnOps::ffn_plif_fused`] on tensors: `Some((g·v [TK, B, D_ff], final state [B, 2·D_ff]))`
/// where the backend fuses it, else `None`. `i_gu` `[TK, B, 2·D_ff]`; `params` the gate and up
/// neurons' β logits, then their thresholds (`[D_ff]` each); see [`ffn_plif_fused_rows`] for a
/// column slice of a wider product.
pub fn ffn_plif_fused<B: SnnOps>(
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
pub fn ffn_plif_fused_rows<B: SnnOps>(
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

fn ffn_plif_call<B: SnnOps>(
    i_gu: FloatTensor<B>,
    params: [Tensor<B, 1>; 4],
    v0: Tensor<B, 2>,
    leak: bool,
) -> Option<(Tensor<B, 3>, Tensor<B, 2>)> {
    let [w_gate, w_up, th_gate, th_up] = params.map(prim);
    B::ffn_plif_fused(i_gu, w_gate, w_up, th_gate, th_up, prim(v0), leak)
        .map(|(gv, last)| (wrap(gv), wrap(last)))
}

/// Whether the decoding fusions ([`block_scan_fused`], [`gate_skip_fused`],
/// [`centred_residual_fused`], the CUDA PonderAgg's one-unit-per-channel kernel for a few rows)
/// run where the backend has them: on by default,
/// `NSACTOR_DECODE_FUSION=off` at start or [`set_decode_fusion`] turns them off (the composed
/// path, for A/B runs and to check them against it).
pub fn decode_fusion() -> bool {
    DECODE_FUSION.load(std::sync::atomic::Ordering::Relaxed)
        && *DECODE_FUSION_ENV
            .get_or_init(|| std::env::var("NSACTOR_DECODE_FUSION").as_deref() != Ok("off"))
}

/// Turns the decoding fusions on or off for the process (see [`decode_fusion`]).
pub fn set_decode_fusion(on: bool) {
    DECODE_FUSION.store(on, std::sync::atomic::Ordering::Relaxed);
}

static DECODE_FUSION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
static DECODE_FUSION_ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// [`SnnOps::block_scan_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on.
pub fn block_scan_fused<B: SnnOps>(
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

/// [`SnnOps::gate_skip_fused`] on tensors, where the backend fuses it and [`decode_fusion`]
/// is on.
pub fn gate_skip_fused<B: SnnOps>(
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

/// [`SnnOps::centred_residual_fused`] on tensors, where the backend fuses it and
/// [`decode_fusion`] is on.
pub fn centred_residual_fused<B: SnnOps>(h: Tensor<B, 2>, r: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
    if !decode_fusion() {
        return None;
    }
    B::centred_residual_fused(prim(h), prim(r)).map(wrap)
}

/// `lhs [M, K] · rhs [K, N]` through [`SnnOps::gemm`], differentiable.
pub fn matmul<B: SnnOps>(lhs: Tensor<B, 2>, rhs: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm(prim(lhs), prim(rhs)))
}

/// `lhs [M, K] · rhs [K, N]` stored in [`SnnOps::storage_dtype`] ([`SnnOps::gemm_out`]),
/// differentiable: for a product read only by the selective scan.
pub fn matmul_stored<B: SnnOps>(lhs: Tensor<B, 2>, rhs: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm_out(prim(lhs), prim(rhs), B::storage_dtype()))
}

/// `t` in [`SnnOps::storage_dtype`] (unchanged when it is already), differentiable (burn's
/// cast: the gradient comes back in `t`'s type). An input that several GEMMs read is rounded
/// once this way instead of once per GEMM: their autodiff nodes then share one bf16 copy, and
/// their input gradients, bf16 too, add up before the cast's backward widens the sum, as
/// PyTorch's autocast does.
pub fn stored<B: SnnOps, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = B::storage_dtype();
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

/// `lhs [M, K] · rhs [K, N] + c [M, N]` through [`SnnOps::gemm_add`]: for untracked passes
/// (on an autodiff backend it is the differentiable GEMM and add).
pub fn matmul_add<B: SnnOps>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    c: Tensor<B, 2>,
) -> Tensor<B, 2> {
    wrap(B::gemm_add(prim(lhs), prim(rhs), prim(c)))
}

/// `t` as [`matmul`] reads it ([`SnnOps::gemm_operand`]): for an operand used many times
/// (a weight while decoding), rounded once. Untracked tensors only: the rounded copy carries
/// no gradient back to `t`.
pub fn gemm_operand<B: SnnOps>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm_operand(prim(t)))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn wrap<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// `[TK, B, dim]` shape of the sequence tensor and the column count `B·dim`.
fn scan_shape<B: Backend>(seq: &FloatTensor<B>, v0: &FloatTensor<B>) -> (Shape, usize) {
    use burn::tensor::TensorMetadata;
    let shape = seq.shape();
    assert_eq!(
        shape.num_dims(),
        3,
        "PLIF scan: sequence tensors must be [TK, B, dim], got {shape:?}"
    );
    let v0_shape = v0.shape();
    assert_eq!(
        v0_shape.as_slice(),
        &shape[1..],
        "PLIF scan: v0 must be [B, dim] = {:?}, got {v0_shape:?}",
        &shape[1..]
    );
    let cols = shape[1] * shape[2];
    (shape, cols)
}

fn host<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    use burn::tensor::TensorMetadata;
    let data = match t.shape().num_dims() {
        2 => wrap::<B, 2>(t).into_data(),
        3 => wrap::<B, 3>(t).into_data(),
        n => panic!("PLIF scan: unexpected rank {n}"),
    };
    data.convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data converts to Vec<f32>")
}

fn device_tensor<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    like: &FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let device = B::float_device(like);
    let data = TensorData::new(values, shape).convert_dtype(like.dtype());
    B::float_from_data(data, &device)
}

fn scan_out<B: Backend>(out: ScanOut, shape: Shape, like: &FloatTensor<B>) -> PlifOutput<B> {
    PlifOutput {
        spike: device_tensor::<B>(out.spike, shape.clone(), like),
        vpost: device_tensor::<B>(out.vpost, shape, like),
        last: None,
    }
}

fn scan_grads<B: Backend>(
    g: ScanGrads,
    param_shape: Shape,
    seq_shape: Shape,
    like: &FloatTensor<B>,
) -> PlifGrads<B> {
    let state_shape = Shape::new([seq_shape[1], seq_shape[2]]);
    PlifGrads {
        beta: device_tensor::<B>(g.beta, param_shape.clone(), like),
        u: device_tensor::<B>(g.u, seq_shape, like),
        vth: device_tensor::<B>(g.vth, param_shape, like),
        v0: device_tensor::<B>(g.v0, state_shape, like),
    }
}

#[cfg(feature = "ndarray")]
impl SnnOps for burn_ndarray::NdArray<f32> {}

/// Runs a PLIF scan kernel's launch as a timed scan span (`crate::cuda_timing`).
#[cfg(feature = "cuda")]
fn scan_timed<R>(device: &burn_cuda::CudaDevice, f: impl FnOnce() -> R) -> R {
    crate::cuda_timing::timed(device, crate::cuda_timing::Kind::Scan, f)
}

/// The fused selective scan's tensors in kernel argument order.
#[cfg(feature = "cuda")]
fn selective_args<B: Backend>(inp: SelectiveInputs<B>) -> [FloatTensor<B>; 8] {
    [
        inp.i,
        inp.r_beta,
        inp.r_alpha,
        inp.r_th,
        inp.b_beta,
        inp.b_alpha,
        inp.b_th,
        inp.v0,
    ]
}

/// The CUDA backend: the scans as CubeCL kernels ([`crate::cuda_scan`]), tested against the
/// host reference these defaults run.
#[cfg(feature = "cuda")]
impl SnnOps for burn_cuda::Cuda<f32, i32> {
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::cuda_gemm::gemm(lhs, rhs)
    }

    fn gemm_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        crate::cuda_gemm::gemm_add(crate::cuda_gemm::precision(), lhs, rhs, c)
    }

    fn gemm_operand(t: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::cuda_gemm::round_operand(t, crate::cuda_gemm::precision())
    }

    fn gemm_out(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: DType) -> FloatTensor<Self> {
        crate::cuda_gemm::gemm_out(crate::cuda_gemm::precision(), lhs, rhs, out)
    }

    fn storage_dtype() -> DType {
        crate::cuda_gemm::storage_dtype()
    }

    fn move_to_device(t: FloatTensor<Self>, device: &Self::Device) -> FloatTensor<Self> {
        crate::cuda_device::to_device(t, device)
    }

    fn fuses_modulation() -> bool {
        true
    }

    fn merges_small_gemms() -> bool {
        true
    }

    fn flush(device: &Self::Device) {
        crate::cuda_graph::flush(device);
    }

    fn timed_call<R>(device: &Self::Device, f: impl FnOnce() -> R) -> R {
        crate::cuda_timing::timed(device, crate::cuda_timing::Kind::Call, f)
    }

    fn captures_steps() -> bool {
        true
    }

    fn capture<R>(
        device: &Self::Device,
        inputs: &[FloatTensor<Self>],
        f: impl FnOnce() -> R,
    ) -> Result<(R, StepGraph), String> {
        crate::cuda_graph::capture(device, inputs, f).map(|(r, g)| (r, StepGraph::new(g)))
    }

    fn capture_copy(src: FloatTensor<Self>, dst: &FloatTensor<Self>) -> Result<(), String> {
        crate::cuda_graph::copy(src, dst)
    }

    fn contiguous(t: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_cubecl::kernel::into_contiguous(t)
    }

    fn replay(
        graph: &StepGraph,
        inputs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        written: &[FloatTensor<Self>],
    ) -> Result<(), String> {
        graph
            .get::<crate::cuda_graph::Graph>()
            .ok_or("a graph captured by another backend")?
            .replay(inputs, written)
    }

    /// `$NSACTOR_NORM_PLIF=composed` keeps the composition, for comparison.
    fn fuses_norm_plif() -> bool {
        std::env::var("NSACTOR_NORM_PLIF").map_or(true, |v| v != "composed")
    }

    fn norm_plif_forward(inp: NormPlifInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = inp.x.device.clone();
        scan_timed(&device, || {
            crate::cuda_infer::norm_plif_train(
                [inp.x, inp.norm_w, inp.w, inp.v_th, inp.v0],
                inp.eps as f32,
                inp.k,
                inp.leak,
            )
        })
    }

    fn norm_plif_backward(
        inp: NormPlifInputs<Self>,
        vpost: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 5] {
        let d = inp.w.meta.shape()[0];
        let beta = sigmoid(wrap::<Self, 1>(inp.w.clone()));
        let device = inp.x.device.clone();
        let [dx, dnw_rows, d_beta, d_th, d_v0] = scan_timed(&device, || {
            crate::cuda_infer::norm_plif_backward(
                [inp.x, inp.norm_w, inp.w, inp.v_th, inp.v0],
                inp.eps as f32,
                inp.k,
                inp.leak,
                vpost,
                grad,
            )
        });
        let d_nw = wrap::<Self, 2>(dnw_rows).sum_dim(0).reshape([d]);
        let d_beta = wrap::<Self, 2>(d_beta).sum_dim(0).reshape([d]);
        let d_w = through_sigmoid(d_beta, beta);
        let d_th = wrap::<Self, 2>(d_th).sum_dim(0).reshape([d]);
        [dx, prim(d_nw), prim(d_w), prim(d_th), d_v0]
    }

    /// `$NSACTOR_PONDER=composed` keeps the composition, for comparison.
    fn fuses_ponder() -> bool {
        std::env::var("NSACTOR_PONDER").map_or(true, |v| v != "composed")
    }

    fn ponder_forward(inp: PonderInputs<Self>) -> FloatTensor<Self> {
        crate::cuda_infer::ponder_agg_packed(
            inp.frames,
            inp.halt_w,
            inp.halt_b,
            inp.k,
            inp.clamp as f32,
            inp.eps as f32,
        )
    }

    fn ponder_backward(inp: PonderInputs<Self>, grad: FloatTensor<Self>) -> [FloatTensor<Self>; 3] {
        let d = inp.halt_w.meta.shape()[1];
        let [dx, dw_rows, db_rows] = crate::cuda_infer::ponder_backward(
            inp.frames,
            inp.halt_w,
            inp.halt_b,
            grad,
            inp.k,
            inp.clamp as f32,
            inp.eps as f32,
        );
        let dw = wrap::<Self, 2>(dw_rows).sum_dim(0).reshape([1, d]);
        let db = wrap::<Self, 1>(db_rows).sum();
        [dx, prim(dw), prim(db)]
    }

    /// `$NSACTOR_FFN_NEURONS=composed` keeps the composition, for comparison.
    fn fuses_ffn_neurons() -> bool {
        std::env::var("NSACTOR_FFN_NEURONS").map_or(true, |v| v != "composed")
    }

    fn ffn_neurons_forward(inp: FfnInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = inp.i_gu.device.clone();
        scan_timed(&device, || {
            crate::cuda_scan::ffn_forward(
                inp.i_gu,
                [inp.w_gate, inp.w_up, inp.th_gate, inp.th_up],
                inp.v0,
                inp.leak,
            )
        })
    }

    fn ffn_neurons_backward(
        inp: FfnInputs<Self>,
        vpost: FloatTensor<Self>,
        grad_gv: FloatTensor<Self>,
    ) -> FfnGrads<Self> {
        let device = inp.i_gu.device.clone();
        let [d_i, d_beta, d_th, d_v0] = scan_timed(&device, || {
            crate::cuda_scan::ffn_backward(
                inp.i_gu.clone(),
                [
                    inp.w_gate.clone(),
                    inp.w_up.clone(),
                    inp.th_gate.clone(),
                    inp.th_up.clone(),
                ],
                inp.v0.clone(),
                vpost,
                grad_gv,
                inp.leak,
            )
        });
        let [w_gate, w_up, th_gate, th_up] = ffn_param_grads(&inp, d_beta, d_th);
        FfnGrads {
            i_gu: d_i,
            w_gate,
            w_up,
            th_gate,
            th_up,
            v0: d_v0,
        }
    }

    fn ponder_agg_fused(
        frames: FloatTensor<Self>,
        halt_w: FloatTensor<Self>,
        halt_b: FloatTensor<Self>,
        k: usize,
        clamp: f64,
        eps: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        Some(crate::cuda_infer::ponder_agg(
            frames,
            halt_w,
            halt_b,
            k,
            clamp as f32,
            eps as f32,
        ))
    }

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
        crate::cuda_infer::ponder_residual(
            [frames, halt_w, halt_b, h, w_mean],
            k,
            clamp as f32,
            eps as f32,
        )
    }

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
        Some(crate::cuda_infer::norm_plif_mean(
            x, norm_w, eps as f32, w, v_th, v0, k, leak,
        ))
    }

    fn rms_norm_fused(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        eps: f64,
    ) -> Option<FloatTensor<Self>> {
        Some(crate::cuda_infer::rms_norm(x, gain, eps as f32))
    }

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
        Some(crate::cuda_infer::norm_plif(
            x, norm_w, eps as f32, w, v_th, v0, k, leak,
        ))
    }

    fn ffn_plif_fused(
        i_gu: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        th_gate: FloatTensor<Self>,
        th_up: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        leak: bool,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        Some(crate::cuda_scan::ffn_infer(
            i_gu,
            [w_gate, w_up, th_gate, th_up],
            v0,
            leak,
        ))
    }

    fn submission_stats() -> Option<[u64; 5]> {
        let (launches, launch_ns) = cubecl::cuda::nsactor_stats::launches();
        let (gemms, gemm_ns, lt_ns) = crate::cuda_gemm::queued_stats();
        Some([launches, launch_ns, gemms, gemm_ns, lt_ns])
    }

    fn block_scan_fused(
        y: FloatTensor<Self>,
        b_beta: FloatTensor<Self>,
        b_alpha: FloatTensor<Self>,
        b_th: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        v_th_min: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        Some(crate::cuda_infer::block_scan(
            y,
            [b_beta, b_alpha, b_th],
            v0,
            v_th_min as f32,
        ))
    }

    fn gate_skip_fused(
        out: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gate_col: usize,
        skip_col: usize,
    ) -> Option<FloatTensor<Self>> {
        Some(crate::cuda_infer::gate_skip(out, y, gate_col, skip_col))
    }

    fn centred_residual_fused(
        h: FloatTensor<Self>,
        r: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        Some(crate::cuda_infer::centred_residual(h, r))
    }

    fn plif_selective_forward(inp: SelectiveInputs<Self>) -> PlifOutput<Self> {
        let _ = scan_shape::<Self>(&inp.i, &inp.v0);
        let v_th_min = inp.v_th_min;
        let device = inp.i.device.clone();
        let (spike, vpost, last) = scan_timed(&device, || {
            crate::cuda_scan::selective_forward(selective_args(inp), v_th_min)
        });
        PlifOutput {
            spike,
            vpost,
            last: Some(last),
        }
    }

    fn plif_selective_backward(
        inp: SelectiveInputs<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> SelectiveGrads<Self> {
        let (shape, _) = scan_shape::<Self>(&grad_vpost, &inp.v0);
        let device = inp.i.device.clone();
        let [i, r_beta, r_alpha, r_th, v0, bias] = scan_timed(&device, || {
            crate::cuda_scan::selective_backward(selective_args(inp), vpost, spike, grad_vpost)
        });
        // [3, B, DN] per-column sums over time → [3, DN] over the batch.
        let dn = shape[2];
        let bias = wrap::<Self, 3>(bias).sum_dim(1).reshape([3, dn]);
        let row = |k: usize| prim(bias.clone().narrow(0, k, 1).reshape([dn]));
        SelectiveGrads {
            i,
            r_beta,
            r_alpha,
            r_th,
            b_beta: row(0),
            b_alpha: row(1),
            b_th: row(2),
            v0,
        }
    }

    fn plif_elem_forward(
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        let _ = scan_shape::<Self>(&u, &v0);
        let device = u.device.clone();
        let (spike, vpost) = scan_timed(&device, || {
            crate::cuda_scan::forward(false, beta, u, vth, v0)
        });
        PlifOutput {
            spike,
            vpost,
            last: None,
        }
    }

    fn plif_elem_backward(
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        let _ = scan_shape::<Self>(&grad_vpost, &v0);
        let device = grad_vpost.device.clone();
        let [beta, u, vth, v0] = scan_timed(&device, || {
            crate::cuda_scan::backward(false, beta, v0, vpost, spike, grad_vpost)
        });
        PlifGrads { beta, u, vth, v0 }
    }

    fn plif_row_forward(
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        let _ = scan_shape::<Self>(&u, &v0);
        let device = u.device.clone();
        let (spike, vpost) = scan_timed(&device, || {
            crate::cuda_scan::forward(true, beta, u, vth, v0)
        });
        PlifOutput {
            spike,
            vpost,
            last: None,
        }
    }

    fn plif_row_backward(
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        let _ = scan_shape::<Self>(&grad_vpost, &v0);
        let device = grad_vpost.device.clone();
        let [beta, u, vth, v0] = scan_timed(&device, || {
            crate::cuda_scan::backward(true, beta, v0, vpost, spike, grad_vpost)
        });
        PlifGrads { beta, u, vth, v0 }
    }
}
