//! Model hyperparameters (SPEC §1.1): the shared, burn-free [`ModelConfig`] of the backend
//! contract and its TOML readers (`nsactor-model-config`), re-exported where the model's users
//! look for them.

pub use nsactor_model_config::{
    ModelConfig, ModelConfigError, PlifOut, consts, from_toml_file, from_toml_str, to_toml_string,
};
