//! WebSocket through the waypoint, as Envoy's `upgrade_configs: websocket` (on by default
//! in Istio): an HTTP/1.1 `Upgrade: websocket` or an HTTP/2 extended CONNECT with
//! `:protocol websocket` (RFC 8441) is planned like any request (policies and routes
//! see it as `GET` with `upgrade: websocket`, whatever the client's version), sent to
//! the backend in the backend's version (HTTP/1.1 upgrade or extended CONNECT), and on
//! success (101, or 200 to a CONNECT) the bytes are relayed both ways until each side
//! has closed. Other upgrade tokens (`h2c`...) are dropped as hop-by-hop headers.

use std::io;
use std::sync::atomic::Ordering;

use base64::Engine as _;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use hyper::body::Incoming;
use hyper::ext::Protocol;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::body::empty;
use super::log::RequestLog;
use crate::lb::Picked;
use crate::upstream::Body;

/// RFC 6455 4.2.2: the GUID the `Sec-WebSocket-Accept` hash appends to the key.
const WS_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
const SEC_KEY: &str = "sec-websocket-key";
const SEC_ACCEPT: &str = "sec-websocket-accept";
/// Each direction's relay buffer.
const RELAY_BUFFER: usize = 64 * 1024;

/// A planned WebSocket: what the response translation needs from the request.
#[derive(Debug, Clone)]
pub struct WebSocket {
    /// The client spoke HTTP/2 (extended CONNECT: success is 200, no accept hash).
    pub client_http2: bool,
    /// The upstream speaks HTTP/2 (extended CONNECT: success is 200).
    pub upstream_http2: bool,
    /// The HTTP/1.1 client's key, to answer its accept hash when the backend (over
    /// HTTP/2) gives none.
    pub client_key: Option<HeaderValue>,
}

