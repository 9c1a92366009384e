//! Supervised fine-tuning end to end on the CPU, as a user runs it: a tiny pretraining run,
//! exported and imported as a step-0 run, then `nsactor train --sft` on conversations whose
//! prompts are partly longer than the window. Every step scores tokens (none logs a loss of
//! ~0), and the run reports at its start how many conversations did not fit. A second run
//! starts from the pretrained weights with `--init-from`, evaluates a held-out set every two
//! steps, draws `loss.png` and serves its live metrics on `--metrics-addr`.

mod common;

use common::cli::{nsactor, ok, refused, run_ok, temp_dir};
use std::io::{BufRead, Read, Write};
use std::path::Path;

/// 24 alpaca records; every third has a prompt far longer than T = 64.
fn alpaca(dir: &Path) -> std::path::PathBuf {
    let records: Vec<serde_json::Value> = (0..24)
        .map(|i| {
            let words = if i % 3 == 0 { 80 } else { 3 };
            let prompt: Vec<String> = (0..words).map(|w| format!("w{w}")).collect();
            serde_json::json!({
                "instruction": prompt.join(" "),
                "input": "",
                "output": format!("Answer {i}."),
            })
        })
        .collect();
    let path = dir.join("alpaca.json");
    std::fs::write(&path, serde_json::to_vec(&records).unwrap()).unwrap();
    path
}

/// The lines of a run's `metrics.jsonl`: (steps, events).
fn metrics(run: &Path) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .partition(|v| v.get("event").is_none())
}

