//! The decoding scans for passes of many sessions: one unit per column, walking its few steps
//! with a group of steps' loads in flight.
//!
//! The staged decoding kernels ([`crate::cuda::decode`]'s block scan, [`crate::cuda::ffn`]'s
//! neurons) give a cube of 32 columns several producer planes, so that one session's 7,168
//! columns keep the schedulers busy. At hundreds of sessions the columns alone fill the GPU
//! many times over, and there the staging costs: plane 0 walks the recurrence alone while the
//! producers wait at the barrier, and the whole pass reaches about half the copy bandwidth
//! (at 256 sessions on the H100, on f32 inputs: the staged block scan 378 µs a layer, this one
//! 203; the FFN neurons 107 and 52). From [`wide_cols`] columns on, these kernels run instead.
//!
//! The arithmetic is the staged kernels' operation for operation (the same device functions,
//! the same `fma`, the same roundings: the staged kernels' shared-memory values are f32 as the
//! registers here), so a session's bits do not depend on which kernel its cohort ran.

use crate::cuda::common::{sigmoid_burn, softplus};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube of the wide kernels.
const UNITS: u32 = 256;
/// Steps whose loads a unit issues before computing them.
const GROUP: usize = 4;
/// Default of [`wide_cols`]: about half of an H100's resident units (132 × 2,048).
const DEFAULT_WIDE_COLS: usize = 1 << 17;

/// Columns (batch rows × channels) from which the decoding scans run one unit per column:
/// `$NSACTOR_DECODE_WIDE_COLS`, default 131,072 (the block scan from 19 sessions at the 0.9B,
/// the FFN neurons from 49).
pub fn wide_cols() -> usize {
    static COLS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COLS.get_or_init(|| {
        std::env::var("NSACTOR_DECODE_WIDE_COLS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_WIDE_COLS)
    })
}

/// [`crate::cuda::decode`]'s block scan, one unit per column `c = b·DN + j`: for each group of
/// steps, the four projections' loads, then per step the modulation (`β = σ(r_β + b_β)`,
/// `u = softplus(r_α + b_α)·i`, `V_th = |r_th + b_th| + V_min`) and the recurrence.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn block_scan_wide_kernel<I: Float, O: Float>(
    y: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    dn: u32,
    row_stride: u32,
    v_th_min: f32,
    #[comptime] group: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let c = ABSOLUTE_POS;
    let cols = cols as usize;
    if c >= cols {
        terminate!();
    }
    let steps = steps as usize;
    let dn = dn as usize;
    let row_stride = row_stride as usize;
    let batch = cols / dn;
    let b = c / dn;
    let j = c % dn;
    let (bb, ba, bt) = (b_beta[j], b_alpha[j], b_th[j]);
    let mut ri = Array::<f32>::new(group);
    let mut rb = Array::<f32>::new(group);
    let mut ra = Array::<f32>::new(group);
    let mut rt = Array::<f32>::new(group);
    let mut v = v0[c];
    let mut k0 = 0usize;
    while k0 < steps {
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let base = (k * batch + b) * row_stride + j;
                ri[r] = f32::cast_from(y[base]);
                rb[r] = f32::cast_from(y[base + dn]);
                ra[r] = f32::cast_from(y[base + 2 * dn]);
                rt[r] = f32::cast_from(y[base + 3 * dn]);
            }
        }
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let beta = sigmoid_burn(rb[r] + bb);
                let u = softplus(ra[r] + ba) * ri[r];
                let th = (rt[r] + bt).abs() + v_th_min;
                let v_pre = fma(beta, v, u);
                let s = select(v_pre >= th, 1.0f32, 0.0f32);
                v = v_pre - th * s;
                vpost[k * cols + c] = O::cast_from(v);
            }
        }
        k0 += group;
    }
    last[c] = v;
}

