//! Decoding sessions' neuron states, kept the way they were last computed: as groups of
//! sessions whose states sit side by side in one batch tensor per state field.
//!
//! A decoding server runs the same set of sessions through a layer token after token. When a
//! call names exactly the sessions of a stored group, in the same order, the group's tensors
//! are the call's state as they are — no copy. Only when the set changes (a session joins,
//! leaves or is batched with others for the first time) are rows gathered from their groups
//! with one `narrow` per contiguous run and one `cat` per field.
//!
//! Closing a session only marks its rows: they go when its group is next regathered, when
//! more than half of the group is closed, or with the group once all of it is. Removing each
//! closed session's rows at once copied the rest of its group every time: 256 sessions ending
//! together took about 0.3 s of the stage workers' time (BENCHMARKS.md).

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use nsactor_plugin_api::EngineError;
use std::collections::HashSet;

struct Group<B: Backend> {
    ids: Vec<u64>,
    /// Batch rows per session.
    rows: usize,
    /// One tensor per state field, `[ids.len() · rows, width]`.
    state: Vec<Tensor<B, 2>>,
}

/// Where a session's rows are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Position `pos` of group `group`.
    Held {
        group: usize,
        pos: usize,
    },
    New,
}

/// The states of every open session of one stage.
pub struct SessionTable<B: Backend> {
    groups: Vec<Group<B>>,
    /// Sessions closed whose rows are still in their group.
    closed: HashSet<u64>,
}

impl<B: Backend> Default for SessionTable<B> {
    fn default() -> Self {
        SessionTable {
            groups: Vec::new(),
            closed: HashSet::new(),
        }
    }
}

/// A copy of `t` in a new buffer, equal bit for bit (`x · 1` is `x` for every float).
pub(crate) fn fresh<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    t.mul_scalar(1.0)
}

/// The rows of positions `positions` (`rows` batch rows each) of every tensor of `state`, in
/// that order: views where the positions are consecutive, else one gather per field.
fn rows_at<B: Backend>(
    state: &[Tensor<B, 2>],
    positions: &[usize],
    rows: usize,
) -> Vec<Tensor<B, 2>> {
    let first = positions[0];
    if positions.iter().enumerate().all(|(i, &p)| p == first + i) {
        state
            .iter()
            .map(|t| t.clone().narrow(0, first * rows, positions.len() * rows))
            .collect()
    } else {
        gather(state, positions, rows)
    }
}

/// The rows of positions `positions` (`rows` batch rows each) of every tensor of `state`, in
/// that order, as new tensors: one gather per field.
pub(crate) fn gather<B: Backend>(
    state: &[Tensor<B, 2>],
    positions: &[usize],
    rows: usize,
) -> Vec<Tensor<B, 2>> {
    let Some(device) = state.first().map(|t| t.device()) else {
        return Vec::new();
    };
    let idx: Vec<i64> = positions
        .iter()
        .flat_map(|&p| (p * rows..(p + 1) * rows).map(|r| r as i64))
        .collect();
    let n = idx.len();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [n]), &device);
    state
        .iter()
        .map(|t| t.clone().select(0, idx.clone()))
        .collect()
}

fn cat<B: Backend>(mut pieces: Vec<Tensor<B, 2>>) -> Tensor<B, 2> {
    if pieces.len() == 1 {
        pieces.pop().expect("one")
    } else {
        Tensor::cat(pieces, 0)
    }
}