#[test]
fn sft_from_a_pretrained_run_scores_every_step() {
    let dir = temp_dir("sft");
    let (pre, hf, run) = (dir.join("pre"), dir.join("hf"), dir.join("run"));
    ok(nsactor().args(["train", "--steps", "3", "--out"]).arg(&pre));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    run_ok(&["export", "--checkpoint", &s(&pre), "--out", &s(&hf)]);
    run_ok(&["import", "--from", &s(&hf), "--out", &s(&run)]);

    let alpaca = alpaca(&dir);

    let out = ok(nsactor()
        .args(["train", "--sft", "--steps", "4", "--resume", "--corpus"])
        .arg(&alpaca)
        .arg("--config")
        .arg(run.join("config.toml")));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("8 of 24 conversations have no scored token at T = 64")
            && stderr.contains("8 kept by truncating their prompt from the left"),
        "no report of the conversations that did not fit: {stderr}"
    );
    let (steps, _) = metrics(&run);
    assert_eq!(steps.len(), 4, "{steps:?}");
    for v in &steps {
        let scored = v["scored_tokens"].as_u64().unwrap();
        let loss = v["loss"].as_f64();
        assert!(scored > 0, "a step scored no token: {v}");
        assert!(
            loss.is_some_and(|l| l.is_finite() && l > 0.5),
            "a step's loss is missing or ~0: {v}"
        );
    }
    // Damaged Hugging Face weights are refused (78: no restart would mend them): a truncated
    // file naming it, weights of other shapes than its config.json's naming the directory.
    let damaged = |name: &str, spoil: &dyn Fn(&Path)| {
        let bad = dir.join(name);
        std::fs::create_dir_all(&bad).unwrap();
        for f in std::fs::read_dir(&hf).unwrap().flatten() {
            std::fs::copy(f.path(), bad.join(f.file_name())).unwrap();
        }
        spoil(&bad);
        let stderr = refused(
            nsactor()
                .args(["train", "--steps", "1", "--init-from"])
                .arg(&bad)
                .arg("--out")
                .arg(dir.join(format!("{name}-run"))),
        );
        (bad, stderr)
    };
    let (bad, err) = damaged("truncated", &|d| {
        let f = std::fs::File::options()
            .write(true)
            .open(d.join("model.safetensors"))
            .unwrap();
        f.set_len(f.metadata().unwrap().len() / 2).unwrap();
    });
    let file = bad.join("model.safetensors");
    assert!(
        err.contains(&format!("{}: not a whole safetensors file", file.display())),
        "{err}"
    );
    let (bad, err) = damaged("misshapen", &|d| {
        let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
        assert!(cfg.contains("\"D_ff\": 192"), "{cfg}");
        let cfg = cfg.replace("\"D_ff\": 192", "\"D_ff\": 256");
        std::fs::write(d.join("config.json"), cfg).unwrap();
    });
    assert!(
        err.contains(&format!("the weights in {} do not load", bad.display()))
            && err.contains("has shape [192, 64], the model expects [256, 64]"),
        "{err}"
    );
    // A NaN weight (a diverged run's, a flipped bit's) is refused naming the tensor, not
    // trained from into NaN losses.
    let (bad, err) = damaged("nan", &|d| {
        let path = d.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let (name, t) = header
            .as_object()
            .unwrap()
            .iter()
            .find(|(k, _)| k.starts_with("model."))
            .unwrap();
        assert_eq!(t["dtype"], "F32", "{name}: {t}");
        let at = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize + 4;
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(&path, bytes).unwrap();
        NAN_TENSOR.set(name.clone()).unwrap();
    });
    let name = NAN_TENSOR.get().unwrap();
    assert!(
        err.contains(&format!("the weights in {} do not load", bad.display()))
            && err.contains(&format!("`{name}` holds NaN at index 1 (of")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tensor the NaN case spoils (set inside its `Fn` closure).
static NAN_TENSOR: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// GET `path` on `addr`; the body.
fn get(addr: &str, path: &str) -> Option<String> {
    let mut c = std::net::TcpStream::connect(addr).ok()?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    c.read_to_string(&mut out).ok()?;
    Some(out[out.find("\r\n\r\n")? + 4..].to_string())
}

#[test]
fn sft_from_init_weights_evaluates_held_out_rows_plots_and_serves_metrics() {
    let dir = temp_dir("sft-init");
    let (pre, run, fresh) = (dir.join("pre"), dir.join("run"), dir.join("fresh"));
    ok(nsactor().args(["train", "--steps", "3", "--out"]).arg(&pre));
    let alpaca = alpaca(&dir);
    let sft = |out: &Path| {
        let mut c = nsactor();
        c.args([
            "train",
            "--sft",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--corpus",
        ])
        .arg(&alpaca)
        .arg("--out")
        .arg(out)
        .env("NSACTOR_TRAIN__EVAL_BATCHES", "1");
        c
    };
    // From the pretrained weights, with the live metrics on a free port (read from the log).
    let mut child = sft(&run)
        .arg("--init-from")
        .arg(&pre)
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut log = String::new();
    let addr = loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "no metrics address in {log}"
        );
        log.push_str(&line);
        if let Some(rest) = line.split("metrics on http://").nth(1) {
            break rest.split("/metrics").next().unwrap().to_string();
        }
    };
    // Scrape while it trains until a step shows (the log is drained in the background).
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        stderr.read_to_string(&mut rest).unwrap();
        rest
    });
    let mut scraped = None;
    while scraped.is_none() && child.try_wait().unwrap().is_none() {
        scraped = get(&addr, "/metrics").filter(|m| {
            m.lines()
                .any(|l| l.starts_with("nsactor_train_step ") && !l.ends_with(" 0"))
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        child.wait().unwrap().success(),
        "{log}{}",
        drain.join().unwrap()
    );
    log.push_str(&drain.join().unwrap());
    let scraped = scraped.unwrap_or_else(|| panic!("no step was scraped: {log}"));
    for name in [
        "nsactor_train_loss",
        "nsactor_train_tokens_total",
        "nsactor_train_expected_k",
    ] {
        assert!(
            scraped.contains(&format!("# TYPE {name} ")),
            "{name} in {scraped}"
        );
    }
    assert!(log.contains("initialised from"), "{log}");
    assert!(
        log.contains("4 of 24 rows held out for evaluation every 2 steps"),
        "{log}"
    );
    let (steps, events) = metrics(&run);
    assert_eq!(steps.len(), 4);
    let evals: Vec<_> = events.iter().filter(|e| e["event"] == "eval").collect();
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 2, 4]
    );
    for e in &evals {
        assert!(e["eval_tokens"].as_u64().unwrap() > 0, "{e}");
        assert!(
            e["eval_loss"]
                .as_f64()
                .is_some_and(|l| l.is_finite() && l > 0.5),
            "{e}"
        );
    }
    assert!(log.contains("held-out CE"), "{log}");
    // After the last step the final checkpoint is started (and its stages read back) before
    // the last evaluation, which runs beside its disk writes.
    let at = |pred: &dyn Fn(&serde_json::Value) -> bool| {
        events
            .iter()
            .position(pred)
            .unwrap_or_else(|| panic!("{events:?}"))
    };
    let last_eval = at(&|e| e["event"] == "eval" && e["step"] == 4);
    let final_ckpt = at(&|e| e["event"] == "checkpoint" && e["final"] == true);
    assert!(final_ckpt < last_eval, "{events:?}");
    // loss.png: a PNG of 960 × 900 (its IHDR).
    let png = std::fs::read(run.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), 960);
    assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), 900);

    // The same run from scratch starts from other weights: its first loss differs. A fresh
    // model is not evaluated before its first step (`eval_at_start` unset), unless asked.
    ok(&mut sft(&fresh));
    let first = |r: &Path| metrics(r).0[0]["loss"].as_f64().unwrap();
    assert_ne!(first(&run), first(&fresh), "--init-from loaded no weights");
    let eval_steps = |r: &Path| {
        metrics(r)
            .1
            .iter()
            .filter(|e| e["event"] == "eval")
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(eval_steps(&fresh), [2, 4]);
    let asked = dir.join("asked");
    ok(sft(&asked).env("NSACTOR_TRAIN__EVAL_AT_START", "true"));
    assert_eq!(eval_steps(&asked), [0, 2, 4]);
    std::fs::remove_dir_all(&dir).unwrap();
}
