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

impl AnalysisError {
    /// Whether the error refuses the command's input (`nsactor analyze` exits 78 on it, as
    /// every command does): a malformed or empty sentence file, a checkpoint without a tensor
    /// the study reads, a file that is missing or unreadable, or what the model's loading
    /// refused. A failed chart, a full disk or a failing device exits 1.
    pub fn refuses_input(&self) -> bool {
        use std::io::ErrorKind::{NotFound, PermissionDenied};
        match self {
            AnalysisError::Runtime(e) => e.refuses_input(),
            AnalysisError::Engine(e) => {
                nsactor_engine::RuntimeError::from(e.clone()).refuses_input()
            }
            AnalysisError::Data(e) => e.refuses_input(),
            AnalysisError::Plot(..) => false,
            AnalysisError::Io(_, e) => matches!(e.kind(), NotFound | PermissionDenied),
            AnalysisError::Invalid(_) => true,
        }
    }
}
