//! Models by Hugging Face Hub name, end to end: a tiny model exported and served by a loopback
//! Hub (`loopback_hub.rs`), fetched by the real `nsactor` binary into a fresh
//! `HF_HOME` by name (`generate --checkpoint owner/name`, `serve owner/name`), with only the
//! files a model needs; then, the Hub stopped, loaded again from the cache alone (`generate`,
//! `import`, `analyze`, `train --init-from`, with and without `HF_HUB_OFFLINE`); and the
//! one-line errors for a missing repository or revision, a gated one without `HF_TOKEN`
//! (and the token sent as `Authorization: Bearer` with it), and nothing cached offline.

use crate::common::cli::*;
use crate::common::served::*;
use crate::loopback_hub::{HubRepo, LoopbackHub};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// `nsactor` with the Hub at `endpoint` (when given) and its cache under `home`, and none of
/// the caller's Hub settings.
fn with_hub(home: &Path, endpoint: Option<&str>) -> Command {
    let mut c = nsactor();
    c.env("HF_HOME", home).env("NO_COLOR", "1");
    for k in ["HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT"] {
        c.env_remove(k);
    }
    if let Some(e) = endpoint {
        c.env("HF_ENDPOINT", e);
    }
    c
}

fn generate(c: &mut Command, model: &str) -> std::process::Output {
    generate_with(c, model, &[])
}

fn generate_with(c: &mut Command, model: &str, extra: &[&str]) -> std::process::Output {
    c.args(["generate", "--max-tokens", "6", "--seed", "7"])
        .args(["--checkpoint", model, "Once upon"])
        .args(extra)
        .output()
        .unwrap()
}

/// Runs `c`, which must fail; its stderr, checked to be one clear error and no panic.
fn fails(c: &mut Command) -> String {
    let o = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "should fail: {stderr}");
    assert!(
        stderr.contains("error:") && !stderr.contains("panicked"),
        "{stderr}"
    );
    stderr
}

