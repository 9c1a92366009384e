//! Stages, device tensors and the calls that drive them.
//!
//! A [`ComputeBackend`] opens one [`Stage`] per decoder layer ([`StageKind::Layer`]) and one for
//! the edge ([`StageKind::Edge`]: embedding, decode path and the tied head, which share one
//! matrix). A stage owns its parameters, gradient accumulators, optimizer state, the inputs it
//! keeps for recompute, and the membrane states of decoding sessions. The host drives it with
//! [`StageCall`]s; each call returns a [`Reply`] whose tensors and scalars are documented on the
//! call. Tensors are opaque [`DeviceTensor`]s owned by whoever holds them; dropping one frees it
//! on its device. Passing a tensor into a call moves it there.
//!
//! One training micro-batch `m` flows: `Embed{m}` (edge) → `Forward{m}` on every layer in order →
//! `Head{m}` (edge: loss and its gradient) → `Backward{m}` on every layer in reverse (each
//! recomputes its forward from the input it kept) → `EmbedBackward{m}` (edge). After all
//! micro-batches: `GradStats` on every layer → the host computes phase-2 factors
//! ([`crate::optim::phase2_scales`]) → `ScaleGrads` on every stage (each replies its gradient
//! sum of squares) → one global clip factor → `Step` on every stage.

use crate::diagnose::{Diagnostic, DiagnosticReport};
use crate::{EngineError, MicroBatchId, ModelConfig, SessionId, ShardBytes, SnapshotId};
use std::any::Any;
use std::fmt;

/// What a backend says about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendInfo {
    /// Short name used for selection (`ndarray`, `cuda`).
    pub name: String,
    /// The backend crate's version.
    pub version: String,
    /// The [`crate::ABI_VERSION`] it was built against.
    pub abi_version: u32,
    /// One description per usable device, indexed by device number.
    pub devices: Vec<String>,
}

/// A backend-side tensor object behind a [`DeviceTensor`].
pub trait TensorObject: Any + Send {
    /// Dimensions, outermost first.
    fn shape(&self) -> Vec<usize>;
    fn as_any(&self) -> &dyn Any;
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

/// An opaque tensor resident on a backend device. Dropping it frees the device memory.
pub struct DeviceTensor(Box<dyn TensorObject>);

impl DeviceTensor {
    pub fn new<T: TensorObject>(t: T) -> Self {
        DeviceTensor(Box::new(t))
    }

    pub fn shape(&self) -> Vec<usize> {
        self.0.shape()
    }

    /// The backend's own object, if it is a `T`; otherwise the handle back.
    pub fn downcast<T: TensorObject>(self) -> Result<T, DeviceTensor> {
        if self.0.as_any().is::<T>() {
            Ok(*self.0.into_any().downcast::<T>().expect("type checked"))
        } else {
            Err(self)
        }
    }

    pub fn downcast_ref<T: TensorObject>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceTensor{:?}", self.shape())
    }
}

/// A host copy of a tensor: f32 values, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

/// Which part of the model a stage holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StageKind {
    /// Embedding, decode path and tied head (parameters without a `layers.` prefix).
    Edge,
    /// Decoder layer `i` (parameters `layers.{i}.*`).
    Layer(usize),
}

/// Pretraining uses Adam; SFT uses AdamW with weight decay 0.01 on the base group (SPEC §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    Adam,
    AdamW,
}

/// Where a stage's first parameters come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InitialWeights {
    /// Drawn from [`StageSpec::seed`]: the step-0 state of a new run.
    #[default]
    Seeded,
    /// Loaded by the caller ([`Stage::load`]) before any other call: the stage draws nothing
    /// (drawing a 0.9B layer took about a second) and refuses every call until loaded.
    Loaded,
}

