//! Long runs that look after themselves, driven as a scheduler would: SIGTERM checkpoints and
//! exits 0, `--max-restarts` brings a run through repeated kills (the chaos test), a full disk
//! during a checkpoint keeps the previous one, NaN gradients skip their step, a loss spike
//! rolls back to the newest checkpoint and skips the batches since. Each ends with the weights
//! and per-step losses of an uninterrupted run, bit for bit, or the data position it must.

mod common;

use common::cli::{losses, nsactor, ok, refused, temp_dir, tiny_with};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn train(out: &Path, steps: u32, extra: &[&str]) -> Command {
    let mut c = nsactor();
    c.args([
        "train",
        "--steps",
        &steps.to_string(),
        "--checkpoint-every",
        "2",
    ])
    .arg("--out")
    .arg(out)
    .args(extra);
    c
}

/// Number of step lines in a run's metrics so far.
fn steps_logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"loss\"") && !l.contains("\"event\""))
        .count()
}

/// The events of a run's metrics named `name`.
fn events(dir: &Path, name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == name)
        .collect()
}

/// Waits until `dir`'s metrics hold more than `n` step lines (or the process ended).
fn wait_for_steps(dir: &Path, n: usize, child: &mut Child) {
    let t = Instant::now();
    while steps_logged(dir) <= n {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before step line {}",
            n + 1
        );
        assert!(t.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process this test started (or its child).
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0, "kill {pid}");
}

/// The pid of a live child process of `parent`, if it has one.
fn child_of(parent: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // `pid (comm) state ppid …`: the fields after the last `)`.
        let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        (rest.first() != Some(&"Z") && rest.get(1)?.parse::<u32>().ok()? == parent).then_some(pid)
    })
}

/// Asserts that `dir` ended exactly as the uninterrupted run in `full`.
fn same_as(dir: &Path, full: &Path) {
    assert_eq!(losses(dir), losses(full), "per-step losses");
    let (a, b) = (
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        std::fs::read(full.join("model.safetensors")).unwrap(),
    );
    assert!(
        a == b,
        "model.safetensors differs from the uninterrupted run's"
    );
}

