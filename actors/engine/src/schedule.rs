//! How a training step is laid out: the order micro-batches take on the stage workers
//! ([`Schedule`], `[train] schedule`) and how data-parallel replicas sum their gradients
//! ([`DpReduce`], `[train] dp_reduce`).

use crate::error::RuntimeError;
use serde::{Deserialize, Serialize};

/// `[train] schedule`: see [`TrainConfig::schedule`](crate::config::TrainConfig::schedule).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// `fifo` on the CPU backend, `depth-first` on the others ([`Schedule::resolve`]).
    #[default]
    Auto,
    Fifo,
    DepthFirst,
}

impl Schedule {
    /// The schedule a pipeline on the backend named `backend` runs: `auto` keeps the CPU
    /// backend (`ndarray`) bit-for-bit reproducible and gives accelerators the overlap.
    pub fn resolve(self, backend: &str) -> Schedule {
        match (self, backend) {
            (Schedule::Auto, "ndarray") => Schedule::Fifo,
            (Schedule::Auto, _) => Schedule::DepthFirst,
            (s, _) => s,
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        match s {
            "auto" => Ok(Schedule::Auto),
            "fifo" => Ok(Schedule::Fifo),
            "depth-first" => Ok(Schedule::DepthFirst),
            other => Err(RuntimeError::Invalid(format!(
                "schedule must be auto, fifo or depth-first, got `{other}`"
            ))),
        }
    }
}

/// `[train] dp_reduce`: see [`TrainConfig::dp_reduce`](crate::config::TrainConfig::dp_reduce).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DpReduce {
    /// `ordered` on the CPU backend, `sum` on the others ([`DpReduce::resolve`]).
    #[default]
    Auto,
    /// Every micro-batch's gradients added in micro-batch order: the sum of one replica.
    Ordered,
    /// Each replica's sum, then the replicas' sums in replica order.
    Sum,
}

impl DpReduce {
    /// The reduction replicas on the backend named `backend` use.
    pub fn resolve(self, backend: &str) -> DpReduce {
        match (self, backend) {
            (DpReduce::Auto, "ndarray") => DpReduce::Ordered,
            (DpReduce::Auto, _) => DpReduce::Sum,
            (r, _) => r,
        }
    }
}

impl std::str::FromStr for DpReduce {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        match s {
            "auto" => Ok(DpReduce::Auto),
            "ordered" => Ok(DpReduce::Ordered),
            "sum" => Ok(DpReduce::Sum),
            other => Err(RuntimeError::Invalid(format!(
                "dp_reduce must be auto, ordered or sum, got `{other}`"
            ))),
        }
    }
}
