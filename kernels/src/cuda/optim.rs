//! The optimizer's kernels. The update as one CubeCL kernel: Adam (or AdamW) over a flat f32
//! parameter, its gradient scaled by the clip, reading `p`, `g`, `m`, `v` once and writing the
//! new `p`, `m`, `v` once (28 bytes per parameter) where the composition makes a dozen passes. The same operations in the same order
//! as [`crate::reference::optim::adam`], each scalar rounded to f32 as the tensor ops round it;
//! the compiler may contract a multiply and an add into one rounding, so results may differ from
//! the composition in the last bits (`bench kernels` reports by how much). And the gradients'
//! sums of squares ([`square_sums`]): per gradient one launch of [`SLOTS`] cubes that each
//! leave a partial sum, then one launch that adds each gradient's partials in a fixed order, so
//! the sums are the same from run to run.

use crate::cuda::common::out_like;
use crate::ops::types::AdamStep;
use burn::tensor::{DType, Shape};
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
    grad_scale: f32,
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
    let mut gi = g[i] * grad_scale;
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
        s.grad_scale as f32,
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

/// Partial sums (cubes) per gradient of [`square_sums`]: enough cubes of 256 units to keep every
/// SM of an H100 loading (128 cubes reached 11% of copy bandwidth over a layer's gradients).
const SLOTS: usize = 1024;
/// Planes of 32 units per cube of [`square_sums`]' first pass.
const PLANES: usize = 8;

/// Cube `c` of the launch sums `t[i]²` over `i ≡ c·width + unit (mod stride)` and writes the
/// sum to `partials[slot0 + c]`.
#[cube(launch)]
fn square_partials_kernel(
    t: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    n: u32,
    slot0: u32,
    stride: u32,
    #[comptime] planes: usize,
) {
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut acc = 0.0f32;
    let mut i = CUBE_POS * width + lane;
    while i < n as usize {
        let x = t[i];
        acc += x * x;
        i += stride as usize;
    }
    let mut shared = SharedMemory::<f32>::new(planes);
    let s = plane_sum(acc);
    if UNIT_POS_PLANE == 0 {
        shared[lane / 32] = s;
    }
    sync_cube();
    if lane == 0 {
        let mut total = 0.0f32;
        #[unroll]
        for p in 0..planes {
            total += shared[p];
        }
        partials[slot0 as usize + CUBE_POS] = total;
    }
}

/// `out[k] = Σ_s partials[k·slots + s]`, one cube per gradient `k`: each unit sums the slots
/// `s ≡ unit (mod width)` in order, then the units' sums are added as a tree (a fixed order).
#[cube(launch)]
fn sum_slots_kernel(
    partials: &Tensor<f32>,
    out: &mut Tensor<f32>,
    slots: u32,
    #[comptime] planes: usize,
) {
    let k = CUBE_POS;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let base = k * slots as usize;
    let mut acc = 0.0f32;
    let mut s = lane;
    while s < slots as usize {
        acc += partials[base + s];
        s += width;
    }
    let mut shared = SharedMemory::<f32>::new(planes);
    let t = plane_sum(acc);
    if UNIT_POS_PLANE == 0 {
        shared[lane / 32] = t;
    }
    sync_cube();
    if lane == 0 {
        let mut total = 0.0f32;
        #[unroll]
        for p in 0..planes {
            total += shared[p];
        }
        out[k] = total;
    }
}

/// `Σ t²` of each of `ts` (flat f32, at least one) as a `[ts.len()]` tensor.
pub fn square_sums<R: CubeRuntime>(ts: Vec<CubeTensor<R>>) -> CubeTensor<R> {
    assert!(!ts.is_empty(), "square_sums of no tensors");
    let ts: Vec<_> = ts.into_iter().map(into_contiguous).collect();
    let Some(live) = ts.iter().find(|t| t.meta.shape().num_elements() > 0) else {
        let t = &ts[0];
        return burn_cubecl::ops::numeric::zeros_client(
            t.client.clone(),
            t.device.clone(),
            Shape::new([ts.len()]),
            DType::F32,
        );
    };
    let partials = out_like(&ts[0], Shape::new([ts.len() * SLOTS]));
    let client = ts[0].client.clone();
    let width = PLANES * 32;
    for (k, t) in ts.iter().enumerate() {
        assert_eq!(t.dtype, DType::F32, "square_sums takes f32");
        let n = t.meta.shape().num_elements();
        assert!(n <= u32::MAX as usize, "square_sums: 32-bit indexing");
        square_partials_kernel::launch::<R>(
            &client,
            CubeCount::Static(SLOTS as u32, 1, 1),
            CubeDim::new_1d(width as u32),
            // An empty gradient binds a live buffer (an empty one is an invalid launch
            // argument) and, with `n = 0`, reads none of it: its partials are zeros.
            match n {
                0 => live.clone(),
                _ => t.clone(),
            }
            .into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            n as u32,
            (k * SLOTS) as u32,
            (SLOTS * width) as u32,
            PLANES,
        );
    }
    let out = out_like(&ts[0], Shape::new([ts.len()]));
    sum_slots_kernel::launch::<R>(
        &client,
        CubeCount::Static(ts.len() as u32, 1, 1),
        CubeDim::new_1d(width as u32),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        SLOTS as u32,
        PLANES,
    );
    out
}
