//! A GEMM for a decoding pass's few rows on the tensor cores, each output tile summed as one
//! chain over `K` in steps of 16: `acc ← mma(x[:, k..k+16], w[k..k+16, :], acc)` from `k = 0`
//! up, one plane (warp) per 16 × 16 output tile, no split of `K`.
//!
//! **Why.** A batch-invariant decoding GEMM must give a row the same bits at every row count
//! (`gemm_invariant`). cuBLASLt's kernels fall into bits classes by their split-K count
//! (s59, s68): every unsplit kernel, whatever its tile, gives the same bits. If an unsplit
//! kernel is the one chain of MMA steps above, this kernel is in that class too, and a pass of
//! one session's 16 frame rows can run it: it reads each weight tile once per row tile, with
//! every plane of the card streaming its own columns, where cuBLASLt's unsplit kernels for 896
//! output columns keep 7–14 multiprocessors busy (`W_out`: 14 µs for 12.8 MB). Whether the bits
//! agree is measured, never assumed: `bench kernels --options only=chain` compares every
//! 0.9B projection with the decoding GEMM bit for bit (`crate::bench::chain`).
//!
//! The operands are bf16: `x [M, K]` row-major, the weight as a `[K, N]` row-major matrix
//! (the merged projections' layout) or as the transposed view of a row-major `[N, K]` one (a
//! `Linear`'s). The output is f32 `[M, N]`. `M`, `N` and `K` are multiples of 16.

use crate::cuda::common::out_typed;
use burn::tensor::{DType, bf16};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Planes (16-column tiles) per cube at most.
const PLANES: u32 = 4;

/// MMA steps of 16 whose loads are issued together.
const UNROLL: usize = 8;

/// How the weight is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `[K, N]` row-major: a `B` tile's rows are 16 consecutive values at stride `N`.
    KByN,
    /// `[N, K]` row-major, used transposed: a `B` tile's columns at stride `K`.
    NByK,
}

#[cube(launch_unchecked)]
fn chain_gemm_kernel(
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    out: &mut Tensor<f32>,
    n: u32,
    #[comptime] k: usize,
    #[comptime] k_by_n: bool,
    #[comptime] unroll: usize,
    #[comptime] m_tiles: usize,
) {
    let n = n as usize;
    let tile_n = CUBE_POS_X as usize * CUBE_DIM_Y as usize + UNIT_POS_Y as usize;
    let n0 = tile_n * 16;
    // Whole planes leave together: every MMA below is the plane's.
    if n0 >= n {
        terminate!();
    }
    // This plane's row tiles: `m_tiles` of them from `m0`, each its own accumulator, all fed
    // by the one weight tile each step loads.
    let m0 = CUBE_POS_Y as usize * m_tiles * 16;
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _t in 0..m_tiles {
        accs.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            0.0,
        ));
    }
    let steps = comptime!(k / (16 * unroll));
    for s in 0..steps {
        #[unroll]
        for u in 0..unroll {
            let k0 = (s * unroll + u) * 16;
            let b = if comptime!(k_by_n) {
                let start = k0 * n + n0;
                cmma::Matrix::<bf16>::from_slice(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::RowMajor,
                    &w.slice(start, start + 15 * n + 16),
                    n as u32,
                )
            } else {
                let start = n0 * k + k0;
                cmma::Matrix::<bf16>::from_slice(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::ColMajor,
                    &w.slice(start, start + 15 * k + 16),
                    k as u32,
                )
            };
            #[unroll]
            for t in 0..m_tiles {
                let x_at = (m0 + t * 16) * k + k0;
                let a = cmma::Matrix::<bf16>::from_slice(
                    cmma::MatrixIdent::A,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::RowMajor,
                    &x.slice(x_at, x_at + 15 * k + 16),
                    k as u32,
                );
                let acc = accs.index(t);
                cmma::execute::<bf16, bf16, f32, f32>(&a, &b, acc, acc);
            }
        }
    }
    #[unroll]
    for t in 0..m_tiles {
        let o = (m0 + t * 16) * n + n0;
        cmma::store(
            &mut out.slice_mut(o, o + 15 * n + 16),
            accs.index(t),
            n as u32,
            cmma::MatrixLayout::RowMajor,
        );
    }
}

