//! Plane 0's part of the selective kernels ([`super::ring`]): the recurrence over one chunk of
//! steps from the double buffer the producers filled, forward and in reverse.

use crate::cuda::plif::{plif, plif_reverse};
use cubecl::prelude::*;

/// Plane 0's part of a staged forward: the recurrence over chunk `ch` (steps `ch·chunk …`) from
/// the double buffer (`width` columns per step row), writing `V_post` and, with `spikes`, the
/// spikes; returns the membrane after the chunk.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn scan_forward_chunk<S: Float>(
    s_beta: &SharedMemory<f32>,
    s_u: &SharedMemory<f32>,
    s_th: &SharedMemory<f32>,
    spike: &mut Tensor<S>,
    vpost: &mut Tensor<S>,
    v_in: f32,
    ch: usize,
    x: usize,
    c: usize,
    valid: bool,
    cols: usize,
    steps: usize,
    #[comptime] chunk: usize,
    #[comptime] width: usize,
    #[comptime] spikes: bool,
) -> f32 {
    let mut v = v_in;
    let k0 = ch * chunk;
    let buf = (ch % 2) * chunk * width;
    #[unroll]
    for q in 0..chunk {
        let k = k0 + q;
        if k < steps {
            let s_idx = buf + q * width + x;
            let th = s_th[s_idx];
            let f = plif(s_beta[s_idx], v, s_u[s_idx], th);
            v = f.v;
            if valid {
                let idx = k * cols + c;
                if comptime![spikes] {
                    spike[idx] = S::cast_from(f.spike);
                }
                vpost[idx] = S::cast_from(v);
            }
        }
    }
    v
}

/// Plane 0's part of a staged backward: the reverse recurrence over chunk `ch` (numbered from
/// the end, slot `q` step `steps − ch·chunk − 1 − q`) from the double buffer, writing the four
/// projections' gradients. `carry` holds `acc` (the carried `gV·β`) and the sums over time of
/// `∂r_β, ∂r_α, ∂r_th`.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn scan_reverse_chunk<I: Float>(
    s_be: &SharedMemory<f32>,
    s_gg: &SharedMemory<f32>,
    s_vp: &SharedMemory<f32>,
    s_fa: &SharedMemory<f32>,
    s_al: &SharedMemory<f32>,
    s_ts: &SharedMemory<f32>,
    g_i: &mut Tensor<I>,
    g_rb: &mut Tensor<I>,
    g_ra: &mut Tensor<I>,
    g_rt: &mut Tensor<I>,
    carry: &mut Array<f32>,
    ch: usize,
    x: usize,
    c: usize,
    valid: bool,
    cols: usize,
    steps: usize,
    #[comptime] chunk: usize,
    #[comptime] width: usize,
) {
    let top = steps - ch * chunk;
    let buf = (ch % 2) * chunk * width;
    let mut acc = carry[0];
    let mut sum_b = carry[1];
    let mut sum_a = carry[2];
    let mut sum_t = carry[3];
    #[unroll]
    for q in 0..chunk {
        if q < top {
            let k = top - 1 - q;
            let s_idx = buf + q * width + x;
            let beta = s_be[s_idx];
            let r = plif_reverse(s_gg[s_idx], acc, beta, s_vp[s_idx], s_ts[s_idx]);
            let d_rb = (beta * (1.0f32 - beta)) * r.g_beta;
            let d_ra = r.gv * s_fa[s_idx];
            let d_rt = r.g_th;
            if valid {
                let idx = k * cols + c;
                g_i[idx] = I::cast_from(r.gv * s_al[s_idx]);
                g_rb[idx] = I::cast_from(d_rb);
                g_ra[idx] = I::cast_from(d_ra);
                g_rt[idx] = I::cast_from(d_rt);
            }
            sum_b += d_rb;
            sum_a += d_ra;
            sum_t += d_rt;
            acc = r.acc;
        }
    }
    carry[0] = acc;
    carry[1] = sum_b;
    carry[2] = sum_a;
    carry[3] = sum_t;
}
