//! The GEMMs under autodiff: `lhs · rhs` and `lhs · rhs + c` (the addend through cuBLASLt's
//! epilogue on CUDA), each one node whose backward runs through `B::gemm_out`.

use crate::ops::gemm::GemmOps;
use crate::ops::snn::SnnOps;
use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, TensorMetadata, ops::FloatTensor};

/// What a GEMM node saves: both operands as its GEMM read them ([`SnnOps::gemm_operand`]: bf16
/// copies on CUDA in bf16, half the memory of the f32 tensors and no second rounding), and
/// their own types.
type GemmState<B> = (FloatTensor<B>, FloatTensor<B>, [DType; 2]);

/// `∂lhs = g · rhsᵀ`, `∂rhs = lhsᵀ · g` through `B::gemm_out`, each registered for its parent
/// (where it wants one) in its tensor's type (a bf16 activation gets a bf16 gradient: the scan
/// kernel that made it reads that).
fn register_products<B: SnnOps>(
    g: &FloatTensor<B>,
    (lhs, rhs, [lhs_dtype, rhs_dtype]): GemmState<B>,
    [lhs_node, rhs_node]: [Option<NodeId>; 2],
    grads: &mut Gradients,
) {
    if let Some(id) = lhs_node {
        grads.register::<B>(
            id,
            B::gemm_out(g.clone(), B::float_transpose(rhs), lhs_dtype),
        );
    }
    if let Some(id) = rhs_node {
        grads.register::<B>(
            id,
            B::gemm_out(B::float_transpose(lhs), g.clone(), rhs_dtype),
        );
    }
}

/// Backward of `lhs · rhs`: the two products on `g` rounded once ([`register_products`]).
#[derive(Debug)]
struct MatmulBackward;

impl<B: SnnOps> Backward<B, 2> for MatmulBackward {
    type State = GemmState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let g = B::gemm_operand(grads.consume::<B>(&ops.node));
        let nodes = ops.parents.map(|n| n.map(|n| n.id));
        register_products::<B>(&g, ops.state, nodes, grads);
    }
}

/// Backward of `lhs · rhs + c`: [`MatmulBackward`]'s two products, and `∂c = g` in the rounded
/// type (bf16 on CUDA in bf16): `c` is a GEMM's output whose own backward reads it so, which
/// saves that GEMM's cast.
#[derive(Debug)]
struct MatmulAddBackward;

impl<B: SnnOps> Backward<B, 3> for MatmulAddBackward {
    type State = GemmState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let g = B::gemm_operand(grads.consume::<B>(&ops.node));
        let [lhs, rhs, c] = ops.parents.map(|n| n.map(|n| n.id));
        register_products::<B>(&g, ops.state, [lhs, rhs], grads);
        if let Some(id) = c {
            grads.register::<B>(id, g);
        }
    }
}

/// The operands a tracked GEMM node computes with and saves (rounded once), with their types.
fn tracked_operands<B: SnnOps>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> GemmState<B> {
    let dtypes = [lhs.dtype(), rhs.dtype()];
    (B::gemm_operand(lhs), B::gemm_operand(rhs), dtypes)
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
                let state = tracked_operands::<B>(lhs.primitive, rhs.primitive);
                let y = B::gemm_out(state.0.clone(), state.1.clone(), out);
                prep.finish(state, y)
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
                let state = tracked_operands::<B>(lhs.primitive, rhs.primitive);
                let y = B::gemm_add(state.0.clone(), state.1.clone(), c.primitive);
                prep.finish(state, y)
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