#[test]
fn sigterm_finishes_the_step_checkpoints_exits_0_and_resume_continues_exactly() {
    let dir = temp_dir("sigterm");
    let (full, part) = (dir.join("full"), dir.join("part"));
    ok(&mut train(&full, 12, &[]));
    let mut child = train(&part, 12, &[])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&part, 2, &mut child);
    signal(child.id(), libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}: {stderr}", o.status);
    let stopped = events(&part, "stopped");
    let at = stopped[0]["step"].as_u64().unwrap();
    assert!((3..12).contains(&at), "{stopped:?}");
    assert_eq!(stopped[0]["signal"], "SIGTERM");
    assert!(
        stderr.contains(&format!("stopped after step {at}")),
        "{stderr}"
    );
    // Its checkpoint is written and complete; the final weights are not.
    let ckpt = part.join(format!("checkpoints/step-{at:08}/manifest.json"));
    assert!(ckpt.is_file(), "{}", ckpt.display());
    assert!(!part.join("model.safetensors").exists());
    ok(&mut train(&part, 12, &["--resume"]));
    same_as(&part, &full);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_killed_again_and_again_under_max_restarts_ends_like_an_uninterrupted_one() {
    let dir = temp_dir("chaos");
    let (full, chaos) = (dir.join("full"), dir.join("chaos"));
    ok(&mut train(&full, 24, &[]));
    // Crash 1: the first child aborts inside the checkpoint write of step 4.
    let agent_args = [
        "--max-restarts",
        "8",
        "--restart-backoff",
        "0.05",
        "--inject-fault",
        "crash-in-checkpoint:4",
    ];
    let mut agent = train(&chaos, 24, &agent_args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while events(&chaos, "restarted").is_empty() {
        assert!(agent.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Crashes 2–5: SIGKILL the training process at pseudo-random moments, each after the
    // run got past the previous one.
    let mut x = std::process::id() as u64 | 1;
    let mut seen = 0;
    for kill in 0..4 {
        wait_for_steps(&chaos, seen, &mut agent);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(x % 250));
        let victim = loop {
            if let Some(pid) = child_of(agent.id()) {
                break pid;
            }
            assert!(
                agent.try_wait().unwrap().is_none(),
                "kill {kill}: the run ended"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        seen = steps_logged(&chaos);
        signal(victim, libc::SIGKILL);
        let t = Instant::now();
        while events(&chaos, "restarted").len() < kill + 2 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no restart after kill {kill}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Then SIGTERM to the agent: passed on, the child checkpoints and exits 0, no restart.
    wait_for_steps(&chaos, seen, &mut agent);
    signal(agent.id(), libc::SIGTERM);
    let o = agent.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "agent exit {:?}: {stderr}", o.status);
    let restarts = events(&chaos, "restarted");
    assert_eq!(restarts.len(), 5, "{restarts:?}");
    assert!(
        restarts[0]["cause"]
            .as_str()
            .unwrap()
            .contains("signal 6 (SIGABRT)"),
        "{restarts:?}"
    );
    assert!(
        restarts[1..]
            .iter()
            .all(|r| r["cause"].as_str().unwrap().contains("signal 9 (SIGKILL)"))
    );
    assert_eq!(events(&chaos, "stopped").len(), 1, "{stderr}");
    if !chaos.join("model.safetensors").exists() {
        ok(&mut train(&chaos, 24, &["--resume"]));
    }
    same_as(&chaos, &full);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_agent_gives_up_after_max_restarts_with_a_clear_message() {
    let dir = temp_dir("give-up");
    // A fault in the config (not the flag, which only the first child gets): every start
    // aborts in step 4's checkpoint, after step 2's is whole (a restart from step 0 would
    // start the metrics again, and with them the restart events).
    let config = tiny_with(
        &dir,
        "crash.toml",
        "inject_fault = \"crash-in-checkpoint:4\"\n",
    );
    let o = train(
        &dir.join("run"),
        6,
        &["--max-restarts", "2", "--restart-backoff", "0"],
    )
    .arg("--config")
    .arg(&config)
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("giving up after 2 restart(s)") && stderr.contains("SIGABRT"),
        "{stderr}"
    );
    assert_eq!(events(&dir.join("run"), "restarted").len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_that_refuses_its_input_is_not_restarted() {
    let dir = temp_dir("refused");
    // A tokenizer that does not exist: the child exits 78 and the agent stops at once.
    // The agent passes the refusal's status on (a service manager's
    // `RestartPreventExitStatus=78` sees it).
    let stderr = refused(
        train(
            &dir.join("run"),
            2,
            &["--max-restarts", "3", "--restart-backoff", "0"],
        )
        .arg("--tokenizer")
        .arg(dir.join("missing-tokenizer.json")),
    );
    assert!(
        stderr.contains("missing-tokenizer.json")
            && stderr.contains("exited with code 78")
            && stderr.contains("not restarted"),
        "{stderr}"
    );
    assert!(events(&dir.join("run"), "restarted").is_empty(), "{stderr}");
    // Without the agent the same refusal is the process's own exit status too.
    refused(
        train(&dir.join("run"), 2, &[])
            .arg("--tokenizer")
            .arg(dir.join("missing-tokenizer.json")),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_new_run_is_not_mixed_into_an_old_one() {
    let dir = temp_dir("rerun");
    let run = dir.join("run");
    ok(&mut train(&run, 4, &[]));
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    // Started again without --resume: refused, the old run untouched.
    let stderr = refused(&mut train(&run, 2, &[]));
    assert!(
        stderr.contains("already holds a training run")
            && stderr.contains("--resume")
            && stderr.contains("--overwrite"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(),
        metrics
    );
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        weights
    );
    // Resumed where it ended, it has nothing to train and writes nothing: its final
    // checkpoint is not written again in place (a full disk or a kill there would take the
    // run's final state). Resumed with fewer steps than it ran, it is refused.
    use std::os::unix::fs::MetadataExt;
    let manifest = run.join("checkpoints/step-00000004/manifest.json");
    let inode = |p: &Path| std::fs::metadata(p).unwrap().ino();
    let before = inode(&manifest);
    let o = ok(&mut train(&run, 4, &["--resume"]));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("already ended at step 4"), "{stderr}");
    let stderr = refused(&mut train(&run, 2, &["--resume"]));
    assert!(
        stderr.contains("at step 4") && stderr.contains("past [train] steps = 2"),
        "{stderr}"
    );
    // A run that died after its final checkpoint, before its end: the weights are linked
    // from that checkpoint, which stays as it was.
    std::fs::remove_file(run.join("model.safetensors")).unwrap();
    std::fs::remove_file(run.join("config.toml")).unwrap();
    ok(&mut train(&run, 4, &["--resume"]));
    assert_eq!(inode(&manifest), before);
    assert!(run.join("config.toml").is_file());
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        weights
    );
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .matches(r#""event":"checkpoint""#)
            .count(),
        metrics.matches(r#""event":"checkpoint""#).count()
    );
    // --overwrite starts over: the same 2-step run as in a fresh directory, nothing of the
    // old one left (its step-4 checkpoint would otherwise be what a resume takes).
    ok(&mut train(&run, 2, &["--overwrite"]));
    let fresh = dir.join("fresh");
    ok(&mut train(&fresh, 2, &[]));
    assert_eq!(losses(&run), losses(&fresh));
    assert!(!run.join("checkpoints/step-00000004").exists());
    assert!(run.join("checkpoints/step-00000002").is_dir());
    // --overwrite and --resume contradict each other.
    let o = train(&run, 2, &["--overwrite", "--resume"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second run into a directory a run is training in (a `--resume`, an `--overwrite`) is
/// refused with 78, naming the holder, and touches nothing; the children of a
/// `--max-restarts` agent run under its lock; once the run ends the directory is free again.
#[test]
fn a_directory_in_use_by_a_live_run_is_refused_to_a_second_one() {
    let dir = temp_dir("locked");
    let run = dir.join("run");
    let mut agent = train(&run, 400, &["--max-restarts", "2"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The agent's child trains under the agent's lock.
    wait_for_steps(&run, 2, &mut agent);
    for extra in [&["--resume"][..], &["--overwrite"]] {
        let stderr = refused(&mut train(&run, 4, extra));
        assert!(
            stderr.contains("is in use by another training run")
                && stderr.contains(&format!("(process {})", agent.id())),
            "{stderr}"
        );
    }
    // The --overwrite removed nothing of the live run.
    assert!(
        run.join("checkpoints/step-00000002/manifest.json")
            .is_file()
    );
    signal(agent.id(), libc::SIGTERM);
    assert!(agent.wait().unwrap().success());
    let stopped = events(&run, "stopped")[0]["step"].as_u64().unwrap();
    // Free again: a resume continues where the stopped run ended.
    let o = ok(&mut train(&run, stopped as u32 + 2, &["--resume"]));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!("step {stopped})")),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The embedded tiny config with `[train] async_checkpoint = false`.
fn synchronous_config(dir: &Path) -> PathBuf {
    tiny_with(dir, "sync.toml", "async_checkpoint = false\n")
}

#[test]
fn a_full_disk_during_a_checkpoint_keeps_the_previous_one() {
    let dir = temp_dir("enospc");
    let full = dir.join("full");
    ok(&mut train(&full, 8, &[]));
    // In the background: the write fails, is logged, training goes on to the same end.
    let bg = dir.join("background");
    let o = ok(&mut train(
        &bg,
        8,
        &["--inject-fault", "enospc-in-checkpoint:4"],
    ));
    let failed = events(&bg, "checkpoint_failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0]["cause"]
            .as_str()
            .unwrap()
            .contains("No space left on device")
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("checkpoint write failed"));
    same_as(&bg, &full);
    // Written before the next step: the run stops with the cause named; step 2's checkpoint
    // is intact and the run resumes from it to the same end.
    let sync = dir.join("sync");
    let cfg = synchronous_config(&dir);
    let o = train(
        &sync,
        8,
        &["--inject-fault", "enospc-in-checkpoint:4", "--config"],
    )
    .arg(&cfg)
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("No space left on device") && stderr.contains("step-00000004"),
        "{stderr}"
    );
    assert!(
        sync.join("checkpoints/step-00000002/manifest.json")
            .is_file()
    );
    // The failed write's partial shard is not left to take the room the next write needs.
    assert!(!sync.join("checkpoints/step-00000004").exists());
    let o = ok(train(&sync, 8, &["--resume", "--config"]).arg(&cfg));
    assert!(String::from_utf8_lossy(&o.stderr).contains("step-00000002"));
    same_as(&sync, &full);
    // The last step's checkpoint (with the weights, written beside the last evaluation and the
    // sample): its state exists nowhere else, so a failed write is tried again (the injected
    // fault fails one attempt) and the run ends as the uninterrupted one, the failure logged.
    let last = dir.join("last");
    let o = ok(&mut train(
        &last,
        8,
        &["--inject-fault", "enospc-in-checkpoint:8"],
    ));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("the final checkpoint was not written")
            && stderr.contains("No space left on device")
            && stderr.contains("writing it again in 1 s"),
        "{stderr}"
    );
    assert_eq!(events(&last, "final_write_failed").len(), 1);
    same_as(&last, &full);
    // With `final_write_wait_s = 0` the run gives up at once: it fails with the cause named,
    // never reports a finished run, and step 6's checkpoint stays the newest complete one.
    let once = tiny_with(&dir, "once.toml", "final_write_wait_s = 0\n");
    let given_up = dir.join("given-up");
    let o = train(
        &given_up,
        8,
        &["--inject-fault", "enospc-in-checkpoint:8", "--config"],
    )
    .arg(&once)
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("No space left on device") && stderr.contains("step-00000008"),
        "{stderr}"
    );
    assert!(
        given_up
            .join("checkpoints/step-00000006/manifest.json")
            .is_file()
    );
    assert!(
        !given_up
            .join("checkpoints/step-00000008/manifest.json")
            .exists()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nan_gradients_skip_their_step_and_the_run_goes_on() {
    let dir = temp_dir("nan");
    let o = ok(&mut train(&dir, 6, &["--inject-fault", "nan-grad:3"]));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("step 3: loss"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("event").is_none())
        .collect();
    let skipped: Vec<u64> = lines
        .iter()
        .filter(|v| v["skipped"] == true)
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(skipped, [3]);
    assert_eq!(lines.len(), 6);
    assert!(
        lines
            .iter()
            .all(|v| v["loss"].as_f64().unwrap().is_finite())
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_loss_spike_rolls_back_and_skips_the_batches_since_the_checkpoint() {
    let dir = temp_dir("spike");
    let cfg = tiny_with(&dir, "spike.toml", "loss_spike_window = 3\n");
    // Checkpoints at 2 and 4; step 6 spikes: back to step 4, the batches of steps 5 and 6
    // skipped, then steps 5..8 again on the batches that follow.
    let spiky = dir.join("spiky");
    let o = ok(train(
        &spiky,
        8,
        &[
            "--loss-spike-factor",
            "3",
            "--inject-fault",
            "loss-spike:6",
            "--config",
        ],
    )
    .arg(&cfg));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("rolled back to step 4"), "{stderr}");
    let e = events(&spiky, "loss_spike");
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        (e[0]["step"].as_u64(), e[0]["to_step"].as_u64()),
        (Some(6), Some(4))
    );
    assert!(e[0]["loss"].as_f64().unwrap() > 3.0 * e[0]["mean"].as_f64().unwrap());
    // The same steps 1..4 as a clean run; the run consumed ten steps' worth of data.
    let clean = dir.join("clean");
    ok(&mut train(&clean, 10, &[]));
    let (got, want) = (losses(&spiky), losses(&clean));
    assert_eq!(got.len(), 8);
    assert_eq!(got[..4], want[..4]);
    assert_ne!(
        got[4], want[4],
        "step 5 trains on the batches after step 6's"
    );
    let cursor = |d: &Path| std::fs::read_to_string(d.join("data_cursor.json")).unwrap();
    assert_eq!(cursor(&spiky), cursor(&clean));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--resume` on a run whose every checkpoint was written whole and is now damaged refuses,
/// naming them, and removes nothing: starting from step 0 would have pruned the run's work.
#[test]
fn resume_refuses_when_every_whole_checkpoint_is_damaged_and_keeps_them() {
    let dir = temp_dir("all-damaged");
    let run = dir.join("run");
    ok(&mut train(&run, 4, &[]));
    let mut damaged = Vec::new();
    for e in std::fs::read_dir(run.join("checkpoints")).unwrap() {
        let manifest = e.unwrap().path().join("manifest.json");
        if manifest.exists() {
            std::fs::write(&manifest, "{bad").unwrap();
            damaged.push(manifest);
        }
    }
    assert!(damaged.len() >= 2, "{damaged:?}");
    let o = train(&run, 6, &["--resume"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("every checkpoint in") && stderr.contains("none is removed"),
        "{stderr}"
    );
    for m in &damaged {
        assert_eq!(
            std::fs::read_to_string(m).unwrap(),
            "{bad",
            "{}",
            m.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
