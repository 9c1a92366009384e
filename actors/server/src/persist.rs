//! The prefix cache kept past a restart (`serve --prefix-cache-dir DIR`). When the server
//! stops, every snapshot its cache holds is written to a folder of DIR named for the model
//! and tokenizer, one state file each ([`crate::saved`]), named by recency; when a server of
//! the same model and tokenizer starts on DIR, the files come back into the cache's host
//! tier, the most recent first, while it has room (a hit brings one to the devices).
//!
//! Nothing is lost on the way: the files are written under temporary names and take the
//! old ones' places only once all are written (a full disk leaves the old set as it was); a
//! file that cannot be read back is renamed `*.refused` and named in the log, never deleted.

use crate::error::ServeError;
use crate::saved::{self, Saved};
use crate::state::Shared;
use nsactor_decoding::snapshot::HostSnapshot;
use std::path::{Path, PathBuf};

const EXT: &str = "nsstate";

/// What [`save`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub folder: PathBuf,
    pub files: usize,
    pub bytes: u64,
}

/// What [`load`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Snapshots now in the host tier.
    pub adopted: usize,
    /// Good files left out: the host tier had no room, or the tokens were cached already.
    pub left: usize,
    /// Files refused, with why (each renamed `*.refused`).
    pub refused: Vec<(PathBuf, String)>,
}

/// The folder of `dir` for this server's model and tokenizer.
pub fn folder(s: &Shared, dir: &Path) -> PathBuf {
    let safe: String = s
        .model_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let hash = s.generator.tokenizer.hash();
    dir.join(format!("{safe}-{}", &hash[..hash.len().min(16)]))
}

fn io(what: &str, path: &Path, e: std::io::Error) -> ServeError {
    ServeError::Internal(format!("{what} {}: {e}", path.display()))
}

/// Writes every snapshot the cache holds to [`folder`]`(dir)`, replacing what an earlier
/// server wrote there.
pub async fn save(s: &Shared, dir: &Path) -> Result<Written, ServeError> {
    let g = &s.generator;
    let held = g.prefix.held(&g.decoder).await;
    let folder = folder(s, dir);
    let (model, vocab, tokenizer) = (
        s.model_name.clone(),
        g.decoder.vocab(),
        g.tokenizer.hash().to_string(),
    );
    let to = folder.clone();
    let key = s.state_key.clone();
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&to).map_err(|e| io("cannot create", &to, e))?;
        let mut written = Vec::with_capacity(held.len());
        let mut bytes = 0;
        for (rank, (tokens, state)) in held.into_iter().enumerate() {
            let file = saved::encode(
                &Saved {
                    model: model.clone(),
                    vocab,
                    tokenizer: tokenizer.clone(),
                    tokens,
                    state: (*state).clone(),
                },
                &key,
            );
            let tmp = to.join(format!("{rank:06}.{EXT}.tmp"));
            if let Err(e) = std::fs::write(&tmp, &file) {
                for t in written.iter().chain([&tmp]) {
                    let _ = std::fs::remove_file(t);
                }
                return Err(io("cannot write", &tmp, e));
            }
            bytes += file.len() as u64;
            written.push(tmp);
        }
        // All written: they take the old files' places.
        for old in files_in(&to)? {
            let _ = std::fs::remove_file(old);
        }
        for tmp in &written {
            let done = tmp.with_extension("");
            std::fs::rename(tmp, &done).map_err(|e| io("cannot rename", tmp, e))?;
        }
        Ok(Written {
            folder: to,
            files: written.len(),
            bytes,
        })
    })
    .await
    .map_err(|e| ServeError::Internal(format!("writing the prefix cache failed: {e}")))?
}

/// The state files in `folder`, by name.
fn files_in(folder: &Path) -> Result<Vec<PathBuf>, ServeError> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(folder)
        .map_err(|e| io("cannot read", folder, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == EXT))
        .collect();
    out.sort();
    Ok(out)
}

/// Takes the state files of [`folder`]`(dir)` into the cache's host tier, the most recent
/// first, while it has room. No folder: nothing to load.
pub async fn load(s: &Shared, dir: &Path) -> Result<Loaded, ServeError> {
    let folder = folder(s, dir);
    if !folder.exists() {
        return Ok(Loaded::default());
    }
    let g = &s.generator;
    let mut loaded = Loaded::default();
    // The first good file's shapes are checked on the devices; the others must match them.
    let mut shapes: Option<Vec<Vec<usize>>> = None;
    for path in files_in(&folder)? {
        let read = std::fs::read(&path).map_err(|e| ServeError::Invalid(e.to_string()));
        let f = read
            .and_then(|b| saved::decode(&b, &s.state_key))
            .and_then(|f| {
                f.check(&s.model_name, g.decoder.vocab(), g.tokenizer.hash())?;
                Ok(f)
            });
        let f = match f {
            Ok(f) => f,
            Err(e) => {
                refuse(&mut loaded, path, e.to_string());
                continue;
            }
        };
        let these = shapes_of(&f.state);
        match &shapes {
            Some(want) if *want != these => {
                let why = "its state's shapes differ from the other files'".to_string();
                refuse(&mut loaded, path, why);
                continue;
            }
            Some(_) => {}
            None => {
                // Written to the devices and dropped: the stages check every field.
                match g.decoder.write_snapshot(&f.state).await {
                    Ok(snap) => g.decoder.drop_snapshot(&snap).await,
                    Err(e) => {
                        refuse(&mut loaded, path, e.to_string());
                        continue;
                    }
                }
                shapes = Some(these);
            }
        }
        if g.prefix.adopt(&f.tokens, f.state) {
            loaded.adopted += 1;
        } else {
            loaded.left += 1;
        }
    }
    Ok(loaded)
}

fn shapes_of(h: &HostSnapshot) -> Vec<Vec<usize>> {
    let fields = h.edge.iter().chain(h.layers.iter().flatten());
    fields.map(|t| t.shape.clone()).collect()
}

fn refuse(loaded: &mut Loaded, path: PathBuf, why: String) {
    tracing::warn!("{}: refused ({why}); renamed *.refused", path.display());
    let _ = std::fs::rename(&path, path.with_extension("refused"));
    loaded.refused.push((path, why));
}
