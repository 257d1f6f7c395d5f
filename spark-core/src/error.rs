//! The error type shared by spark-core and the backends: a kind (stable numeric code, for the C
//! ABI) plus a message that names the file, field or value at fault.

use std::fmt;

/// What went wrong, as a stable code that can cross a C ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorKind {
    /// Bad user input: a config field, an argument, a token id, a sequence position.
    InvalidInput = 1,
    /// A model file is missing, truncated or malformed.
    BadModel = 2,
    /// The request needs more memory (KV cache, context) than was planned.
    OutOfMemory = 3,
    /// The feature is not implemented by this engine or backend.
    Unsupported = 4,
    /// I/O failure.
    Io = 5,
    /// A backend/device failure.
    Backend = 6,
    /// A bug: an internal invariant did not hold.
    Internal = 7,
}

/// spark's error: a kind and a human-readable message.
#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }
    pub fn model(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadModel, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::new(ErrorKind::Io, e.to_string())
    }
}

/// Result with spark's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Build an [`Error`] of kind `InvalidInput` from a format string and return it.
#[macro_export]
macro_rules! bail_invalid {
    ($($arg:tt)*) => { return Err($crate::error::Error::invalid(format!($($arg)*))) };
}
