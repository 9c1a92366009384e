//! The actor pipeline: the model's stages as ractor actors, driven by a supervisor (DESIGN.md,
//! "Actors"). It runs training steps, checkpoints through `nsactor-checkpoint`, recovers from
//! lost actors and exchanges gradients between replicas and processes; the decoding batcher
//! (`nsactor-decoding`) drives the same actors for sessions.
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
//! The synchronous handle over all of this, `Pipeline`, lives in `nsactor-decoding`, which
//! owns the batcher it also starts.

pub mod collective;
pub mod data;
pub mod edge;
pub mod guard;
pub mod heal;
pub mod holder;
pub mod keep;
mod keep_run;
pub mod lanes;
pub mod layer;
pub mod layers;
pub mod msg;
pub mod plan;
pub mod probe;
pub mod recovery;
pub mod replicas;
pub mod round;
pub mod state;
pub mod step;
pub mod supervisor;
pub mod topology;
pub mod trace;
pub mod worker;
pub mod world;

pub use plan::PipelinePlan;
pub use step::Ponder;
pub use supervisor::StepReport;
