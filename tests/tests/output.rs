//! What the commands that print do when their output goes away or would overwrite the run: a
//! reader that hangs up (`| head`) ends `generate` as it ends `cat` (SIGPIPE), not with a panic
//! dump; `generate --chat` skips an input line that is not UTF-8; `plot --out` refuses a name
//! that is not a PNG's (the run's own `metrics.jsonl`, which it used to overwrite with the
//! picture). And how they end on bad input: argument values refused with exit 78, the last
//! line a JSON object under `--log-format json`, a plugin file cut short named and refused
//! instead of crashing the process. Through the `nsactor` binary.

mod common;

use common::cli::{nsactor, ok, refused, temp_dir};
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

    // `generate --chat`: a line that is not UTF-8 is refused on its own, the next one answered.
    let mut child = nsactor()
        .args(["generate", "--chat", "--max-tokens", "4", "--checkpoint"])
        .arg(&run)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"caf\xe9 au lait\nHello\n").unwrap();
    }
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}: {stderr}", o.status);
    assert!(stderr.contains("that line is not UTF-8 text"), "{stderr}");
    // One answer (the second line's): four tokens at most, on the turn's prompt lines.
    assert_eq!(stderr.matches("tokens, ").count(), 1, "{stderr}");
    // A sampling value out of range is refused input.
    let stderr = refused(
        nsactor()
            .args(["generate", "--top-p", "2", "--checkpoint"])
            .arg(&run)
            .arg("Emma was"),
    );
    assert!(
        stderr.contains("top_p must be in (0, 1], got 2"),
        "{stderr}"
    );
    // `plot` of a directory that holds no run: refused input, named.
    let stderr = refused(nsactor().arg("plot").arg(dir.join("none")));
    assert!(stderr.contains("has no `metrics.jsonl`"), "{stderr}");

    // `plot --out` of the run's metrics: refused (exit 78), the metrics kept.
    let metrics = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let stderr = refused(
        nsactor()
            .arg("plot")
            .arg(&run)
            .arg("--out")
            .arg(run.join("metrics.jsonl")),
    );
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

#[test]
fn refused_arguments_exit_78_and_json_logs_end_in_json() {
    let dir = temp_dir("refusals");
    let run = dir.join("run");
    ok(nsactor()
        .args(["train", "--steps", "1", "--sample", "", "--out"])
        .arg(&run));
    let cases: [(&[&str], &str); 3] = [
        (
            &["eval", "--batches", "0", "--checkpoint"],
            "--batches must be at least 1",
        ),
        (
            &[
                "analyze",
                "--max-tokens",
                "0",
                "--out",
                "/nonexistent/analysis",
                "--checkpoint",
            ],
            "--max-tokens must be at least 1",
        ),
        (
            &["serve", "--max-body-bytes", "10", "--checkpoint"],
            "--max-body-bytes must be at least 1024",
        ),
    ];
    for (args, want) in cases {
        let stderr = refused(nsactor().args(args).arg(&run));
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let stderr = refused(
        nsactor()
            .args(["--log-format", "json", "eval", "--batches", "0"])
            .arg("--checkpoint")
            .arg(&run),
    );
    let last: serde_json::Value =
        serde_json::from_str(stderr.lines().last().expect("a line")).expect("a JSON line");
    assert_eq!(last["level"], "ERROR", "{last}");
    assert_eq!(last["fields"]["exit_code"], 78, "{last}");
    assert!(
        last["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--batches")),
        "{last}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A plugin file cut short (an interrupted copy) used to be mapped by the loader and kill the
/// process with SIGBUS on its first missing page; it is now named and refused.
#[test]
fn a_plugin_file_cut_short_is_refused_not_a_crash() {
    let dir = temp_dir("cut-plugin");
    let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let cut = dir.join("libnsactor_backend_cut.so");
    std::fs::write(&cut, &me[..me.len() / 3]).unwrap();
    let o = nsactor()
        .arg("plugins")
        .env("NSACTOR_PLUGIN_PATH", &dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.code().is_some(),
        "killed by a signal: {:?}: {text}",
        o.status
    );
    assert!(
        text.contains("libnsactor_backend_cut.so") && text.contains("cut short"),
        "{text}"
    );
    let o = nsactor()
        .args(["train", "--steps", "1", "--backend"])
        .arg(&cut)
        .arg("--out")
        .arg(dir.join("run"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code().is_some(),
        "killed by a signal: {:?}: {stderr}",
        o.status
    );
    assert!(
        !o.status.success() && stderr.contains("cut short"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
