//! Why an outbound HBONE connect failed.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    #[error("TLS to {peer} failed: {source}")]
    Tls { peer: String, source: io::Error },
    #[error("HTTP/2 error with {peer}: {source}")]
    H2 { peer: String, source: h2::Error },
    #[error("CONNECT {authority} answered {status}")]
    Status {
        authority: String,
        status: http::StatusCode,
    },
    #[error("cannot reach {peer}: {source}")]
    Connect {
        peer: String,
        source: crate::netns::NetnsError,
    },
    #[error(
        "HBONE to {peer} did not complete within the connect timeout ({after:?}: TCP, TLS, HTTP/2 and the CONNECT answer); \
         check that the peer's ztunnel is alive, or raise CONNECT_TIMEOUT_MS"
    )]
    Timeout {
        peer: String,
        after: std::time::Duration,
    },
    #[error("HBONE connection to {peer} failed while this request waited for it: {reason}")]
    DialFailed { peer: String, reason: String },
    #[error("no certificate for the source identity: {0}")]
    Cert(#[from] crate::identity::manager::CertError),
    #[error(transparent)]
    TlsConfig(#[from] crate::tls::TlsError),
    #[error("bad CONNECT request: {0}")]
    Request(#[from] http::Error),
}
