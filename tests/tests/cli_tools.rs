//! The `nsactor` command line beyond training, run as a user runs it: tokenizer and data
//! preparation, the benchmarks and `verify`, and a plugin that cannot initialise.

mod common;

use common::cli::{nsactor, ok, run_err, run_ok, run_stdout, temp_dir, trains_two_steps_on};
use common::{cargo_build, library};
use std::path::PathBuf;

// More tests of this binary, by topic.
#[path = "cli_tools/profile.rs"]
mod profile;

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
    trains_two_steps_on(&p("shards"), &p("run"));

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
    // Evaluation asked for, but two conversations are too few to hold any out: trained on,
    // evaluation skipped, and said.
    let out = ok(nsactor()
        .env("NSACTOR_TRAIN__EVAL_EVERY", "1")
        .args(["train", "--sft", "--steps", "2", "--corpus"])
        .arg(p("sft.json"))
        .arg("--out")
        .arg(p("run3")));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("no held-out evaluation"), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_train_reports_throughput_busy_time_and_flops() {
    let out = ok(nsactor().args([
        "bench",
        "train",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--accumulation",
        "2",
        "--pipeline",
        "2",
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("2 × T 16 × accumulation 2 = 64 tokens/step"),
        "{stdout}"
    );
    // Three rows: one warm-up and two timed steps, each with a finite loss.
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u32>().is_ok())
        })
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for r in rows {
        let loss: f64 = r.split_whitespace().nth(3).unwrap().parse().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{r}");
    }
    for needle in [
        "median step",
        "MFU",
        // `keep_activations = "auto"`, the default, keeps none on the CPU.
        "kept layers: the last 0 of each stage keep their forward's graph (auto: this backend \
         reports no device memory)",
        "nsactor-edge",
        "nsactor-stage0",
        "nsactor-stage1",
    ] {
        assert!(stdout.contains(needle), "no `{needle}` in:\n{stdout}");
    }
    let err = run_err(&["bench", "train", "--steps", "0"]);
    assert!(err.contains("--steps"), "{err}");
}

#[test]
fn bench_checkpoint_times_the_parts_and_cleans_up() {
    let work = temp_dir("bench-checkpoint").join("bench");
    let stdout = run_stdout(&[
        "bench",
        "checkpoint",
        "--steps",
        "1",
        "--dir",
        work.to_str().unwrap(),
    ]);
    for needle in [
        "read back one stage after another",
        "disk (page cache, the run's): ",
        "disk (direct",
        "checkpoint (synchronous)",
        "checkpoint (background)",
        "steps beside it",
        "final checkpoint with the run's weights",
        "linked as",
        "× the 2 GB/s target",
    ] {
        assert!(stdout.contains(needle), "no `{needle}` in:\n{stdout}");
    }
    // Every rate printed is a finite number (a tiny state's may round to 0.00).
    for w in stdout.split(" GB/s").filter_map(|s| s.rsplit(' ').next()) {
        if let Ok(v) = w.trim_start_matches('=').parse::<f64>() {
            assert!(v.is_finite() && v >= 0.0, "{w} in:\n{stdout}");
        }
    }
    assert!(!work.exists(), "the bench left {}", work.display());
}

#[test]
fn bench_generate_batches_concurrent_sessions() {
    let stdout = run_stdout(&[
        "bench",
        "generate",
        "--sessions",
        "1,3",
        "--tokens",
        "5",
        "--prompt-len",
        "4",
    ]);
    // One row per session count: sessions, prefill, step p50/p99, tokens/s ×2, mean cohort.
    let rows: Vec<Vec<f64>> = stdout
        .lines()
        .filter_map(|l| {
            let v: Vec<f64> = l
                .split_whitespace()
                .map(|w| w.parse::<f64>())
                .collect::<Result<_, _>>()
                .ok()?;
            (v.len() == 7).then_some(v)
        })
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for (r, n) in rows.iter().zip([1.0, 3.0]) {
        assert_eq!(r[0], n, "{stdout}");
        assert!(r[1..6].iter().all(|x| x.is_finite() && *x > 0.0), "{r:?}");
        assert!(r[2] <= r[3], "p50 above p99: {r:?}");
        // The three sessions decode in shared passes (the batcher), one session alone.
        assert!(r[6] >= 1.0 && r[6] <= n, "{r:?}");
    }
    assert!(rows[1][6] > 1.5, "3 sessions were not batched: {stdout}");
    assert!(stdout.contains("batch-1 ceiling"), "{stdout}");
    let err = run_err(&["bench", "generate", "--tokens", "1"]);
    assert!(err.contains("--tokens"), "{err}");
}

