//! `GemmOps`: the GEMM hook of every projection ([`GemmOps::gemm`], cuBLASLt on CUDA), the
//! storage type of the scans' large activations, and the tensor-level products the model calls
//! ([`matmul`], [`matmul_stored`], [`matmul_add`], [`gemm_operand`], [`stored`]).

use crate::tensor::{prim, wrap};
use burn::tensor::{DType, Tensor, backend::Backend, ops::FloatTensor};

/// The GEMM hook every projection goes through, and the type the scans' large activations are
/// stored in: one of the jobs of `SnnOps`. Every method has a default (burn's own matmul, f32).
pub trait GemmOps: Backend {
    /// `lhs [M, K] · rhs [K, N]`: the GEMM of every projection. Default: the backend's own
    /// matmul, exact fp32 on the CPU. The CUDA backend runs cuBLASLt in the process's GEMM
    /// precision: exact fp32 (no TF32, so parity with the reference holds) or bf16 inputs with
    /// fp32 accumulation (`crate::cuda::gemm`, feature `cuda`).
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `lhs · rhs + c` (`c` `[M, N]`, possibly a column slice of a wider tensor in an untracked
    /// pass). Default: [`gemm`](Self::gemm) then an add. CUDA adds `c` in cuBLASLt's epilogue
    /// (one call instead of two). Under autodiff one node, whose `∂c` comes in the type
    /// [`gemm_operand`](Self::gemm_operand) rounds to: `c` must be a tensor whose other
    /// consumers (if any) take that, as a GEMM output's own backward does.
    fn gemm_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(Self::gemm(lhs, rhs), c)
    }

    /// `lhs · rhs` written in `out` where the backend stores that type: a product read only by
    /// a kernel that takes [`storage_dtype`](Self::storage_dtype) inputs (the selective scan's
    /// four projections) is asked for in it, and a gradient in its tensor's type. Default:
    /// [`gemm`](Self::gemm), f32 whatever is asked (the backend stores f32 only).
    fn gemm_out(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: DType) -> FloatTensor<Self> {
        let _ = out;
        Self::gemm(lhs, rhs)
    }

    /// The type the scans' large activations are stored in: the selective scan's four input
    /// projections, its `V_post` and spikes, and the gradients of those projections. The
    /// arithmetic and the membrane state stay f32 whatever it is. Default f32; CUDA in bf16
    /// precision: bf16 (`$NSACTOR_BF16_STORAGE=off` keeps f32 for comparison).
    fn storage_dtype() -> DType {
        DType::F32
    }

    /// Rounds a GEMM operand to the type [`gemm`](Self::gemm) reads, so that an operand used by
    /// several products is rounded once: the autodiff node keeps its operands rounded for the
    /// backward products and rounds the incoming gradient once for both. Default: unchanged
    /// (the GEMM reads f32). CUDA in bf16 precision: the bf16 copy.
    fn gemm_operand(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
    }

    /// Whether the model should compute projections that share an input as one GEMM on
    /// concatenated weights when the call is small and not differentiated (decoding): the
    /// CUDA backend pays ≈ 100 µs of host time per GEMM call, far more than the GPU time of a
    /// decoding step's projections. Default `false` (autodiff backends and the CPU).
    fn merges_small_gemms() -> bool {
        false
    }
}

/// `lhs [M, K] · rhs [K, N]` through [`GemmOps::gemm`], differentiable.
pub fn matmul<B: GemmOps>(lhs: Tensor<B, 2>, rhs: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm(prim(lhs), prim(rhs)))
}

/// `lhs [M, K] · rhs [K, N]` stored in [`GemmOps::storage_dtype`] ([`GemmOps::gemm_out`]),
/// differentiable: for a product read only by the selective scan.
pub fn matmul_stored<B: GemmOps>(lhs: Tensor<B, 2>, rhs: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm_out(prim(lhs), prim(rhs), B::storage_dtype()))
}

/// `t` in [`GemmOps::storage_dtype`] (unchanged when it is already), differentiable (burn's
/// cast: the gradient comes back in `t`'s type). An input that several GEMMs read is rounded
/// once this way instead of once per GEMM: their autodiff nodes then share one bf16 copy, and
/// their input gradients, bf16 too, add up before the cast's backward widens the sum, as
/// PyTorch's autocast does.
pub fn stored<B: GemmOps, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = B::storage_dtype();
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

/// `lhs [M, K] · rhs [K, N] + c [M, N]` through [`GemmOps::gemm_add`], differentiable (one
/// node on an autodiff backend).
pub fn matmul_add<B: GemmOps>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    c: Tensor<B, 2>,
) -> Tensor<B, 2> {
    wrap(B::gemm_add(prim(lhs), prim(rhs), prim(c)))
}

/// `t` as [`matmul`] reads it ([`GemmOps::gemm_operand`]): for an operand used many times
/// (a weight while decoding), rounded once. Untracked tensors only: the rounded copy carries
/// no gradient back to `t`.
pub fn gemm_operand<B: GemmOps>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::gemm_operand(prim(t)))
}
