//! The PLIF scans as CubeCL kernels: one unit per column (a flattened `(batch, dim)` index)
//! walks the `TK` steps in order, holding the membrane in a register. Loads of step `k + 1`
//! do not depend on the state, so the hardware keeps them in flight while the recurrence runs;
//! consecutive units read consecutive columns, so every load and store is coalesced.
//!
//! Same recurrence as [`crate::reference`], term for term: `v_pre = fma(β, v, u)`, the `≥`
//! test, `v = v_pre − V_th·s` (exact, `s` is 0 or 1), `f32` state; the backward pass keeps
//! `acc = gV·β` as its own rounded product like the reference.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
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

fn out_like<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
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
