//! The actor runtime: the model's stages as ractor actors in a pipeline, driven by a
//! supervisor (DESIGN.md, "Actors").
//!
//! ```text
//! Supervisor ─┬─ DataActor   (sampler; prefetches the next step's micro-batches)
//!             ├─ EdgeActor   (embedding + head + loss; owns the tied matrix)
//!             └─ LayerActor 0..L-1, grouped into P pipeline stages
//! BatcherActor    (decoding: batches concurrent sessions into cohorts through the same actors)
//! ```
//!
//! Compute runs only on [`worker`] threads (one per pipeline stage, one for the edge); actors
//! hand their stage to the worker with the job and get it back with the result, so a layer's
//! parameters, optimizer state and neuron states stay owned by its actor. A micro-batch flows
//! edge → layer 0 → … → layer L−1 → edge (loss) → layer L−1 → … → layer 0 → edge, each hop a
//! message. The supervisor admits at most P micro-batches at once, which bounds every mailbox
//! and every worker queue (at most P + 1 messages each), and keeps activation memory to
//! P kept inputs per layer.
//!
//! [`Pipeline`] is the synchronous handle the CLI and tests use.

pub mod batcher;
pub mod batching;
pub mod buckets;
pub mod checkpoint;
pub mod cohort;
pub mod collective;
pub mod data;
pub mod decoder;
pub mod edge;
pub mod guard;
pub mod handle;
pub mod heal;
pub mod holder;
pub mod lanes;
pub mod layer;
pub mod layers;
pub mod msg;
pub mod plan;
pub mod probe;
pub mod recovery;
pub mod replicas;
pub mod step;
pub mod stream;
pub mod supervisor;
pub mod topology;
pub mod trace;
pub mod warmup;
pub mod worker;
pub mod world;
pub mod writer;

pub use batcher::{PickRequest, Picked};
pub use decoder::AsyncDecoder;
pub use handle::Pipeline;
pub use plan::PipelinePlan;
pub use probe::{LayerProbe, SequenceProbe};
pub use step::Ponder;
pub use stream::{DecodeStream, MAX_UNREAD, StreamItem, StreamPlan};
pub use supervisor::StepReport;
