//! Replies the waypoint makes itself (denied, no route, no upstream, timeout...), as
//! plain text or, to gRPC clients, as a gRPC status.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;

use super::body::{empty, full, Metered};
use super::log::RequestLog;
use crate::upstream::Body;

/// A reply decided before anything was sent upstream (or after every attempt failed).
#[derive(Debug)]
pub struct LocalReply {
    pub status: StatusCode,
    /// Envoy's response flags for the log (`DENY`, `NR`, `UH`...).
    pub flags: &'static str,
    pub message: String,
    /// A route's redirect: the reply is plain HTTP (even to gRPC clients) with this
    /// `Location`.
    pub redirect: Option<String>,
    /// A refused JWT: the RFC 6750 challenge (`Bearer realm=..., error="invalid_token"`).
    pub www_authenticate: Option<String>,
    /// An external authorizer's denial: its body (sent as is, not `message`) and headers.
    pub external: Option<Box<(HeaderMap, Bytes)>>,
    /// Set on the reply whatever it is: a rule's CORS headers (an allowed origin's, or a
    /// preflight's answer).
    pub headers: Option<Box<HeaderMap>>,
    /// Plain HTTP even to gRPC clients: a preflight's answer is no error.
    pub plain: bool,
}

impl super::stream_idle::StreamIdle {
    /// Envoy's local reply for a stream idle timeout: `stream timeout`, flag `SI`, with
    /// the status the stream's state gives (`StreamIdle::status`).
    pub fn reply(&self) -> LocalReply {
        LocalReply::new(self.status(), "SI", super::stream_idle::MESSAGE)
    }
}

impl LocalReply {
    pub fn new(status: StatusCode, flags: &'static str, message: impl Into<String>) -> Self {
        LocalReply {
            status,
            flags,
            message: message.into(),
            redirect: None,
            www_authenticate: None,
            external: None,
            headers: None,
            plain: false,
        }
    }

    /// A CORS preflight's answer: 200, no body, `headers` (plain HTTP even to a gRPC
    /// client: it is no error).
    pub fn preflight(headers: HeaderMap) -> Self {
        LocalReply {
            external: Some(Box::new((HeaderMap::new(), Bytes::new()))),
            headers: Some(Box::new(headers)),
            plain: true,
            ..LocalReply::new(StatusCode::OK, "-", "CORS preflight")
        }
    }

    /// The answer to an HTTP/1.0 request when HTTP/1.0 is not accepted (PILOT_HTTP10
    /// unset), as Envoy's HTTP/1 codec gives it: 426 `Upgrade Required`, connection closed.
    pub fn http10_refused() -> Self {
        let mut close = HeaderMap::new();
        close.insert(header::CONNECTION, HeaderValue::from_static("close"));
        LocalReply {
            headers: Some(Box::new(close)),
            plain: true,
            ..LocalReply::new(StatusCode::UPGRADE_REQUIRED, "-", "Upgrade Required")
        }
    }

    /// A VirtualService's `directResponse`: the status and body as configured
    /// (`text/plain` when there is a body, as Envoy's local replies); a gRPC client gets
    /// the status's gRPC code with the body as its message, as Envoy converts it.
    pub fn direct(status: StatusCode, body: Bytes) -> Self {
        let mut headers = HeaderMap::new();
        if !body.is_empty() {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        }
        let message = String::from_utf8_lossy(&body).into_owned();
        LocalReply {
            external: Some(Box::new((headers, body))),
            ..LocalReply::new(status, "-", message)
        }
    }

    /// The same reply with `headers` set on it too (a rule's CORS headers).
    pub fn with_headers(mut self, headers: Option<&HeaderMap>) -> Self {
        if let Some(h) = headers {
            let mine = self.headers.get_or_insert_with(Default::default);
            for (name, value) in h {
                mine.insert(name.clone(), value.clone());
            }
        }
        self
    }

    /// The response, which writes `log` when it has been sent.
    pub fn send(mut self, log: RequestLog, grpc: bool) -> Response<Body> {
        let headers = self.headers.take();
        let mut resp = self.response(log, grpc);
        for (name, value) in headers.iter().flat_map(|h| h.iter()) {
            resp.headers_mut().insert(name.clone(), value.clone());
        }
        resp
    }

    fn response(self, mut log: RequestLog, grpc: bool) -> Response<Body> {
        let grpc = grpc && !self.plain;
        if let Some(ext) = self.external {
            let (headers, body) = *ext;
            let mut resp = if grpc {
                local_reply(log, true, self.status, self.flags, &self.message)
            } else {
                log.status = self.status.as_u16();
                log.response_flags = self.flags;
                let mut r = Response::new(full(body.clone()));
                *r.status_mut() = self.status;
                r.headers_mut()
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
                r.map(|b| Metered::new(b, log, None).boxed())
            };
            for (name, value) in &headers {
                if name != header::CONTENT_LENGTH {
                    resp.headers_mut().append(name.clone(), value.clone());
                }
            }
            return resp;
        }
        let Some(location) = self.redirect else {
            let mut resp = local_reply(log, grpc, self.status, self.flags, &self.message);
            if let Some(v) = self
                .www_authenticate
                .and_then(|c| HeaderValue::from_str(&c).ok())
            {
                resp.headers_mut().insert(header::WWW_AUTHENTICATE, v);
            }
            return resp;
        };
        let mut resp = local_reply(log, false, self.status, self.flags, &self.message);
        if let Ok(v) = HeaderValue::from_str(&location) {
            resp.headers_mut().insert(header::LOCATION, v);
        }
        resp
    }
}

pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// HTTP status -> gRPC status for locally generated replies to gRPC clients (the
/// mapping Envoy uses).
fn grpc_status_for(status: StatusCode) -> u8 {
    match status.as_u16() {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502..=504 => 14,
        _ => 2,
    }
}

/// A reply made by the waypoint itself (denied, no route, no upstream, timeout...).
fn local_reply(
    mut log: RequestLog,
    grpc: bool,
    status: StatusCode,
    flags: &'static str,
    message: &str,
) -> Response<Body> {
    log.status = status.as_u16();
    log.response_flags = flags;
    let mut resp = if grpc {
        // gRPC clients read errors from grpc-status, in a trailers-only response (HTTP
        // 200 on the wire, which is what Istio's metrics report too).
        let code = grpc_status_for(status);
        log.grpc_status = Some(ztunnel::metrics::http::grpc_status(&code.to_string()));
        log.status = 200;
        let mut r = Response::new(empty());
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        r.headers_mut()
            .insert("grpc-status", HeaderValue::from(u16::from(code)));
        if let Ok(v) = HeaderValue::from_str(message) {
            r.headers_mut().insert("grpc-message", v);
        }
        r
    } else {
        let mut r = Response::new(full(format!("{message}\n")));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    let bytes = if grpc { 0 } else { message.len() as u64 + 1 };
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes));
    if grpc {
        resp.headers_mut().remove(header::CONTENT_LENGTH);
    }
    resp.map(|b| Metered::new(b, log, None).boxed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_local_replies_map_status() {
        assert_eq!(grpc_status_for(StatusCode::FORBIDDEN), 7);
        assert_eq!(grpc_status_for(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(grpc_status_for(StatusCode::NOT_FOUND), 12);
    }
}
