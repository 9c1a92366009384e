//! docs/CONFIG.md cannot go stale. Every `NSACTOR_*` environment variable named in the
//! workspace's Rust sources (`plugins`, `kernels` without its vendored crates, `model`,
//! `backends`, `actors`, `tests`) is documented there, and every `NSACTOR_*` name the page
//! documents still occurs in some source, so a removed variable leaves the page too. Every
//! `CUBECL_*` variable the page documents (our patches to the vendored CubeCL) is still read
//! there. Every key of the run config's serde structs (`RunConfig`'s tables, `TrainConfig`,
//! `DataConfig`, `BackendConfig` in `actors/engine/src/config.rs`, `ModelToml` (the form of `ModelConfig`) in
//! `model/config/src/lib.rs`, serde renames applied) has a row in its table's section, and every
//! row's key is a field of that struct. Every file a variable's row says it is read in exists
//! and names it. Names are extracted with the small scanners below, which a test of their own
//! proves can see what they must.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace's root directory.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

fn config_md() -> String {
    read("docs/CONFIG.md")
}

/// Directories whose `.rs` files may read environment variables.
const SOURCE_DIRS: [&str; 6] = ["plugins", "kernels", "model", "backends", "actors", "tests"];

/// Skipped: vendored upstream crates (their variables are upstream's) and build outputs.
const SKIP_DIRS: [&str; 1] = ["kernels/vendor"];

/// This file names variables only to test the scanner; it is no source of them.
const THIS_FILE: &str = "tests/tests/config_docs.rs";

/// Names built at run time from a prefix (e.g. `format!("NSACTOR_{x}")` or a constant prefix
/// joined with a suffix): `(prefix as it appears in the source, every full name it makes)`.
/// None today: every variable is spelled out in full where it is read. A source that starts
/// building names from a prefix fails `every_env_var_is_documented_and_every_documented_one_exists`
/// until the names it makes are listed here.
const DYNAMIC: &[(&str, &[&str])] = &[];

/// Every `.rs` file under `dir`, skipping `target` directories and [`SKIP_DIRS`].
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let rel = p
            .strip_prefix(root())
            .unwrap_or(&p)
            .to_string_lossy()
            .into_owned();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") || SKIP_DIRS.contains(&rel.as_str()) {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") && rel != THIS_FILE {
            out.push(p);
        }
    }
}

/// Whether `name` is a configuration key's variable (`NSACTOR_TRAIN__STEPS`): a double
/// underscore between the table and the key.
fn is_config_layer(name: &str) -> bool {
    name.strip_prefix("NSACTOR_")
        .is_some_and(|rest| rest.contains("__"))
}

/// What a scan of a text finds for one prefix.
#[derive(Debug, Default, PartialEq)]
struct Found {
    /// Whole names: the prefix and at least one more `[A-Z0-9_]`, not ending in `_`.
    names: BTreeSet<String>,
    /// Names ending in `_` not followed by `*`: the start of a name built at run time.
    prefixes: BTreeSet<String>,
}

/// Finds `prefix[A-Z0-9_]*` where the prefix does not continue an identifier (so
/// `__NSACTOR_TABLE`, a static's name, is not a variable). A name ending in `_` followed by `*`
/// is a wildcard mention in prose (`NSACTOR_STAGE_*`) and is ignored.
fn scan(text: &str, prefix: &str) -> Found {
    let bytes = text.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut found = Found::default();
    let mut from = 0;
    while let Some(i) = text[from..].find(prefix).map(|i| from + i) {
        from = i + prefix.len();
        if i > 0 && is_ident(bytes[i - 1]) {
            continue;
        }
        let mut end = from;
        while end < bytes.len()
            && (bytes[end].is_ascii_uppercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        // A lower-case letter right after means this is part of some other identifier.
        if end < bytes.len() && (bytes[end].is_ascii_lowercase()) {
            continue;
        }
        let name = &text[i..end];
        if name.ends_with('_') {
            if bytes.get(end) != Some(&b'*') {
                found.prefixes.insert(name.to_string());
            }
        } else {
            found.names.insert(name.to_string());
        }
        from = end;
    }
    found
}

/// `NSACTOR_*` names of the sources: name → files naming it; and prefixes → files.
fn source_names() -> (BTreeMap<String, Vec<String>>, BTreeMap<String, Vec<String>>) {
    let mut files = Vec::new();
    for d in SOURCE_DIRS {
        rust_files(&root().join(d), &mut files);
    }
    assert!(
        files.len() > 50,
        "found only {} source files under {SOURCE_DIRS:?}; is the walk broken?",
        files.len()
    );
    let (mut names, mut prefixes) = (BTreeMap::new(), BTreeMap::new());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let rel = f
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let found = scan(&text, "NSACTOR_");
        for n in found.names {
            names.entry(n).or_insert_with(Vec::new).push(rel.clone());
        }
        for p in found.prefixes {
            prefixes.entry(p).or_insert_with(Vec::new).push(rel.clone());
        }
    }
    (names, prefixes)
}