/// The staged form for problems of few column tiles (a long `K` over 896 columns): one cube a
/// 16-column tile, whose `producers` planes copy the next `chunk` steps of the weight's tile
/// and of the activations into shared memory while plane 0 runs the current chunk's MMA chain
/// from it; one barrier a chunk swaps the two buffers. The chain and its order are the plain
/// kernel's: the same bits.
#[cube(launch_unchecked)]
fn chain_gemm_staged_kernel(
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    out: &mut Tensor<f32>,
    n: u32,
    #[comptime] k: usize,
    #[comptime] k_by_n: bool,
    #[comptime] m_tiles: usize,
    #[comptime] chunk: usize,
    #[comptime] producers: usize,
    #[comptime] pad: usize,
) {
    let n = n as usize;
    let n0 = CUBE_POS_X as usize * 16;
    let m0 = CUBE_POS_Y as usize * m_tiles * 16;
    let plane = UNIT_POS_Y as usize;
    // Columns of `K` a chunk spans, and its two tiles' sizes in shared memory: the weight's
    // 16 columns (as `[16][ck]` from `[N, K]`, as `[ck][16]` from `[K, N]`) and the
    // activations' `16·m_tiles` rows as `[16·m_tiles][ck]`. A `[rows][ck]` tile's rows lie
    // `ld = ck + pad` apart: `ck` values are a multiple of 128 bytes, so unpadded, the 16 rows
    // a fragment load reads would fall on the same banks; 8 more values (16 bytes) spread
    // them and keep every fragment's start 32-byte aligned and `ld` a multiple of 8.
    let ck = comptime!(chunk * 16);
    let ld = comptime!(ck + pad);
    let b_len = comptime!(16 * chunk * 16);
    let a_len = comptime!(m_tiles * 16 * chunk * 16);
    let b_size = comptime!(if k_by_n { b_len } else { 16 * ld });
    let a_size = comptime!(m_tiles * 16 * ld);
    let mut sb = SharedMemory::<bf16>::new_aligned(comptime!(2 * b_size), 32usize);
    let mut sa = SharedMemory::<bf16>::new_aligned(comptime!(2 * a_size), 32usize);
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _t in 0..m_tiles {
        accs.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            0.0,
        ));
    }
    let chunks = comptime!(k / ck);
    let units = comptime!(producers * 32);
    let per_b = comptime!(b_len.div_ceil(producers * 32));
    let per_a = comptime!(a_len.div_ceil(producers * 32));
    let mut ch = 0usize;
    while ch <= chunks {
        if plane == 0 {
            if ch > 0 {
                let bb = ((ch - 1) % 2) * b_size;
                let ba = ((ch - 1) % 2) * a_size;
                #[unroll]
                for s in 0..chunk {
                    let b = if comptime!(k_by_n) {
                        let at = bb + s * 256;
                        cmma::Matrix::<bf16>::from_slice(
                            cmma::MatrixIdent::B,
                            16usize,
                            16usize,
                            16usize,
                            cmma::MatrixLayout::RowMajor,
                            &sb.slice(at, at + 256),
                            16u32,
                        )
                    } else {
                        let at = bb + s * 16;
                        cmma::Matrix::<bf16>::from_slice(
                            cmma::MatrixIdent::B,
                            16usize,
                            16usize,
                            16usize,
                            cmma::MatrixLayout::ColMajor,
                            &sb.slice(at, at + 15 * ld + 16),
                            ld as u32,
                        )
                    };
                    #[unroll]
                    for t in 0..m_tiles {
                        let at = ba + t * 16 * ld + s * 16;
                        let a = cmma::Matrix::<bf16>::from_slice(
                            cmma::MatrixIdent::A,
                            16usize,
                            16usize,
                            16usize,
                            cmma::MatrixLayout::RowMajor,
                            &sa.slice(at, at + 15 * ld + 16),
                            ld as u32,
                        );
                        let acc = accs.index(t);
                        cmma::execute::<bf16, bf16, f32, f32>(&a, &b, acc, acc);
                    }
                }
            }
        } else if ch < chunks {
            let k0 = ch * ck;
            let p = (plane - 1) * 32 + UNIT_POS_X as usize;
            let bb = (ch % 2) * b_size;
            let ba = (ch % 2) * a_size;
            // Every load of the unit's share in flight before the first store.
            let mut rb = Array::<bf16>::new(per_b);
            #[unroll]
            for r in 0..per_b {
                let e = r * units + p;
                if e < b_len {
                    let g = if comptime!(k_by_n) {
                        (k0 + e / 16) * n + n0 + e % 16
                    } else {
                        (n0 + e / ck) * k + k0 + e % ck
                    };
                    rb[r] = w[g];
                }
            }
            let mut ra = Array::<bf16>::new(per_a);
            #[unroll]
            for r in 0..per_a {
                let e = r * units + p;
                if e < a_len {
                    ra[r] = x[(m0 + e / ck) * k + k0 + e % ck];
                }
            }
            // Element `e` of a `[rows][ck]` tile goes to row `e / ck` at stride `ld`.
            #[unroll]
            for r in 0..per_b {
                let e = r * units + p;
                if e < b_len {
                    let at = if comptime!(k_by_n) {
                        e
                    } else {
                        (e / ck) * ld + e % ck
                    };
                    sb[bb + at] = rb[r];
                }
            }
            #[unroll]
            for r in 0..per_a {
                let e = r * units + p;
                if e < a_len {
                    sa[ba + (e / ck) * ld + e % ck] = ra[r];
                }
            }
        }
        sync_cube();
        ch += 1;
    }
    if plane == 0 {
        #[unroll]
        for t in 0..m_tiles {
            let o = (m0 + t * 16) * n + n0;
            cmma::store(
                &mut out.slice_mut(o, o + 15 * n + 16),
                accs.index(t),
                n as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
    }
}

/// Producer planes of the staged kernel.
const PRODUCERS: usize = 7;

/// Column tiles below which a problem takes the staged kernel: fewer than two a
/// multiprocessor of an H100 (132).
const STAGED_BELOW_TILES: usize = 264;

/// `K` steps of 16 a chunk of the staged kernel copies: the largest divisor of `K / 16`, at
/// most 32, whose two buffers of weight and activations (`16·m_tiles` rows of `16·chunk + pad`
/// values, and the weight's 16) stay within 48 KB of static shared memory.
fn chunk_for(k: usize, m_tiles: usize, pad: usize) -> usize {
    let fits = |c: usize| 2 * (1 + m_tiles) * 16 * (16 * c + pad) * 2 <= 48 * 1024;
    (1..=32)
        .rev()
        .find(|&c| fits(c) && (k / 16).is_multiple_of(c))
        .unwrap_or(1)
}

/// Values added to each shared row of the staged kernel (see [`ChainForm::Staged`]).
const PAD: usize = 8;

/// Which of the two kernels runs a problem. Both sum every output element the same way (the
/// same bits); they differ only in how the operands reach the tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainForm {
    /// The staged kernel below [`STAGED_BELOW_TILES`] column tiles (with its rows padded), the
    /// plain one from there.
    Auto,
    /// Fragments straight from global memory, [`UNROLL`] steps in flight.
    Plain,
    /// Producer planes stage chunks in shared memory; `padded` spreads its rows over the banks.
    Staged { padded: bool },
}

