//! The first selective kernels: one unit per column computes its own modulation and runs the
//! recurrence, f32 only (bf16 storage is cast around them). Superseded by the staged kernels;
//! `$NSACTOR_SELECTIVE=per-unit` selects them, for comparison.

use crate::cuda::common::{sigmoid_burn, sign, softplus};
use cubecl::prelude::*;

/// The fused selective kernels carry a chain of four transcendentals per step (σ as burn
/// composes it, softplus) and three (forward) or six (backward) buffers; with one unit per
/// column there are only B·D·N = 28,672 units, so deeper unrolling spills instead of hiding
/// latency. Measured on the H100 at the 0.9B shapes (ms, unroll 2 / 4 / 8 / 16 / 32): forward
/// 5.60 / 5.57 / 6.53 / 6.83 / 8.60, backward 7.07 / 9.35 / 10.66 / 12.81 / 18.67 (the last two
/// before the modulation moved ahead of the recurrence).
pub(crate) const UNROLL_SELECTIVE_FORWARD: usize = 4;
pub(crate) const UNROLL_SELECTIVE_BACKWARD: usize = 2;

/// The selective scan with the SNNBlock modulation fused in: reads the four projections once
/// and writes the spikes and `V_post`; `β, α, V_th, u` never leave registers.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn selective_forward_kernel(
    i: &Tensor<f32>,
    r_beta: &Tensor<f32>,
    r_alpha: &Tensor<f32>,
    r_th: &Tensor<f32>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    dim: u32,
    v_th_min: f32,
    #[comptime] unroll: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let j = c % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let mut v = v0[c];
    // The modulation of a chunk depends on loads only, never on the membrane: it is computed
    // for the whole chunk first (independent work the hardware overlaps), then the recurrence
    // runs over registers.
    let mut bb_ = Array::<f32>::new(unroll);
    let mut uu = Array::<f32>::new(unroll);
    let mut tt = Array::<f32>::new(unroll);
    let mut k0 = 0usize;
    while k0 < steps {
        let n = select(k0 + unroll <= steps, unroll, steps - k0);
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let idx = (k0 + q) * cols + c;
                bb_[q] = sigmoid_burn(r_beta[idx] + bb);
                uu[q] = softplus(r_alpha[idx] + ba) * i[idx];
                tt[q] = (r_th[idx] + bt).abs() + v_th_min;
            }
        }
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let idx = (k0 + q) * cols + c;
                let v_pre = fma(bb_[q], v, uu[q]);
                let s = select(v_pre >= tt[q], 1.0f32, 0.0f32);
                v = v_pre - tt[q] * s;
                spike[idx] = s;
                vpost[idx] = v;
            }
        }
        k0 += unroll;
    }
}

/// Its backward: the reverse loop of SPEC §6.1 with the modulation's derivatives applied in
/// registers. Writes `∂i, ∂r_β, ∂r_α, ∂r_th` per step, `∂v0`, and per column the sums over
/// time of `∂r_β, ∂r_α, ∂r_th` (the bias gradients before the sum over the batch).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn selective_backward_kernel(
    i: &Tensor<f32>,
    r_beta: &Tensor<f32>,
    r_alpha: &Tensor<f32>,
    r_th: &Tensor<f32>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    spike: &Tensor<f32>,
    grad: &Tensor<f32>,
    g_i: &mut Tensor<f32>,
    g_rb: &mut Tensor<f32>,
    g_ra: &mut Tensor<f32>,
    g_rt: &mut Tensor<f32>,
    g_v0: &mut Tensor<f32>,
    g_bias: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    dim: u32,
    #[comptime] unroll: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let j = c % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let v_first = v0[c];
    let mut acc = 0.0f32;
    let mut sum_b = 0.0f32;
    let mut sum_a = 0.0f32;
    let mut sum_t = 0.0f32;
    // Everything of a step but the carried gradient depends on loads only: computed for the
    // whole chunk first, then the reverse recurrence runs over registers.
    let mut be = Array::<f32>::new(unroll);
    let mut gg = Array::<f32>::new(unroll);
    let mut vp = Array::<f32>::new(unroll);
    let mut fa = Array::<f32>::new(unroll);
    let mut al = Array::<f32>::new(unroll);
    let mut ts = Array::<f32>::new(unroll);
    let mut end = steps;
    while end > 0 {
        let n = select(end >= unroll, unroll, end);
        let base = end - n;
        // q counts down from the chunk's last step.
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let k = base + n - 1 - q;
                let idx = k * cols + c;
                let xa = r_alpha[idx] + ba;
                be[q] = sigmoid_burn(r_beta[idx] + bb);
                gg[q] = grad[idx];
                vp[q] = select(k > 0, vpost[select(k > 0, idx - cols, c)], v_first);
                // ∂r_α = ∂u·i·softplus′(x), softplus′ = σ.
                fa[q] = i[idx] * sigmoid_burn(xa);
                al[q] = softplus(xa);
                // ∂r_th = ∂V_th·sign(·) with ∂V_th = −gv·s: the spike and sign are exact.
                ts[q] = spike[idx] * sign(r_th[idx] + bt);
            }
        }
        #[unroll]
        for q in 0..unroll {
            if q < n {
                let k = base + n - 1 - q;
                let idx = k * cols + c;
                let beta = be[q];
                let gv = gg[q] + acc;
                // ∂u = gv; ∂β = gv·V_{k−1}; ∂V_th = −gv·s.
                let d_rb = (beta * (1.0f32 - beta)) * (gv * vp[q]);
                let d_ra = gv * fa[q];
                let d_rt = -gv * ts[q];
                g_i[idx] = gv * al[q];
                g_rb[idx] = d_rb;
                g_ra[idx] = d_ra;
                g_rt[idx] = d_rt;
                sum_b += d_rb;
                sum_a += d_ra;
                sum_t += d_rt;
                acc = gv * beta;
            }
        }
        end = base;
    }
    g_v0[c] = acc;
    g_bias[c] = sum_b;
    g_bias[cols + c] = sum_a;
    g_bias[2 * cols + c] = sum_t;
}
