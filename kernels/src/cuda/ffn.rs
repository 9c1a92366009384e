//! The SNNFFN's gate and up neurons after its merged projection as staged CubeCL kernels: a
//! cube holds 32 `(batch row, channel)` pairs, producer planes load both neurons' currents of the
//! next chunk into shared memory while plane 0 scans both neurons and writes their gated product.
//! One forward kernel serves training (saving `V_post`) and inference (reading a column slice of a
//! wider product in place); the backward recomputes the spikes exactly.

use crate::cuda::common::{
    STAGE_COLS, check_f32, check_ffn_shapes, ffn_geometry, out_like, out_typed, pair, stage_shape,
    stored_dtype,
};
use crate::cuda::plif::{plif_reverse, plif_step, spike_of};
use crate::cuda::precision::input_dtype;
use crate::cuda::speculative;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

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
#[cube(launch_unchecked)]
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
    let c = CUBE_POS_X as usize * 32 + UNIT_POS_X as usize;
    let p = pair(w_g, w_u, th_g, th_u, batch, ff, c);
    let mut s_g = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let per = comptime!(chunk / producers);
    let mut xg = Array::<f32>::new(per);
    let mut xu = Array::<f32>::new(per);
    let mut vg = v0[p.b * 2 * ff + p.j];
    let mut vu = v0[p.b * 2 * ff + ff + p.j];
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
                        vg = plif_step(p.beta_g, vg, s_g[s_idx] * p.om_g, p.tg);
                        vu = plif_step(p.beta_u, vu, s_u[s_idx] * p.om_u, p.tu);
                        if p.valid {
                            if comptime![save_vpost] {
                                let row = (k * batch + p.b) * 2 * ff;
                                vpost[row + p.j] = vg;
                                vpost[row + ff + p.j] = vu;
                            }
                            let o = (k * batch + p.b) * ff + p.j;
                            if comptime![leak] {
                                gv[o] = O::cast_from((vg * p.om_g) * (vu * p.om_u));
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
                if k < steps && p.valid {
                    let row = (k * batch + p.b) * row_stride;
                    xg[r] = f32::cast_from(i_gu[row + p.j]);
                    xu[r] = f32::cast_from(i_gu[row + ff + p.j]);
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
    if y == 0 && p.valid {
        last[p.b * 2 * ff + p.j] = vg;
        last[p.b * 2 * ff + ff + p.j] = vu;
    }
}

/// One neuron's step prepared by a producer for the reverse pass (see
/// [`ffn_backward_staged_kernel`]).
#[derive(CubeType)]
struct Prepared {
    /// `∂V_post` from the gating: `∂act`, times `1 − β` with `leak`.
    dv: f32,
    /// `∂V_pre/∂β = V_{k−1} − i` (with `u = i·(1 − β)`).
    dbeta: f32,
    /// The step's spike, recomputed as the forward made it.
    spike: f32,
    /// `∂act·V_post`, the `(1 − β)·V_post` term's part of `∂β` (`leak` only).
    leak: f32,
}

/// One FFN neuron's constants: β, `1 − β` and its threshold.
#[derive(CubeType)]
struct Neuron {
    beta: f32,
    one_minus: f32,
    th: f32,
}

/// [`Neuron`] from its three constants.
#[cube]
fn neuron(beta: f32, one_minus: f32, th: f32) -> Neuron {
    Neuron {
        beta,
        one_minus,
        th,
    }
}

/// A neuron's activation as the gating reads it: `(1 − β)·V_post` with `leak`, else `V_post`.
#[cube]
fn activation(v: f32, one_minus: f32, #[comptime] leak: bool) -> f32 {
    let mut act = v;
    if comptime![leak] {
        act = v * one_minus;
    }
    act
}

/// [`Prepared`] from the neuron's `∂act`, `V_post`, `V_{k−1}` and input `i` at one step.
#[cube]
fn prepare_step(
    d_act: f32,
    v: f32,
    v_prev: f32,
    i: f32,
    n: &Neuron,
    #[comptime] leak: bool,
) -> Prepared {
    let mut dv = d_act;
    let mut leak_part = 0.0f32;
    if comptime![leak] {
        dv = d_act * n.one_minus;
        leak_part = d_act * v;
    }
    Prepared {
        dv,
        dbeta: v_prev - i,
        spike: spike_of(n.beta, v_prev, i * n.one_minus, n.th),
        leak: leak_part,
    }
}

/// Their backward, staged in reverse: producers compute everything of a step but the carried
/// gradients (the gating's `∂act`, `∂V_post`, the spike recomputed exactly as the forward made
/// it, `V_{k−1} − i`), plane 0 runs both neurons' reverse recurrences, writes
/// `∂i = ∂u·(1 − β)` and sums per pair over time: `∂β` (the scan's `Σ ∂u·(V_{k−1} − i)` minus
/// `Σ ∂act·V_post`, the `(1 − β)·V_post` term, which needs no carry: each producer sums its own
/// steps and plane 0 adds the producers' sums at the end), `∂V_th`, and the carried `∂v0`.
/// Plane 0 reads six values a step from shared memory.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
    let c = CUBE_POS_X as usize * 32 + UNIT_POS_X as usize;
    let p = pair(w_g, w_u, th_g, th_u, batch, ff, c);
    let first_g = v0[p.b * 2 * ff + p.j];
    let first_u = v0[p.b * 2 * ff + ff + p.j];
    let size = comptime!(2 * chunk * 32);
    let mut s_dvg = SharedMemory::<f32>::new(size);
    let mut s_dvu = SharedMemory::<f32>::new(size);
    let mut s_dbg = SharedMemory::<f32>::new(size);
    let mut s_dbu = SharedMemory::<f32>::new(size);
    let mut s_sg = SharedMemory::<f32>::new(size);
    let mut s_su = SharedMemory::<f32>::new(size);
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
    // A producer's own sum of `∂act·V_post` over the steps it prepared (leak only).
    let mut sl_g = 0.0f32;
    let mut sl_u = 0.0f32;
    let gate = neuron(p.beta_g, p.om_g, p.tg);
    let up = neuron(p.beta_u, p.om_u, p.tu);
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
                        let at = buf + q * 32 + x;
                        let rg = plif_reverse(s_dvg[at], acc_g, p.beta_g, s_dbg[at], s_sg[at]);
                        let ru = plif_reverse(s_dvu[at], acc_u, p.beta_u, s_dbu[at], s_su[at]);
                        if p.valid {
                            let row = (k * batch + p.b) * 2 * ff;
                            d_i[row + p.j] = I::cast_from(rg.gv * p.om_g);
                            d_i[row + ff + p.j] = I::cast_from(ru.gv * p.om_u);
                        }
                        sb_g += rg.g_beta;
                        sb_u += ru.g_beta;
                        st_g += rg.g_th;
                        st_u += ru.g_th;
                        acc_g = rg.acc;
                        acc_u = ru.acc;
                    }
                }
            }
        } else if ch < chunks {
            let top = steps - ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                if q < top && p.valid {
                    let k = top - 1 - q;
                    let row = (k * batch + p.b) * 2 * ff;
                    xg[r] = f32::cast_from(grad[(k * batch + p.b) * ff + p.j]);
                    xig[r] = f32::cast_from(i_gu[row + p.j]);
                    xiu[r] = f32::cast_from(i_gu[row + ff + p.j]);
                    xvg[r] = vpost[row + p.j];
                    xvu[r] = vpost[row + ff + p.j];
                    let prev = select(k > 0, row - batch * 2 * ff, 0);
                    xpg[r] = select(k > 0, vpost[prev + p.j], first_g);
                    xpu[r] = select(k > 0, vpost[prev + ff + p.j], first_u);
                } else {
                    // Past the first step (or an idle pair): nothing to add.
                    xg[r] = 0.0f32;
                    xvg[r] = 0.0f32;
                    xvu[r] = 0.0f32;
                }
            }
            #[unroll]
            for r in 0..per {
                let s_idx = buf + ((y - 1) + r * producers) * 32 + x;
                let act_g = activation(xvg[r], p.om_g, leak);
                let act_u = activation(xvu[r], p.om_u, leak);
                let g = prepare_step(xg[r] * act_u, xvg[r], xpg[r], xig[r], &gate, leak);
                let u = prepare_step(xg[r] * act_g, xvu[r], xpu[r], xiu[r], &up, leak);
                s_dvg[s_idx] = g.dv;
                s_dvu[s_idx] = u.dv;
                if comptime![leak] {
                    sl_g += g.leak;
                    sl_u += u.leak;
                }
                s_dbg[s_idx] = g.dbeta;
                s_dbu[s_idx] = u.dbeta;
                s_sg[s_idx] = g.spike;
                s_su[s_idx] = u.spike;
            }
        }
        sync_cube();
        ch += 1;
    }
    // The producers' `Σ ∂act·V_post` to plane 0 through the (now free) first two buffers.
    if y > 0 {
        s_dvg[(y - 1) * 32 + x] = sl_g;
        s_dvu[(y - 1) * 32 + x] = sl_u;
    }
    sync_cube();
    if y == 0 && p.valid {
        let o = p.b * 2 * ff + p.j;
        let l_g = producers_sum(&s_dvg, x, producers);
        let l_u = producers_sum(&s_dvu, x, producers);
        d_beta[o] = sb_g - l_g;
        d_beta[o + ff] = sb_u - l_u;
        d_th[o] = st_g;
        d_th[o + ff] = st_u;
        d_v0[o] = acc_g;
        d_v0[o + ff] = acc_u;
    }
}

