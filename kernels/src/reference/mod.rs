//! The references every kernel is checked against.
//!
//! * [`scan`] — the exact sequential PLIF scans on host slices, forward and backward (SPEC §6.1,
//!   §6.2): the ground truth, and what `ScanOps`' defaults run;
//! * [`selective`], [`norm_plif`], [`ponder`], [`ffn`], [`gated`]: the fused training ops composed from
//!   tensor ops and the backend's own scans, op for op as the model composes them: what
//!   `SnnOps`' defaults run, and what `nsactor bench kernels` checks the fused kernels against.

pub mod ffn;
pub mod gated;
pub mod norm_plif;
pub mod optim;
pub mod ponder;
pub mod scan;
pub mod selective;

pub use scan::{ScanGrads, ScanOut, elem_backward, elem_forward, row_backward, row_forward};
