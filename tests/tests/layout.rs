//! The house rules of docs/DESIGN.md, checked over `cargo metadata` and the sources:
//! `plugins/api` ← `kernels` ← `model` ← `backends/*`; `plugins/abi` (the C boundary) stays
//! burn-free; the actor side reaches burn only through the optional embedded-CPU backend of
//! `actors/engine`; the actor side's crates stand on floors, each using only those below it
//! (engine ← checkpoint ← pipeline ← decoding ← training ← launch, [`FLOORS`]); the server
//! (`actors/server`) sits on the decoding engine, never the reverse; nothing depends on the CLI
//! (`actors/cli`); `actors/data` is burn-free; no file outside the CLI imports its benchmarks;
//! and no two files of a crate import each other, directly or through others.

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
        "nsactor-engine",
        "nsactor-checkpoint",
        "nsactor-pipeline",
        "nsactor-decoding",
        "nsactor-training",
        "nsactor-launch",
        "nsactor-server",
        "nsactor-data",
        "nsactor-analysis",
        "nsactor-cluster",
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

    // The actor side: burn, cubecl and backends only through the optional embedded CPU backend
    // of the engine crate; every other crate above the backends: never.
    let heavy = |dep: &str| {
        dep.starts_with("burn")
            || dep.starts_with("cubecl")
            || dep.starts_with("nsactor-backend")
            || dep == "nsactor-model"
            || dep == "nsactor-kernels"
    };
    for (dep, optional) in &ws["nsactor-engine"] {
        if heavy(dep) {
            assert!(
                *optional && dep == "nsactor-backend-ndarray",
                "the engine depends on {dep} (optional: {optional})"
            );
        }
    }
    for (krate, _) in FLOORS.iter().skip(1) {
        for (dep, _) in &ws[*krate] {
            assert!(!heavy(dep), "{krate} depends on {dep}");
        }
    }
    for krate in ["nsactor-server", "nsactor", "nsactor-analysis"] {
        for (dep, _) in &ws[krate] {
            assert!(!heavy(dep), "{krate} depends on {dep}");
        }
    }
    // The analysis is a front end beside the server: it drives the decoder and draws with
    // the plots crate, and neither sees the other.
    let analysis = names(&ws["nsactor-analysis"]);
    assert!(
        analysis.contains("nsactor-decoding") && analysis.contains("nsactor-plots"),
        "the analysis drives the decoder and draws its charts: {analysis:?}"
    );
    assert!(
        !analysis.contains("nsactor-server")
            && !names(&ws["nsactor-server"]).contains("nsactor-analysis"),
        "the server and the analysis are independent"
    );

    // The picture, metrics and control-plane crates are leaves: no workspace crate, no burn
    // (the control plane carries f32 values, never tensors).
    for krate in ["nsactor-plots", "nsactor-telemetry", "nsactor-cluster"] {
        for (dep, _) in &ws[krate] {
            assert!(
                !dep.starts_with("nsactor") && !heavy(dep),
                "{krate} depends on {dep}"
            );
        }
    }

    // Upward edges: no actor-side crate sees a front end (the floors below); nothing depends on
    // the CLI.
    assert!(
        names(&ws["nsactor-server"]).contains("nsactor-decoding"),
        "the server drives the decoding engine"
    );
    for (krate, deps) in &ws {
        assert!(
            !deps.iter().any(|(d, _)| d == "nsactor"),
            "{krate} depends on the CLI crate"
        );
    }
}

/// The actor side's crates, bottom floor first, and the workspace crates each may use: those
/// on lower floors, and the leaves (the plugin contract, data, plots, telemetry, the control
/// plane). A crate never reaches a floor above its own, nor a front end.
const FLOORS: [(&str, &[&str]); 6] = [
    (
        "nsactor-engine",
        &[
            "nsactor-plugin-api",
            "nsactor-plugin-abi",
            "nsactor-model-config",
            "nsactor-data",
            "nsactor-backend-ndarray",
        ],
    ),
    (
        "nsactor-checkpoint",
        &["nsactor-engine", "nsactor-plugin-api", "nsactor-data"],
    ),
    (
        "nsactor-pipeline",
        &[
            "nsactor-engine",
            "nsactor-checkpoint",
            "nsactor-plugin-api",
            "nsactor-data",
            "nsactor-cluster",
        ],
    ),
    (
        "nsactor-decoding",
        &[
            "nsactor-engine",
            "nsactor-checkpoint",
            "nsactor-pipeline",
            "nsactor-plugin-api",
            "nsactor-data",
        ],
    ),
    (
        "nsactor-training",
        &[
            "nsactor-engine",
            "nsactor-checkpoint",
            "nsactor-pipeline",
            "nsactor-decoding",
            "nsactor-plugin-api",
            "nsactor-data",
            "nsactor-plots",
            "nsactor-telemetry",
        ],
    ),
    (
        "nsactor-launch",
        &[
            "nsactor-engine",
            "nsactor-checkpoint",
            "nsactor-pipeline",
            "nsactor-decoding",
            "nsactor-training",
            "nsactor-plugin-api",
            "nsactor-data",
            "nsactor-cluster",
            "nsactor-telemetry",
        ],
    ),
];