/// `bench kernels --options only=…` runs just the parts named, through the backend's
/// diagnostic as users call it, and refuses a part this backend does not have by name.
#[test]
fn bench_kernels_runs_only_the_parts_named() {
    let shapes = "steps=40,batch=2,elem_dim=24,row_dim=16,check_steps=13,reps=1,dim=12,k=4";
    let kernels = |only: &str| {
        let options = format!("{shapes},{only}");
        ["bench", "kernels", "--backend", "embedded", "--options"]
            .into_iter()
            .map(str::to_owned)
            .chain([options])
            .collect::<Vec<_>>()
    };
    let args = kernels("only=ffn+norm");
    let stdout = run_stdout(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for name in [
        "ffn neurons fwd",
        "ffn neurons bwd",
        "norm + input plif fwd",
    ] {
        assert!(
            stdout.lines().any(|l| l.starts_with(name)),
            "no {name} in:\n{stdout}"
        );
    }
    for name in ["per-element forward", "selective fused fwd", "adam update"] {
        assert!(!stdout.contains(name), "{name} ran:\n{stdout}");
    }
    // The CPU backend has no GEMM bench of its own.
    let args = kernels("only=gemm");
    let err = run_err(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("unknown part `gemm`") && err.contains("selective"),
        "{err}"
    );
}

#[test]
fn verify_plif_scan_reports_both_precisions_and_rejects_a_missing_fixture() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/plif_scan.safetensors");
    let out = nsactor()
        .args(["verify", "plif-scan", "--fixture"])
        .arg(&fixture)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "elem scan, fp32:",
        "row scan, fp32:",
        "elem scan, bf16 storage:",
        "row scan, bf16 storage:",
        "grad_v0",
    ] {
        assert!(stdout.contains(line), "no `{line}` in\n{stdout}");
    }
    // Both fp32 runs agree on every spike (the bf16 ones report their flips).
    assert!(
        stdout.matches("agreement 100.0000% (0 flipped").count() >= 2,
        "{stdout}"
    );
    assert!(
        !stdout.contains("FAIL") && stdout.ends_with("PASS\n"),
        "{stdout}"
    );

    let out = nsactor()
        .args([
            "verify",
            "plif-scan",
            "--fixture",
            "/no/such/plif_scan.safetensors",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot read fixture /no/such"), "{stderr}");
}

#[test]
fn verify_batch_invariance_passes_on_the_cpu_and_refuses_an_empty_cohort() {
    let stdout = run_stdout(&[
        "verify",
        "batch-invariance",
        "--cohorts",
        "3,17",
        "--steps",
        "6",
    ]);
    assert_eq!(stdout.matches("  ok").count(), 2, "{stdout}");
    assert!(
        stdout.contains("cohort of   17: tokens differing 0 of 6"),
        "{stdout}"
    );
    assert!(stdout.ends_with("PASS\n"), "{stdout}");
    for cohorts in ["0", "1", "3,1"] {
        let e = run_err(&["verify", "batch-invariance", "--cohorts", cohorts]);
        assert!(
            e.contains("cohorts of at least two sessions"),
            "{cohorts}: {e}"
        );
    }
}

/// `bench serve` drives the real server over loopback with WebSocket and HTTP/SSE clients and
/// prints the engine's own figure beside them: greedy clients agree (one distinct text), and
/// every row has a throughput.
#[test]
fn bench_serve_measures_websocket_and_sse_clients_beside_the_engine() {
    let stdout = run_stdout(&[
        "bench",
        "serve",
        "--sessions",
        "1,3",
        "--tokens",
        "6",
        "--temperature",
        "0",
    ]);
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() >= 2 && w[0].parse::<usize>().is_ok())
        .collect();
    let clients: Vec<&str> = rows.iter().map(|w| w[1]).collect();
    assert_eq!(
        clients,
        ["ws", "sse", "engine", "ws", "sse", "engine"],
        "{stdout}"
    );
    for w in &rows {
        let tokens_per_s: f64 = w[if w[1] == "engine" { 5 } else { 6 }].parse().unwrap();
        assert!(tokens_per_s > 0.0, "{stdout}");
        if w[1] != "engine" {
            assert_eq!(w[8], "1", "greedy clients gave different texts: {stdout}");
        }
    }
    let e = run_err(&["bench", "serve", "--protocol", "grpc"]);
    assert!(e.contains("grpc"), "{e}");
}

