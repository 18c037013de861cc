//! Istio's HTTP/2 and TLS tuning for HBONE, client and server side.

use std::time::Duration;

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
