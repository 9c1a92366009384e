//! The optimizer's update as one CubeCL kernel: Adam (or AdamW) over a flat f32 parameter,
//! reading `p`, `g`, `m`, `v` once and writing the new `p`, `m`, `v` once (28 bytes per
//! parameter) where the composition makes a dozen passes. The same operations in the same order
//! as [`crate::reference::optim::adam`], each scalar rounded to f32 as the tensor ops round it;
//! the compiler may contract a multiply and an add into one rounding, so results may differ from
//! the composition in the last bits (`bench kernels` reports by how much).

use crate::cuda::common::out_like;
use crate::ops::types::AdamStep;
use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// How the weight decay enters: none, AdamW's shrinking of `p`, or Adam's `wd·p` in the gradient.
const DECAY_NONE: u32 = 0;
const DECAY_DECOUPLED: u32 = 1;
const DECAY_L2: u32 = 2;

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn adam_kernel(
    p: &Tensor<f32>,
    g: &Tensor<f32>,
    m: &Tensor<f32>,
    v: &Tensor<f32>,
    p_out: &mut Tensor<f32>,
    m_out: &mut Tensor<f32>,
    v_out: &mut Tensor<f32>,
    n: u32,
    decay_mode: u32,
    decay: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    sqrt_bc2: f32,
    eps: f32,
    step_size: f32,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let mut pi = p[i];
    let mut gi = g[i];
    if decay_mode == 1u32 {
        pi *= decay;
    }
    if decay_mode == 2u32 {
        gi += pi * decay;
    }
    let mi = m[i] * beta1 + gi * one_minus_beta1;
    let vi = v[i] * beta2 + gi * gi * one_minus_beta2;
    let denom = vi.sqrt() / sqrt_bc2 + eps;
    p_out[i] = pi - mi / denom * step_size;
    m_out[i] = mi;
    v_out[i] = vi;
}

/// `(p, exp_avg, exp_avg_sq)` after one update (see [`adam_kernel`]); every tensor `[n]`, f32.
pub fn adam<R: CubeRuntime>(
    p: CubeTensor<R>,
    g: CubeTensor<R>,
    m: CubeTensor<R>,
    v: CubeTensor<R>,
    s: &AdamStep,
) -> [CubeTensor<R>; 3] {
    let [p, g, m, v] = [p, g, m, v].map(into_contiguous);
    let shape = p.meta.shape().clone();
    for t in [&p, &g, &m, &v] {
        assert_eq!(t.dtype, DType::F32, "adam takes f32");
        assert_eq!(t.meta.shape(), &shape, "adam: p, g, m, v differ in shape");
    }
    let n = shape.num_elements();
    assert!(n <= u32::MAX as usize, "adam: 32-bit indexing");
    let outs = [&p, &m, &v].map(|t| out_like(t, shape.clone()));
    if n == 0 {
        return outs;
    }
    let (mode, decay) = match (s.wd != 0.0, s.decoupled) {
        (false, _) => (DECAY_NONE, 1.0),
        (true, true) => (DECAY_DECOUPLED, (1.0 - s.lr * s.wd) as f32),
        (true, false) => (DECAY_L2, s.wd as f32),
    };
    let bc1 = 1.0 - s.beta1.powi(s.step);
    let bc2 = 1.0 - s.beta2.powi(s.step);
    let client = p.client.clone();
    adam_kernel::launch::<R>(
        &client,
        CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
        CubeDim::new_1d(256),
        p.into_tensor_arg(),
        g.into_tensor_arg(),
        m.into_tensor_arg(),
        v.into_tensor_arg(),
        outs[0].clone().into_tensor_arg(),
        outs[1].clone().into_tensor_arg(),
        outs[2].clone().into_tensor_arg(),
        n as u32,
        mode,
        decay,
        s.beta1 as f32,
        (1.0 - s.beta1) as f32,
        s.beta2 as f32,
        (1.0 - s.beta2) as f32,
        bc2.sqrt() as f32,
        s.eps as f32,
        (s.lr / bc1) as f32,
    );
    outs
}
