//! Time-chunked inference scans for a long pass over few columns (one session's prefill):
//! the SNNBlock's block scan, the FFN neurons and the RMSNorm + input PLIF, with the results
//! of one walk over all steps, bit for bit.
//!
//! One session has only 7,168 block-scan columns and 2,688 FFN pairs, so a kernel that walks
//! each column's thousands of steps in order keeps a few warps per SM busy and runs at a
//! tenth to a half of the copy bandwidth. Here the steps are cut into chunks ([`time_chunk`]
//! and its siblings) and every `(chunk, column)` pair gets a unit:
//!
//! * **Pass 0** walks every chunk at once, chunk 0 from the true initial state and every other
//!   chunk from a guess (the session's initial state), writing the outputs and each chunk's
//!   final membrane.
//! * **Fix-up pass `p`** (`p = 1 … chunks − 1`) gives chunk `c` the final membrane of chunk
//!   `c − 1` from pass `p − 1` as its start. A chunk whose start did not change is done. Any
//!   other walks again from the new start and, in lockstep on the same loaded inputs, from the
//!   start it had: once the two membranes hold the same bits, every later step is the same as
//!   the walk already written, so it stops there. Only when they never meet does its final
//!   membrane change, for chunk `c + 1` in the next pass.
//!
//! By induction chunk `c` is exact after pass `c`, so `chunks − 1` fix-up passes always give
//! the sequential result; the PLIF membrane forgets its start geometrically (`β < 1`), so
//! where β is moderate (the FFN and input neurons, `σ(w)` around 0.5 at initialisation) the
//! walks meet within tens of steps and the fix-ups cost little. Where β is near 1 (the
//! SNNBlock's selective β, 0.80–0.99 before modulation) they stay apart for thousands of
//! steps, the fix-ups walk whole chunks one pass after another, and the cut is slower than one
//! walk: off by default there. The passes read finals from one buffer and write the other,
//! with no host round trip between them.
//!
//! The step is [`crate::cuda::wide`]'s ([`block_modulation`], [`plif_step`]) and the input
//! neuron's [`token_frames`] (whose walks meet at token ends): the same bits as the staged
//! and the wide kernels, so a prompt's logits do not depend on how its pass was cut
//! (`bench kernels`' `prefill` part checks it on the device).

use crate::cuda::common::{block_modulation, out_typed, pair, sigmoid_burn};
use crate::cuda::norm_plif_staged::{Frames, token_frames};
use crate::cuda::plif::plif_step;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube.
const UNITS: u32 = 256;
/// Steps whose loads a unit issues before computing them.
const GROUP: usize = 8;

/// Steps per chunk of the FFN neurons: the `time_chunk` knob (`NSACTOR_TIME_CHUNK`), 512 by
/// default; 0 is off.
pub fn time_chunk() -> usize {
    crate::tuning::current().time_chunk
}

/// Frames per chunk of the RMSNorm + input PLIF (`time_chunk_norm`, 2,048 by default).
pub fn time_chunk_norm() -> usize {
    crate::tuning::current().time_chunk_norm
}

/// Steps per chunk of the block scan (`time_chunk_block`, 0 by default: its selective β near
/// 1 keeps the walks apart for thousands of steps, and the cut ran slower than one walk).
pub fn time_chunk_block() -> usize {
    crate::tuning::current().time_chunk_block
}

/// The chunks a pass of `steps` over `cols` columns is cut into at `chunk` steps each, or
/// `None` where it runs in one walk: the knob is off, the pass has fewer than two chunks, or
/// it has columns enough to keep the GPU busy (from a sixteenth of the wide kernels'
/// threshold: at four sessions the FFN neurons gained nothing from the cut).
pub fn chunks_for(steps: usize, cols: usize, chunk: usize) -> Option<usize> {
    (chunk > 0 && steps >= 2 * chunk && cols < crate::cuda::wide::wide_cols() / 16)
        .then(|| steps.div_ceil(chunk))
}

