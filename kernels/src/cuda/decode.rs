//! The decoding fusions as CubeCL kernels (forward only), each replacing several tensor ops whose
//! ≈ 11 µs of host time apiece set the speed of a decoding step: the SNNBlock's selective scan
//! read straight from its merged projection, its gated output with the skip path, a sublayer's
//! residual update with its centred out-projection, and the edge's RMSNorm before the head.
//!
//! The model falls back to the compositions where a backend does not fuse
//! ([`InferOps::block_scan_fused`] and its siblings return `None`).
//!
//! [`InferOps::block_scan_fused`]: crate::InferOps::block_scan_fused

use crate::cuda::common::{
    PLANE, STAGE_COLS, block_modulation, gemm_input, launch_guarded, out_like, out_typed,
    sigmoid_burn, stage_shape,
};
use crate::cuda::plif::plif_step;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The SNNBlock's selective scan for a decoding step, read straight from the merged projection
/// `y` `[TK·B, W]` (f32, or bf16 where the scans' inputs are stored in bf16; row stride
/// `row_stride`; columns `[0, DN)` the input current `i`, then `r_β, r_α, r_th`): the modulation and recurrence of the training selective forward op for op,
/// writing `V_post` `[TK·B, DN]` and the final state, no spikes. It replaces the four column
/// slices' copies, the scan and the final state's copy of the composed path.
///
/// Staged like the FFN neurons' kernel: a cube holds 32 columns; its producer planes load a
/// chunk of steps and compute their modulation (four transcendentals a step, independent of the
/// membrane) into shared memory, one step per plane at a time, while plane 0 runs the
/// recurrence over the previous chunk. A decoding step has only `B·DN` columns (7,168 at the
/// 0.9B for one session), so one unit per column walking every step's modulation itself leaves
/// each scheduler with less than one plane and its whole dependent chain exposed.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn block_scan_kernel<I: Float, O: Float>(
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
            // Every load of the plane's steps in flight before the first transcendental.
            let mut ri = Array::<f32>::new(per);
            let mut rb = Array::<f32>::new(per);
            let mut ra = Array::<f32>::new(per);
            let mut rt = Array::<f32>::new(per);
            #[unroll]
            for r in 0..per {
                let k = k0 + (plane - 1) + r * producers;
                if k < steps && valid {
                    let base = (k * batch + b) * row_stride + j;
                    ri[r] = f32::cast_from(y[base]);
                    rb[r] = f32::cast_from(y[base + dn]);
                    ra[r] = f32::cast_from(y[base + 2 * dn]);
                    rt[r] = f32::cast_from(y[base + 3 * dn]);
                }
            }
            #[unroll]
            for r in 0..per {
                let q = (plane - 1) + r * producers;
                if k0 + q < steps && valid {
                    let s_idx = buf + q * 32 + x;
                    let m = block_modulation(
                        ri[r], rb[r], ra[r], rt[r], b_beta[j], b_alpha[j], b_th[j], v_th_min,
                    );
                    s_beta[s_idx] = m.beta;
                    s_u[s_idx] = m.u;
                    s_th[s_idx] = m.th;
                }
            }
        }
        sync_cube();
        ch += 1;
    }
    if plane == 0 && valid {
        last[c] = v;
    }
}

/// `out·σ(gate) + skip` with `gate`, `skip` the columns `[gate_col, gate_col + D)` and
/// `[skip_col, skip_col + D)` of `y` (row stride `row_stride`): the SNNBlock's output in one
/// launch instead of three.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn gate_skip_kernel(
    out: &Tensor<f32>,
    y: &Tensor<f32>,
    res: &mut Tensor<f32>,
    n: u32,
    dim: u32,
    row_stride: u32,
    gate_col: u32,
    skip_col: u32,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let dim = dim as usize;
    let base = (i / dim) * (row_stride as usize) + i % dim;
    let g = sigmoid_burn(y[base + gate_col as usize]);
    let prod = out[i] * g;
    res[i] = prod + y[base + skip_col as usize];
}

