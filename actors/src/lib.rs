//! The nsactor runtime and its command-line program.
//!
//! Today this is the single-process training loop (`nsactor train`) driving a [`TrainEngine`];
//! the ractor supervisor, layer actors and server grow here. This crate depends on the burn-free
//! engine contract (`nsactor-plugin-api`) only — never on burn or a backend — except through the
//! optional default feature `embedded-cpu`, which links the ndarray backend in as the embedded
//! default so `cargo run --release -- train` works on a fresh checkout. Tokenizer, corpora and
//! batches come from `nsactor-data`.
//!
//! [`TrainEngine`]: nsactor_plugin_api::TrainEngine

pub mod config;
pub mod train;