/// Whether two membranes hold the same bits (so `+0`/`−0` differ and a NaN can meet itself).
#[cube]
fn same(a: f32, b: f32) -> bool {
    u32::reinterpret(a) == u32::reinterpret(b)
}

/// Where unit `u` (chunk `ch`; its predecessor's unit `u − cols`) starts a pass: the walk
/// written so far (`old`, fix-ups only) and the one this pass writes (`new`); `done` where it
/// has nothing to walk (chunk 0, or a fix-up whose start did not change: its final is carried
/// over). Records the start it walks from.
#[derive(CubeType)]
struct Start {
    old: f32,
    new: f32,
    done: bool,
}

#[allow(clippy::too_many_arguments)]
#[cube]
fn start(
    v0: f32,
    starts: &mut Tensor<f32>,
    finals_in: &Tensor<f32>,
    finals_out: &mut Tensor<f32>,
    u: usize,
    ch: usize,
    cols: usize,
    #[comptime] fixup: bool,
) -> Start {
    let mut old = 0.0f32;
    let mut new = v0;
    let mut done = false;
    if comptime![fixup] {
        if ch == 0 {
            done = true;
        } else {
            let from = finals_in[u - cols];
            let had = starts[u];
            if same(from, had) {
                done = true;
            } else {
                starts[u] = from;
                old = had;
                new = from;
            }
        }
        if done {
            finals_out[u] = finals_in[u];
        }
    } else {
        starts[u] = v0;
    }
    Start { old, new, done }
}

/// One pass of the block scan over `(chunk, column)` units `u = ch·cols + c`, `c = b·DN + j`
/// (see the module docs): pass 0 when not `fixup`. `starts`, `finals_in` and `finals_out` are
/// `[chunks·cols]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn block_scan_chunk_kernel<I: Float, O: Float>(
    y: &Tensor<I>,
    b_beta: &Tensor<f32>,
    b_alpha: &Tensor<f32>,
    b_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    vpost: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    starts: &mut Tensor<f32>,
    finals_in: &Tensor<f32>,
    finals_out: &mut Tensor<f32>,
    cols: u32,
    steps: u32,
    dn: u32,
    row_stride: u32,
    chunk: u32,
    chunks: u32,
    v_th_min: f32,
    #[comptime] fixup: bool,
    #[comptime] group: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let u = ABSOLUTE_POS;
    let cols = cols as usize;
    let chunks = chunks as usize;
    if u >= cols * chunks {
        terminate!();
    }
    let ch = u / cols;
    let c = u % cols;
    let st = start(v0[c], starts, finals_in, finals_out, u, ch, cols, fixup);
    if st.done {
        terminate!();
    }
    // The walk written so far (`va`, fix-ups only) and the one this pass writes (`vb`).
    let mut va = st.old;
    let mut vb = st.new;
    let steps = steps as usize;
    let dn = dn as usize;
    let row_stride = row_stride as usize;
    let batch = cols / dn;
    let b = c / dn;
    let j = c % dn;
    let (bb, ba, bt) = (b_beta[j], b_alpha[j], b_th[j]);
    let begin = ch * chunk as usize;
    let end = select(
        begin + (chunk as usize) < steps,
        begin + chunk as usize,
        steps,
    );
    let mut ri = Array::<f32>::new(group);
    let mut rb = Array::<f32>::new(group);
    let mut ra = Array::<f32>::new(group);
    let mut rt = Array::<f32>::new(group);
    let mut k0 = begin;
    while k0 < end {
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < end {
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
            if k < end {
                let m = block_modulation(ri[r], rb[r], ra[r], rt[r], bb, ba, bt, v_th_min);
                vb = plif_step(m.beta, vb, m.u, m.th);
                vpost[k * cols + c] = O::cast_from(vb);
                if comptime![fixup] {
                    va = plif_step(m.beta, va, m.u, m.th);
                    if same(va, vb) {
                        // From here on the written walk is this one: its final stands.
                        finals_out[u] = finals_in[u];
                        terminate!();
                    }
                }
            }
        }
        k0 += group;
    }
    finals_out[u] = vb;
    if ch + 1 == chunks {
        last[c] = vb;
    }
}

