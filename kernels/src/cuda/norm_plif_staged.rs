//! RMSNorm + the input PLIF for training and prefill, staged by tokens: the forward (the rows
//! path, where `1/RMS` comes from its own kernel, also here) and the backward; and what
//! [`super::norm_plif`]'s launcher shares with them (geometry, cube width).
//!
//! The neuron's recurrence runs one unit per `(batch row, channel)`: only `B·D` units (12,544
//! at 14 × 511 of the 0.9B, three planes an SM), each walking every token. One token's loads at
//! a time left each unit waiting out a memory round trip per token: the forward at 21 % and
//! the backward at 8 % of copy bandwidth. Here each unit loads the next group of tokens while
//! it computes the current one (`NSACTOR_NORM_PLIF_PREFETCH`, forward × backward tokens a
//! group); the arithmetic is unchanged, op for op.

use crate::cuda::common::{
    PLANE, check_norm_plif_params, launch_guarded, out_like, sigmoid_burn, stored_dtype,
};
use crate::cuda::plif::{plif_reverse, plif_step, spike_of};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube of the input neuron's kernels: a few thousand columns (3,584 at the 0.9B
/// shape) spread over the SMs one plane each.
pub(crate) const NORM_PLIF_CUBE: u32 = 32;

/// `1/√(mean_D(x²) + eps)` of every `(token, batch row)`: one plane per row.
#[cube(launch, launch_unchecked)]
fn rms_inv_kernel(x: &Tensor<f32>, r: &mut Tensor<f32>, dim: u32, eps: f32) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let mut ss = 0.0f32;
    let mut d = lane;
    while d < dim {
        let v = x[row * dim + d];
        ss += v * v;
        d += 32usize;
    }
    let total = plane_sum(ss);
    if lane == 0 {
        r[row] = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
    }
}

/// `1/√(mean_D(x²) + eps)` per token row `[T, B]` of a contiguous `x`.
pub(crate) fn rms_inv<R: CubeRuntime>(
    x: &CubeTensor<R>,
    t: usize,
    batch: usize,
    dim: usize,
    eps: f32,
) -> CubeTensor<R> {
    let r = out_like(x, Shape::new([t, batch]));
    // SAFETY: one cube per row of `x` `[T·B, D]` (the caller asserted its shape), lanes below `D`.
    launch_guarded!(rms_inv_kernel::<R>(
        &x.client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        x.clone().into_tensor_arg(),
        r.clone().into_tensor_arg(),
        dim as u32,
        eps,
    ));
    r
}

/// `(T, B, D)` of `x` `[T, B, D]`, every tensor checked f32.
pub(crate) fn norm_plif_geometry<R: CubeRuntime>(
    tensors: &[&CubeTensor<R>],
    k: usize,
) -> (usize, usize, usize) {
    for t in tensors {
        assert_eq!(t.dtype, burn::tensor::DType::F32, "norm_plif takes f32");
    }
    let shape = tensors[0].meta.shape();
    assert_eq!(shape.num_dims(), 3, "norm_plif: x [T, B, D]");
    let (t, batch, dim) = (shape[0], shape[1], shape[2]);
    assert!(
        k > 0 && t * k * batch * dim <= u32::MAX as usize,
        "norm_plif: 32-bit indexing"
    );
    (t, batch, dim)
}

/// Tokens a group, `(forward, backward)`: the `norm_plif_prefetch` knob
/// (`NSACTOR_NORM_PLIF_PREFETCH`, `FxB`, each 1–16; 8 × 2 by default).
pub(crate) fn prefetch() -> (usize, usize) {
    crate::tuning::current().norm_plif_prefetch
}

