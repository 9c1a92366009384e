//! The analysis crate's one error type.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    /// Opening or running the model failed.
    #[error(transparent)]
    Runtime(#[from] nsactor_engine::RuntimeError),
    /// A backend call failed.
    #[error(transparent)]
    Engine(#[from] nsactor_plugin_api::EngineError),
    /// Tokenizing failed.
    #[error(transparent)]
    Data(#[from] nsactor_data::DataError),
    /// A chart could not be drawn.
    #[error("chart {0}: {1}")]
    Plot(&'static str, nsactor_plots::PlotError),
    /// An input or output file.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// Bad input: an empty sentence set, a malformed JSONL line, a weights file without a
    /// tensor the study reads.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, AnalysisError>;