#[test]
fn every_env_var_is_documented_and_every_documented_one_exists() {
    let (mut in_sources, prefixes) = source_names();
    let mut problems = Vec::new();
    for (prefix, files) in &prefixes {
        match DYNAMIC.iter().find(|(p, _)| p == prefix) {
            Some((_, made)) => {
                for n in *made {
                    in_sources
                        .entry(n.to_string())
                        .or_default()
                        .extend(files.clone());
                }
            }
            None => problems.push(format!(
                "`{prefix}` in {} starts a name built at run time: list the names it makes in \
                 DYNAMIC (tests/tests/config_docs.rs) and document them",
                files.join(", ")
            )),
        }
    }
    let mut doc = scan(&config_md(), "NSACTOR_");
    // `NSACTOR_TABLE__KEY` names are the configuration's environment layer: one per config
    // key, documented as a rule with the keys' tables, not one by one.
    in_sources.retain(|name, _| !is_config_layer(name));
    doc.names.retain(|name| !is_config_layer(name));
    assert!(
        config_md().contains("NSACTOR_TRAIN__STEPS"),
        "docs/CONFIG.md does not show the environment layer (`NSACTOR_TRAIN__STEPS=5`)"
    );
    for (name, files) in &in_sources {
        if !doc.names.contains(name) {
            problems.push(format!(
                "{name} (read in {}) is not documented in docs/CONFIG.md",
                files.join(", ")
            ));
        }
    }
    for name in &doc.names {
        if !in_sources.contains_key(name) {
            problems.push(format!(
                "docs/CONFIG.md documents {name}, which no source under {SOURCE_DIRS:?} names: \
                 remove it from the page"
            ));
        }
    }
    for p in &doc.prefixes {
        problems.push(format!(
            "docs/CONFIG.md names `{p}`, which is not a whole variable name: spell the names out"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn documented_cubecl_variables_exist_in_the_vendored_crates() {
    // Upstream CubeCL reads many variables of its own; the page documents the ones our patches
    // add, and each must still be read there.
    let doc = scan(&config_md(), "CUBECL_");
    assert!(
        doc.names.contains("CUBECL_SERVER_HOT_US"),
        "docs/CONFIG.md should document CUBECL_SERVER_HOT_US, the vendored cubecl-common's \
         hot window (or this test should drop it once the patch is gone)"
    );
    let mut files = Vec::new();
    for d in SKIP_DIRS {
        let mut here = Vec::new();
        collect_all_rs(&root().join(d), &mut here);
        files.extend(here);
    }
    let mut vendored = BTreeSet::new();
    for f in files {
        vendored.extend(scan(&std::fs::read_to_string(f).unwrap(), "CUBECL_").names);
    }
    let missing: Vec<&String> = doc
        .names
        .iter()
        .filter(|n| !vendored.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/CONFIG.md documents {missing:?}, which no vendored crate under {SKIP_DIRS:?} reads"
    );
}

/// A row of an environment-variable table: the variable of its first cell and the backticked
/// `.rs` paths of its last cell ("read in"); `None` for any other line.
fn read_in(line: &str) -> Option<(String, Vec<String>)> {
    let first = line.strip_prefix("| `")?.split('`').next()?;
    if !(first.starts_with("NSACTOR_") || first.starts_with("CUBECL_")) {
        return None;
    }
    let last = line.trim_end().trim_end_matches('|').rsplit('|').next()?;
    let paths = last
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|p| p.ends_with(".rs"))
        .map(str::to_string)
        .collect();
    Some((first.to_string(), paths))
}

#[test]
fn every_read_in_file_exists_and_names_its_variable() {
    let doc = config_md();
    let mut rows = 0;
    let mut problems = Vec::new();
    for line in doc.lines() {
        let Some((name, paths)) = read_in(line) else {
            continue;
        };
        rows += 1;
        if paths.is_empty() {
            problems.push(format!(
                "{name}: its row in docs/CONFIG.md names no file it is read in"
            ));
        }
        for p in paths {
            let prefix = if name.starts_with("CUBECL_") {
                "CUBECL_"
            } else {
                "NSACTOR_"
            };
            match std::fs::read_to_string(root().join(&p)) {
                Ok(text) if scan(&text, prefix).names.contains(&name) => {}
                Ok(_) => problems.push(format!("{name}: {p} does not name it")),
                Err(e) => problems.push(format!("{name}: {p}: {e}")),
            }
        }
    }
    assert!(
        rows > 10,
        "only {rows} variable rows found in docs/CONFIG.md"
    );
    assert!(
        problems.is_empty(),
        "docs/CONFIG.md, \"read in\" column:\n{}",
        problems.join("\n")
    );
}

/// Every `.rs` file under `dir` (no skipping; for the vendored crates).
fn collect_all_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_all_rs(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The serde keys of `pub struct {name} { … }` in `source`: each field's name, or the
/// `#[serde(rename = "…")]` above it; fields marked `#[serde(skip)]` (or
/// `skip_deserializing`) are no keys.
fn struct_keys(source: &str, name: &str, file: &str) -> Vec<String> {
    let head = format!("pub struct {name} {{");
    let start = source
        .find(&head)
        .unwrap_or_else(|| panic!("{file} has no `{head}`: update tests/tests/config_docs.rs"));
    let attrs_before: String = source[..start]
        .lines()
        .rev()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| l.trim_start().starts_with("#[") || l.trim_start().starts_with("///"))
        .collect();
    assert!(
        !attrs_before.contains("rename_all") && !attrs_before.contains("flatten"),
        "{name} in {file} uses serde attributes this test does not model: teach struct_keys"
    );
    let body = &source[start + head.len()..];
    let body = &body[..body.find("\n}").expect("the struct ends")];
    let is_ident = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    let mut keys = Vec::new();
    let mut rename: Option<String> = None;
    let mut skip = false;
    for line in body.lines().map(str::trim) {
        if let Some(attr) = line.strip_prefix("#[serde(") {
            let items: Vec<&str> = attr
                .trim_end_matches(")]")
                .split(',')
                .map(str::trim)
                .collect();
            assert!(
                !items.contains(&"flatten"),
                "{name}: serde flatten is not modelled here"
            );
            for item in &items {
                if let Some(r) = item.strip_prefix("rename = \"") {
                    rename = Some(r.trim_end_matches('"').to_string());
                }
            }
            skip |= items
                .iter()
                .any(|i| *i == "skip" || *i == "skip_deserializing");
            continue;
        }
        let decl = ["pub(crate) ", "pub(super) ", "pub "]
            .iter()
            .find_map(|v| line.strip_prefix(v))
            .unwrap_or(line);
        let Some((field, _)) = decl.split_once(':') else {
            continue;
        };
        if !is_ident(field.trim()) {
            continue;
        }
        if !std::mem::take(&mut skip) {
            keys.push(rename.take().unwrap_or_else(|| field.trim().to_string()));
        }
        rename = None;
    }
    assert!(!keys.is_empty(), "{name} in {file}: no fields found");
    keys
}

/// The section of `doc` under the `###` heading that contains `` `[table]` ``, up to the next
/// heading of level 2 or 3.
fn section<'a>(doc: &'a str, table: &str) -> &'a str {
    let marker = format!("`[{table}]`");
    let start = doc
        .lines()
        .scan(0usize, |at, l| {
            let here = *at;
            *at += l.len() + 1;
            Some((here, l))
        })
        .find(|(_, l)| l.starts_with("### ") && l.contains(&marker))
        .map(|(at, _)| at)
        .unwrap_or_else(|| panic!("docs/CONFIG.md has no `### {marker}` section"));
    let rest = &doc[start..];
    let body_from = rest.find('\n').map_or(rest.len(), |i| i + 1);
    let end = rest[body_from..]
        .lines()
        .scan(body_from, |at, l| {
            let here = *at;
            *at += l.len() + 1;
            Some((here, l))
        })
        .find(|(_, l)| l.starts_with("## ") || l.starts_with("### "))
        .map_or(rest.len(), |(at, _)| at);
    &rest[..end]
}

/// The keys a section documents: the backticked name in the first cell of each table row.
fn documented_keys(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn every_config_key_is_documented_in_its_table_and_every_documented_key_exists() {
    let runtime = read("actors/engine/src/config.rs");
    let model = read("model/config/src/lib.rs");
    let doc = config_md();
    let tables = struct_keys(&runtime, "RunConfig", "actors/engine/src/config.rs");
    let expect = ["model", "train", "backend", "data"];
    assert!(
        tables.iter().all(|t| expect.contains(&t.as_str())),
        "RunConfig has tables {tables:?}; this test knows {expect:?}: add the new table's struct"
    );
    let mut problems = Vec::new();
    for table in &tables {
        let (source, file, strukt) = match table.as_str() {
            "model" => (&model, "model/config/src/lib.rs", "ModelToml"),
            "train" => (&runtime, "actors/engine/src/config.rs", "TrainConfig"),
            "data" => (&runtime, "actors/engine/src/config.rs", "DataConfig"),
            "backend" => (&runtime, "actors/engine/src/config.rs", "BackendConfig"),
            other => unreachable!("checked above: {other}"),
        };
        let keys = struct_keys(source, strukt, file);
        let sec = section(&doc, table);
        let rows = documented_keys(sec);
        for k in &keys {
            if !sec.contains(&format!("`{k}`")) || !rows.contains(k) {
                problems.push(format!(
                    "[{table}] `{k}` ({strukt} in {file}) has no row in the `[{table}]` table of \
                     docs/CONFIG.md"
                ));
            }
        }
        for k in &rows {
            if !keys.contains(k) {
                problems.push(format!(
                    "docs/CONFIG.md documents [{table}] `{k}`, which {strukt} in {file} does not \
                     have"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scanners_see_what_they_must() {
    // Each check above must be able to fail: the scanners find names, prefixes and fields.
    let f = scan(
        "env(\"NSACTOR_A_B\"); `$NSACTOR_C=off`; __NSACTOR_TABLE; NSACTOR_STAGE_* ; \
         format!(\"NSACTOR_{x}\"); \"NSACTOR_PRE_\".to_string() + s; NSACTOR_Xy",
        "NSACTOR_",
    );
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(f.names, set(&["NSACTOR_A_B", "NSACTOR_C"]), "{f:?}");
    assert_eq!(f.prefixes, set(&["NSACTOR_", "NSACTOR_PRE_"]), "{f:?}");

    let src = "#[derive(Deserialize)]\n#[serde(deny_unknown_fields)]\npub struct S {\n    \
               /// Doc: not a field.\n    pub alpha: u32,\n    #[serde(rename = \"B\")]\n    \
               pub b: usize,\n    #[serde(skip)]\n    pub hidden: u8,\n    \
               #[serde(default, skip_serializing_if = \"Option::is_none\")]\n    \
               pub gamma: Option<bool>,\n    delta: f64,\n}\n";
    assert_eq!(
        struct_keys(src, "S", "test"),
        ["alpha", "B", "gamma", "delta"]
    );

    assert_eq!(
        read_in("| `NSACTOR_A` | `off` (on) | x | `a/b.rs`, `c/d.rs` |"),
        Some((
            "NSACTOR_A".to_string(),
            vec!["a/b.rs".to_string(), "c/d.rs".to_string()]
        ))
    );
    assert_eq!(
        read_in("| `NSACTOR_B` | 1 | effect naming `x.rs` |"),
        Some(("NSACTOR_B".to_string(), vec!["x.rs".to_string()]))
    );
    assert_eq!(read_in("| `steps` | integer | required | x |"), None);

    let doc = "## Keys\n\n### `[t]`\n\n| key | x |\n|---|---|\n| `a` | 1 |\n| `b` | 2 |\n\n\
               ### `[u]`\n\n| `c` | 3 |\n";
    let sec = section(doc, "t");
    assert_eq!(documented_keys(sec), set(&["a", "b"]));
    assert!(!sec.contains("`c`"), "{sec}");
}