/// Everything a backend needs to open a stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageSpec {
    pub kind: StageKind,
    /// Device number on the backend (see [`BackendInfo::devices`]).
    pub device: usize,
    /// The model's hyperparameters (validated by the caller).
    pub model: ModelConfig,
    /// Initialisation seed of the whole model; each stage derives its own stream from it, so
    /// a stage's initial parameters do not depend on how layers are grouped.
    pub seed: u64,
    /// The optimizer of a stage that trains; `None` for one that only serves or evaluates: it
    /// keeps no optimizer state (a checkpoint's Adam moments are not loaded, about 8 bytes a
    /// parameter of device memory saved) and refuses [`StageCall::Step`].
    pub optimizer: Option<OptimizerKind>,
    pub weights: InitialWeights,
}

/// Token ids `[batch, seq_len]`, row-major.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tokens<'a> {
    pub ids: &'a [i64],
    pub batch: usize,
    pub seq_len: usize,
}

impl Tokens<'_> {
    pub fn validate(&self) -> Result<(), EngineError> {
        if self.batch == 0 || self.seq_len == 0 || self.ids.len() != self.batch * self.seq_len {
            return Err(EngineError::InvalidInput(format!(
                "tokens [{}×{}] need {} ids, got {}",
                self.batch,
                self.seq_len,
                self.batch * self.seq_len,
                self.ids.len()
            )));
        }
        Ok(())
    }
}