/// One pass of the FFN neurons over `(chunk, pair)` units `u = ch·pairs + p`, `p = b·D_ff + j`
/// (the gate and up neurons of channel `j`, both of which must meet): pass 0 when not `fixup`.
/// `starts`, `finals_in` and `finals_out` are `[chunks·pairs·2]` (gate, up).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn ffn_chunk_kernel<I: Float, O: Float>(
    i_gu: &Tensor<I>,
    w_g: &Tensor<f32>,
    w_u: &Tensor<f32>,
    th_g: &Tensor<f32>,
    th_u: &Tensor<f32>,
    v0: &Tensor<f32>,
    gv: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    starts: &mut Tensor<f32>,
    finals_in: &Tensor<f32>,
    finals_out: &mut Tensor<f32>,
    batch: u32,
    ff: u32,
    steps: u32,
    row_stride: u32,
    chunk: u32,
    chunks: u32,
    #[comptime] leak: bool,
    #[comptime] fixup: bool,
    #[comptime] group: usize,
    #[define(I, O)] _types: [StorageType; 2],
) {
    let u = ABSOLUTE_POS;
    let batch = batch as usize;
    let ff = ff as usize;
    let pairs = batch * ff;
    let chunks = chunks as usize;
    if u >= pairs * chunks {
        terminate!();
    }
    let ch = u / pairs;
    let p = pair(w_g, w_u, th_g, th_u, batch, ff, u % pairs);
    let (b, j) = (p.b, p.j);
    let (sg, su) = (b * 2 * ff + j, b * 2 * ff + ff + j);
    let mut ga = 0.0f32;
    let mut ua = 0.0f32;
    let mut gb = v0[sg];
    let mut ub = v0[su];
    if comptime![fixup] {
        if ch == 0 {
            finals_out[2 * u] = finals_in[2 * u];
            finals_out[2 * u + 1] = finals_in[2 * u + 1];
            terminate!();
        }
        let (new_g, new_u) = (finals_in[2 * (u - pairs)], finals_in[2 * (u - pairs) + 1]);
        let (old_g, old_u) = (starts[2 * u], starts[2 * u + 1]);
        if same(new_g, old_g) && same(new_u, old_u) {
            finals_out[2 * u] = finals_in[2 * u];
            finals_out[2 * u + 1] = finals_in[2 * u + 1];
            terminate!();
        }
        starts[2 * u] = new_g;
        starts[2 * u + 1] = new_u;
        ga = old_g;
        ua = old_u;
        gb = new_g;
        ub = new_u;
    } else {
        starts[2 * u] = gb;
        starts[2 * u + 1] = ub;
    }
    let steps = steps as usize;
    let row_stride = row_stride as usize;
    let begin = ch * chunk as usize;
    let end = select(
        begin + (chunk as usize) < steps,
        begin + chunk as usize,
        steps,
    );
    let mut xg = Array::<f32>::new(group);
    let mut xu = Array::<f32>::new(group);
    let mut k0 = begin;
    while k0 < end {
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < end {
                let row = (k * batch + b) * row_stride;
                xg[r] = f32::cast_from(i_gu[row + j]);
                xu[r] = f32::cast_from(i_gu[row + ff + j]);
            }
        }
        #[unroll]
        for r in 0..group {
            let k = k0 + r;
            if k < end {
                let (cg, cu) = (xg[r] * p.om_g, xu[r] * p.om_u);
                gb = plif_step(p.beta_g, gb, cg, p.tg);
                ub = plif_step(p.beta_u, ub, cu, p.tu);
                let o = (k * batch + b) * ff + j;
                if comptime![leak] {
                    gv[o] = O::cast_from((gb * p.om_g) * (ub * p.om_u));
                } else {
                    gv[o] = O::cast_from(gb * ub);
                }
                if comptime![fixup] {
                    ga = plif_step(p.beta_g, ga, cg, p.tg);
                    ua = plif_step(p.beta_u, ua, cu, p.tu);
                    if same(ga, gb) && same(ua, ub) {
                        finals_out[2 * u] = finals_in[2 * u];
                        finals_out[2 * u + 1] = finals_in[2 * u + 1];
                        terminate!();
                    }
                }
            }
        }
        k0 += group;
    }
    finals_out[2 * u] = gb;
    finals_out[2 * u + 1] = ub;
    if ch + 1 == chunks {
        last[sg] = gb;
        last[su] = ub;
    }
}

