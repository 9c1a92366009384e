//! Checkpoints, the run's memory: the on-disk format (a manifest with every shard's digest, written
//! atomically, newest valid one found on resume; [`checkpoint`]), shards written as they are read
//! back ([`stream`]) with the disk kept busy ([`disk`]), a stage's parameters kept in the
//! checkpoint's one weights file and its optimizer state in its shard ([`split`]), the background [`writer`] that keeps a step from waiting on the disk, merged
//! parameter files ([`weights`]), finding a checkpoint from a run directory and exporting to /
//! importing from a Hugging Face directory ([`export`]), and models by Hugging Face Hub name
//! ([`hub`]). It knows the model only through `nsactor-engine`'s configuration and staged engine;
//! the actor pipeline writes through it.

mod ahead;
pub mod checkpoint;
pub mod disk;
pub mod export;
pub mod hub;
pub mod source;
pub mod split;
pub mod stream;
pub mod streamed;
pub mod weights;
pub mod writer;