/// One request to a stage. `micro` names a training micro-batch (unique among those in flight);
/// `session` a decoding session; both come from one [`IdAllocator`](crate::IdAllocator). Residual-stream tensors are
/// `[T, B, D]`.
#[derive(Debug)]
pub enum StageCall<'a> {
    /// Layer: training forward from membranes at rest; keeps `h` for `Backward{micro}`, or
    /// with `keep_graph` the forward's whole autodiff graph (no recompute in the backward: one
    /// forward pass less, the layer's activations held until then).
    /// Reply: [`ForwardOut`](crate::ForwardOut).
    Forward {
        micro: MicroBatchId,
        h: DeviceTensor,
        keep_graph: bool,
    },
    /// Layer: recomputes the forward of `micro` under autodiff (unless its graph was kept) and
    /// back-propagates `grad` (∂loss/∂h_out) plus `ponder_grad` (∂loss/∂ponder_cost);
    /// accumulates parameter gradients. Reply: `[∂loss/∂h_in]`.
    Backward {
        micro: MicroBatchId,
        grad: DeviceTensor,
        ponder_grad: f64,
    },
    /// Edge: embeds `tokens`, keeping them for `EmbedBackward{micro}`. Reply: `[h]` `[T, B, D]`.
    Embed {
        micro: MicroBatchId,
        tokens: Tokens<'a>,
    },
    /// Edge: decode path, masked mean cross entropy (ignore id 0) of `h` against `targets`, and
    /// its backward with the loss scaled by `loss_scale`; accumulates head gradients.
    /// Reply: [`HeadOut`](crate::HeadOut).
    Head {
        /// The micro-batch whose head this is (heads come in micro-batch order).
        micro: MicroBatchId,
        h: DeviceTensor,
        targets: &'a [i64],
        mask: &'a [f32],
        loss_scale: f64,
    },
    /// Edge: the cross entropy only. Reply: [`Loss`](crate::Loss).
    HeadEval {
        h: DeviceTensor,
        targets: &'a [i64],
        mask: &'a [f32],
    },
    /// Edge: back-propagates `grad` (∂loss/∂h of `Embed{micro}`) into the embedding. Reply: none.
    EmbedBackward {
        micro: MicroBatchId,
        grad: DeviceTensor,
    },
    /// Layer: natural-gradient phase 1 on the accumulated gradients, then the L2 norms of the
    /// `b_beta`, `b_alpha`, `b_th` gradients Reply: [`BiasGradNorms`](crate::BiasGradNorms) (all `None` from the edge).
    GradStats,
    /// Multiplies the `b_beta`, `b_alpha`, `b_th` gradients by the phase-2 factors (layers; the
    /// edge ignores them). Reply: [`GradSumSquares`](crate::GradSumSquares) of the stage.
    ScaleGrads { scales: [f64; 3] },
    /// Multiplies every gradient by `clip`, then one optimizer step at `lr` (base group) and
    /// `neuron_lr` (neuron group); clears the gradients. Reply: none.
    Step { lr: f64, neuron_lr: f64, clip: f64 },
    /// Drops accumulated gradients and kept inputs (an abandoned step). Reply: none.
    ZeroGrad,
    /// Edge: embeds `tokens` for decoding; nothing is kept. Reply: `[h]`.
    SessionEmbed { tokens: Tokens<'a> },
    /// Layer: forward of several decoding sessions batched together, from each session's
    /// membrane states (at rest for a new session), keeping the new states. `h` is
    /// `[T, B, D]` with `B` a multiple of `sessions.len()`: session `i` owns batch rows
    /// `i·B/n .. (i+1)·B/n`. Sessions must be distinct, and a session keeps the row count it
    /// started with. Reply: `[h_out]`.
    SessionForward {
        sessions: &'a [SessionId],
        h: DeviceTensor,
    },
    /// Edge: decode path from each session's output-neuron state, rows split among `sessions`
    /// as in `SessionForward`. Reply: `[logits]` `[1, B, V]` of the last position.
    SessionDecode {
        sessions: &'a [SessionId],
        h: DeviceTensor,
    },
    /// Edge: `SessionDecode` with every position's logits: `[T, B, V]` (a prompt scored in one
    /// pass; position `t` holds the logits after the row's input `t`).
    SessionDecodeAll {
        sessions: &'a [SessionId],
        h: DeviceTensor,
    },
    /// Edge: `SessionDecode`, then every row's next token chosen on the device as its
    /// [`Picks`](crate::Picks) row says (one row per batch row). Reply: `[picked, logits]`:
    /// `picked` `[1, 2, B]` f32 holds each row's token id (exact: vocabularies stay under 2²⁴)
    /// and the log-probability of that token under the model's own distribution; `logits`
    /// `[1, B, V]` stays on the device unless the host reads it.
    SessionSample {
        sessions: &'a [SessionId],
        h: DeviceTensor,
        picks: crate::Picks<'a>,
    },
    /// Layer or edge: forgets `session`'s states. Reply: none.
    SessionClose { session: SessionId },
    /// Layer or edge: keeps a copy of each of `sessions`' states as they are now under the
    /// snapshot beside it in `snapshots` (same length; replacing one kept there); the sessions
    /// go on unchanged. All of them or none: a call that cannot keep one keeps nothing. Reply:
    /// one scalar, the device bytes each copy holds (all hold the same).
    StateSave {
        sessions: &'a [SessionId],
        snapshots: &'a [SnapshotId],
    },
    /// Layer or edge: each of `sessions`, which hold no states, starts from a copy of the
    /// snapshot beside it in `snapshots` (same length; one snapshot may serve many). All of
    /// them or none. Reply: none.
    StateRestore {
        sessions: &'a [SessionId],
        snapshots: &'a [SnapshotId],
    },
    /// Layer or edge: forgets `snapshot` (nothing happens for an unknown one). Reply: none.
    StateDrop { snapshot: SnapshotId },
    /// Layer or edge: copies of `snapshot`'s states, one `[1, rows, width]` tensor per state
    /// field in field order (a layer's four, the edge's one), to take to the host. Reply: them.
    StateRead { snapshot: SnapshotId },
    /// Layer or edge: keeps `states` (as `StateRead` gave them, of this stage's shapes) under
    /// `snapshot`, replacing one kept there. Reply: as `StateSave`.
    StateWrite {
        snapshot: SnapshotId,
        states: Vec<DeviceTensor>,
    },
    /// Layer: forward of `h` from membranes at rest, keeping nothing, with what the
    /// interpretability study reads (`nsactor analyze`). Reply: [`Probe`](crate::Probe).
    Probe { h: DeviceTensor },
    /// Layer: the training forward of `h` from membranes at rest, keeping nothing (a held-out
    /// evaluation: the training step's kernels at its shapes, none compiled or chosen anew).
    /// Reply: `[h_out]`.
    Evaluate { h: DeviceTensor },
    /// Edge: the decode path and the cross entropy of every position of `h` against `targets`
    /// (`[B, T]` row-major; id 0 is padding and scores 0), nothing kept. Reply: `[ce]`
    /// `[1, B, T]` in nats: the surprisal `−ln p(target)` of each position.
    TokenLosses { h: DeviceTensor, targets: &'a [i64] },
    /// Layer or edge: while `hold` is set, each micro-batch's gradients wait apart under its
    /// id (a data-parallel replica whose micro-batches are not the step's first: they are
    /// added in order once every replica's are in). Kept until changed. Reply: none.
    HoldGrads { hold: bool },
    /// Layer or edge: takes the stage's first gradient part (or, with `keep`, a copy of it,
    /// leaving it in place): unless holding, every waiting set is added first; then each
    /// stream's sum, else its waiting set with the smallest id. Reply: a
    /// [`GradPart`](crate::GradPart), or none when no gradient is left.
    GradsOut { keep: bool },
    /// Layer or edge: `grad`, a part as `GradsOut` hands it, waits in `stream` under `micro`
    /// and is added in micro-batch order, after the stream's sum so far. Reply: none.
    GradsIn {
        stream: crate::GradStream,
        micro: MicroBatchId,
        mask: &'a crate::ParamMask,
        grad: DeviceTensor,
    },
}

impl StageCall<'_> {
    /// Stable numeric code of the call (its C ABI opcode).
    pub fn opcode(&self) -> u32 {
        match self {
            StageCall::Forward { .. } => 1,
            StageCall::Backward { .. } => 2,
            StageCall::Embed { .. } => 3,
            StageCall::Head { .. } => 4,
            StageCall::HeadEval { .. } => 5,
            StageCall::EmbedBackward { .. } => 6,
            StageCall::GradStats => 7,
            StageCall::ScaleGrads { .. } => 8,
            StageCall::Step { .. } => 9,
            StageCall::ZeroGrad => 10,
            StageCall::SessionEmbed { .. } => 11,
            StageCall::SessionForward { .. } => 12,
            StageCall::SessionDecode { .. } => 13,
            StageCall::SessionClose { .. } => 14,
            StageCall::Probe { .. } => 15,
            StageCall::TokenLosses { .. } => 16,
            StageCall::SessionSample { .. } => 17,
            StageCall::HoldGrads { .. } => 18,
            StageCall::GradsOut { .. } => 19,
            StageCall::GradsIn { .. } => 20,
            StageCall::SessionDecodeAll { .. } => 21,
            StageCall::StateSave { .. } => 22,
            StageCall::StateRestore { .. } => 23,
            StageCall::StateDrop { .. } => 24,
            StageCall::StateRead { .. } => 25,
            StageCall::StateWrite { .. } => 26,
            StageCall::Evaluate { .. } => 27,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            StageCall::Forward { .. } => "Forward",
            StageCall::Backward { .. } => "Backward",
            StageCall::Embed { .. } => "Embed",
            StageCall::Head { .. } => "Head",
            StageCall::HeadEval { .. } => "HeadEval",
            StageCall::EmbedBackward { .. } => "EmbedBackward",
            StageCall::GradStats => "GradStats",
            StageCall::ScaleGrads { .. } => "ScaleGrads",
            StageCall::Step { .. } => "Step",
            StageCall::ZeroGrad => "ZeroGrad",
            StageCall::SessionEmbed { .. } => "SessionEmbed",
            StageCall::SessionForward { .. } => "SessionForward",
            StageCall::SessionDecode { .. } => "SessionDecode",
            StageCall::SessionDecodeAll { .. } => "SessionDecodeAll",
            StageCall::SessionClose { .. } => "SessionClose",
            StageCall::Probe { .. } => "Probe",
            StageCall::TokenLosses { .. } => "TokenLosses",
            StageCall::SessionSample { .. } => "SessionSample",
            StageCall::HoldGrads { .. } => "HoldGrads",
            StageCall::GradsOut { .. } => "GradsOut",
            StageCall::GradsIn { .. } => "GradsIn",
            StageCall::StateSave { .. } => "StateSave",
            StageCall::StateRestore { .. } => "StateRestore",
            StageCall::StateDrop { .. } => "StateDrop",
            StageCall::StateRead { .. } => "StateRead",
            StageCall::StateWrite { .. } => "StateWrite",
            StageCall::Evaluate { .. } => "Evaluate",
        }
    }
}