/// Every workspace dependency of a [`FLOORS`] crate that its floor does not allow.
fn floor_violations(ws: &BTreeMap<String, Vec<(String, bool)>>) -> Vec<String> {
    let mut bad = Vec::new();
    for (krate, allowed) in FLOORS {
        let Some(deps) = ws.get(krate) else {
            bad.push(format!("{krate} is missing"));
            continue;
        };
        for (dep, _) in deps {
            if dep.starts_with("nsactor") && !allowed.contains(&dep.as_str()) {
                bad.push(format!("{krate} depends on {dep}"));
            }
        }
    }
    bad
}

#[test]
fn the_actor_crates_stand_on_their_floors() {
    let ws = workspace_deps();
    let bad = floor_violations(&ws);
    assert!(bad.is_empty(), "edges the floors forbid: {bad:?}");
    // The rule bites: an edge up a floor, or to a front end, planted into the real graph.
    for (from, to) in [
        ("nsactor-pipeline", "nsactor-decoding"),
        ("nsactor-engine", "nsactor-checkpoint"),
        ("nsactor-decoding", "nsactor-server"),
        ("nsactor-launch", "nsactor"),
    ] {
        let mut planted = ws.clone();
        planted.get_mut(from).unwrap().push((to.to_string(), false));
        let found = floor_violations(&planted);
        assert_eq!(
            found,
            [format!("{from} depends on {to}")],
            "the planted edge {from} -> {to} went unseen"
        );
    }
}

/// The workspace's root directory.
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The library and binary crates the import rules cover: `(name, src directory)`.
const CRATES: [(&str, &str); 19] = [
    ("plugin-api", "plugins/api/src"),
    ("plugin-abi", "plugins/abi/src"),
    ("kernels", "kernels/src"),
    ("model", "model/src"),
    ("backend-core", "backends/core/src"),
    ("backend-cuda", "backends/cuda/src"),
    ("data", "actors/data/src"),
    ("engine", "actors/engine/src"),
    ("checkpoint", "actors/checkpoint/src"),
    ("pipeline", "actors/pipeline/src"),
    ("decoding", "actors/decoding/src"),
    ("training", "actors/training/src"),
    ("launch", "actors/launch/src"),
    ("server", "actors/server/src"),
    ("cli", "actors/cli/src"),
    ("plots", "actors/plots/src"),
    ("telemetry", "actors/telemetry/src"),
    ("analysis", "actors/analysis/src"),
    ("cluster", "actors/cluster/src"),
];

#[test]
fn no_file_outside_the_cli_imports_its_benchmarks() {
    // The CLI's benchmarks are a private module of the binary; the kernel benchmark suite is
    // reached only where the backends register it as `bench kernels`.
    let mut files = Vec::new();
    for (_, dir) in CRATES {
        rust_files(&root().join(dir), &mut files);
    }
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let rel = f
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel.starts_with("actors/cli/") || rel.starts_with("kernels/src/bench") {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            // The backends register the kernel benchmarks as the plugin's `bench kernels`
            // entry point (`Diagnostic::Kernels`, run in `backends/core/src/diagnose.rs`; the
            // CUDA plugin adds its GEMM bench in its `lib.rs`): the only production use allowed.
            let entry_point =
                rel == "backends/core/src/diagnose.rs" || rel == "backends/cuda/src/lib.rs";
            let bench_use = line.contains("nsactor_kernels::bench") && !entry_point;
            assert!(
                !bench_use && !line.contains("crate::bench::"),
                "{rel}:{}: production code imports benchmark code: {line}",
                i + 1
            );
        }
    }
}

/// The longest a source file may grow: a room a newcomer can read in one sitting.
const MAX_LINES: usize = 600;

#[test]
fn no_file_outgrows_a_room() {
    // Every crate's sources and tests (integration tests too); vendored upstream crates aside.
    let mut files = Vec::new();
    for dir in ["plugins", "kernels", "model", "backends", "actors", "tests"] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut long: Vec<String> = files
        .iter()
        .filter(|f| {
            let rel = f.strip_prefix(root()).unwrap();
            !rel.starts_with("kernels/vendor")
                && !rel.components().any(|c| c.as_os_str() == "target")
        })
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > MAX_LINES)
                .then(|| format!("{} ({n} lines)", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them by job): {long:?}"
    );
}

