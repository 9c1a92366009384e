//! `nsactor analyze` as a user runs it: on a tiny run trained here, on that run exported as a
//! Hugging Face directory (and its `v_post` variant), with JSONL categories, and with bad
//! input.

mod common;

use common::cli::{nsactor, ok, run_ok, run_refused, run_stdout, temp_dir};
use serde_json::Value;
use std::path::Path;

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn analyze(checkpoint: &Path, out: &Path, extra: &[&str]) -> (String, Value) {
    let mut args = vec![
        "analyze",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let stdout = run_stdout(&args);
    (stdout, read_json(&out.join("analysis.json")))
}

/// Every check a study of a `layers × D × N`, K-frame model must pass.
fn check_study(a: &Value, k: f64) {
    let layers = a["model"]["layers"].as_u64().unwrap() as usize;
    let dn = a["model"]["d"].as_f64().unwrap() * a["model"]["n"].as_f64().unwrap();
    let sentences = a["per_token"].as_array().unwrap();
    assert_eq!(a["sentences"].as_u64().unwrap() as usize, sentences.len());
    let mut tokens = 0;
    for s in sentences {
        let ts = s["tokens"].as_array().unwrap();
        assert_eq!(ts[0]["category"], "bos", "every sentence starts with BOS");
        assert!(
            ts[ts.len() - 1]["surprisal"].is_null(),
            "the last token has no next"
        );
        for t in ts {
            tokens += 1;
            for key in ["expected_k", "block", "ffn"] {
                let e = t[key].as_f64().unwrap();
                assert!((1.0..=k).contains(&e), "{key} {e} outside [1, {k}]: {t}");
            }
        }
    }
    assert_eq!(a["tokens"].as_u64().unwrap() as usize, tokens);
    let per_layer = a["expected_k"]["per_layer"].as_array().unwrap();
    assert_eq!(per_layer.len(), layers);
    for l in per_layer {
        for sub in ["block", "ffn"] {
            let (lo, hi) = (
                l[sub]["min"].as_f64().unwrap(),
                l[sub]["max"].as_f64().unwrap(),
            );
            assert!(1.0 <= lo && hi <= k, "layer E[K] {lo} … {hi}");
        }
    }
    let cats = a["expected_k"]["by_category"].as_object().unwrap();
    let counted: u64 = cats.values().map(|c| c["count"].as_u64().unwrap()).sum();
    assert_eq!(counted as usize, tokens, "every token has one category");
    assert_eq!(
        cats["bos"]["count"].as_u64().unwrap() as usize,
        sentences.len()
    );
    let pairs = a["surprisal"]["pairs"].as_u64().unwrap() as usize;
    assert_eq!(pairs, tokens - sentences.len());
    assert!(a["surprisal"]["r_with_bos"].as_f64().unwrap().abs() <= 1.0);
    let beta = &a["beta"];
    for split in ["hidden_static", "hidden_over_data"] {
        let s = &beta[split];
        let pct = s["fast_percent"].as_f64().unwrap() + s["slow_percent"].as_f64().unwrap();
        assert!((pct - 100.0).abs() < 1e-9, "{split}: {pct}%");
        let hist: f64 = s["histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .sum();
        assert_eq!(hist, s["count"].as_f64().unwrap(), "{split}");
    }
    assert_eq!(
        beta["hidden_static"]["count"].as_f64().unwrap(),
        layers as f64 * dn
    );
    // β(t) of every hidden neuron at every frame of every token, in every layer.
    let frames = tokens as f64 * k;
    let data = beta["hidden_over_data"]["count"].as_f64().unwrap();
    assert!(
        (data - frames * dn * layers as f64).abs() <= 1e-6 * data,
        "β(t) values {data}, frames × D·N × layers {}",
        frames * dn * layers as f64
    );
    for n in ["input1", "input2", "ffn_gate", "ffn_up", "output"] {
        assert!(
            beta["row_neurons"][n]["count"].as_f64().unwrap() > 0.0,
            "{n}"
        );
    }
}

fn check_charts(dir: &Path) {
    for name in [
        "ek_tokens.png",
        "ek_categories.png",
        "ek_layers.png",
        "beta.png",
        "surprisal_ek.png",
    ] {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        let (w, h, rgb) = nsactor_plots::decode_png(&bytes).unwrap_or_else(|| panic!("{name}"));
        assert!(w >= 900 && h >= 500, "{name}: {w}×{h}");
        let coloured = rgb.chunks(3).filter(|p| p.iter().any(|&c| c < 200)).count();
        assert!(
            coloured > 2000,
            "{name}: something is drawn ({coloured} pixels)"
        );
    }
}

#[test]
fn analyze_a_trained_tiny_run_its_hugging_face_export_and_bad_input() {
    let dir = temp_dir("analyze");
    let run = dir.join("run");
    run_ok(&["train", "--steps", "30", "--out", run.to_str().unwrap()]);
    let out = dir.join("study");
    let (stdout, a) = analyze(&run, &out, &[]);
    for line in [
        "E[K] per token",
        "E[K] by category",
        "surprisal vs E[K]",
        "hidden neurons",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    assert_eq!(a["sentences"], 40, "the bundled set");
    let groups = a["expected_k"]["by_group"].as_object().unwrap();
    assert_eq!(groups["en"]["sentences"], 20);
    assert_eq!(groups["zh"]["sentences"], 20);
    let k = a["model"]["k"].as_f64().unwrap();
    check_study(&a, k);
    check_charts(&out);

    // The same weights as a Hugging Face directory give the same numbers.
    let hf = dir.join("hf");
    run_ok(&[
        "export",
        "--checkpoint",
        run.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]);
    let (_, from_hf) = analyze(&hf, &dir.join("study-hf"), &[]);
    assert_eq!(from_hf["per_token"], a["per_token"]);
    assert_eq!(from_hf["beta"], a["beta"]);
    // The released model's variant (V_post out of the row neurons): other numbers, same checks.
    let config = hf.join("config.json");
    let mut c = read_json(&config);
    c["nsactor_plif_out"] = "v_post".into();
    std::fs::write(&config, c.to_string()).unwrap();
    let (_, v_post) = analyze(&hf, &dir.join("study-vpost"), &[]);
    assert_eq!(v_post["model"]["plif_out"], "v_post");
    assert_ne!(v_post["per_token"], a["per_token"]);
    check_study(&v_post, k);

    // JSONL with categories: E[K] and surprisal per category.
    let q = dir.join("q.jsonl");
    std::fs::write(
        &q,
        "{\"text\": \"What is two plus two?\", \"category\": \"arithmetic\"}\n\
         {\"text\": \"Why is the sky blue?\", \"category\": \"commonsense\"}\n\
         {\"text\": \"Tell me about your day.\", \"category\": \"coherence\"}\n",
    )
    .unwrap();
    let (_, by_q) = analyze(
        &run,
        &dir.join("study-q"),
        &["--jsonl", q.to_str().unwrap()],
    );
    let groups = by_q["expected_k"]["by_group"].as_object().unwrap();
    assert_eq!(groups.len(), 3);
    assert!(groups["arithmetic"]["surprisal"]["mean"].as_f64().unwrap() > 0.0);
    check_study(&by_q, k);

    // Bad input, refused (78): a malformed line, an empty file, a missing file, no checkpoint.
    std::fs::write(&q, "{\"text\": \"fine\"}\nnot json\n").unwrap();
    let e = run_refused(&[
        "analyze",
        "--checkpoint",
        run.to_str().unwrap(),
        "--jsonl",
        q.to_str().unwrap(),
        "--out",
        dir.join("x").to_str().unwrap(),
    ]);
    assert!(e.contains("q.jsonl:2"), "{e}");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let e = run_refused(&[
        "analyze",
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        empty.to_str().unwrap(),
        "--out",
        dir.join("x").to_str().unwrap(),
    ]);
    assert!(e.contains("no sentence"), "{e}");
    let e = run_refused(&[
        "analyze",
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        dir.join("absent.txt").to_str().unwrap(),
        "--out",
        dir.join("x").to_str().unwrap(),
    ]);
    assert!(e.contains("absent.txt"), "{e}");
    let e = run_refused(&[
        "analyze",
        "--checkpoint",
        dir.join("nothing").to_str().unwrap(),
        "--out",
        dir.join("x").to_str().unwrap(),
    ]);
    assert!(e.contains("no valid checkpoint"), "{e}");
}

/// Apart from the trained run's test, so the two run side by side.
#[test]
fn analyze_at_initialisation_gives_every_token_the_geometric_expectation() {
    // At initialisation (one step at LR 0 changes nothing) every halt unit sits near its bias,
    // p = σ(−3.5) at every frame, so every token's E[K] is the geometric expectation
    // Σ k·p(1−p)^(k−1) / Σ p(1−p)^(k−1) over the K frames (SPEC §2.3: 7.870 at K = 16).
    let dir = temp_dir("analyze-init");
    let init = dir.join("init");
    let mut c = nsactor();
    c.env("NSACTOR_TRAIN__LR", "0")
        .env("NSACTOR_TRAIN__CHECKPOINT_EVERY", "1")
        .args(["train", "--steps", "1", "--out", init.to_str().unwrap()]);
    ok(&mut c);
    let (_, at_init) = analyze(&init, &dir.join("study-init"), &[]);
    let k = at_init["model"]["k"].as_f64().unwrap();
    let p = 1.0 / (1.0 + 3.5f64.exp());
    let lambda: Vec<f64> = (0..k as i32).map(|i| p * (1.0 - p).powi(i)).collect();
    let want: f64 = lambda
        .iter()
        .enumerate()
        .map(|(i, l)| (i + 1) as f64 * l)
        .sum::<f64>()
        / lambda.iter().sum::<f64>();
    for s in at_init["per_token"].as_array().unwrap() {
        for t in s["tokens"].as_array().unwrap() {
            let e = t["expected_k"].as_f64().unwrap();
            assert!(
                (e - want).abs() < 0.01,
                "E[K] {e} at init, want {want:.4}: {t}"
            );
        }
    }
}
