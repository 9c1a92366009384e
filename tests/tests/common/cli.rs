//! The `nsactor` binary as the command-line tests run it: built with the test's own profile
//! (with the ndarray plugin beside it) unless `$NSACTOR_BIN` names one, and the small runners
//! that assert on its exit status.

use super::cargo_build;
use std::path::PathBuf;
use std::process::Command;

/// The `nsactor` command, pinned to one rayon thread.
pub fn nsactor() -> Command {
    let exe = std::env::var_os("NSACTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // The binary and the ndarray plugin, built with this test's own profile into this
            // test's own target directory: the plugin lands next to the binary.
            cargo_build().join("nsactor")
        });
    let mut c = Command::new(exe);
    // Runs are compared bit for bit (crash and resume against an uninterrupted run): one rayon
    // thread keeps burn-ndarray's reductions deterministic while pipeline stages overlap.
    c.env("RAYON_NUM_THREADS", "1");
    c
}

/// The embedded tiny config with `keys` added to its `[train]` table, written as `dir/name`.
pub fn tiny_with(dir: &std::path::Path, name: &str, keys: &str) -> PathBuf {
    let tiny = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.toml"),
    )
    .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(
        &path,
        tiny.replace("[train]\n", &format!("[train]\n{keys}")),
    )
    .unwrap();
    path
}

pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nsactor-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `c` and asserts it succeeded (its stderr in the message otherwise).
pub fn ok(c: &mut Command) -> std::process::Output {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

pub fn run_ok(args: &[&str]) -> String {
    let out = nsactor().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    stderr
}

pub fn run_err(args: &[&str]) -> String {
    let out = nsactor().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(stderr.contains("error:"), "{stderr}");
    stderr
}

/// Runs `cmd`, which must refuse its input: exit 78 (`EX_CONFIG`), which `--max-restarts`
/// never restarts. Its stderr.
pub fn refused(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(78), "{cmd:?}: {stderr}");
    stderr
}

/// [`run_err`] for a refusal of the command's input ([`refused`]).
pub fn run_refused(args: &[&str]) -> String {
    let stderr = refused(nsactor().args(args));
    assert!(stderr.contains("error:"), "{stderr}");
    stderr
}

pub fn run_stdout(args: &[&str]) -> String {
    let out = nsactor().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `(step, loss)` of every step line of a run's metrics (event lines skipped), the last line of
/// each step winning, in step order.
pub fn losses(dir: &std::path::Path) -> Vec<(u64, f64)> {
    let mut by_step = std::collections::BTreeMap::new();
    for l in std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if let (Some(step), Some(loss)) = (v["step"].as_u64(), v["loss"].as_f64()) {
            by_step.insert(step, loss);
        }
    }
    by_step.into_iter().collect()
}

/// Trains two steps of the tiny default (batch 4) on the shards in `data` into `out`, and checks
/// that the run's data cursor then stands at 8 sequences.
pub fn trains_two_steps_on(data: &str, out: &str) {
    run_ok(&["train", "--steps", "2", "--data", data, "--out", out]);
    let cursor: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(std::path::Path::new(out).join("data_cursor.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cursor["position"], 8, "2 steps × batch 4: {cursor}");
}
