//! The PLIF scans as CubeCL kernels: one unit per column (a flattened `(batch, dim)` index)
//! walks the `TK` steps in order, holding the membrane in a register. Loads of step `k + 1`
//! do not depend on the state, so the hardware keeps them in flight while the recurrence runs;
//! consecutive units read consecutive columns, so every load and store is coalesced.
//!
//! The 0.9B model has too few columns for that alone (21,504–28,672, a few planes per SM), and
//! the selective scan adds four transcendentals per step to each unit's chain. The staged
//! kernels split the work instead: in a cube of 32 columns, producer planes load (and modulate)
//! the next chunk of steps into shared memory while one plane runs the recurrence over the
//! current chunk from it; one barrier per chunk swaps the two buffers. They compute the same
//! values as the per-unit kernels, bit for bit in the forward. With f32 storage the forward's
//! producers load through `cp.async` into a ring of stages in shared memory, each tracked by an
//! mbarrier, so the loads ahead of the recurrence hold no registers (84 % of copy against 77 %
//! for the same kernel loading into registers; with bf16 storage 1.75 ms against 2.12). The
//! selective backward does the same with its seven inputs (bf16 storage 3.12 → 2.83 ms).
//!
//! Same recurrence as [`crate::reference`], term for term: `v_pre = fma(β, v, u)`, the `≥`
//! test, `v = v_pre − V_th·s` (exact, `s` is 0 or 1), `f32` state; the backward pass keeps
//! `acc = gV·β` as its own rounded product like the reference.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

/// Units per cube. Small cubes spread the few thousand columns over every SM evenly (at the
/// 0.9B shapes 21,504–28,672 units: 128-unit cubes would leave a third of the SMs with one
/// cube and the rest with two). `$NSACTOR_SCAN_CUBE` overrides it.
const CUBE: u32 = 32;

/// Steps whose loads are issued together before their recurrence runs: the loads do not
/// depend on the membrane, so reading that many steps ahead keeps that many requests per unit
/// in flight instead of one. Measured on the H100 at the 0.9B shapes: the forward kernels gain
/// up to 32; the backward kernels hold four such buffers, the per-element one is fastest at 16
/// and the row one at 8. `$NSACTOR_SCAN_UNROLL` overrides them all.
const UNROLL_FORWARD: usize = 32;
const UNROLL_BACKWARD_ELEM: usize = 16;
const UNROLL_BACKWARD_ROW: usize = 8;
/// The fused selective kernels carry a chain of four transcendentals per step (σ as burn
/// composes it, softplus) and three (forward) or six (backward) buffers; with one unit per
/// column there are only B·D·N = 28,672 units, so deeper unrolling spills instead of hiding
/// latency. Measured on the H100 at the 0.9B shapes (ms, unroll 2 / 4 / 8 / 16 / 32): forward
/// 5.60 / 5.57 / 6.53 / 6.83 / 8.60, backward 7.07 / 9.35 / 10.66 / 12.81 / 18.67 (the last two
/// before the modulation moved ahead of the recurrence).
const UNROLL_SELECTIVE_FORWARD: usize = 4;
const UNROLL_SELECTIVE_BACKWARD: usize = 2;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&u| (1..=1024).contains(&u))
        .unwrap_or(default)
}

fn unroll(default: usize) -> usize {
    env_or("NSACTOR_SCAN_UNROLL", default).min(64)
}

fn cube() -> u32 {
    env_or("NSACTOR_SCAN_CUBE", CUBE as usize) as u32
}

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn forward_kernel(
    beta: &Tensor<f32>,
    u: &Tensor<f32>,
    vth: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    #[comptime] row: bool,
    #[comptime] unroll: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    // Row-parameter β and V_th: one value per column for every step.
    let b_row = beta[select(row, c, 0)];
    let th_row = vth[select(row, c, 0)];
    let mut v = v0[c];
    let mut bb = Array::<f32>::new(unroll);
    let mut uu = Array::<f32>::new(unroll);
    let mut tt = Array::<f32>::new(unroll);
    let mut k0 = 0usize;
    while k0 + unroll <= steps {
        #[unroll]
        for j in 0..unroll {
            let i = (k0 + j) * cols + c;
            uu[j] = u[i];
            if comptime![!row] {
                bb[j] = beta[i];
                tt[j] = vth[i];
            }
        }
        #[unroll]
        for j in 0..unroll {
            let i = (k0 + j) * cols + c;
            let b = select(row, b_row, bb[j]);
            let th = select(row, th_row, tt[j]);
            let v_pre = fma(b, v, uu[j]);
            let s = select(v_pre >= th, 1.0f32, 0.0f32);
            v = v_pre - th * s;
            spike[i] = s;
            vpost[i] = v;
        }
        k0 += unroll;
    }
    for k in k0..steps {
        let i = k * cols + c;
        let b = select(row, b_row, beta[select(row, c, i)]);
        let th = select(row, th_row, vth[select(row, c, i)]);
        let v_pre = fma(b, v, u[i]);
        let s = select(v_pre >= th, 1.0f32, 0.0f32);
        v = v_pre - th * s;
        spike[i] = s;
        vpost[i] = v;
    }
}

/// The reverse loop of SPEC §6.1. Per-element: the β and V_th gradients of every step are
/// stored. Row-parameter: they are summed over time in registers.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn backward_kernel(
    beta: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    spike: &Tensor<f32>,
    grad: &Tensor<f32>,
    g_beta: &mut Tensor<f32>,
    g_u: &mut Tensor<f32>,
    g_vth: &mut Tensor<f32>,
    g_v0: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    #[comptime] row: bool,
    #[comptime] unroll: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b_row = beta[select(row, c, 0)];
    let v_first = v0[c];
    let mut acc = 0.0f32;
    let mut sum_beta = 0.0f32;
    let mut sum_vth = 0.0f32;
    let mut gg = Array::<f32>::new(unroll);
    let mut vp = Array::<f32>::new(unroll);
    let mut ss = Array::<f32>::new(unroll);
    let mut bb = Array::<f32>::new(unroll);
    let mut end = steps;
    while end >= unroll {
        let base = end - unroll;
        // j counts down from the chunk's last step.
        #[unroll]
        for j in 0..unroll {
            let k = base + unroll - 1 - j;
            let i = k * cols + c;
            gg[j] = grad[i];
            ss[j] = spike[i];
            vp[j] = select(k > 0, vpost[select(k > 0, i - cols, c)], v_first);
            if comptime![!row] {
                bb[j] = beta[i];
            }
        }
        #[unroll]
        for j in 0..unroll {
            let k = base + unroll - 1 - j;
            let i = k * cols + c;
            let gv = gg[j] + acc;
            g_u[i] = gv;
            if comptime![row] {
                sum_beta += gv * vp[j];
                sum_vth += -gv * ss[j];
                acc = gv * b_row;
            } else {
                g_beta[i] = gv * vp[j];
                g_vth[i] = -gv * ss[j];
                acc = gv * bb[j];
            }
        }
        end = base;
    }
    while end > 0 {
        end -= 1;
        let k = end;
        let i = k * cols + c;
        let v_prev = select(k > 0, vpost[select(k > 0, i - cols, c)], v_first);
        let gv = grad[i] + acc;
        g_u[i] = gv;
        if comptime![row] {
            sum_beta += gv * v_prev;
            sum_vth += -gv * spike[i];
            acc = gv * b_row;
        } else {
            g_beta[i] = gv * v_prev;
            g_vth[i] = -gv * spike[i];
            acc = gv * beta[i];
        }
    }
    if comptime![row] {
        g_beta[c] = sum_beta;
        g_vth[c] = sum_vth;
    }
    g_v0[c] = acc;
}

/// The staged row-parameter forward: plane 0 of a cube runs the recurrence of 32 columns over
/// shared memory while planes `1..=producers` load the next chunk's input currents (every
/// `producers`-th step each, all loads issued together). With few columns (3,584 for the
/// 0.9B's input neurons) one unit per column keeps too few loads in flight; here a cube keeps
/// `chunk` steps of them. Same arithmetic as [`forward_kernel`] with `row`, bit for bit.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn row_forward_staged_kernel(
    beta: &Tensor<f32>,
    u: &Tensor<f32>,
    vth: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let b = beta[cc];
    let th = vth[cc];
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xu = Array::<f32>::new(per);
    let mut v = v0[cc];
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                let k0 = (ch - 1) * chunk;
                let buf = ((ch - 1) % 2) * chunk * 32;
                #[unroll]
                for q in 0..chunk {
                    let k = k0 + q;
                    if k < steps {
                        let v_pre = fma(b, v, s_u[buf + q * 32 + x]);
                        let s = select(v_pre >= th, 1.0f32, 0.0f32);
                        v = v_pre - th * s;
                        if valid {
                            let idx = k * cols + c;
                            spike[idx] = s;
                            vpost[idx] = v;
                        }
                    }
                }
            }
        } else if ch < chunks {
            let k0 = ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let k = k0 + (y - 1) + r * producers;
                if k < steps && valid {
                    xu[r] = u[k * cols + c];
                }
            }
            #[unroll]
            for r in 0..per {
                s_u[buf + ((y - 1) + r * producers) * 32 + x] = xu[r];
            }
        }
        sync_cube();
        ch += 1;
    }
}

