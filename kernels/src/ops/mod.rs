//! The `SnnOps` backend extension family and the tensor-level API the model calls.
//!
//! `SnnOps` (DESIGN "The seams", point 1) is the union of five traits grouped by job, each with a
//! default for every method so that any burn backend is correct with no extra code, plus its own
//! methods, the fused training ops:
//!
//! * [`gemm`] — `GemmOps`, the GEMM hook every projection goes through and the storage type of
//!   the scans' large activations; `matmul` and its siblings;
//! * [`scan`] — `ScanOps`, the PLIF scans (either `ScanKind`, forward and backward),
//!   defaulting to the exact host reference; `plif_elem` / `plif_row`;
//! * [`infer`] — `InferOps`, the fused inference and decoding ops (default `None`: composed);
//!   their tensor-level wrappers;
//! * [`optim`] — `OptimOps`, the optimizer's update of a flat parameter (Adam), composed by
//!   default;
//! * [`device`] — `DeviceOps` (moves between devices, flushes, timed calls, submission counters)
//!   and `GraphOps` (captured, replayable work);
//! * [`snn`] — `SnnOps` itself and the fused training ops (the selective scan with its
//!   modulation, RMSNorm + input PLIF, PonderAgg, the FFN neurons), differentiable through
//!   `Autodiff<B>`; `plif_selective` and its siblings.
//!
//! [`types`] holds the ops' inputs and outputs. Every file here is generic: the backends'
//! implementations live with them (`crate::cpu`, `crate::autodiff`, `crate::cuda::backend`), the
//! compositions the defaults run in `crate::reference`.

pub(crate) mod device;
pub(crate) mod gemm;
pub(crate) mod infer;
pub(crate) mod optim;
pub(crate) mod scan;
pub(crate) mod snn;
pub(crate) mod types;
