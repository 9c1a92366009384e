//! The burn-free contract between the nsactor runtime and its compute backends.
//!
//! Both sides depend on this crate and nothing else of each other. A backend — linked in, or a
//! plugin loaded at run time through the C ABI of `nsactor-plugin-abi` — implements
//! [`ComputeBackend`]: it moves tensors between host and devices and opens [`Stage`]s, one per
//! decoder layer and one for the edge (embedding + decode path + tied head). The runtime drives
//! stages with [`StageCall`]s and sees tensors only as opaque [`DeviceTensor`] handles; only token
//! ids, scalars and (on request) host copies of tensors cross as plain values (DESIGN "The
//! seams", points 2 and 3). [`model`] has the hyperparameters every side shares; [`ids`] the
//! typed session and micro-batch numbers and their one allocator; [`reply`] the named fields of
//! each call's reply; [`diagnose`] the diagnostics a backend runs on request; [`optim`] the pure
//! arithmetic the supervisor applies between stages (natural-gradient phase 2, clipping);
//! [`timing`] the device-time breakdown backends report; [`files`] the atomic write both sides
//! use for the files the other reads; [`collective`] the names of communication groups between
//! processes; [`bytes`] a stage's serialised state, owned where it was made; [`tuning`] the kernels' tuning knobs, one typed value sent in the plugin's options. [`ABI_VERSION`] names the revision of
//! the contract.
//!
//! Depends on nothing but `std`.

pub mod bytes;
pub mod collective;
pub mod diagnose;
pub mod files;
pub mod grads;
pub mod ids;
pub mod model;
pub mod optim;
pub mod picks;
pub mod reply;
pub mod stage;
pub mod timing;
pub mod tuning;

pub use bytes::ShardBytes;
pub use collective::{CollectiveId, Communicator};
pub use diagnose::{DeviceMemory, Diagnostic, DiagnosticReport, ScanPrecisions};
pub use grads::{GradPart, GradStream, ParamMask};
pub use ids::{IdAllocator, MicroBatchId, SessionId, SnapshotId};
pub use model::{ModelConfig, PlifOut};
pub use picks::{PickParams, PickRow, Picks, PicksBuf, RowPick};
pub use reply::{
    BETA_BINS, BiasGradNorms, ForwardOut, GradSumSquares, HeadOut, Loss, Probe, Spread,
};
pub use stage::{
    BackendInfo, ComputeBackend, DeviceTensor, HostTensor, InitialWeights, OptimizerKind, Reply,
    SavedBytes, Stage, StageCall, StageKind, StageSnapshot, StageSpec, TensorObject, Tokens,
};
pub use tuning::KernelTuning;

use std::fmt;

/// Revision of the backend contract (the [`StageCall`] set and the C function table); bumped on
/// any incompatible change. A host refuses a plugin built against another revision.
/// Revision 4 added `tensor_ready` ([`ComputeBackend::ready`]). Revision 5 typed the seams:
/// stages open with a [`ModelConfig`] (not TOML text), diagnostics are [`Diagnostic`] /
/// [`DiagnosticReport`] values (JSON on the C boundary) instead of free text, and calls name
/// [`SessionId`]s and [`MicroBatchId`]s. Revision 6 added stage snapshots
/// ([`Stage::snapshot`], `stage_snapshot`/`snapshot_bytes`/`snapshot_free`). Revision 7 added
/// the interpretability calls [`StageCall::Probe`] and [`StageCall::TokenLosses`]. Revision 8
/// added sampling on the device ([`StageCall::SessionSample`] with its [`Picks`]). Revision 9
/// added the gradient exchange of data parallelism ([`StageCall::HoldGrads`],
/// [`StageCall::GradsOut`], [`StageCall::GradsIn`]). Revision 10 added collectives between
/// processes ([`ComputeBackend::collective_id`], [`ComputeBackend::collective_join`],
/// [`ComputeBackend::all_reduce_sum`]). Revision 11 added [`StageSpec::weights`]: a stage opened
/// to load its weights draws none. Revision 12 made [`StageSpec::optimizer`] optional: a stage
/// that only serves keeps no optimizer state. Revision 13 added [`StageCall::SessionDecodeAll`]:
/// every position's logits of a prefill (a prompt scored in one pass). Revision 14 added the
/// prefix cache's state snapshots ([`StageCall::StateSave`], `StateRestore`, `StateDrop`,
/// `StateRead`, `StateWrite`). Revision 15 made `StateSave` and `StateRestore` name many
/// sessions at once (one copy per state field for all of them). Revision 16 added
/// [`StageCall::Evaluate`]: a layer's training forward that keeps nothing. Revision 17 added
/// [`ComputeBackend::prewarm`]: a step's kernels compiled without running them. Revision 18
/// added `min_p` to each row of [`Picks`].
pub const ABI_VERSION: u32 = 18;

/// One micro-batch of token ids, row-major `[batch, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    /// Model inputs.
    pub inputs: Vec<i64>,
    /// Shifted targets (`inputs[t + 1]`); id 0 is padding and never scored.
    pub targets: Vec<i64>,
    /// 1.0 where a target counts toward the loss.
    pub loss_mask: Vec<f32>,
}

impl Batch {
    /// Checks the three arrays agree with `batch × seq_len`.
    pub fn validate(&self) -> Result<(), EngineError> {
        let n = self.batch * self.seq_len;
        if n == 0 || self.inputs.len() != n || self.targets.len() != n || self.loss_mask.len() != n
        {
            return Err(EngineError::InvalidInput(format!(
                "batch {}×{} needs {n} inputs, targets and mask values; got {}, {}, {}",
                self.batch,
                self.seq_len,
                self.inputs.len(),
                self.targets.len(),
                self.loss_mask.len()
            )));
        }
        Ok(())
    }
}

/// Errors a backend reports; each carries a message that says what to do.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineError {
    /// The caller passed something wrong (shapes, ids, an unknown micro-batch).
    InvalidInput(String),
    /// Reading or writing bytes failed (weights, checkpoints).
    Io(String),
    /// The device or the backend failed (no GPU, out of memory, a kernel error).
    Backend(String),
    /// The backend panicked; the call was abandoned and the stage should be considered lost.
    Panic(String),
    /// The plugin boundary itself: not found, wrong ABI, missing symbol.
    Plugin(String),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            EngineError::Io(m) => write!(f, "I/O: {m}"),
            EngineError::Backend(m) => write!(f, "backend: {m}"),
            EngineError::Panic(m) => write!(f, "backend panicked: {m}"),
            EngineError::Plugin(m) => write!(f, "plugin: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}
