//! The nsactor runtime: everything between a compute backend and a user-facing front end.
//!
//! The runtime sees a model only as [`Stage`]s of a [`ComputeBackend`]: the backend linked into
//! the binary or a plugin loaded through the C ABI ([`backend`]). [`engine`] drives the stages
//! in order — the reference schedule — and [`train`] runs the training loop on it; the actor
//! [`pipeline`] (supervisor, data, edge and layer actors, checkpoints, the decoding batcher)
//! runs the same stages concurrently. The server (`nsactor-server`) and the command-line
//! program (`nsactor`) sit on top of this crate; it never depends on them. It never depends on
//! burn or a backend,
//! except through the optional default feature `embedded-cpu`, which links the ndarray backend
//! in as the embedded default so `cargo run --release -- train` works on a fresh checkout.
//! Tokenizer, corpora and batches come from `nsactor-data`.
//!
//! [`Stage`]: nsactor_plugin_api::Stage
//! [`ComputeBackend`]: nsactor_plugin_api::ComputeBackend

pub mod backend;
pub mod config;
pub mod decode;
pub mod engine;
pub mod error;
pub mod export;
pub mod heldout;
pub mod history;
pub mod invariance;
pub mod launch;
pub mod pipeline;
pub mod schedule;
pub mod shutdown;
pub mod train;
pub mod verify;
pub mod weights;

pub use error::{Result, RuntimeError};