/// The forward's rows path of `norm_plif_kernel` (`1/RMS` read from `r`), a group of `group`
/// tokens' `x` and `1/RMS` loaded while the previous group is computed.
// `div_ceil` spelled out: plain arithmetic in the kernel.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
#[cube(launch, launch_unchecked)]
pub(crate) fn norm_plif_staged_kernel<O: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    y: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] save_vpost: bool,
    #[comptime] mean_frames: bool,
    #[comptime] group: usize,
    #[define(O)] _out: StorageType,
) {
    let cols = cols as usize;
    let dim = dim as usize;
    let tokens = tokens as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = c / dim;
    let d = c % dim;
    let rows = cols / dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    let mut v = v0[c];
    let mut xs = Array::<f32>::new(group);
    let mut rs = Array::<f32>::new(group);
    let mut xn = Array::<f32>::new(group);
    let mut rn = Array::<f32>::new(group);
    #[unroll]
    for q in 0..group {
        let t = select(q < tokens, q, tokens - 1);
        xn[q] = x[t * cols + c];
        rn[q] = r[t * rows + b];
    }
    let groups = (tokens + group - 1) / group;
    for gi in 0..groups {
        #[unroll]
        for q in 0..group {
            xs[q] = xn[q];
            rs[q] = rn[q];
        }
        // The next group's loads, in flight while this group computes.
        #[unroll]
        for q in 0..group {
            let tn = (gi + 1) * group + q;
            let t = select(tn < tokens, tn, tokens - 1);
            xn[q] = x[t * cols + c];
            rn[q] = r[t * rows + b];
        }
        #[unroll]
        for q in 0..group {
            let t = gi * group + q;
            if t < tokens {
                let u = xs[q] * rs[q] * nw * one_minus;
                let frames = Frames {
                    beta,
                    one_minus,
                    th,
                    t,
                    c,
                    cols,
                };
                v = token_frames::<O>(&frames, v, u, y, vpost, k, leak, save_vpost, mean_frames);
            }
        }
    }
    last[c] = v;
}

/// Where one token's K frames of the input PLIF go: the neuron's constants (β, `1 − β`,
/// `V_th`), the token `t` and the column `c` of `cols`.
#[derive(CubeType)]
pub(crate) struct Frames {
    pub beta: f32,
    pub one_minus: f32,
    pub th: f32,
    pub t: usize,
    pub c: usize,
    pub cols: usize,
}

/// One token's K frames of the input PLIF from membrane `v_in` with the token's input `u`
/// (the same in every frame, SPEC §3): writes each frame's output `(1 − β)·V_post` (`leak`)
/// or `V_post`, or their mean over the frames (`mean_frames`), and `V_post` itself
/// (`save_vpost`); returns the membrane after the last frame. Shared by the one-token and the
/// staged kernels, so their bits agree.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn token_frames<O: Float>(
    f: &Frames,
    v_in: f32,
    u: f32,
    y: &mut Tensor<O>,
    vpost: &mut Tensor<f32>,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] save_vpost: bool,
    #[comptime] mean_frames: bool,
) -> f32 {
    let mut v = v_in;
    let mut sum = 0.0f32;
    #[unroll]
    for j in 0..k {
        v = plif_step(f.beta, v, u, f.th);
        let out = select(leak, v * f.one_minus, v);
        if comptime![mean_frames] {
            sum += out;
        } else {
            y[(f.t * k + j) * f.cols + f.c] = O::cast_from(out);
        }
        if comptime![save_vpost] {
            vpost[(f.t * k + j) * f.cols + f.c] = v;
        }
    }
    if comptime![mean_frames] {
        y[f.t * f.cols + f.c] = O::cast_from(sum / f32::cast_from(k));
    }
    v
}

/// One group's loads for the backward: token `t = tokens − 1 − (gi·group + q)` (clamped) in
/// slot `q`: its K frames' `∂y` and `V_post`, `x`, `1/RMS`, and the membrane before its first
/// frame (`V_post` of the previous token's last frame, or `v0`).
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_group<G: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    vpost: &Tensor<f32>,
    grad: &Tensor<G>,
    gy: &mut Array<f32>,
    vp: &mut Array<f32>,
    xs: &mut Array<f32>,
    rs: &mut Array<f32>,
    bs: &mut Array<f32>,
    gi: usize,
    tokens: usize,
    cols: usize,
    rows: usize,
    c: usize,
    b: usize,
    first: f32,
    #[comptime] k: usize,
    #[comptime] group: usize,
) {
    #[unroll]
    for q in 0..group {
        let idx = gi * group + q;
        let clamped = select(idx < tokens, idx, tokens - 1);
        let t = tokens - 1 - clamped;
        xs[q] = x[t * cols + c];
        rs[q] = r[t * rows + b];
        bs[q] = select(
            t > 0,
            vpost[select(t > 0, (t * k - 1) * cols + c, c)],
            first,
        );
        #[unroll]
        for j in 0..k {
            let f = (t * k + j) * cols + c;
            gy[q * k + j] = f32::cast_from(grad[f]);
            vp[q * k + j] = vpost[f];
        }
    }
}

