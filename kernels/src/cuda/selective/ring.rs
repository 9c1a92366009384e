//! The selective kernels through an asynchronous ring: producer planes issue `cp.async` copies of
//! a chunk's raw inputs `stages − 1` chunks ahead into a ring of stages in shared memory, each
//! stage tracked by its own mbarrier, then modulate the current chunk from the ring into the
//! double buffer plane 0 scans. No register holds a load in flight. Where `cp.async` cannot
//! copy (bf16 rows of odd width: even its 4-byte copies would straddle rows), the producers
//! load and store plainly through the same ring ([`Ring::direct`]): the same arithmetic, bit for bit.

use super::chunk::{scan_forward_chunk, scan_reverse_chunk};
use crate::cuda::common::{exp_neg_abs, sigmoid_mod, sigmoid_of, sign, softplus_mod, softplus_of};
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

/// A ring kernel's compile-time shape.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct Ring {
    /// Steps per chunk, a multiple of `producers`.
    pub chunk: usize,
    /// Producer planes (plane 0 scans).
    pub producers: usize,
    /// Ring stages in shared memory (2 to 4), one mbarrier each.
    pub stages: usize,
    /// Columns per cube.
    pub width: usize,
    /// Plain loads and stores into the ring instead of `cp.async` (then every pack is 1).
    pub direct: bool,
    /// Whether the forward writes the spikes (an untracked forward needs only `V_post`).
    pub spikes: bool,
    /// σ and softplus as burn composes them (the `modulation = exact` knob).
    pub exact: bool,
}

/// Issues this producer unit's share of the asynchronous copies of forward chunk `cn` (four
/// arrays) into ring stage `cn % stages` and commits them to the stage's barrier.
#[allow(clippy::too_many_arguments)]
#[cube]
fn issue_chunk<I: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    raw: &mut SharedMemory<I>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    cn: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
    steps: usize,
    #[comptime] pack: usize,
    #[comptime] ring: Ring,
) {
    let plane = comptime!(ring.chunk * ring.width);
    let stage = cn % comptime!(ring.stages);
    let rb = stage * 4 * plane;
    let ra = rb + plane;
    let rt = rb + 2 * plane;
    let ii = rb + 3 * plane;
    let k0 = cn * comptime!(ring.chunk);
    let at = Span {
        origin: k0,
        steps,
        lane,
        x,
        cube_col,
        cols,
    };
    copy_steps::<I>(r_beta, raw, rb, &at, false, 0usize, pack, ring);
    copy_steps::<I>(r_alpha, raw, ra, &at, false, 0usize, pack, ring);
    copy_steps::<I>(r_th, raw, rt, &at, false, 0usize, pack, ring);
    copy_steps::<I>(i, raw, ii, &at, false, 0usize, pack, ring);
    commit_stage(bar0, bar1, bar2, bar3, stage);
}

/// Counts this unit's copies issued so far, and its arrival, on ring stage `s`'s barrier: the
/// stage's phase completes once every producer unit has arrived and all their copies landed.
#[cube]
fn commit_stage(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    s: usize,
) {
    if s == 0 {
        bar0.commit_copy_async();
        let _t = bar0.arrive();
    } else if s == 1 {
        bar1.commit_copy_async();
        let _t = bar1.arrive();
    } else if s == 2 {
        bar2.commit_copy_async();
        let _t = bar2.arrive();
    } else {
        bar3.commit_copy_async();
        let _t = bar3.arrive();
    }
}

/// Waits until chunk `ch`'s copies have landed in ring stage `ch % stages`: the stage's
/// `ch / stages`-th phase, whose parity alternates.
#[cube]
fn wait_stage(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    ch: usize,
    #[comptime] stages: usize,
) {
    let s = ch % stages;
    let parity = ((ch / stages) % 2) as u32;
    if s == 0 {
        bar0.wait_parity(parity);
    } else if s == 1 {
        bar1.wait_parity(parity);
    } else if s == 2 {
        bar2.wait_parity(parity);
    } else {
        bar3.wait_parity(parity);
    }
}

