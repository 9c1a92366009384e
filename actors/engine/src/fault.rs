//! Failures to inject on purpose (`[train] inject_fault`, `--inject-fault`): the chaos tests'
//! way of proving that every recovery path works. The actor pipeline fires them.

use crate::error::RuntimeError;

/// A failure to inject, once (`[train] inject_fault` / `--inject-fault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Layer `layer` panics in its forward pass during step `step` (1-based).
    LayerPanic { layer: usize, step: u64 },
    /// Layer `layer` panics in its `pass`-th decoding pass (1-based, counted over the
    /// pipeline's life: the rebuilt layer does not panic again).
    SessionPanic { layer: usize, pass: u64 },
    /// The process aborts while writing the checkpoint of step `step`: after the shards,
    /// before the manifest (a crash mid-checkpoint).
    CrashInCheckpoint { step: u64 },
    /// Writing the checkpoint of step `step` fails as on a full disk (ENOSPC).
    DiskFullInCheckpoint { step: u64 },
    /// Every gradient of step `step` is NaN (the loss is scaled by NaN before the backward).
    NanGrad { step: u64 },
    /// Step `step` measures a loss 100× its true value, as a bad batch would spike it (exercises
    /// the loss-spike guard; the gradients are the step's own).
    LossSpike { step: u64 },
    /// The process of world rank `rank` kills itself with SIGKILL during step `step`, once its
    /// first layer has finished that step's backward passes (a process dying mid-step).
    KillRank { rank: usize, step: u64 },
}

impl std::str::FromStr for Fault {
    type Err = RuntimeError;

    /// `layer-panic:LAYER:STEP`, `session-panic:LAYER:PASS`, `crash-in-checkpoint:STEP`,
    /// `enospc-in-checkpoint:STEP` or
    /// `nan-grad:STEP`, `loss-spike:STEP` or `kill-rank:RANK:STEP`.
    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |p: &str| {
            p.parse::<u64>()
                .map_err(|_| RuntimeError::Invalid(format!("fault `{s}`: `{p}` is not a number")))
        };
        match parts.as_slice() {
            ["layer-panic", layer, step] => Ok(Fault::LayerPanic {
                layer: num(layer)? as usize,
                step: num(step)?,
            }),
            ["session-panic", layer, pass] => Ok(Fault::SessionPanic {
                layer: num(layer)? as usize,
                pass: num(pass)?,
            }),
            ["crash-in-checkpoint", step] => Ok(Fault::CrashInCheckpoint { step: num(step)? }),
            ["enospc-in-checkpoint", step] => Ok(Fault::DiskFullInCheckpoint { step: num(step)? }),
            ["nan-grad", step] => Ok(Fault::NanGrad { step: num(step)? }),
            ["loss-spike", step] => Ok(Fault::LossSpike { step: num(step)? }),
            ["kill-rank", rank, step] => Ok(Fault::KillRank {
                rank: num(rank)? as usize,
                step: num(step)?,
            }),
            _ => Err(RuntimeError::Invalid(format!(
                "fault `{s}`: expected `layer-panic:LAYER:STEP`, `session-panic:LAYER:PASS`, \
                 `crash-in-checkpoint:STEP`, \
                 `enospc-in-checkpoint:STEP`, `nan-grad:STEP`, `loss-spike:STEP` or \
                 `kill-rank:RANK:STEP`"
            ))),
        }
    }
}
