//! What the CUDA kernel families share: output allocation and the dtype checks of their
//! launchers, the modulation's device functions (σ exactly as burn composes it; σ and softplus
//! at a few instructions for the scans; sign), the decoding scans' shared step (the SNNBlock's
//! modulation, one PLIF step, the FFN
//! neurons' per-column constants: the staged and the one-unit-per-column kernels call the same
//! functions), the staged kernels' cube width and shape knob, the plane constants of the
//! inference kernels, and the element type a GEMM after an inference kernel reads.

use crate::cuda::precision::input_dtype;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

pub(crate) fn out_like<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    out_typed(like, shape, like.dtype)
}

/// An uninitialised contiguous tensor of `dtype` on `like`'s device.
pub(crate) fn out_typed<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: burn::tensor::DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

pub(crate) fn check_f32<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) {
    for t in tensors {
        assert_eq!(
            t.dtype,
            burn::tensor::DType::F32,
            "the CUDA PLIF scan kernels take f32 tensors"
        );
    }
}

/// A tensor's shape as a vector, for the shape assertions the unchecked kernels rely on.
pub(crate) fn dims<R: CubeRuntime>(t: &CubeTensor<R>) -> Vec<usize> {
    t.meta.shape().as_slice().to_vec()
}

/// The dtype of a stored activation a scan kernel reads: f32 or bf16.
pub(crate) fn stored_dtype<R: CubeRuntime>(t: &CubeTensor<R>) -> DType {
    assert!(
        matches!(t.dtype, DType::F32 | DType::BF16),
        "PLIF scan kernels read f32 or bf16 activations, got {:?}",
        t.dtype
    );
    t.dtype
}

/// `σ(x)` exactly as burn composes it from tensor ops (`exp(−ln(e^{−x} + 1))`), so the fused
/// kernels and the composed model agree bit for bit on β.
#[cube]
pub(crate) fn sigmoid_burn(x: f32) -> f32 {
    let e = (-x).exp();
    (-((e + 1.0f32).ln())).exp()
}

/// The modulation's transcendentals at one `exp` an argument, a hardware reciprocal for σ and a
/// hardware `lg2` for softplus, instead of burn's composition (`exp(−ln(e^{−x} + 1))` for σ, `log1p` for softplus):
/// the scans' producers are bound by instruction issue, and the libm `logf`/`log1pf`
/// polynomials were most of their instructions (`docs/benchmarks/HISTORY.md`, issue 34). Both start from
/// `t = e^{−|x|}` (libm `expf`, ≤ 2 ulp, never overflows), so σ and softplus of one argument
/// share it:
/// - `σ(x) = (x ≥ 0 ? 1 : t) / (1 + t)` through the hardware reciprocal (`__fdividef`, ≤ 2 ulp
///   for a divisor in [1, 2]);
/// - `softplus(x) = max(x, 0) + ln(1 + t)` through the hardware `lg2` (`__logf`): absolute error
///   ≤ 2e-7 (the rounding of `1 + t` and `lg2.approx`'s 2^-22.6), on values ≥ ln 2 where
///   `x ≥ 0`.
///
/// They differ from burn's σ and softplus by a few f32 ulp, far inside every tolerance the
/// kernels are checked with (`bench kernels` against the composed reference, the fixtures).
#[cube]
pub(crate) fn exp_neg_abs(x: f32) -> f32 {
    (-(x.abs())).exp()
}

/// `a / b` through the hardware reciprocal (`__fdividef`).
#[cube(fast_math = FastMath::AllowReciprocal | FastMath::ReducedPrecision | FastMath::UnsignedZero | FastMath::NotInf)]
fn div_fast(a: f32, b: f32) -> f32 {
    a / b
}

/// `ln(x)` through the hardware `lg2` (`__logf`).
#[cube(fast_math = FastMath::all())]
fn ln_fast(x: f32) -> f32 {
    x.ln()
}

/// `σ(x)` from `t = e^{−|x|}` ([`exp_neg_abs`]); where `exact` (the `modulation = exact`
/// knob), burn's composition ([`sigmoid_burn`]) instead, as the scans computed it before the
/// few-instruction forms.
#[cube]
pub(crate) fn sigmoid_of(x: f32, t: f32, #[comptime] exact: bool) -> f32 {
    if comptime!(exact) {
        sigmoid_burn(x)
    } else {
        div_fast(select(x >= 0.0f32, 1.0f32, t), t + 1.0f32)
    }
}

/// `softplus(x) = max(x, 0) + ln(1 + e^{−|x|})` from `t = e^{−|x|}` ([`exp_neg_abs`]); where
/// `exact`, with libm's `log1p` instead of the hardware `lg2`.
#[cube]
pub(crate) fn softplus_of(x: f32, t: f32, #[comptime] exact: bool) -> f32 {
    if comptime!(exact) {
        max(x, 0.0f32) + t.log1p()
    } else {
        max(x, 0.0f32) + ln_fast(t + 1.0f32)
    }
}