/// The module path of `file` within its crate (`src/a/b.rs` and `src/a/b/mod.rs` → `a::b`).
fn module_of(src: &std::path::Path, file: &std::path::Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The modules that `text` (the source of module `me`) names through `crate::` or `super::`
/// paths, resolved to the longest known module prefix. `mod x;` declarations are not imports.
fn imports(text: &str, me: &[String], known: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let mut found = BTreeSet::new();
    // Strip line comments and the test module (tests may use anything).
    let code: String = text
        .split("#[cfg(test)]")
        .next()
        .unwrap()
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut rest = code.as_str();
    while let Some(i) = rest.find(['c', 's']) {
        let here = &rest[i..];
        let before_ok = i == 0 || !rest[..i].ends_with(|c: char| is_ident(c) || c == ':');
        let (mut base, tail) = if before_ok && here.starts_with("crate::") {
            (Vec::new(), &here["crate::".len()..])
        } else if before_ok && here.starts_with("super::") {
            let mut b = me.to_vec();
            let mut t = here;
            while let Some(r) = t.strip_prefix("super::") {
                b.pop();
                t = r;
            }
            (b, t)
        } else {
            rest = &rest[i + 1..];
            continue;
        };
        // Follow identifiers joined by `::`; a `{` group adds each of its first names.
        let mut t = tail;
        let mut best: Option<Vec<String>> = None;
        loop {
            let end = t.find(|c: char| !is_ident(c)).unwrap_or(t.len());
            if end == 0 {
                if let Some(g) = t.strip_prefix('{') {
                    for item in g.split('}').next().unwrap().split(',') {
                        let name: String =
                            item.trim().chars().take_while(|&c| is_ident(c)).collect();
                        let mut m = base.clone();
                        m.push(name);
                        if known.contains(&m) {
                            found.insert(m);
                        }
                    }
                }
                break;
            }
            base.push(t[..end].to_string());
            if known.contains(&base) {
                best = Some(base.clone());
            }
            match t[end..].strip_prefix("::") {
                Some(r) => t = r,
                None => break,
            }
        }
        if let Some(m) = best {
            found.insert(m);
        }
        rest = &rest[i + 1..];
    }
    found.remove(me);
    found
}

#[test]
fn no_file_level_import_cycles() {
    let mut cycles = Vec::new();
    for (krate, dir) in CRATES {
        let src = root().join(dir);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let modules: BTreeMap<Vec<String>, std::path::PathBuf> = files
            .iter()
            .map(|f| (module_of(&src, f), f.clone()))
            .collect();
        let known: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
        let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (m, f) in &modules {
            let text = std::fs::read_to_string(f).unwrap();
            // A parent naming its own descendants (`mod x; pub use x::Y;`) is no back edge.
            let out = imports(&text, m, &known)
                .into_iter()
                .filter(|t| !t.starts_with(m))
                .collect();
            edges.insert(m.clone(), out);
        }
        // Depth-first search for a back edge.
        fn visit(
            m: &Vec<String>,
            edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
            state: &mut BTreeMap<Vec<String>, u8>,
            stack: &mut Vec<Vec<String>>,
            cycles: &mut Vec<String>,
            krate: &str,
        ) {
            state.insert(m.clone(), 1);
            stack.push(m.clone());
            for t in &edges[m] {
                match state.get(t).copied().unwrap_or(0) {
                    0 => visit(t, edges, state, stack, cycles, krate),
                    1 => {
                        let at = stack.iter().position(|s| s == t).unwrap();
                        let names: Vec<String> = stack[at..]
                            .iter()
                            .chain(std::iter::once(t))
                            .map(|s| format!("{krate}::{}", s.join("::")))
                            .collect();
                        cycles.push(names.join(" → "));
                    }
                    _ => {}
                }
            }
            stack.pop();
            state.insert(m.clone(), 2);
        }
        let mut state = BTreeMap::new();
        for m in modules.keys() {
            if !state.contains_key(m) {
                visit(m, &edges, &mut state, &mut Vec::new(), &mut cycles, krate);
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "files that import each other:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    // The check must be able to fail: two modules naming each other are found.
    let known: BTreeSet<Vec<String>> = [vec!["a".to_string()], vec!["b".to_string()]]
        .into_iter()
        .collect();
    let a = imports("use crate::b::Thing;", &["a".to_string()], &known);
    let b = imports("fn f() { super::a::g(); }", &["b".to_string()], &known);
    assert!(a.contains(&vec!["b".to_string()]));
    assert!(b.contains(&vec!["a".to_string()]));
    let grouped = imports("use crate::{a, b::X};", &["c".to_string()], &known);
    assert_eq!(grouped.len(), 2, "{grouped:?}");
}
