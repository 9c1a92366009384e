//! The TOML form of [`ModelConfig`]: the `[model]` table of run configs, fixtures and
//! checkpoints, with the reference's key names (`D`, `N`, `K`, `D_ff`) and unknown keys refused.
//!
//! [`ModelConfig`] itself lives in the dependency-free backend contract (`nsactor-plugin-api`),
//! so every crate — the runtime, the backends, the model — shares one type; this crate adds the
//! serde mapping for it ([`ModelToml`], for `#[serde(with = …)]`) and the readers. Burn-free.

use nsactor_plugin_api::model::DEFAULT_V_TH_MIN;
pub use nsactor_plugin_api::model::{ModelConfig, PlifOut, consts};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub mod words;

/// What reading a model config can go wrong with.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    #[error("invalid model config: {0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The serde mapping of [`ModelConfig`] (`#[serde(with = "ModelToml")]`), keyed as the
/// reference's `model_config`. Unknown keys are errors.
#[derive(Serialize, Deserialize)]
#[serde(remote = "ModelConfig", deny_unknown_fields)]
pub struct ModelToml {
    pub vocab_size: usize,
    #[serde(rename = "D")]
    pub d: usize,
    #[serde(rename = "N")]
    pub n: usize,
    #[serde(rename = "K")]
    pub k: usize,
    pub num_layers: usize,
    #[serde(rename = "D_ff")]
    pub d_ff: usize,
    #[serde(default = "default_v_th_min")]
    pub v_th_min: f64,
    #[serde(default = "PlifOut::default", with = "PlifOutToml")]
    pub plif_out: PlifOut,
}

/// The serde mapping of [`PlifOut`]: `leak` or `v_post`.
#[derive(Serialize, Deserialize)]
#[serde(remote = "PlifOut")]
enum PlifOutToml {
    #[serde(rename = "leak")]
    Leak,
    #[serde(rename = "v_post")]
    VPost,
}

fn default_v_th_min() -> f64 {
    DEFAULT_V_TH_MIN
}

#[derive(Serialize, Deserialize)]
struct Table(#[serde(with = "ModelToml")] ModelConfig);

/// Reads a `[model]` table's value (already split out of its document) and validates it.
pub fn from_table(table: toml::Table) -> Result<ModelConfig, ModelConfigError> {
    let Table(cfg) = toml::Value::Table(table)
        .try_into()
        .map_err(|e| ModelConfigError::Invalid(format!("[model]: {e}")))?;
    cfg.validate()
        .map_err(|e| ModelConfigError::Invalid(e.to_string()))?;
    Ok(cfg)
}

/// The `[model]` table of `cfg`.
pub fn to_table(cfg: &ModelConfig) -> toml::Table {
    match toml::Value::try_from(Table(cfg.clone())) {
        Ok(toml::Value::Table(t)) => t,
        other => unreachable!("a struct serializes to a table, got {other:?}"),
    }
}

/// Parses the `[model]` table of a TOML document (other tables belong to other crates).
pub fn from_toml_str(text: &str) -> Result<ModelConfig, ModelConfigError> {
    #[derive(Deserialize)]
    struct Doc {
        model: toml::Table,
    }
    let doc: Doc =
        toml::from_str(text).map_err(|e| ModelConfigError::Invalid(format!("TOML: {e}")))?;
    from_table(doc.model)
}

/// Reads a TOML file's `[model]` table.
pub fn from_toml_file(path: &Path) -> Result<ModelConfig, ModelConfigError> {
    let io = |source| ModelConfigError::Io {
        path: path.display().to_string(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    from_toml_str(&text).map_err(|e| match e {
        ModelConfigError::Invalid(m) => {
            ModelConfigError::Invalid(format!("{}: {m}", path.display()))
        }
        e => e,
    })
}

/// `cfg` as a TOML document with one `[model]` table.
pub fn to_toml_string(cfg: &ModelConfig) -> String {
    let mut doc = toml::Table::new();
    doc.insert("model".into(), toml::Value::Table(to_table(cfg)));
    doc.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "[model]\nvocab_size = 64\nD = 8\nN = 2\nK = 2\nnum_layers = 1\nD_ff = 16\n";

    #[test]
    fn reads_the_reference_keys_with_defaults_and_round_trips() {
        let c = from_toml_str(OK).unwrap();
        assert_eq!(
            (c.vocab_size, c.d, c.n, c.k, c.num_layers, c.d_ff),
            (64, 8, 2, 2, 1, 16)
        );
        assert_eq!((c.v_th_min, c.plif_out), (0.1, PlifOut::Leak));
        let v = from_toml_str(&format!("{OK}plif_out = \"v_post\"\n")).unwrap();
        assert_eq!(v.plif_out, PlifOut::VPost);
        assert_eq!(from_toml_str(&to_toml_string(&v)).unwrap(), v);
        assert_eq!(from_table(to_table(&c)).unwrap(), c);
    }

    #[test]
    fn unknown_keys_bad_values_and_missing_files_are_clear_errors() {
        let e = from_toml_str(&format!("{OK}dropout = 0.1\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("dropout"), "{e}");
        let e = from_toml_str(&OK.replace("K = 2", "K = 0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`K` must be positive"), "{e}");
        let e = from_toml_str(&format!("{OK}plif_out = \"spike\"\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("spike"), "{e}");
        let e = from_toml_file(Path::new("/no/such/model.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/model.toml"), "{e}");
    }
}