/// Launches [`block_scan_wide_kernel`] over `vpost`'s and `last`'s columns (the launcher in
/// [`crate::cuda::decode`] has checked and allocated them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scan<R: CubeRuntime>(
    y: CubeTensor<R>,
    [bb, ba, bt]: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    vpost: CubeTensor<R>,
    last: CubeTensor<R>,
    (cols, steps, dn, row_stride): (usize, usize, usize, usize),
    v_th_min: f32,
) {
    let types = [y.dtype.into(), vpost.dtype.into()];
    block_scan_wide_kernel::launch::<R>(
        &y.client.clone(),
        CubeCount::Static(cols.div_ceil(UNITS as usize) as u32, 1, 1),
        CubeDim::new_1d(UNITS),
        y.into_tensor_arg(),
        bb.into_tensor_arg(),
        ba.into_tensor_arg(),
        bt.into_tensor_arg(),
        v0.into_tensor_arg(),
        vpost.into_tensor_arg(),
        last.into_tensor_arg(),
        cols as u32,
        steps as u32,
        dn as u32,
        row_stride as u32,
        v_th_min,
        GROUP,
        types,
    );
}

/// [`crate::cuda::ffn`]'s neurons for inference, one unit per `(batch row b, channel j)`:
/// both neurons' recurrences (`fma(β, v, i·(1 − β))`, the `≥` test) and the gated product,
/// `(1 − β)·V_post` per neuron with `leak`. `V_post` is not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ffn_infer_wide_kernel<I: Float, O: Float>(
    i_gu: &Tensor<I>,
    w_g: &Tensor<f32>,
    w_u: &Tensor<f32>,
    th_g: &Tensor<f32>,
    th_u: &Tensor<f32>,
    v0: &Tensor<f32>,
    gv: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    batch: u32,
    ff: u32,
    steps: u32,
    row_stride: u32,
    #[comptime] leak: bool,
    #[comptime] group: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let c = ABSOLUTE_POS;
    let batch = batch as usize;
    let ff = ff as usize;
    if c >= batch * ff {
        terminate!();
    }
    let steps = steps as usize;
    let row_stride = row_stride as usize;
    let b = c / ff;
    let j = c % ff;
    let beta_g = sigmoid_burn(w_g[j]);
    let beta_u = sigmoid_burn(w_u[j]);
    let om_g = -beta_g + 1.0f32;
    let om_u = -beta_u + 1.0f32;
    let (tg, tu) = (th_g[j], th_u[j]);
    let mut xg = Array::<f32>::new(group);
    let mut xu = Array::<f32>::new(group);
    let mut vg = v0[b * 2 * ff + j];
    let mut vu = v0[b * 2 * ff + ff + j];
    let mut k0 = 0usize;
    while k0 < steps {
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let row = (k * batch + b) * row_stride;
                xg[r] = f32::cast_from(i_gu[row + j]);
                xu[r] = f32::cast_from(i_gu[row + ff + j]);
            }
        }
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let pg = fma(beta_g, vg, xg[r] * om_g);
                vg = pg - tg * select(pg >= tg, 1.0f32, 0.0f32);
                let pu = fma(beta_u, vu, xu[r] * om_u);
                vu = pu - tu * select(pu >= tu, 1.0f32, 0.0f32);
                let o = (k * batch + b) * ff + j;
                if comptime![leak] {
                    gv[o] = O::cast_from((vg * om_g) * (vu * om_u));
                } else {
                    gv[o] = O::cast_from(vg * vu);
                }
            }
        }
        k0 += group;
    }
    last[b * 2 * ff + j] = vg;
    last[b * 2 * ff + ff + j] = vu;
}

/// Launches [`ffn_infer_wide_kernel`] (the launcher in [`crate::cuda::ffn`] has checked and
/// allocated its tensors). `params`: `w_gate, w_up, th_gate, th_up`.
pub(crate) fn ffn_infer<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    [w_g, w_u, th_g, th_u]: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    [gv, last]: [CubeTensor<R>; 2],
    (steps, batch, ff, row_stride): (usize, usize, usize, usize),
    leak: bool,
) {
    let types = [i_gu.dtype.into(), gv.dtype.into()];
    ffn_infer_wide_kernel::launch::<R>(
        &i_gu.client.clone(),
        CubeCount::Static((batch * ff).div_ceil(UNITS as usize) as u32, 1, 1),
        CubeDim::new_1d(UNITS),
        i_gu.into_tensor_arg(),
        w_g.into_tensor_arg(),
        w_u.into_tensor_arg(),
        th_g.into_tensor_arg(),
        th_u.into_tensor_arg(),
        v0.into_tensor_arg(),
        gv.into_tensor_arg(),
        last.into_tensor_arg(),
        batch as u32,
        ff as u32,
        steps as u32,
        row_stride as u32,
        leak,
        GROUP * 2,
        types,
    );
}
