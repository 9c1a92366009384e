//! The prefix cache's snapshots of one stage: copies of sessions' states, kept under
//! [`SnapshotId`]s until dropped ([`StageCall::StateSave`] and the calls after it). A
//! snapshot is taken from a session and given to new ones as copies, so the session it came
//! from and every session started from it go on without touching it.
//!
//! Snapshots sit side by side in slabs, one tensor per state field, as a session table keeps
//! sessions: saving or restoring many sessions is one gather per field and slab, whatever
//! their number (one copy per field and session took ~85 µs each on an H200, 1.77 s for 256
//! restores of the 0.9B model). A save fills the free places of the slabs of its rows first
//! (one in-place write per field and run of places), and only then makes a slab of at least
//! [`PLACES`] places; a slab goes with its last snapshot, or when it is a [`SPARSE`]th full
//! or less and its snapshots fit in other slabs' free places, with them moved there
//! ([`Snapshots::evacuate`]). So the device holds a few large
//! buffers, not one small buffer per snapshot and field: CubeCL's pools look for room by
//! walking every slice they hold, and the ~30,000 small buffers of 371 snapshots of the 0.9B
//! (81 fields each) slowed every allocation of every pass (s69).

use crate::sessions::{SessionTable, Source, assemble, fresh};
use crate::{act, wrap};
use burn::tensor::{Tensor, backend::Backend};
use nsactor_plugin_api::{DeviceTensor, EngineError, Reply, SessionId, SnapshotId, StageCall};
use std::collections::{HashMap, HashSet};

/// Places of a slab made for fewer snapshots: at most this many, and at most
/// [`SLAB_BYTES`] of them (a model with large states gets slabs of fewer places).
pub(crate) const PLACES: usize = 64;
/// Bytes a slab made for fewer snapshots may hold, over its fields.
const SLAB_BYTES: usize = 16 << 20;
/// Runs of free places one save writes at most (one write per field and run); the rest go
/// to a new slab, so a save into scattered places costs no more than a few copies a field.
const MAX_RUNS: usize = 8;
/// A slab whose live snapshots fill at most one place in this many gives them up to other
/// slabs and its buffers back ([`Snapshots::evacuate`]).
const SPARSE: usize = 4;

/// Snapshots side by side.
struct Slab<B: Backend> {
    /// One tensor per state field, `[members.len() · rows, width]`.
    fields: Vec<Tensor<B, 2>>,
    /// Batch rows per snapshot.
    rows: usize,
    /// The snapshot at each position; `None` once dropped.
    members: Vec<Option<u64>>,
    live: usize,
}

/// One stage's snapshots.
pub(crate) struct Snapshots<B: Backend> {
    slabs: HashMap<u64, Slab<B>>,
    next_slab: u64,
    /// Each snapshot's slab and position in it.
    kept: HashMap<u64, (u64, usize)>,
    /// The state fields a session of this stage has, and their widths.
    widths: Vec<usize>,
}

impl<B: Backend> Snapshots<B> {
    /// The snapshots of a stage whose sessions have state fields of `widths` columns.
    pub(crate) fn new(widths: Vec<usize>) -> Self {
        Snapshots {
            slabs: HashMap::new(),
            next_slab: 0,
            kept: HashMap::new(),
            widths,
        }
    }

