//! The prefix cache's snapshots of one stage: copies of a session's states, kept under a
//! [`SnapshotId`] until dropped ([`StageCall::StateSave`] and the calls after it). A
//! snapshot is taken from a session and given to new ones as copies, so the session it came
//! from and every session started from it go on without touching it.

use crate::sessions::{SessionTable, fresh};
use crate::{act, wrap};
use burn::tensor::{Tensor, backend::Backend};
use nsactor_plugin_api::{DeviceTensor, EngineError, Reply, StageCall};
use std::collections::HashMap;

/// One stage's snapshots.
pub(crate) struct Snapshots<B: Backend> {
    kept: HashMap<u64, Vec<Tensor<B, 2>>>,
    /// The state fields a session of this stage has, and their widths.
    widths: Vec<usize>,
}

impl<B: Backend> Snapshots<B> {
    /// The snapshots of a stage whose sessions have state fields of `widths` columns.
    pub(crate) fn new(widths: Vec<usize>) -> Self {
        Snapshots {
            kept: HashMap::new(),
            widths,
        }
    }

    pub(crate) fn clear(&mut self) {
        self.kept.clear();
    }

    /// Runs `call` if it is a snapshot call, on the sessions of `table`; hands it back
    /// otherwise.
    pub(crate) fn call<'a>(
        &mut self,
        table: &mut SessionTable<B>,
        call: StageCall<'a>,
    ) -> Result<Result<Reply, EngineError>, StageCall<'a>> {
        Ok(match call {
            StageCall::StateSave { session, snapshot } => table.copy_of(session.0).map(|state| {
                let bytes = held(&state);
                self.kept.insert(snapshot.0, state);
                bytes_reply(bytes)
            }),
            StageCall::StateRestore { session, snapshot } => match self.kept.get(&snapshot.0) {
                Some(state) => table.start_from(session.0, state).map(|()| Reply::none()),
                None => Err(EngineError::InvalidInput(format!("no {snapshot} is kept"))),
            },
            StageCall::StateDrop { snapshot } => {
                self.kept.remove(&snapshot.0);
                Ok(Reply::none())
            }
            StageCall::StateRead { snapshot } => match self.kept.get(&snapshot.0) {
                Some(state) => Ok(Reply {
                    tensors: state
                        .iter()
                        .map(|t| wrap(fresh(t.clone()).unsqueeze_dim(0)))
                        .collect(),
                    scalars: Vec::new(),
                }),
                None => Err(EngineError::InvalidInput(format!("no {snapshot} is kept"))),
            },
            StageCall::StateWrite { snapshot, states } => self.written(states).map(|state| {
                let bytes = held(&state);
                self.kept.insert(snapshot.0, state);
                bytes_reply(bytes)
            }),
            other => return Err(other),
        })
    }

    /// `states` as `StateRead` gave them, checked against this stage's fields.
    fn written(&self, states: Vec<DeviceTensor>) -> Result<Vec<Tensor<B, 2>>, EngineError> {
        if states.len() != self.widths.len() {
            return Err(EngineError::InvalidInput(format!(
                "StateWrite: {} state fields, this stage has {}",
                states.len(),
                self.widths.len()
            )));
        }
        let mut rows = None;
        let mut out = Vec::with_capacity(states.len());
        for (t, &width) in states.into_iter().zip(&self.widths) {
            let t = act::<B>(t, "StateWrite")?;
            let [one, r, w] = t.dims();
            if one != 1 || w != width || r == 0 || rows.is_some_and(|n| n != r) {
                return Err(EngineError::InvalidInput(format!(
                    "StateWrite: a state field of shape [{one}, {r}, {w}], this stage's fields \
                     are [1, rows, w] with w in {:?}",
                    self.widths
                )));
            }
            rows = Some(r);
            out.push(t.squeeze_dim(0));
        }
        Ok(out)
    }
}

/// `StateSave`'s and `StateWrite`'s reply.
fn bytes_reply(bytes: usize) -> Reply {
    Reply {
        tensors: Vec::new(),
        scalars: vec![bytes as f64],
    }
}

/// Bytes a copy of states holds.
fn held<B: Backend>(state: &[Tensor<B, 2>]) -> usize {
    state
        .iter()
        .map(|t| t.shape().num_elements() * t.dtype().size())
        .sum()
}
