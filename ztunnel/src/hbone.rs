//! HBONE: TCP tunnelled as HTTP/2 CONNECT streams inside mTLS, port 15008.

use std::io;
use std::time::Duration;

use bytes::Bytes;

pub mod guard;
pub mod pool;
pub mod server;
pub mod stream;

pub use pool::{Pool, PoolKey, StreamGuard};
pub use stream::H2Stream;

/// Istio's HTTP/2 tuning for HBONE.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
pub const MAX_FRAME: u32 = 1024 * 1024;
pub const SERVER_MAX_STREAMS: u32 = 200;
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Plaintext rustls accepts while earlier TLS records still wait for the socket. rustls's
/// default (64 KiB) is just under one full copy chunk plus its HTTP/2 frame header, so
/// each 64 KiB chunk left as two writev(2)s, the second a 9-byte record (measured: half
/// the writevs of a bulk transfer). Bounded still; HTTP/2 flow control, not this, is what
/// holds a fast sender back.
pub const TLS_SEND_BUFFER_LIMIT: usize = 256 * 1024;

/// Applies HBONE's TLS session tuning once the handshake is done.
pub fn tune_tls<D>(conn: &mut rustls::ConnectionCommon<D>) {
    conn.set_buffer_limit(Some(TLS_SEND_BUFFER_LIMIT));
}

#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    #[error("TLS to {peer} failed: {source}")]
    Tls { peer: String, source: io::Error },
    #[error("HTTP/2 error with {peer}: {source}")]
    H2 { peer: String, source: h2::Error },
    #[error("CONNECT {authority} answered {status}")]
    Status { authority: String, status: http::StatusCode },
    #[error("cannot reach {peer}: {source}")]
    Connect { peer: String, source: crate::netns::NetnsError },
    #[error("HBONE connection to {peer} failed while this request waited for it: {reason}")]
    DialFailed { peer: String, reason: String },
    #[error("no certificate for the source identity: {0}")]
    Cert(#[from] crate::identity::manager::CertError),
    #[error(transparent)]
    TlsConfig(#[from] crate::tls::TlsError),
    #[error("bad CONNECT request: {0}")]
    Request(#[from] http::Error),
}

/// Largest header block an HBONE peer may send (HPACK-decoded size).
pub const MAX_HEADER_BYTES: u32 = 16 * 1024;

/// The HTTP/2 server side of HBONE with Istio's tuning (ztunnel's inbound, the waypoint):
/// at most `max_streams` concurrent streams per connection (more are refused with
/// REFUSED_STREAM) and `max_header_bytes` of headers per request.
pub fn server_builder(max_streams: u32, max_header_bytes: u32) -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(max_streams)
        .max_header_list_size(max_header_bytes)
        // Rapid reset: streams reset before we accept them count here; past the bound
        // the connection gets GOAWAY ENHANCE_YOUR_CALM (h2's default is 20).
        .max_pending_accept_reset_streams(20);
    b
}

/// Why an HBONE request is refused before anything else looks at it (answered 400).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadConnect {
    #[error("HBONE request is {0}, not CONNECT")]
    NotConnect(String),
    #[error("CONNECT authority {0:?} is not ip:port")]
    BadAuthority(String),
}

/// The target of an HBONE request: it must be `CONNECT ip:port` (IPv6 in brackets).
/// Anything else, headers included, is never used to decide where a tunnel goes.
pub fn connect_target<B>(req: &http::Request<B>) -> Result<std::net::SocketAddr, BadConnect> {
    if req.method() != http::Method::CONNECT {
        return Err(BadConnect::NotConnect(req.method().to_string()));
    }
    req.uri()
        .authority()
        .and_then(|a| a.as_str().parse().ok())
        .ok_or_else(|| BadConnect::BadAuthority(req.uri().to_string()))
}

/// Whether an HTTP/2 connection error means the peer misbehaved, and how (a bounded
/// metric label): floods of empty DATA frames (our guard), floods h2 cuts off with GOAWAY
/// ENHANCE_YOUR_CALM (rapid reset, CONTINUATION floods), and other protocol violations
/// h2 answers with GOAWAY. A peer that just went away is not abuse.
pub fn protocol_abuse(e: &h2::Error) -> Option<&'static str> {
    if e.get_io().is_some_and(guard::is_flood) {
        return Some("empty_data_flood");
    }
    match e.reason() {
        Some(h2::Reason::ENHANCE_YOUR_CALM) => Some("h2_flood"),
        Some(h2::Reason::NO_ERROR) | Some(h2::Reason::CANCEL) | None => None,
        Some(_) if e.is_go_away() || e.is_library() => Some("h2_protocol"),
        Some(_) => None,
    }
}

/// Answers a CONNECT stream with a bodyless status (400/401/503...).
pub fn respond_status(mut tx: h2::server::SendResponse<Bytes>, status: http::StatusCode) {
    let resp = http::Response::builder().status(status).body(()).unwrap_or_default();
    let _ = tx.send_response(resp, true);
}

/// W3C traceparent with fresh ids for one tunnelled connection.
pub fn traceparent() -> String {
    let trace: u128 = rand::random();
    let span: u64 = rand::random();
    format!("00-{trace:032x}-{span:016x}-01")
}

#[cfg(test)]
mod connect_tests {
    use super::*;

    #[test]
    fn connect_targets() {
        let req = |m: &str, uri: &str| http::Request::builder().method(m).uri(uri).body(()).unwrap();
        assert_eq!(connect_target(&req("CONNECT", "10.0.0.1:8080")), Ok("10.0.0.1:8080".parse().unwrap()));
        assert_eq!(connect_target(&req("CONNECT", "[fd00::1]:80")), Ok("[fd00::1]:80".parse().unwrap()));
        assert!(matches!(connect_target(&req("GET", "http://10.0.0.1:80/")), Err(BadConnect::NotConnect(_))));
        for bad in ["echo.default:80", "10.0.0.1", "10.0.0.1:99999", "user@10.0.0.1:80"] {
            assert!(matches!(connect_target(&req("CONNECT", bad)), Err(BadConnect::BadAuthority(_))), "{bad}");
        }
    }
}
