//! Finding plugins: the platform's library file name of a backend, the directories searched
//! (`$NSACTOR_PLUGIN_PATH`, then extra ones, then next to the binary), and resolving a backend
//! name or path to one library file.

use nsactor_plugin_api::EngineError;
use std::path::{Path, PathBuf};

/// Environment variable with extra plugin directories (`:`-separated, like `PATH`).
pub const PLUGIN_PATH_ENV: &str = "NSACTOR_PLUGIN_PATH";

/// The file name of backend `name`'s plugin on this platform (`libnsactor_backend_cuda.so`).
pub fn library_file_name(name: &str) -> String {
    format!(
        "{}nsactor_backend_{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Where plugins are looked for, in order: `$NSACTOR_PLUGIN_PATH`, `extra` (from the config),
/// the directory of the running binary.
pub fn search_dirs(extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(p) = std::env::var_os(PLUGIN_PATH_ENV) {
        dirs.extend(std::env::split_paths(&p).filter(|d| !d.as_os_str().is_empty()));
    }
    dirs.extend(extra.iter().cloned());
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        dirs.push(dir);
    }
    dirs
}

/// Resolves `--backend` to a library path: a path (contains a `/` or ends in the platform's
/// library suffix) is taken as is; a name is searched for in `dirs`.
pub fn resolve(backend: &str, dirs: &[PathBuf]) -> Result<PathBuf, EngineError> {
    let looks_like_path = backend.contains('/') || backend.ends_with(std::env::consts::DLL_SUFFIX);
    if looks_like_path {
        let p = PathBuf::from(backend);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(EngineError::Plugin(format!(
                "plugin file {} does not exist",
                p.display()
            )))
        };
    }
    let file = library_file_name(backend);
    for d in dirs {
        let p = d.join(&file);
        if p.is_file() {
            return Ok(p);
        }
    }
    let searched: Vec<String> = dirs.iter().map(|d| format!("  {}", d.display())).collect();
    Err(EngineError::Plugin(format!(
        "no plugin for backend `{backend}`: looked for {file} in\n{}\nbuild it \
         (`cargo build --release -p nsactor-backend-{backend}`), put its directory in \
         ${PLUGIN_PATH_ENV}, or pass --backend with the library's path",
        if searched.is_empty() {
            "  (no directories)".to_string()
        } else {
            searched.join("\n")
        }
    )))
}

/// Every plugin library file in `dirs` (by name pattern; not yet loaded).
pub fn discover(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let prefix = format!("{}nsactor_backend_", std::env::consts::DLL_PREFIX);
    let mut found = Vec::new();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        let mut here: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with(&prefix) && n.ends_with(std::env::consts::DLL_SUFFIX)
                })
            })
            .collect();
        here.sort();
        for p in here {
            if !found.contains(&p) {
                found.push(p);
            }
        }
    }
    found
}
