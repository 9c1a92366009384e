//! The plugin side of a stage call: the flat `NsArgs` and input handles the host sent,
//! rebuilt into the [`StageCall`] the backend's stage takes.

use super::slice;
use crate::{ABI_VERSION, NsArgs};
use nsactor_plugin_api::{
    DeviceTensor, EngineError, GradStream, MicroBatchId, ParamMask, SessionId, SnapshotId,
    StageCall, Tokens,
};

/// Rebuilds the call from its flat form.
pub(crate) fn decode_call<'a>(
    op: u32,
    a: &'a NsArgs,
    mut inputs: Vec<DeviceTensor>,
    mask_out: &'a mut ParamMask,
) -> Result<StageCall<'a>, EngineError> {
    // SAFETY (all three): the host keeps these buffers alive for the call.
    let ids = unsafe { slice(a.ids, a.ids_len) };
    let targets = unsafe { slice(a.targets, a.targets_len) };
    let mask = unsafe { slice(a.mask, a.mask_len) };
    let sessions = SessionId::from_raw(unsafe { slice(a.sessions, a.sessions_len) });
    let tokens = Tokens {
        ids,
        batch: a.batch as usize,
        seq_len: a.seq_len as usize,
    };
    if op == 20 {
        *mask_out = ParamMask::from_words(ids)?;
    }
    let mask_out: &'a ParamMask = mask_out;
    let raw = SessionId::raw(sessions);
    if op == 26 {
        let [snapshot] = named::<1>(raw, "StateWrite")?;
        return Ok(StageCall::StateWrite {
            snapshot: SnapshotId(snapshot),
            states: inputs,
        });
    }
    let mut tensor = |name: &str| {
        if inputs.len() == 1 {
            Ok(inputs.pop().expect("one"))
        } else {
            Err(EngineError::InvalidInput(format!(
                "{name} takes one tensor, got {}",
                inputs.len()
            )))
        }
    };
    Ok(match op {
        1 => StageCall::Forward {
            micro: MicroBatchId(a.micro),
            h: tensor("Forward")?,
            keep_graph: a.f[0] != 0.0,
        },
        2 => StageCall::Backward {
            micro: MicroBatchId(a.micro),
            grad: tensor("Backward")?,
            ponder_grad: a.f[0],
        },
        3 => StageCall::Embed {
            micro: MicroBatchId(a.micro),
            tokens,
        },
        4 => StageCall::Head {
            micro: MicroBatchId(a.micro),
            h: tensor("Head")?,
            targets,
            mask,
            loss_scale: a.f[0],
        },
        5 => StageCall::HeadEval {
            h: tensor("HeadEval")?,
            targets,
            mask,
        },
        6 => StageCall::EmbedBackward {
            micro: MicroBatchId(a.micro),
            grad: tensor("EmbedBackward")?,
        },
        7 => StageCall::GradStats,
        8 => StageCall::ScaleGrads {
            scales: [a.f[0], a.f[1], a.f[2]],
        },
        9 => StageCall::Step {
            lr: a.f[0],
            neuron_lr: a.f[1],
            clip: a.f[2],
        },
        10 => StageCall::ZeroGrad,
        11 => StageCall::SessionEmbed { tokens },
        12 => StageCall::SessionForward {
            sessions,
            h: tensor("SessionForward")?,
        },
        13 => StageCall::SessionDecode {
            sessions,
            h: tensor("SessionDecode")?,
        },
        21 => StageCall::SessionDecodeAll {
            sessions,
            h: tensor("SessionDecodeAll")?,
        },
        17 => StageCall::SessionSample {
            sessions,
            h: tensor("SessionSample")?,
            picks: nsactor_plugin_api::Picks {
                floats: mask,
                ints: targets,
                rows: a.batch as usize,
            },
        },
        15 => StageCall::Probe {
            h: tensor("Probe")?,
        },
        27 => StageCall::Evaluate {
            h: tensor("Evaluate")?,
        },
        16 => StageCall::TokenLosses {
            h: tensor("TokenLosses")?,
            targets,
        },
        14 => {
            let [session] = named::<1>(raw, "SessionClose")?;
            StageCall::SessionClose {
                session: SessionId(session),
            }
        }
        22 | 23 => {
            if !raw.len().is_multiple_of(2) {
                return Err(EngineError::InvalidInput(format!(
                    "StateSave and StateRestore: sessions then as many snapshots expected, got \
                     {} ids",
                    raw.len()
                )));
            }
            let (s, p) = raw.split_at(raw.len() / 2);
            let (sessions, snapshots) = (SessionId::from_raw(s), SnapshotId::from_raw(p));
            if op == 22 {
                StageCall::StateSave {
                    sessions,
                    snapshots,
                }
            } else {
                StageCall::StateRestore {
                    sessions,
                    snapshots,
                }
            }
        }
        24 | 25 => {
            let [snapshot] = named::<1>(raw, "StateDrop and StateRead")?;
            let snapshot = SnapshotId(snapshot);
            if op == 24 {
                StageCall::StateDrop { snapshot }
            } else {
                StageCall::StateRead { snapshot }
            }
        }
        18 => StageCall::HoldGrads {
            hold: a.f[0] != 0.0,
        },
        19 => StageCall::GradsOut {
            keep: a.f[0] != 0.0,
        },
        20 => StageCall::GradsIn {
            stream: GradStream(a.f[0] as u32),
            micro: MicroBatchId(a.micro),
            mask: mask_out,
            grad: tensor("GradsIn")?,
        },
        other => {
            return Err(EngineError::InvalidInput(format!(
                "unknown stage opcode {other} (this plugin speaks ABI {ABI_VERSION})"
            )));
        }
    })
}

/// The `N` ids a call names (sessions, then snapshots).
fn named<const N: usize>(ids: &[u64], call: &str) -> Result<[u64; N], EngineError> {
    ids.try_into().map_err(|_| {
        EngineError::InvalidInput(format!("{call}: {N} ids expected, got {}", ids.len()))
    })
}

#[cfg(test)]
mod tests {
    use crate::host::call::encode;
    use nsactor_plugin_api::{ParamMask, SessionId, SnapshotId, StageCall};

    /// Each snapshot call comes out of the C form as it went in, many sessions and all.
    #[test]
    fn snapshot_calls_cross_the_c_form_whole() {
        let sessions = [SessionId(7), SessionId(9), SessionId(11)];
        let snapshots = [SnapshotId(70), SnapshotId(90), SnapshotId(110)];
        let calls = [
            StageCall::StateSave {
                sessions: &sessions,
                snapshots: &snapshots,
            },
            StageCall::StateRestore {
                sessions: &sessions[..1],
                snapshots: &snapshots[..1],
            },
            StageCall::StateDrop {
                snapshot: SnapshotId(5),
            },
            StageCall::SessionClose {
                session: SessionId(3),
            },
        ];
        for call in calls {
            let (op, want) = (call.opcode(), format!("{call:?}"));
            let (mut named, mut mask) = (Vec::new(), Vec::new());
            let (args, inputs) = encode(call, &mut named, &mut mask);
            let mut mask_out = ParamMask::default();
            let back = super::decode_call(op, &args, inputs, &mut mask_out).unwrap();
            assert_eq!(format!("{back:?}"), want);
        }
    }
}