/// The largest of 8, 4, 2, 1 that divides `k / 16`.
fn unroll_for(k: usize) -> usize {
    [UNROLL, 4, 2, 1]
        .into_iter()
        .find(|u| (k / 16).is_multiple_of(*u))
        .unwrap_or(1)
}

/// Row tiles a plane accumulates: the largest of 4, 2, 1 that divides the row tiles.
fn m_tiles_for(tiles: usize) -> usize {
    [4, 2, 1]
        .into_iter()
        .find(|t| tiles.is_multiple_of(*t))
        .unwrap_or(1)
}

/// `x · w` as one MMA chain per output element (see the module). `x` bf16 `[M, K]` contiguous;
/// `w` bf16, laid out as `layout` says (`[K, N]` or `[N, K]` contiguous); `M`, `N`, `K`
/// multiples of 16. Returns f32 `[M, N]`.
pub fn chain_gemm<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    layout: WeightLayout,
) -> CubeTensor<R> {
    chain_gemm_as(x, w, layout, ChainForm::Auto)
}

/// [`chain_gemm`] by the given kernel form (the kernel bench compares them).
pub fn chain_gemm_as<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    layout: WeightLayout,
    form: ChainForm,
) -> CubeTensor<R> {
    assert_eq!(x.dtype, DType::BF16, "chain_gemm: x must be bf16");
    assert_eq!(w.dtype, DType::BF16, "chain_gemm: w must be bf16");
    // The kernels index rows by their shapes' strides of a packed layout.
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let xs = x.meta.shape().as_slice().to_vec();
    let ws = w.meta.shape().as_slice().to_vec();
    assert!(xs.len() == 2 && ws.len() == 2, "chain_gemm: 2-d operands");
    let (m, k) = (xs[0], xs[1]);
    let (wk, n) = match layout {
        WeightLayout::KByN => (ws[0], ws[1]),
        WeightLayout::NByK => (ws[1], ws[0]),
    };
    assert_eq!(k, wk, "chain_gemm: x [M, K] against a weight of K = {wk}");
    assert!(
        m.is_multiple_of(16) && n.is_multiple_of(16) && k.is_multiple_of(16),
        "chain_gemm: M, N, K multiples of 16 (got {m}, {n}, {k})"
    );
    assert!(m * k.max(n) <= u32::MAX as usize && n * k <= u32::MAX as usize);
    let out = out_typed(&x, [m, n].into(), DType::F32);
    if m == 0 || n == 0 {
        return out;
    }
    let m_tiles = m_tiles_for(m / 16);
    // Enough cubes to give every multiprocessor one: a plane a cube while the column tiles are
    // few, up to [`PLANES`].
    let planes = ((n / 16) / 132).clamp(1, PLANES as usize) as u32;
    let cubes_n = (n / 16).div_ceil(planes as usize) as u32;
    // SAFETY: every slice the kernels take starts at a tile's first element and ends at its
    // last plus one: `x` rows `m0 + 16·t .. + 16` (the cubes along `y` times `m_tiles` cover
    // exactly `M / 16` row tiles) and columns `k0 .. k0 + 16` (`k0 + 16 ≤ K`: the plain
    // kernel's steps times `unroll`, the staged one's chunks times `chunk`, cover exactly
    // `K / 16`); the weight's tile likewise inside `[K, N]` or `[N, K]`; the output's inside
    // `[M, N]`. Planes past `N` leave before any access; the staged kernel's grid is exactly
    // the column tiles, its producers' copies skip indices past their tiles, and its shared
    // buffers hold exactly two chunks (rows at the padded stride, the fragments' slices within
    // them). The shapes and dtypes were asserted above, the operands made contiguous.
    let client = x.client.clone();
    let staged = match form {
        ChainForm::Auto => (n / 16 < STAGED_BELOW_TILES).then_some(PAD),
        ChainForm::Plain => None,
        ChainForm::Staged { padded } => Some(if padded { PAD } else { 0 }),
    };
    if let Some(pad) = staged {
        let chunk = chunk_for(k, m_tiles, pad);
        unsafe {
            chain_gemm_staged_kernel::launch_unchecked::<R>(
                &client,
                CubeCount::Static((n / 16) as u32, (m / 16 / m_tiles) as u32, 1),
                CubeDim::new_2d(32, 1 + PRODUCERS as u32),
                x.into_tensor_arg(),
                w.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                n as u32,
                k,
                layout == WeightLayout::KByN,
                m_tiles,
                chunk,
                PRODUCERS,
                pad,
            )
        };
        return out;
    }
    unsafe {
        chain_gemm_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(cubes_n, (m / 16 / m_tiles) as u32, 1),
            CubeDim::new_2d(32, planes),
            x.into_tensor_arg(),
            w.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n as u32,
            k,
            layout == WeightLayout::KByN,
            unroll_for(k),
            m_tiles,
        )
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared bytes the staged kernel's two buffers take (as the kernel sizes them).
    fn shared_bytes(k_by_n: bool, m_tiles: usize, chunk: usize, pad: usize) -> usize {
        let ld = chunk * 16 + pad;
        let b = if k_by_n { 256 * chunk } else { 16 * ld };
        2 * (b + m_tiles * 16 * ld) * 2
    }

    #[test]
    fn a_chunk_divides_k_and_its_buffers_fit_shared_memory() {
        for k in [896, 2688, 7168] {
            for m_tiles in [1, 2, 4] {
                for pad in [0, PAD] {
                    let c = chunk_for(k, m_tiles, pad);
                    assert!((k / 16).is_multiple_of(c), "K {k}: chunk {c}");
                    for k_by_n in [false, true] {
                        let bytes = shared_bytes(k_by_n, m_tiles, c, pad);
                        assert!(bytes <= 48 * 1024, "K {k} m {m_tiles} pad {pad}: {bytes}");
                    }
                    // The largest such divisor: the next one up would not fit.
                    if let Some(up) = (c + 1..=32).find(|d| (k / 16).is_multiple_of(*d)) {
                        assert!(shared_bytes(false, m_tiles, up, pad) > 48 * 1024);
                    }
                }
            }
        }
        // W_out's K at one row tile: 16 steps a chunk, padded or not; FFN down's 2,688: 24
        // steps unpadded, 21 with the padding (24 would take 50 KB).
        assert_eq!(chunk_for(7168, 1, PAD), 16);
        assert_eq!(chunk_for(2688, 1, 0), 24);
        assert_eq!(chunk_for(2688, 1, PAD), 21);
    }

    #[test]
    fn padded_rows_keep_fragments_aligned() {
        // Every fragment the consumer loads starts 32-byte aligned, and `ld` is a multiple of 8
        // values, as wmma's loads require.
        for k in [896, 2688, 7168] {
            let c = chunk_for(k, 1, PAD);
            let ld = c * 16 + PAD;
            assert!(ld.is_multiple_of(8));
            for t in 0..4 {
                for s in 0..c {
                    assert!(((t * 16 * ld + s * 16) * 2).is_multiple_of(32));
                }
            }
            assert!(
                (16 * ld * 2).is_multiple_of(32),
                "the second buffer's start"
            );
        }
    }
}
