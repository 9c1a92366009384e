//! PonderNet halting and aggregation as one CubeCL kernel, for inference (no backward): one
//! plane of 32 units per `(token, batch row)` computes the K halting logits (dot products with
//! the halt weight, reduced across the plane), the geometric halting distribution and E[K], and
//! the weighted sum of the K frames. The composed version ([`SnnOps::ponder_agg_fused`]'s
//! callers fall back to it) is ≈ 50 tensor ops; on a decoding step every op costs ≈ 11 µs of
//! host time, so this one launch replaces ≈ 0.5 ms per sublayer.
//!
//! [`SnnOps::ponder_agg_fused`]: crate::SnnOps::ponder_agg_fused

use crate::cuda_scan::{out_like, sigmoid_burn};
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube: one plane.
const PLANE: u32 = 32;

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ponder_agg_kernel(
    frames: &Tensor<f32>,
    w: &Tensor<f32>,
    bias: &Tensor<f32>,
    agg: &mut Tensor<f32>,
    ek: &mut Tensor<f32>,
    batch: u32,
    dim: u32,
    halt_clamp: f32,
    norm_eps: f32,
    #[comptime] k: usize,
) {
    let batch = batch as usize;
    let dim = dim as usize;
    let row = CUBE_POS;
    let t = row / batch;
    let b = row % batch;
    let lane = UNIT_POS as usize;
    let mut part = Array::<f32>::new(k);
    #[unroll]
    for j in 0..k {
        part[j] = 0.0f32;
    }
    let mut d = lane;
    while d < dim {
        let wd = w[d];
        #[unroll]
        for j in 0..k {
            part[j] += frames[((t * k + j) * batch + b) * dim + d] * wd;
        }
        d += 32usize;
    }
    let bb = bias[0];
    let mut lam = Array::<f32>::new(k);
    // λ_j = p_j · Π_{i<j}(1 − p_i), the product as exp of the running Σ log(1 − p_i).
    let mut log_survive = 0.0f32;
    let mut total = 0.0f32;
    #[unroll]
    for j in 0..k {
        let logit = plane_sum(part[j]) + bb;
        let p = clamp(sigmoid_burn(logit), halt_clamp, 1.0f32 - halt_clamp);
        let l = p * log_survive.exp();
        lam[j] = l;
        total += l;
        log_survive += (-p).log1p();
    }
    let norm = total + norm_eps;
    let mut e = 0.0f32;
    let mut step = 0.0f32;
    #[unroll]
    for j in 0..k {
        step += 1.0f32;
        lam[j] = lam[j] / norm;
        e += lam[j] * step;
    }
    if lane == 0 {
        ek[row] = e;
    }
    let mut d = lane;
    while d < dim {
        let mut acc = 0.0f32;
        #[unroll]
        for j in 0..k {
            acc += frames[((t * k + j) * batch + b) * dim + d] * lam[j];
        }
        agg[row * dim + d] = acc;
        d += 32usize;
    }
}

/// `frames` `[T·K, B, D]`, halt weight `w` `[D]`, bias `[1]` → aggregate `[T, B, D]` and E[K]
/// `[T, B]` (SPEC §2.3: σ, clamp to `[c, 1 − c]`, λ normalised by `Σλ + eps`).
pub fn ponder_agg<R: CubeRuntime>(
    frames: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    k: usize,
    halt_clamp: f32,
    norm_eps: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    for x in [&frames, &w, &bias] {
        assert_eq!(x.dtype, burn::tensor::DType::F32, "ponder_agg takes f32");
    }
    let shape = frames.meta.shape().clone();
    assert_eq!(shape.num_dims(), 3, "ponder_agg: frames [T·K, B, D]");
    let (tk, batch, dim) = (shape[0], shape[1], shape[2]);
    assert!(
        k > 0 && tk % k == 0,
        "ponder_agg: {tk} frames are not whole tokens of K = {k}"
    );
    assert!(
        tk * batch * dim <= u32::MAX as usize,
        "ponder_agg: 32-bit indexing"
    );
    let t = tk / k;
    let [frames, w, bias] = [frames, w, bias].map(into_contiguous);
    let agg = out_like(&frames, Shape::new([t, batch, dim]));
    let ek = out_like(&frames, Shape::new([t, batch]));
    let client = frames.client.clone();
    ponder_agg_kernel::launch::<R>(
        &client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        frames.into_tensor_arg(),
        w.into_tensor_arg(),
        bias.into_tensor_arg(),
        agg.clone().into_tensor_arg(),
        ek.clone().into_tensor_arg(),
        batch as u32,
        dim as u32,
        halt_clamp,
        norm_eps,
        k,
    );
    (agg, ek)
}
