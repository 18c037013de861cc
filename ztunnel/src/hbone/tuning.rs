//! Istio's HTTP/2 and TLS tuning for HBONE, client and server side.

use std::time::Duration;

/// Istio's HTTP/2 tuning for HBONE (the defaults of [`H2Sizes`]).
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
pub const MAX_FRAME: u32 = 1024 * 1024;

/// HBONE's HTTP/2 window and frame sizes (Istio's `HTTP2_STREAM_WINDOW_SIZE`,
/// `HTTP2_CONNECTION_WINDOW_SIZE`, `HTTP2_FRAME_SIZE`), set once at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2Sizes {
    pub stream_window: u32,
    pub connection_window: u32,
    pub max_frame: u32,
}

impl Default for H2Sizes {
    fn default() -> Self {
        H2Sizes {
            stream_window: STREAM_WINDOW,
            connection_window: CONNECTION_WINDOW,
            max_frame: MAX_FRAME,
        }
    }
}

/// What HTTP/2 (RFC 9113 6.5.2) allows: a frame size of 2^14 to 2^24 - 1 and windows of
/// at most 2^31 - 1. h2 panics outside these, so they are checked before use.
pub const FRAME_RANGE: std::ops::RangeInclusive<u32> = 16_384..=16_777_215;
pub const MAX_WINDOW: u32 = (1 << 31) - 1;

static SIZES: std::sync::OnceLock<H2Sizes> = std::sync::OnceLock::new();

/// Sets the sizes for the process (before any HBONE connection); later calls are ignored.
pub fn set_h2_sizes(sizes: H2Sizes) {
    let _ = SIZES.set(sizes);
}

pub fn h2_sizes() -> H2Sizes {
    SIZES.get().copied().unwrap_or_default()
}
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
    let sizes = h2_sizes();
    let mut b = h2::server::Builder::new();
    b.initial_window_size(sizes.stream_window)
        .initial_connection_window_size(sizes.connection_window)
        .max_frame_size(sizes.max_frame)
        .max_concurrent_streams(max_streams)
        .max_header_list_size(max_header_bytes)
        // Rapid reset: streams reset before we accept them count here; past the bound
        // the connection gets GOAWAY ENHANCE_YOUR_CALM (h2's default is 20).
        .max_pending_accept_reset_streams(20);
    b
}
