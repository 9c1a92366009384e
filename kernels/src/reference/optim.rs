//! The optimizer's work composed from tensor ops: the defaults of
//! [`OptimOps::adam_update`](crate::OptimOps::adam_update) and
//! [`OptimOps::square_sums`](crate::OptimOps::square_sums), and the references their kernels are
//! checked against (`bench kernels`).

use crate::ops::types::AdamStep;
use burn::tensor::{Tensor, backend::Backend};

/// One Adam update of a flat parameter, as `torch.optim.Adam(W)` (single-tensor path):
/// `(p, exp_avg, exp_avg_sq)`. Scalars enter each op as f32, as the tensor ops take them.
pub fn adam<B: Backend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    s: &AdamStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let (mut p, mut g) = (p, g * s.grad_scale);
    if s.wd != 0.0 {
        if s.decoupled {
            p = p * (1.0 - s.lr * s.wd);
        } else {
            g = g + p.clone() * s.wd;
        }
    }
    let m = m * s.beta1 + g.clone() * (1.0 - s.beta1);
    let v = v * s.beta2 + g.square() * (1.0 - s.beta2);
    let bc1 = 1.0 - s.beta1.powi(s.step);
    let bc2 = 1.0 - s.beta2.powi(s.step);
    let denom = v.clone().sqrt() / bc2.sqrt() + s.eps;
    let p = p - m.clone() / denom * (s.lr / bc1);
    (p, m, v)
}

/// `Σ g²` of a flat gradient as a `[1]` tensor. A long gradient is summed as rows of 1,024
/// first (a reduction with many outputs) and then over the rows: a single full reduction of
/// millions of values is left to the backend's autotuner, which on CUDA has picked a one-cube
/// kernel taking 1.3 ms for a 6.4 M-value gradient (measured on the H100).
pub fn square_sum<B: Backend>(g: &Tensor<B, 1>) -> Tensor<B, 1> {
    const ROW: usize = 1024;
    let n = g.dims()[0];
    let sq = g.clone().square();
    if n >= 64 * ROW && n.is_multiple_of(ROW) {
        sq.reshape([n / ROW, ROW]).sum_dim(1).sum()
    } else {
        sq.sum()
    }
}