/// The selective forward: plane 0 of a cube runs the recurrence over `width` columns; producer
/// planes issue `cp.async` copies of the raw projections `stages − 1` chunks ahead into a ring in shared memory, each
/// stage tracked by its own mbarrier, then modulate the current chunk from the ring into the
/// double buffer plane 0 scans. No register holds a load in flight, so the loads ahead are
/// bounded by shared memory, not by registers. Same recurrence as the reference
/// ([`crate::reference`]) term for term; σ and softplus as [`exp_neg_abs`] says.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub(crate) fn selective_forward_kernel<I: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    spike: &mut Tensor<I>,
    vpost: &mut Tensor<I>,
    last: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    chunks: u32,
    dim: u32,
    v_th_min: f32,
    #[comptime] pack: usize,
    #[comptime] ring: Ring,
    #[define(I)] _stored: StorageType,
) {
    let chunk = comptime!(ring.chunk);
    let producers = comptime!(ring.producers);
    let stages = comptime!(ring.stages);
    let width = comptime!(ring.width);
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let cube_col = CUBE_POS_X as usize * width;
    let c = cube_col + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let plane = comptime!(chunk * width);
    let mut raw = SharedMemory::<I>::new_aligned(comptime!(stages * 4 * chunk * width), 16usize);
    let mut s_beta = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_u = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_th = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    // One mbarrier per ring stage; every producer unit arrives once per use of a stage, and
    // its copies count through `commit_copy_async`.
    let arrivals = comptime!((producers * width) as u32);
    let bar0 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar1 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar2 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar3 = Barrier::shared(arrivals, UNIT_POS == 0);
    sync_cube();
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let lane = y - 1;
    if y > 0 {
        #[unroll]
        for cn in 0..comptime!(stages - 1) {
            if cn < chunks {
                issue_chunk::<I>(
                    i, r_beta, r_alpha, r_th, &mut raw, &bar0, &bar1, &bar2, &bar3, cn, lane, x,
                    cube_col, cols, steps, pack, ring,
                );
            }
        }
    }
    let mut ch = 0usize;
    let mut v = v0[cc];
    while ch <= chunks {
        if y == 0 {
            if ch > 0 {
                v = scan_forward_chunk::<I>(
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
                    width,
                    comptime!(ring.spikes),
                );
            }
        } else if ch < chunks {
            let cn = ch + comptime!(stages - 1);
            if cn < chunks {
                issue_chunk::<I>(
                    i, r_beta, r_alpha, r_th, &mut raw, &bar0, &bar1, &bar2, &bar3, cn, lane, x,
                    cube_col, cols, steps, pack, ring,
                );
            }
            let s = ch % stages;
            wait_stage(&bar0, &bar1, &bar2, &bar3, ch, stages);
            let base = s * 4 * plane;
            let buf = (ch % 2) * plane;
            #[unroll]
            for r in 0..per {
                let q = lane + r * producers;
                let o = base + q * width + x;
                let s_idx = buf + q * width + x;
                s_beta[s_idx] = sigmoid_mod(f32::cast_from(raw[o]) + bb, comptime!(ring.exact));
                s_u[s_idx] =
                    softplus_mod(f32::cast_from(raw[o + plane]) + ba, comptime!(ring.exact))
                        * f32::cast_from(raw[o + 3 * plane]);
                s_th[s_idx] = (f32::cast_from(raw[o + 2 * plane]) + bt).abs() + v_th_min;
            }
        }
        sync_cube();
        ch += 1;
    }
    if y == 0 && valid {
        last[c] = v;
    }
}

/// Where a producer unit copies: the chunk's `origin` step, the step count, the unit's lane
/// (its producer plane less one) and column `x` in a cube whose first column is `cube_col`, of
/// `cols` columns.
#[derive(CubeType)]
struct Span {
    origin: usize,
    steps: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
}

