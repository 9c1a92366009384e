//! PLIF scan kernels for NeuronSpark (SPEC §6).
//!
//! This crate owns the one operation that makes the model a spiking network: the sequential
//! PLIF membrane scan `V_pre = β·V + u; s = (V_pre ≥ V_th); V = V_pre − V_th·s` over the whole
//! `T·K` frame sequence, in its two shapes:
//!
//! * **per-element** (selective): `β, u, V_th` all `(TK, B, dim)` — the SNNBlock hidden neurons;
//! * **row-parameter**: `β, V_th` are `(B, dim)` held for every step — input, FFN and output neurons.
//!
//! Both are *exact* sequential recurrences (never the reference's approximate 3-iteration fixed
//! point), computed with a fused multiply-add like the reference kernels so the fixture matches bit
//! for bit. The backward pass treats the reset spike as a constant (SPEC §6.1: the spike output is
//! never used, so no surrogate term reaches any gradient).
//!
//! Layout, from the ground up:
//! * [`reference`] — the ground truth: the exact scans on host slices, forward and backward
//!   ([`reference::scan`]), and the fused ops composed from tensor ops (the selective scan's
//!   modulation, RMSNorm + input PLIF, PonderAgg, the FFN neurons).
//! * `ops` — [`SnnOps`], the burn backend extension trait the model calls: the union of
//!   [`GemmOps`] (the GEMM hook every projection goes through, [`matmul`]), [`ScanOps`] (the
//!   scans, [`plif_elem`] / [`plif_row`]), [`InferOps`] (the inference and decoding fusions),
//!   [`DeviceOps`] and [`GraphOps`] (devices, queued work, captured steps), with its own fused
//!   training ops ([`plif_selective`], [`norm_plif_train`], [`ponder_agg_train`],
//!   [`ffn_neurons`]). Every method has a default — the reference on the host, a composition, or
//!   `None` — so every backend is correct out of the box; GPU backends override them with fused
//!   kernels and are tested against these defaults. Generic code only.
//! * `Autodiff<B>` implements the family with its own backward nodes calling `B`'s backward
//!   methods, so the scans and fused ops are differentiable on any backend; the CPU backend
//!   (burn-ndarray) takes every default.
//! * [`cuda`] (feature `cuda`) — the CUDA backend's implementation: CubeCL kernels, one file per
//!   family (scans, selective scan, FFN neurons, RMSNorm + input PLIF, PonderAgg, decoding
//!   fusions), the GEMMs through cuBLASLt in exact fp32 (never TF32) or bf16 with fp32
//!   accumulation, peer copies, CUDA graphs and device timing.
//! * [`parity`] — a backend's scans against the reference's golden fixture (`nsactor verify`).
//! * [`bench`] — `nsactor bench kernels`: every kernel checked against its reference, then
//!   timed. Production code never imports it.
//! * [`options`] — the `key=value` option strings and the decoding fusions' switch.
//! * [`KernelError`] — the crate's one error type, seen by the backends as `EngineError`.
//!
//! Depends on burn and the burn-free stage contract (`nsactor-plugin-api`, for its error type); with the `cuda` feature also on burn-cuda, burn-cubecl, cubecl, cubek and
//! cudarc (cuBLASLt, loaded at run time).
//!
//! [`reference`]: mod@reference
//! [`bench`]: mod@bench

mod autodiff;
pub mod bench;
#[cfg(feature = "ndarray")]
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod ops;
pub mod options;
pub mod parity;
pub mod reference;
mod tensor;
pub mod tuning;

pub use error::KernelError;
pub use ops::device::{DeviceOps, GraphOps};
pub use ops::gemm::{GemmOps, gemm_operand, matmul, matmul_add, matmul_stored, stored};
pub use ops::infer::{
    InferOps, block_scan_fused, centred_residual_fused, ffn_plif_fused, ffn_plif_fused_rows,
    gate_skip_fused, norm_plif_fused, norm_plif_mean_fused, ponder_agg_fused,
    ponder_residual_fused, rms_norm_fused,
};
pub use ops::optim::OptimOps;
pub use ops::scan::{ScanOps, plif_elem, plif_row};
pub use ops::snn::{
    SnnOps, ffn_neurons, gated_out, norm_plif_train, plif_selective, ponder_agg_train,
};
pub use ops::types::AdamStep;
pub use ops::types::{
    FfnGrads, FfnInputs, NormPlifInputs, PlifGrads, PlifOutput, PonderInputs, ScanKind,
    SelectiveGrads, SelectiveInputs, StepGraph,
};
pub use options::{
    GemmRows, decode_fusion, decoding_gemms, gemm_rows, per_token_gemms, set_decode_fusion,
};
pub use reference::ffn::{ffn_backward_reference, ffn_forward_reference, ffn_param_grads};
pub use reference::gated::{gated_out_backward_reference, gated_out_forward_reference};
pub use reference::norm_plif::{norm_plif_backward_reference, norm_plif_forward_reference};
pub use reference::ponder::{ponder_backward_reference, ponder_forward_reference};
pub use reference::selective::{
    selective_backward_reference, selective_forward_reference, selective_modulation,
};
pub use tensor::{last_frame, softplus};
