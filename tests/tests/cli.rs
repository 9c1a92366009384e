//! The `nsactor` command line, run as a user runs it.

use std::path::PathBuf;
use std::process::Command;

fn nsactor() -> Command {
    let exe = std::env::var_os("NSACTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // Build the binary with this test's own profile, into this test's own target directory.
            let profile_dir = std::env::current_exe()
                .unwrap()
                .parent()
                .and_then(|d| d.parent())
                .unwrap()
                .to_path_buf();
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let mut build = Command::new(env!("CARGO"));
            build
                .args(["build", "--quiet", "-p", "nsactor"])
                .current_dir(&root);
            build.env("CARGO_TARGET_DIR", profile_dir.parent().unwrap());
            if release {
                build.arg("--release");
            }
            let status = build.status().expect("cargo build runs");
            assert!(status.success(), "building nsactor failed");
            profile_dir.join("nsactor")
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
