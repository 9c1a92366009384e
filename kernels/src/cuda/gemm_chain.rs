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
    assert_eq!(x.dtype, DType::BF16, "chain_gemm: x must be bf16");
    assert_eq!(w.dtype, DType::BF16, "chain_gemm: w must be bf16");
    assert!(
        x.is_contiguous() && w.is_contiguous(),
        "chain_gemm: contiguous operands"
    );
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
    // SAFETY: every slice the kernel takes starts at a tile's first element and ends at its
    // last plus one: `x` rows `m0 + 16·t .. + 16` (the cubes along `y` times `m_tiles` cover
    // exactly `M / 16` row tiles) and columns `k0 .. k0 + 16` (`k0 + 16 ≤ K`, the steps times
    // `unroll` covering exactly `K / 16`); the weight's tile likewise inside `[K, N]` or
    // `[N, K]`; the output's inside `[M, N]`. Planes past `N` leave before any access. The
    // shapes, dtypes and contiguity were asserted above.
    unsafe {
        chain_gemm_kernel::launch_unchecked::<R>(
            &x.client.clone(),
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
