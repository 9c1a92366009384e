//! Shared helpers: building artifacts with the test's own profile, and the golden fixtures.

#![allow(dead_code)]

pub mod cli;
pub mod served;

use std::path::PathBuf;
use std::process::Command;

/// The profile directory this test binary was built into (`target/release`).
pub fn profile_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .to_path_buf()
}

/// Builds the workspace's binaries and plugin libraries with this test's profile into this
/// test's target directory and returns where they land ([`profile_dir`]), finding everything
/// the suite's own build made, so nothing is compiled twice:
/// * it asks for the very targets the suite's `cargo test --workspace --lib --bins --tests`
///   builds, so cargo resolves the same features (a build of a few packages, `-p nsactor -p …`,
///   resolves theirs apart and compiles much of the workspace again);
/// * it runs without the variables cargo sets for a test process (`CARGO_MANIFEST_DIR`,
///   `CARGO_PKG_*`, …): `ring`'s build script reruns when `CARGO_MANIFEST_DIR` changes, and
///   with it every crate above `ring`.
///
/// Either one cost the suite eight minutes on two cores.
pub fn cargo_build() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let profile = profile_dir();
            let release = profile.file_name().is_some_and(|n| n == "release");
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let mut build = Command::new(env!("CARGO"));
            build
                .args([
                    "build",
                    "--quiet",
                    "--workspace",
                    "--lib",
                    "--bins",
                    "--tests",
                ])
                .current_dir(&root)
                .env("CARGO_TARGET_DIR", profile.parent().unwrap());
            for (name, _) in std::env::vars_os() {
                let n = name.to_string_lossy();
                if n.starts_with("CARGO_PKG_")
                    || n.starts_with("CARGO_BIN_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_CRATE_NAME",
                        "CARGO_PRIMARY_PACKAGE",
                        "CARGO_TARGET_TMPDIR",
                        "OUT_DIR",
                    ]
                    .contains(&n.as_ref())
                {
                    build.env_remove(&name);
                }
            }
            if release {
                build.arg("--release");
            }
            let status = build.status().expect("cargo build runs");
            assert!(status.success(), "building the workspace failed");
            profile
        })
        .clone()
}

/// `lib<name>.so` (platform naming) in `dir`.
pub fn library(dir: &std::path::Path, name: &str) -> PathBuf {
    dir.join(format!(
        "{}{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

/// `shared/fixtures/<name>` beside the checkout, or under `$NSACTOR_FIXTURES`. A missing
/// fixture fails the test.
pub fn fixture_bytes(name: &str) -> Vec<u8> {
    let dir = std::env::var_os("NSACTOR_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"));
    let path = dir.join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "golden fixture {} is required and could not be read: {e}",
            path.display()
        )
    })
}