/// The staged row-parameter backward: producers load `grad`, the spike and `V_{k−1}` of the
/// chunk before the current one (reverse order); plane 0 runs the reverse recurrence and sums
/// the β and V_th gradients in registers. Same arithmetic as [`backward_kernel`] with `row`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn row_backward_staged_kernel(
    beta: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    spike: &Tensor<f32>,
    grad: &Tensor<f32>,
    g_beta: &mut Tensor<f32>,
    g_u: &mut Tensor<f32>,
    g_vth: &mut Tensor<f32>,
    g_v0: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let b_row = beta[cc];
    let v_first = v0[cc];
    let mut s_g = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_s = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_v = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xg = Array::<f32>::new(per);
    let mut xs = Array::<f32>::new(per);
    let mut xv = Array::<f32>::new(per);
    let mut acc = 0.0f32;
    let mut sum_beta = 0.0f32;
    let mut sum_vth = 0.0f32;
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                let top = steps - (ch - 1) * chunk;
                let buf = ((ch - 1) % 2) * chunk * 32;
                #[unroll]
                for q in 0..chunk {
                    if q < top {
                        let k = top - 1 - q;
                        let s_idx = buf + q * 32 + x;
                        let gv = s_g[s_idx] + acc;
                        if valid {
                            g_u[k * cols + c] = gv;
                        }
                        sum_beta += gv * s_v[s_idx];
                        sum_vth += -gv * s_s[s_idx];
                        acc = gv * b_row;
                    }
                }
            }
        } else if ch < chunks {
            let top = steps - ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                if q < top && valid {
                    let k = top - 1 - q;
                    let idx = k * cols + c;
                    xg[r] = grad[idx];
                    xs[r] = spike[idx];
                    xv[r] = select(k > 0, vpost[select(k > 0, idx - cols, c)], v_first);
                }
            }
            #[unroll]
            for r in 0..per {
                let s_idx = buf + ((y - 1) + r * producers) * 32 + x;
                s_g[s_idx] = xg[r];
                s_s[s_idx] = xs[r];
                s_v[s_idx] = xv[r];
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        g_beta[c] = sum_beta;
        g_vth[c] = sum_vth;
        g_v0[c] = acc;
    }
}

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

/// `(steps, cols)` of a `[TK, B, dim]` sequence, as kernel arguments.
fn geometry<R: CubeRuntime>(seq: &CubeTensor<R>) -> (Shape, u32, u32, CubeCount, CubeDim) {
    let shape = seq.meta.shape().clone();
    assert_eq!(
        shape.num_dims(),
        3,
        "PLIF scan: [TK, B, dim] expected, got {shape:?}"
    );
    let cols = shape[1] * shape[2];
    let steps = shape[0];
    assert!(
        (steps * cols) <= u32::MAX as usize,
        "PLIF scan: {steps}×{cols} elements exceed 32-bit indexing"
    );
    let cube = cube();
    let cubes = cols.div_ceil(cube as usize) as u32;
    (
        shape,
        steps as u32,
        cols as u32,
        CubeCount::Static(cubes, 1, 1),
        CubeDim::new_1d(cube),
    )
}

fn check_f32<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) {
    for t in tensors {
        assert_eq!(
            t.dtype,
            burn::tensor::DType::F32,
            "the CUDA PLIF scan kernels take f32 tensors"
        );
    }
}

/// Forward of either scan: `(spike, vpost)`; `row` picks the row-parameter variant, whose β
/// and V_th are `[B, dim]`.
pub fn forward<R: CubeRuntime>(
    row: bool,
    beta: CubeTensor<R>,
    u: CubeTensor<R>,
    vth: CubeTensor<R>,
    v0: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    check_f32(&[&beta, &u, &vth, &v0]);
    let (shape, steps, cols, count, dim) = geometry(&u);
    let [beta, u, vth, v0] = [beta, u, vth, v0].map(into_contiguous);
    let spike = out_like(&u, shape.clone());
    let vpost = out_like(&u, shape);
    let client = u.client.clone();
    if row && staged_rows() && cols >= STAGE_ROW_FORWARD_MIN_COLS {
        let (producers, chunk) = stage_shape("NSACTOR_STAGE_ROW_FORWARD", STAGE_ROW_FORWARD);
        row_forward_staged_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(STAGE_COLS), 1, 1),
            CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
            beta.into_tensor_arg(),
            u.into_tensor_arg(),
            vth.into_tensor_arg(),
            v0.into_tensor_arg(),
            spike.clone().into_tensor_arg(),
            vpost.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(chunk as u32),
            chunk,
            producers,
        );
        return (spike, vpost);
    }
    forward_kernel::launch::<R>(
        &client,
        count,
        dim,
        beta.into_tensor_arg(),
        u.into_tensor_arg(),
        vth.into_tensor_arg(),
        v0.into_tensor_arg(),
        spike.clone().into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        cols,
        steps,
        row,
        unroll(UNROLL_FORWARD),
    );
    (spike, vpost)
}

/// Gradients `(beta, u, vth, v0)` of either scan; `row` picks the row-parameter variant,
/// whose β and V_th gradients are `[B, dim]`.
pub fn backward<R: CubeRuntime>(
    row: bool,
    beta: CubeTensor<R>,
    v0: CubeTensor<R>,
    vpost: CubeTensor<R>,
    spike: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 4] {
    check_f32(&[&beta, &v0, &vpost, &spike, &grad]);
    let (shape, steps, cols, count, dim) = geometry(&grad);
    let [beta, v0, vpost, spike, grad] = [beta, v0, vpost, spike, grad].map(into_contiguous);
    let state = Shape::new([shape[1], shape[2]]);
    let param = if row { state.clone() } else { shape.clone() };
    let g_beta = out_like(&grad, param.clone());
    let g_u = out_like(&grad, shape);
    let g_vth = out_like(&grad, param);
    let g_v0 = out_like(&grad, state);
    let client = grad.client.clone();
    if row && staged_rows() {
        let (producers, chunk) = stage_shape("NSACTOR_STAGE_ROW_BACKWARD", STAGE_ROW_BACKWARD);
        row_backward_staged_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(STAGE_COLS), 1, 1),
            CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
            beta.into_tensor_arg(),
            v0.into_tensor_arg(),
            vpost.into_tensor_arg(),
            spike.into_tensor_arg(),
            grad.into_tensor_arg(),
            g_beta.clone().into_tensor_arg(),
            g_u.clone().into_tensor_arg(),
            g_vth.clone().into_tensor_arg(),
            g_v0.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(chunk as u32),
            chunk,
            producers,
        );
        return [g_beta, g_u, g_vth, g_v0];
    }
    backward_kernel::launch::<R>(
        &client,
        count,
        dim,
        beta.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        spike.into_tensor_arg(),
        grad.into_tensor_arg(),
        g_beta.clone().into_tensor_arg(),
        g_u.clone().into_tensor_arg(),
        g_vth.clone().into_tensor_arg(),
        g_v0.clone().into_tensor_arg(),
        cols,
        steps,
        row,
        unroll(if row {
            UNROLL_BACKWARD_ROW
        } else {
            UNROLL_BACKWARD_ELEM
        }),
    );
    [g_beta, g_u, g_vth, g_v0]
}

/// `σ(x)` exactly as burn composes it from tensor ops (`exp(−ln(e^{−x} + 1))`), so the fused
/// kernels and the composed model agree bit for bit on β.
#[cube]
pub(crate) fn sigmoid_burn(x: f32) -> f32 {
    let e = (-x).exp();
    (-((e + 1.0f32).ln())).exp()
}

/// The model's overflow-free softplus, `max(x, 0) + log1p(e^{−|x|})`.
#[cube]
pub(crate) fn softplus(x: f32) -> f32 {
    max(x, 0.0f32) + (-(x.abs())).exp().log1p()
}

#[cube]
fn sign(x: f32) -> f32 {
    select(x > 0.0f32, 1.0f32, select(x < 0.0f32, -1.0f32, 0.0f32))
}

