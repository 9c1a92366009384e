//! A fresh run's directory: a run started without `--resume` into a directory that holds
//! another run's files would mix the two (its metrics appended to the old ones, its checkpoints
//! beside older ones of higher steps, which a later `--resume` would take), so it is refused
//! unless `--overwrite` says to remove them, like Hugging Face's `overwrite_output_dir`.

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
    use super::claim;

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
