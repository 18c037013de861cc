//! Errors of ZDS, both sides.

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("cannot connect to the ZDS socket {path}: {source}; is the CNI agent running?")]
    Connect { path: String, source: nix::Error },
    #[error("cannot listen on the ZDS socket {path}: {source}")]
    Listen { path: String, source: nix::Error },
    #[error("ZDS socket I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZDS peer closed the connection")]
    Closed,
    #[error("malformed ZDS message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("ZDS message has no payload")]
    Empty,
    #[error("ZDS Add for {0} came without a network namespace file descriptor")]
    MissingNetns(String),
}