/// The selective scan with the SNNBlock modulation fused in: reads the four projections once
/// and writes the spikes and `V_post`; `β, α, V_th, u` never leave registers.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn selective_forward_kernel(
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
fn selective_backward_kernel(
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

/// Columns per cube of the staged selective kernels: one plane wide, so each step's loads and
/// stores are one coalesced 128-byte line.
const STAGE_COLS: u32 = 32;
/// `(producer planes, steps per chunk)` of the staged selective kernels. Measured on the H100
/// at the 0.9B shape (forward / backward ms): 2×32 5.89 / 8.69, 4×64 3.64 / 9.07, 8×32 2.65 /
/// 4.36. `$NSACTOR_STAGE_FORWARD` and `$NSACTOR_STAGE_BACKWARD` (`PxC`) override them.
const STAGE_FORWARD: (usize, usize) = (8, 32);
const STAGE_BACKWARD: (usize, usize) = (8, 16);
/// The register-loading forward's shape with f32 storage (`$NSACTOR_SELECTIVE_FORWARD=sync`;
/// the asynchronous ring is the default there). 8×32 holds 5 cubes per SM (registers and shared
/// memory), so the 896 cubes of the 0.9B shape run in 1.36 waves; 4×24 holds 7 (one wave).
/// Measured on the H100 (ms, f32): 8×32 2.64–2.67, 4×24 2.49–2.51, 4×20 2.49–2.53, 6×24 3.09,
/// 3×24 2.84, 4×32 3.71. With bf16 storage 8×32 and 4×24 tie (2.117 / 2.111 ms) and 4×20 is
/// slower (2.46), so bf16 keeps [`STAGE_FORWARD`].
const STAGE_FORWARD_F32: (usize, usize) = (4, 24);

/// `(producer planes, steps per chunk)` of the staged row-parameter kernels.
/// `$NSACTOR_STAGE_ROW_FORWARD` / `$NSACTOR_STAGE_ROW_BACKWARD` override them. Measured on the
/// H100 at T·K = 8176 and 21,504 columns (forward / backward ms): 8×64 / 8×32 0.89 / 1.89,
/// 4×32 / 4×64 0.97 / 1.50, 16×64 / 16×64 1.50 / 1.61, 8×128 / 8×16 1.60 / 1.21; one unit per
/// column 0.97 / 1.54.
const STAGE_ROW_FORWARD: (usize, usize) = (8, 64);
const STAGE_ROW_BACKWARD: (usize, usize) = (8, 16);
/// Below this many columns the row forward keeps one unit per column: at the input neurons'
/// 3,584 columns it took 0.50 ms against 0.63 staged (112 cubes leave a fifth of the SMs idle
/// and the rest with one scanning plane), while the backward still gained (1.11 → 0.76 ms).
const STAGE_ROW_FORWARD_MIN_COLS: u32 = 8192;

/// Whether the row-parameter scans run staged; `$NSACTOR_ROW_SCAN=per-unit` selects one unit per
/// column, for comparison.
fn staged_rows() -> bool {
    std::env::var("NSACTOR_ROW_SCAN").map_or(true, |v| v != "per-unit")
}

/// Whether the selective scans run staged (producer planes compute the modulation of the next
/// chunk into shared memory while one plane runs the recurrence over the current chunk) or one
/// unit per column (each unit computes its own modulation, the first version).
/// `$NSACTOR_SELECTIVE=per-unit` selects the latter, for comparison.
fn staged() -> bool {
    std::env::var("NSACTOR_SELECTIVE").map_or(true, |v| v != "per-unit")
}

/// `(producers, chunk)` of a staged kernel from `$var` (`PxC`) or the default; `chunk` is
/// rounded up to a multiple of `producers`.
fn stage_shape(var: &str, default: (usize, usize)) -> (usize, usize) {
    let (p, c) = std::env::var(var)
        .ok()
        .and_then(|v| {
            let (p, c) = v.split_once('x')?;
            Some((p.parse().ok()?, c.parse().ok()?))
        })
        .filter(|&(p, c): &(usize, usize)| (1..=31).contains(&p) && (1..=128).contains(&c))
        .unwrap_or(default);
    (p, c.div_ceil(p) * p)
}

/// Plane 0's part of a staged forward: the recurrence over chunk `ch` (steps `ch·chunk …`) from
/// the double buffer (`width` columns per step row), writing spikes and `V_post`; returns the
/// membrane after the chunk.
#[allow(clippy::too_many_arguments)]
#[cube]
fn scan_forward_chunk<S: Float>(
    s_beta: &SharedMemory<f32>,
    s_u: &SharedMemory<f32>,
    s_th: &SharedMemory<f32>,
    spike: &mut Tensor<S>,
    vpost: &mut Tensor<S>,
    v_in: f32,
    ch: usize,
    x: usize,
    c: usize,
    valid: bool,
    cols: usize,
    steps: usize,
    #[comptime] chunk: usize,
    #[comptime] width: usize,
) -> f32 {
    let mut v = v_in;
    let k0 = ch * chunk;
    let buf = (ch % 2) * chunk * width;
    #[unroll]
    for q in 0..chunk {
        let k = k0 + q;
        if k < steps {
            let s_idx = buf + q * width + x;
            let th = s_th[s_idx];
            let v_pre = fma(s_beta[s_idx], v, s_u[s_idx]);
            let s = select(v_pre >= th, 1.0f32, 0.0f32);
            v = v_pre - th * s;
            if valid {
                let idx = k * cols + c;
                spike[idx] = S::cast_from(s);
                vpost[idx] = S::cast_from(v);
            }
        }
    }
    v
}

/// Plane 0's part of a staged backward: the reverse recurrence over chunk `ch` (numbered from
/// the end, slot `q` step `steps − ch·chunk − 1 − q`) from the double buffer, writing the four
/// projections' gradients. `carry` holds `acc` (the carried `gV·β`) and the sums over time of
/// `∂r_β, ∂r_α, ∂r_th`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn scan_reverse_chunk<I: Float>(
    s_be: &SharedMemory<f32>,
    s_gg: &SharedMemory<f32>,
    s_vp: &SharedMemory<f32>,
    s_fa: &SharedMemory<f32>,
    s_al: &SharedMemory<f32>,
    s_ts: &SharedMemory<f32>,
    g_i: &mut Tensor<I>,
    g_rb: &mut Tensor<I>,
    g_ra: &mut Tensor<I>,
    g_rt: &mut Tensor<I>,
    carry: &mut Array<f32>,
    ch: usize,
    x: usize,
    c: usize,
    valid: bool,
    cols: usize,
    steps: usize,
    #[comptime] chunk: usize,
    #[comptime] width: usize,
) {
    let top = steps - ch * chunk;
    let buf = (ch % 2) * chunk * width;
    let mut acc = carry[0];
    let mut sum_b = carry[1];
    let mut sum_a = carry[2];
    let mut sum_t = carry[3];
    #[unroll]
    for q in 0..chunk {
        if q < top {
            let k = top - 1 - q;
            let s_idx = buf + q * width + x;
            let beta = s_be[s_idx];
            let gv = s_gg[s_idx] + acc;
            let d_rb = (beta * (1.0f32 - beta)) * (gv * s_vp[s_idx]);
            let d_ra = gv * s_fa[s_idx];
            let d_rt = -gv * s_ts[s_idx];
            if valid {
                let idx = k * cols + c;
                g_i[idx] = I::cast_from(gv * s_al[s_idx]);
                g_rb[idx] = I::cast_from(d_rb);
                g_ra[idx] = I::cast_from(d_ra);
                g_rt[idx] = I::cast_from(d_rt);
            }
            sum_b += d_rb;
            sum_a += d_ra;
            sum_t += d_rt;
            acc = gv * beta;
        }
    }
    carry[0] = acc;
    carry[1] = sum_b;
    carry[2] = sum_a;
    carry[3] = sum_t;
}

/// The staged forward: plane 0 of a cube scans 32 columns; planes `1..=producers` compute
/// `β, u, V_th` of the next chunk (`chunk` steps) into shared memory meanwhile, each taking
/// every `producers`-th step with all its loads issued together. One barrier per chunk swaps
/// the two buffers. Same arithmetic as [`selective_forward_kernel`], bit for bit.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn selective_forward_staged_kernel<I: Float, S: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<S>,
    vpost: &mut Tensor<S>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    v_th_min: f32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, S)] _types: [StorageType; 2],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let mut s_beta = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_th = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xb = Array::<f32>::new(per);
    let mut xa = Array::<f32>::new(per);
    let mut xt = Array::<f32>::new(per);
    let mut xi = Array::<f32>::new(per);
    // Chunk `ch` lives in buffer `ch % 2`; producers fill chunk 0 before the loop.
    let mut ch = 0usize;
    let mut v = v0[cc];
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                v = scan_forward_chunk::<S>(
                    &s_beta,
                    &s_u,
                    &s_th,
                    spike,
                    vpost,
                    v,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    32usize,
                );
            }
        } else if ch < chunks {
            let k0 = ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let k = k0 + (y - 1) + r * producers;
                if k < steps && valid {
                    let idx = k * cols + c;
                    xb[r] = f32::cast_from(r_beta[idx]);
                    xa[r] = f32::cast_from(r_alpha[idx]);
                    xt[r] = f32::cast_from(r_th[idx]);
                    xi[r] = f32::cast_from(i[idx]);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                let s_idx = buf + q * 32 + x;
                s_beta[s_idx] = sigmoid_burn(xb[r] + bb);
                s_u[s_idx] = softplus(xa[r] + ba) * xi[r];
                s_th[s_idx] = (xt[r] + bt).abs() + v_th_min;
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        last[c] = v;
    }
}

/// `(producer planes, steps per chunk, ring stages)` of the asynchronous forward (f32 storage).
/// `$NSACTOR_STAGE_ASYNC` (`PxCxD`) overrides it. Measured on the H100 at the 0.9B shape (ms):
/// 4×12×3 2.314–2.317, 4×12×2 2.307, 4×16×2 2.306, 6×12×3 2.324, 4×8×4 2.340, 4×24×3 2.341,
/// 3×12×3 2.365, 8×16×3 2.389, 4×16×3 2.410, 2×12×3 2.436, 4×12×4 2.441; the staged kernel
/// loading into registers took 2.519 on the same host. Three stages keep two chunks of loads
/// in flight per cube at 27.6 KB of shared memory (8 cubes per SM). 64- and 128-column cubes
/// (`PxCxDx64`, `…x128`: whole 128-byte lines per bf16 row) gained in neither storage.
const STAGE_ASYNC: (usize, usize, usize, usize) = (4, 12, 3, 32);
/// The same with bf16 storage. Measured (ms): 4×12×3 1.749–1.750, 8×16×3 1.749, 8×24×3 1.758,
/// 4×16×4 1.873, 12×24×3 1.919, 4×24×4 1.923, 4×32×2 1.924, 8×32×2 1.928, 4×24×3 1.944,
/// 8×32×3 1.963, 6×24×3 1.982, 8×48×3 2.512; the register-loading kernel 2.120.
const STAGE_ASYNC_BF16: (usize, usize, usize, usize) = (4, 12, 3, 32);

/// Which selective forward runs: the asynchronous ring (the default), or with
/// `$NSACTOR_SELECTIVE_FORWARD=sync` the staged kernel whose producers load into registers.
fn async_forward() -> bool {
    std::env::var("NSACTOR_SELECTIVE_FORWARD").map_or(true, |v| v != "sync")
}

/// `(producer planes, steps per chunk, ring stages, columns per cube)` of the asynchronous
/// backward; `$NSACTOR_STAGE_ASYNC_BACKWARD` overrides it. Measured on the H100 at the 0.9B
/// shape (ms, f32 / bf16 storage): 4×16×2 4.149 / 2.826, 4×8×2 4.132 / 2.919, 4×8×3 4.177 /
/// 2.886, 8×16×2 4.207 / 3.076, 4×12×3 4.244 / 3.370, 2×4×3 4.325 / 3.513, 2×8×3 5.162 /
/// 3.532, 8×8×2 4.182 / 3.759, 4×4×4 4.200 / 3.806, 8×8×4 4.276 / 4.033, 8×8×3 4.317 / 4.053;
/// the register-loading kernel 4.184 / 3.118 on the same host.
const STAGE_ASYNC_BACKWARD: (usize, usize, usize, usize) = (4, 16, 2, 32);

