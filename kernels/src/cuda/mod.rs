//! The CUDA backend's kernels and plumbing (feature `cuda`).
//!
//! Kernel families, one file each (CubeCL kernels and their launchers), all taking the PLIF
//! neuron's step from `plif` (charge, fire, soft reset and the reverse step, written once):
//! * [`scan`] — the per-element and row-parameter PLIF scans;
//! * [`selective`] — the selective scan with the SNNBlock modulation fused in (forward and
//!   backward through a `cp.async` ring; the register-loading staged kernels as the fallback);
//! * [`ffn`] — the SNNFFN's gate and up neurons (training and inference);
//! * [`gated`] — the SNNBlock's gated output `r·σ(g) + s` (training and prefill);
//! * [`norm_plif`] — RMSNorm then the input PLIF (inference, and the launcher of both), and
//!   [`norm_plif_staged`], its kernels staged by tokens (training and prefill, and the backward);
//! * [`ponder`], [`ponder_backward`]: PonderNet's halting and aggregation;
//! * [`decode`] — the decoding fusions (the SNNBlock's scan on its merged projection, its gate
//!   and skip, the centred residual, the edge's RMSNorm), and `wide`, the decoding scans for
//!   passes of many sessions (one unit per column).
//!
//! Around them: [`gemm`] (cuBLASLt, with its plans and tuning in `gemm_plan`) in the
//! [`precision`] the process picked, [`naive`] (cubek's naive fp32 GEMM, the GEMMs' on-device
//! reference), [`device`] (contexts and peer copies), [`host_read`] (tensors read back for checkpoints), [`host_write`] (host values uploaded), [`graph`] (CUDA graphs of decoding steps),
//! [`timing`] (device time from CUDA events), [`cache`] (the kernel and autotune caches on disk), `server` (CubeCL's server thread, where queued work
//! runs), `common` (what the kernel families share) and `backend` (the `SnnOps` family for
//! `burn_cuda::Cuda`).

mod backend;
pub mod cache;
mod common;
pub mod decode;
pub mod device;
pub mod ffn;
pub mod gated;
pub mod gemm;
pub mod gemm_chain;
mod gemm_chain_pick;
mod gemm_choice;
mod gemm_invariant;
mod gemm_lt;
mod gemm_plan;
mod gemm_probe;
mod gemm_split;
mod gemm_store;
pub mod graph;
pub mod host_read;
pub mod host_write;
mod long_scan;
pub mod naive;
pub mod nccl;
pub mod norm_plif;
pub mod norm_plif_staged;
pub mod optim;
mod plif;
pub mod ponder;
pub mod ponder_backward;
pub mod precision;
pub mod scan;
pub mod selective;
mod server;
mod speculative;
pub mod timing;
mod wide;