/// The states of the sessions whose rows come from `sources` (one per session, in the call's
/// order), stacked in that order: `part(source, positions)` gives the rows of one source's
/// sessions (their positions in it, in call order), one piece per source in the order the
/// sources first appear, and where the pieces' order is not the call's, one gather per field
/// puts the rows in place.
pub(crate) fn assemble<B: Backend>(
    sources: &[Source],
    rows: usize,
    mut part: impl FnMut(Source, &[usize]) -> Vec<Tensor<B, 2>>,
) -> Vec<Tensor<B, 2>> {
    let key = |s: &Source| match *s {
        Source::Held { group, .. } => Some(group),
        Source::New => None,
    };
    // Sources in order of first appearance, each with its sessions' call indices.
    let mut order: Vec<(Source, Vec<usize>)> = Vec::new();
    for (i, src) in sources.iter().enumerate() {
        match order.iter_mut().find(|(s, _)| key(s) == key(src)) {
            Some((_, members)) => members.push(i),
            None => order.push((*src, vec![i])),
        }
    }
    let mut pieces: Vec<Vec<Tensor<B, 2>>> = Vec::new();
    // Where each call index sits in the pieces stacked in order.
    let mut slot = vec![0usize; sources.len()];
    let mut next = 0;
    for (src, members) in &order {
        let positions: Vec<usize> = members
            .iter()
            .map(|&i| match sources[i] {
                Source::Held { pos, .. } => pos,
                Source::New => i,
            })
            .collect();
        let fields = part(*src, &positions);
        if pieces.is_empty() {
            pieces.resize(fields.len(), Vec::new());
        }
        for (f, t) in fields.into_iter().enumerate() {
            pieces[f].push(t);
        }
        for &i in members {
            slot[i] = next;
            next += 1;
        }
    }
    let stacked: Vec<Tensor<B, 2>> = pieces.into_iter().map(cat).collect();
    if slot.iter().enumerate().all(|(i, &s)| s == i) {
        stacked
    } else {
        gather(&stacked, &slot, rows)
    }
}

impl<B: Backend> SessionTable<B> {
    /// Open sessions.
    pub fn len(&self) -> usize {
        self.groups.iter().map(|g| g.ids.len()).sum::<usize>() - self.closed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        self.groups.clear();
        self.closed.clear();
    }

    /// The group and position of an open `session`.
    fn find(&self, session: u64) -> Option<(usize, usize)> {
        if self.closed.contains(&session) {
            return None;
        }
        self.find_rows(session)
    }

    /// The group and position of `session`'s rows, open or closed.
    fn find_rows(&self, session: u64) -> Option<(usize, usize)> {
        self.groups.iter().enumerate().find_map(|(g, grp)| {
            grp.ids
                .iter()
                .position(|&id| id == session)
                .map(|pos| (g, pos))
        })
    }

    /// Takes the states of `sessions`, `rows` batch rows each, stacked in that order; sessions
    /// not held start from `zeros(k)` (`k` rows). Nothing changes when it fails.
    pub fn take(
        &mut self,
        sessions: &[u64],
        rows: usize,
        zeros: impl Fn(usize) -> Vec<Tensor<B, 2>>,
    ) -> Result<Vec<Tensor<B, 2>>, EngineError> {
        let mut seen = HashSet::with_capacity(sessions.len());
        if let Some(dup) = sessions.iter().find(|s| !seen.insert(**s)) {
            return Err(EngineError::InvalidInput(format!(
                "session {dup} appears twice in one call"
            )));
        }
        // An id closed and named again (pad sessions reuse theirs) starts afresh.
        let reopened: Vec<u64> = sessions
            .iter()
            .copied()
            .filter(|s| self.closed.contains(s))
            .collect();
        for s in reopened {
            self.remove_now(s);
        }
        if let Some(g) = self
            .groups
            .iter()
            .position(|g| g.ids == sessions && g.rows == rows)
        {
            return Ok(self.groups.swap_remove(g).state);
        }
        let sources: Vec<Source> = sessions
            .iter()
            .map(|&s| match self.find(s) {
                Some((group, pos)) => Source::Held { group, pos },
                None => Source::New,
            })
            .collect();
        for (s, src) in sessions.iter().zip(&sources) {
            if let Source::Held { group, .. } = *src
                && self.groups[group].rows != rows
            {
                return Err(EngineError::InvalidInput(format!(
                    "session {s} has batch {}, the call {rows}",
                    self.groups[group].rows
                )));
            }
        }
        // One piece per source (a group, or the new sessions), then one reordering gather
        // where the cohort interleaves them. Prompts batched by length leave a decoding
        // cohort's sessions spread over many groups in id order; a piece per stretch of one
        // group cost ~150 stretches × 81 fields of small copies and index uploads, ~150 ms
        // for the first 256-session step after such a wave on an H100 (s69). A cohort that
        // takes 20 sessions spread through one group of 256 still costs one gather per field.
        // (Never a zero-row tensor: some devices cannot launch an empty fill.)
        let state = assemble(&sources, rows, |src, positions| match src {
            Source::New => zeros(positions.len() * rows),
            Source::Held { group, .. } => rows_at(&self.groups[group].state, positions, rows),
        });
        let mut taken: Vec<Vec<usize>> = vec![Vec::new(); self.groups.len()];
        for src in &sources {
            if let Source::Held { group, pos } = *src {
                taken[group].push(pos);
            }
        }
        self.remove_positions(taken);
        Ok(state)
    }