/// What a call returns: tensors and scalars as documented on each [`StageCall`].
#[derive(Debug, Default)]
pub struct Reply {
    pub tensors: Vec<DeviceTensor>,
    pub scalars: Vec<f64>,
}

impl Reply {
    pub fn none() -> Self {
        Reply::default()
    }

    pub fn tensor(t: DeviceTensor) -> Self {
        Reply {
            tensors: vec![t],
            scalars: Vec::new(),
        }
    }

    /// The one tensor of a reply that has exactly one.
    pub fn into_tensor(mut self, call: &str) -> Result<DeviceTensor, EngineError> {
        if self.tensors.len() != 1 {
            return Err(EngineError::Backend(format!(
                "{call} replied {} tensors, expected 1",
                self.tensors.len()
            )));
        }
        Ok(self.tensors.pop().expect("one"))
    }

    /// Scalar `i`, or an error naming the call.
    pub fn scalar(&self, i: usize, call: &str) -> Result<f64, EngineError> {
        self.scalars.get(i).copied().ok_or_else(|| {
            EngineError::Backend(format!(
                "{call} replied {} scalars, expected at least {}",
                self.scalars.len(),
                i + 1
            ))
        })
    }
}

/// A model part on a device, driven by [`StageCall`]s. Stages are used from one thread at a
/// time but may move between threads.
pub trait Stage: Send {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError>;
    /// Parameters and optimizer state as safetensors bytes: parameters under their reference
    /// names (`layers.3.snn_block.W_in.weight`), optimizer moments as `adam.exp_avg.<name>` and
    /// `adam.exp_avg_sq.<name>`, step counts in the `nsactor` metadata entry. Equal states give equal bytes.
    fn save(&self) -> Result<Vec<u8>, EngineError>;
    /// The state [`save`](Self::save) would write, taken now and serialised later
    /// ([`StageSnapshot::bytes`], from any thread): training goes on while a checkpoint is
    /// written. A backend whose optimizer writes new tensors (never into the ones it holds)
    /// snapshots by keeping its tensors' handles, on the device, without reading them. Default:
    /// the saved bytes.
    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        Ok(Box::new(SavedBytes(self.save()?)))
    }
    /// Restores from safetensors bytes. Every parameter of the stage must be present; tensors of
    /// other stages are ignored, so one whole-model file can feed every stage. Optimizer state
    /// is restored when present and reset otherwise.
    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError>;
    /// Trainable parameters held.
    fn param_count(&self) -> u64;
}

