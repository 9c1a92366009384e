//! nsactor's control plane across processes and hosts.
//!
//! A run of several processes is a *world*: each process is a rank, rank 0 coordinates. The
//! [`World`] comes from the environment (torchrun-style variables, or Slurm's); [`Peers`]
//! joins it over `ractor_cluster` (nodes authenticated with the world's shared secret) and
//! carries the typed [`wire::Packet`]s ranks exchange: the hello that checks every rank runs
//! the same configuration from the same step, the gradient parts of a data-parallel
//! reduction, each step's micro-batch results, and the end of the run. What the packets mean
//! for training is the runtime's business (`nsactor-pipeline`'s `world`); this crate
//! knows no tensors and no model.

pub mod error;
pub mod peers;
pub mod wire;
pub mod world;

pub use error::ClusterError;
pub use peers::Peers;
pub use wire::{Body, Kind, MicroResult, Packet, WirePart};
pub use world::World;

/// FNV-1a over `bytes`: the same on every host and build, for configuration fingerprints.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
