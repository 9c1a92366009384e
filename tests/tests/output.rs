//! What the commands that print do when their output goes away or would overwrite the run: a
//! reader that hangs up (`| head`) ends `generate` as it ends `cat` (SIGPIPE), not with a panic
//! dump; `plot --out` refuses a name that is not a PNG's (the run's own `metrics.jsonl`, which
//! it used to overwrite with the picture). Through the `nsactor` binary.

mod common;

use common::cli::{nsactor, ok, temp_dir};
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

#[test]
fn a_closed_pipe_ends_the_printing_quietly_and_plot_keeps_the_run() {
    let dir = temp_dir("output");
    let run = dir.join("run");
    ok(nsactor()
        .args(["train", "--steps", "2", "--sample", "", "--out"])
        .arg(&run));

    // The reader goes before the text is written: the next write ends the process by SIGPIPE.
    let mut child = nsactor()
        .args(["generate", "--max-tokens", "20", "--checkpoint"])
        .arg(&run)
        .arg("Emma was")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        o.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // `plot --out` of the run's metrics: refused (exit 78), the metrics kept.
    let metrics = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let o = nsactor()
        .arg("plot")
        .arg(&run)
        .arg("--out")
        .arg(run.join("metrics.jsonl"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("the picture is a PNG"), "{stderr}");
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), metrics);
    ok(nsactor()
        .arg("plot")
        .arg(&run)
        .arg("--out")
        .arg(dir.join("curves.PNG")));
    assert!(dir.join("curves.PNG").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}
