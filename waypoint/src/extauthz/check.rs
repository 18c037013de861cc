//! What a check says and carries, as Envoy's ext_authz filter has it: the gRPC
//! CheckRequest built from a request, gRPC framing, and the reading of an answer into a
//! decision. The exchange itself is the request path's (`http::ext_authz`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::SystemTime;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use prost::Message;
use ztunnel::identity::Identity;

use super::proto::envoy::config::core::v3 as core;
use super::proto::envoy::service::auth::v3 as auth;

/// What the check sees of the request.
pub struct CheckRequest<'a> {
    /// The request head as the backend would get it (trusted headers already set).
    pub parts: &'a http::request::Parts,
    /// Host / :authority as received.
    pub host: &'a str,
    /// The normalized path with the query.
    pub path: &'a str,
    pub client_http2: bool,
    pub source: SocketAddr,
    pub source_principal: &'a Identity,
    /// The address the client sent to (service VIP and port) and who answers for it.
    pub destination: SocketAddr,
    pub destination_principal: &'a Identity,
    /// The request body, when the provider includes it (`includeRequestBodyInCheck`).
    pub body: Option<CheckBody>,
}

/// The body a check carries.
#[derive(Clone, Debug)]
pub struct CheckBody {
    /// At most the provider's `maxRequestBytes` of it.
    pub data: Bytes,
    /// Less than the whole body (Envoy's `x-envoy-auth-partial-body: true`).
    pub partial: bool,
    /// gRPC: in `raw_body` (`packAsBytes`), else in `body` as text.
    pub as_bytes: bool,
}

/// The header Envoy adds to a check that carries the body.
pub const PARTIAL_BODY_HEADER: &str = "x-envoy-auth-partial-body";

/// The authorizer's answer.
#[derive(Debug)]
pub enum Decision {
    Allow(Allowed),
    Deny(Denied),
}

/// Changes an allowing answer makes to the request and to its response.
#[derive(Debug, Default)]
pub struct Allowed {
    /// Set on the request to the backend.
    pub upstream: Vec<(HeaderName, HeaderValue, HeaderMode)>,
    pub remove: Vec<HeaderName>,
    /// Added to the backend's response.
    pub downstream: Vec<(HeaderName, HeaderValue)>,
    /// The check could not be made and the provider fails open.
    pub failed_open: Option<String>,
}

/// How an answer's header joins the headers already there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderMode {
    Overwrite,
    Append,
    AddIfAbsent,
    OverwriteIfExists,
}

impl HeaderMode {
    /// In an ext_authz answer the deprecated `append` is false unless set, and an
    /// unset `append_action` does not turn that into appending (Envoy's reading).
    fn of(o: &core::HeaderValueOption) -> HeaderMode {
        use core::header_value_option::HeaderAppendAction as A;
        if let Some(append) = o.append {
            return if append {
                HeaderMode::Append
            } else {
                HeaderMode::Overwrite
            };
        }
        match A::try_from(o.append_action) {
            Ok(A::AddIfAbsent) => HeaderMode::AddIfAbsent,
            Ok(A::OverwriteIfExists) => HeaderMode::OverwriteIfExists,
            _ => HeaderMode::Overwrite,
        }
    }

    pub fn apply(self, headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
        match self {
            HeaderMode::Overwrite => {
                headers.insert(name, value);
            }
            HeaderMode::Append => {
                headers.append(name, value);
            }
            HeaderMode::AddIfAbsent => {
                headers.entry(name).or_insert(value);
            }
            HeaderMode::OverwriteIfExists => {
                if headers.contains_key(&name) {
                    headers.insert(name, value);
                }
            }
        }
    }
}