/// Issues this producer unit's share of the copies of one array's chunk into `dst` at
/// `dst_base` (slot `q` at `q·width`). Forward, slot `q` is step `origin + q` (steps past
/// `steps` are skipped); in reverse (`reverse`), step `origin − 1 − q` (slots past `origin` are
/// skipped). `shift` 1 reads the row before each step (`V_post` of step `k − 1`; step 0 has
/// none and is left to the caller). Each `cp.async` moves `pack` neighbouring columns global →
/// shared without a register: 16 bytes (8 bf16) or 4 (1 f32 or 2 bf16), so a plane
/// of `width` units copies `pack` slots' rows per instruction; with [`Ring::direct`] a plain
/// load and store moves one element. A plane copies the slots it later reads; the stage's
/// barrier makes every unit's copies visible to all.
#[allow(clippy::too_many_arguments)]
#[cube]
fn copy_steps<T: Float>(
    src: &Tensor<T>,
    dst: &mut SharedMemory<T>,
    dst_base: usize,
    at: &Span,
    #[comptime] reverse: bool,
    #[comptime] shift: usize,
    #[comptime] pack: usize,
    #[comptime] ring: Ring,
) {
    let width = comptime!(ring.width);
    let per = comptime!(ring.chunk / ring.producers);
    let producers = comptime!(ring.producers);
    let row_lanes = comptime!(ring.width / pack);
    let origin = at.origin;
    let col = (at.x % row_lanes) * pack;
    let c = at.cube_col + col;
    #[unroll]
    for r0 in 0..comptime!(per.div_ceil(pack)) {
        let r = r0 * pack + at.x / row_lanes;
        let q = at.lane + r * producers;
        let mut in_chunk = origin + q < at.steps;
        if comptime![reverse] {
            in_chunk = q < origin;
        }
        if r < per && in_chunk && c < at.cols {
            let mut k = origin + q;
            if comptime![reverse] {
                k = origin - 1 - q;
            }
            if k >= shift {
                let idx = (k - shift) * at.cols + c;
                let o = dst_base + q * width + col;
                if comptime![ring.direct] {
                    dst[o] = src[idx];
                } else {
                    copy_async(
                        &src.slice(idx, idx + pack),
                        &mut dst.slice_mut(o, o + pack),
                        comptime!(pack as u32),
                    );
                }
            }
        }
    }
}

/// Issues a producer unit's copies of backward chunk `cn` (seven arrays) into ring stage
/// `cn % stages` and commits them to the stage's barrier.
#[allow(clippy::too_many_arguments)]
#[cube]
fn issue_reverse<I: Float, S: Float, G: Float>(
    i: &Tensor<I>,
    r_beta: &Tensor<I>,
    r_alpha: &Tensor<I>,
    r_th: &Tensor<I>,
    vpost: &Tensor<S>,
    spike: &Tensor<S>,
    grad: &Tensor<G>,
    raw_i: &mut SharedMemory<I>,
    raw_s: &mut SharedMemory<S>,
    raw_g: &mut SharedMemory<G>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    bar3: &Shared<Barrier>,
    cn: usize,
    steps: usize,
    lane: usize,
    x: usize,
    cube_col: usize,
    cols: usize,
    #[comptime] packs: (usize, usize, usize),
    #[comptime] ring: Ring,
) {
    let plane = comptime!(ring.chunk * ring.width);
    let (pi, ps, pg) = packs;
    let top = steps - cn * comptime!(ring.chunk);
    let stage = cn % comptime!(ring.stages);
    let bi = stage * 4 * plane;
    let bs = stage * 2 * plane;
    let bg = stage * plane;
    let at = Span {
        origin: top,
        steps,
        lane,
        x,
        cube_col,
        cols,
    };
    copy_steps::<I>(r_beta, raw_i, bi, &at, true, 0usize, pi, ring);
    copy_steps::<I>(r_alpha, raw_i, bi + plane, &at, true, 0usize, pi, ring);
    copy_steps::<I>(r_th, raw_i, bi + 2 * plane, &at, true, 0usize, pi, ring);
    copy_steps::<I>(i, raw_i, bi + 3 * plane, &at, true, 0usize, pi, ring);
    copy_steps::<S>(spike, raw_s, bs, &at, true, 0usize, ps, ring);
    copy_steps::<S>(vpost, raw_s, bs + plane, &at, true, 1usize, ps, ring);
    copy_steps::<G>(grad, raw_g, bg, &at, true, 0usize, pg, ring);
    commit_stage(bar0, bar1, bar2, bar3, stage);
}