/// The backward of the input neuron, one unit per `(batch row, channel)` walking the tokens in
/// reverse, a group of `group` tokens' K frames loaded while the previous group is computed:
/// `∂V_post` from the output (times `1 − β` with leak), the reverse recurrence with the spikes
/// recomputed exactly as the forward made them, `∂x̂ = (1 − β)·Σ_k ∂u` per token (the norm's
/// backward follows in [`rms_norm_backward_kernel`]), and per column the sums `∂β` (the scan's
/// term less both `(1 − β)` factors'), `∂V_th` and the carried `∂v0`.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
#[cube(launch, launch_unchecked)]
fn norm_plif_backward_staged_kernel<G: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<f32>,
    grad: &Tensor<G>,
    d_xhat: &mut Tensor<f32>,
    d_beta: &mut Tensor<f32>,
    d_th: &mut Tensor<f32>,
    d_v0: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] group: usize,
    #[define(G)] _grad_type: StorageType,
) {
    let cols = cols as usize;
    let dim = dim as usize;
    let tokens = tokens as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = c / dim;
    let d = c % dim;
    let rows = cols / dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    let first = v0[c];
    let mut gy = Array::<f32>::new(comptime!(group * k));
    let mut vp = Array::<f32>::new(comptime!(group * k));
    let mut xs = Array::<f32>::new(group);
    let mut rs = Array::<f32>::new(group);
    let mut bs = Array::<f32>::new(group);
    let mut gn = Array::<f32>::new(comptime!(group * k));
    let mut vn = Array::<f32>::new(comptime!(group * k));
    let mut xn = Array::<f32>::new(group);
    let mut rn = Array::<f32>::new(group);
    let mut bn = Array::<f32>::new(group);
    load_group::<G>(
        x, r, vpost, grad, &mut gn, &mut vn, &mut xn, &mut rn, &mut bn, 0usize, tokens, cols, rows,
        c, b, first, k, group,
    );
    let mut acc = 0.0f32;
    let mut s_beta = 0.0f32;
    let mut s_th = 0.0f32;
    let mut s_om = 0.0f32;
    let groups = (tokens + group - 1) / group;
    for gi in 0..groups {
        #[unroll]
        for i in 0..comptime!(group * k) {
            gy[i] = gn[i];
            vp[i] = vn[i];
        }
        #[unroll]
        for q in 0..group {
            xs[q] = xn[q];
            rs[q] = rn[q];
            bs[q] = bn[q];
        }
        // The next group's loads, in flight while this group computes.
        load_group::<G>(
            x,
            r,
            vpost,
            grad,
            &mut gn,
            &mut vn,
            &mut xn,
            &mut rn,
            &mut bn,
            gi + 1,
            tokens,
            cols,
            rows,
            c,
            b,
            first,
            k,
            group,
        );
        #[unroll]
        for q in 0..group {
            let idx = gi * group + q;
            if idx < tokens {
                let t = tokens - 1 - idx;
                let xh = xs[q] * rs[q] * nw;
                let u = xh * one_minus;
                let mut du = 0.0f32;
                #[unroll]
                for jq in 0..k {
                    let j = k - 1 - jq;
                    // `j` is known when the kernel is expanded: no index below 0 is formed.
                    let mut v_prev = bs[q];
                    if j > 0 {
                        v_prev = vp[q * k + j - 1];
                    }
                    let mut g_out = gy[q * k + j];
                    if comptime![leak] {
                        s_om += gy[q * k + j] * vp[q * k + j];
                        g_out = gy[q * k + j] * one_minus;
                    }
                    let r = plif_reverse(g_out, acc, beta, v_prev, spike_of(beta, v_prev, u, th));
                    s_beta += r.g_beta;
                    s_th += r.g_th;
                    du += r.gv;
                    acc = r.acc;
                }
                d_xhat[t * cols + c] = du * one_minus;
                s_om += du * xh;
            }
        }
    }
    d_beta[c] = s_beta - s_om;
    d_th[c] = s_th;
    d_v0[c] = acc;
}

