//! Supervised fine-tuning end to end on the CPU, as a user runs it: a tiny pretraining run,
//! exported and imported as a step-0 run, then `nsactor train --sft` on conversations whose
//! prompts are partly longer than the window. Every step scores tokens (none logs a loss of
//! ~0), and the run reports at its start how many conversations did not fit.

mod common;

use common::cli::{nsactor, ok, run_ok, temp_dir};

#[test]
fn sft_from_a_pretrained_run_scores_every_step() {
    let dir = temp_dir("sft");
    let (pre, hf, run) = (dir.join("pre"), dir.join("hf"), dir.join("run"));
    ok(nsactor().args(["train", "--steps", "3", "--out"]).arg(&pre));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    run_ok(&["export", "--checkpoint", &s(&pre), "--out", &s(&hf)]);
    run_ok(&["import", "--from", &s(&hf), "--out", &s(&run)]);

    // 24 alpaca records; every third has a prompt far longer than T = 64.
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
    let alpaca = dir.join("alpaca.json");
    std::fs::write(&alpaca, serde_json::to_vec(&records).unwrap()).unwrap();

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
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("event").is_none())
        .collect();
    assert_eq!(steps.len(), 4, "{metrics}");
    for v in &steps {
        let scored = v["scored_tokens"].as_u64().unwrap();
        let loss = v["loss"].as_f64();
        assert!(scored > 0, "a step scored no token: {v}");
        assert!(
            loss.is_some_and(|l| l.is_finite() && l > 0.5),
            "a step's loss is missing or ~0: {v}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