/// A stage's state at one instant ([`Stage::snapshot`]), not yet serialised.
pub trait StageSnapshot: Send {
    /// The bytes [`Stage::save`] would have returned when the snapshot was taken, in the
    /// buffer they were serialised into (a plugin's is read in place, not copied).
    fn bytes(self: Box<Self>) -> Result<ShardBytes, EngineError>;
}

/// A snapshot that is already bytes.
pub struct SavedBytes(pub Vec<u8>);

impl StageSnapshot for SavedBytes {
    fn bytes(self: Box<Self>) -> Result<ShardBytes, EngineError> {
        Ok(self.0.into())
    }
}

/// A compute backend: devices, tensor transfer and stages.
pub trait ComputeBackend: Send + Sync {
    fn info(&self) -> BackendInfo;
    /// Copies host values to `device`. Tensors are 3-D.
    // The transfer names of DESIGN.md (`from_host`/`to_host`/`to_device`) win over the lint.
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, device: usize, t: &HostTensor) -> Result<DeviceTensor, EngineError>;
    fn to_host(&self, t: &DeviceTensor) -> Result<HostTensor, EngineError>;
    /// Moves a tensor to another device of the same backend (a no-op when already there).
    fn to_device(&self, t: DeviceTensor, device: usize) -> Result<DeviceTensor, EngineError>;
    fn open_stage(&self, spec: &StageSpec) -> Result<Box<dyn Stage>, EngineError>;
    /// Returns once the work that produces `t` has finished on its device (the calling
    /// thread's queue there). A stage calls it before handing a tensor to a stage on another
    /// device: an accelerator runs its queue in order, so a receiver that enqueued work on a
    /// tensor still being computed elsewhere would hold its own device idle until then, while
    /// it could have run other ready work. Default: nothing to wait for (backends that compute
    /// synchronously).
    fn ready(&self, t: &DeviceTensor) -> Result<(), EngineError> {
        let _ = t;
        Ok(())
    }
    /// A new communication group's id, made by one process of a world and handed to the
    /// others ([`crate::collective`]). Default: the backend has no collectives.
    fn collective_id(&self) -> Result<crate::CollectiveId, EngineError> {
        Err(crate::collective::unsupported(&self.info().name))
    }
    /// Joins the group `id` as `rank` of `size`, on `device`; returns once every rank has
    /// joined. Default: the backend has no collectives.
    fn collective_join(
        &self,
        id: &crate::CollectiveId,
        rank: usize,
        size: usize,
        device: usize,
    ) -> Result<crate::Communicator, EngineError> {
        let _ = (id, rank, size, device);
        Err(crate::collective::unsupported(&self.info().name))
    }
    /// The element-wise sum of `t` over every rank of `comm`, on `t`'s device (which must be the
    /// group's). Every rank calls it with a tensor of the same length, in the same order as
    /// its other calls on `comm`. Default: the backend has no collectives.
    fn all_reduce_sum(
        &self,
        comm: crate::Communicator,
        t: DeviceTensor,
    ) -> Result<DeviceTensor, EngineError> {
        let _ = (comm, t);
        Err(crate::collective::unsupported(&self.info().name))
    }
    /// Compiles, without running them, the kernels a training step of `spec`'s stage launches
    /// (a layer's forward and backward of a `[seq_len, batch, D]` input on a throwaway copy of
    /// the layer whose weights are never drawn), on the calling thread, in the backend's
    /// compile-only mode; the step's results are thrown away and nothing else changes. A cold
    /// process calls it on a thread of its own while its stages are set up, so that its first
    /// step finds most kernels compiled. Returns whether the backend compiled anything this
    /// way (`false`: it has no such mode, or nothing to compile for this kind of stage).
    /// Default: `false`.
    fn prewarm(&self, spec: &StageSpec, batch: usize, seq_len: usize) -> Result<bool, EngineError> {
        let _ = (spec, batch, seq_len);
        Ok(false)
    }

    /// Runs one of the backend's diagnostics (kernel benchmarks and checks, memory, device
    /// time). Default: the backend has none.
    fn diagnose(&self, what: &Diagnostic) -> Result<DiagnosticReport, EngineError> {
        Err(EngineError::InvalidInput(format!(
            "backend {} has no diagnostic `{}`",
            self.info().name,
            what.name()
        )))
    }
}