    pub(crate) fn clear(&mut self) {
        self.slabs.clear();
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
            StageCall::StateSave {
                sessions,
                snapshots,
            } => self.save(table, sessions, snapshots),
            StageCall::StateRestore {
                sessions,
                snapshots,
            } => self.restore(table, sessions, snapshots),
            StageCall::StateDrop { snapshot } => {
                self.remove(snapshot.0);
                Ok(Reply::none())
            }
            StageCall::StateRead { snapshot } => self.read(snapshot).map(|state| Reply {
                tensors: state
                    .into_iter()
                    .map(|t| wrap(fresh(t).unsqueeze_dim(0)))
                    .collect(),
                scalars: Vec::new(),
            }),
            StageCall::StateWrite { snapshot, states } => self.written(states).map(|state| {
                let rows = state[0].dims()[0];
                let bytes = self.insert(&[snapshot], rows, state, MAX_RUNS);
                Reply {
                    tensors: Vec::new(),
                    scalars: vec![bytes as f64],
                }
            }),
            other => return Err(other),
        })
    }

    /// Keeps copies of `sessions`' states under `snapshots`; all or none.
    fn save(
        &mut self,
        table: &SessionTable<B>,
        sessions: &[SessionId],
        snapshots: &[SnapshotId],
    ) -> Result<Reply, EngineError> {
        pairs("StateSave", sessions, snapshots)?;
        distinct("StateSave", SnapshotId::raw(snapshots), "snapshot")?;
        let (rows, state) = table.copies_of(SessionId::raw(sessions))?;
        let bytes = self.insert(snapshots, rows, state, MAX_RUNS);
        Ok(Reply {
            tensors: Vec::new(),
            scalars: vec![bytes as f64],
        })
    }

    /// Starts each of `sessions` from its snapshot; all or none.
    fn restore(
        &mut self,
        table: &mut SessionTable<B>,
        sessions: &[SessionId],
        snapshots: &[SnapshotId],
    ) -> Result<Reply, EngineError> {
        pairs("StateRestore", sessions, snapshots)?;
        let mut at = Vec::with_capacity(snapshots.len());
        for p in snapshots {
            at.push(
                *self
                    .kept
                    .get(&p.0)
                    .ok_or_else(|| EngineError::InvalidInput(format!("no {p} is kept")))?,
            );
        }
        let rows = self.slabs[&at[0].0].rows;
        if let Some(i) = at.iter().position(|(s, _)| self.slabs[s].rows != rows) {
            return Err(EngineError::InvalidInput(format!(
                "StateRestore: {} has batch {}, {} {rows}",
                snapshots[i], self.slabs[&at[i].0].rows, snapshots[0]
            )));
        }
        // One gather per slab, then one that puts the rows in the sessions' order.
        let mut slabs: Vec<u64> = Vec::new();
        let sources: Vec<Source> = at
            .iter()
            .map(|&(slab, pos)| {
                let group = slabs.iter().position(|&s| s == slab).unwrap_or_else(|| {
                    slabs.push(slab);
                    slabs.len() - 1
                });
                Source::Held { group, pos }
            })
            .collect();
        let state = assemble(&sources, rows, |src, positions| match src {
            Source::Held { group, .. } => {
                crate::sessions::gather(&self.slabs[&slabs[group]].fields, positions, rows)
            }
            Source::New => unreachable!("every snapshot is kept"),
        });
        table.start_many(SessionId::raw(sessions), rows, state)?;
        Ok(Reply::none())
    }

    /// `snapshot`'s rows of every field (views of its slab).
    fn read(&self, snapshot: SnapshotId) -> Result<Vec<Tensor<B, 2>>, EngineError> {
        let &(slab, pos) = self
            .kept
            .get(&snapshot.0)
            .ok_or_else(|| EngineError::InvalidInput(format!("no {snapshot} is kept")))?;
        let s = &self.slabs[&slab];
        Ok(s.fields
            .iter()
            .map(|t| t.clone().narrow(0, pos * s.rows, s.rows))
            .collect())
    }

    /// Keeps `state` (`[n · rows, width]` per field, new buffers) as `snapshots`, replacing
    /// any kept under those ids: the device bytes each one holds. Free places of the slabs of
    /// `rows` are filled first, in slab and place order, in at most `max_runs` runs; the rest
    /// go to a new slab.
    fn insert(
        &mut self,
        snapshots: &[SnapshotId],
        rows: usize,
        state: Vec<Tensor<B, 2>>,
        max_runs: usize,
    ) -> usize {
        for p in snapshots {
            self.remove(p.0);
        }
        let n = snapshots.len();
        let bytes: usize = state
            .iter()
            .map(|t| t.dims()[1] * rows * t.dtype().size())
            .sum();
        let fits = |s: &Slab<B>| {
            s.rows == rows
                && s.live < s.members.len()
                && s.fields
                    .iter()
                    .zip(&state)
                    .all(|(a, b)| a.dtype() == b.dtype())
        };
        let mut ids: Vec<u64> = self
            .slabs
            .iter()
            .filter(|(_, s)| fits(s))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        let mut places: Vec<(u64, usize)> = Vec::with_capacity(n);
        let mut runs = 0;
        'slabs: for id in ids {
            for (pos, m) in self.slabs[&id].members.iter().enumerate() {
                if places.len() == n {
                    break 'slabs;
                }
                if m.is_some() {
                    continue;
                }
                if places.last() != Some(&(id, pos.wrapping_sub(1))) {
                    if runs == max_runs {
                        break 'slabs;
                    }
                    runs += 1;
                }
                places.push((id, pos));
            }
        }
        let rest = n - places.len();
        if rest > 0 {
            let id = self.next_slab;
            self.next_slab += 1;
            let fit = SLAB_BYTES / bytes.max(1);
            let places_made = rest.max(fit.clamp(1, PLACES));
            let whole = places.is_empty() && rest == places_made;
            let fields = if whole {
                // A slab of exactly these snapshots: the state as it is, no copy.
                state.clone()
            } else {
                state
                    .iter()
                    .map(|t| {
                        let shape = [places_made * rows, t.dims()[1]];
                        Tensor::<B, 2>::zeros(shape, (&t.device(), t.dtype()))
                    })
                    .collect()
            };
            self.slabs.insert(
                id,
                Slab {
                    fields,
                    rows,
                    members: vec![None; places_made],
                    live: 0,
                },
            );
            if whole {
                let slab = self.slabs.get_mut(&id).expect("made");
                for (pos, p) in snapshots.iter().enumerate() {
                    slab.members[pos] = Some(p.0);
                    self.kept.insert(p.0, (id, pos));
                }
                slab.live = n;
                return bytes;
            }
            places.extend((0..rest).map(|pos| (id, pos)));
        }
        // Each run of consecutive places of one slab takes the next rows of `state`.
        let mut next = 0;
        for run in places.chunk_by(|a, b| a.0 == b.0 && b.1 == a.1 + 1) {
            let (id, first) = run[0];
            let len = run.len();
            let slab = self.slabs.get_mut(&id).expect("a slab with room");
            let to = first * rows..(first + len) * rows;
            let fields = std::mem::take(&mut slab.fields);
            slab.fields = fields
                .into_iter()
                .zip(&state)
                .map(|(t, s)| {
                    let w = t.dims()[1];
                    // In place where the slab's buffer is not shared (a read's view is not).
                    t.slice_assign(
                        [to.clone(), 0..w],
                        s.clone().narrow(0, next * rows, len * rows),
                    )
                })
                .collect();
            for (k, &(_, pos)) in run.iter().enumerate() {
                let p = snapshots[next + k].0;
                slab.members[pos] = Some(p);
                self.kept.insert(p, (id, pos));
            }
            slab.live += len;
            next += len;
        }
        bytes
    }

    /// Forgets `snapshot` (nothing happens for an unknown one): its place is free for the next
    /// save, and a slab goes with its last snapshot.
    fn remove(&mut self, snapshot: u64) {
        let Some((id, pos)) = self.kept.remove(&snapshot) else {
            return;
        };
        let slab = self.slabs.get_mut(&id).expect("a kept snapshot's slab");
        slab.members[pos] = None;
        slab.live -= 1;
        if slab.live == 0 {
            self.slabs.remove(&id);
        } else if slab.live * SPARSE <= slab.members.len() {
            self.evacuate(id);
        }
    }

    /// Moves the snapshots of slab `id` into free places of other slabs of its rows and
    /// storage types and lets its buffers go, where they all fit there (one gather per field
    /// of the few rows still live, then one write per field and run of places); else leaves
    /// it. Another sparse slab of the class then has room for them, or will take this one's.
    fn evacuate(&mut self, id: u64) {
        let slab = &self.slabs[&id];
        let room: usize = self
            .slabs
            .iter()
            .filter(|&(&other, s)| {
                other != id
                    && s.rows == slab.rows
                    && s.fields
                        .iter()
                        .zip(&slab.fields)
                        .all(|(a, b)| a.dtype() == b.dtype())
            })
            .map(|(_, s)| s.members.len() - s.live)
            .sum();
        if room < slab.live {
            return;
        }
        let slab = self.slabs.remove(&id).expect("a kept snapshot's slab");
        let (positions, snapshots): (Vec<usize>, Vec<SnapshotId>) = slab
            .members
            .iter()
            .enumerate()
            .filter_map(|(pos, m)| m.map(|p| (pos, SnapshotId(p))))
            .unzip();
        for p in &snapshots {
            self.kept.remove(&p.0);
        }
        let state = crate::sessions::gather(&slab.fields, &positions, slab.rows);
        self.insert(&snapshots, slab.rows, state, usize::MAX);
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

/// Checks that a call names as many snapshots as sessions, at least one.
fn pairs(call: &str, sessions: &[SessionId], snapshots: &[SnapshotId]) -> Result<(), EngineError> {
    if sessions.len() != snapshots.len() || sessions.is_empty() {
        return Err(EngineError::InvalidInput(format!(
            "{call}: {} sessions and {} snapshots (one snapshot per session, at least one)",
            sessions.len(),
            snapshots.len()
        )));
    }
    Ok(())
}

/// Checks that no id is named twice.
fn distinct(call: &str, ids: &[u64], what: &str) -> Result<(), EngineError> {
    let mut seen = HashSet::with_capacity(ids.len());
    match ids.iter().find(|s| !seen.insert(**s)) {
        Some(dup) => Err(EngineError::InvalidInput(format!(
            "{call}: {what} {dup} named twice"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
