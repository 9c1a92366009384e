//! A training step's kernels compiled before the step: [`ComputeBackend::prewarm`] for every
//! burn backend.
//!
//! A cold process compiles each kernel when the host first reaches its launch, and the host
//! stops at every read and every autotuned operation until what it launched has compiled and
//! run: the first step of a 0.9B run goes as a chain of such waits (HISTORY, session 66). Here
//! a thread of its own runs one layer's training forward and backward at the shape it is given
//! (the run's micro-batch), on a throwaway copy of the layer whose weights are never drawn,
//! with the backend in compile-only mode ([`DeviceOps::compile_only`]): every kernel it
//! launches goes to the compiler threads at once and none runs (nothing is read back, no GEMM
//! is called, the autotuner times nothing). The real step's launches then find their kernels
//! compiled, or take over their compilation. At the run's own shape the kernels and the
//! autotuner's keys are the real step's; at one row most differed (measured: 36 of ~105
//! compilations never used, the first step 12.8 → 8.9 s against 6.3–6.7 s at the run's
//! shape). The memory the step's tensors take is only reserved, never written, and goes back
//! to the device when compile-only mode ends.
//!
//! [`ComputeBackend::prewarm`]: nsactor_plugin_api::ComputeBackend::prewarm
//! [`DeviceOps::compile_only`]: nsactor_kernels::ops::device::DeviceOps::compile_only

use crate::Ad;
use burn::tensor::Tensor;
use nsactor_kernels::SnnOps;
use nsactor_model::init::Rng;
use nsactor_model::train::GradSet;
use nsactor_model::{LayerState, ModelConfig, SnnDecoderLayer};

/// Turns compile-only mode off however the prewarm ends.
struct CompileOnly<'a, B: SnnOps>(&'a B::Device);

impl<B: SnnOps> Drop for CompileOnly<'_, B> {
    fn drop(&mut self) {
        B::compile_only(self.0, false);
    }
}

/// One layer's training forward (untracked, as a forward that keeps its input runs it, with
/// its reply's reductions) and its recompute under autodiff with the backward, on `device` in
/// compile-only mode; `false` where the backend has no such mode (then nothing ran).
pub(crate) fn layer<B: SnnOps>(
    cfg: &ModelConfig,
    batch: usize,
    seq_len: usize,
    device: &B::Device,
) -> bool {
    if !B::compile_only(device, true) {
        return false;
    }
    let _off = CompileOnly::<B>(device);
    let ad = SnnDecoderLayer::<Ad<B>>::init(cfg, &mut Rng::blank(), device);
    let inner = SnnDecoderLayer::<B>::init(cfg, &mut Rng::blank(), device);
    let h = Tensor::<B, 3>::zeros([seq_len, batch, cfg.d], device);
    let out = inner.forward(h.clone(), LayerState::zeros(cfg, batch, device), cfg);
    let ek = crate::layer::flat_expected_k(&out.expected_k);
    drop((
        out.ponder_cost(),
        ek.clone().mean(),
        ek.clone().min(),
        ek.max(),
    ));
    let grad = out.h;
    let x = Tensor::<Ad<B>, 3>::from_inner(h).require_grad();
    let out = ad.forward(x.clone(), LayerState::zeros(cfg, batch, device), cfg);
    let ponder_cost = out.ponder_cost();
    let objective = (out.h * Tensor::from_inner(grad)).sum() + ponder_cost * 0.5;
    let grads = objective.backward();
    drop(x.grad(&grads));
    drop(GradSet::collect::<Ad<B>, _>(&ad, "layers.0.", &grads));
    true
}
