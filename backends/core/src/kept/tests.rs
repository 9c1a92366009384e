//! The prefix cache's slabs under test: saves, restores, drops, free places and compaction.

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

/// A slab a quarter full or less gives its snapshots to another slab's free places and its
/// buffers back; each snapshot still restores its own rows. Where no other slab has room, it
/// stays as it is.
#[test]
fn a_sparse_slab_moves_into_free_places_and_goes() {
    let (mut k, mut t) = (Snapshots::<B>::new(vec![2]), SessionTable::<B>::default());
    let ids: Vec<u64> = (1..=128).collect();
    t.put(&ids, 2, rows_of(&ids, 2));
    let (a, b): (Vec<u64>, Vec<u64>) = (1..=64).zip(65..=128).unzip();
    let snap = |s: &[u64]| s.iter().map(|s| 1000 + s).collect::<Vec<u64>>();
    save(&mut k, &mut t, &a, &snap(&a)).unwrap();
    save(&mut k, &mut t, &b, &snap(&b)).unwrap();
    assert_eq!(k.slabs.len(), 2);
    let slab_of = |k: &Snapshots<B>, s: u64| k.kept[&(1000 + s)].0;
    let (slab_a, slab_b) = (slab_of(&k, 1), slab_of(&k, 65));
    // B down to 24 of 64: more than a quarter, it stays.
    for s in &b[..40] {
        drop_snapshot(&mut k, &mut t, 1000 + s);
    }
    assert_eq!(k.slabs[&slab_b].live, 24);
    // A down to 16 of 64 (a quarter): its 16 move into B's 40 free places, A goes.
    for s in &a[..47] {
        drop_snapshot(&mut k, &mut t, 1000 + s);
    }
    assert_eq!(k.slabs.len(), 2, "17 live: A stays");
    drop_snapshot(&mut k, &mut t, 1000 + a[47]);
    assert_eq!(k.slabs.len(), 1, "16 live: A's snapshots moved");
    assert!(!k.slabs.contains_key(&slab_a));
    assert_eq!(k.slabs[&slab_b].live, 40);
    let kept: Vec<u64> = a[48..].iter().chain(&b[40..]).copied().collect();
    for s in &kept {
        assert_eq!(slab_of(&k, *s), slab_b);
        assert_eq!(
            read(&mut k, &mut t, 1000 + s).unwrap(),
            *s,
            "snapshot {}",
            1000 + s
        );
    }
    let back: Vec<u64> = (500..500 + kept.len() as u64).collect();
    restore(&mut k, &mut t, &back, &snap(&kept)).unwrap();
    assert_eq!(
        ids_in(&t.take(&back, 2, |_| unreachable!()).unwrap(), 2),
        kept
    );
    // The one slab left, down to 8 of 64: nowhere to go, it stays whole.
    for s in &kept[..32] {
        drop_snapshot(&mut k, &mut t, 1000 + s);
    }
    assert_eq!(k.slabs.len(), 1);
    assert_eq!(k.slabs[&slab_b].live, 8);
    for s in &kept[32..] {
        assert_eq!(read(&mut k, &mut t, 1000 + s).unwrap(), *s);
    }
}
