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
//! Layers:
//! * [`reference`] — the scans on host slices, forward and backward; the ground truth.
//! * [`SnnOps`] — the burn backend extension trait the model calls. Its default methods run the
//!   reference on the host, so every backend is correct out of the box; GPU backends override
//!   them with fused kernels and are tested against these defaults.
//! * `Autodiff<B>` implements [`SnnOps`] with its own backward node calling `B`'s backward
//!   methods, so the scans are differentiable on any backend.
//! * [`plif_elem`] / [`plif_row`] — the tensor-level API used by `model`.
//!
//! It also carries the GEMM hook ([`SnnOps::gemm`], [`matmul`]) every projection goes through;
//! on CUDA it is cuBLASLt ([`cuda_gemm`]) in exact fp32 (never TF32) or bf16 with fp32
//! accumulation, checked against cubek's naive fp32 kernel.
//!
//! On CUDA the four scans are CubeCL kernels ([`cuda_scan`]); [`bench`] checks any backend's
//! scans against the reference and times them (`nsactor bench kernels`).
//!
//! Depends on burn; with the `cuda` feature also on burn-cuda, burn-cubecl, cubecl, cubek and
//! cudarc (cuBLASLt, loaded at run time).

mod autodiff;
pub mod bench;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_device;
#[cfg(feature = "cuda")]
pub mod cuda_gemm;
#[cfg(feature = "cuda")]
pub mod cuda_graph;
#[cfg(feature = "cuda")]
pub mod cuda_infer;
#[cfg(feature = "cuda")]
pub mod cuda_scan;
#[cfg(feature = "cuda")]
pub mod cuda_timing;
mod ops;
pub mod parity;
pub mod reference;

pub use ops::{
    FfnGrads, FfnInputs, NormPlifInputs, PlifGrads, PlifOutput, PonderInputs, SelectiveGrads,
    SelectiveInputs, SnnOps, StepGraph, block_scan_fused, centred_residual_fused, decode_fusion,
    ffn_backward_reference, ffn_forward_reference, ffn_neurons, ffn_param_grads, ffn_plif_fused,
    ffn_plif_fused_rows, gate_skip_fused, gemm_operand, last_frame, matmul, matmul_add,
    matmul_stored, norm_plif_backward_reference, norm_plif_forward_reference, norm_plif_fused,
    norm_plif_mean_fused, norm_plif_train, plif_elem, plif_row, plif_selective, ponder_agg_fused,
    ponder_agg_train, ponder_backward_reference, ponder_forward_reference, ponder_residual_fused,
    rms_norm_fused, selective_backward_reference, selective_forward_reference,
    selective_modulation, set_decode_fusion, softplus, stored,
};
