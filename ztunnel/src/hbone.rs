//! HBONE: TCP tunnelled as HTTP/2 CONNECT streams inside mTLS, port 15008.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

const COPY_BUF: usize = 64 * 1024;

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
    #[error(
        "HBONE to {peer} did not complete within the connect timeout ({after:?}: TCP, TLS, HTTP/2 and the CONNECT answer); \
         check that the peer's ztunnel is alive, or raise CONNECT_TIMEOUT_MS"
    )]
    Timeout { peer: String, after: std::time::Duration },
    #[error("HBONE connection to {peer} failed while this request waited for it: {reason}")]
    DialFailed { peer: String, reason: String },
    #[error("no certificate for the source identity: {0}")]
    Cert(#[from] crate::identity::manager::CertError),
    #[error(transparent)]
    TlsConfig(#[from] crate::tls::TlsError),
    #[error("bad CONNECT request: {0}")]
    Request(#[from] http::Error),
}

/// How a tunnelled copy ended.
#[derive(Debug, Default, Clone, Copy)]
pub struct Transferred {
    /// bytes from the TCP side into the tunnel
    pub sent: u64,
    /// bytes from the tunnel to the TCP side
    pub received: u64,
}

/// Which side broke a tunnel, so the other side can be reset rather than closed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("TCP side failed: {0}")]
    Tcp(io::Error),
    #[error("tunnel stream failed: {0}")]
    Stream(h2::Error),
    #[error("closed: authorization policy now denies this connection")]
    Revoked,
    #[error("closed: no bytes either way for longer than the idle timeout")]
    Idle,
}

/// Completes once neither counter has moved for `timeout` (checked every `timeout`, so
/// an idle connection ends within twice the timeout); never without a timeout.
pub(crate) async fn idle_watchdog(counters: [&AtomicU64; 2], timeout: Option<Duration>) {
    let Some(timeout) = timeout.filter(|t| !t.is_zero()) else {
        return std::future::pending().await;
    };
    let total = || counters.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
    let mut last = total();
    loop {
        tokio::time::sleep(timeout).await;
        let now = total();
        if now == last {
            return;
        }
        last = now;
    }
}

/// Copies both ways between a TCP connection and an HTTP/2 stream until both directions
/// end. EOF becomes END_STREAM (and END_STREAM a write shutdown), so half-close carries
/// through. An error on one side resets the other: RST_STREAM towards the tunnel, or the
/// caller resets the TCP connection (see [`CopyError`]).
///
/// It also ends early, with the tunnel reset, when `revoked` completes (a policy change
/// that denies the open connection: [`CopyError::Revoked`]) or when no byte moved either
/// way for `idle` ([`CopyError::Idle`]).
pub async fn copy_tcp_h2(
    tcp: &mut tokio::net::TcpStream,
    mut send: SendStream<Bytes>,
    mut recv: RecvStream,
    revoked: impl std::future::Future<Output = ()>,
    idle: Option<Duration>,
) -> Result<Transferred, (CopyError, Transferred)> {
    let (mut rd, mut wr) = tcp.split();
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let res = {
        let up = tcp_to_h2(&mut rd, &mut send, &sent);
        let down = h2_to_tcp(&mut recv, &mut wr, &received);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
            _ = revoked => Err(CopyError::Revoked),
            _ = idle_watchdog([&sent, &received], idle) => Err(CopyError::Idle),
        }
    };
    let t = Transferred { sent: sent.into_inner(), received: received.into_inner() };
    match res {
        Ok(()) => Ok(t),
        Err(e) => {
            if !matches!(e, CopyError::Stream(_)) {
                send.send_reset(h2::Reason::CANCEL);
            }
            Err((e, t))
        }
    }
}

async fn tcp_to_h2<R: AsyncRead + Unpin>(
    rd: &mut R,
    send: &mut SendStream<Bytes>,
    count: &AtomicU64,
) -> Result<(), CopyError> {
    let mut buf = BytesMut::with_capacity(COPY_BUF);
    loop {
        buf.reserve(COPY_BUF);
        let n = rd.read_buf(&mut buf).await.map_err(CopyError::Tcp)?;
        if n == 0 {
            send.send_data(Bytes::new(), true).map_err(CopyError::Stream)?;
            return Ok(());
        }
        let mut chunk = buf.split().freeze();
        count.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let cap = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Err(CopyError::Stream(e)),
                None => return Err(CopyError::Stream(h2::Error::from(h2::Reason::CANCEL))),
            };
            if cap == 0 {
                continue;
            }
            let part = chunk.split_to(cap.min(chunk.len()));
            send.send_data(part, false).map_err(CopyError::Stream)?;
        }
    }
}

async fn h2_to_tcp<W: AsyncWrite + Unpin>(
    recv: &mut RecvStream,
    wr: &mut W,
    count: &AtomicU64,
) -> Result<(), CopyError> {
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.map_err(CopyError::Stream)?;
        let n = chunk.len();
        wr.write_all(&chunk).await.map_err(CopyError::Tcp)?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        // Return flow-control credit only once the bytes are written, so a slow reader
        // pushes back on the sender instead of growing our buffers.
        let _ = recv.flow_control().release_capacity(n);
    }
    // A stream that ends with RST_STREAM yields an error above; None here is END_STREAM.
    wr.shutdown().await.map_err(CopyError::Tcp)?;
    Ok(())
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

/// Relays between two HBONE streams (a waypoint's downstream and upstream) until both
/// directions end: END_STREAM carries over as END_STREAM, a reset on one side resets
/// the other. Credit is returned to each sender only once its bytes were sent on.
pub async fn copy_h2_h2(
    down_send: SendStream<Bytes>,
    down_recv: RecvStream,
    up_send: SendStream<Bytes>,
    up_recv: RecvStream,
) -> Result<Transferred, (h2::Error, Transferred)> {
    let mut t = Transferred::default();
    let (mut ds, mut dr, mut us, mut ur) = (down_send, down_recv, up_send, up_recv);
    let r = tokio::try_join!(h2_to_h2(&mut dr, &mut us, &mut t.sent), h2_to_h2(&mut ur, &mut ds, &mut t.received));
    match r {
        Ok(_) => Ok(t),
        Err(e) => {
            ds.send_reset(h2::Reason::CANCEL);
            us.send_reset(h2::Reason::CANCEL);
            Err((e, t))
        }
    }
}

async fn h2_to_h2(recv: &mut RecvStream, send: &mut SendStream<Bytes>, count: &mut u64) -> Result<(), h2::Error> {
    while let Some(chunk) = recv.data().await {
        let mut chunk = chunk?;
        let n = chunk.len();
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let cap = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(c) => c?,
                None => return Err(h2::Error::from(h2::Reason::CANCEL)),
            };
            if cap == 0 {
                continue;
            }
            send.send_data(chunk.split_to(cap.min(chunk.len())), false)?;
        }
        *count += n as u64;
        let _ = recv.flow_control().release_capacity(n);
    }
    send.send_data(Bytes::new(), true)
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