/// Whether the selective backward runs the asynchronous ring (the default) or, with
/// `$NSACTOR_SELECTIVE_BACKWARD=sync`, the staged kernel whose producers load into registers.
fn async_backward() -> bool {
    std::env::var("NSACTOR_SELECTIVE_BACKWARD").map_or(true, |v| v != "sync")
}

/// Elements per 4-byte asynchronous copy of a stored type (f32 or bf16).
fn pack_of(dtype: DType) -> usize {
    if dtype == DType::F32 { 1 } else { 2 }
}

/// `(producers, chunk, stages, columns per cube)` of the asynchronous forward from
/// `$NSACTOR_STAGE_ASYNC` (`PxCxD` or `PxCxDxW`) or the default for the storage type; `chunk`
/// is rounded up to a multiple of `producers`, `stages` is 2 to 4, the width 32, 64 or 128.
fn async_shape(stored: DType) -> (usize, usize, usize, usize) {
    let default = if stored == DType::F32 {
        STAGE_ASYNC
    } else {
        STAGE_ASYNC_BF16
    };
    ring_shape("NSACTOR_STAGE_ASYNC", default)
}

/// A ring kernel's `(producers, chunk, stages, width)` from `$var` (`PxCxD` or `PxCxDxW`) or
/// `default`.
fn ring_shape(var: &str, default: (usize, usize, usize, usize)) -> (usize, usize, usize, usize) {
    let (p, c, d, w) = std::env::var(var)
        .ok()
        .and_then(|v| {
            let n: Vec<usize> = v
                .split('x')
                .map(|n| n.parse().ok())
                .collect::<Option<_>>()?;
            match n[..] {
                [p, c, d] => Some((p, c, d, 32)),
                [p, c, d, w] => Some((p, c, d, w)),
                _ => None,
            }
        })
        .filter(|&(p, c, d, w)| {
            (1..=31).contains(&p)
                && (1..=128).contains(&c)
                && (2..=4).contains(&d)
                && [32, 64, 128].contains(&w)
                && w * (1 + p) <= 1024
        })
        .unwrap_or(default);
    (p, c.div_ceil(p) * p, d, w)
}

/// Issues this producer unit's share of the asynchronous copies of forward chunk `cn` (four
/// arrays) into ring stage `cn % stages` and commits them to the stage's barrier.
#[allow(clippy::too_many_arguments)]
#[cube]
fn issue_chunk<I: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    raw: &mut SharedMemory<I>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    cn: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
    steps: usize,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] stages: usize,
    #[comptime] pack: usize,
    #[comptime] width: usize,
) {
    let plane = comptime!(chunk * width);
    let stage = cn % stages;
    let rb = stage * 4 * plane;
    let ra = rb + plane;
    let rt = rb + 2 * plane;
    let ii = rb + 3 * plane;
    let k0 = cn * chunk;
    copy_steps::<I>(
        r_beta, raw, rb, k0, steps, lane, x, cube_col, cols, false, 0usize, chunk, producers, pack,
        width,
    );
    copy_steps::<I>(
        r_alpha, raw, ra, k0, steps, lane, x, cube_col, cols, false, 0usize, chunk, producers,
        pack, width,
    );
    copy_steps::<I>(
        r_th, raw, rt, k0, steps, lane, x, cube_col, cols, false, 0usize, chunk, producers, pack,
        width,
    );
    copy_steps::<I>(
        i, raw, ii, k0, steps, lane, x, cube_col, cols, false, 0usize, chunk, producers, pack,
        width,
    );
    commit_stage(bar0, bar1, bar2, bar3, stage);
}

/// Counts this unit's copies issued so far, and its arrival, on ring stage `s`'s barrier: the
/// stage's phase completes once every producer unit has arrived and all their copies landed.
#[cube]
fn commit_stage(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    s: usize,
) {
    if s == 0 {
        bar0.commit_copy_async();
        let _t = bar0.arrive();
    } else if s == 1 {
        bar1.commit_copy_async();
        let _t = bar1.arrive();
    } else if s == 2 {
        bar2.commit_copy_async();
        let _t = bar2.arrive();
    } else {
        bar3.commit_copy_async();
        let _t = bar3.arrive();
    }
}

/// Waits until chunk `ch`'s copies have landed in ring stage `ch % stages`: the stage's
/// `ch / stages`-th phase, whose parity alternates.
#[cube]
fn wait_stage(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    ch: usize,
    #[comptime] stages: usize,
) {
    let s = ch % stages;
    let parity = ((ch / stages) % 2) as u32;
    if s == 0 {
        bar0.wait_parity(parity);
    } else if s == 1 {
        bar1.wait_parity(parity);
    } else if s == 2 {
        bar2.wait_parity(parity);
    } else {
        bar3.wait_parity(parity);
    }
}

/// The staged forward with an asynchronous ring (f32 storage): producer planes issue `cp.async`
/// copies of the raw projections `stages − 1` chunks ahead into a ring in shared memory, each
/// stage tracked by its own mbarrier, then modulate the current chunk from the ring into the
/// double buffer plane 0 scans, as in [`selective_forward_staged_kernel`]. No register holds a
/// load in flight, so the loads ahead are bounded by shared memory, not by registers. Same
/// arithmetic, bit for bit.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn selective_forward_async_kernel<I: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<I>,
    vpost: &mut Tensor<I>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    v_th_min: f32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] stages: usize,
    #[comptime] pack: usize,
    #[comptime] width: usize,
    #[define(I)] _stored: StorageType,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let cube_col = CUBE_POS_X as usize * width;
    let c = cube_col + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let plane = comptime!(chunk * width);
    let mut raw = SharedMemory::<I>::new(comptime!(stages * 4 * chunk * width));
    let mut s_beta = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_th = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    // One mbarrier per ring stage; every producer unit arrives once per use of a stage, and
    // its copies count through `commit_copy_async`.
    let arrivals = comptime!((producers * width) as u32);
    let bar0 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar1 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar2 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar3 = Barrier::shared(arrivals, UNIT_POS == 0);
    sync_cube();
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let lane = y - 1;
    if y > 0 {
        #[unroll]
        for cn in 0..comptime!(stages - 1) {
            if cn < chunks {
                issue_chunk::<I>(
                    i, r_beta, r_alpha, r_th, &mut raw, &bar0, &bar1, &bar2, &bar3, cn, lane, x,
                    cube_col, cols, steps, chunk, producers, stages, pack, width,
                );
            }
        }
    }
    let mut ch = 0usize;
    let mut v = v0[cc];
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                v = scan_forward_chunk::<I>(
                    &s_beta,
                    &s_u,
                    &s_th,
                    spike,
                    vpost,
                    v,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    width,
                );
            }
        } else if ch < chunks {
            let cn = ch + comptime!(stages - 1);
            if cn < chunks {
                issue_chunk::<I>(
                    i, r_beta, r_alpha, r_th, &mut raw, &bar0, &bar1, &bar2, &bar3, cn, lane, x,
                    cube_col, cols, steps, chunk, producers, stages, pack, width,
                );
            }
            let s = ch % stages;
            wait_stage(&bar0, &bar1, &bar2, &bar3, ch, stages);
            let base = s * 4 * plane;
            let buf = (ch % 2) * plane;
            #[unroll]
            for r in 0..per {
                let q = lane + r * producers;
                let o = base + q * width + x;
                let s_idx = buf + q * width + x;
                s_beta[s_idx] = sigmoid_burn(f32::cast_from(raw[o]) + bb);
                s_u[s_idx] = softplus(f32::cast_from(raw[o + plane]) + ba)
                    * f32::cast_from(raw[o + 3 * plane]);
                s_th[s_idx] = (f32::cast_from(raw[o + 2 * plane]) + bt).abs() + v_th_min;
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        last[c] = v;
    }
}

/// The staged backward: producer planes compute everything of a step but the carried
/// gradient for the chunk before the current one (the reverse order), plane 0 runs the
/// reverse recurrence over shared memory. Same arithmetic as [`selective_backward_kernel`].
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn selective_backward_staged_kernel<I: Float, S: Float, G: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<S>,
    spike: &Tensor<S>,
    grad: &Tensor<G>,
    g_i: &mut Tensor<I>,
    g_rb: &mut Tensor<I>,
    g_ra: &mut Tensor<I>,
    g_rt: &mut Tensor<I>,
    g_v0: &mut Tensor<f32>,
    g_bias: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, S, G)] _types: [StorageType; 3],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let v_first = v0[cc];
    let mut s_be = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_gg = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_vp = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_fa = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_al = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_ts = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xb = Array::<f32>::new(per);
    let mut xa = Array::<f32>::new(per);
    let mut xt = Array::<f32>::new(per);
    let mut xi = Array::<f32>::new(per);
    let mut xg = Array::<f32>::new(per);
    let mut xv = Array::<f32>::new(per);
    let mut xs = Array::<f32>::new(per);
    // The reverse recurrence's carry: `acc` and the three bias sums (see `scan_reverse_chunk`).
    let mut carry = Array::<f32>::new(4usize);
    #[unroll]
    for n in 0..4 {
        carry[n] = 0.0f32;
    }
    // Chunks are numbered from the end: chunk `n` holds steps `[steps − (n+1)·chunk, steps − n·chunk)`
    // (clipped at 0), slot `q` its step `steps − n·chunk − 1 − q`.
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                scan_reverse_chunk::<I>(
                    &s_be,
                    &s_gg,
                    &s_vp,
                    &s_fa,
                    &s_al,
                    &s_ts,
                    g_i,
                    g_rb,
                    g_ra,
                    g_rt,
                    &mut carry,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    32usize,
                );
            }
        } else if ch < chunks {
            let top = steps - ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                if q < top && valid {
                    let k = top - 1 - q;
                    let idx = k * cols + c;
                    xb[r] = f32::cast_from(r_beta[idx]);
                    xa[r] = f32::cast_from(r_alpha[idx]);
                    xt[r] = f32::cast_from(r_th[idx]);
                    xi[r] = f32::cast_from(i[idx]);
                    xg[r] = f32::cast_from(grad[idx]);
                    xs[r] = f32::cast_from(spike[idx]);
                    let prev = f32::cast_from(vpost[select(k > 0, idx - cols, c)]);
                    xv[r] = select(k > 0, prev, v_first);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                let s_idx = buf + q * 32 + x;
                let a = xa[r] + ba;
                s_be[s_idx] = sigmoid_burn(xb[r] + bb);
                s_gg[s_idx] = xg[r];
                s_vp[s_idx] = xv[r];
                s_fa[s_idx] = xi[r] * sigmoid_burn(a);
                s_al[s_idx] = softplus(a);
                s_ts[s_idx] = xs[r] * sign(xt[r] + bt);
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        g_v0[c] = carry[0];
        g_bias[c] = carry[1];
        g_bias[cols + c] = carry[2];
        g_bias[2 * cols + c] = carry[3];
    }
}

