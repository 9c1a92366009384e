//! The decoding engine: many sessions decoded at once through the actor pipeline's layer and
//! edge actors. The [`batcher`] gathers every running session into one cohort per pass
//! ([`cohort`], padded to [`buckets`] sizes: [`batching`]); [`decoder`] is the asynchronous
//! handle servers hold (`AsyncDecoder`), [`stream`] a session's tokens as they come; [`heal`]
//! rebuilds the actors when a stage is lost, within a restart policy; [`pacer`] sizes a prompt's
//! chunks beside decoding streams by time; [`warmup`] compiles every
//! cohort size before serving; [`probe`] records what each layer did for one sequence
//! (interpretability) and [`invariance`] checks that a session's logits do not depend on its
//! cohort.
//!
//! [`handle`] holds `Pipeline`, the synchronous handle that starts the actors (the supervisor
//! and data actor of `nsactor-pipeline`, and this crate's batcher) and drives training steps,
//! checkpoints and decoding through them: the one place that sees both sides.

pub mod batcher;
pub mod batching;
pub mod buckets;
pub mod cohort;
pub mod decoder;
pub mod handle;
pub mod heal;
pub mod invariance;
mod kept;
pub mod logprobs;
mod order;
pub mod pacer;
pub mod prefix;
pub mod probe;
pub mod snapshot;
pub mod stream;
pub mod warmup;

pub use batcher::{PickRequest, Picked};
pub use decoder::AsyncDecoder;
pub use handle::Pipeline;
pub use nsactor_pipeline::{PipelinePlan, Ponder, StepReport};
pub use probe::{LayerProbe, SequenceProbe};
pub use stream::{DecodeStream, MAX_UNREAD, StreamItem, StreamPlan};
