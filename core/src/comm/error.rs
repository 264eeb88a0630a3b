//! The communication layer's error type.

/// Everything a collective, the store or a rendezvous can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The caller passed something no rank could run (wrong sizes, unsupported dtype...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Two ranks entered the same collective with different ops, shapes or dtypes.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// A peer's connection closed or failed, usually because that rank died.
    #[error("lost rank {rank}: {reason}")]
    PeerLost {
        /// The rank whose connection was lost.
        rank: usize,
        /// What the socket said (closed, reset...).
        reason: String,
    },
    /// A wait exceeded its deadline.
    #[error("timed out after {seconds:.1} s waiting for {what}")]
    Timeout {
        /// What was awaited (a store key, a peer, a collective).
        what: String,
        /// The deadline that passed, in seconds.
        seconds: f64,
    },
    /// The store refused the connection or answered with an error.
    #[error("store: {0}")]
    Store(String),
    /// A socket or file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done (connecting to an address, reading a file...).
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// An operation whose original error was already returned to another waiter.
    #[error("{0}")]
    Failed(String),
    /// The NCCL backend failed or is unavailable.
    #[error("nccl: {0}")]
    Nccl(String),
}

impl CommError {
    /// Wraps an I/O error with what was being done when it happened.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source,
        }
    }
}
