//! The four PLIF scans of `ScanOps` (per-element and row-parameter, forward and backward) as
//! the benchmark calls them, their inputs, and the same outputs from the host reference.

use super::report::host;
use crate::ops::scan::ScanOps;
use crate::reference::scan as reference;
use crate::tensor::prim;
use burn::tensor::{Distribution, Tensor, backend::Backend, ops::FloatTensor};

/// Scan inputs for `steps` frames of `cols` columns: β in (0.5, 1), u around the threshold so
/// neurons spike often, V_th in (0.3, 1).
pub(super) struct Inputs<B: Backend> {
    beta: Tensor<B, 3>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 3>,
    v0: Tensor<B, 2>,
    grad: Tensor<B, 3>,
    beta_row: Tensor<B, 2>,
    vth_row: Tensor<B, 2>,
}

impl<B: Backend> Inputs<B> {
    pub(super) fn new(steps: usize, batch: usize, dim: usize, device: &B::Device) -> Self {
        let u = |lo, hi| Distribution::Uniform(lo, hi);
        let seq = [steps, batch, dim];
        Inputs {
            beta: Tensor::random(seq, u(0.5, 1.0), device),
            u: Tensor::random(seq, u(-0.2, 0.6), device),
            vth: Tensor::random(seq, u(0.3, 1.0), device),
            v0: Tensor::random([batch, dim], u(-0.5, 0.5), device),
            grad: Tensor::random(seq, u(-1.0, 1.0), device),
            beta_row: Tensor::random([batch, dim], u(0.5, 1.0), device),
            vth_row: Tensor::random([batch, dim], u(0.3, 1.0), device),
        }
    }
}

/// The four scans: name, bytes moved per call for `n` sequence elements and `c` columns, and
/// the call (returning every output, so all of them are awaited).
type Run<B> = fn(&Inputs<B>) -> Vec<FloatTensor<B>>;

/// Name, row-parameter variant, bytes per call for `n` elements and `c` columns, the call.
type Scan<B> = (&'static str, bool, fn(usize, usize) -> usize, Run<B>);

pub(super) fn scans<B: ScanOps>() -> [Scan<B>; 4] {
    [
        (
            "per-element forward",
            false,
            |n, c| 4 * (5 * n + c),
            |i| {
                let o = B::plif_elem_forward(
                    prim(i.beta.clone()),
                    prim(i.u.clone()),
                    prim(i.vth.clone()),
                    prim(i.v0.clone()),
                );
                vec![o.spike, o.vpost]
            },
        ),
        (
            "per-element backward",
            false,
            |n, c| 4 * (7 * n + 2 * c),
            |i| {
                // Spikes and V_post of the forward feed the backward; the check and the timing
                // both use the kernel's own forward outputs.
                let o = B::plif_elem_forward(
                    prim(i.beta.clone()),
                    prim(i.u.clone()),
                    prim(i.vth.clone()),
                    prim(i.v0.clone()),
                );
                let g = B::plif_elem_backward(
                    prim(i.beta.clone()),
                    prim(i.v0.clone()),
                    o.vpost,
                    o.spike,
                    prim(i.grad.clone()),
                );
                vec![g.beta, g.u, g.vth, g.v0]
            },
        ),
        (
            "row-parameter forward",
            true,
            |n, c| 4 * (3 * n + 3 * c),
            |i| {
                let o = B::plif_row_forward(
                    prim(i.beta_row.clone()),
                    prim(i.u.clone()),
                    prim(i.vth_row.clone()),
                    prim(i.v0.clone()),
                );
                vec![o.spike, o.vpost]
            },
        ),
        (
            "row-parameter backward",
            true,
            |n, c| 4 * (4 * n + 5 * c),
            |i| {
                let o = B::plif_row_forward(
                    prim(i.beta_row.clone()),
                    prim(i.u.clone()),
                    prim(i.vth_row.clone()),
                    prim(i.v0.clone()),
                );
                let g = B::plif_row_backward(
                    prim(i.beta_row.clone()),
                    prim(i.v0.clone()),
                    o.vpost,
                    o.spike,
                    prim(i.grad.clone()),
                );
                vec![g.beta, g.u, g.vth, g.v0]
            },
        ),
    ]
}

/// The same outputs from the host reference.
pub(super) fn reference_outputs<B: Backend>(
    name: &str,
    i: &Inputs<B>,
    cols: usize,
) -> Vec<Vec<f32>> {
    let h3 = |t: &Tensor<B, 3>| host::<B>(&prim(t.clone()));
    let h2 = |t: &Tensor<B, 2>| host::<B>(&prim(t.clone()));
    let (u, v0, grad) = (h3(&i.u), h2(&i.v0), h3(&i.grad));
    match name {
        "per-element forward" | "per-element backward" => {
            let (beta, vth) = (h3(&i.beta), h3(&i.vth));
            let o = reference::elem_forward(&beta, &u, &vth, &v0, cols);
            if name.ends_with("forward") {
                return vec![o.spike, o.vpost];
            }
            let g = reference::elem_backward(&beta, &v0, &o.vpost, &o.spike, &grad, cols);
            vec![g.beta, g.u, g.vth, g.v0]
        }
        _ => {
            let (beta, vth) = (h2(&i.beta_row), h2(&i.vth_row));
            let o = reference::row_forward(&beta, &u, &vth, &v0, cols);
            if name.ends_with("forward") {
                return vec![o.spike, o.vpost];
            }
            let g = reference::row_backward(&beta, &v0, &o.vpost, &o.spike, &grad, cols);
            vec![g.beta, g.u, g.vth, g.v0]
        }
    }
}
