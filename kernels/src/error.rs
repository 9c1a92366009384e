//! The crate's one error type: what a kernel, a device call, a captured graph, a timing window,
//! an option string or a parity check reports when it fails. The runtime and the backends see
//! it as [`EngineError`] (`From` below), which is what crosses the plugin boundary.

use nsactor_plugin_api::EngineError;

/// A failure in this crate, by kind; each message says what was being done.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// The backend does not do this (e.g. capturing work on the CPU).
    #[error("this backend does not {0}")]
    Unsupported(&'static str),
    /// A CUDA driver, cuBLASLt or device-server call failed.
    #[error("{0}")]
    Device(String),
    /// Work run on the device's thread panicked.
    #[error("{what} panicked: {message}")]
    Panicked { what: &'static str, message: String },
    /// The caller used an API out of order (a report without a start, a replay from another
    /// thread).
    #[error("{0}")]
    Misuse(String),
    /// An option string or a named setting that cannot be read.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A fixture that cannot be read or lacks a tensor.
    #[error("fixture: {0}")]
    Fixture(String),
    /// A kernel disagreed with its reference; the report says where.
    #[error("{report}")]
    Mismatch { report: String },
}

impl KernelError {
    /// A device failure, `what` doing and the driver's answer.
    pub fn device(what: &str, detail: impl std::fmt::Debug) -> Self {
        KernelError::Device(format!("{what}: {detail:?}"))
    }
}

impl From<KernelError> for EngineError {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::Unsupported(_)
            | KernelError::Misuse(_)
            | KernelError::InvalidOption(_)
            | KernelError::Fixture(_) => EngineError::InvalidInput(e.to_string()),
            KernelError::Panicked { .. } => EngineError::Panic(e.to_string()),
            KernelError::Device(_) | KernelError::Mismatch { .. } => {
                EngineError::Backend(e.to_string())
            }
        }
    }
}