    /// Copies of the rows of open `sessions` (each of the same batch rows), stacked in that
    /// order: the batch rows per session and one `[n · rows, width]` tensor per state field.
    /// The copies are new buffers (a captured decoding step writes its states back into the
    /// buffers the table holds: `super::graphs`), made with one gather per field for each
    /// run of sessions that sit in one group, so many sessions cost as few copies as one.
    pub fn copies_of(&self, sessions: &[u64]) -> Result<(usize, Vec<Tensor<B, 2>>), EngineError> {
        let mut at = Vec::with_capacity(sessions.len());
        for &s in sessions {
            let (group, pos) = self
                .find(s)
                .ok_or_else(|| EngineError::InvalidInput(format!("session {s} holds no states")))?;
            at.push((group, pos));
        }
        let Some(&(first, _)) = at.first() else {
            return Err(EngineError::InvalidInput("no sessions named".into()));
        };
        let rows = self.groups[first].rows;
        if let Some(i) = at.iter().position(|&(g, _)| self.groups[g].rows != rows) {
            return Err(EngineError::InvalidInput(format!(
                "session {} has batch {}, session {} {rows}",
                sessions[i], self.groups[at[i].0].rows, sessions[0]
            )));
        }
        let sources: Vec<Source> = at
            .iter()
            .map(|&(group, pos)| Source::Held { group, pos })
            .collect();
        // New buffers in every case: a gather even where the rows are consecutive.
        let state = assemble(&sources, rows, |src, positions| match src {
            Source::Held { group, .. } => gather(&self.groups[group].state, positions, rows),
            Source::New => unreachable!("copies are of held sessions"),
        });
        Ok((rows, state))
    }

    /// `sessions`, none of which holds states, start from `state` (`[n · rows, width]` per
    /// state field, theirs in order; kept as given, so new buffers the caller gives up).
    pub fn start_many(
        &mut self,
        sessions: &[u64],
        rows: usize,
        state: Vec<Tensor<B, 2>>,
    ) -> Result<(), EngineError> {
        if let Some(s) = sessions.iter().find(|&&s| self.find(s).is_some()) {
            return Err(EngineError::InvalidInput(format!(
                "session {s} already holds states"
            )));
        }
        let mut seen = HashSet::with_capacity(sessions.len());
        if let Some(dup) = sessions.iter().find(|s| !seen.insert(**s)) {
            return Err(EngineError::InvalidInput(format!(
                "session {dup} appears twice in one call"
            )));
        }
        if rows == 0 || state.iter().any(|t| t.dims()[0] != sessions.len() * rows) {
            return Err(EngineError::InvalidInput(format!(
                "{} sessions of {rows} rows: states of {:?} rows",
                sessions.len(),
                state.iter().map(|t| t.dims()[0]).collect::<Vec<_>>()
            )));
        }
        self.put(sessions, rows, state);
        Ok(())
    }

    /// Stores the states of `sessions` (as returned by a call that took them).
    pub fn put(&mut self, sessions: &[u64], rows: usize, state: Vec<Tensor<B, 2>>) {
        for &s in sessions {
            self.remove_now(s);
        }
        self.groups.push(Group {
            ids: sessions.to_vec(),
            rows,
            state,
        });
    }

