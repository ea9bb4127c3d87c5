//! The harness's error type: kiln's errors, plus the harness's own (bad options, files, the
//! user-model build), whose messages may name the command line's flags.

use std::path::{Path, PathBuf};

/// Errors of the benchmark harness.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from kiln (tracing, compiling, running a model).
    #[error(transparent)]
    Kiln(#[from] kiln::Error),

    /// Bad options or input, with what to do about it.
    #[error("{0}")]
    Invalid(String),

    /// I/O on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        Error::Kiln(e.into())
    }
}

/// The harness's result type.
pub type Result<T> = std::result::Result<T, Error>;
