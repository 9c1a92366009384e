//! Choosing the compute backend of a run: the engine linked into this binary, or a plugin found
//! by name on the plugin search path, or a plugin given by path.

use nsactor_plugin_abi::host::{self, Plugin};
use nsactor_plugin_api::{BackendInfo, ComputeBackend, EngineError};
use std::path::PathBuf;
use std::sync::Arc;

/// The name that selects the backend linked into the binary.
pub const EMBEDDED: &str = "embedded";

/// Whether this binary has the embedded CPU backend.
pub fn has_embedded() -> bool {
    cfg!(feature = "embedded-cpu")
}

/// The backend used when none is named: the embedded one if linked in, else the ndarray plugin.
pub fn default_name() -> &'static str {
    if has_embedded() { EMBEDDED } else { "ndarray" }
}

#[cfg(feature = "embedded-cpu")]
fn embedded(options: &str) -> Result<Arc<dyn ComputeBackend>, EngineError> {
    Ok(Arc::new(nsactor_backend_ndarray::backend_with(options)?))
}

#[cfg(not(feature = "embedded-cpu"))]
fn embedded(_options: &str) -> Result<Arc<dyn ComputeBackend>, EngineError> {
    Err(EngineError::Plugin(
        "this nsactor was built without the embedded CPU backend (feature `embedded-cpu`); \
         choose a plugin with --backend ndarray|cuda|<path>"
            .into(),
    ))
}

/// Opens backend `name`: `embedded`, a plugin name (`ndarray`, `cuda`) searched for in
/// `$NSACTOR_PLUGIN_PATH`, `extra_dirs` and the binary's directory, or a library path.
pub fn open(name: &str, extra_dirs: &[PathBuf]) -> Result<Arc<dyn ComputeBackend>, EngineError> {
    open_with(name, extra_dirs, "")
}

/// [`open`] with the plugin's option string (`key=value,…`, e.g. `precision=bf16`); each
/// plugin rejects options it does not know.
pub fn open_with(
    name: &str,
    extra_dirs: &[PathBuf],
    options: &str,
) -> Result<Arc<dyn ComputeBackend>, EngineError> {
    if name == EMBEDDED {
        let other: Vec<&str> = options
            .split(',')
            .map(str::trim)
            .filter(|kv| {
                !kv.is_empty() && !kv.starts_with(nsactor_plugin_api::tuning::OPTION_PREFIX)
            })
            .collect();
        if !other.is_empty() {
            return Err(EngineError::InvalidInput(format!(
                "the embedded CPU backend takes no options but the kernel knobs, got `{}` (bf16 \
                 GEMMs need --backend cuda)",
                other.join(",")
            )));
        }
        return embedded(options);
    }
    let path = host::resolve(name, &host::search_dirs(extra_dirs))?;
    let plugin = Plugin::load(&path)?;
    let backend: Arc<dyn ComputeBackend> = plugin.open(options)?;
    Ok(backend)
}

/// One line of `nsactor plugins`.
#[derive(Debug)]
pub struct Listing {
    pub path: PathBuf,
    /// The loaded, version-checked library, or why it was refused.
    pub plugin: Result<Plugin, EngineError>,
    /// Its devices once opened, or why it could not initialise (absent if it did not load).
    pub info: Option<Result<BackendInfo, EngineError>>,
}

/// The directories searched, and every plugin found there, loaded and opened to list devices.
pub fn list(extra_dirs: &[PathBuf]) -> (Vec<PathBuf>, Vec<Listing>) {
    let dirs = host::search_dirs(extra_dirs);
    let found = host::discover(&dirs)
        .into_iter()
        .map(|path| {
            let plugin = Plugin::load(&path);
            let info = plugin.as_ref().ok().map(|p| p.open("").map(|b| b.info()));
            Listing { path, plugin, info }
        })
        .collect();
    (dirs, found)
}