/// The producers' partial sums (one a producer, in the first rows of `buf`) for column `x`,
/// added in producer order.
#[cube]
fn producers_sum(buf: &SharedMemory<f32>, x: usize, #[comptime] producers: usize) -> f32 {
    let mut sum = 0.0f32;
    #[unroll]
    for r in 0..producers {
        sum += buf[r * 32 + x];
    }
    sum
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
    let (gv, vpost, _) = ffn_forward_with(i_gu, params, v0, leak, true, geometry, 0);
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
    ffn_infer_cut(i_gu, params, v0, leak, speculative::time_chunk())
}

/// [`ffn_infer`] cut in time chunks of `chunk` steps where it is cut at all (0: never).
pub(crate) fn ffn_infer_cut<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    leak: bool,
    chunk: usize,
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
        // Contiguous columns, rows that do not overlap (not a broadcast row).
        let strides = i_gu.meta.strides();
        let i_gu = if strides[1] == 1 && (strides[0] >= shape[1] || shape[0] <= 1) {
            i_gu
        } else {
            into_contiguous(i_gu)
        };
        let row_stride = i_gu.meta.strides()[0].max(shape[1]);
        let geometry = (shape[0] / batch, batch, ff, row_stride);
        let (gv, _, last) = ffn_forward_with(i_gu, params, v0, leak, false, geometry, chunk);
        return (gv, last);
    }
    let (batch, ff, steps) = ffn_geometry(&i_gu);
    let i_gu = into_contiguous(i_gu);
    let geometry = (steps, batch, ff, 2 * ff);
    let (gv, _, last) = ffn_forward_with(i_gu, params, v0, leak, false, geometry, chunk);
    (gv, last)
}

