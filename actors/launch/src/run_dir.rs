//! A fresh run's directory: a run started without `--resume` into a directory that holds
//! another run's files would mix the two (its metrics appended to the old ones, its checkpoints
//! beside older ones of higher steps, which a later `--resume` would take), so it is refused
//! unless `--overwrite` says to remove them, like Hugging Face's `overwrite_output_dir`. And a
//! directory a live run trains in is locked ([`RunLock`]): a second run into it, resumed or
//! overwriting, is refused while the first runs.

use nsactor_engine::error::RuntimeError;
use std::path::Path;

/// What a run writes into its directory; `--overwrite` removes exactly these.
const RUN_FILES: [&str; 6] = [
    "checkpoints",
    "metrics.jsonl",
    "model.safetensors",
    "data_cursor.json",
    "loss.png",
    "config.toml",
];

/// The files that mark a directory as holding a run (a `config.toml` or `loss.png` alone is
/// not a run: a config kept beside it, a plot).
const MARKS: [&str; 4] = [
    "checkpoints",
    "metrics.jsonl",
    "model.safetensors",
    "data_cursor.json",
];

/// Makes `out_dir` ready for a run from step 0: refuses when it holds another run's files,
/// or removes them first with `overwrite`. A `checkpoints/` without a checkpoint's directory
/// does not count.
pub fn claim(out_dir: &Path, overwrite: bool) -> Result<(), RuntimeError> {
    let held: Vec<&str> = MARKS
        .into_iter()
        .filter(|name| holds(&out_dir.join(name)))
        .collect();
    if held.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(RuntimeError::Invalid(format!(
            "{} already holds a training run (its {}): `--resume` continues it, `--overwrite` \
             starts again from step 0 and removes its checkpoints, metrics and weights, or \
             give the new run another `--out`",
            out_dir.display(),
            held.iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    for name in RUN_FILES {
        let path = out_dir.join(name);
        let removed = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(_) => continue,
        };
        removed.map_err(|e| RuntimeError::Io(path.clone(), e))?;
    }
    tracing::info!(
        "--overwrite: removed the previous run's {} from {}",
        held.join(", "),
        out_dir.display()
    );
    Ok(())
}

/// The lock file in a run's directory; [`RunLock`] holds an exclusive `flock` on it for the
/// run's life and writes its process id into it.
pub const LOCK_FILE: &str = ".nsactor-train.lock";

/// Set by `nsactor train --max-restarts` (the agent, which holds the lock) to its process id
/// in each child's environment: a child whose parent is that process runs under the parent's
/// lock instead of taking its own (the kernel would refuse it: the parent holds it).
pub const LOCK_HELD_BY: &str = "NSACTOR_RUN_LOCK_HELD_BY";

/// An exclusive lock on a run's directory for as long as it is held: a second run into the
/// same `--out` (a `--resume` or an `--overwrite` beside a live run, which would tear its
/// `metrics.jsonl` or delete its checkpoints) is refused while the first runs. The kernel
/// releases it when the process ends, however it ends, so a crash leaves no stale lock.
#[derive(Debug)]
pub struct RunLock {
    _file: Option<std::fs::File>,
}

impl RunLock {
    /// Takes the lock on `out_dir` (creating the directory), or refuses naming the process
    /// that holds it. In a child of the agent that holds it already, takes nothing.
    pub fn acquire(out_dir: &Path) -> Result<Self, RuntimeError> {
        if held_by_parent(out_dir) {
            return Ok(Self { _file: None });
        }
        std::fs::create_dir_all(out_dir).map_err(|e| RuntimeError::Io(out_dir.into(), e))?;
        let path = out_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| RuntimeError::Io(path.clone(), e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => String::new(),
                    pid => format!(" (process {pid})"),
                };
                return Err(RuntimeError::Invalid(format!(
                    "{} is in use by another training run{holder}: two runs in one directory \
                     would tear its metrics and checkpoints; wait for it to end, stop it, or \
                     give this run another `--out`",
                    out_dir.display()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(RuntimeError::Io(path, e)),
        }
        use std::io::{Seek, Write};
        let wrote = file
            .set_len(0)
            .and_then(|()| file.seek(std::io::SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{}", std::process::id()));
        wrote.map_err(|e| RuntimeError::Io(path, e))?;
        Ok(Self { _file: Some(file) })
    }
}

/// Whether this process is a child of the agent that holds `out_dir`'s lock: the agent named
/// itself in [`LOCK_HELD_BY`], it is this process's parent, and the lock file names it.
fn held_by_parent(out_dir: &Path) -> bool {
    let Ok(named) = std::env::var(LOCK_HELD_BY) else {
        return false;
    };
    let parent = std::os::unix::process::parent_id().to_string();
    let recorded = std::fs::read_to_string(out_dir.join(LOCK_FILE)).unwrap_or_default();
    named == parent && recorded.trim() == parent
}

/// Whether `path` holds a run's file: a directory (`checkpoints/`) holding a directory (a
/// checkpoint, whole or not), or any other path that exists.
fn holds(path: &Path) -> bool {
    match std::fs::read_dir(path) {
        Ok(entries) => entries
            .flatten()
            .any(|e| e.file_type().is_ok_and(|t| t.is_dir())),
        Err(_) => path.exists(),
    }
}

#[cfg(test)]
mod tests {
    use super::{LOCK_FILE, RunLock, claim};

    /// A second lock on a locked directory is refused naming the holder; dropping the first
    /// frees it, and the file left behind is no run's mark.
    #[test]
    fn a_locked_directory_is_refused_until_its_lock_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let first = RunLock::acquire(&out).unwrap();
        assert_eq!(
            std::fs::read_to_string(out.join(LOCK_FILE)).unwrap().trim(),
            std::process::id().to_string()
        );
        let err = RunLock::acquire(&out).unwrap_err();
        assert!(err.refuses_input());
        let err = err.to_string();
        assert!(
            err.contains("is in use by another training run")
                && err.contains(&format!("(process {})", std::process::id())),
            "{err}"
        );
        drop(first);
        let _again = RunLock::acquire(&out).unwrap();
        claim(&out, false).unwrap();
    }

    #[test]
    fn a_directory_holding_a_run_is_refused_unless_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        // Missing, then empty (with an empty `checkpoints/`): a fresh run may start.
        claim(&out, false).unwrap();
        std::fs::create_dir_all(out.join("checkpoints")).unwrap();
        std::fs::write(out.join("checkpoints/stray"), "not a checkpoint").unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        claim(&out, false).unwrap();

        std::fs::create_dir_all(out.join("checkpoints/step-00000005")).unwrap();
        std::fs::write(out.join("metrics.jsonl"), "{}\n").unwrap();
        std::fs::write(out.join("loss.png"), "png").unwrap();
        let err = claim(&out, false).unwrap_err().to_string();
        assert!(
            err.contains("already holds a training run")
                && err.contains("`checkpoints`, `metrics.jsonl`")
                && err.contains("--resume")
                && err.contains("--overwrite"),
            "{err}"
        );
        // Refusing touched nothing.
        assert!(out.join("checkpoints/step-00000005").is_dir());
        assert!(out.join("metrics.jsonl").is_file());

        claim(&out, true).unwrap();
        assert!(!out.join("checkpoints").exists());
        assert!(!out.join("metrics.jsonl").exists());
        assert!(!out.join("loss.png").exists());
        // What the run did not write stays.
        assert_eq!(
            std::fs::read_to_string(out.join("notes.txt")).unwrap(),
            "mine"
        );
        claim(&out, false).unwrap();
    }
}
