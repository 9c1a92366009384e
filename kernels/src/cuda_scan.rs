//! The PLIF scans as CubeCL kernels: one unit per column (a flattened `(batch, dim)` index)
//! walks the `TK` steps in order, holding the membrane in a register. Loads of step `k + 1`
//! do not depend on the state, so the hardware keeps them in flight while the recurrence runs;
//! consecutive units read consecutive columns, so every load and store is coalesced.
//!
//! Same recurrence as [`crate::reference`], term for term: `v_pre = fma(β, v, u)`, the `≥`
//! test, `v = v_pre − V_th·s` (exact, `s` is 0 or 1), `f32` state; the backward pass keeps
//! `acc = gV·β` as its own rounded product like the reference.

use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn::tensor::Shape;
use cubecl::prelude::*;

/// Units per cube.
const CUBE: u32 = 128;

#[cube(launch)]
fn elem_forward_kernel(
    beta: &Tensor<f32>,
    u: &Tensor<f32>,
    vth: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let mut v = v0[c];
    for k in 0..steps {
        let i = k * cols + c;
        let th = vth[i];
        let v_pre = fma(beta[i], v, u[i]);
        let s = select(v_pre >= th, 1.0f32, 0.0f32);
        v = v_pre - th * s;
        spike[i] = s;
        vpost[i] = v;
    }
}

#[cube(launch)]
fn row_forward_kernel(
    beta: &Tensor<f32>,
    u: &Tensor<f32>,
    vth: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = beta[c];
    let th = vth[c];
    let mut v = v0[c];
    for k in 0..steps {
        let i = k * cols + c;
        let v_pre = fma(b, v, u[i]);
        let s = select(v_pre >= th, 1.0f32, 0.0f32);
        v = v_pre - th * s;
        spike[i] = s;
        vpost[i] = v;
    }
}

/// Reverse loop of SPEC §6.1 with the per-step β and V_th gradients stored.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn elem_backward_kernel(
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
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let mut acc = 0.0f32;
    let mut k = steps;
    while k > 0 {
        k -= 1;
        let i = k * cols + c;
        let v_prev = select(k > 0, vpost[select(k > 0, i - cols, c)], v0[c]);
        let gv = grad[i] + acc;
        g_u[i] = gv;
        g_beta[i] = gv * v_prev;
        g_vth[i] = -gv * spike[i];
        acc = gv * beta[i];
    }
    g_v0[c] = acc;
}

/// Row-parameter reverse loop: the β and V_th gradients summed over time in registers.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn row_backward_kernel(
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
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = beta[c];
    let mut acc = 0.0f32;
    let mut sum_beta = 0.0f32;
    let mut sum_vth = 0.0f32;
    let mut k = steps;
    while k > 0 {
        k -= 1;
        let i = k * cols + c;
        let v_prev = select(k > 0, vpost[select(k > 0, i - cols, c)], v0[c]);
        let gv = grad[i] + acc;
        g_u[i] = gv;
        sum_beta += gv * v_prev;
        sum_vth += -gv * spike[i];
        acc = gv * b;
    }
    g_beta[c] = sum_beta;
    g_vth[c] = sum_vth;
    g_v0[c] = acc;
}

fn out_like<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

/// `(steps, cols)` of a `[TK, B, dim]` sequence, as kernel arguments.
fn geometry<R: CubeRuntime>(seq: &CubeTensor<R>) -> (Shape, u32, u32, CubeCount, CubeDim) {
    let shape = seq.meta.shape().clone();
    assert_eq!(shape.num_dims(), 3, "PLIF scan: [TK, B, dim] expected, got {shape:?}");
    let cols = shape[1] * shape[2];
    let steps = shape[0];
    assert!(
        (steps * cols) <= u32::MAX as usize,
        "PLIF scan: {steps}×{cols} elements exceed 32-bit indexing"
    );
    let cubes = cols.div_ceil(CUBE as usize) as u32;
    (
        shape,
        steps as u32,
        cols as u32,
        CubeCount::Static(cubes, 1, 1),
        CubeDim::new_1d(CUBE),
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

/// Per-element forward: `(spike, vpost)`.
pub fn elem_forward<R: CubeRuntime>(
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
    elem_forward_kernel::launch::<R>(
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
    );
    (spike, vpost)
}

/// Row-parameter forward: `(spike, vpost)`.
pub fn row_forward<R: CubeRuntime>(
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
    row_forward_kernel::launch::<R>(
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
    let args = (
        beta.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        spike.into_tensor_arg(),
        grad.into_tensor_arg(),
        g_beta.clone().into_tensor_arg(),
        g_u.clone().into_tensor_arg(),
        g_vth.clone().into_tensor_arg(),
        g_v0.clone().into_tensor_arg(),
    );
    if row {
        row_backward_kernel::launch::<R>(
            &client, count, dim, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7,
            args.8, cols, steps,
        );
    } else {
        elem_backward_kernel::launch::<R>(
            &client, count, dim, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7,
            args.8, cols, steps,
        );
    }
    [g_beta, g_u, g_vth, g_v0]
}
