//! `OptimOps`: the optimizer's update of one flat parameter, one of the jobs of `SnnOps`. The
//! default composes it from tensor ops ([`crate::reference::optim::adam`]); CUDA overrides it
//! with one kernel that reads the parameter, its gradient and both moments once and writes the
//! three results once (`crate::cuda::optim`), instead of a dozen passes over memory.

use crate::ops::types::AdamStep;
use crate::reference::optim::adam;
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
}
