//! The crate's one error type.
//!
//! Every fallible public function returns [`Result<T>`]. Messages name the op, the shapes, the
//! file or the PJRT call involved, so that a user can act on them without a debugger.

use std::path::PathBuf;

/// Errors raised by kiln.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An op was given operands whose types it cannot accept (found at trace time).
    #[error("{op}: {message} (operands: {operands})")]
    Type {
        /// The op's name, e.g. `dot_general`.
        op: String,
        /// What is wrong.
        message: String,
        /// The operand types, rendered, e.g. `f32[2,3], f32[4,3]`.
        operands: String,
    },

    /// A value of the wrong type was passed to a compiled function or graph.
    #[error("input {index} ({name}): expected {expected}, got {got}")]
    InputMismatch {
        /// Position of the input.
        index: usize,
        /// Name of the input (parameter path or `input{i}`).
        name: String,
        /// The expected type, rendered.
        expected: String,
        /// The type that was passed, rendered.
        got: String,
    },

    /// Misuse of the tracing machinery (tensor from another trace, nested trace misuse, ...).
    #[error("trace: {0}")]
    Trace(String),

    /// A graph failed validation (dangling operand, wrong output index, cycle, ...).
    #[error("graph: {0}")]
    Graph(String),

    /// An op or feature that the named backend does not implement.
    #[error("{backend}: unsupported: {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// What is unsupported.
        what: String,
    },

    /// The PJRT plugin could not be found or loaded.
    #[error("PJRT plugin {path}: {message}")]
    Plugin {
        /// The path that was tried.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },

    /// A PJRT C API call returned an error; `message` is the plugin's own message.
    #[error("PJRT {call} failed ({code}): {message}")]
    Pjrt {
        /// The C API function, e.g. `PJRT_Client_Compile`.
        call: &'static str,
        /// The plugin's error code name, e.g. `INVALID_ARGUMENT`.
        code: String,
        /// The plugin's message.
        message: String,
    },

    /// An error from libtorch (eager backend or host tensors).
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),

    /// I/O on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// Loading or saving weights, or a malformed file.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },

    /// A caller-supplied argument is invalid (outside any op).
    #[error("{0}")]
    Invalid(String),

    /// An error raised while working on one op of a graph (differentiating it, evaluating it):
    /// the op and its result type, around the underlying error, whose variant is kept
    /// ([`Error::root`] reaches it).
    #[error("{action} {op} -> {ty}: {source}")]
    AtOp {
        /// What was being done, e.g. `differentiating`, `evaluating`.
        action: &'static str,
        /// The op's name, e.g. `reshape`.
        op: String,
        /// The op's result type, rendered.
        ty: String,
        /// The underlying error.
        #[source]
        source: Box<Error>,
    },

    /// A broken internal invariant: a bug in kiln, never the caller's fault.
    #[error("internal error (this is a kiln bug, please report it): {0}")]
    Internal(String),
}

/// Shorthand for `std::result::Result<T, kiln::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Builds an [`Error::Type`] from an op name, a message and operand types.
    pub fn type_error(
        op: impl Into<String>,
        message: impl Into<String>,
        operands: &[&crate::ir::TensorType],
    ) -> Self {
        let operands = operands
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        Error::Type {
            op: op.into(),
            message: message.into(),
            operands,
        }
    }

    /// Wraps `source` with the op (and its result type) it was raised at; see [`Error::AtOp`].
    pub fn at_op(
        action: &'static str,
        op: impl Into<String>,
        ty: &crate::ir::TensorType,
        source: Error,
    ) -> Self {
        Error::AtOp {
            action,
            op: op.into(),
            ty: ty.to_string(),
            source: Box::new(source),
        }
    }

    /// The innermost error under any [`Error::AtOp`] context, for matching on what went wrong.
    pub fn root(&self) -> &Error {
        let mut e = self;
        while let Error::AtOp { source, .. } = e {
            e = source;
        }
        e
    }

    /// Wraps an I/O error with the file it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};

    #[test]
    fn context_layers_keep_the_variant() {
        let ty = TensorType::new(DType::F32, [2]);
        let inner = Error::type_error("add", "shapes differ", &[&ty, &ty]);
        let e = Error::at_op("evaluating", "add", &ty, inner);
        let e = Error::at_op("differentiating", "exp", &ty, e);
        assert!(matches!(e.root(), Error::Type { op, .. } if op == "add"));
        assert_eq!(
            e.to_string(),
            "differentiating exp -> f32[2]: evaluating add -> f32[2]: add: shapes differ \
             (operands: f32[2], f32[2])"
        );
        assert!(std::error::Error::source(&e).is_some());
    }
}