/// The reply a denying answer (or a failed check) makes.
#[derive(Debug)]
pub struct Denied {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Why the check failed, when it did not answer (the reply is statusOnError's).
    pub error: Option<String>,
}

fn addr(a: SocketAddr) -> core::Address {
    core::Address {
        address: Some(core::address::Address::SocketAddress(core::SocketAddress {
            protocol: core::socket_address::Protocol::Tcp as i32,
            address: a.ip().to_string(),
            port_specifier: Some(core::socket_address::PortSpecifier::PortValue(u32::from(
                a.port(),
            ))),
        })),
    }
}

/// The CheckRequest Envoy's network ext_authz filter sends for a TCP connection: the
/// peers (addresses and the principals of their certificates) and no request.
pub fn tcp_check_message(
    source: SocketAddr,
    source_principal: &Identity,
    destination: SocketAddr,
    destination_principal: &Identity,
) -> auth::CheckRequest {
    auth::CheckRequest {
        attributes: Some(auth::AttributeContext {
            source: Some(auth::attribute_context::Peer {
                address: Some(addr(source)),
                principal: source_principal.to_string(),
                ..Default::default()
            }),
            destination: Some(auth::attribute_context::Peer {
                address: Some(addr(destination)),
                principal: destination_principal.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// The CheckRequest Envoy sends for an HTTP request.
pub fn check_message(req: &CheckRequest<'_>) -> auth::CheckRequest {
    // Header values of one name are joined with "," (Envoy's merge); keys lowercase.
    let mut headers: HashMap<String, String> = HashMap::new();
    for (name, value) in &req.parts.headers {
        let v = String::from_utf8_lossy(value.as_bytes()).into_owned();
        headers
            .entry(name.as_str().to_string())
            .and_modify(|e| {
                e.push(',');
                e.push_str(&v);
            })
            .or_insert(v);
    }
    if let Some(b) = &req.body {
        headers.insert(PARTIAL_BODY_HEADER.into(), b.partial.to_string());
    }
    headers.insert(":authority".into(), req.host.to_string());
    headers.insert(":method".into(), req.parts.method.to_string());
    headers.insert(":path".into(), req.path.to_string());
    let size = req
        .parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(-1);
    let id = req
        .parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    auth::CheckRequest {
        attributes: Some(auth::AttributeContext {
            source: Some(auth::attribute_context::Peer {
                address: Some(addr(req.source)),
                principal: req.source_principal.to_string(),
                ..Default::default()
            }),
            destination: Some(auth::attribute_context::Peer {
                address: Some(addr(req.destination)),
                principal: req.destination_principal.to_string(),
                ..Default::default()
            }),
            request: Some(auth::attribute_context::Request {
                time: Some(prost_types::Timestamp::from(SystemTime::now())),
                http: Some(auth::attribute_context::HttpRequest {
                    id,
                    method: req.parts.method.to_string(),
                    headers,
                    path: req.path.to_string(),
                    host: req.host.to_string(),
                    scheme: "http".into(),
                    size,
                    protocol: if req.client_http2 {
                        "HTTP/2"
                    } else {
                        "HTTP/1.1"
                    }
                    .into(),
                    // Envoy puts the body in `body` as text (bytes that are not UTF-8
                    // replaced here: a protobuf string must be UTF-8) or, packed as
                    // bytes, in `raw_body`.
                    body: req
                        .body
                        .as_ref()
                        .filter(|b| !b.as_bytes)
                        .map(|b| String::from_utf8_lossy(&b.data).into_owned())
                        .unwrap_or_default(),
                    raw_body: req
                        .body
                        .as_ref()
                        .filter(|b| b.as_bytes)
                        .map(|b| b.data.to_vec())
                        .unwrap_or_default(),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }),
    }
}

/// gRPC's length-prefixed message framing (uncompressed).
pub fn grpc_frame(msg: &impl Message) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + msg.encoded_len());
    buf.put_u8(0);
    buf.put_u32(msg.encoded_len() as u32);
    msg.encode(&mut buf).ok();
    buf.freeze()
}

pub fn grpc_unframe(mut body: Bytes) -> Result<Bytes, String> {
    if body.len() < 5 {
        return Err("no gRPC message".into());
    }
    if body.get_u8() != 0 {
        return Err("compressed gRPC message".into());
    }
    let len = body.get_u32() as usize;
    if body.len() < len {
        return Err("truncated gRPC message".into());
    }
    Ok(body.split_to(len))
}

/// A CheckResponse as Envoy reads it.
pub fn decision(answer: auth::CheckResponse) -> Decision {
    let code = answer.status.as_ref().map_or(0, |s| s.code);
    let option = |o: &core::HeaderValueOption| {
        let h = o.header.as_ref()?;
        let name = HeaderName::from_bytes(h.key.as_bytes()).ok()?;
        let raw = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        let value = HeaderValue::from_bytes(raw).ok()?;
        (!value.is_empty() || o.keep_empty_value).then_some((name, value, HeaderMode::of(o)))
    };
    if code == 0 {
        let mut allowed = Allowed::default();
        if let Some(auth::check_response::HttpResponse::OkResponse(ok)) = &answer.http_response {
            allowed.upstream = ok.headers.iter().filter_map(option).collect();
            allowed.remove = ok
                .headers_to_remove
                .iter()
                .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
                .collect();
            allowed.downstream = ok
                .response_headers_to_add
                .iter()
                .filter_map(option)
                .map(|(n, v, _)| (n, v))
                .collect();
        }
        return Decision::Allow(allowed);
    }
    // UNAUTHENTICATED answers 401, any other denial 403, unless the answer says.
    let mut status = if code == 16 {
        StatusCode::UNAUTHORIZED
    } else {
        StatusCode::FORBIDDEN
    };
    let mut headers = HeaderMap::new();
    let mut body = Bytes::new();
    if let Some(auth::check_response::HttpResponse::DeniedResponse(d)) = answer.http_response {
        if let Some(s) = d
            .status
            .as_ref()
            .and_then(|s| StatusCode::from_u16(u16::try_from(s.code).ok()?).ok())
        {
            status = s;
        }
        for (name, value, mode) in d.headers.iter().filter_map(option) {
            mode.apply(&mut headers, name, value);
        }
        body = Bytes::from(d.body);
    }
    Decision::Deny(Denied {
        status,
        headers,
        body,
        error: None,
    })
}
