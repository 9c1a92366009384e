//! The staged selective kernels whose producers load into registers: the kernels before the
//! `cp.async` ring, its fallback for bf16 storage with an odd column count (the ring's 4-byte
//! copies of bf16 column pairs need rows of an even width), and selected with
//! `$NSACTOR_SELECTIVE_FORWARD=sync` / `$NSACTOR_SELECTIVE_BACKWARD=sync`. Same arithmetic as the
//! ring kernels, bit for bit.

use super::chunk::{scan_forward_chunk, scan_reverse_chunk};
use crate::cuda::common::{sigmoid_burn, sign, softplus};
use cubecl::prelude::*;

/// The staged forward: plane 0 of a cube scans 32 columns; planes `1..=producers` compute
/// `β, u, V_th` of the next chunk (`chunk` steps) into shared memory meanwhile, each taking
/// every `producers`-th step with all its loads issued together. One barrier per chunk swaps
/// the two buffers. Same arithmetic as the reference ([`crate::reference`]) term for term, and
/// bit for bit the ring kernel's.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn selective_forward_staged_kernel<I: Float, S: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<S>,
    vpost: &mut Tensor<S>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    v_th_min: f32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, S)] _types: [StorageType; 2],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let mut s_beta = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_th = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xb = Array::<f32>::new(per);
    let mut xa = Array::<f32>::new(per);
    let mut xt = Array::<f32>::new(per);
    let mut xi = Array::<f32>::new(per);
    // Chunk `ch` lives in buffer `ch % 2`; producers fill chunk 0 before the loop.
    let mut ch = 0usize;
    let mut v = v0[cc];
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                v = scan_forward_chunk::<S>(
                    &s_beta,
                    &s_u,
                    &s_th,
                    spike,
                    vpost,
                    v,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    32usize,
                );
            }
        } else if ch < chunks {
            let k0 = ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let k = k0 + (y - 1) + r * producers;
                if k < steps && valid {
                    let idx = k * cols + c;
                    xb[r] = f32::cast_from(r_beta[idx]);
                    xa[r] = f32::cast_from(r_alpha[idx]);
                    xt[r] = f32::cast_from(r_th[idx]);
                    xi[r] = f32::cast_from(i[idx]);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                let s_idx = buf + q * 32 + x;
                s_beta[s_idx] = sigmoid_burn(xb[r] + bb);
                s_u[s_idx] = softplus(xa[r] + ba) * xi[r];
                s_th[s_idx] = (xt[r] + bt).abs() + v_th_min;
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        last[c] = v;
    }
}

/// The staged backward: producer planes compute everything of a step but the carried
/// gradient for the chunk before the current one (the reverse order), plane 0 runs the
/// reverse recurrence over shared memory. Same arithmetic as the reference's backward.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn selective_backward_staged_kernel<I: Float, S: Float, G: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &Tensor<S>,
    spike: &Tensor<S>,
    grad: &Tensor<G>,
    g_i: &mut Tensor<I>,
    g_rb: &mut Tensor<I>,
    g_ra: &mut Tensor<I>,
    g_rt: &mut Tensor<I>,
    g_v0: &mut Tensor<f32>,
    g_bias: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, S, G)] _types: [StorageType; 3],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let v_first = v0[cc];
    let mut s_be = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_gg = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_vp = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_fa = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_al = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_ts = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let mut xb = Array::<f32>::new(per);
    let mut xa = Array::<f32>::new(per);
    let mut xt = Array::<f32>::new(per);
    let mut xi = Array::<f32>::new(per);
    let mut xg = Array::<f32>::new(per);
    let mut xv = Array::<f32>::new(per);
    let mut xs = Array::<f32>::new(per);
    // The reverse recurrence's carry: `acc` and the three bias sums (see `scan_reverse_chunk`).
    let mut carry = Array::<f32>::new(4usize);
    #[unroll]
    for n in 0..4 {
        carry[n] = 0.0f32;
    }
    // Chunks are numbered from the end: chunk `n` holds steps `[steps − (n+1)·chunk, steps − n·chunk)`
    // (clipped at 0), slot `q` its step `steps − n·chunk − 1 − q`.
    let mut ch = 0usize;
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                scan_reverse_chunk::<I>(
                    &s_be,
                    &s_gg,
                    &s_vp,
                    &s_fa,
                    &s_al,
                    &s_ts,
                    g_i,
                    g_rb,
                    g_ra,
                    g_rt,
                    &mut carry,
                    ch - 1,
                    x,
                    c,
                    valid,
                    cols,
                    steps,
                    chunk,
                    32usize,
                );
            }
        } else if ch < chunks {
            let top = steps - ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                if q < top && valid {
                    let k = top - 1 - q;
                    let idx = k * cols + c;
                    xb[r] = f32::cast_from(r_beta[idx]);
                    xa[r] = f32::cast_from(r_alpha[idx]);
                    xt[r] = f32::cast_from(r_th[idx]);
                    xi[r] = f32::cast_from(i[idx]);
                    xg[r] = f32::cast_from(grad[idx]);
                    xs[r] = f32::cast_from(spike[idx]);
                    let prev = f32::cast_from(vpost[select(k > 0, idx - cols, c)]);
                    xv[r] = select(k > 0, prev, v_first);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (y - 1) + r * producers;
                let s_idx = buf + q * 32 + x;
                let a = xa[r] + ba;
                s_be[s_idx] = sigmoid_burn(xb[r] + bb);
                s_gg[s_idx] = xg[r];
                s_vp[s_idx] = xv[r];
                s_fa[s_idx] = xi[r] * sigmoid_burn(a);
                s_al[s_idx] = softplus(a);
                s_ts[s_idx] = xs[r] * sign(xt[r] + bt);
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        g_v0[c] = carry[0];
        g_bias[c] = carry[1];
        g_bias[cols + c] = carry[2];
        g_bias[2 * cols + c] = carry[3];
    }
}