/// `σ(x)` of the modulation (see [`exp_neg_abs`], [`sigmoid_of`]).
#[cube]
pub(crate) fn sigmoid_mod(x: f32, #[comptime] exact: bool) -> f32 {
    sigmoid_of(x, exp_neg_abs(x), exact)
}

/// `softplus(x)` of the modulation (see [`exp_neg_abs`], [`softplus_of`]).
#[cube]
pub(crate) fn softplus_mod(x: f32, #[comptime] exact: bool) -> f32 {
    softplus_of(x, exp_neg_abs(x), exact)
}

/// The SNNBlock's modulation of one hidden neuron at one step (Eq. 5–7).
#[derive(CubeType)]
pub(crate) struct Modulation {
    /// `β = σ(r_β + b_β)`.
    pub beta: f32,
    /// `u = softplus(r_α + b_α)·i`.
    pub u: f32,
    /// `V_th = |r_th + b_th| + V_min`.
    pub th: f32,
}

/// [`Modulation`] from the step's four projections `i, r_β, r_α, r_th` and the neuron's
/// biases `b_β, b_α, b_th`: shared by the decoding block scans.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn block_modulation(
    i: f32,
    rb: f32,
    ra: f32,
    rt: f32,
    bb: f32,
    ba: f32,
    bt: f32,
    v_th_min: f32,
) -> Modulation {
    Modulation {
        // The decoding scans keep the fast forms (the knob is the training scans').
        beta: sigmoid_mod(rb + bb, false),
        u: softplus_mod(ra + ba, false) * i,
        th: (rt + bt).abs() + v_th_min,
    }
}

/// What a unit of the FFN neuron kernels works on: its `(batch row b, channel j)` pair
/// (`valid` where the last units run past `B·D_ff`) and both neurons' constants of channel `j`:
/// β, `1 − β` and the threshold of the gate (`_g`) and up (`_u`) neuron.
#[derive(CubeType)]
pub(crate) struct Pair {
    pub b: usize,
    pub j: usize,
    pub valid: bool,
    pub beta_g: f32,
    pub beta_u: f32,
    pub om_g: f32,
    pub om_u: f32,
    pub tg: f32,
    pub tu: f32,
}

/// The [`Pair`] of column `c = b·D_ff + j` (the staged kernels: 32 per cube, in order; the
/// one-unit-per-column kernel: its absolute position).
#[cube]
pub(crate) fn pair(
    w_g: &Tensor<f32>,
    w_u: &Tensor<f32>,
    th_g: &Tensor<f32>,
    th_u: &Tensor<f32>,
    batch: usize,
    ff: usize,
    c: usize,
) -> Pair {
    let valid = c < batch * ff;
    let cc = select(valid, c, 0);
    let j = cc % ff;
    let beta_g = sigmoid_burn(w_g[j]);
    let beta_u = sigmoid_burn(w_u[j]);
    Pair {
        b: cc / ff,
        j,
        valid,
        beta_g,
        beta_u,
        om_g: -beta_g + 1.0f32,
        om_u: -beta_u + 1.0f32,
        tg: th_g[j],
        tu: th_u[j],
    }
}

#[cube]
pub(crate) fn sign(x: f32) -> f32 {
    select(x > 0.0f32, 1.0f32, select(x < 0.0f32, -1.0f32, 0.0f32))
}

/// Columns per cube of the staged kernels (selective, row-parameter, FFN neurons): one plane
/// wide, so each step's loads and stores are one coalesced 128-byte line.
pub(crate) const STAGE_COLS: u32 = 32;

/// `(producers, chunk)` of a staged kernel: its knob's shape (`PxC`, [`crate::tuning`]) or
/// `default`; `chunk` is rounded up to a multiple of `producers`.
pub(crate) fn stage_shape(
    knob: Option<nsactor_plugin_api::tuning::StageShape>,
    default: (usize, usize),
) -> (usize, usize) {
    let (p, c) = knob.map_or(default, |s| (s.producers, s.chunk));
    (p, c.div_ceil(p) * p)
}

/// Whether the kernels that may skip CubeCL's per-access bounds checks keep them (the
/// `kernel_bounds_check` knob, `NSACTOR_KERNEL_BOUNDS_CHECK=on`: a debugging aid, the same
/// bits). Off by default: each such kernel guards its own accesses on shapes its launcher
/// asserts, and the checks cost a metadata load, a compare and a select on every access.
pub(crate) fn bounds_checked() -> bool {
    crate::tuning::current().kernel_bounds_check
}

