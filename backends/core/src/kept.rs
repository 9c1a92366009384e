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
//! [`PLACES`] places; a slab goes with its last snapshot. So the device holds a few large
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
                let bytes = self.insert(&[snapshot], rows, state);
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
        let bytes = self.insert(snapshots, rows, state);
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
    /// `rows` are filled first, in slab and place order; the rest go to a new slab.
    fn insert(&mut self, snapshots: &[SnapshotId], rows: usize, state: Vec<Tensor<B, 2>>) -> usize {
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
                    if runs == MAX_RUNS {
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
        }
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
mod tests {
    use super::*;
    use crate::sessions::tests::{ids_in, rows_of};
    use burn_ndarray::NdArray;

    type B = NdArray<f32>;

    fn sessions(ids: &[u64]) -> Vec<SessionId> {
        ids.iter().map(|&i| SessionId(i)).collect()
    }

    fn snaps(ids: &[u64]) -> Vec<SnapshotId> {
        ids.iter().map(|&i| SnapshotId(i)).collect()
    }

    fn run(
        k: &mut Snapshots<B>,
        t: &mut SessionTable<B>,
        call: StageCall<'_>,
    ) -> Result<Reply, EngineError> {
        k.call(t, call)
            .unwrap_or_else(|_| panic!("a snapshot call"))
    }

    fn save(
        k: &mut Snapshots<B>,
        t: &mut SessionTable<B>,
        s: &[u64],
        p: &[u64],
    ) -> Result<Reply, EngineError> {
        let (s, p) = (sessions(s), snaps(p));
        run(
            k,
            t,
            StageCall::StateSave {
                sessions: &s,
                snapshots: &p,
            },
        )
    }

    fn restore(
        k: &mut Snapshots<B>,
        t: &mut SessionTable<B>,
        s: &[u64],
        p: &[u64],
    ) -> Result<Reply, EngineError> {
        let (s, p) = (sessions(s), snaps(p));
        run(
            k,
            t,
            StageCall::StateRestore {
                sessions: &s,
                snapshots: &p,
            },
        )
    }

    fn drop_snapshot(k: &mut Snapshots<B>, t: &mut SessionTable<B>, p: u64) {
        run(
            k,
            t,
            StageCall::StateDrop {
                snapshot: SnapshotId(p),
            },
        )
        .unwrap();
    }

    /// The id snapshot `p` carries, read as `StateRead` gives it.
    fn read(k: &mut Snapshots<B>, t: &mut SessionTable<B>, p: u64) -> Result<u64, EngineError> {
        let r = run(
            k,
            t,
            StageCall::StateRead {
                snapshot: SnapshotId(p),
            },
        )?;
        let x = act::<B>(r.tensors.into_iter().next().unwrap(), "test")?;
        assert_eq!(x.dims(), [1, 2, 2]);
        Ok(ids_in(&[x.squeeze_dim(0)], 2)[0])
    }

    #[test]
    fn many_sessions_saved_and_restored_at_once_keep_each_ones_rows() {
        let (mut k, mut t) = (Snapshots::<B>::new(vec![2]), SessionTable::<B>::default());
        t.put(&[1, 2, 3, 4], 2, rows_of(&[1, 2, 3, 4], 2));
        let r = save(&mut k, &mut t, &[4, 1, 3], &[10, 11, 12]).unwrap();
        assert_eq!(r.scalars, [16.0], "2 rows of 2 f32 each");
        // One snapshot serves several sessions; they form one group, in the call's order.
        restore(&mut k, &mut t, &[20, 21, 22, 23], &[11, 12, 11, 10]).unwrap();
        let s = t.take(&[20, 21, 22, 23], 2, |_| unreachable!()).unwrap();
        assert_eq!(ids_in(&s, 2), [1, 3, 1, 4]);
        // The restored states are copies: changing them leaves the snapshots as they were.
        t.put(&[20, 21, 22, 23], 2, vec![s[0].clone().mul_scalar(0.0)]);
        assert_eq!(read(&mut k, &mut t, 11).unwrap(), 1);
        // Two of the slab's three dropped: their places are free, what is left is intact.
        for p in [11, 10, 99] {
            drop_snapshot(&mut k, &mut t, p);
        }
        assert_eq!(k.slabs.len(), 1);
        let slab = k.slabs.values().next().unwrap();
        assert_eq!((slab.live, slab.members.len()), (1, PLACES));
        assert_eq!(slab.members[..3], [None, None, Some(12)]);
        assert!(read(&mut k, &mut t, 11).is_err());
        restore(&mut k, &mut t, &[30], &[12]).unwrap();
        assert_eq!(
            ids_in(&t.take(&[30], 2, |_| unreachable!()).unwrap(), 2),
            [3]
        );
        // Saving under a kept id replaces it; the last drop takes the slab.
        save(&mut k, &mut t, &[2], &[12]).unwrap();
        assert_eq!(read(&mut k, &mut t, 12).unwrap(), 2);
        drop_snapshot(&mut k, &mut t, 12);
        assert!(k.slabs.is_empty() && k.kept.is_empty());
    }

    /// Snapshots saved one at a time share slabs: each save fills a free place (the lowest),
    /// a save of more than the free places fills them and makes a slab for the rest, and each
    /// snapshot still restores its own rows.
    #[test]
    fn saves_fill_free_places_before_making_slabs() {
        let (mut k, mut t) = (Snapshots::<B>::new(vec![2]), SessionTable::<B>::default());
        let ids: Vec<u64> = (1..=100).collect();
        t.put(&ids, 2, rows_of(&ids, 2));
        for s in 1..=10 {
            save(&mut k, &mut t, &[s], &[1000 + s]).unwrap();
        }
        assert_eq!(k.slabs.len(), 1, "ten saves, one slab");
        for p in [1003, 1004, 1007] {
            drop_snapshot(&mut k, &mut t, p);
        }
        // 3 free places among the first 10, 54 after: 60 snapshots fill 57, 3 go to a new slab.
        let many: Vec<u64> = (11..=70).collect();
        let snaps_many: Vec<u64> = many.iter().map(|s| 1000 + s).collect();
        save(&mut k, &mut t, &many, &snaps_many).unwrap();
        assert_eq!(k.slabs.len(), 2);
        assert_eq!(k.kept[&1011].1, 2, "the lowest free place first");
        for (s, p) in many
            .iter()
            .zip(&snaps_many)
            .chain([(&1, &1001), (&10, &1010)])
        {
            assert_eq!(read(&mut k, &mut t, *p).unwrap(), *s, "snapshot {p}");
        }
        let back: Vec<u64> = (200..260).collect();
        restore(&mut k, &mut t, &back, &snaps_many).unwrap();
        assert_eq!(
            ids_in(&t.take(&back, 2, |_| unreachable!()).unwrap(), 2),
            many
        );
    }

    /// Free places scattered one by one: a save writes at most `MAX_RUNS` runs of them and
    /// puts the rest in a new slab, each snapshot still its own rows.
    #[test]
    fn a_save_into_scattered_places_writes_a_few_runs() {
        let (mut k, mut t) = (Snapshots::<B>::new(vec![2]), SessionTable::<B>::default());
        let ids: Vec<u64> = (1..=100).collect();
        t.put(&ids, 2, rows_of(&ids, 2));
        for s in 1..=PLACES as u64 {
            save(&mut k, &mut t, &[s], &[1000 + s]).unwrap();
        }
        assert_eq!(k.slabs.len(), 1);
        for p in (1..=PLACES as u64).step_by(2) {
            drop_snapshot(&mut k, &mut t, 1000 + p);
        }
        let many: Vec<u64> = (71..=90).collect();
        let snaps_many: Vec<u64> = many.iter().map(|s| 1000 + s).collect();
        save(&mut k, &mut t, &many, &snaps_many).unwrap();
        assert_eq!(
            k.slabs.len(),
            2,
            "eight scattered places, a new slab for the other 12"
        );
        let first = *k.slabs.keys().min().unwrap();
        let in_first = snaps_many.iter().filter(|p| k.kept[p].0 == first).count();
        assert_eq!(in_first, MAX_RUNS);
        for (s, p) in many
            .iter()
            .zip(&snaps_many)
            .chain([(&2, &1002), (&64, &1064)])
        {
            assert_eq!(read(&mut k, &mut t, *p).unwrap(), *s, "snapshot {p}");
        }
    }

    #[test]
    fn a_call_that_cannot_do_one_does_none() {
        let (mut k, mut t) = (Snapshots::<B>::new(vec![2]), SessionTable::<B>::default());
        t.put(&[1, 2], 2, rows_of(&[1, 2], 2));
        let e = save(&mut k, &mut t, &[1, 7], &[10, 11])
            .unwrap_err()
            .to_string();
        assert!(e.contains("session 7 holds no states"), "{e}");
        assert!(k.kept.is_empty() && k.slabs.is_empty());
        let e = save(&mut k, &mut t, &[1, 2], &[10, 10])
            .unwrap_err()
            .to_string();
        assert!(e.contains("named twice"), "{e}");
        let e = save(&mut k, &mut t, &[1, 2], &[10])
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 sessions and 1 snapshots"), "{e}");
        save(&mut k, &mut t, &[1], &[10]).unwrap();
        // A session that holds states, a snapshot not kept, a session named twice: nothing
        // starts.
        for (s, p, why) in [
            (&[5, 2][..], &[10, 10][..], "session 2 already holds states"),
            (&[5, 6], &[10, 77], "no snapshot 77 is kept"),
            (&[5, 5], &[10, 10], "session 5 appears twice"),
        ] {
            let e = restore(&mut k, &mut t, s, p).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
            assert_eq!(t.len(), 2);
        }
    }
}
