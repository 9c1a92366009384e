//! The PLIF scans as CubeCL kernels: one unit per column (a flattened `(batch, dim)` index)
//! walks the `TK` steps in order, holding the membrane in a register. Loads of step `k + 1`
//! do not depend on the state, so the hardware keeps them in flight while the recurrence runs;
//! consecutive units read consecutive columns, so every load and store is coalesced. That runs
//! the per-element scans, and the row-parameter forward below 8,192 columns (every row scan
//! with `$NSACTOR_ROW_SCAN=per-unit`).
//!
//! The row-parameter scans have too few columns for that alone (21,504 at the 0.9B's FFN): the
//! staged kernels split the work instead. In a cube of 32 columns, producer planes load the
//! next chunk of steps into shared memory while one plane runs the recurrence over the current
//! chunk from it; one barrier per chunk swaps the two buffers. They compute the same values as
//! the per-unit kernels, bit for bit in the forward.
//!
//! Same recurrence as [`crate::reference`], term for term: `v_pre = fma(β, v, u)`, the `≥`
//! test, `v = v_pre − V_th·s` (exact, `s` is 0 or 1), `f32` state; the backward pass keeps
//! `acc = gV·β` as its own rounded product like the reference.

use crate::cuda::common::{STAGE_COLS, check_f32, out_like, stage_shape};
use crate::cuda::plif::{plif, plif_reverse};
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Steps whose loads are issued together before their recurrence runs: the loads do not
/// depend on the membrane, so reading that many steps ahead keeps that many requests per unit
/// in flight instead of one. Measured on the H100 at the 0.9B shapes: the forward kernels gain
/// up to 32; the backward kernels hold four such buffers, the per-element one is fastest at 16
/// and the row one at 8. The `scan_unroll` knob (`NSACTOR_SCAN_UNROLL`) overrides them all.
const UNROLL_FORWARD: usize = 32;
const UNROLL_BACKWARD_ELEM: usize = 16;
const UNROLL_BACKWARD_ROW: usize = 8;

/// The steps issued together: the `scan_unroll` knob (`NSACTOR_SCAN_UNROLL`, capped at 64), or
/// the kernel's `default`.
pub(crate) fn unroll(default: usize) -> usize {
    crate::tuning::current()
        .scan_unroll
        .unwrap_or(default)
        .min(64)
}

/// Units per cube: the `scan_cube` knob (`NSACTOR_SCAN_CUBE`), 32 by default. Small cubes
/// spread the few thousand columns over every SM evenly (at the 0.9B shapes 21,504–28,672
/// units: 128-unit cubes would leave a third of the SMs with one cube and the rest with two).
fn cube() -> u32 {
    crate::tuning::current().scan_cube as u32
}

/// `(producer planes, steps per chunk)` of the staged row-parameter kernels.
/// The `stage_row_forward` / `stage_row_backward` knobs (`NSACTOR_STAGE_ROW_FORWARD` /
/// `NSACTOR_STAGE_ROW_BACKWARD`) override them. Measured on the
/// H100 at T·K = 8176 and 21,504 columns (forward / backward ms): 8×64 / 8×32 0.89 / 1.89,
/// 4×32 / 4×64 0.97 / 1.50, 16×64 / 16×64 1.50 / 1.61, 8×128 / 8×16 1.60 / 1.21; one unit per
/// column 0.97 / 1.54.
const STAGE_ROW_FORWARD: (usize, usize) = (8, 64);
const STAGE_ROW_BACKWARD: (usize, usize) = (8, 16);

/// Below this many columns the row forward keeps one unit per column: at the input neurons'
/// 3,584 columns it took 0.50 ms against 0.63 staged (112 cubes leave a fifth of the SMs idle
/// and the rest with one scanning plane), while the backward still gained (1.11 → 0.76 ms).
const STAGE_ROW_FORWARD_MIN_COLS: u32 = 8192;

/// Whether the row-parameter scans run staged; the `row_scan` knob `per-unit`
/// (`NSACTOR_ROW_SCAN=per-unit`) selects one unit per column, for comparison.
fn staged_rows() -> bool {
    crate::tuning::current().staged_row_scan
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
            let f = plif(b, v, uu[j], th);
            v = f.v;
            spike[i] = f.spike;
            vpost[i] = v;
        }
        k0 += unroll;
    }
    for k in k0..steps {
        let i = k * cols + c;
        let b = select(row, b_row, beta[select(row, c, i)]);
        let th = select(row, th_row, vth[select(row, c, i)]);
        let f = plif(b, v, u[i], th);
        v = f.v;
        spike[i] = f.spike;
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
            let b = select(row, b_row, bb[j]);
            let r = plif_reverse(gg[j], acc, b, vp[j], ss[j]);
            g_u[i] = r.gv;
            if comptime![row] {
                sum_beta += r.g_beta;
                sum_vth += r.g_th;
            } else {
                g_beta[i] = r.g_beta;
                g_vth[i] = r.g_th;
            }
            acc = r.acc;
        }
        end = base;
    }
    while end > 0 {
        end -= 1;
        let k = end;
        let i = k * cols + c;
        let v_prev = select(k > 0, vpost[select(k > 0, i - cols, c)], v_first);
        let b = select(row, b_row, beta[select(row, c, i)]);
        let r = plif_reverse(grad[i], acc, b, v_prev, spike[i]);
        g_u[i] = r.gv;
        if comptime![row] {
            sum_beta += r.g_beta;
            sum_vth += r.g_th;
        } else {
            g_beta[i] = r.g_beta;
            g_vth[i] = r.g_th;
        }
        acc = r.acc;
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
                        let f = plif(b, v, s_u[buf + q * 32 + x], th);
                        v = f.v;
                        if valid {
                            let idx = k * cols + c;
                            spike[idx] = f.spike;
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
                        let r = plif_reverse(s_g[s_idx], acc, b_row, s_v[s_idx], s_s[s_idx]);
                        if valid {
                            g_u[k * cols + c] = r.gv;
                        }
                        sum_beta += r.g_beta;
                        sum_vth += r.g_th;
                        acc = r.acc;
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

/// `(steps, cols)` of a `[TK, B, dim]` sequence, as kernel arguments.
pub(crate) fn geometry<R: CubeRuntime>(
    seq: &CubeTensor<R>,
) -> (Shape, u32, u32, CubeCount, CubeDim) {
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
        let (producers, chunk) = stage_shape(
            crate::tuning::current().stage_row_forward,
            STAGE_ROW_FORWARD,
        );
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
        let (producers, chunk) = stage_shape(
            crate::tuning::current().stage_row_backward,
            STAGE_ROW_BACKWARD,
        );
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
