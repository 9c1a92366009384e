//! The crate's one error type; every variant names the file or directory it is about.

use std::path::PathBuf;

/// Errors of the tokenizer and data pipeline.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot decompress {path} ({codec}): {source}; is the file truncated or corrupt?")]
    Decompress {
        path: PathBuf,
        codec: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    Parquet { path: PathBuf, msg: String },
    #[error("{path}: invalid UTF-8 at byte offset {offset}{note}")]
    Utf8 {
        path: PathBuf,
        offset: usize,
        /// Says the offset counts decompressed bytes, for compressed inputs.
        note: &'static str,
    },
    #[error("{path}: {what}: {msg}")]
    Json {
        path: PathBuf,
        what: String,
        msg: String,
    },
    #[error(
        "{path}: line {line} is longer than {limit} bytes (is it a text or JSON lines file?); \
         split it into lines"
    )]
    LineTooLong {
        path: PathBuf,
        line: usize,
        limit: usize,
    },
    #[error("empty corpus: no non-empty document in {0}")]
    EmptyCorpus(String),
    #[error("tokenizer {origin}: {msg}")]
    Tokenizer { origin: String, msg: String },
    #[error(
        "the shards in {dir} were made with tokenizer sha256 {shards}, but this run's tokenizer \
         ({origin}) has sha256 {run}; prepare the data again with this tokenizer"
    )]
    TokenizerMismatch {
        dir: PathBuf,
        shards: String,
        run: String,
        origin: String,
    },
    #[error(
        "tokenizer {origin} has {vocab} tokens; u16 shards hold ids below 65536 (use --dtype u32 or auto)"
    )]
    VocabTooLargeForU16 { origin: String, vocab: usize },
    #[error("shard {path}: {msg}")]
    Shard { path: PathBuf, msg: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;

impl DataError {
    /// Whether trying again cannot help: the input itself is wrong (a file that is not there,
    /// not readable, or not what it says it is). A read or write that failed otherwise (an
    /// interrupted network filesystem, a full disk) may succeed later.
    pub fn refuses_input(&self) -> bool {
        use std::io::ErrorKind::{
            InvalidData, IsADirectory, NotFound, PermissionDenied, UnexpectedEof,
        };
        match self {
            // A file not there or not readable, or whose bytes are not what it should hold
            // (text that is not UTF-8, a file cut short): the same command meets it again.
            DataError::Read { source, .. } => matches!(
                source.kind(),
                NotFound | PermissionDenied | InvalidData | UnexpectedEof | IsADirectory
            ),
            DataError::Write { .. } => false,
            _ => true,
        }
    }

    pub(crate) fn read(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Read {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn decompress(
        path: impl Into<PathBuf>,
        codec: &'static str,
        source: std::io::Error,
    ) -> Self {
        DataError::Decompress {
            path: path.into(),
            codec,
            source,
        }
    }

    pub(crate) fn parquet(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        DataError::Parquet {
            path: path.into(),
            msg: msg.to_string(),
        }
    }

    pub(crate) fn write(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Write {
            path: path.into(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    #[test]
    fn a_file_whose_bytes_are_wrong_is_refused_and_a_failing_disk_is_not() {
        let read = |kind| DataError::read("tokenizer.json", Error::new(kind, "x"));
        for kind in [
            ErrorKind::NotFound,
            ErrorKind::InvalidData,
            ErrorKind::UnexpectedEof,
        ] {
            assert!(read(kind).refuses_input(), "{kind:?}");
        }
        assert!(!read(ErrorKind::Interrupted).refuses_input());
        assert!(!read(ErrorKind::TimedOut).refuses_input());
    }
}
