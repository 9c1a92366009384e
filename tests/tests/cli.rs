//! The `nsactor` command line, run as a user runs it.

mod common;

use common::cargo_build;
use std::path::PathBuf;
use std::process::Command;

fn nsactor() -> Command {
    let exe = std::env::var_os("NSACTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // The binary and the ndarray plugin, built with this test's own profile into this
            // test's own target directory: the plugin lands next to the binary.
            cargo_build(&["nsactor", "nsactor-backend-ndarray"]).join("nsactor")
        });
    Command::new(exe)
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nsactor-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn train_on_the_embedded_default_lowers_the_loss_and_writes_weights() {
    let dir = temp_dir("train");
    let out = nsactor()
        .args(["train", "--steps", "24", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 24);
    let first = losses[..2].iter().sum::<f64>() / 2.0;
    let last = losses[22..].iter().sum::<f64>() / 2.0;
    assert!(last < first - 0.3, "loss did not fall: {losses:?}");
    let weights = std::fs::metadata(dir.join("model.safetensors")).unwrap();
    assert!(
        weights.len() > 1_000_000,
        "weights file too small: {}",
        weights.len()
    );
    assert!(dir.join("config.toml").exists());
    let png = std::fs::read(dir.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "loss.png is a PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn losses(dir: &std::path::Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

#[test]
fn pipelined_training_checkpoints_and_resumes_exactly() {
    let dir = temp_dir("pipeline");
    let full = dir.join("full");
    let out = nsactor()
        .args([
            "--log-format",
            "json",
            "train",
            "--steps",
            "6",
            "--pipeline",
            "2",
            "--checkpoint-every",
            "3",
            "--out",
        ])
        .arg(&full)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    // JSON logs: every stderr line is an object with a message.
    for line in stderr.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        assert!(v["fields"]["message"].is_string(), "{line}");
    }
    assert!(stderr.contains("pipeline 2 [0-0@0 1-1@0]"), "{stderr}");
    let want = losses(&full);
    assert_eq!(want.len(), 6);
    let ckpts = full.join("checkpoints");
    assert!(ckpts.join("step-00000003/manifest.json").exists());
    assert!(ckpts.join("step-00000006/layer-001.safetensors").exists());

    // A run that stopped after step 3: its checkpoint and the metrics it had written.
    let cut = dir.join("cut");
    std::fs::create_dir_all(cut.join("checkpoints")).unwrap();
    let src = ckpts.join("step-00000003");
    let dst = cut.join("checkpoints/step-00000003");
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    let metrics = std::fs::read_to_string(full.join("metrics.jsonl")).unwrap();
    let head: Vec<&str> = metrics.lines().take(3).collect();
    std::fs::write(cut.join("metrics.jsonl"), head.join("\n") + "\n").unwrap();
    // Resumed with a different P: the schedule does not change the numbers.
    let out = nsactor()
        .args([
            "train",
            "--steps",
            "6",
            "--pipeline",
            "1",
            "--resume",
            "--out",
        ])
        .arg(&cut)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "resume failed: {stderr}");
    assert!(stderr.contains("resuming from"), "{stderr}");
    assert_eq!(
        losses(&cut),
        want,
        "the resumed run differs from the uninterrupted one"
    );
    assert_eq!(
        std::fs::read(cut.join("model.safetensors")).unwrap(),
        std::fs::read(full.join("model.safetensors")).unwrap()
    );

    // Impossible layouts are refused up front.
    let err = run_err(&[
        "train",
        "--steps",
        "1",
        "--pipeline",
        "3",
        "--out",
        "/tmp/x",
    ]);
    assert!(
        err.contains("--pipeline 3 needs at least 3 layers"),
        "{err}"
    );
    let err = run_err(&["train", "--steps", "1", "--devices", "4", "--out", "/tmp/x"]);
    assert!(err.contains("device 4 does not exist"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_configs_get_clear_errors() {
    let dir = temp_dir("badcfg");
    let tiny = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.toml"),
    )
    .unwrap();
    let cases = [
        (
            "unknown-train-key",
            tiny.replace("seed = 42", "seed = 42\nlearning_rate = 1"),
            "learning_rate",
        ),
        (
            "unknown-model-key",
            tiny.replace("v_th_min = 0.1", "v_th_min = 0.1\nheads = 4"),
            "heads",
        ),
        (
            "unknown-table",
            format!("{tiny}\n[serve]\naddr = \"x\"\n"),
            "serve",
        ),
        (
            "zero-steps",
            tiny.replace("steps = 300", "steps = 0"),
            "`steps` must be positive",
        ),
        (
            "small-vocab",
            tiny.replace("vocab_size = 2048", "vocab_size = 1000"),
            "vocab_size",
        ),
    ];
    for (name, text, needle) in cases {
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = nsactor()
            .args(["train", "--steps", "1", "--config"])
            .arg(&path)
            .arg("--out")
            .arg(dir.join(name))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: should fail");
        assert!(
            stderr.contains("error:") && stderr.contains(needle),
            "{name}: unclear error: {stderr}"
        );
    }
    let out = nsactor()
        .args(["train", "--config", "/nonexistent/x.toml"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("/nonexistent/x.toml"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plugins_lists_the_ndarray_plugin_and_the_search_path() {
    let out = nsactor().arg("plugins").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("ndarray "))
        .unwrap_or_else(|| panic!("no ndarray plugin listed:\n{stdout}"));
    assert!(line.contains("ABI ") && line.contains("cpu ("), "{line}");
    assert!(
        stdout.contains("embedded ") && stdout.contains("searched:"),
        "{stdout}"
    );
}

#[test]
fn train_runs_through_the_ndarray_plugin_and_unknown_backends_fail_clearly() {
    let dir = temp_dir("plugin-train");
    let out = nsactor()
        .args(["train", "--backend", "ndarray", "--steps", "3", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train via plugin failed: {stderr}");
    assert!(stderr.contains("on ndarray "), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        3
    );
    let out = nsactor()
        .args(["train", "--backend", "tpu", "--steps", "1", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no plugin for backend `tpu`") && stderr.contains("NSACTOR_PLUGIN_PATH"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn run_ok(args: &[&str]) -> String {
    let out = nsactor().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    stderr
}

fn run_err(args: &[&str]) -> String {
    let out = nsactor().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(stderr.contains("error:"), "{stderr}");
    stderr
}

#[test]
fn tokenizer_train_data_prepare_and_train_on_shards() {
    let dir = temp_dir("data");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let text: String = (0..300)
        .map(|i| format!("Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n"))
        .collect();
    std::fs::write(p("c.txt"), &text).unwrap();
    let jsonl: String = (0..50)
        .map(|i| format!("{{\"body\": \"Record {i} says hello to the world.\"}}\n"))
        .collect();
    std::fs::write(p("d.jsonl"), jsonl).unwrap();

    let log = run_ok(&[
        "tokenizer",
        "train",
        "--corpus",
        &p("c.txt"),
        "--vocab-size",
        "300",
        "--out",
        &p("tok.json"),
    ]);
    assert!(log.contains("300-token"), "{log}");
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("tok.json")).unwrap()).unwrap();
    assert_eq!(tok["added_tokens"][3]["content"], "<|im_start|>");

    // Shards with the bundled tokenizer (the default), then a run on them.
    let log = run_ok(&[
        "data",
        "prepare",
        "--out",
        &p("shards"),
        "--text-field",
        "body",
        &p("c.txt"),
        &p("d.jsonl"),
    ]);
    assert!(
        log.contains("350 documents") && log.contains("MB/s"),
        "{log}"
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("shards/manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["dtype"], "u16");
    assert_eq!(manifest["documents"], 350);
    run_ok(&[
        "train",
        "--steps",
        "2",
        "--data",
        &p("shards"),
        "--out",
        &p("run"),
    ]);
    let cursor: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/data_cursor.json")).unwrap())
            .unwrap();
    assert_eq!(cursor["position"], 8, "2 steps × batch 4: {cursor}");

    // The same shards under another tokenizer: refused, naming both hashes.
    let e = run_err(&[
        "train",
        "--steps",
        "1",
        "--data",
        &p("shards"),
        "--tokenizer",
        &p("tok.json"),
        "--out",
        &p("run2"),
    ]);
    assert!(e.contains("made with tokenizer"), "{e}");

    // Unreadable inputs and an empty corpus.
    let e = run_err(&["data", "prepare", "--out", &p("x"), &p("missing.txt")]);
    assert!(e.contains("missing.txt"), "{e}");
    std::fs::write(p("empty.txt"), "\n\n").unwrap();
    let e = run_err(&[
        "tokenizer",
        "train",
        "--corpus",
        &p("empty.txt"),
        "--out",
        &p("t2.json"),
    ]);
    assert!(e.contains("empty corpus"), "{e}");

    // SFT on an alpaca file.
    std::fs::write(
        p("sft.json"),
        r#"[{"instruction":"Say hi","input":"","output":"Hi there."},{"instruction":"Add 1 and 2","input":"","output":"3"}]"#,
    )
    .unwrap();
    run_ok(&[
        "train",
        "--sft",
        "--steps",
        "2",
        "--corpus",
        &p("sft.json"),
        "--out",
        &p("run3"),
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
}