/// Issues this producer unit's share of the asynchronous copies of one array's chunk into
/// `dst` at `dst_base` (slot `q` at `q·width`). Forward, slot `q` is step `origin + q` (steps
/// past `steps` are skipped); in reverse (`reverse`), step `origin − 1 − q` (slots past
/// `origin` are skipped). `shift` 1 reads the row before each step (`V_post` of step `k − 1`;
/// step 0 has none and is left to the caller). Each `cp.async` moves 4 bytes global → shared
/// without a register: one f32, or `pack` = 2 neighbouring bf16 columns, in which case a warp
/// copies two slots' rows per instruction (each half-warp one 64-byte row). A plane copies the
/// slots it later reads; the stage's barrier makes every unit's copies visible to all.
#[allow(clippy::too_many_arguments)]
#[cube]
fn copy_steps<T: Float>(
    src: &Tensor<T>,
    dst: &mut SharedMemory<T>,
    dst_base: usize,
    origin: usize,
    steps: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
    #[comptime] reverse: bool,
    #[comptime] shift: usize,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] pack: usize,
    #[comptime] width: usize,
) {
    let per = comptime!(chunk / producers);
    let row_lanes = comptime!(width / pack);
    let col = (x % row_lanes) * pack;
    let c = cube_col + col;
    #[unroll]
    for r0 in 0..comptime!(per.div_ceil(pack)) {
        let r = r0 * pack + x / row_lanes;
        let q = lane + r * producers;
        let mut in_chunk = origin + q < steps;
        if comptime![reverse] {
            in_chunk = q < origin;
        }
        if r < per && in_chunk && c < cols {
            let mut k = origin + q;
            if comptime![reverse] {
                k = origin - 1 - q;
            }
            if k >= shift {
                let idx = (k - shift) * cols + c;
                let o = dst_base + q * width + col;
                copy_async(
                    &src.slice(idx, idx + pack),
                    &mut dst.slice_mut(o, o + pack),
                    comptime!(pack as u32),
                );
            }
        }
    }
}

/// Issues a producer unit's copies of backward chunk `cn` (seven arrays) into ring stage
/// `cn % stages` and commits them to the stage's barrier.
#[allow(clippy::too_many_arguments)]
#[cube]
fn issue_reverse<I: Float, S: Float, G: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    vpost: &Tensor<S>,
    spike: &Tensor<S>,
    grad: &Tensor<G>,
    raw_i: &mut SharedMemory<I>,
    raw_s: &mut SharedMemory<S>,
    raw_g: &mut SharedMemory<G>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    cn: usize,
    steps: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] stages: usize,
    #[comptime] packs: (usize, usize, usize),
    #[comptime] width: usize,
) {
    let plane = comptime!(chunk * width);
    let (pi, ps, pg) = packs;
    let top = steps - cn * chunk;
    let stage = cn % stages;
    let bi = stage * 4 * plane;
    let bs = stage * 2 * plane;
    let bg = stage * plane;
    let ra = bi + plane;
    let rt = bi + 2 * plane;
    let ii = bi + 3 * plane;
    let vp = bs + plane;
    copy_steps::<I>(
        r_beta, raw_i, bi, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers, pi,
        width,
    );
    copy_steps::<I>(
        r_alpha, raw_i, ra, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers,
        pi, width,
    );
    copy_steps::<I>(
        r_th, raw_i, rt, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers, pi,
        width,
    );
    copy_steps::<I>(
        i, raw_i, ii, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers, pi,
        width,
    );
    copy_steps::<S>(
        spike, raw_s, bs, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers, ps,
        width,
    );
    copy_steps::<S>(
        vpost, raw_s, vp, top, steps, lane, x, cube_col, cols, true, 1usize, chunk, producers, ps,
        width,
    );
    copy_steps::<G>(
        grad, raw_g, bg, top, steps, lane, x, cube_col, cols, true, 0usize, chunk, producers, pg,
        width,
    );
    commit_stage(bar0, bar1, bar2, bar3, stage);
}

/// The staged backward with an asynchronous ring, as [`selective_forward_async_kernel`] is to
/// the staged forward: producer planes copy the seven inputs of a chunk `stages − 1` chunks
/// ahead through `cp.async`, then compute everything of a step but the carried gradient from
/// the ring into the double buffer plane 0 runs the reverse recurrence over. Same arithmetic
/// as [`selective_backward_staged_kernel`].
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn selective_backward_async_kernel<I: Float, S: Float, G: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<S>,
    spike: &Tensor<S>,
    grad: &Tensor<G>,
    g_i: &mut Tensor<I>,
    g_rb: &mut Tensor<I>,
    g_ra: &mut Tensor<I>,
    g_rt: &mut Tensor<I>,
    g_v0: &mut Tensor<f32>,
    g_bias: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] stages: usize,
    #[comptime] packs: (usize, usize, usize),
    #[comptime] width: usize,
    #[define(I, S, G)] _types: [StorageType; 3],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let cube_col = CUBE_POS_X as usize * width;
    let c = cube_col + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let v_first = v0[cc];
    let plane = comptime!(chunk * width);
    let mut raw_i = SharedMemory::<I>::new(comptime!(stages * 4 * chunk * width));
    let mut raw_s = SharedMemory::<S>::new(comptime!(stages * 2 * chunk * width));
    let mut raw_g = SharedMemory::<G>::new(comptime!(stages * chunk * width));
    let mut s_be = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_gg = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_vp = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_fa = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_al = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_ts = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let arrivals = comptime!((producers * width) as u32);
    let bar0 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar1 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar2 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar3 = Barrier::shared(arrivals, UNIT_POS == 0);
    sync_cube();
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let lane = y - 1;
    if y > 0 {
        #[unroll]
        for cn in 0..comptime!(stages - 1) {
            if cn < chunks {
                issue_reverse::<I, S, G>(
                    i, r_beta, r_alpha, r_th, vpost, spike, grad, &mut raw_i, &mut raw_s,
                    &mut raw_g, &bar0, &bar1, &bar2, &bar3, cn, steps, lane, x, cube_col, cols,
                    chunk, producers, stages, packs, width,
                );
            }
        }
    }
    // The reverse recurrence's carry: `acc` and the three bias sums (see `scan_reverse_chunk`).
    let mut carry = Array::<f32>::new(4usize);
    #[unroll]
    for n in 0..4 {
        carry[n] = 0.0f32;
    }
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                scan_reverse_chunk::<I>(
                    &s_be,
                    &s_gg,
                    &s_vp,
                    &s_fa,
                    &s_al,
                    &s_ts,
                    g_i,
                    g_rb,
                    g_ra,
                    g_rt,
                    &mut carry,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    width,
                );
            }
        } else if ch < chunks {
            let cn = ch + comptime!(stages - 1);
            if cn < chunks {
                issue_reverse::<I, S, G>(
                    i, r_beta, r_alpha, r_th, vpost, spike, grad, &mut raw_i, &mut raw_s,
                    &mut raw_g, &bar0, &bar1, &bar2, &bar3, cn, steps, lane, x, cube_col, cols,
                    chunk, producers, stages, packs, width,
                );
            }
            let stage = ch % stages;
            wait_stage(&bar0, &bar1, &bar2, &bar3, ch, stages);
            let top = steps - ch * chunk;
            let buf = (ch % 2) * plane;
            let bi = stage * 4 * plane;
            let bs = stage * 2 * plane;
            let bg = stage * plane;
            #[unroll]
            for r in 0..per {
                let q = lane + r * producers;
                let o = q * width + x;
                let s_idx = buf + o;
                let a = f32::cast_from(raw_i[bi + plane + o]) + ba;
                let prev = f32::cast_from(raw_s[bs + plane + o]);
                let first = q + 1 >= top;
                s_be[s_idx] = sigmoid_burn(f32::cast_from(raw_i[bi + o]) + bb);
                s_gg[s_idx] = f32::cast_from(raw_g[bg + o]);
                s_vp[s_idx] = select(first, v_first, prev);
                s_fa[s_idx] = f32::cast_from(raw_i[bi + 3 * plane + o]) * sigmoid_burn(a);
                s_al[s_idx] = softplus(a);
                s_ts[s_idx] = f32::cast_from(raw_s[bs + o])
                    * sign(f32::cast_from(raw_i[bi + 2 * plane + o]) + bt);
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        g_v0[c] = carry[0];
        g_bias[c] = carry[1];
        g_bias[cols + c] = carry[2];
        g_bias[2 * cols + c] = carry[3];
    }
}

