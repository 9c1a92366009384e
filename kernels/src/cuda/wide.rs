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
//! The arithmetic is the staged kernels': both call the same device functions for the step
//! ([`block_modulation`], [`plif_step`]; the staged kernels' shared-memory values are f32 as
//! the registers here), so a session's bits do not depend on which kernel its cohort ran.

use crate::cuda::common::{block_modulation, launch_guarded, pair};
use crate::cuda::plif::plif_step;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube of the wide kernels.
const UNITS: u32 = 256;
/// Steps whose loads a unit issues before computing them.
const GROUP: usize = 4;
/// Columns (batch rows × channels) from which the decoding scans run one unit per column:
/// the `decode_wide_cols` knob (`NSACTOR_DECODE_WIDE_COLS`), by default 131,072, about half of
/// an H100's resident units (132 × 2,048): the block scan from 19 sessions at the 0.9B, the FFN
/// neurons from 49.
pub fn wide_cols() -> usize {
    crate::tuning::current().decode_wide_cols
}

/// [`crate::cuda::decode`]'s block scan, one unit per column `c = b·DN + j`: for each group of
/// steps, the four projections' loads, then per step the modulation (`β = σ(r_β + b_β)`,
/// `u = softplus(r_α + b_α)·i`, `V_th = |r_th + b_th| + V_min`) and the recurrence.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
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
                let m = block_modulation(ri[r], rb[r], ra[r], rt[r], bb, ba, bt, v_th_min);
                v = plif_step(m.beta, v, m.u, m.th);
                vpost[k * cols + c] = O::cast_from(v);
            }
        }
        k0 += group;
    }
    last[c] = v;
}

/// [`block_scan_wide_kernel`] with `N` adjacent columns per unit, read and written as vectors
/// of `N` (8-byte loads of bf16 projections at `N = 4` where the scalar kernel issues 2-byte
/// ones: a warp's load then covers 256 contiguous bytes, four times fewer load instructions).
/// Each lane's arithmetic is the scalar kernel's, in the same order ([`block_modulation`],
/// [`plif_step`] on f32 scalars), so the bits are the same.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn block_scan_wide_vec_kernel<I: Float, O: Float, N: Size>(
    y: &Tensor<Vector<I, N>>,
    b_beta: &Tensor<Vector<f32, N>>,
    b_alpha: &Tensor<Vector<f32, N>>,
    b_th: &Tensor<Vector<f32, N>>,
    v0: &Tensor<Vector<f32, N>>,
    vpost: &mut Tensor<Vector<O, N>>,
    last: &mut Tensor<Vector<f32, N>>,
    cols: u32,
    steps: u32,
    dn: u32,
    row_stride: u32,
    v_th_min: f32,
    #[comptime] group: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let n = y.vector_size();
    // Units and columns in vectors of n.
    let g = ABSOLUTE_POS;
    let cols = cols as usize / n;
    if g >= cols {
        terminate!();
    }
    let steps = steps as usize;
    let dn = dn as usize / n;
    let row_stride = row_stride as usize / n;
    let batch = cols / dn;
    let b = g / dn;
    let j = g % dn;
    let (bb, ba, bt) = (b_beta[j], b_alpha[j], b_th[j]);
    let mut ri = Array::<Vector<I, N>>::new(group);
    let mut rb = Array::<Vector<I, N>>::new(group);
    let mut ra = Array::<Vector<I, N>>::new(group);
    let mut rt = Array::<Vector<I, N>>::new(group);
    let mut v = v0[g];
    let mut k0 = 0usize;
    while k0 < steps {
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let base = (k * batch + b) * row_stride + j;
                ri[r] = y[base];
                rb[r] = y[base + dn];
                ra[r] = y[base + 2 * dn];
                rt[r] = y[base + 3 * dn];
            }
        }
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < steps {
                let mut out = Vector::<O, N>::empty();
                #[unroll]
                for l in 0..n {
                    let m = block_modulation(
                        f32::cast_from(ri[r][l]),
                        f32::cast_from(rb[r][l]),
                        f32::cast_from(ra[r][l]),
                        f32::cast_from(rt[r][l]),
                        bb[l],
                        ba[l],
                        bt[l],
                        v_th_min,
                    );
                    let vl = plif_step(m.beta, v[l], m.u, m.th);
                    v[l] = vl;
                    out[l] = O::cast_from(vl);
                }
                vpost[k * cols + g] = out;
            }
        }
        k0 += group;
    }
    last[g] = v;
}