/// `h + (r − mean_D(r))` per row, one cube of `planes` planes per row: the residual update with the centred
/// out-projection in one launch instead of three.
#[cube(launch, launch_unchecked)]
fn centred_residual_kernel(
    h: &Tensor<f32>,
    r: &Tensor<f32>,
    out: &mut Tensor<f32>,
    dim: u32,
    dim_f: f32,
    #[comptime] planes: usize,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut part = 0.0f32;
    let mut d = lane;
    while d < dim {
        part += r[row * dim + d];
        d += width;
    }
    let mut shared = SharedMemory::<f32>::new(planes);
    let s = plane_sum(part);
    if UNIT_POS_PLANE == 0 {
        shared[lane / 32] = s;
    }
    sync_cube();
    let mut total = 0.0f32;
    #[unroll]
    for p in 0..planes {
        total += shared[p];
    }
    let mean = total / dim_f;
    let mut d = lane;
    while d < dim {
        let i = row * dim + d;
        let centred = r[i] - mean;
        out[i] = h[i] + centred;
        d += width;
    }
}

/// RMSNorm of each row with a gain, one cube per row: `x` `[rows, D]` f32 →
/// `x / √(mean(x²) + eps) · gain` in `O` (the GEMM's input type).
#[cube(launch, launch_unchecked)]
fn rms_norm_kernel<O: Float>(
    x: &Tensor<f32>,
    gain: &Tensor<f32>,
    y: &mut Tensor<O>,
    dim: u32,
    eps: f32,
    #[comptime] planes: usize,
    #[define(O)] _out: StorageType,
) {
    let dim = dim as usize;
    let row = CUBE_POS;
    let lane = UNIT_POS as usize;
    let width = comptime![planes * 32];
    let mut ss = 0.0f32;
    let mut d = lane;
    while d < dim {
        let v = x[row * dim + d];
        ss += v * v;
        d += width;
    }
    let mut sums = SharedMemory::<f32>::new(planes);
    let s = plane_sum(ss);
    if UNIT_POS_PLANE == 0 {
        sums[lane / 32] = s;
    }
    sync_cube();
    let mut total = 0.0f32;
    #[unroll]
    for p in 0..planes {
        total += sums[p];
    }
    let r = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
    let mut d = lane;
    while d < dim {
        y[row * dim + d] = O::cast_from(x[row * dim + d] * r * gain[d]);
        d += width;
    }
}

/// Planes per row of [`centred_residual`] (a decoding step has few rows).
const CENTRED_PLANES: usize = 8;

/// `(producer planes, steps per chunk)` of [`block_scan`]; `$NSACTOR_STAGE_BLOCK_SCAN` (`PxC`)
/// overrides it. A decoding step's 16 frames (K at the 0.9B) fit one chunk.
const STAGE_BLOCK_SCAN: (usize, usize) = (8, 16);
/// The same for a longer pass (more than 64 steps: prefill chunks beside running sessions,
/// short prompts): chunks of 64 steps, 1.61 against 1.74 ms at one session's 16,384 frames on
/// an H200 (fewer producers ran far slower: 4 × 64 2.73 ms).
const STAGE_BLOCK_SCAN_LONG: (usize, usize) = (8, 64);
/// The same for [`BlockScanKernel::Ahead`] (one session's pass of more than 64 steps).
const STAGE_BLOCK_SCAN_AHEAD: (usize, usize) = (16, 32);

/// `(stride of a row, columns)` of a 2-D f32 tensor whose columns are contiguous and whose
/// rows do not overlap (a broadcast row is not such a view: the kernels would read past its
/// buffer), else `None`.
fn rows_view<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<(usize, usize)> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    (matches!(t.dtype, DType::F32 | DType::BF16)
        && shape.num_dims() == 2
        && (strides[1] == 1 || shape[1] <= 1)
        && (strides[0] >= shape[1] || shape[0] <= 1))
        .then(|| (strides[0].max(shape[1]), shape[1]))
}