/// The dtype shared by the four projections of the selective scan: f32, or bf16 storage
/// (what the scans' outputs and the projections' gradients are then stored in too).
fn projection_dtype<R: CubeRuntime>(inputs: &[CubeTensor<R>; 8]) -> DType {
    let dtype = stored_dtype(&inputs[0]);
    assert!(
        inputs[1..4].iter().all(|t| t.dtype == dtype),
        "selective scan: the four projections are all f32 or all bf16, got {:?}",
        inputs[..4].iter().map(|t| t.dtype).collect::<Vec<_>>()
    );
    check_f32(&inputs[4..].iter().collect::<Vec<_>>());
    dtype
}

/// The dtype of a stored activation a scan kernel reads: f32 or bf16.
fn stored_dtype<R: CubeRuntime>(t: &CubeTensor<R>) -> DType {
    assert!(
        matches!(t.dtype, DType::F32 | DType::BF16),
        "PLIF scan kernels read f32 or bf16 activations, got {:?}",
        t.dtype
    );
    t.dtype
}

/// `t` in `dtype` (unchanged when it is already).
fn as_dtype<R: CubeRuntime>(t: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    if t.dtype == dtype {
        t
    } else {
        burn_cubecl::kernel::cast(t, dtype)
    }
}

/// Forward of the fused selective scan: `(spike, vpost, last)`. `inputs`: the projections `i,
/// r_β, r_α, r_th` `[TK, B, DN]`, the biases `b_β, b_α, b_th` `[DN]`, and `v0` `[B, DN]`.
/// Spikes and `V_post` are stored in the projections' type (f32, or bf16 storage: the kernel
/// reads bf16, computes in f32 and rounds what it writes); `last`, the final membrane state
/// `[B, DN]`, is always the f32 state itself.
pub fn selective_forward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 8],
    v_th_min: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let stored = projection_dtype(&inputs);
    let (shape, steps, cols, count, dim) = geometry(&inputs[0]);
    let dn = shape[2] as u32;
    let state = Shape::new([shape[1], shape[2]]);
    let [i, rb, ra, rt, bb, ba, bt, v0] = inputs.map(into_contiguous);
    if staged() {
        let spike = out_like(&i, shape.clone());
        let vpost = out_like(&i, shape);
        let last = out_typed(&i, state, DType::F32);
        let client = i.client.clone();
        let default = if stored == DType::F32 {
            STAGE_FORWARD_F32
        } else {
            STAGE_FORWARD
        };
        // bf16 storage copies column pairs (4 bytes), which rows of an even width keep aligned.
        let pack = pack_of(stored);
        if async_forward() && (cols as usize).is_multiple_of(pack) {
            let (producers, chunk, stages, width) = async_shape(stored);
            selective_forward_async_kernel::launch::<R>(
                &client,
                CubeCount::Static(cols.div_ceil(width as u32), 1, 1),
                CubeDim::new_2d(width as u32, 1 + producers as u32),
                i.into_tensor_arg(),
                rb.into_tensor_arg(),
                ra.into_tensor_arg(),
                rt.into_tensor_arg(),
                bb.into_tensor_arg(),
                ba.into_tensor_arg(),
                bt.into_tensor_arg(),
                v0.into_tensor_arg(),
                spike.clone().into_tensor_arg(),
                vpost.clone().into_tensor_arg(),
                last.clone().into_tensor_arg(),
                cols,
                steps,
                steps.div_ceil(chunk as u32),
                dn,
                v_th_min,
                chunk,
                producers,
                stages,
                pack,
                width,
                stored.into(),
            );
            return (spike, vpost, last);
        }
        let (producers, chunk) = stage_shape("NSACTOR_STAGE_FORWARD", default);
        selective_forward_staged_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(STAGE_COLS), 1, 1),
            CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
            i.into_tensor_arg(),
            rb.into_tensor_arg(),
            ra.into_tensor_arg(),
            rt.into_tensor_arg(),
            bb.into_tensor_arg(),
            ba.into_tensor_arg(),
            bt.into_tensor_arg(),
            v0.into_tensor_arg(),
            spike.clone().into_tensor_arg(),
            vpost.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(chunk as u32),
            dn,
            v_th_min,
            chunk,
            producers,
            [stored.into(), stored.into()],
        );
        return (spike, vpost, last);
    }
    // One unit per column (f32 only): bf16 storage is cast around it.
    let [i, rb, ra, rt] = [i, rb, ra, rt].map(|t| as_dtype(t, DType::F32));
    let spike = out_like(&i, shape.clone());
    let vpost = out_like(&i, shape.clone());
    let client = i.client.clone();
    selective_forward_kernel::launch::<R>(
        &client,
        count,
        dim,
        i.into_tensor_arg(),
        rb.into_tensor_arg(),
        ra.into_tensor_arg(),
        rt.into_tensor_arg(),
        bb.into_tensor_arg(),
        ba.into_tensor_arg(),
        bt.into_tensor_arg(),
        v0.into_tensor_arg(),
        spike.clone().into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        cols,
        steps,
        dn,
        v_th_min,
        unroll(UNROLL_SELECTIVE_FORWARD),
    );
    let last = last_frame(&vpost, &shape);
    (as_dtype(spike, stored), as_dtype(vpost, stored), last)
}

/// The last step `[B, DN]` of a `[TK, B, DN]` sequence, as a contiguous copy.
fn last_frame<R: CubeRuntime>(seq: &CubeTensor<R>, shape: &Shape) -> CubeTensor<R> {
    let [tk, b, dn] = [shape[0], shape[1], shape[2]];
    let rows = burn_cubecl::kernel::slice(seq.clone(), &[tk - 1..tk, 0..b, 0..dn]);
    burn_cubecl::ops::reshape(into_contiguous(rows), Shape::new([b, dn]))
}

/// Backward of the fused selective scan: `[∂i, ∂r_β, ∂r_α, ∂r_th, ∂v0, bias sums]`, the last
/// `[3, B, DN]` (`∂b_β, ∂b_α, ∂b_th` summed over time per column; sum it over `B`). The four
/// projections' gradients come in the projections' type; `vpost`, `spike` and `grad` may each
/// be f32 or bf16.
pub fn selective_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 8],
    vpost: CubeTensor<R>,
    spike: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 6] {
    let stored = projection_dtype(&inputs);
    assert_eq!(
        vpost.dtype, spike.dtype,
        "selective scan: V_post and spikes are stored alike"
    );
    let types = [
        stored.into(),
        stored_dtype(&vpost).into(),
        stored_dtype(&grad).into(),
    ];
    let (shape, steps, cols, count, dim) = geometry(&grad);
    let dn = shape[2] as u32;
    let [i, rb, ra, rt, bb, ba, bt, v0] = inputs.map(into_contiguous);
    let [vpost, spike, grad] = [vpost, spike, grad].map(into_contiguous);
    let state = Shape::new([shape[1], shape[2]]);
    let client = grad.client.clone();
    let g_v0 = out_typed(&grad, state.clone(), DType::F32);
    let g_bias = out_typed(&grad, Shape::new([3, state[0], state[1]]), DType::F32);
    let packs = (pack_of(stored), pack_of(vpost.dtype), pack_of(grad.dtype));
    if staged() && async_backward() && (cols % 2 == 0 || packs == (1, 1, 1)) {
        let g = || out_typed(&grad, shape.clone(), stored);
        let [g_i, g_rb, g_ra, g_rt] = [g(), g(), g(), g()];
        let (producers, chunk, stages, width) =
            ring_shape("NSACTOR_STAGE_ASYNC_BACKWARD", STAGE_ASYNC_BACKWARD);
        selective_backward_async_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(width as u32), 1, 1),
            CubeDim::new_2d(width as u32, 1 + producers as u32),
            i.into_tensor_arg(),
            rb.into_tensor_arg(),
            ra.into_tensor_arg(),
            rt.into_tensor_arg(),
            bb.into_tensor_arg(),
            ba.into_tensor_arg(),
            bt.into_tensor_arg(),
            v0.into_tensor_arg(),
            vpost.into_tensor_arg(),
            spike.into_tensor_arg(),
            grad.into_tensor_arg(),
            g_i.clone().into_tensor_arg(),
            g_rb.clone().into_tensor_arg(),
            g_ra.clone().into_tensor_arg(),
            g_rt.clone().into_tensor_arg(),
            g_v0.clone().into_tensor_arg(),
            g_bias.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(chunk as u32),
            dn,
            chunk,
            producers,
            stages,
            packs,
            width,
            types,
        );
        return [g_i, g_rb, g_ra, g_rt, g_v0, g_bias];
    }
    if staged() {
        let g = || out_typed(&grad, shape.clone(), stored);
        let [g_i, g_rb, g_ra, g_rt] = [g(), g(), g(), g()];
        let (producers, chunk) = stage_shape("NSACTOR_STAGE_BACKWARD", STAGE_BACKWARD);
        selective_backward_staged_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(STAGE_COLS), 1, 1),
            CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
            i.into_tensor_arg(),
            rb.into_tensor_arg(),
            ra.into_tensor_arg(),
            rt.into_tensor_arg(),
            bb.into_tensor_arg(),
            ba.into_tensor_arg(),
            bt.into_tensor_arg(),
            v0.into_tensor_arg(),
            vpost.into_tensor_arg(),
            spike.into_tensor_arg(),
            grad.into_tensor_arg(),
            g_i.clone().into_tensor_arg(),
            g_rb.clone().into_tensor_arg(),
            g_ra.clone().into_tensor_arg(),
            g_rt.clone().into_tensor_arg(),
            g_v0.clone().into_tensor_arg(),
            g_bias.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(chunk as u32),
            dn,
            chunk,
            producers,
            types,
        );
        return [g_i, g_rb, g_ra, g_rt, g_v0, g_bias];
    }
    // One unit per column (f32 only): bf16 storage is cast around it.
    let [i, rb, ra, rt, vpost, spike, grad] =
        [i, rb, ra, rt, vpost, spike, grad].map(|t| as_dtype(t, DType::F32));
    let g = || out_typed(&grad, shape.clone(), DType::F32);
    let [g_i, g_rb, g_ra, g_rt] = [g(), g(), g(), g()];
    selective_backward_kernel::launch::<R>(
        &client,
        count,
        dim,
        i.into_tensor_arg(),
        rb.into_tensor_arg(),
        ra.into_tensor_arg(),
        rt.into_tensor_arg(),
        bb.into_tensor_arg(),
        ba.into_tensor_arg(),
        bt.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        spike.into_tensor_arg(),
        grad.into_tensor_arg(),
        g_i.clone().into_tensor_arg(),
        g_rb.clone().into_tensor_arg(),
        g_ra.clone().into_tensor_arg(),
        g_rt.clone().into_tensor_arg(),
        g_v0.clone().into_tensor_arg(),
        g_bias.clone().into_tensor_arg(),
        cols,
        steps,
        dn,
        unroll(UNROLL_SELECTIVE_BACKWARD),
    );
    let [g_i, g_rb, g_ra, g_rt] = [g_i, g_rb, g_ra, g_rt].map(|t| as_dtype(t, stored));
    [g_i, g_rb, g_ra, g_rt, g_v0, g_bias]
}