/// Columns per unit of the vector block scan.
const VEC: usize = 4;

/// Whether the block scan's tensors can be read in vectors of [`VEC`]: `dn` and the row
/// stride multiples of it (so every vector stays inside one projection's columns of one row)
/// and every tensor read or written as vectors starting at an offset that keeps them aligned.
fn vector_fits<R: CubeRuntime>(tensors: &[&CubeTensor<R>], dn: usize, row_stride: usize) -> bool {
    let aligned = |t: &CubeTensor<R>| {
        (t.handle.offset_start.unwrap_or(0) as usize).is_multiple_of(VEC * t.dtype.size())
    };
    dn.is_multiple_of(VEC) && row_stride.is_multiple_of(VEC) && tensors.iter().all(|t| aligned(t))
}

/// Launches [`block_scan_wide_kernel`] (or, with `vector` and where the shapes allow, its
/// vector form) over `vpost`'s and `last`'s columns (the launcher in [`crate::cuda::decode`]
/// has checked and allocated them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scan<R: CubeRuntime>(
    y: CubeTensor<R>,
    [bb, ba, bt]: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    vpost: CubeTensor<R>,
    last: CubeTensor<R>,
    (cols, steps, dn, row_stride): (usize, usize, usize, usize),
    v_th_min: f32,
    vector: bool,
) {
    let types = [y.dtype.into(), vpost.dtype.into()];
    macro_rules! launch {
        ($kernel:ident, $units:expr $(, $vec:expr)?) => {
            launch_guarded!($kernel::<R>(
                &y.client.clone(),
                CubeCount::Static($units.div_ceil(UNITS as usize) as u32, 1, 1),
                CubeDim::new_1d(UNITS),
                $($vec,)?
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
            ))
        };
    }
    // SAFETY (the unchecked launches): each unit past the columns terminates; the rest read
    // `y` at steps below `steps` (the launcher asserted its rows and the four `dn`-wide
    // projections in each), the biases at `j < dn` (their length asserted), `v0`, `vpost` and
    // `last` at their own column (the launcher asserted and allocated them).
    if vector && vector_fits(&[&y, &bb, &ba, &bt, &v0, &vpost, &last], dn, row_stride) {
        launch!(block_scan_wide_vec_kernel, cols / VEC, VEC);
        return;
    }
    launch!(block_scan_wide_kernel, cols);
}

/// [`crate::cuda::ffn`]'s neurons for inference, one unit per `(batch row b, channel j)`:
/// both neurons' recurrences (`fma(β, v, i·(1 − β))`, the `≥` test) and the gated product,
/// `(1 − β)·V_post` per neuron with `leak`. `V_post` is not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
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
    let batch = batch as usize;
    let ff = ff as usize;
    let p = pair(w_g, w_u, th_g, th_u, batch, ff, ABSOLUTE_POS);
    if !p.valid {
        terminate!();
    }
    let steps = steps as usize;
    let row_stride = row_stride as usize;
    let (b, j) = (p.b, p.j);
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
                vg = plif_step(p.beta_g, vg, xg[r] * p.om_g, p.tg);
                vu = plif_step(p.beta_u, vu, xu[r] * p.om_u, p.tu);
                let o = (k * batch + b) * ff + j;
                if comptime![leak] {
                    gv[o] = O::cast_from((vg * p.om_g) * (vu * p.om_u));
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
    // SAFETY: units past the `B·D_ff` pairs end; the rest read `i_gu` at steps below
    // `steps` (its `steps·batch` rows of `row_stride` hold both currents: the launcher in
    // `crate::cuda::ffn` asserted it, as for its staged kernel), the parameters and `v0` asserted by
    // `check_ffn_shapes`, `gv` and `last` allocated there.
    launch_guarded!(ffn_infer_wide_kernel::<R>(
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
    ));
}