/// Launches `kernel` (declared `#[cube(launch, launch_unchecked)]`) with CubeCL's per-access
/// bounds checks only where [`bounds_checked`] asks for them. The caller states, in a
/// `SAFETY` comment at the call, why every access of the kernel stays inside its tensors: the
/// kernel's own guards and the shapes the launcher asserted or allocated.
macro_rules! launch_guarded {
    ($kernel:ident :: < $($g:ty),* > ( $($arg:expr),* $(,)? )) => {
        if $crate::cuda::common::bounds_checked() {
            $kernel::launch::<$($g),*>($($arg),*)
        } else {
            // SAFETY: stated by the caller (see the macro).
            unsafe { $kernel::launch_unchecked::<$($g),*>($($arg),*) }
        }
    };
}
pub(crate) use launch_guarded;

/// Asserts the shapes the norm + PLIF kernels index by without bounds checks: the three
/// per-channel parameters `[D]` and `v0` `[B, D]`.
pub(crate) fn check_norm_plif_params<R: CubeRuntime>(
    [norm_w, w, v_th, v0]: [&CubeTensor<R>; 4],
    (batch, dim): (usize, usize),
) {
    for (name, p) in [("norm_w", norm_w), ("w", w), ("v_th", v_th)] {
        assert_eq!(
            p.meta.shape().num_elements(),
            dim,
            "norm_plif: {name} has D values"
        );
    }
    assert_eq!(
        v0.meta.shape().num_elements(),
        batch * dim,
        "norm_plif: v0 [B, D]"
    );
}

/// `(T, B, D)` of `frames` `[T·K, B, D]`, with every tensor checked f32.
pub(crate) fn ponder_geometry<R: CubeRuntime>(
    tensors: &[&CubeTensor<R>],
    k: usize,
) -> (usize, usize, usize) {
    for x in tensors {
        assert_eq!(x.dtype, burn::tensor::DType::F32, "ponder_agg takes f32");
    }
    let shape = tensors[0].meta.shape();
    assert_eq!(shape.num_dims(), 3, "ponder_agg: frames [T·K, B, D]");
    let (tk, batch, dim) = (shape[0], shape[1], shape[2]);
    assert!(
        k > 0 && tk % k == 0,
        "ponder_agg: {tk} frames are not whole tokens of K = {k}"
    );
    assert!(
        tk * batch * (dim + 1) <= u32::MAX as usize,
        "ponder_agg: 32-bit indexing"
    );
    // What the kernels index by without bounds checks: the halting weights `[D]`, its bias.
    assert_eq!(
        tensors[1].meta.shape().num_elements(),
        dim,
        "ponder_agg: the halting weights have D values"
    );
    assert!(
        tensors[2].meta.shape().num_elements() >= 1,
        "ponder_agg: no halting bias"
    );
    (tk / k, batch, dim)
}

/// Units per cube: one plane.
pub(crate) const PLANE: u32 = 32;

/// Below this many rows a row-per-cube kernel gives each row a cube of several planes.
pub(crate) const FEW_ROWS: usize = 1024;

/// The type the GEMM after an inference kernel reads (bf16 in bf16 precision, else f32): the
/// kernel writes it, so the GEMM needs no cast of its input (the same round to nearest even).
pub(crate) fn gemm_input() -> DType {
    input_dtype()
}

/// Asserts what the unchecked kernels rely on besides `i_gu`'s geometry: the four per-channel
/// parameters `[D_ff]`, `v0` `[B, 2·D_ff]`, and each of `seqs` (with its width) `[TK, B, width]`.
pub(crate) fn check_ffn_shapes<R: CubeRuntime>(
    params: [&CubeTensor<R>; 4],
    v0: &CubeTensor<R>,
    (steps, batch, ff): (usize, usize, usize),
    seqs: &[(&CubeTensor<R>, usize)],
) {
    for t in params {
        assert_eq!(
            dims(t),
            [ff],
            "ffn neurons: per-channel parameters are [D_ff]"
        );
    }
    assert_eq!(dims(v0), [batch, 2 * ff], "ffn neurons: v0 is [B, 2·D_ff]");
    for (t, width) in seqs {
        assert_eq!(
            dims(t),
            [steps, batch, *width],
            "ffn neurons: [TK, B, ·] tensors alike"
        );
    }
}

/// `(batch, D_ff, steps)` of the FFN neurons' `i_gu` `[TK, B, 2·D_ff]`, checked.
pub(crate) fn ffn_geometry<R: CubeRuntime>(i_gu: &CubeTensor<R>) -> (usize, usize, usize) {
    let shape = i_gu.meta.shape();
    assert_eq!(shape.num_dims(), 3, "ffn neurons: i_gu [TK, B, 2·D_ff]");
    let (steps, batch, two_f) = (shape[0], shape[1], shape[2]);
    assert!(two_f % 2 == 0, "ffn neurons: odd gate/up width {two_f}");
    assert!(
        steps * batch * two_f <= u32::MAX as usize,
        "ffn neurons: {steps}×{batch}×{two_f} elements exceed 32-bit indexing"
    );
    (batch, two_f / 2, steps)
}
