//! Models by Hugging Face Hub name: `nsactor serve Brain2nd/NeuronSpark-0.9B-Chat` (and
//! `--checkpoint`, `--init-from`, `import --from`, `analyze`) resolve `owner/name[@revision]`
//! to a directory of the Hub's cache, downloading what is missing. [`resolve`] decides what an
//! argument names: an existing path wins; otherwise `owner/name` (one `/`, optionally
//! `@revision`) is a Hub name; anything else stays a path (and fails as a missing one).
//!
//! Downloads go through the `hf-hub` crate's blocking client into the cache layout every
//! Hugging Face tool shares (`$HF_HOME/hub/models--owner--name/{blobs,refs,snapshots}`), and
//! only the files a NeuronSpark model needs (see [`hub_files`]). The pieces `hf-hub` lacks sit
//! over its `Cache`/`Repo` types here: the revision's commit asked of the Hub first (so a moved
//! branch is fetched anew), the status codes told apart for one-line errors, and resolution
//! from the cache alone with `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached.
//!
//! Environment: `HF_ENDPOINT` (default `https://huggingface.co`), `HF_HOME` (default
//! `~/.cache/huggingface`; the cache is `$HF_HOME/hub`, or `HF_HUB_CACHE`), `HF_TOKEN` (else
//! the token file `$HF_HOME/token`), sent as `Authorization: Bearer`, and `HF_HUB_OFFLINE`.

use hf_hub::api::Progress;
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use nsactor_engine::error::RuntimeError;
use std::path::{Path, PathBuf};

/// The weights file of an unsharded model, and the index of a sharded one.
pub const WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Files fetched when the repository has them; a model loads without them.
const OPTIONAL: [&str; 2] = ["tokenizer_config.json", "generation_config.json"];
/// Files a model cannot load without (besides its weights).
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A model argument resolved: the directory to read, and the Hub model it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub path: PathBuf,
    pub hub: Option<HubModel>,
}

/// A model found through the Hub (or its cache).
#[derive(Debug, Clone, PartialEq)]
pub struct HubModel {
    /// `owner/name`.
    pub repo: String,
    /// What was asked for: a branch, tag or commit (default `main`).
    pub revision: String,
    /// The commit the revision named: the snapshot directory's name.
    pub commit: String,
}

