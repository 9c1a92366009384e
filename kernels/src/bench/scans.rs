//! The four PLIF scans of `ScanOps` (either [`ScanKind`], forward and backward) as the
//! benchmark calls them, their inputs, and the same outputs from the host reference.

use super::report::host;
use crate::ops::scan::ScanOps;
use crate::ops::types::ScanKind;
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

impl<B: Backend> Inputs<B> {
    /// β and V_th as the scan of `kind` takes them.
    fn params(&self, kind: ScanKind) -> (FloatTensor<B>, FloatTensor<B>) {
        match kind {
            ScanKind::Elem => (prim(self.beta.clone()), prim(self.vth.clone())),
            ScanKind::Row => (prim(self.beta_row.clone()), prim(self.vth_row.clone())),
        }
    }
}

/// One of the four scans the benchmark runs: a [`ScanKind`], forward or backward.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scan {
    pub kind: ScanKind,
    pub backward: bool,
}

impl Scan {
    pub const ALL: [Scan; 4] = [
        Scan::new(ScanKind::Elem, false),
        Scan::new(ScanKind::Elem, true),
        Scan::new(ScanKind::Row, false),
        Scan::new(ScanKind::Row, true),
    ];

    const fn new(kind: ScanKind, backward: bool) -> Self {
        Scan { kind, backward }
    }

    pub fn name(self) -> &'static str {
        match (self.kind, self.backward) {
            (ScanKind::Elem, false) => "per-element forward",
            (ScanKind::Elem, true) => "per-element backward",
            (ScanKind::Row, false) => "row-parameter forward",
            (ScanKind::Row, true) => "row-parameter backward",
        }
    }

    /// The same scan's forward (what a backward's timing includes).
    pub fn forward(self) -> Self {
        Scan::new(self.kind, false)
    }

    /// Bytes moved per call for `n` sequence elements and `c` columns.
    pub fn bytes(self, n: usize, c: usize) -> usize {
        match (self.kind, self.backward) {
            (ScanKind::Elem, false) => 4 * (5 * n + c),
            (ScanKind::Elem, true) => 4 * (7 * n + 2 * c),
            (ScanKind::Row, false) => 4 * (3 * n + 3 * c),
            (ScanKind::Row, true) => 4 * (4 * n + 5 * c),
        }
    }

    /// The call, returning every output (so all of them are awaited). A backward runs the
    /// kernel's own forward first: its spikes and `V_post` feed the backward, in the check and
    /// the timing alike.
    pub fn run<B: ScanOps>(self, i: &Inputs<B>) -> Vec<FloatTensor<B>> {
        let (beta, vth) = i.params(self.kind);
        let (u, v0) = (prim(i.u.clone()), prim(i.v0.clone()));
        let o = B::plif_forward(self.kind, beta.clone(), u, vth, v0.clone());
        if !self.backward {
            return vec![o.spike, o.vpost];
        }
        let grad = prim(i.grad.clone());
        let g = B::plif_backward(self.kind, beta, v0, o.vpost, o.spike, grad);
        vec![g.beta, g.u, g.vth, g.v0]
    }

    /// The same outputs from the host reference.
    pub fn reference<B: Backend>(self, i: &Inputs<B>, cols: usize) -> Vec<Vec<f32>> {
        let h3 = |t: &Tensor<B, 3>| host::<B>(&prim(t.clone()));
        let h2 = |t: &Tensor<B, 2>| host::<B>(&prim(t.clone()));
        let (u, v0, grad) = (h3(&i.u), h2(&i.v0), h3(&i.grad));
        let (beta, vth) = match self.kind {
            ScanKind::Elem => (h3(&i.beta), h3(&i.vth)),
            ScanKind::Row => (h2(&i.beta_row), h2(&i.vth_row)),
        };
        let (forward, backward) = reference::scans(self.kind);
        let o = forward(&beta, &u, &vth, &v0, cols);
        if !self.backward {
            return vec![o.spike, o.vpost];
        }
        let g = backward(&beta, &v0, &o.vpost, &o.spike, &grad, cols);
        vec![g.beta, g.u, g.vth, g.v0]
    }
}
