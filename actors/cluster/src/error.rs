//! The crate's one error type: what went wrong between ranks.

/// What went wrong between ranks.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The world cannot form: bad variables, a port in use, a rank that never came, a refusal.
    #[error("{0}")]
    World(String),
    /// Another rank is gone or gave up.
    #[error("the world broke: {0}")]
    Broken(String),
    #[error("waited {seconds:.0} s for {what} (NSACTOR_TIMEOUT_S)")]
    Timeout { what: String, seconds: f64 },
    #[error("{0}")]
    Wire(String),
}
