//! The CLI's plugin commands: `nsactor plugins` lists what it found and where it searched, and
//! `train --backend <plugin>` runs through a loaded plugin or says clearly why it cannot.

use super::common::cli::{nsactor, temp_dir};

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
            .filter(|l| !l.contains("\"event\""))
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
    // Options a plugin does not take are refused by the plugin itself.
    let out = nsactor()
        .args([
            "train",
            "--backend",
            "ndarray",
            "--precision",
            "bf16",
            "--steps",
            "1",
        ])
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the ndarray backend takes no options")
            && stderr.contains("precision=bf16"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
