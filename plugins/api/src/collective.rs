//! Collectives between processes: the values that name a communication group on the contract.
//!
//! One process makes a [`CollectiveId`] ([`ComputeBackend::collective_id`], NCCL's unique id on
//! the CUDA backend), the runtime hands it to every other process over its control plane, and
//! each process joins with its rank and device ([`ComputeBackend::collective_join`]), getting a
//! [`Communicator`]. Every process then calls [`ComputeBackend::all_reduce_sum`] on it with
//! tensors of the same length in the same order; the sum of all of them comes back to each. A
//! backend without collectives (the CPU ones) refuses, and the runtime moves tensors through the
//! host over TCP instead.
//!
//! [`ComputeBackend::collective_id`]: crate::ComputeBackend::collective_id
//! [`ComputeBackend::collective_join`]: crate::ComputeBackend::collective_join
//! [`ComputeBackend::all_reduce_sum`]: crate::ComputeBackend::all_reduce_sum

use crate::EngineError;

/// The opaque bytes that name a group before anyone has joined it (NCCL: 128 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveId(pub Vec<u8>);

/// A joined group, as the backend numbers it within this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Communicator(pub u64);

/// The error of a backend that has no collectives.
pub fn unsupported(backend: &str) -> EngineError {
    EngineError::InvalidInput(format!(
        "backend {backend} has no collectives between processes (NCCL is the cuda backend's); \
         tensors cross through the host instead"
    ))
}
