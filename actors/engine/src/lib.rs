//! The model as stages of a compute backend, and the run's configuration: the lowest floor of
//! the actor side.
//!
//! A model is only [`Stage`]s of a [`ComputeBackend`]: the backend linked into the binary or a
//! plugin loaded through the C ABI ([`backend`]). [`engine`] drives the stages in order on the
//! calling thread — the reference schedule the actor pipeline (`nsactor-pipeline`) must
//! reproduce — and [`decode`] chooses tokens from logits. [`config`] is the layered run
//! configuration (defaults ← file ← environment ← flags) with its [`schedule`]; [`placement`]
//! says where stages live and [`fault`] which failure to inject. It never depends on burn or a
//! backend, except through the optional default feature `embedded-cpu`, which links the ndarray
//! backend in as the embedded default so `cargo run --release -- train` works on a fresh
//! checkout. Tokenizer, corpora and batches come from `nsactor-data`.
//!
//! [`Stage`]: nsactor_plugin_api::Stage
//! [`ComputeBackend`]: nsactor_plugin_api::ComputeBackend

pub mod backend;
pub mod config;
pub mod decode;
pub mod engine;
pub mod error;
pub mod fault;
pub mod placement;
pub mod schedule;
pub mod supervision;

pub use error::{Result, RuntimeError};
