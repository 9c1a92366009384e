//! `data prepare` into a directory that holds a dataset: a run that succeeds leaves only its
//! own shards, and one that fails leaves the earlier dataset as it was and none of its files.

use nsactor_data::prepare::{PrepareOptions, prepare};
use nsactor_data::{ShardSet, Tokenizer};
use std::path::Path;

fn text(paragraphs: usize) -> String {
    let c = nsactor_data::bundled_corpus();
    nsactor_data::corpus::paragraphs(&c)
        .take(paragraphs)
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_rerun_leaves_its_own_shards_and_a_failed_one_leaves_the_earlier_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let (d, tok) = (dir.path(), Tokenizer::bundled());
    let opts = PrepareOptions {
        shard_tokens: 2_000,
        ..Default::default()
    };
    let (big, small) = (d.join("big.txt"), d.join("small.txt"));
    std::fs::write(&big, text(300)).unwrap();
    std::fs::write(&small, text(20)).unwrap();
    let out = d.join("out");
    let first = prepare(&tok, std::slice::from_ref(&big), &out, &opts).unwrap();
    assert!(
        first.manifest.shards.len() >= 4,
        "{}",
        first.manifest.shards.len()
    );
    std::fs::write(out.join("notes.txt"), "the user's own file").unwrap();

    // A smaller corpus: the shards past its own are gone, the user's file stays.
    let second = prepare(&tok, std::slice::from_ref(&small), &out, &opts).unwrap();
    let n = second.manifest.shards.len();
    assert!(n < first.manifest.shards.len());
    let mut expected: Vec<String> = second
        .manifest
        .shards
        .iter()
        .flat_map(|s| [s.file.clone(), s.index.clone()])
        .chain(["manifest.json".into(), "notes.txt".into()])
        .collect();
    expected.sort();
    assert_eq!(names(&out), expected);
    let set = ShardSet::open(&out, &tok, true).unwrap();
    assert_eq!(set.manifest().tokens, second.manifest.tokens);

    // A run that fails on its second file, after shards of the first were written: the
    // second dataset is still there, checksums and all, and nothing of the failed run is.
    let bad = d.join("bad.txt");
    std::fs::write(&bad, b"good text\n\nbad \xff here").unwrap();
    let before = names(&out);
    let e = prepare(&tok, &[big.clone(), bad], &out, &opts)
        .map(|r| r.manifest.tokens)
        .expect_err("invalid UTF-8 is refused");
    assert!(e.to_string().contains("invalid UTF-8"), "{e}");
    assert_eq!(names(&out), before);
    let set = ShardSet::open(&out, &tok, true).unwrap();
    assert_eq!(set.manifest().tokens, second.manifest.tokens);
}

#[test]
fn a_killed_runs_staging_folder_goes_with_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let (d, tok) = (dir.path(), Tokenizer::bundled());
    let out = d.join("out");
    // pid 0 names no process a run could have.
    let killed = out.join(".prepare-0");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(killed.join("shard-00000.bin"), b"half").unwrap();
    let small = d.join("small.txt");
    std::fs::write(&small, text(20)).unwrap();
    prepare(&tok, &[small], &out, &PrepareOptions::default()).unwrap();
    assert!(!killed.exists());
    assert!(names(&out).iter().all(|n| !n.starts_with(".prepare")));
}