/// `(producer planes, steps per chunk)` of the staged FFN-neuron kernels (forward, backward).
/// `$NSACTOR_STAGE_FFN_FORWARD` / `$NSACTOR_STAGE_FFN_BACKWARD` override them.
const STAGE_FFN_FORWARD: (usize, usize) = (8, 32);
const STAGE_FFN_BACKWARD: (usize, usize) = (8, 16);

/// The SNNFFN's gate and up neurons for training, staged: a cube holds 32 `(batch row, channel
/// j)` pairs; producer planes load the gate and up currents `i_gu[·, j]`, `i_gu[·, D_ff + j]` of
/// the next chunk, plane 0 scans both neurons and writes their `V_post` (saved for the
/// backward) and the gated product. Same arithmetic as the composition
/// ([`crate::ffn_forward_reference`]) bit for bit: `u = i·(1 − β)`, `fma(β, v, u)`, the `≥`
/// test, `(1 − β)·V_post` per neuron with `leak`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ffn_forward_staged_kernel<I: Float, O: Float>(
    i_gu: &Tensor<I>,
    w_g: &Tensor<f32>,
    w_u: &Tensor<f32>,
    th_g: &Tensor<f32>,
    th_u: &Tensor<f32>,
    v0: &Tensor<f32>,
    gv: &mut Tensor<O>,
    vpost: &mut Tensor<f32>,
    last: &mut Tensor<f32>,
    batch: u32,
    ff: u32,
    steps: u32,
    chunks: u32,
    row_stride: u32,
    #[comptime] leak: bool,
    #[comptime] save_vpost: bool,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let batch = batch as usize;
    let ff = ff as usize;
    let steps = steps as usize;
    let chunks = chunks as usize;
    let x = UNIT_POS_X as usize;
    let row_stride = row_stride as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < batch * ff;
    let cc = select(valid, c, 0);
    let b = cc / ff;
    let j = cc % ff;
    let beta_g = sigmoid_burn(w_g[j]);
    let beta_u = sigmoid_burn(w_u[j]);
    let om_g = -beta_g + 1.0f32;
    let om_u = -beta_u + 1.0f32;
    let tg = th_g[j];
    let tu = th_u[j];
    let mut s_g = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let per = comptime!(chunk / producers);
    let mut xg = Array::<f32>::new(per);
    let mut xu = Array::<f32>::new(per);
    let mut vg = v0[b * 2 * ff + j];
    let mut vu = v0[b * 2 * ff + ff + j];
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                let k0 = (ch - 1) * chunk;
                let buf = ((ch - 1) % 2) * chunk * 32;
                #[unroll]
                for q in 0..chunk {
                    let k = k0 + q;
                    if k < steps {
                        let s_idx = buf + q * 32 + x;
                        let pg = fma(beta_g, vg, s_g[s_idx] * om_g);
                        vg = pg - tg * select(pg >= tg, 1.0f32, 0.0f32);
                        let pu = fma(beta_u, vu, s_u[s_idx] * om_u);
                        vu = pu - tu * select(pu >= tu, 1.0f32, 0.0f32);
                        if valid {
                            if comptime![save_vpost] {
                                let row = (k * batch + b) * 2 * ff;
                                vpost[row + j] = vg;
                                vpost[row + ff + j] = vu;
                            }
                            let o = (k * batch + b) * ff + j;
                            if comptime![leak] {
                                gv[o] = O::cast_from((vg * om_g) * (vu * om_u));
                            } else {
                                gv[o] = O::cast_from(vg * vu);
                            }
                        }
                    }
                }
            }
        } else if ch < chunks {
            let k0 = ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let k = k0 + (y - 1) + r * producers;
                if k < steps && valid {
                    let row = (k * batch + b) * row_stride;
                    xg[r] = f32::cast_from(i_gu[row + j]);
                    xu[r] = f32::cast_from(i_gu[row + ff + j]);
                }
            }
            #[unroll]
            for r in 0..per {
                let s_idx = buf + ((y - 1) + r * producers) * 32 + x;
                s_g[s_idx] = xg[r];
                s_u[s_idx] = xu[r];
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        last[b * 2 * ff + j] = vg;
        last[b * 2 * ff + ff + j] = vu;
    }
}

/// Their backward, staged in reverse: producers compute everything of a step but the carried
/// gradients (the gating's `∂act`, `∂V_post`, the `(1 − β)·V_post` term of `∂β`, the spike
/// recomputed exactly as the forward made it, `V_{k−1}`), plane 0 runs both neurons' reverse
/// recurrences, writes `∂i = ∂u·(1 − β)` and sums per pair over time: `∂β` (the scan's
/// `Σ gv·V_{k−1}` minus `Σ ∂act·V_post` and `Σ ∂u·i`), `∂V_th`, and the carried `∂v0`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ffn_backward_staged_kernel<I: Float, G: Float>(
    i_gu: &Tensor<I>,
    w_g: &Tensor<f32>,
    w_u: &Tensor<f32>,
    th_g: &Tensor<f32>,
    th_u: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    grad: &Tensor<G>,
    d_i: &mut Tensor<I>,
    d_beta: &mut Tensor<f32>,
    d_th: &mut Tensor<f32>,
    d_v0: &mut Tensor<f32>,
    batch: u32,
    ff: u32,
    steps: u32,
    chunks: u32,
    #[comptime] leak: bool,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, G)] _types: [StorageType; 2],
) {
    let batch = batch as usize;
    let ff = ff as usize;
    let steps = steps as usize;
    let chunks = chunks as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < batch * ff;
    let cc = select(valid, c, 0);
    let b = cc / ff;
    let j = cc % ff;
    let beta_g = sigmoid_burn(w_g[j]);
    let beta_u = sigmoid_burn(w_u[j]);
    let om_g = -beta_g + 1.0f32;
    let om_u = -beta_u + 1.0f32;
    let tg = th_g[j];
    let tu = th_u[j];
    let first_g = v0[b * 2 * ff + j];
    let first_u = v0[b * 2 * ff + ff + j];
    let size = comptime!(2 * chunk * 32);
    let mut s_dvg = SharedMemory::<f32>::new(size);
    let mut s_dvu = SharedMemory::<f32>::new(size);
    let mut s_pvg = SharedMemory::<f32>::new(size);
    let mut s_pvu = SharedMemory::<f32>::new(size);
    let mut s_sg = SharedMemory::<f32>::new(size);
    let mut s_su = SharedMemory::<f32>::new(size);
    let mut s_ig = SharedMemory::<f32>::new(size);
    let mut s_iu = SharedMemory::<f32>::new(size);
    let mut s_lg = SharedMemory::<f32>::new(size);
    let mut s_lu = SharedMemory::<f32>::new(size);
    let per = comptime!(chunk / producers);
    let mut xg = Array::<f32>::new(per);
    let mut xig = Array::<f32>::new(per);
    let mut xiu = Array::<f32>::new(per);
    let mut xvg = Array::<f32>::new(per);
    let mut xvu = Array::<f32>::new(per);
    let mut xpg = Array::<f32>::new(per);
    let mut xpu = Array::<f32>::new(per);
    let mut acc_g = 0.0f32;
    let mut acc_u = 0.0f32;
    let mut sb_g = 0.0f32;
    let mut sb_u = 0.0f32;
    let mut st_g = 0.0f32;
    let mut st_u = 0.0f32;
    let mut si_g = 0.0f32;
    let mut si_u = 0.0f32;
    let mut sl_g = 0.0f32;
    let mut sl_u = 0.0f32;
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                let top = steps - (ch - 1) * chunk;
                let buf = ((ch - 1) % 2) * chunk * 32;
                #[unroll]
                for q in 0..chunk {
                    if q < top {
                        let k = top - 1 - q;
                        let s_idx = buf + q * 32 + x;
                        let gg = s_dvg[s_idx] + acc_g;
                        let gu = s_dvu[s_idx] + acc_u;
                        if valid {
                            let row = (k * batch + b) * 2 * ff;
                            d_i[row + j] = I::cast_from(gg * om_g);
                            d_i[row + ff + j] = I::cast_from(gu * om_u);
                        }
                        sb_g += gg * s_pvg[s_idx];
                        sb_u += gu * s_pvu[s_idx];
                        st_g += -gg * s_sg[s_idx];
                        st_u += -gu * s_su[s_idx];
                        si_g += gg * s_ig[s_idx];
                        si_u += gu * s_iu[s_idx];
                        sl_g += s_lg[s_idx];
                        sl_u += s_lu[s_idx];
                        acc_g = gg * beta_g;
                        acc_u = gu * beta_u;
                    }
                }
            }
        } else if ch < chunks {
            let top = steps - ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                if q < top && valid {
                    let k = top - 1 - q;
                    let row = (k * batch + b) * 2 * ff;
                    xg[r] = f32::cast_from(grad[(k * batch + b) * ff + j]);
                    xig[r] = f32::cast_from(i_gu[row + j]);
                    xiu[r] = f32::cast_from(i_gu[row + ff + j]);
                    xvg[r] = vpost[row + j];
                    xvu[r] = vpost[row + ff + j];
                    let prev = select(k > 0, row - batch * 2 * ff, 0);
                    xpg[r] = select(k > 0, vpost[prev + j], first_g);
                    xpu[r] = select(k > 0, vpost[prev + ff + j], first_u);
                }
            }
            #[unroll]
            for r in 0..per {
                let s_idx = buf + ((y - 1) + r * producers) * 32 + x;
                let vg = xvg[r];
                let vu = xvu[r];
                let mut act_g = vg;
                let mut act_u = vu;
                if comptime![leak] {
                    act_g = vg * om_g;
                    act_u = vu * om_u;
                }
                let da_g = xg[r] * act_u;
                let da_u = xg[r] * act_g;
                if comptime![leak] {
                    s_dvg[s_idx] = da_g * om_g;
                    s_dvu[s_idx] = da_u * om_u;
                    s_lg[s_idx] = da_g * vg;
                    s_lu[s_idx] = da_u * vu;
                } else {
                    s_dvg[s_idx] = da_g;
                    s_dvu[s_idx] = da_u;
                    s_lg[s_idx] = 0.0f32;
                    s_lu[s_idx] = 0.0f32;
                }
                let ig = xig[r];
                let iu = xiu[r];
                s_ig[s_idx] = ig;
                s_iu[s_idx] = iu;
                s_pvg[s_idx] = xpg[r];
                s_pvu[s_idx] = xpu[r];
                s_sg[s_idx] = select(fma(beta_g, xpg[r], ig * om_g) >= tg, 1.0f32, 0.0f32);
                s_su[s_idx] = select(fma(beta_u, xpu[r], iu * om_u) >= tu, 1.0f32, 0.0f32);
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        let o = b * 2 * ff + j;
        d_beta[o] = sb_g - sl_g - si_g;
        d_beta[o + ff] = sb_u - sl_u - si_u;
        d_th[o] = st_g;
        d_th[o + ff] = st_u;
        d_v0[o] = acc_g;
        d_v0[o + ff] = acc_u;
    }
}