/// The SNNBlock's scan on its merged projection `y` `[TK·B, W ≥ 4·DN]` (see
/// [`block_scan_kernel`]): `(V_post [TK·B, DN], final state [B, DN])`. Biases `[DN]`, `v0`
/// `[B, DN]`.
pub fn block_scan<R: CubeRuntime>(
    y: CubeTensor<R>,
    biases: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    v_th_min: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let chunk = crate::cuda::speculative::time_chunk_block();
    block_scan_cut(y, biases, v0, v_th_min, chunk)
}

/// [`block_scan`] with `chunk` steps per time chunk where the pass is cut
/// ([`crate::cuda::speculative`]; 0: never).
pub(crate) fn block_scan_cut<R: CubeRuntime>(
    y: CubeTensor<R>,
    biases: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    v_th_min: f32,
    chunk: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    block_scan_by(y, biases, v0, v_th_min, chunk, BlockScanKernel::ByShape)
}

/// Which kernel runs a decoding block scan: the one the pass's shape and the tuning choose, or
/// one named (`bench kernels`' prefill part holds them bit for bit against each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockScanKernel {
    ByShape,
    /// The staged kernel (one walk, never cut in time chunks).
    Staged,
    /// The wide kernel, one column per unit.
    Wide,
    /// The wide kernel, four columns per unit as vectors (where the shapes allow).
    WideVector,
    /// The staged kernel with its producers' loads a chunk ahead
    /// ([`crate::cuda::long_scan`]).
    Ahead,
}