/// `owner/name` and its revision if `arg` is spelt as a Hub name (`owner/name[@revision]`),
/// whether or not such a path exists.
pub fn hub_name(arg: &str) -> Option<(&str, Option<&str>)> {
    let (repo, rev) = match arg.split_once('@') {
        Some((r, v)) => (r, Some(v)),
        None => (arg, None),
    };
    let (owner, name) = repo.split_once('/')?;
    let part = |s: &str| {
        !s.is_empty()
            && !s.starts_with(['.', '-'])
            && !s.contains("..")
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let rev_ok = rev.is_none_or(|v| !v.is_empty() && !v.contains(char::is_whitespace));
    (part(owner) && part(name) && rev_ok).then_some((repo, rev))
}

/// What `arg` names: an existing path as it is; else a Hub name, resolved to its cached
/// snapshot (fetched as needed); else the path (whose reader reports it missing).
/// `revision` (`--revision`) applies to Hub names only and must agree with an `@revision`.
pub fn resolve(arg: &str, revision: Option<&str>) -> Result<Resolved, RuntimeError> {
    let path = Path::new(arg);
    let named = hub_name(arg);
    if path.exists() || named.is_none() {
        if revision.is_some() {
            return Err(hub_err(format!(
                "--revision applies to Hub names (owner/name); `{arg}` is a local path"
            )));
        }
        return Ok(Resolved {
            path: path.to_path_buf(),
            hub: None,
        });
    }
    let (repo, at) = named.expect("checked above");
    let revision = match (at, revision) {
        (Some(a), Some(r)) if a != r => {
            return Err(hub_err(format!(
                "`{arg}` names revision `{a}` but --revision says `{r}`"
            )));
        }
        (a, r) => a.or(r).unwrap_or("main"),
    };
    Hub::from_env()?.fetch(repo, revision)
}

/// A resolved argument's Hub model, as `owner/name` (what `/v1/models` reports).
pub fn display_name(r: &Resolved) -> Option<String> {
    r.hub.as_ref().map(|h| h.repo.clone())
}

fn hub_err(msg: String) -> RuntimeError {
    RuntimeError::Convert(msg)
}

/// The Hub as the environment sets it up.
struct Hub {
    endpoint: String,
    cache: Cache,
    token: Option<String>,
    offline: bool,
}

impl Hub {
    fn from_env() -> Result<Self, RuntimeError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let home = match var("HF_HOME") {
            Some(h) => PathBuf::from(h),
            None => std::env::home_dir()
                .map(|h| h.join(".cache/huggingface"))
                .ok_or_else(|| {
                    hub_err("no home directory for the Hub's cache: set HF_HOME".into())
                })?,
        };
        let cache = Cache::new(var("HF_HUB_CACHE").map_or_else(|| home.join("hub"), PathBuf::from));
        let token = var("HF_TOKEN").or_else(|| Cache::new(home.join("hub")).token());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "on" | "yes" | "true"
            )
        });
        Ok(Hub {
            endpoint: var("HF_ENDPOINT").map_or(DEFAULT_ENDPOINT.into(), |e| {
                e.trim_end_matches('/').to_string()
            }),
            cache,
            token,
            offline,
        })
    }

    /// The snapshot of `repo` at `revision`, fetched as needed (or from the cache alone).
    fn fetch(&self, repo: &str, revision: &str) -> Result<Resolved, RuntimeError> {
        let dir = self
            .cache
            .path()
            .join(Repo::model(repo.into()).folder_name());
        if self.offline {
            return self.cached(repo, revision, &dir, "HF_HUB_OFFLINE is set");
        }
        let api = ApiBuilder::from_cache(self.cache.clone())
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(false)
            .with_user_agent("nsactor", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| hub_err(format!("the Hub client: {e}")))?;
        let commit = match self.commit_of(&api, repo, revision) {
            Ok(c) => c,
            Err(Failure::Unreachable(why)) => {
                tracing::warn!(
                    "cannot reach {} ({why}); looking in the cache",
                    self.endpoint
                );
                return self.cached(
                    repo,
                    revision,
                    &dir,
                    &format!("cannot reach {} ({why})", self.endpoint),
                );
            }
            Err(f) => return Err(self.explain(f, repo, revision, "config.json")),
        };
        let snapshot = dir.join("snapshots").join(&commit);
        let at_commit = api.repo(Repo::with_revision(
            repo.into(),
            RepoType::Model,
            commit.clone(),
        ));
        let get = |file: &str| -> Result<(), Failure> {
            if snapshot.join(file).is_file() {
                return Ok(());
            }
            tracing::info!("downloading {file} of {repo}@{revision} ({commit:.12})");
            at_commit
                .download_with_progress(file, Bar::new())
                .map(drop)
                .map_err(Failure::from)
        };
        let mut needed: Vec<String> = REQUIRED.iter().map(|s| s.to_string()).collect();
        for f in REQUIRED {
            get(f).map_err(|e| self.explain(e, repo, revision, f))?;
        }
        // Unsharded weights, or the shards an index names.
        let sharded = snapshot.join(WEIGHTS_INDEX).is_file()
            || match get(WEIGHTS) {
                Ok(()) => false,
                Err(Failure::Status {
                    entry_missing: true,
                    ..
                }) => true,
                Err(e) => return Err(self.explain(e, repo, revision, WEIGHTS)),
            };
        if sharded {
            get(WEIGHTS_INDEX).map_err(|e| self.explain(e, repo, revision, WEIGHTS_INDEX))?;
            for shard in shards(&snapshot)? {
                get(&shard).map_err(|e| self.explain(e, repo, revision, &shard))?;
                needed.push(shard);
            }
        } else {
            needed.push(WEIGHTS.into());
        }
        for f in OPTIONAL {
            match get(f) {
                Ok(())
                | Err(Failure::Status {
                    entry_missing: true,
                    ..
                }) => {}
                Err(e) => return Err(self.explain(e, repo, revision, f)),
            }
        }
        self.set_ref(repo, revision, &commit)?;
        tracing::info!(
            "{repo}@{revision} is {} ({} files)",
            snapshot.display(),
            needed.len()
        );
        Ok(self.found(repo, revision, commit, snapshot))
    }

    /// The commit `revision` names now, asked of the Hub with a one-byte read of config.json
    /// (its `x-repo-commit` header).
    fn commit_of(&self, api: &Api, repo: &str, revision: &str) -> Result<String, Failure> {
        let url = api
            .repo(Repo::with_revision(
                repo.into(),
                RepoType::Model,
                revision.into(),
            ))
            .url("config.json");
        // hf-hub keeps its request builder to itself: the same headers on an agent of ours.
        let mut request = ureq::AgentBuilder::new()
            .timeout_connect(std::time::Duration::from_secs(20))
            .build()
            .get(&url)
            .set("Range", "bytes=0-0")
            .set("User-Agent", concat!("nsactor/", env!("CARGO_PKG_VERSION")));
        if let Some(t) = &self.token {
            request = request.set("Authorization", &format!("Bearer {t}"));
        }
        let response = request.call().map_err(|e| Failure::from(Box::new(e)))?;
        response
            .header("x-repo-commit")
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty() && !c.contains(['/', '\\', '.']))
            .ok_or_else(|| {
                Failure::Other(format!(
                    "{url} named no commit (no x-repo-commit header): is HF_ENDPOINT a Hugging Face Hub?"
                ))
            })
    }

    /// Points `refs/<revision>` at `commit` (nothing for a commit asked by its hash), after
    /// removing the `refs/<commit>` that hf-hub writes when it downloads by commit (the Hub's
    /// own tools keep no ref named by a commit).
    fn set_ref(&self, repo: &str, revision: &str, commit: &str) -> Result<(), RuntimeError> {
        let by_commit = self
            .cache
            .path()
            .join(Repo::model(repo.into()).folder_name())
            .join("refs")
            .join(commit);
        let _ = std::fs::remove_file(&by_commit);
        if revision != commit {
            self.cache
                .repo(Repo::with_revision(
                    repo.into(),
                    RepoType::Model,
                    revision.into(),
                ))
                .create_ref(commit)
                .map_err(|e| {
                    hub_err(format!(
                        "the Hub cache {}: {e}",
                        self.cache.path().display()
                    ))
                })?;
        }
        Ok(())
    }

    /// The snapshot of `repo` at `revision` from the cache alone; `why` says why the Hub was not
    /// asked.
    fn cached(
        &self,
        repo: &str,
        revision: &str,
        dir: &Path,
        why: &str,
    ) -> Result<Resolved, RuntimeError> {
        let missing = |what: String| {
            hub_err(format!(
                "{why}, and {what} (the Hub cache is {})",
                self.cache.path().display()
            ))
        };
        let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
        let commit = if is_commit && dir.join("snapshots").join(revision).is_dir() {
            revision.to_string()
        } else {
            std::fs::read_to_string(dir.join("refs").join(revision))
                .map(|c| c.trim().to_string())
                .map_err(|_| missing(format!("{repo}@{revision} is not cached")))?
        };
        let snapshot = dir.join("snapshots").join(&commit);
        let mut want: Vec<String> = REQUIRED.iter().map(|s| s.to_string()).collect();
        if snapshot.join(WEIGHTS_INDEX).is_file() {
            want.extend(shards(&snapshot)?);
        } else {
            want.push(WEIGHTS.into());
        }
        let absent: Vec<_> = want
            .iter()
            .filter(|f| !snapshot.join(f).is_file())
            .cloned()
            .collect();
        if !absent.is_empty() {
            return Err(missing(format!(
                "the cached {repo}@{revision} lacks {}",
                absent.join(", ")
            )));
        }
        tracing::info!("{repo}@{revision} from the cache: {}", snapshot.display());
        Ok(self.found(repo, revision, commit, snapshot))
    }

    fn found(&self, repo: &str, revision: &str, commit: String, path: PathBuf) -> Resolved {
        Resolved {
            path,
            hub: Some(HubModel {
                repo: repo.into(),
                revision: revision.into(),
                commit,
            }),
        }
    }

    /// A one-line error for a failed request of `file`.
    fn explain(&self, f: Failure, repo: &str, revision: &str, file: &str) -> RuntimeError {
        let at = &self.endpoint;
        let token_hint = if self.token.is_some() {
            "the token in HF_TOKEN may not read it (accept the model's terms on the Hub, or use another token)"
        } else {
            "set HF_TOKEN to a token that may read it"
        };
        hub_err(match f {
            Failure::Status {
                code,
                error_code,
                entry_missing,
            } => match error_code.as_deref() {
                Some("RepoNotFound") => format!(
                    "no model repository `{repo}` on {at} (HTTP {code}); if it is private, {token_hint}"
                ),
                Some("RevisionNotFound") => {
                    format!("`{repo}` on {at} has no revision `{revision}`")
                }
                _ if entry_missing => format!(
                    "`{repo}`@{revision} on {at} has no {file}: not a NeuronSpark model nsactor can load"
                ),
                Some("GatedRepo") => {
                    format!("`{repo}` on {at} is gated (HTTP {code}): {token_hint}")
                }
                _ if code == 401 || code == 403 => {
                    format!("`{repo}` on {at} is gated or private (HTTP {code}): {token_hint}")
                }
                _ if code == 404 => format!(
                    "no model repository `{repo}` (revision `{revision}`) on {at} (HTTP 404)"
                ),
                _ => format!("{at} answered HTTP {code} for {file} of `{repo}`@{revision}"),
            },
            Failure::Unreachable(why) => {
                format!("lost the connection to {at} while downloading {file} of `{repo}`: {why}")
            }
            Failure::Other(why) => {
                format!("downloading {file} of `{repo}`@{revision} from {at}: {why}")
            }
        })
    }
}

