//! `OptimOps`: the optimizer's update of one flat parameter and the gradients' sums of squares
//! (for the global norm), one of the jobs of `SnnOps`. The defaults compose them from tensor ops
//! ([`crate::reference::optim`]); CUDA overrides them (`crate::cuda::optim`): the update as one
//! kernel that reads the parameter, its gradient and both moments once and writes the three
//! results once, instead of a dozen passes over memory, and the sums with one launch per
//! gradient and one for all, instead of three per gradient and a concatenation.

use crate::ops::types::AdamStep;
use crate::reference::optim::{adam, square_sum};
use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};

/// The optimizer's update: one of the jobs of `SnnOps`; every method has a default.
pub trait OptimOps: Backend {
    /// `(p, exp_avg, exp_avg_sq)` after one Adam update of the flat parameter `p` with gradient
    /// `g` and moments `m`, `v` (all `[n]`, f32). Default: the composition
    /// [`crate::reference::optim::adam`].
    fn adam_update(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: &AdamStep,
    ) -> [FloatTensor<Self>; 3] {
        let t = |x| Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(x));
        let (p, m, v) = adam(t(p), t(g), t(m), t(v), s);
        [p, m, v].map(|x| x.into_primitive().tensor())
    }

    /// `Σ g²` of each of `ts` (flat f32 tensors, at least one) as one `[ts.len()]` tensor.
    /// Default: [`crate::reference::optim::square_sum`] of each, concatenated.
    fn square_sums(ts: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        let t = |x| Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(x));
        let sums = ts.into_iter().map(|x| square_sum(&t(x))).collect();
        Tensor::cat(sums, 0).into_primitive().tensor()
    }
}