/// [`block_scan_cut`] on the kernel `kernel` names.
pub(crate) fn block_scan_by<R: CubeRuntime>(
    y: CubeTensor<R>,
    biases: [CubeTensor<R>; 3],
    v0: CubeTensor<R>,
    v_th_min: f32,
    chunk: usize,
    kernel: BlockScanKernel,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let y = match rows_view(&y) {
        Some(_) => y,
        None => into_contiguous(y),
    };
    let (row_stride, width) = rows_view(&y).expect("block scan: y is f32 or bf16 [TK·B, W]");
    let rows = y.meta.shape()[0];
    let [bb, ba, bt] = biases.map(into_contiguous);
    let v0 = into_contiguous(v0);
    let (batch, dn) = (v0.meta.shape()[0], v0.meta.shape()[1]);
    assert!(
        width >= 4 * dn && batch > 0 && rows.is_multiple_of(batch),
        "block scan: y [{rows}, {width}] does not hold four [·, {dn}] projections of {batch} rows"
    );
    assert!(
        rows * row_stride <= u32::MAX as usize,
        "block scan: 32-bit indexing"
    );
    for t in [&bb, &ba, &bt, &v0] {
        assert_eq!(t.dtype, burn::tensor::DType::F32, "block scan takes f32");
    }
    for t in [&bb, &ba, &bt] {
        assert_eq!(
            t.meta.shape().num_elements(),
            dn,
            "block scan: a bias of {:?} for {dn} columns",
            t.meta.shape()
        );
    }
    let cols = batch * dn;
    let vpost = out_typed(&y, Shape::new([rows, dn]), gemm_input());
    let vpost_dtype = vpost.dtype;
    let last = out_typed(&y, Shape::new([batch, dn]), DType::F32);
    let steps = rows / batch;
    let y_dtype = y.dtype;
    let vector = match kernel {
        BlockScanKernel::ByShape if cols >= crate::cuda::wide::wide_cols() => {
            Some(crate::tuning::current().decode_wide_vector)
        }
        BlockScanKernel::Wide => Some(false),
        BlockScanKernel::WideVector => Some(true),
        _ => None,
    };
    if let Some(vector) = vector {
        let geometry = (cols, steps, dn, row_stride);
        let (out, fin) = (vpost.clone(), last.clone());
        crate::cuda::wide::block_scan(y, [bb, ba, bt], v0, out, fin, geometry, v_th_min, vector);
        return (vpost, last);
    }
    let chunk = if matches!(kernel, BlockScanKernel::Staged | BlockScanKernel::Ahead) {
        0
    } else {
        chunk
    };
    if let Some(chunks) = crate::cuda::speculative::chunks_for(steps, cols, chunk) {
        let geometry = (cols, steps, dn, row_stride);
        let (out, fin) = (vpost.clone(), last.clone());
        let biases = [bb, ba, bt];
        let cut = (chunk, chunks);
        crate::cuda::speculative::block_scan(y, biases, v0, out, fin, geometry, v_th_min, cut);
        return (vpost, last);
    }
    // One session's long pass: the producers' loads a chunk ahead.
    let kernel = match kernel {
        BlockScanKernel::ByShape
            if steps > 64 && batch == 1 && crate::tuning::current().block_scan_ahead =>
        {
            BlockScanKernel::Ahead
        }
        k => k,
    };
    // Three double-buffered f32 arrays of `chunk` × 32: at most 48 KiB of shared memory.
    let default = if kernel == BlockScanKernel::Ahead {
        STAGE_BLOCK_SCAN_AHEAD
    } else if steps > 64 {
        STAGE_BLOCK_SCAN_LONG
    } else {
        STAGE_BLOCK_SCAN
    };
    let (producers, chunk) = match stage_shape(crate::tuning::current().stage_block_scan, default) {
        (_, c) if c > 64 => {
            eprintln!(
                "nsactor: NSACTOR_STAGE_BLOCK_SCAN takes at most 64 steps per chunk, got {c}; using the default"
            );
            default
        }
        shape => shape,
    };
    macro_rules! launch {
        ($kernel:ident) => {
            launch_guarded!($kernel::<R>(
                &y.client.clone(),
                CubeCount::Static(cols.div_ceil(STAGE_COLS as usize) as u32, 1, 1),
                CubeDim::new_2d(STAGE_COLS, 1 + producers as u32),
                y.into_tensor_arg(),
                bb.into_tensor_arg(),
                ba.into_tensor_arg(),
                bt.into_tensor_arg(),
                v0.into_tensor_arg(),
                vpost.clone().into_tensor_arg(),
                last.clone().into_tensor_arg(),
                cols as u32,
                steps as u32,
                steps.div_ceil(chunk) as u32,
                dn as u32,
                row_stride as u32,
                v_th_min,
                chunk,
                producers,
                [y_dtype.into(), vpost_dtype.into()],
            ))
        };
    }
    use crate::cuda::long_scan::block_scan_ahead_kernel;
    // SAFETY (the unchecked launches): each kernel guards its accesses itself: `y` at steps
    // below `steps` of valid columns (rows `steps·batch` of stride `row_stride` holding the four
    // `dn`-wide projections, asserted above), the biases at `j < dn` (their length asserted
    // above), `v0`, `vpost` and `last` at valid columns (`batch` and `dn` read from `v0`'s
    // shape, the outputs allocated here), shared memory within its double-buffered `chunk × 32`.
    if kernel == BlockScanKernel::Ahead {
        launch!(block_scan_ahead_kernel)
    } else {
        launch!(block_scan_kernel)
    }
    (vpost, last)
}