    /// Forgets `session` (nothing happens for an unknown one): its rows are marked, and go
    /// with the next regathering of its group, once more than half of the group is closed, or
    /// with the whole group.
    pub fn close(&mut self, session: u64) {
        let Some((group, _)) = self.find(session) else {
            return;
        };
        self.closed.insert(session);
        let grp = &self.groups[group];
        let closed = grp.ids.iter().filter(|s| self.closed.contains(s)).count();
        if 2 * closed > grp.ids.len() {
            let mut taken = vec![Vec::new(); self.groups.len()];
            taken[group].push(grp.ids.iter().position(|&s| s == session).expect("found"));
            self.remove_positions(taken);
        }
    }

    /// Removes `session`'s rows now, open or closed.
    fn remove_now(&mut self, session: u64) {
        if let Some((group, pos)) = self.find_rows(session) {
            let mut taken = vec![Vec::new(); self.groups.len()];
            taken[group].push(pos);
            self.remove_positions(taken);
        }
        self.closed.remove(&session);
    }

    /// Drops positions `taken[g]` from each group `g`, and with them the rows of its closed
    /// sessions, keeping the rest in order.
    fn remove_positions(&mut self, mut taken: Vec<Vec<usize>>) {
        let groups = std::mem::take(&mut self.groups);
        for (g, grp) in groups.into_iter().enumerate() {
            let gone = &mut taken[g];
            if gone.is_empty() {
                self.groups.push(grp);
                continue;
            }
            gone.sort_unstable();
            let closed = &mut self.closed;
            let keep: Vec<usize> = (0..grp.ids.len())
                .filter(|&p| gone.binary_search(&p).is_err() && !closed.remove(&grp.ids[p]))
                .collect();
            for &p in gone.iter() {
                closed.remove(&grp.ids[p]);
            }
            if keep.is_empty() {
                continue;
            }
            let state = rows_at(&grp.state, &keep, grp.rows);
            self.groups.push(Group {
                ids: keep.iter().map(|&p| grp.ids[p]).collect(),
                rows: grp.rows,
                state,
            });
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use burn::tensor::TensorData;
    use burn_ndarray::NdArray;

    type B = NdArray<f32>;

    /// A state whose rows carry their session id, so every move can be checked.
    pub(crate) fn rows_of(ids: &[u64], rows: usize) -> Vec<Tensor<B, 2>> {
        let v: Vec<f32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n([id as f32, -(id as f32)], rows))
            .flatten()
            .collect();
        vec![Tensor::from_data(
            TensorData::new(v, [ids.len() * rows, 2]),
            &Default::default(),
        )]
    }

    fn zeros(k: usize) -> Vec<Tensor<B, 2>> {
        vec![Tensor::zeros([k, 2], &Default::default())]
    }

    pub(crate) fn ids_in(state: &[Tensor<B, 2>], rows: usize) -> Vec<u64> {
        let v = state[0].to_data().to_vec::<f32>().unwrap();
        v.chunks(2 * rows).map(|c| c[0] as u64).collect()
    }

    #[test]
    fn regrouping_moves_each_session_with_its_rows() {
        let mut t = SessionTable::<B>::default();
        t.put(&[1, 2, 3, 4], 2, rows_of(&[1, 2, 3, 4], 2));
        t.put(&[7], 2, rows_of(&[7], 2));
        assert_eq!(t.len(), 5);
        // Same set, same order: the stored tensor itself.
        let s = t.take(&[7], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [7]);
        t.put(&[7], 2, s);
        // 3 leaves, 7 and a new session 9 join, 1 moves to the back.
        let s = t.take(&[2, 7, 9, 4, 1], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [2, 7, 0, 4, 1]);
        assert_eq!(t.len(), 1, "session 3 stays behind");
        let rest = t.take(&[3], 2, zeros).unwrap();
        assert_eq!(ids_in(&rest, 2), [3]);
        t.put(&[2, 7, 9, 4, 1], 2, s);
        t.close(7);
        t.close(12345);
        let s = t.take(&[2, 9, 4, 1], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [2, 0, 4, 1]);
        assert!(t.is_empty());
    }

    #[test]
    fn closing_marks_rows_and_drops_them_at_half_a_group_or_the_next_gather() {
        let mut t = SessionTable::<B>::default();
        let ids: Vec<u64> = (1..=6).collect();
        t.put(&ids, 2, rows_of(&ids, 2));
        t.close(2);
        t.close(5);
        assert_eq!(t.len(), 4);
        // Two of six closed: the rows are still there, the open ones are found as before.
        assert_eq!(t.groups[0].ids.len(), 6);
        assert!(t.find(2).is_none() && t.find(3).is_some());
        // The next gather of the open sessions leaves the closed rows behind for good.
        let s = t.take(&[1, 3, 4, 6], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [1, 3, 4, 6]);
        assert!(t.is_empty() && t.groups.is_empty() && t.closed.is_empty());
        t.put(&[1, 3, 4, 6], 2, s);
        // More than half closed: the group is rebuilt from its open sessions.
        t.close(1);
        t.close(4);
        assert_eq!(t.groups[0].ids.len(), 4);
        t.close(6);
        assert_eq!(t.groups[0].ids, [3]);
        assert!(t.closed.is_empty());
        assert_eq!(ids_in(&t.take(&[3], 2, zeros).unwrap(), 2), [3]);
        // All of a group closed: the group goes.
        t.put(&[8, 9], 1, rows_of(&[8, 9], 1));
        t.close(8);
        t.close(9);
        assert!(t.groups.is_empty() && t.closed.is_empty());
        // An id closed and named again starts from zeros.
        t.put(&[10, 11, 12], 1, rows_of(&[10, 11, 12], 1));
        t.close(10);
        let s = t.take(&[10, 11, 12], 1, zeros).unwrap();
        assert_eq!(ids_in(&s, 1), [0, 11, 12]);
    }

    /// Prompts batched by length leave a decoding cohort's sessions interleaved over many
    /// groups in id order: each group is read once (one piece per source), and the rows still
    /// come out in the call's order, new sessions included, for `take` and `copies_of` alike.
    #[test]
    fn interleaved_groups_are_read_once_each_and_stacked_in_call_order() {
        let mut t = SessionTable::<B>::default();
        let groups: [Vec<u64>; 3] = [vec![1, 4, 7, 10], vec![2, 5, 8], vec![3, 6, 9]];
        for g in &groups {
            t.put(g, 2, rows_of(g, 2));
        }
        let call: Vec<u64> = (1..=11).collect();
        let copies = t.copies_of(&call[..10]).unwrap();
        assert_eq!(copies.0, 2);
        assert_eq!(ids_in(&copies.1, 2), (1..=10).collect::<Vec<u64>>());
        let sources: Vec<Source> = call
            .iter()
            .map(|&s| match t.find(s) {
                Some((group, pos)) => Source::Held { group, pos },
                None => Source::New,
            })
            .collect();
        let mut parts = Vec::new();
        let stacked = assemble::<B>(&sources, 2, |src, positions| {
            parts.push(positions.to_vec());
            match src {
                Source::New => zeros(positions.len() * 2),
                Source::Held { group, .. } => rows_at(&t.groups[group].state, positions, 2),
            }
        });
        assert_eq!(
            parts,
            [vec![0, 1, 2, 3], vec![0, 1, 2], vec![0, 1, 2], vec![10]]
        );
        assert_eq!(ids_in(&stacked, 2), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]);
        let s = t.take(&call, 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]);
        assert!(t.is_empty() && t.groups.is_empty());
        // One source in the call's order: no reordering gather, the group's rows as they are.
        t.put(&call, 2, s);
        let s = t.take(&[3, 4, 5], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [3, 4, 5]);
        let s = t.take(&[9, 1], 2, zeros).unwrap();
        assert_eq!(ids_in(&s, 2), [9, 1]);
    }

    #[test]
    fn bad_calls_change_nothing() {
        let mut t = SessionTable::<B>::default();
        t.put(&[1, 2], 1, rows_of(&[1, 2], 1));
        let e = t.take(&[2, 2], 1, zeros).unwrap_err().to_string();
        assert!(e.contains("session 2 appears twice"), "{e}");
        let e = t.take(&[5, 1], 3, zeros).unwrap_err().to_string();
        assert!(e.contains("session 1 has batch 1, the call 3"), "{e}");
        assert_eq!(t.len(), 2);
        assert_eq!(ids_in(&t.take(&[1, 2], 1, zeros).unwrap(), 1), [1, 2]);
    }
}
