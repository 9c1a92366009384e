//! The GEMMs under autodiff: `lhs · rhs` and `lhs · rhs + c` (the addend through cuBLASLt's
//! epilogue on CUDA), each one node whose backward runs through `B::gemm_out`.

use crate::ops::gemm::GemmOps;
use crate::ops::snn::SnnOps;
use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, TensorMetadata, ops::FloatTensor};

/// Backward of `lhs · rhs`: `∂lhs = g · rhsᵀ`, `∂rhs = lhsᵀ · g`, through `B::gemm_out`. The
/// state holds the operands as the forward's GEMM read them ([`SnnOps::gemm_operand`]: bf16
/// copies on CUDA in bf16, half the memory of the f32 tensors and no second rounding), and `g`
/// is rounded once for both products. Each gradient is written in its tensor's type (a bf16
/// activation gets a bf16 gradient: the scan kernel that made it reads that).
#[derive(Debug)]
struct MatmulBackward;

impl<B: SnnOps> Backward<B, 2> for MatmulBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, [DType; 2]);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_lhs, node_rhs] = ops.parents;
        let g = B::gemm_operand(grads.consume::<B>(&ops.node));
        let (lhs, rhs, [lhs_dtype, rhs_dtype]) = ops.state;
        if let Some(node) = node_lhs {
            let d = B::gemm_out(g.clone(), B::float_transpose(rhs), lhs_dtype);
            grads.register::<B>(node.id, d);
        }
        if let Some(node) = node_rhs {
            let d = B::gemm_out(B::float_transpose(lhs), g, rhs_dtype);
            grads.register::<B>(node.id, d);
        }
    }
}

/// Backward of `lhs · rhs + c`: [`MatmulBackward`]'s two products on `g` rounded once, and
/// `∂c = g` in that rounded type (bf16 on CUDA in bf16): `c` is a GEMM's output whose own
/// backward reads it so, which saves that GEMM's cast.
#[derive(Debug)]
struct MatmulAddBackward;

impl<B: SnnOps> Backward<B, 3> for MatmulAddBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, [DType; 2]);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_lhs, node_rhs, node_c] = ops.parents;
        let g = B::gemm_operand(grads.consume::<B>(&ops.node));
        let (lhs, rhs, [lhs_dtype, rhs_dtype]) = ops.state;
        if let Some(node) = node_lhs {
            let d = B::gemm_out(g.clone(), B::float_transpose(rhs), lhs_dtype);
            grads.register::<B>(node.id, d);
        }
        if let Some(node) = node_rhs {
            let d = B::gemm_out(B::float_transpose(lhs), g.clone(), rhs_dtype);
            grads.register::<B>(node.id, d);
        }
        if let Some(node) = node_c {
            grads.register::<B>(node.id, g);
        }
    }
}

/// The GEMMs with their own backward nodes (`MatmulBackward`, `MatmulAddBackward`).
impl<B: SnnOps, C: CheckpointStrategy> GemmOps for Autodiff<B, C> {
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::gemm_out(lhs, rhs, DType::F32)
    }

    fn gemm_out(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: DType) -> FloatTensor<Self> {
        let prep = MatmulBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(prep) => {
                let dtypes = [lhs.primitive.dtype(), rhs.primitive.dtype()];
                let lhs = B::gemm_operand(lhs.primitive);
                let rhs = B::gemm_operand(rhs.primitive);
                let out = B::gemm_out(lhs.clone(), rhs.clone(), out);
                prep.finish((lhs, rhs, dtypes), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gemm_out(lhs.primitive, rhs.primitive, out)),
        }
    }

    fn gemm_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let prep = MatmulAddBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone(), c.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(prep) => {
                let dtypes = [lhs.primitive.dtype(), rhs.primitive.dtype()];
                let lhs = B::gemm_operand(lhs.primitive);
                let rhs = B::gemm_operand(rhs.primitive);
                let out = B::gemm_add(lhs.clone(), rhs.clone(), c.primitive);
                prep.finish((lhs, rhs, dtypes), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::gemm_add(lhs.primitive, rhs.primitive, c.primitive))
            }
        }
    }

    fn storage_dtype() -> DType {
        B::storage_dtype()
    }
}
