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

impl Fault {
    /// Fails where a training run of `layers` layers and `steps` steps would never fire this
    /// fault (a layer it does not have, a step past its last, step 0): a chaos test would
    /// pass without its failure ever happening. A decoding fault never fires in training.
    pub fn fits_training(&self, layers: usize, steps: u64) -> Result<(), RuntimeError> {
        let (layer, step) = match *self {
            Fault::LayerPanic { layer, step } => (Some(layer), step),
            Fault::SessionPanic { .. } => {
                return Err(RuntimeError::Invalid(
                    "`inject_fault`: `session-panic` fires in a server's decoding passes, never in \
                     training: use `layer-panic:LAYER:STEP`"
                        .into(),
                ));
            }
            Fault::CrashInCheckpoint { step }
            | Fault::DiskFullInCheckpoint { step }
            | Fault::NanGrad { step }
            | Fault::LossSpike { step }
            | Fault::KillRank { step, .. } => (None, step),
        };
        if let Some(l) = layer.filter(|&l| l >= layers) {
            return Err(RuntimeError::Invalid(format!(
                "`inject_fault`: layer {l} does not exist (the model has {layers}: 0..={})",
                layers.saturating_sub(1)
            )));
        }
        if step == 0 || step > steps {
            return Err(RuntimeError::Invalid(format!(
                "`inject_fault`: step {step} never runs (steps are 1..={steps}), so it would \
                 never fire"
            )));
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_that_would_never_fire_in_a_training_run_is_refused() {
        let fits = |f: &str| f.parse::<Fault>().unwrap().fits_training(2, 6);
        assert!(fits("layer-panic:1:6").is_ok());
        assert!(fits("nan-grad:1").is_ok());
        assert!(fits("kill-rank:1:3").is_ok());
        for (f, why) in [
            ("layer-panic:9:1", "layer 9 does not exist"),
            ("layer-panic:2:1", "layer 2 does not exist"),
            ("nan-grad:50", "step 50 never runs"),
            ("crash-in-checkpoint:0", "step 0 never runs"),
            ("session-panic:1:3", "never in training"),
        ] {
            let e = fits(f).unwrap_err();
            assert!(e.to_string().contains(why), "{f}: {e}");
            assert!(e.refuses_input(), "{f}");
        }
    }
}