/// The shard files `model.safetensors.index.json` in `snapshot` names, each once, in order.
pub(crate) fn shards(snapshot: &Path) -> Result<Vec<String>, RuntimeError> {
    let p = snapshot.join(WEIGHTS_INDEX);
    let bad = |e: String| hub_err(format!("{}: {e}", p.display()));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&p).map_err(|e| bad(e.to_string()))?)
            .map_err(|e| bad(e.to_string()))?;
    let map = index["weight_map"]
        .as_object()
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for v in map.values() {
        let f = v
            .as_str()
            .ok_or_else(|| bad("a `weight_map` value is not a file name".into()))?;
        if f.contains("..") || f.starts_with('/') {
            return Err(bad(format!("shard `{f}` is not a file of the repository")));
        }
        if !files.iter().any(|x| x == f) {
            files.push(f.to_string());
        }
    }
    Ok(files)
}

/// How one request failed.
enum Failure {
    /// The Hub answered with an error status; `error_code` is its `x-error-code` header.
    Status {
        code: u16,
        error_code: Option<String>,
        /// The repository and revision exist but the file does not.
        entry_missing: bool,
    },
    /// No answer: no network, a refused connection, DNS, TLS.
    Unreachable(String),
    Other(String),
}

impl From<Box<ureq::Error>> for Failure {
    fn from(e: Box<ureq::Error>) -> Self {
        match *e {
            ureq::Error::Status(code, r) => {
                let error_code = r.header("x-error-code").map(str::to_string);
                let entry_missing = error_code.as_deref() == Some("EntryNotFound")
                    || (code == 404 && error_code.is_none() && r.header("x-repo-commit").is_some());
                Failure::Status {
                    code,
                    error_code,
                    entry_missing,
                }
            }
            ureq::Error::Transport(t) => Failure::Unreachable(t.to_string()),
        }
    }
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::RequestError(e) => Failure::from(e),
            ApiError::TooManyRetries(e) => Failure::from(*e),
            other => Failure::Other(other.to_string()),
        }
    }
}

