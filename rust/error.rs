//! The crate's one error type; the Python layer maps each variant to an exception in one place.
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// An argument is out of its domain; the message names the argument and its value.
    #[error("{0}")]
    InvalidArgument(String),
    /// A request id the index has no chain for.
    #[error("unknown request id {0:?}")]
    UnknownRequest(String),
    /// A request id used for a prompt that does not extend the tokens already hashed for it (the id was reused
    /// without `forget`).
    #[error("request {request:?} was hashed for another prompt: {reason}; a request's tokens may only grow until it is forgotten")]
    PromptMismatch { request: String, reason: String },
    /// A ticket id that is not in flight (already completed or aborted, or never issued).
    #[error("unknown ticket {0}")]
    UnknownTicket(u64),
    /// A lookup's pages or state were evicted before the load began.
    #[error("lookup of request {0:?} is stale: its pages or state left the host pool")]
    Stale(String),
    /// kvtier's own state refuses the call (the host pool is closed, a slot is not usable yet): kvtier's failure,
    /// never the caller's.
    #[error("{0}")]
    State(String),
    /// An internal consistency check failed (never expected; reported rather than panicking).
    #[error("invariant violated: {0}")]
    Invariant(String),
    /// A copy could not be launched or failed (CUDA error string or OS error).
    #[error("{0}")]
    Copy(String),
    /// An engine callback failed during a call (the binding raises the callback's own exception).
    #[error("an engine callback failed: {0}")]
    Hook(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for an `InvalidArgument` error.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
