//! The environment's layer of the run configuration: `NSACTOR_TABLE__KEY` variables over the
//! file's keys, each value read as the type it looks like.

/// The environment's layer of the configuration: every `NSACTOR_TABLE__KEY` variable (a
/// double underscore between the table and the key: `NSACTOR_TRAIN__STEPS=5`,
/// `NSACTOR_BACKEND__PRECISION=bf16`; a nested table's key with one more:
/// `NSACTOR_BACKEND__KERNELS__SCAN_CUBE=64`), whose value replaces the file's `[table] key`. Other
/// `NSACTOR_*` variables (one underscore-separated name, e.g. `NSACTOR_PLUGIN_PATH`) are the
/// process's own settings and not read here. Values parse as numbers and booleans where they
/// look like them.
#[derive(Debug, Clone, Default)]
pub struct EnvLayer(pub(super) Vec<EnvVar>);

/// One configuration variable: its name, the key path it sets (`train.steps`) and its value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct EnvVar {
    name: String,
    path: String,
    value: String,
}

impl EnvLayer {
    /// The configuration variables of this process's environment.
    pub fn from_env() -> Self {
        Self::from_vars(std::env::vars())
    }

    /// The configuration variables among `vars`.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut v: Vec<EnvVar> = vars
            .into_iter()
            .filter_map(|(name, value)| {
                let rest = name.strip_prefix(ENV_PREFIX)?.strip_prefix('_')?;
                let (table, key) = rest.split_once(ENV_SEPARATOR)?;
                // A nested table's key: `NSACTOR_BACKEND__KERNELS__SCAN_CUBE`.
                let key = key.to_lowercase().replace(ENV_SEPARATOR, ".");
                let path = key_path(&table.to_lowercase(), &key);
                Some(EnvVar { name, path, value })
            })
            .collect();
        v.sort();
        EnvLayer(v)
    }

    /// The variables' names, for messages.
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(|v| v.name.as_str()).collect()
    }
}

/// `table.key` as the file spells it: the model's upper-case keys (`D`, `N`, `K`, `D_ff`) by
/// their spelling there, every other key in lower case. (config-rs's own environment source
/// lower-cases every key, which would miss those four.)
fn key_path(table: &str, key: &str) -> String {
    let key = match table {
        "model" => ["D", "N", "K", "D_ff"]
            .into_iter()
            .find(|k| k.eq_ignore_ascii_case(key))
            .unwrap_or(key),
        _ => key,
    };
    format!("{table}.{key}")
}

/// The prefix of the configuration's environment variables (then `_`, the table, `__`, the key).
pub const ENV_PREFIX: &str = "NSACTOR";
/// Between a table and its key in a configuration variable's name.
pub const ENV_SEPARATOR: &str = "__";

/// Sets the key `var` names to its value, read as an integer, a float or a boolean where it is
/// one, else as text.
pub(super) fn env_override(
    builder: ::config::ConfigBuilder<::config::builder::DefaultState>,
    var: &EnvVar,
) -> Result<::config::ConfigBuilder<::config::builder::DefaultState>, ::config::ConfigError> {
    let (path, value) = (var.path.as_str(), var.value.as_str());
    if let Ok(v) = value.parse::<i64>() {
        builder.set_override(path, v)
    } else if let Ok(v) = value.parse::<f64>() {
        builder.set_override(path, v)
    } else if let Ok(v) = value.parse::<bool>() {
        builder.set_override(path, v)
    } else {
        builder.set_override(path, value)
    }
}
