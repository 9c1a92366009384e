//! The `nsactor` command line, run as a user runs it: training on the embedded default,
//! crashes and resumes, pipelines, bad configs, and training through the ndarray plugin. The
//! other commands (tokenizer, data, benchmarks, verify) are in `cli_tools.rs`.

mod common;

use common::cli::{losses, nsactor, ok, run_err, run_ok, temp_dir, tiny_with};
use std::path::PathBuf;
use std::process::Command;

// More tests of this binary, by topic.
#[path = "cli/plugins.rs"]
mod plugins;

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
    // Step lines; the events (startup, the final checkpoint) are their own lines.
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (steps, events): (Vec<_>, Vec<_>) = records.iter().partition(|v| v.get("event").is_none());
    let losses: Vec<f64> = steps.iter().map(|v| v["loss"].as_f64().unwrap()).collect();
    assert_eq!(losses.len(), 24);
    // The start is accounted for phase by phase, and the final checkpoint wrote the weights
    // from the same read of the stages.
    let startup = events
        .iter()
        .find(|v| v["event"] == "startup")
        .expect("a startup event");
    let phases = startup["phases"].as_object().unwrap();
    let sum: f64 = phases.values().map(|s| s.as_f64().unwrap()).sum();
    assert!(
        (sum - startup["seconds"].as_f64().unwrap()).abs() < 1e-6,
        "{startup}"
    );
    for p in ["tokenizer and data", "backend", "stages", "first step"] {
        assert!(phases.contains_key(p), "{p} missing: {startup}");
    }
    // The end likewise, from the end of the last step: the final checkpoint's start and reads,
    // the last evaluation where there is one, then what waits for the final files.
    let end = events
        .iter()
        .rfind(|v| v["event"] == "end")
        .expect("an end event");
    assert_eq!(end["step"], 24, "{end}");
    let phases = end["phases"].as_object().unwrap();
    let sum: f64 = phases.values().map(|s| s.as_f64().unwrap()).sum();
    assert!(
        (sum - end["seconds"].as_f64().unwrap()).abs() < 1e-6,
        "{end}"
    );
    let evaluated_last = events
        .iter()
        .any(|v| v["event"] == "eval" && v["step"] == 24);
    let mut want = vec![
        "the previous write and the final snapshot",
        "the final checkpoint's reads",
    ];
    if evaluated_last {
        want.push("the last evaluation");
    }
    want.push("the rest of the final checkpoint and weights");
    for p in want {
        assert!(phases.contains_key(p), "{p} missing: {end}");
    }
    let last = events
        .iter()
        .rfind(|v| v["event"] == "checkpoint_written")
        .expect("the final checkpoint");
    assert_eq!(last["step"], 24);
    let weights_len = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len();
    assert_eq!(last["export_bytes"].as_u64(), Some(weights_len));
    // The run's weights are the final checkpoint's weights file, linked: written once.
    {
        use std::os::unix::fs::MetadataExt;
        let ckpt = dir.join("checkpoints/step-00000024/model.safetensors");
        let (run, kept) = (
            std::fs::metadata(dir.join("model.safetensors")).unwrap(),
            std::fs::metadata(&ckpt).unwrap(),
        );
        assert_eq!((run.dev(), run.ino()), (kept.dev(), kept.ino()), "{ckpt:?}");
    }
    // Each step's own time and, within it, its wait for batches.
    for v in &steps {
        let (step_s, wait_s) = (
            v["step_s"].as_f64().unwrap(),
            v["data_wait_s"].as_f64().unwrap(),
        );
        assert!(step_s > 0.0 && (0.0..=step_s).contains(&wait_s), "{v}");
    }
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
    // The held-out loss of the trained run: below its first training loss, the same twice.
    let eval = |extra: &[&str]| {
        let out = nsactor()
            .args(["eval", "--checkpoint"])
            .arg(&dir)
            .args(["--batches", "2"])
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stdout, stderr)
    };
    let (ok, stdout, stderr) = eval(&[]);
    assert!(ok, "eval failed: {stderr}");
    let ce_of = |stdout: &str| -> f64 {
        stdout
            .split("held-out CE ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no CE in {stdout}"))
    };
    let ce = ce_of(&stdout);
    assert!(
        ce.is_finite() && ce < losses[0] - 0.3,
        "CE {ce} vs first loss {}",
        losses[0]
    );
    let again = eval(&[]).1;
    assert!(
        again.starts_with(&format!("held-out CE {ce:.5} ")),
        "eval is deterministic: {stdout} then {again}"
    );
    // One sequence per forward instead of the whole batch: the same CE up to rounding.
    let (ok, one_row, stderr) = eval(&["--forward-rows", "1"]);
    assert!(ok, "eval --forward-rows 1 failed: {stderr}");
    let ce_one = ce_of(&one_row);
    assert!(
        (ce_one - ce).abs() < 1e-4,
        "CE {ce} by batches, {ce_one} by rows"
    );
    let (ok, _, stderr) = eval(&["--forward-rows", "0"]);
    assert!(!ok && stderr.contains("--forward-rows"), "{stderr}");
    let (ok, _, stderr) = eval(&["--precision", "bf16"]);
    assert!(!ok && stderr.contains("bf16"), "{stderr}");
    let (ok, _, stderr) = eval(&["--batches", "0"]);
    assert!(!ok && stderr.contains("--batches"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn train_args(out: &std::path::Path, extra: &[&str]) -> Command {
    let mut c = nsactor();
    c.args(["train", "--steps", "8", "--checkpoint-every", "2", "--out"])
        .arg(out)
        .args(extra);
    c
}

fn run_train(out: &std::path::Path, extra: &[&str]) -> String {
    let o = train_args(out, extra).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "train {extra:?} failed: {stderr}");
    stderr
}

#[test]
fn killed_crashed_and_failing_runs_end_exactly_like_an_uninterrupted_one() {
    let dir = temp_dir("faults");
    let full = dir.join("full");
    run_train(&full, &[]);
    let want = losses(&full);
    assert_eq!(want.len(), 8);
    let weights = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();

    // kill -9 mid-run (between or during checkpoint writes, wherever it lands), then --resume.
    let killed = dir.join("killed");
    let mut child = train_args(&killed, &[])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    let step_lines = |m: String| m.lines().filter(|l| !l.contains("\"event\"")).count();
    while std::fs::read_to_string(killed.join("metrics.jsonl")).map_or(0, step_lines) < 5 {
        assert!(t.elapsed().as_secs() < 120, "the run never reached step 5");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    assert!(!child.wait().unwrap().success());
    let err = run_train(&killed, &["--resume"]);
    assert!(err.contains("resuming from"), "{err}");
    assert_eq!(losses(&killed), want, "resumed after kill -9");
    assert_eq!(weights(&killed), weights(&full));

    // A crash while writing checkpoint 4: its shards are there, its manifest is not; the
    // resume skips it, naming it, and continues from step 2.
    let crashed = dir.join("crashed");
    let o = train_args(&crashed, &["--inject-fault", "crash-in-checkpoint:4"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "the injected crash did not happen");
    let torn = crashed.join("checkpoints/step-00000004");
    assert!(torn.join("edge.safetensors").exists() && !torn.join("manifest.json").exists());
    let err = run_train(&crashed, &["--resume"]);
    assert!(
        err.contains("skipping")
            && err.contains("step-00000004")
            && err.contains("step-00000002 (step 2)"),
        "{err}"
    );
    assert_eq!(
        losses(&crashed),
        want,
        "resumed after a crash mid-checkpoint"
    );
    assert_eq!(weights(&crashed), weights(&full));

    // A layer actor panics in step 5: rebuilt, rolled back to step 4, same end.
    let panicked = dir.join("panicked");
    let err = run_train(
        &panicked,
        &["--inject-fault", "layer-panic:1:5", "--pipeline", "2"],
    );
    assert!(err.contains("rolled back to step 4"), "{err}");
    assert_eq!(losses(&panicked), want, "after an in-process recovery");
    assert_eq!(weights(&panicked), weights(&full));
    let recovered = std::fs::read_to_string(panicked.join("metrics.jsonl")).unwrap();
    assert_eq!(
        recovered.matches("\"event\":\"recovered\"").count(),
        1,
        "{recovered}"
    );

    // An unwritable checkpoint (a file where step 4's directory must go) with synchronous
    // checkpoints: training stops with the path named; checkpoint 2 stays valid and the run
    // resumes from it. (Background writes log the failure and train on: reliability.rs.)
    let blocked = dir.join("blocked");
    std::fs::create_dir_all(blocked.join("checkpoints")).unwrap();
    std::fs::write(blocked.join("checkpoints/step-00000004"), b"in the way").unwrap();
    let sync = tiny_with(&dir, "sync.toml", "async_checkpoint = false\n");
    let sync = sync.to_str().unwrap();
    let o = train_args(&blocked, &["--config", sync]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("error:") && err.contains("step-00000004"),
        "{err}"
    );
    assert!(
        blocked
            .join("checkpoints/step-00000002/manifest.json")
            .exists()
    );
    std::fs::remove_file(blocked.join("checkpoints/step-00000004")).unwrap();
    run_train(&blocked, &["--resume", "--config", sync]);
    assert_eq!(
        losses(&blocked),
        want,
        "resumed after a failed checkpoint write"
    );

    // Export to the Hugging Face layout and back.
    let hf = dir.join("hf");
    run_ok(&[
        "export",
        "--checkpoint",
        full.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["model_type"].as_str(), config["D"].as_i64()),
        (Some("neuronspark"), Some(64))
    );
    let st = std::fs::read(hf.join("model.safetensors")).unwrap();
    let names = safetensors::SafeTensors::deserialize(&st)
        .unwrap()
        .names()
        .len();
    let header = String::from_utf8_lossy(&st[8..200]).into_owned();
    assert!(header.contains("\"model."), "{header}");
    // The tokenizer says what it is: BOS, EOS, pad and the ChatML template, as Hugging Face
    // tools (AutoTokenizer, lm-evaluation-harness) read them.
    let read_json = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(hf.join(name)).unwrap()).unwrap()
    };
    let tc = read_json("tokenizer_config.json");
    assert_eq!(
        (
            tc["bos_token"].as_str(),
            tc["eos_token"].as_str(),
            tc["pad_token"].as_str()
        ),
        (Some("<|im_start|>"), Some("<|im_end|>"), Some("<unk>")),
        "{tc}"
    );
    assert!(
        tc["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>assistant"),
        "{tc}"
    );
    let gc = read_json("generation_config.json");
    assert_eq!(
        (gc["bos_token_id"].as_u64(), gc["eos_token_id"].as_u64()),
        (Some(3), Some(4))
    );
    let cj = read_json("config.json");
    let ids = |v: &serde_json::Value| {
        [&v["bos_token_id"], &v["eos_token_id"], &v["pad_token_id"]].map(|x| x.as_u64())
    };
    assert_eq!(
        ids(&cj),
        ids(&gc),
        "config.json names the tokenizer's ids: {cj}"
    );
    // Imported into a folder named relative to where the command runs: its config's paths
    // are absolute, so the run trains on (below) from another directory, into that folder.
    let imported = dir.join("imported");
    ok(nsactor()
        .current_dir(&dir)
        .args(["import", "--from"])
        .arg(&hf)
        .args(["--out", "imported"]));
    let again = dir.join("hf-again");
    run_ok(&[
        "export",
        "--checkpoint",
        imported.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read(again.join("model.safetensors")).unwrap(),
        st,
        "{names} tensors"
    );
    ok(nsactor()
        .current_dir(hf.parent().unwrap().parent().unwrap())
        .args(["train", "--steps", "2", "--resume", "--config"])
        .arg(imported.join("config.toml")));
    assert!(imported.join("metrics.jsonl").is_file());
    // A damaged export source is refused with the file named.
    let shard = full.join("checkpoints/step-00000008/layer-001.safetensors");
    let mut b = std::fs::read(&shard).unwrap();
    b.truncate(b.len() / 2);
    std::fs::write(&shard, b).unwrap();
    let err = run_err(&[
        "export",
        "--checkpoint",
        shard.parent().unwrap().to_str().unwrap(),
        "--out",
        "/tmp/x",
    ]);
    assert!(
        err.contains("layer-001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
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
    // Steps 1..=3 and the events logged among them (the evaluation before step 1).
    let mut steps = 0;
    let head: Vec<&str> = metrics
        .lines()
        .take_while(|l| {
            steps += usize::from(!l.contains("\"event\""));
            steps <= 3
        })
        .collect();
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

/// `train --data-parallel 2` (two replicas of a two-stage pipeline, each one of the step's two
/// micro-batches) on the CPU: the same losses and the same final weights, bit for bit, as one
/// replica; a layout with more replicas than micro-batches is refused up front.
#[test]
fn data_parallel_training_matches_one_replica_bitwise() {
    let dir = temp_dir("data-parallel");
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let o = nsactor()
            .env("NSACTOR_TRAIN__ACCUMULATION", "2")
            .args(["train", "--steps", "4", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "train {extra:?} failed: {stderr}");
        (out, stderr)
    };
    let (one, _) = run("one", &[]);
    let (two, stderr) = run("two", &["--data-parallel", "2", "--pipeline", "2"]);
    assert!(
        stderr.contains("data parallelism: 2 replicas [0-0@0 1-1@0] [0-0@0 1-1@0], Ordered"),
        "{stderr}"
    );
    assert_eq!(losses(&two), losses(&one));
    assert_eq!(losses(&one).len(), 4);
    assert!(
        std::fs::read(two.join("model.safetensors")).unwrap()
            == std::fs::read(one.join("model.safetensors")).unwrap(),
        "the weights after data-parallel training differ"
    );
    let err = run_err(&[
        "train",
        "--steps",
        "1",
        "--data-parallel",
        "3",
        "--out",
        "/tmp/x",
    ]);
    assert!(
        err.contains("data_parallel") && err.contains("accumulation"),
        "{err}"
    );
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
        (
            "bad-precision",
            format!("{tiny}\n[backend]\nprecision = \"fp16\"\n"),
            "precision = `fp16`",
        ),
        (
            "bf16-on-cpu",
            format!("{tiny}\n[backend]\nprecision = \"bf16\"\n"),
            "bf16 GEMMs need",
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