/// One pass of the RMSNorm + input PLIF over `(chunk, column)` units `u = ch·cols + c`,
/// `c = b·D + d`, each chunk `chunk` tokens of K frames (`1/RMS` per token row from `r`, as
/// the staged kernel reads it); two walks are compared at token ends. Pass 0 when not
/// `fixup`; `starts`, `finals_in` and `finals_out` are `[chunks·cols]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn norm_plif_chunk_kernel<O: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    y: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    starts: &mut Tensor<f32>,
    finals_in: &Tensor<f32>,
    finals_out: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    chunk: u32,
    chunks: u32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] mean_frames: bool,
    #[comptime] fixup: bool,
    #[define(O)] _out: StorageType,
) {
    let u = ABSOLUTE_POS;
    let cols = cols as usize;
    let chunks = chunks as usize;
    if u >= cols * chunks {
        terminate!();
    }
    let ch = u / cols;
    let c = u % cols;
    let st = start(v0[c], starts, finals_in, finals_out, u, ch, cols, fixup);
    if st.done {
        terminate!();
    }
    // The walk written so far (`va`, fix-ups only) and the one this pass writes (`vb`).
    let mut va = st.old;
    let mut vb = st.new;
    let dim = dim as usize;
    let tokens = tokens as usize;
    let rows = cols / dim;
    let b = c / dim;
    let d = c % dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    // `token_frames` writes no `V_post` here; it takes a tensor for it all the same.
    let begin = ch * chunk as usize;
    let end = select(
        begin + (chunk as usize) < tokens,
        begin + chunk as usize,
        tokens,
    );
    for t in begin..end {
        let cur = x[t * cols + c] * r[t * rows + b] * nw * one_minus;
        let frames = Frames {
            beta,
            one_minus,
            th,
            t,
            c,
            cols,
        };
        vb = token_frames::<O>(&frames, vb, cur, y, last, k, leak, false, mean_frames);
        if comptime![fixup] {
            #[unroll]
            for _j in 0..k {
                va = plif_step(beta, va, cur, th);
            }
            if same(va, vb) {
                finals_out[u] = finals_in[u];
                terminate!();
            }
        }
    }
    finals_out[u] = vb;
    if ch + 1 == chunks {
        last[c] = vb;
    }
}

/// The three `[n]` f32 buffers of the passes: the starts and two finals.
fn buffers<R: CubeRuntime>(like: &CubeTensor<R>, n: usize) -> [CubeTensor<R>; 3] {
    [(); 3].map(|_| out_typed(like, Shape::new([n]), DType::F32))
}

/// [`crate::cuda::decode`]'s block scan in `chunks` chunks of `chunk` steps (the launcher
/// there has checked and allocated `vpost` and `last`; geometry: columns, steps, DN, row
/// stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scan<R: CubeRuntime>(
    y: CubeTensor<R>,
    [bb, ba, bt]: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    vpost: CubeTensor<R>,
    last: CubeTensor<R>,
    (cols, steps, dn, row_stride): (usize, usize, usize, usize),
    v_th_min: f32,
    (chunk, chunks): (usize, usize),
) {
    let types = [y.dtype.into(), vpost.dtype.into()];
    let [starts, mut fin, mut fout] = buffers(&y, chunks * cols);
    let units = (cols * chunks).div_ceil(UNITS as usize) as u32;
    for pass in 0..chunks {
        block_scan_chunk_kernel::launch::<R>(
            &y.client.clone(),
            CubeCount::Static(units, 1, 1),
            CubeDim::new_1d(UNITS),
            y.clone().into_tensor_arg(),
            bb.clone().into_tensor_arg(),
            ba.clone().into_tensor_arg(),
            bt.clone().into_tensor_arg(),
            v0.clone().into_tensor_arg(),
            vpost.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            fin.clone().into_tensor_arg(),
            fout.clone().into_tensor_arg(),
            cols as u32,
            steps as u32,
            dn as u32,
            row_stride as u32,
            chunk as u32,
            chunks as u32,
            v_th_min,
            pass > 0,
            GROUP,
            types,
        );
        std::mem::swap(&mut fin, &mut fout);
    }
}