fn has_token(h: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Whether the request asks for a WebSocket; an HTTP/2 extended CONNECT is rewritten to
/// the HTTP/1.1 form (`GET`, `upgrade: websocket`) so that policies and routes see one
/// request whatever the client's version (Envoy's codecs do the same). Call before the
/// hop-by-hop headers are stripped.
pub fn detect(parts: &mut http::request::Parts) -> bool {
    if parts.method == Method::CONNECT {
        let ws = parts
            .extensions
            .get::<Protocol>()
            .is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket"));
        if ws {
            parts.method = Method::GET;
            parts.extensions.remove::<Protocol>();
        }
        return ws;
    }
    parts.version == http::Version::HTTP_11
        && has_token(&parts.headers, header::CONNECTION, "upgrade")
        && has_token(&parts.headers, header::UPGRADE, "websocket")
}

/// After the hop-by-hop headers were stripped: `upgrade: websocket` back, for policies
/// and routes to match as Envoy's do.
pub fn mark(h: &mut HeaderMap) {
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
}

/// Rewrites the planned head for the upstream's version: an HTTP/1.1 upgrade (with a
/// key when the HTTP/2 client sent none: RFC 8441 clients don't, RFC 6455 servers
/// require one) or an extended CONNECT.
pub fn set_upstream_head(
    parts: &mut http::request::Parts,
    client_http2: bool,
    upstream_http2: bool,
) -> WebSocket {
    let client_key = if client_http2 {
        None
    } else {
        parts.headers.get(SEC_KEY).cloned()
    };
    if upstream_http2 {
        parts.method = Method::CONNECT;
        parts.extensions.insert(Protocol::from_static("websocket"));
        for h in [header::UPGRADE.as_str(), SEC_KEY] {
            parts.headers.remove(h);
        }
    } else {
        parts.method = Method::GET;
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts
            .headers
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if !parts.headers.contains_key(SEC_KEY) {
            let key: [u8; 16] = rand::random();
            if let Ok(v) =
                HeaderValue::from_str(&base64::engine::general_purpose::STANDARD.encode(key))
            {
                parts.headers.insert(SEC_KEY, v);
            }
        }
    }
    WebSocket {
        client_http2,
        upstream_http2,
        client_key,
    }
}

/// RFC 6455 4.2.2: base64(SHA-1(key + GUID)).
pub fn accept_for(key: &[u8]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key);
    ctx.update(WS_GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(ctx.finish().as_ref())
}

impl WebSocket {
    /// Whether the backend took the upgrade: 101 over HTTP/1.1, 2xx to a CONNECT.
    pub fn accepted(&self, resp: &Response<Incoming>) -> bool {
        if self.upstream_http2 {
            resp.status().is_success() && resp.extensions().get::<OnUpgrade>().is_some()
        } else {
            resp.status() == StatusCode::SWITCHING_PROTOCOLS
                && resp.extensions().get::<OnUpgrade>().is_some()
        }
    }

    /// The backend's accepted head (hop-by-hop headers already stripped) as the client's
    /// version says success: 101 with the upgrade headers and accept hash, or 200.
    pub fn client_head(&self, parts: &mut http::response::Parts) {
        parts.headers.remove(header::CONTENT_LENGTH);
        if self.client_http2 {
            parts.status = StatusCode::OK;
            parts.headers.remove(SEC_ACCEPT);
            return;
        }
        parts.status = StatusCode::SWITCHING_PROTOCOLS;
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts
            .headers
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if self.upstream_http2 {
            match self
                .client_key
                .as_ref()
                .and_then(|k| HeaderValue::from_str(&accept_for(k.as_bytes())).ok())
            {
                Some(v) => {
                    parts.headers.insert(SEC_ACCEPT, v);
                }
                None => {
                    parts.headers.remove(SEC_ACCEPT);
                }
            }
        }
    }
}

/// The accepted upgrade's response to the client; the relay starts once both sides have
/// switched, and writes the log (101 or 200, bytes both ways) when both have closed.
pub fn relay(
    client: OnUpgrade,
    backend: OnUpgrade,
    mut rparts: http::response::Parts,
    ws: &WebSocket,
    mut log: RequestLog,
    picked: Picked,
) -> Response<Body> {
    ws.client_head(&mut rparts);
    rparts.extensions = http::Extensions::new();
    log.status = rparts.status.as_u16();
    tokio::spawn(async move {
        let _picked = picked;
        let (c, b) = tokio::join!(client, backend);
        let (c, b) = match (c, b) {
            (Ok(c), Ok(b)) => (TokioIo::new(c), TokioIo::new(b)),
            (c, b) => {
                // Envoy's flags: the client went away (DC), else the backend's side (UC).
                log.response_flags = if c.is_err() { "DC" } else { "UC" };
                let e = c
                    .err()
                    .or(b.err())
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                tracing::debug!(error = %e, "upgrade did not complete");
                log.error = Some(format!("upgrade failed: {e}"));
                return log.finish(0);
            }
        };
        let ((mut c_read, mut c_write), (mut b_read, mut b_write)) =
            (tokio::io::split(c), tokio::io::split(b));
        let (up, down) = tokio::join!(
            pipe(&mut c_read, &mut b_write),
            pipe(&mut b_read, &mut c_write)
        );
        if let Some(e) = up.1.or(down.1) {
            tracing::debug!(error = %e, "upgraded connection ended with an error");
            log.error = Some(format!("upgraded connection: {e}"));
        }
        log.request_bytes.fetch_add(up.0, Ordering::Relaxed);
        log.finish(down.0);
    });
    Response::from_parts(rparts, empty())
}

/// One direction of the relay, until its reader ends; then the writer is shut down (a
/// half-close), also after a read error, so what was relayed is delivered rather than
/// reset. Returns the bytes relayed and the error that ended it, if any.
async fn pipe<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
) -> (u64, Option<io::Error>) {
    let mut buf = vec![0u8; RELAY_BUFFER];
    let mut n = 0u64;
    let err = loop {
        match r.read(&mut buf).await {
            Ok(0) => break None,
            Ok(k) => {
                if let Err(e) = w.write_all(&buf[..k]).await {
                    // The other side is gone: nothing more can be delivered to it.
                    return (n, Some(e));
                }
                n += k as u64;
            }
            Err(e) => break Some(e),
        }
    };
    let _ = w.shutdown().await;
    (n, err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(r: Request<()>) -> http::request::Parts {
        r.into_parts().0
    }

    #[tokio::test]
    async fn each_relay_direction_counts_and_passes_its_half_close() {
        let (mut client, mut relay_side) = tokio::io::duplex(1024);
        let (mut backend_side, mut backend) = tokio::io::duplex(1024);
        let data = vec![7u8; 300_000];
        let d = data.clone();
        let writer = tokio::spawn(async move {
            client.write_all(&d).await?;
            // The client's half-close; it still reads what the backend sends after.
            client.shutdown().await?;
            let mut back = Vec::new();
            client.read_to_end(&mut back).await?;
            Ok::<_, io::Error>(back)
        });
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            backend.read_to_end(&mut got).await?;
            backend.write_all(b"bye").await?;
            backend.shutdown().await?;
            Ok::<_, io::Error>(got)
        });
        let (mut rr, mut rw) = tokio::io::split(&mut relay_side);
        let (mut br, mut bw) = tokio::io::split(&mut backend_side);
        let (up, down) = tokio::join!(pipe(&mut rr, &mut bw), pipe(&mut br, &mut rw));
        assert_eq!((up.0, up.1.is_none()), (300_000, true));
        assert_eq!((down.0, down.1.is_none()), (3, true));
        assert_eq!(reader.await.expect("join").expect("backend"), data);
        assert_eq!(writer.await.expect("join").expect("client"), b"bye");
    }

    #[test]
    fn the_rfc_6455_accept_hash() {
        // RFC 6455 1.3's example.
        assert_eq!(
            accept_for(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn only_websocket_upgrades_are_detected() {
        let ws = |conn: &str, up: &str| {
            let mut p = parts(
                Request::get("/")
                    .header("connection", conn)
                    .header("upgrade", up)
                    .body(())
                    .expect("request"),
            );
            detect(&mut p)
        };
        assert!(ws("Upgrade", "websocket"));
        assert!(ws("keep-alive, upgrade", "WebSocket"));
        assert!(!ws("upgrade", "h2c"), "h2c stays ignored");
        assert!(
            !ws("keep-alive", "websocket"),
            "no upgrade without Connection: upgrade"
        );
        let mut h10 = parts(
            Request::get("/")
                .version(http::Version::HTTP_10)
                .header("connection", "upgrade")
                .header("upgrade", "websocket")
                .body(())
                .expect("request"),
        );
        assert!(!detect(&mut h10));
    }

    #[test]
    fn an_extended_connect_is_seen_as_a_get() {
        let mut p = parts(
            Request::connect("http://echo/chat")
                .version(http::Version::HTTP_2)
                .body(())
                .expect("request"),
        );
        p.extensions.insert(Protocol::from_static("websocket"));
        assert!(detect(&mut p));
        assert_eq!(p.method, Method::GET);
        assert!(p.extensions.get::<Protocol>().is_none());
        // Plain CONNECT, or another protocol, is no WebSocket (the plan refuses it).
        let mut plain = parts(Request::connect("echo:80").body(()).expect("request"));
        assert!(!detect(&mut plain));
        let mut other = parts(Request::connect("http://echo/").body(()).expect("request"));
        other
            .extensions
            .insert(Protocol::from_static("connect-udp"));
        assert!(!detect(&mut other));
        assert_eq!(other.method, Method::CONNECT);
    }

    #[test]
    fn the_upstream_head_follows_the_upstream_version() {
        // HTTP/2 client -> HTTP/1.1 backend: an upgrade with a fresh key.
        let mut p = parts(Request::get("/chat").body(()).expect("request"));
        let ws = set_upstream_head(&mut p, true, false);
        assert_eq!(
            p.headers.get("upgrade").map(|v| v.as_bytes()),
            Some(&b"websocket"[..])
        );
        assert_eq!(
            p.headers.get("connection").map(|v| v.as_bytes()),
            Some(&b"upgrade"[..])
        );
        let key = p.headers.get(SEC_KEY).map(|v| v.as_bytes().len());
        assert_eq!(key, Some(24), "16 random bytes, base64");
        assert!(ws.client_key.is_none());
        // HTTP/1.1 client -> HTTP/2 backend: extended CONNECT; the key is kept for the accept.
        let mut p = parts(
            Request::get("/chat")
                .header("upgrade", "websocket")
                .header(SEC_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
                .body(())
                .expect("request"),
        );
        let ws = set_upstream_head(&mut p, false, true);
        assert_eq!(p.method, Method::CONNECT);
        assert_eq!(
            p.extensions.get::<Protocol>().map(|p| p.as_str()),
            Some("websocket")
        );
        assert!(p.headers.get("upgrade").is_none() && p.headers.get(SEC_KEY).is_none());
        let mut r = Response::builder()
            .status(200)
            .header("content-length", "0")
            .body(())
            .expect("response")
            .into_parts()
            .0;
        ws.client_head(&mut r);
        assert_eq!(r.status, StatusCode::SWITCHING_PROTOCOLS);
        assert_eq!(
            r.headers.get(SEC_ACCEPT).map(|v| v.as_bytes()),
            Some(&b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="[..])
        );
        assert!(r.headers.get("content-length").is_none());
        // HTTP/1.1 backend's 101 -> HTTP/2 client's 200, without the accept hash.
        let ws = WebSocket {
            client_http2: true,
            upstream_http2: false,
            client_key: None,
        };
        let mut r = Response::builder()
            .status(101)
            .header(SEC_ACCEPT, "x")
            .body(())
            .expect("response")
            .into_parts()
            .0;
        ws.client_head(&mut r);
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.headers.get(SEC_ACCEPT).is_none());
    }
}
