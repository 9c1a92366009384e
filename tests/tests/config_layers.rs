//! The run configuration's layers as a user meets them: `nsactor config show` prints the merged
//! configuration, `NSACTOR_TABLE__KEY` variables replace the file's keys (a training run
//! takes its step count from one), and a variable naming no key fails with the key's path.

mod common;

use common::cli::{losses, nsactor, ok, temp_dir};

/// `nsactor config show` with the environment `vars`: (success, stdout, stderr).
fn show(vars: &[(&str, &str)], extra: &[&str]) -> (bool, String, String) {
    let mut c = nsactor();
    c.args(["config", "show"]).args(extra);
    for (k, v) in vars {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value of `key` in `table` of the TOML `text`.
fn value(text: &str, table: &str, key: &str) -> toml::Value {
    let doc: toml::Table = toml::from_str(text).unwrap();
    doc[table][key].clone()
}

#[test]
fn config_show_prints_the_file_under_the_environment() {
    let (ok, plain, err) = show(&[], &[]);
    assert!(ok, "config show failed: {err}");
    assert_eq!(value(&plain, "train", "steps").as_integer(), Some(300));
    assert!(plain.contains("configs/tiny.toml"), "{plain}");

    let vars = [
        ("NSACTOR_TRAIN__STEPS", "5"),
        ("NSACTOR_TRAIN__LR", "0.0005"),
        ("NSACTOR_BACKEND__PRECISION", "fp32"),
        // The process's own settings (one name, no `__`) are not configuration keys.
        ("NSACTOR_PLUGIN_PATH", "/nonexistent"),
    ];
    let (ok, layered, err) = show(&vars, &[]);
    assert!(ok, "config show failed: {err}");
    assert_eq!(value(&layered, "train", "steps").as_integer(), Some(5));
    assert_eq!(value(&layered, "train", "lr").as_float(), Some(0.0005));
    assert_eq!(
        value(&layered, "backend", "precision").as_str(),
        Some("fp32")
    );
    assert!(layered.contains("$NSACTOR_TRAIN__STEPS"), "{layered}");
    // Everything else is the file's.
    assert_eq!(value(&layered, "model", "D"), value(&plain, "model", "D"));
    assert_eq!(
        value(&layered, "train", "batch_size"),
        value(&plain, "train", "batch_size")
    );
}

#[test]
fn a_variable_naming_no_key_fails_with_its_path() {
    let (ok, _, err) = show(&[("NSACTOR_TRAIN__LEARNING_RATE", "1")], &[]);
    assert!(!ok, "an unknown key was accepted");
    assert!(
        err.contains("learning_rate") && err.contains("train"),
        "the error does not name the key's path: {err}"
    );
    assert!(err.contains("$NSACTOR_TRAIN__LEARNING_RATE"), "{err}");
    let (ok, _, err) = show(&[("NSACTOR_TRAIN__STEPS", "0")], &[]);
    assert!(!ok && err.contains("`steps` must be positive"), "{err}");
    let (ok, _, err) = show(&[("NSACTOR_SERVE__ADDR", "x")], &[]);
    assert!(!ok && err.contains("serve"), "{err}");
}

#[test]
fn nsactor_train_takes_its_steps_from_the_environment() {
    let dir = temp_dir("env-steps");
    ok(nsactor()
        .env("NSACTOR_TRAIN__STEPS", "5")
        .args(["train", "--out"])
        .arg(&dir));
    let steps: Vec<u64> = losses(&dir).into_iter().map(|(step, _)| step).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    // The manifest stores the merged configuration.
    let stored = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert_eq!(value(&stored, "train", "steps").as_integer(), Some(5));
}