/// [`crate::cuda::ffn`]'s inference neurons in `chunks` chunks of `chunk` steps (the
/// launcher there has checked and allocated `gv` and `last`; geometry: steps, batch, D_ff,
/// row stride; `params`: `w_gate, w_up, th_gate, th_up`).
pub(crate) fn ffn_infer<R: CubeRuntime>(
    i_gu: CubeTensor<R>,
    [w_g, w_u, th_g, th_u]: [CubeTensor<R>; 4],
    v0: CubeTensor<R>,
    [gv, last]: [CubeTensor<R>; 2],
    (steps, batch, ff, row_stride): (usize, usize, usize, usize),
    leak: bool,
    (chunk, chunks): (usize, usize),
) {
    let types = [i_gu.dtype.into(), gv.dtype.into()];
    let pairs = batch * ff;
    let [starts, mut fin, mut fout] = buffers(&i_gu, 2 * chunks * pairs);
    let units = (pairs * chunks).div_ceil(UNITS as usize) as u32;
    for pass in 0..chunks {
        ffn_chunk_kernel::launch::<R>(
            &i_gu.client.clone(),
            CubeCount::Static(units, 1, 1),
            CubeDim::new_1d(UNITS),
            i_gu.clone().into_tensor_arg(),
            w_g.clone().into_tensor_arg(),
            w_u.clone().into_tensor_arg(),
            th_g.clone().into_tensor_arg(),
            th_u.clone().into_tensor_arg(),
            v0.clone().into_tensor_arg(),
            gv.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            fin.clone().into_tensor_arg(),
            fout.clone().into_tensor_arg(),
            batch as u32,
            ff as u32,
            steps as u32,
            row_stride as u32,
            chunk as u32,
            chunks as u32,
            leak,
            pass > 0,
            GROUP,
            types,
        );
        std::mem::swap(&mut fin, &mut fout);
    }
}

/// [`crate::cuda::norm_plif`]'s inference forward in `chunks` chunks of `chunk` tokens (the
/// launcher there has computed `r` and allocated `y` and `last`; geometry: columns, D,
/// tokens, K).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_plif<R: CubeRuntime>(
    [x, r, norm_w, w, v_th, v0]: [CubeTensor<R>; 6],
    [y, last]: [CubeTensor<R>; 2],
    (cols, dim, tokens, k): (usize, usize, usize, usize),
    leak: bool,
    mean_frames: bool,
    (chunk, chunks): (usize, usize),
) {
    let [starts, mut fin, mut fout] = buffers(&x, chunks * cols);
    let units = (cols * chunks).div_ceil(UNITS as usize) as u32;
    for pass in 0..chunks {
        norm_plif_chunk_kernel::launch::<R>(
            &x.client.clone(),
            CubeCount::Static(units, 1, 1),
            CubeDim::new_1d(UNITS),
            x.clone().into_tensor_arg(),
            r.clone().into_tensor_arg(),
            norm_w.clone().into_tensor_arg(),
            w.clone().into_tensor_arg(),
            v_th.clone().into_tensor_arg(),
            v0.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            fin.clone().into_tensor_arg(),
            fout.clone().into_tensor_arg(),
            cols as u32,
            dim as u32,
            tokens as u32,
            chunk as u32,
            chunks as u32,
            k,
            leak,
            mean_frames,
            pass > 0,
            y.dtype.into(),
        );
        std::mem::swap(&mut fin, &mut fout);
    }
}