/// `(g·v, V_post (empty unless save_vpost), final state)` for an `i_gu` of `steps·batch` rows
/// of `row_stride` values each, the first `2·ff` of them the currents (`geometry`: steps,
/// batch, ff, row_stride); inference in time chunks of `chunk` steps where it is cut.
fn ffn_forward_with<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    params: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    leak: bool,
    save_vpost: bool,
    (steps, batch, ff, row_stride): (usize, usize, usize, usize),
    chunk: usize,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let [w_g, w_u, th_g, th_u] = params;
    check_f32(&[&w_g, &w_u, &th_g, &th_u, &v0]);
    check_ffn_shapes([&w_g, &w_u, &th_g, &th_u], &v0, (steps, batch, ff), &[]);
    let stored = stored_dtype(&i_gu);
    assert!(
        steps * batch * row_stride <= u32::MAX as usize,
        "ffn neurons: {steps}×{batch}×{row_stride} elements exceed 32-bit indexing"
    );
    let [w_g, w_u, th_g, th_u, v0] = [w_g, w_u, th_g, th_u, v0].map(into_contiguous);
    // Inference writes g·v in the type the down projection's GEMM reads; training stores it
    // like the currents (bf16 storage: bf16), `V_post` (which the backward's exact spike
    // recomputation reads) and the state always f32.
    let gv_dtype = if save_vpost { stored } else { input_dtype() };
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
    // Many sessions: one unit per column; one session's long pass: cut in time chunks.
    let cut = crate::cuda::speculative::chunks_for(steps, batch * ff, chunk);
    if !save_vpost && (batch * ff >= crate::cuda::wide::wide_cols() || cut.is_some()) {
        let (params, outs) = ([w_g, w_u, th_g, th_u], [gv.clone(), last.clone()]);
        let g = (steps, batch, ff, row_stride);
        match cut {
            Some(n) => speculative::ffn_infer(i_gu, params, v0, outs, g, leak, (chunk, n)),
            None => crate::cuda::wide::ffn_infer(i_gu, params, v0, outs, g, leak),
        }
        return (gv, vpost, last);
    }
    let (producers, chunk) = stage_shape(
        crate::tuning::current().stage_ffn_forward,
        STAGE_FFN_FORWARD,
    );
    let client = i_gu.client.clone();
    // SAFETY: launched without CubeCL's per-access bounds checks (a metadata load, a compare
    // and a select on every global access). The kernel guards each access itself (`valid`
    // pairs, steps below `steps`) on tensors whose shapes were asserted above or allocated
    // here; an inference `i_gu` holds `steps·batch` rows of `row_stride`.
    unsafe {
        ffn_forward_staged_kernel::launch_unchecked::<R>(
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
    }
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
    check_ffn_shapes(
        [&w_g, &w_u, &th_g, &th_u],
        &v0,
        (steps, batch, ff),
        &[(&vpost, 2 * ff), (&grad, ff)],
    );
    let [i_gu, w_g, w_u, th_g, th_u, v0, vpost, grad] =
        [i_gu, w_g, w_u, th_g, th_u, v0, vpost, grad].map(into_contiguous);
    let state = Shape::new([batch, 2 * ff]);
    // ∂i_gu in i_gu's type; the parameter and state gradients f32.
    let d_i = out_like(&i_gu, Shape::new([steps, batch, 2 * ff]));
    let d_beta = out_typed(&i_gu, state.clone(), DType::F32);
    let d_th = out_typed(&i_gu, state.clone(), DType::F32);
    let d_v0 = out_typed(&i_gu, state, DType::F32);
    let (producers, chunk) = stage_shape(
        crate::tuning::current().stage_ffn_backward,
        STAGE_FFN_BACKWARD,
    );
    let client = i_gu.client.clone();
    // SAFETY: as for the forward's launch above; the backward guards its accesses alike.
    unsafe {
        ffn_backward_staged_kernel::launch_unchecked::<R>(
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
    }
    [d_i, d_beta, d_th, d_v0]
}