/// The selective backward, as [`selective_forward_kernel`] is to the forward: producer
/// planes copy the seven inputs of a chunk `stages − 1` chunks ahead (the reverse order), then
/// compute everything of a step but the carried gradient from the ring into the double buffer
/// plane 0 runs the reverse recurrence over. Same recurrence as the reference's backward.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub(crate) fn selective_backward_kernel<I: Float, S: Float, G: Float>(
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
    #[comptime] packs: (usize, usize, usize),
    #[comptime] ring: Ring,
    #[define(I, S, G)] _types: [StorageType; 3],
) {
    let chunk = comptime!(ring.chunk);
    let producers = comptime!(ring.producers);
    let stages = comptime!(ring.stages);
    let width = comptime!(ring.width);
    let cols = cols as usize;
    let steps = steps as usize;
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let cube_col = CUBE_POS_X as usize * width;
    let c = cube_col + x;
    let valid = c < cols;
    let cc = select(valid, c, 0);
    let j = cc % (dim as usize);
    let bb = b_beta[j];
    let ba = b_alpha[j];
    let bt = b_th[j];
    let v_first = v0[cc];
    let plane = comptime!(chunk * width);
    let mut raw_i = SharedMemory::<I>::new_aligned(comptime!(stages * 4 * chunk * width), 16usize);
    let mut raw_s = SharedMemory::<S>::new_aligned(comptime!(stages * 2 * chunk * width), 16usize);
    let mut raw_g = SharedMemory::<G>::new_aligned(comptime!(stages * chunk * width), 16usize);
    let mut s_be = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_gg = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_vp = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_fa = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_al = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let mut s_ts = SharedMemory::<f32>::new(comptime!(2 * chunk * width));
    let arrivals = comptime!((producers * width) as u32);
    let bar0 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar1 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar2 = Barrier::shared(arrivals, UNIT_POS == 0);
    let bar3 = Barrier::shared(arrivals, UNIT_POS == 0);
    sync_cube();
    let chunks = chunks as usize;
    let per = comptime!(chunk / producers);
    let lane = y - 1;
    if y > 0 {
        #[unroll]
        for cn in 0..comptime!(stages - 1) {
            if cn < chunks {
                issue_reverse::<I, S, G>(
                    i, r_beta, r_alpha, r_th, vpost, spike, grad, &mut raw_i, &mut raw_s,
                    &mut raw_g, &bar0, &bar1, &bar2, &bar3, cn, steps, lane, x, cube_col, cols,
                    packs, ring,
                );
            }
        }
    }
    // The reverse recurrence's carry: `acc` and the three bias sums (see `scan_reverse_chunk`).
    let mut carry = Array::<f32>::new(4usize);
    #[unroll]
    for n in 0..4 {
        carry[n] = 0.0f32;
    }
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
                    width,
                );
            }
        } else if ch < chunks {
            let cn = ch + comptime!(stages - 1);
            if cn < chunks {
                issue_reverse::<I, S, G>(
                    i, r_beta, r_alpha, r_th, vpost, spike, grad, &mut raw_i, &mut raw_s,
                    &mut raw_g, &bar0, &bar1, &bar2, &bar3, cn, steps, lane, x, cube_col, cols,
                    packs, ring,
                );
            }
            let stage = ch % stages;
            wait_stage(&bar0, &bar1, &bar2, &bar3, ch, stages);
            let top = steps - ch * chunk;
            let buf = (ch % 2) * plane;
            let bi = stage * 4 * plane;
            let bs = stage * 2 * plane;
            let bg = stage * plane;
            #[unroll]
            for r in 0..per {
                let q = lane + r * producers;
                let o = q * width + x;
                let s_idx = buf + o;
                let a = f32::cast_from(raw_i[bi + plane + o]) + ba;
                let prev = f32::cast_from(raw_s[bs + plane + o]);
                let first = q + 1 >= top;
                // σ(a) and softplus(a) share `e^{−|a|}`.
                let t = exp_neg_abs(a);
                s_be[s_idx] =
                    sigmoid_mod(f32::cast_from(raw_i[bi + o]) + bb, comptime!(ring.exact));
                s_gg[s_idx] = f32::cast_from(raw_g[bg + o]);
                s_vp[s_idx] = select(first, v_first, prev);
                s_fa[s_idx] = f32::cast_from(raw_i[bi + 3 * plane + o])
                    * sigmoid_of(a, t, comptime!(ring.exact));
                s_al[s_idx] = softplus_of(a, t, comptime!(ring.exact));
                s_ts[s_idx] = f32::cast_from(raw_s[bs + o])
                    * sign(f32::cast_from(raw_i[bi + 2 * plane + o]) + bt);
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
