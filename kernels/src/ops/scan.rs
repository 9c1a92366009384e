//! `ScanOps`: the PLIF scans (either [`ScanKind`], forward and backward) every backend provides, defaulting to the exact host reference
//! ([`crate::reference::scan`]) run after reading the inputs back, and the tensor-level scans
//! [`plif_elem`] / [`plif_row`] the model calls.

use crate::ops::types::{PlifGrads, PlifOutput, ScanKind};
use crate::reference::scan::{self as reference, ScanGrads, ScanOut};
use crate::tensor::{prim, wrap};
use burn::tensor::{Shape, Tensor, TensorData, backend::Backend, ops::FloatTensor};

/// The PLIF scans (per-element and row-parameter, forward and backward): one of the jobs of
/// `SnnOps`.
///
/// ## Design
///
/// Every method has a default: the exact sequential scan of [`crate::reference`], run on the host
/// after reading the inputs back. That makes any burn backend correct with no extra code, and it
/// is the reference every fused kernel is tested against. A backend overrides a method only with
/// a kernel that computes the same recurrence (same `≥` test, same fused multiply-add, `f32`
/// state). The backward methods receive the saved forward outputs, never `u` or `V_pre`, which
/// lets a kernel skip storing them (SPEC §6.1).
///
/// Shapes: `u` is `[TK, B, dim]`; `v0` is `[B, dim]`; per-element `beta, vth` are `[TK, B, dim]`,
/// row-parameter `beta, vth` are `[B, dim]` (held for all `TK` steps).
pub trait ScanOps: Backend {
    /// The scan of `kind` forward.
    fn plif_forward(
        kind: ScanKind,
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        host_forward::<Self>(kind, beta, u, vth, v0)
    }

    /// Its backward: gradients of `Σ V_post·grad_vpost`; a row scan's `beta`/`vth` gradients
    /// are `[B, dim]` sums over time.
    fn plif_backward(
        kind: ScanKind,
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        host_backward::<Self>(kind, [beta, v0, vpost, spike, grad_vpost])
    }
}

/// The default forward of either scan: the reference on the inputs copied to the host.
fn host_forward<B: Backend>(
    kind: ScanKind,
    beta: FloatTensor<B>,
    u: FloatTensor<B>,
    vth: FloatTensor<B>,
    v0: FloatTensor<B>,
) -> PlifOutput<B> {
    let (shape, cols) = scan_shape::<B>(&u, &v0);
    let (scan, _) = reference::scans(kind);
    let out = scan(
        &host::<B>(beta),
        &host::<B>(u.clone()),
        &host::<B>(vth),
        &host::<B>(v0),
        cols,
    );
    scan_out::<B>(out, shape, &u)
}

/// The default backward of either scan: the reference on `[beta, v0, vpost, spike,
/// grad_vpost]` copied to the host.
fn host_backward<B: Backend>(
    kind: ScanKind,
    [beta, v0, vpost, spike, grad_vpost]: [FloatTensor<B>; 5],
) -> PlifGrads<B> {
    let (shape, cols) = scan_shape::<B>(&grad_vpost, &v0);
    let (_, scan) = reference::scans(kind);
    let param_shape = match kind {
        ScanKind::Elem => shape.clone(),
        ScanKind::Row => Shape::new([shape[1], shape[2]]),
    };
    let g = scan(
        &host::<B>(beta),
        &host::<B>(v0),
        &host::<B>(vpost),
        &host::<B>(spike),
        &host::<B>(grad_vpost.clone()),
        cols,
    );
    scan_grads::<B>(g, param_shape, shape, &grad_vpost)
}

/// Per-element PLIF scan. `beta, u, vth`: `[TK, B, dim]`; `v0`: `[B, dim]`.
/// Returns `(spike, V_post)`, both `[TK, B, dim]`; only `V_post` carries gradient.
pub fn plif_elem<B: ScanOps>(
    beta: Tensor<B, 3>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 3>,
    v0: Tensor<B, 2>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let out = B::plif_forward(ScanKind::Elem, prim(beta), prim(u), prim(vth), prim(v0));
    (wrap(out.spike), wrap(out.vpost))
}

/// Row-parameter PLIF scan. `beta, vth`: `[B, dim]`; `u`: `[TK, B, dim]`; `v0`: `[B, dim]`.
/// Returns `(spike, V_post)`, both `[TK, B, dim]`; only `V_post` carries gradient.
pub fn plif_row<B: ScanOps>(
    beta: Tensor<B, 2>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 2>,
    v0: Tensor<B, 2>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let out = B::plif_forward(ScanKind::Row, prim(beta), prim(u), prim(vth), prim(v0));
    (wrap(out.spike), wrap(out.vpost))
}

/// `[TK, B, dim]` shape of the sequence tensor and the column count `B·dim`.
pub(crate) fn scan_shape<B: Backend>(seq: &FloatTensor<B>, v0: &FloatTensor<B>) -> (Shape, usize) {
    use burn::tensor::TensorMetadata;
    let shape = seq.shape();
    assert_eq!(
        shape.num_dims(),
        3,
        "PLIF scan: sequence tensors must be [TK, B, dim], got {shape:?}"
    );
    let v0_shape = v0.shape();
    assert_eq!(
        v0_shape.as_slice(),
        &shape[1..],
        "PLIF scan: v0 must be [B, dim] = {:?}, got {v0_shape:?}",
        &shape[1..]
    );
    let cols = shape[1] * shape[2];
    (shape, cols)
}

fn host<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    use burn::tensor::TensorMetadata;
    let data = match t.shape().num_dims() {
        2 => wrap::<B, 2>(t).into_data(),
        3 => wrap::<B, 3>(t).into_data(),
        n => panic!("PLIF scan: unexpected rank {n}"),
    };
    data.convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data converts to Vec<f32>")
}

fn device_tensor<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    like: &FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let device = B::float_device(like);
    let data = TensorData::new(values, shape).convert_dtype(like.dtype());
    B::float_from_data(data, &device)
}

fn scan_out<B: Backend>(out: ScanOut, shape: Shape, like: &FloatTensor<B>) -> PlifOutput<B> {
    PlifOutput {
        spike: device_tensor::<B>(out.spike, shape.clone(), like),
        vpost: device_tensor::<B>(out.vpost, shape, like),
        last: None,
    }
}

fn scan_grads<B: Backend>(
    g: ScanGrads,
    param_shape: Shape,
    seq_shape: Shape,
    like: &FloatTensor<B>,
) -> PlifGrads<B> {
    let state_shape = Shape::new([seq_shape[1], seq_shape[2]]);
    PlifGrads {
        beta: device_tensor::<B>(g.beta, param_shape.clone(), like),
        u: device_tensor::<B>(g.u, seq_shape, like),
        vth: device_tensor::<B>(g.vth, param_shape, like),
        v0: device_tensor::<B>(g.v0, state_shape, like),
    }
}
