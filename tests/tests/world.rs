//! `nsactor train` over several processes on one host, as a user launches it
//! (`--nproc-per-node`): two CPU processes over loopback give the one-process run's losses
//! and weights bit for bit, a run resumes in another number of processes, and a rank killed
//! with SIGKILL in the middle of a step is restarted with the others from the newest
//! checkpoint, ending where an uninterrupted run ends. Bad worlds get clear errors.

mod common;

use common::cli::{losses, nsactor, ok, temp_dir};
use std::path::Path;
use std::process::Command;

/// A tiny run of `steps` steps of two micro-batches into `out`.
fn train_for(out: &Path, steps: u64, extra: &[&str]) -> Command {
    let mut c = nsactor();
    c.env("NSACTOR_TRAIN__ACCUMULATION", "2")
        .args([
            "train",
            "--checkpoint-every",
            "2",
            "--steps",
            &steps.to_string(),
        ])
        .arg("--out")
        .arg(out)
        .args(extra);
    c
}

fn train(out: &Path, extra: &[&str]) -> Command {
    train_for(out, 4, extra)
}

fn events(dir: &Path, name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == name)
        .collect()
}

fn same_weights(a: &Path, b: &Path) -> bool {
    std::fs::read(a.join("model.safetensors")).unwrap()
        == std::fs::read(b.join("model.safetensors")).unwrap()
}

#[test]
fn two_processes_train_like_one_bit_for_bit_and_survive_a_killed_rank() {
    let dir = temp_dir("world");
    let one = dir.join("one");
    ok(&mut train(&one, &["--data-parallel", "2"]));
    assert_eq!(losses(&one).len(), 4);

    // Two processes, one replica each (the default: one per process).
    let two = dir.join("two");
    let o = ok(&mut train(&two, &["--nproc-per-node", "2"]));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("rank 0/2 joined a world of 2 processes"),
        "{stderr}"
    );
    assert_eq!(losses(&two), losses(&one));
    assert!(same_weights(&two, &one), "two processes' weights differ");

    // Half the run in two processes, the rest resumed in one: checkpoints do not care.
    let mixed = dir.join("mixed");
    ok(&mut train_for(&mixed, 2, &["--nproc-per-node", "2"]));
    ok(&mut train(&mixed, &["--data-parallel", "2", "--resume"]));
    assert_eq!(losses(&mixed), losses(&one));
    assert!(
        same_weights(&mixed, &one),
        "the resumed run's weights differ"
    );

    // Rank 1 dies from SIGKILL during step 3; the group restarts from step 2's checkpoint.
    let killed = dir.join("killed");
    let o = ok(&mut train(
        &killed,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--restart-backoff",
            "0",
            "--inject-fault",
            "kill-rank:1:3",
        ],
    ));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let restarts = events(&killed, "restarted");
    assert_eq!(restarts.len(), 1, "{restarts:?}\n{stderr}");
    let cause = restarts[0]["cause"].as_str().unwrap();
    assert!(
        cause.contains("(rank 1)") && cause.contains("SIGKILL"),
        "{cause}"
    );
    assert_eq!(restarts[0]["to_step"], 2);
    assert_eq!(losses(&killed), losses(&one));
    assert!(
        same_weights(&killed, &one),
        "the restarted run's weights differ"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn worlds_that_cannot_split_the_replicas_are_refused() {
    let dir = temp_dir("world-bad");
    let o = train(
        &dir.join("a"),
        &["--nproc-per-node", "2", "--data-parallel", "3"],
    )
    .env("NSACTOR_TRAIN__ACCUMULATION", "4")
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("does not split over 2 processes"),
        "{stderr}"
    );
    // Three processes for a step of two micro-batches.
    let o = train(&dir.join("b"), &["--nproc-per-node", "3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("need at least 3"), "{stderr}");
    // A rank started by hand without the shared secret.
    let o = train(&dir.join("c"), &[])
        .env("NSACTOR_WORLD_SIZE", "2")
        .env("NSACTOR_RANK", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("NSACTOR_SECRET"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
