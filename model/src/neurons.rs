//! Row-parameter PLIF neurons and the two RMS normalisations.

use crate::config::{PlifOut, consts};
use crate::init::Rng;
use crate::params::impl_params;
use burn::tensor::{Tensor, TensorData, activation::sigmoid, backend::Backend};
use nsactor_kernels::{NormPlifInputs, SnnOps, last_frame, plif_row};

/// Builds a small parameter tensor from host values (marked for gradients on autodiff backends). No
/// values for a non-empty shape (what a [`Rng::blank`] draws) make zeros on the device, with
/// nothing built or copied on the host.
pub(crate) fn param<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    blank(&values, shape, device)
        .unwrap_or_else(|| Tensor::from_data(TensorData::new(values, shape), device))
        .require_grad()
}

/// Zeros made on the device for a non-empty shape given no values (a [`Rng::blank`] draw).
fn blank<B: Backend, const D: usize>(
    values: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Option<Tensor<B, D>> {
    (values.is_empty() && shape.iter().product::<usize>() > 0).then(|| Tensor::zeros(shape, device))
}

/// [`param`] for a large one (a projection's or the embedding's weights): uploaded through
/// the backend's [`SnnOps::upload_f32`] (pinned staging on CUDA), its host buffer then kept for
/// the next draw ([`crate::init::recycle`]).
pub(crate) fn weight<B: SnnOps, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    if let Some(zeros) = blank(&values, shape, device) {
        return zeros.require_grad();
    }
    let t = upload(&values, shape, device).require_grad();
    crate::init::recycle(values);
    t
}

/// `values` as a tensor of `shape` on `device`, through the backend's upload
/// ([`SnnOps::upload_f32`]: pinned staging on CUDA).
pub(crate) fn upload<B: SnnOps, const D: usize>(
    values: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(B::upload_f32(
        values,
        burn::tensor::Shape::new(shape),
        device,
    )))
}

/// Repeats a per-token tensor `[T, B, C]` over the K frames of each token → `[T·K, B, C]`
/// (token-major, frame-minor; SPEC §3).
pub(crate) fn repeat_frames<B: Backend>(x: Tensor<B, 3>, k: usize) -> Tensor<B, 3> {
    let [t, b, c] = x.dims();
    x.unsqueeze_dim::<4>(1)
        .expand([t, k, b, c])
        .reshape([t * k, b, c])
}

/// PLIFNode with a learnable decay `β = σ(w)` and threshold `v_th` per channel.
#[derive(Debug, Clone)]
pub struct PlifNode<B: Backend> {
    pub w: Tensor<B, 1>,
    pub v_th: Tensor<B, 1>,
}
impl_params!(PlifNode {
    tensors: [w, v_th],
    modules: []
});

impl<B: SnnOps> PlifNode<B> {
    /// `w ~ N(0, 0.5)` (τ₀ = 2), `v_th ~ U(v0/2, 3·v0/2)`.
    pub fn init(dim: usize, v0: f64, rng: &mut Rng, device: &B::Device) -> Self {
        PlifNode {
            w: param(rng.normal_vec(dim, 0.0, 0.5), [dim], device),
            v_th: param(rng.uniform_vec(dim, 0.5 * v0, 1.5 * v0), [dim], device),
        }
    }

    /// Runs the neuron over K frames of a per-token input `x` `[T, B, dim]` with input current
    /// `u = (1 − β)·x` (SPEC §2.3). Returns the output `[T·K, B, dim]` (leak or raw `V_post`) and
    /// the final membrane state `[B, dim]` (detached, as the reference carries it).
    pub fn forward_tokens(
        &self,
        x: Tensor<B, 3>,
        k: usize,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        self.scan(x, Some(k), v0, out)
    }

    /// The same on a per-frame input `x` `[T·K, B, dim]` (the reference's layout).
    pub fn forward_frames(
        &self,
        x: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        self.scan(x, None, v0, out)
    }

    /// Row-parameter scan of the input current `u = (1 − β)·x`; `x` is per token (repeated over
    /// `repeat = Some(K)` frames after scaling) or already per frame (`None`).
    fn scan(
        &self,
        x: Tensor<B, 3>,
        repeat: Option<usize>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [_, b, dim] = x.dims();
        let beta = sigmoid(self.w.clone()); // [dim]
        let one_minus = beta.clone().neg() + 1.0;
        let u = x * one_minus.clone().unsqueeze::<3>();
        let u = match repeat {
            Some(k) => repeat_frames(u, k),
            None => u,
        };
        let (_, vpost) = plif_row(
            beta.unsqueeze::<2>().expand([b, dim]),
            u,
            self.v_th.clone().unsqueeze::<2>().expand([b, dim]),
            v0,
        );
        let last = last_frame(&vpost);
        let y = match out {
            PlifOut::Leak => vpost * one_minus.unsqueeze::<3>(),
            PlifOut::VPost => vpost,
        };
        (y, last)
    }
}

/// RMSNorm, `y = w · x / √(mean(x²) + 1e-6)` over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm<B: Backend> {
    pub weight: Tensor<B, 1>,
}
impl_params!(RmsNorm {
    tensors: [weight],
    modules: []
});

impl<B: Backend> RmsNorm<B> {
    pub fn init(dim: usize, device: &B::Device) -> Self {
        RmsNorm {
            weight: param(vec![1.0; dim], [dim], device),
        }
    }

    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        rms_scale(x, consts::RMS_EPS) * self.weight.clone().unsqueeze::<3>()
    }
}

/// LateralInhibition: divisive normalisation with a learnable gain (RMSNorm-equivalent, SPEC §2.4).
#[derive(Debug, Clone)]
pub struct LateralInhibition<B: Backend> {
    pub gain: Tensor<B, 1>,
}
impl_params!(LateralInhibition {
    tensors: [gain],
    modules: []
});

impl<B: Backend> LateralInhibition<B> {
    pub fn init(dim: usize, device: &B::Device) -> Self {
        LateralInhibition {
            gain: param(vec![1.0; dim], [dim], device),
        }
    }

    pub fn forward(&self, y: Tensor<B, 3>) -> Tensor<B, 3> {
        rms_scale(y, consts::LATERAL_EPS) * self.gain.clone().unsqueeze::<3>()
    }
}

fn rms_scale<B: Backend>(x: Tensor<B, 3>, eps: f64) -> Tensor<B, 3> {
    let ms = x.clone().square().mean_dim(2);
    x * (ms + eps).sqrt().recip()
}

/// The fused kernels' inputs for RMSNorm (`norm`) then the input PLIF (`neuron`) over the K
/// frames of each token of `h` `[T, B, D]`, from state `v0` `[B, D]`.
pub fn norm_plif_inputs<B: SnnOps>(
    norm: &RmsNorm<B>,
    neuron: &PlifNode<B>,
    h: Tensor<B, 3>,
    k: usize,
    v0: Tensor<B, 2>,
    out: PlifOut,
) -> NormPlifInputs<B> {
    NormPlifInputs::new(
        h,
        norm.weight.clone(),
        consts::RMS_EPS,
        neuron.w.clone(),
        neuron.v_th.clone(),
        v0,
        k,
        out == PlifOut::Leak,
    )
}