fn stdout_ok(o: std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "failed: {stderr}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_model_by_hub_name_is_fetched_served_and_then_loaded_offline_from_the_cache() {
    let dir = temp_dir("hub");
    let run = trained_run(&dir);
    let hf = dir.join("hf");
    ok(nsactor()
        .args(["export", "--checkpoint"])
        .arg(&run)
        .arg("--out")
        .arg(&hf));
    let mut files: HashMap<String, Vec<u8>> = std::fs::read_dir(&hf)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    // The model code is for `transformers`; nsactor reads the rest.
    let needed: Vec<String> = files
        .keys()
        .filter(|f| !f.ends_with(".py"))
        .cloned()
        .collect();
    // A file the model does not need, which must not be fetched.
    files.insert("optimizer.pt".into(), vec![0; 4096]);
    let repo = |token: Option<&str>| HubRepo {
        commit: COMMIT.into(),
        files: files.clone(),
        token: token.map(String::from),
    };
    let mut hub = LoopbackHub::start(HashMap::from([
        ("nsactor/tiny".to_string(), repo(None)),
        ("nsactor/gated".to_string(), repo(Some("hf_secret"))),
    ]));
    let endpoint = hub.endpoint();
    let home = dir.join("hf-home");
    let online = || with_hub(&home, Some(&endpoint));

    // The same text as the exported directory gives, fetched by name.
    let local = stdout_ok(generate(&mut nsactor(), hf.to_str().unwrap()));
    assert_eq!(stdout_ok(generate(&mut online(), "nsactor/tiny")), local);
    let cached = home.join("hub/models--nsactor--tiny");
    assert_eq!(
        std::fs::read_to_string(cached.join("refs/main")).unwrap(),
        COMMIT
    );
    let snapshot = cached.join("snapshots").join(COMMIT);
    for f in &needed {
        let p = snapshot.join(f);
        assert!(p.is_symlink(), "{} is not a link into blobs/", p.display());
        assert_eq!(std::fs::read(&p).unwrap(), files[f], "{f}");
    }
    let fetched = hub.seen.lock().unwrap().requests.clone();
    assert!(
        fetched.iter().all(|r| !r.contains("optimizer.pt")),
        "fetched a file the model does not need: {fetched:?}"
    );
    assert!(hub.seen.lock().unwrap().authorization.is_empty());

    // `serve NAME`, as vLLM takes it, answers a completion and reports the Hub name.
    let addr = free_addr();
    let mut server = online()
        .args([
            "serve",
            "nsactor/tiny",
            "--no-warmup",
            "--addr",
            &addr.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until_serving(addr, &mut server);
    let body = r#"{"model":"nsactor/tiny","prompt":"Once upon","max_tokens":3,"ignore_eos":true}"#;
    let (status, done) = answer(send(addr, "POST", "/v1/completions", "", body));
    let (_, models) = answer(send(addr, "GET", "/v1/models", "", ""));
    server.kill().unwrap();
    server.wait().unwrap();
    assert_eq!(status, 200, "{done}");
    assert!(done.contains("\"completion_tokens\":3"), "{done}");
    assert!(models.contains("\"nsactor/tiny\""), "{models}");

    // Errors: a missing repository, a missing revision, a gated one without a token.
    let e = fails(online().args(["generate", "--checkpoint", "nsactor/missing", "x"]));
    assert!(e.contains("no model repository `nsactor/missing`"), "{e}");
    let e = fails(online().args(["generate", "--checkpoint", "nsactor/tiny@v9", "x"]));
    assert!(e.contains("no revision `v9`"), "{e}");
    let e = fails(online().args(["generate", "--checkpoint", "nsactor/gated", "x"]));
    assert!(
        e.contains("gated or private (HTTP 401)") && e.contains("set HF_TOKEN"),
        "{e}"
    );
    // With HF_TOKEN it is fetched, the token sent as a bearer token; `--revision` by commit.
    let mut with_token = online();
    with_token.env("HF_TOKEN", "hf_secret");
    let o = generate_with(&mut with_token, "nsactor/gated", &["--revision", COMMIT]);
    assert_eq!(stdout_ok(o), local);
    let auth = hub.seen.lock().unwrap().authorization.clone();
    assert!(
        !auth.is_empty() && auth.iter().all(|a| a == "Bearer hf_secret"),
        "{auth:?}"
    );

    // The Hub gone: the cache answers, by itself when the network fails, and offline.
    hub.stop();
    let o = generate(&mut online(), "nsactor/tiny");
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot reach"));
    assert_eq!(stdout_ok(o), local);
    let offline = || {
        let mut c = with_hub(&home, None);
        c.env("HF_HUB_OFFLINE", "1");
        c
    };
    assert_eq!(
        stdout_ok(generate(&mut offline(), &format!("nsactor/tiny@{COMMIT}"))),
        local
    );
    let imported = dir.join("imported");
    ok(offline()
        .args(["import", "--from", "nsactor/tiny", "--out"])
        .arg(&imported));
    assert!(imported.join("checkpoints/step-00000000").is_dir());
    let sentences = dir.join("sentences.txt");
    std::fs::write(&sentences, "Once upon a time.\nThe cat sat.\n").unwrap();
    let analysis = dir.join("analysis");
    ok(offline()
        .args([
            "analyze",
            "--checkpoint",
            "nsactor/tiny",
            "--max-tokens",
            "8",
            "--text",
        ])
        .arg(&sentences)
        .arg("--out")
        .arg(&analysis));
    let study = std::fs::read_to_string(analysis.join("analysis.json")).unwrap();
    assert!(study.contains("nsactor/tiny"), "{study}");
    let tuned = dir.join("tuned");
    ok(offline()
        .args([
            "train",
            "--steps",
            "1",
            "--init-from",
            "nsactor/tiny",
            "--out",
        ])
        .arg(&tuned));
    assert!(tuned.join("checkpoints").is_dir());

    // Nothing cached: offline, and with the Hub unreachable.
    let e = fails(offline().args(["generate", "--checkpoint", "nsactor/other", "x"]));
    assert!(
        e.contains("HF_HUB_OFFLINE is set, and nsactor/other@main is not cached"),
        "{e}"
    );
    let e = fails(online().args(["generate", "--checkpoint", "nsactor/other", "x"]));
    assert!(
        e.contains("cannot reach") && e.contains("is not cached"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