/// `out·σ(y[:, gate_col..]) + y[:, skip_col..]` (see [`gate_skip_kernel`]); `out` `[rows, D]`.
pub fn gate_skip<R: CubeRuntime>(
    out: CubeTensor<R>,
    y: CubeTensor<R>,
    gate_col: usize,
    skip_col: usize,
) -> CubeTensor<R> {
    let out = into_contiguous(out);
    let y = match rows_view(&y) {
        Some(_) => y,
        None => into_contiguous(y),
    };
    let (row_stride, width) = rows_view(&y).expect("gate/skip: y is f32 [rows, W]");
    let shape = out.meta.shape().clone();
    assert_eq!(out.dtype, DType::F32, "gate/skip takes f32");
    assert_eq!(y.dtype, DType::F32, "gate/skip reads an f32 projection");
    assert_eq!(shape.num_dims(), 2, "gate/skip: out [rows, D]");
    let (rows, dim) = (shape[0], shape[1]);
    assert!(
        y.meta.shape()[0] == rows && gate_col.max(skip_col) + dim <= width,
        "gate/skip: columns {gate_col}, {skip_col} (+{dim}) outside y [{}, {width}]",
        y.meta.shape()[0]
    );
    assert!(
        rows * row_stride <= u32::MAX as usize,
        "gate/skip: 32-bit indexing"
    );
    let res = out_like(&out, shape);
    let n = rows * dim;
    // SAFETY: units at or past `n = rows·D` end; `out` and `res` `[rows, D]`, `y` rows of
    // `row_stride` holding both column ranges (asserted above).
    launch_guarded!(gate_skip_kernel::<R>(
        &out.client.clone(),
        CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
        CubeDim::new_1d(256),
        out.into_tensor_arg(),
        y.into_tensor_arg(),
        res.clone().into_tensor_arg(),
        n as u32,
        dim as u32,
        row_stride as u32,
        gate_col as u32,
        skip_col as u32,
    ));
    res
}

/// `h + (r − mean_D(r))` for `h`, `r` `[rows, D]` (see [`centred_residual_kernel`]).
pub fn centred_residual<R: CubeRuntime>(h: CubeTensor<R>, r: CubeTensor<R>) -> CubeTensor<R> {
    let [h, r] = [h, r].map(into_contiguous);
    let shape = h.meta.shape().clone();
    assert_eq!(shape.num_dims(), 2, "centred residual: h [rows, D]");
    assert_eq!(
        &shape,
        r.meta.shape(),
        "centred residual: h and r differ in shape"
    );
    for t in [&h, &r] {
        assert_eq!(
            t.dtype,
            burn::tensor::DType::F32,
            "centred residual takes f32"
        );
    }
    let (rows, dim) = (shape[0], shape[1]);
    assert!(
        rows * dim <= u32::MAX as usize,
        "centred residual: 32-bit indexing"
    );
    let out = out_like(&h, shape);
    // SAFETY: one cube per row of `h`, `r`, `out` `[rows, D]` (asserted equal above),
    // lanes below `D`.
    launch_guarded!(centred_residual_kernel::<R>(
        &h.client.clone(),
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(PLANE * CENTRED_PLANES as u32),
        h.into_tensor_arg(),
        r.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dim as u32,
        dim as f32,
        CENTRED_PLANES,
    ));
    out
}

/// `x` `[rows, D]` → RMSNorm with `gain` `[D]` and `eps`, in the GEMM's input type: the edge's
/// LateralInhibition before the head.
pub fn rms_norm<R: CubeRuntime>(x: CubeTensor<R>, gain: CubeTensor<R>, eps: f32) -> CubeTensor<R> {
    for t in [&x, &gain] {
        assert_eq!(t.dtype, DType::F32, "rms_norm takes f32");
    }
    let shape = x.meta.shape().clone();
    assert_eq!(shape.num_dims(), 2, "rms_norm: x [rows, D]");
    let (rows, dim) = (shape[0], shape[1]);
    assert_eq!(
        gain.meta.shape().num_elements(),
        dim,
        "rms_norm: gain has D values"
    );
    assert!(rows * dim <= u32::MAX as usize, "rms_norm: 32-bit indexing");
    let [x, gain] = [x, gain].map(into_contiguous);
    let y = out_typed(&x, Shape::new([rows, dim]), gemm_input());
    let planes = dim.div_ceil(PLANE as usize).clamp(1, 8);
    // SAFETY: one cube per row of `x`, `y` `[rows, D]`, lanes below `D`, `gain` `[D]` (asserted).
    launch_guarded!(rms_norm_kernel::<R>(
        &x.client.clone(),
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(PLANE * planes as u32),
        x.into_tensor_arg(),
        gain.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        dim as u32,
        eps,
        planes,
        y.dtype.into(),
    ));
    y
}
