//! The dependency direction of DESIGN.md, checked over `cargo metadata`:
//! `plugins/api` ← `kernels` ← `model` ← `backends/*`; `plugins/abi` (the C boundary) stays
//! burn-free; `actors` reaches burn only through the optional embedded-CPU backend; `actors/data`
//! is burn-free.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

fn metadata() -> Value {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("metadata is JSON")
}

/// Workspace crate → its direct normal dependencies `(name, optional)`.
fn workspace_deps() -> BTreeMap<String, Vec<(String, bool)>> {
    let meta = metadata();
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| members.contains(p["id"].as_str().unwrap()))
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| {
                    (
                        d["name"].as_str().unwrap().to_string(),
                        d["optional"].as_bool().unwrap_or(false),
                    )
                })
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

fn names(deps: &[(String, bool)]) -> BTreeSet<&str> {
    deps.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn dependency_direction_follows_the_design() {
    let ws = workspace_deps();
    for krate in [
        "nsactor-plugin-api",
        "nsactor-kernels",
        "nsactor-model",
        "nsactor-backend-core",
        "nsactor-backend-ndarray",
        "nsactor-backend-cuda",
        "nsactor-plugin-abi",
        "nsactor",
        "nsactor-data",
        "nsactor-tests",
    ] {
        assert!(ws.contains_key(krate), "workspace crate {krate} is missing");
    }
    let api = names(&ws["nsactor-plugin-api"]);
    assert!(
        api.is_empty(),
        "plugins/api must be burn-free and dependency-free, has {api:?}"
    );

    let kernels = names(&ws["nsactor-kernels"]);
    assert!(
        !kernels.contains("nsactor-model")
            && !kernels.iter().any(|d| d.starts_with("nsactor-backend")),
        "kernels depends upward: {kernels:?}"
    );

    let model = names(&ws["nsactor-model"]);
    assert!(model.contains("nsactor-kernels"), "model uses the kernels");
    assert!(
        !model.iter().any(|d| d.starts_with("nsactor-backend")
            || *d == "nsactor"
            || *d == "nsactor-plugin-abi"),
        "model depends on the runtime side: {model:?}"
    );

    // The C ABI crate is burn-free: it carries the api types across, nothing else.
    let abi = names(&ws["nsactor-plugin-abi"]);
    assert!(
        !abi.iter().any(|d| d.starts_with("burn")
            || d.starts_with("cubecl")
            || d.starts_with("nsactor-backend")
            || *d == "nsactor-model"),
        "plugins/abi must stay burn-free: {abi:?}"
    );

    // Backends sit on the model and never on the runtime.
    for b in [
        "nsactor-backend-core",
        "nsactor-backend-ndarray",
        "nsactor-backend-cuda",
    ] {
        assert!(
            !ws[b].iter().any(|(d, _)| d == "nsactor"),
            "{b} depends on the runtime"
        );
    }

    // The data pipeline is burn-free: of the workspace it may use the engine contract only.
    for (dep, _) in &ws["nsactor-data"] {
        assert!(
            !dep.starts_with("burn") && !dep.starts_with("cubecl"),
            "nsactor-data depends on {dep}"
        );
        assert!(
            !dep.starts_with("nsactor") || dep == "nsactor-plugin-api",
            "nsactor-data depends on the workspace crate {dep}"
        );
    }

    // actors: burn, cubecl and backends only through the optional embedded CPU backend.
    for (dep, optional) in &ws["nsactor"] {
        let heavy = dep.starts_with("burn")
            || dep.starts_with("cubecl")
            || dep.starts_with("nsactor-backend")
            || dep == "nsactor-model"
            || dep == "nsactor-kernels";
        if heavy {
            assert!(
                *optional && dep == "nsactor-backend-ndarray",
                "actors depends on {dep} (optional: {optional})"
            );
        }
    }
}