/// `(batch, D_ff, steps)` of the FFN neurons' `i_gu` `[TK, B, 2·D_ff]`, checked.
fn ffn_geometry<R: CubeRuntime>(i_gu: &CubeTensor<R>) -> (usize, usize, usize) {
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

/// Forward of the FFN neurons for training: `(g·v [TK, B, D_ff], V_post [TK, B, 2·D_ff])`.
/// `params`: `w_gate, w_up, th_gate, th_up` `[D_ff]`; `v0` `[B, 2·D_ff]`.
pub fn ffn_forward<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (batch, ff, steps) = ffn_geometry(&i_gu);
    let i_gu = into_contiguous(i_gu);
    let geometry = (steps, batch, ff, 2 * ff);
    let (gv, vpost, _) = ffn_forward_with(i_gu, params, v0, leak, true, geometry);
    (gv, vpost)
}

/// The same for inference: `(g·v, final state [B, 2·D_ff])`, `V_post` not written. `i_gu` is
/// `[TK, B, 2·D_ff]`, or a 2-D `[TK·B, W ≥ 2·D_ff]` with contiguous columns whose first
/// 2·D_ff columns are the currents (a column slice of a wider projection, read in place).
pub fn ffn_infer<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let shape = i_gu.meta.shape().clone();
    if shape.num_dims() == 2 {
        let batch = v0.meta.shape()[0];
        let ff = params[0].meta.shape()[0];
        assert!(
            batch > 0 && shape[0].is_multiple_of(batch) && shape[1] >= 2 * ff,
            "ffn neurons: i_gu {shape:?} is not [TK·{batch}, ≥ {}]",
            2 * ff
        );
        let i_gu = if i_gu.meta.strides()[1] == 1 {
            i_gu
        } else {
            into_contiguous(i_gu)
        };
        let row_stride = i_gu.meta.strides()[0].max(shape[1]);
        let geometry = (shape[0] / batch, batch, ff, row_stride);
        let (gv, _, last) = ffn_forward_with(i_gu, params, v0, leak, false, geometry);
        return (gv, last);
    }
    let (batch, ff, steps) = ffn_geometry(&i_gu);
    let i_gu = into_contiguous(i_gu);
    let geometry = (steps, batch, ff, 2 * ff);
    let (gv, _, last) = ffn_forward_with(i_gu, params, v0, leak, false, geometry);
    (gv, last)
}

/// `(g·v, V_post (empty unless save_vpost), final state)` for an `i_gu` of `steps·batch` rows
/// of `row_stride` values each, the first `2·ff` of them the currents (`geometry`: steps,
/// batch, ff, row_stride).
fn ffn_forward_with<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    leak: bool,
    save_vpost: bool,
    (steps, batch, ff, row_stride): (usize, usize, usize, usize),
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let [w_g, w_u, th_g, th_u] = params;
    check_f32(&[&w_g, &w_u, &th_g, &th_u, &v0]);
    let stored = stored_dtype(&i_gu);
    assert!(
        steps * batch * row_stride <= u32::MAX as usize,
        "ffn neurons: {steps}×{batch}×{row_stride} elements exceed 32-bit indexing"
    );
    let [w_g, w_u, th_g, th_u, v0] = [w_g, w_u, th_g, th_u, v0].map(into_contiguous);
    // Inference writes g·v in the type the down projection's GEMM reads; training stores it
    // like the currents (bf16 storage: bf16), `V_post` (which the backward's exact spike
    // recomputation reads) and the state always f32.
    let gv_dtype = if save_vpost {
        stored
    } else {
        crate::cuda_gemm::input_dtype()
    };
    let gv = out_typed(&i_gu, Shape::new([steps, batch, ff]), gv_dtype);
    let vpost = out_typed(
        &i_gu,
        Shape::new(if save_vpost {
            [steps, batch, 2 * ff]
        } else {
            [1, 1, 1]
        }),
        DType::F32,
    );
    let last = out_typed(&i_gu, Shape::new([batch, 2 * ff]), DType::F32);
    let (producers, chunk) = stage_shape("NSACTOR_STAGE_FFN_FORWARD", STAGE_FFN_FORWARD);
    let client = i_gu.client.clone();
    ffn_forward_staged_kernel::launch::<R>(
        &client,
        CubeCount::Static((batch * ff).div_ceil(STAGE_COLS as usize) as u32, 1, 1),
        CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
        i_gu.into_tensor_arg(),
        w_g.into_tensor_arg(),
        w_u.into_tensor_arg(),
        th_g.into_tensor_arg(),
        th_u.into_tensor_arg(),
        v0.into_tensor_arg(),
        gv.clone().into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        batch as u32,
        ff as u32,
        steps as u32,
        steps.div_ceil(chunk) as u32,
        row_stride as u32,
        leak,
        save_vpost,
        chunk,
        producers,
        [stored.into(), gv_dtype.into()],
    );
    (gv, vpost, last)
}

/// Backward of the FFN neurons: `[∂i_gu [TK, B, 2·D_ff], ∂β, ∂V_th, ∂v0]`, the last three
/// `[B, 2·D_ff]` (per batch row; [`crate::ffn_param_grads`] sums them and applies σ′).
pub fn ffn_backward<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    vpost: CubeTensor<R>,
    grad: CubeTensor<R>,
    leak: bool,
) -> [CubeTensor<R>; 4] {
    let [w_g, w_u, th_g, th_u] = params;
    check_f32(&[&w_g, &w_u, &th_g, &th_u, &v0, &vpost]);
    let types = [stored_dtype(&i_gu).into(), stored_dtype(&grad).into()];
    let (batch, ff, steps) = ffn_geometry(&i_gu);
    let [i_gu, w_g, w_u, th_g, th_u, v0, vpost, grad] =
        [i_gu, w_g, w_u, th_g, th_u, v0, vpost, grad].map(into_contiguous);
    let state = Shape::new([batch, 2 * ff]);
    // ∂i_gu in i_gu's type; the parameter and state gradients f32.
    let d_i = out_like(&i_gu, Shape::new([steps, batch, 2 * ff]));
    let d_beta = out_typed(&i_gu, state.clone(), DType::F32);
    let d_th = out_typed(&i_gu, state.clone(), DType::F32);
    let d_v0 = out_typed(&i_gu, state, DType::F32);
    let (producers, chunk) = stage_shape("NSACTOR_STAGE_FFN_BACKWARD", STAGE_FFN_BACKWARD);
    let client = i_gu.client.clone();
    ffn_backward_staged_kernel::launch::<R>(
        &client,
        CubeCount::Static((batch * ff).div_ceil(STAGE_COLS as usize) as u32, 1, 1),
        CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
        i_gu.into_tensor_arg(),
        w_g.into_tensor_arg(),
        w_u.into_tensor_arg(),
        th_g.into_tensor_arg(),
        th_u.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        grad.into_tensor_arg(),
        d_i.clone().into_tensor_arg(),
        d_beta.clone().into_tensor_arg(),
        d_th.clone().into_tensor_arg(),
        d_v0.clone().into_tensor_arg(),
        batch as u32,
        ff as u32,
        steps as u32,
        steps.div_ceil(chunk) as u32,
        leak,
        chunk,
        producers,
        types,
    );
    [d_i, d_beta, d_th, d_v0]
}
