//! The SNNBlock's inference block scan for a long pass over few columns (one session's prompt):
//! the staged kernel of [`crate::cuda::decode`] with its producers' loads issued a chunk ahead.
//!
//! One session has 7,168 columns, 224 cubes of 32: one or two cubes an SM. In the staged kernel
//! each producer plane loads its steps of a chunk, waits for them, computes their modulation and
//! meets the consumer at the barrier, so every chunk pays the loads' whole latency with little
//! else on the SM to cover it (~99 ns a step at 16,384 frames on an H100). Here a producer holds
//! the next chunk's loads in flight in registers while it computes the current chunk's
//! modulation, and reads the biases once. The arithmetic of every step is the staged kernel's
//! ([`block_modulation`], [`plif_step`], in the same order), so the bits are the same (`bench
//! kernels`' prefill part holds it against the staged kernel on the device).

use crate::cuda::common::block_modulation;
use crate::cuda::plif::plif_step;
use cubecl::prelude::*;

/// See the module: `y` `[TK·B, ≥ 4·DN]` (`[i | r_β | r_α | r_th]`, row stride `row_stride`),
/// the biases `[DN]`, `v0` `[B, DN]` → `V_post` `[TK·B, DN]` and the final membrane `[B, DN]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
pub(crate) fn block_scan_ahead_kernel<I: Float, O: Float>(
    y: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dn: u32,
    row_stride: u32,
    v_th_min: f32,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let cols = cols as usize;
    let steps = steps as usize;
    let chunks = chunks as usize;
    let dn = dn as usize;
    let row_stride = row_stride as usize;
    let x = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let c = CUBE_POS_X as usize * 32 + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let batch = cols / dn;
    let b = cc / dn;
    let j = cc % dn;
    let per = comptime!(chunk / producers);
    let mut s_beta = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let mut s_th = SharedMemory::<f32>::new(comptime!(2 * chunk * 32));
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    // This producer's steps of the chunk being computed (`r*`) and of the next one (`n*`).
    let mut ri = Array::<f32>::new(per);
    let mut rb = Array::<f32>::new(per);
    let mut ra = Array::<f32>::new(per);
    let mut rt = Array::<f32>::new(per);
    let mut ni = Array::<f32>::new(per);
    let mut nb = Array::<f32>::new(per);
    let mut na = Array::<f32>::new(per);
    let mut nt = Array::<f32>::new(per);
    if plane > 0 {
        #[unroll]
        for r in 0..per {
            let k = (plane - 1) + r * producers;
            if k < steps && valid {
                let base = (k * batch + b) * row_stride + j;
                ri[r] = f32::cast_from(y[base]);
                rb[r] = f32::cast_from(y[base + dn]);
                ra[r] = f32::cast_from(y[base + 2 * dn]);
                rt[r] = f32::cast_from(y[base + 3 * dn]);
            }
        }
    }
    let mut v = v0[cc];
    let mut ch = 0usize;
    while ch <= chunks {
        if plane == 0 {
            if ch > 0 {
                let k0 = (ch - 1) * chunk;
                let buf = ((ch - 1) % 2) * chunk * 32;
                #[unroll]
                for q in 0..chunk {
                    let k = k0 + q;
                    if k < steps {
                        let s_idx = buf + q * 32 + x;
                        v = plif_step(s_beta[s_idx], v, s_u[s_idx], s_th[s_idx]);
                        if valid {
                            vpost[k * cols + c] = O::cast_from(v);
                        }
                    }
                }
            }
        } else if ch < chunks {
            let k0 = ch * chunk;
            let buf = (ch % 2) * chunk * 32;
            // The next chunk's loads go out before this chunk's transcendentals.
            #[unroll]
            for r in 0..per {
                let k = k0 + chunk + (plane - 1) + r * producers;
                if k < steps && valid {
                    let base = (k * batch + b) * row_stride + j;
                    ni[r] = f32::cast_from(y[base]);
                    nb[r] = f32::cast_from(y[base + dn]);
                    na[r] = f32::cast_from(y[base + 2 * dn]);
                    nt[r] = f32::cast_from(y[base + 3 * dn]);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (plane - 1) + r * producers;
                if k0 + q < steps && valid {
                    let s_idx = buf + q * 32 + x;
                    let m = block_modulation(ri[r], rb[r], ra[r], rt[r], bb, ba, bt, v_th_min);
                    s_beta[s_idx] = m.beta;
                    s_u[s_idx] = m.u;
                    s_th[s_idx] = m.th;
                }
            }
            #[unroll]
            for r in 0..per {
                ri[r] = ni[r];
                rb[r] = nb[r];
                ra[r] = na[r];
                rt[r] = nt[r];
            }
        }
        sync_cube();
        ch += 1;
    }
    if plane == 0 && valid {
        last[c] = v;
    }
}