/// A download's progress bar on stderr (drawn only on a terminal).
struct Bar(indicatif::ProgressBar);

impl Bar {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg:30} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Bar(bar)
    }
}

impl Progress for Bar {
    fn init(&mut self, size: usize, filename: &str) {
        self.0.set_length(size as u64);
        self.0.set_position(0);
        self.0.set_message(filename.to_string());
    }
    fn update(&mut self, size: usize) {
        self.0.inc(size as u64);
    }
    fn finish(&mut self) {
        self.0.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names_are_owner_slash_name_with_an_optional_revision() {
        assert_eq!(
            hub_name("Brain2nd/NeuronSpark-0.9B-Chat"),
            Some(("Brain2nd/NeuronSpark-0.9B-Chat", None))
        );
        assert_eq!(hub_name("a/b@v1.0"), Some(("a/b", Some("v1.0"))));
        assert_eq!(hub_name("a/b@refs/pr/1"), Some(("a/b", Some("refs/pr/1"))));
        for path in [
            "runs/tiny/checkpoints",
            "/abs/x",
            "./a/b",
            "../a/b",
            "a",
            "a/",
            "/a",
            "a/b@",
            "a b/c",
            "a/.hidden",
            "a/b..c",
        ] {
            assert_eq!(hub_name(path), None, "{path}");
        }
    }

    #[test]
    fn an_existing_path_wins_and_revision_needs_a_hub_name() {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("owner/name");
        std::fs::create_dir_all(&local).unwrap();
        let arg = local.to_str().unwrap();
        assert_eq!(
            resolve(arg, None).unwrap(),
            Resolved {
                path: local.clone(),
                hub: None
            }
        );
        let e = resolve(arg, Some("main")).unwrap_err().to_string();
        assert!(e.contains("--revision applies to Hub names"), "{e}");
        let e = resolve("o/n@v1", Some("v2")).unwrap_err().to_string();
        assert!(e.contains("`v1`") && e.contains("`v2`"), "{e}");
    }

    #[test]
    fn shards_come_from_the_index_each_once() {
        let dir = tempfile::tempdir().unwrap();
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#;
        std::fs::write(dir.path().join(WEIGHTS_INDEX), index).unwrap();
        assert_eq!(
            shards(dir.path()).unwrap(),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        std::fs::write(
            dir.path().join(WEIGHTS_INDEX),
            r#"{"weight_map": {"a": "../x"}}"#,
        )
        .unwrap();
        assert!(shards(dir.path()).is_err());
    }
}