/// The rows of a table printed by a bench whose first column is a number, split on whitespace.
fn numbered_rows(stdout: &str) -> Vec<Vec<&str>> {
    stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.first().is_some_and(|x| x.parse::<usize>().is_ok()))
        .collect()
}

/// `bench detokenize` times the server's text per token both ways and checks they agree.
#[test]
fn bench_detokenize_times_the_window_against_the_whole_decode_and_they_agree() {
    let stdout = run_stdout(&["bench", "detokenize", "--tokens", "8,64"]);
    let rows = numbered_rows(&stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    for (r, n) in rows.iter().zip(["8", "64"]) {
        assert_eq!(r[0], n, "{stdout}");
        assert_eq!(r.last(), Some(&"yes"), "{stdout}");
        let ms: f64 = r[1].parse().unwrap();
        assert!(ms.is_finite() && ms >= 0.0, "{stdout}");
    }
    let err = run_err(&["bench", "detokenize", "--tokens", "0"]);
    assert!(err.contains("--tokens"), "{err}");
}

/// `bench host` times a ChatML prompt's encoding both ways (refusing unequal ids) and a
/// decoding step's pick block: with the penalties off it carries the same ids at any prompt
/// length; the repetition penalty's set grows with the prompt's distinct tokens.
#[test]
fn bench_host_shows_a_steps_picks_flat_in_the_prompt_without_penalties() {
    let stdout = run_stdout(&["bench", "host", "--tokens", "100,3000", "--sessions", "8"]);
    let rows = numbered_rows(&stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    let ids = |r: &Vec<&str>, i: usize| r[i].parse::<usize>().unwrap();
    for r in &rows {
        assert_eq!(r.len(), 13, "{stdout}");
        let (fast, full): (f64, f64) = (r[1].parse().unwrap(), r[2].parse().unwrap());
        assert!(fast > 0.0 && full > 0.0, "{stdout}");
        // 7 head integers a row and the one banned token's id, for each of the 8 sessions.
        assert_eq!(ids(r, 7), 8 * 8, "{stdout}");
    }
    assert!(ids(&rows[1], 11) > ids(&rows[0], 11), "{stdout}");
    assert!(ids(&rows[0], 11) > ids(&rows[0], 7), "{stdout}");
    let err = run_err(&["bench", "host", "--sessions", "0"]);
    assert!(err.contains("--sessions"), "{err}");
}

/// `bench heal` runs the serving path's rebuild (checkpoint on disk, layer panic, reload) and
/// reports it by phase, with the first pass after it; its scratch directory is gone after.
#[test]
fn bench_heal_reports_the_rebuild_by_phase() {
    let dir = temp_dir("bench-heal");
    let scratch = dir.join("scratch");
    let stdout = run_stdout(&["bench", "heal", "--dir", scratch.to_str().unwrap()]);
    assert!(
        stdout.contains("layer 1 panics in decoding pass 9"),
        "{stdout}"
    );
    let away = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("decoding away "))
        .unwrap_or_else(|| panic!("no recovery time in:\n{stdout}"));
    let ms: f64 = away.split(' ').next().unwrap().parse().unwrap();
    assert!(ms > 0.0, "{stdout}");
    for part in [
        "read + verify the checkpoint",
        "rebuild the actors",
        "load the weights",
    ] {
        assert!(away.contains(part), "{stdout}");
    }
    assert!(stdout.contains("first decoding pass after it"), "{stdout}");
    assert!(!scratch.exists(), "the scratch directory was left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plugin that cannot initialise (here the panicky one told to panic when it opens; in a
/// workspace build on a machine without a GPU, the CUDA plugin beside the binary too) says so
/// in one line: no `panicked at`, no backtrace, even with `RUST_BACKTRACE=1`, on any command.
#[test]
fn a_plugin_that_cannot_initialise_says_so_in_one_line_without_a_panic_dump() {
    // Beside the binary, built with the rest of the workspace.
    let dir = cargo_build();
    let panicky = library(&dir, "nsactor_testplugin_panicky");
    let dir = temp_dir("plugin-panics");
    // `nsactor plugins` lists `*nsactor_backend_*` libraries: a copy under that name.
    let listed = dir.join("found");
    std::fs::create_dir_all(&listed).unwrap();
    std::fs::copy(&panicky, library(&listed, "nsactor_backend_panicky")).unwrap();
    let run = |args: &[&str]| {
        let o = nsactor()
            .args(args)
            .env("NSACTOR_TEST_PANICKY", "panic")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (o.status.success(), text(&o.stdout), text(&o.stderr))
    };
    let clean = |stderr: &str| {
        assert!(
            !stderr.contains("panicked at") && !stderr.contains("stack backtrace"),
            "{stderr}"
        );
    };
    let (ok, stdout, stderr) = run(&["plugins", "--plugin-dir", listed.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    clean(&stderr);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("panicky "))
        .unwrap_or_else(|| panic!("no panicky plugin listed:\n{stdout}"));
    assert!(
        line.contains("unusable here") && line.contains("injected panic while opening"),
        "{line}"
    );
    let (ok, _, stderr) = run(&[
        "train",
        "--steps",
        "1",
        "--backend",
        panicky.to_str().unwrap(),
        "--out",
        dir.join("run").to_str().unwrap(),
    ]);
    assert!(!ok);
    clean(&stderr);
    let errors: Vec<_> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(
        errors.len() == 1 && errors[0].contains("injected panic while opening"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `export` and `import` into a folder that holds a training run or a checkpoint would
/// overwrite it: refused before anything is read or written, the folder untouched.
#[test]
fn export_and_import_refuse_to_write_over_a_run() {
    let dir = temp_dir("over-a-run");
    let run = dir.join("run");
    std::fs::create_dir_all(run.join("checkpoints")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
    let missing = dir.join("no-such-model");
    for (cmd, from_flag) in [("export", "--checkpoint"), ("import", "--from")] {
        let o = nsactor()
            .args([cmd, from_flag])
            .arg(&missing)
            .arg("--out")
            .arg(&run)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{cmd}: {stderr}");
        assert!(
            stderr.contains("holds a training run or checkpoint"),
            "{cmd}: {stderr}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(),
        "{}\n"
    );
    let entries = std::fs::read_dir(&run).unwrap().count();
    assert_eq!(entries, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench prefill` through the real server: one prefill equals one token at a time, and a
/// multiple-choice question's answers scored in one request feed their context once through
/// the prefix cache (the three other answers start from its snapshot).
#[test]
fn bench_prefill_scores_a_question_from_one_pass_over_its_context() {
    let stdout = run_stdout(&[
        "bench",
        "prefill",
        "--lengths",
        "32",
        "--concurrent",
        "2x32",
        "--score",
        "120",
        "--choices",
        "4",
        "--check",
        "16",
        "--memory",
        "--reps",
        "1",
    ]);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("a 4-answer question on a 120-token context"))
        .unwrap_or_else(|| panic!("no question line: {stdout}"));
    assert!(
        line.ends_with("the cache saved 360 prompt tokens a question"),
        "{line}"
    );
    assert!(stdout.contains("bit for bit the same"), "{stdout}");
}