/// RMSNorm's backward, one plane per token row: with `g = ∂x̂·w`, `∂x = r·g − x·r³·mean(g·x)`;
/// writes the row's `∂w` terms `∂x̂·x·r` (summed over rows by the caller).
#[cube(launch, launch_unchecked)]
fn rms_norm_backward_kernel(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    d_xhat: &Tensor<f32>,
    d_x: &mut Tensor<f32>,
    d_w_rows: &mut Tensor<f32>,
    dim: u32,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let rr = r[row];
    let mut part = 0.0f32;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        part += d_xhat[i] * norm_w[d] * x[i];
        d += 32usize;
    }
    let m = plane_sum(part) / (dim as f32);
    let r3 = rr * rr * rr;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        let xi = x[i];
        let gi = d_xhat[i] * norm_w[d];
        d_x[i] = rr * gi - xi * r3 * m;
        d_w_rows[i] = d_xhat[i] * xi * rr;
        d += 32usize;
    }
}

/// Backward of [`super::norm_plif::norm_plif_train`] from the saved `V_post` and the output's gradient:
/// `[∂x [T, B, D], per-row ∂norm_w [T·B, D], per-column ∂β, ∂V_th, ∂v0 [B, D]]` (the caller
/// sums the per-row and per-column terms and applies σ′ to ∂β).
pub fn norm_plif_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    vpost: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 5] {
    let (t, batch, dim) = norm_plif_geometry(&inputs.each_ref(), k);
    let [x, norm_w, w, v_th, v0] = inputs.map(into_contiguous);
    let [vpost, grad] = [vpost, grad].map(into_contiguous);
    check_norm_plif_params([&norm_w, &w, &v_th, &v0], (batch, dim));
    // The staged backward clamps its token loads below `T`.
    assert!(t > 0, "norm_plif backward: no tokens");
    assert_eq!(vpost.dtype, DType::F32, "norm_plif backward: V_post is f32");
    for (name, g) in [("vpost", &vpost), ("grad", &grad)] {
        assert_eq!(
            g.meta.shape().num_elements(),
            t * k * batch * dim,
            "norm_plif backward: {name} [T·K, B, D]"
        );
    }
    // The output's gradient in the type the forward wrote it (see `norm_plif_with`).
    let grad_dtype = stored_dtype(&grad);
    let r = rms_inv(&x, t, batch, dim, eps);
    let cols = batch * dim;
    let d_xhat = out_like(&x, Shape::new([t, batch, dim]));
    let d_beta = out_like(&x, Shape::new([batch, dim]));
    let d_th = out_like(&x, Shape::new([batch, dim]));
    let d_v0 = out_like(&x, Shape::new([batch, dim]));
    let client = x.client.clone();
    let (_, group) = prefetch();
    // SAFETY: units past `cols` end; tokens clamped below `T > 0`; `vpost` and
    // `grad` `[T·K, B, D]`, the parameters and `v0` asserted above, the outputs allocated here.
    launch_guarded!(norm_plif_backward_staged_kernel::<R>(
        &client,
        CubeCount::Static(cols.div_ceil(NORM_PLIF_CUBE as usize) as u32, 1, 1),
        CubeDim::new_1d(NORM_PLIF_CUBE),
        x.clone().into_tensor_arg(),
        r.clone().into_tensor_arg(),
        norm_w.clone().into_tensor_arg(),
        w.into_tensor_arg(),
        v_th.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        grad.into_tensor_arg(),
        d_xhat.clone().into_tensor_arg(),
        d_beta.clone().into_tensor_arg(),
        d_th.clone().into_tensor_arg(),
        d_v0.clone().into_tensor_arg(),
        cols as u32,
        dim as u32,
        t as u32,
        k,
        leak,
        group,
        grad_dtype.into(),
    ));
    let d_x = out_like(&x, Shape::new([t, batch, dim]));
    let d_w_rows = out_like(&x, Shape::new([t * batch, dim]));
    // SAFETY: one cube per row of `[T·B, D]` tensors allocated or asserted above, lanes below `D`.
    launch_guarded!(rms_norm_backward_kernel::<R>(
        &client,
        CubeCount::Static((t * batch) as u32, 1, 1),
        CubeDim::new_1d(PLANE),
        x.into_tensor_arg(),
        r.into_tensor_arg(),
        norm_w.into_tensor_arg(),
        d_xhat.into_tensor_arg(),
        d_x.clone().into_tensor_arg(),
        d_w_rows.clone().into_tensor_arg(),
        dim as u32,
    ));
    [d_x, d_w_rows, d_beta, d_th, d_v0]
}
