//! One gRPC unary call from the waypoint itself to a mesh Service (an ext_authz
//! authorizer's Check, a tracing collector's Export): an endpoint of the Service picked
//! as for any backend, the call over HBONE (or plain TCP outside the mesh) in HTTP/2,
//! the answer's one message read (bounded) and its `grpc-status` checked.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request};
use http_body_util::{BodyExt, Limited};

use super::authority::Authority;
use super::backend::{Backend, Origin};
use super::body::full;
use super::plan::set_head_for;
use crate::config::Config;
use crate::context::Waypoint;
use crate::extauthz::check::{grpc_frame, grpc_unframe};
use crate::lookup::{provider_service, LookupError};
use crate::upstream::{Endpoint, UpstreamError};

/// The most of an answer that is read.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The mesh config's service name finds no Service, or more than one.
    #[error(transparent)]
    NoService(#[from] LookupError),
    #[error("the service {0} has no healthy endpoint")]
    NoEndpoint(String),
    #[error("request failed: {0}")]
    Upstream(Box<UpstreamError>),
    #[error("response unreadable: {0}")]
    Body(String),
    #[error("call ended with gRPC status {0}{1}")]
    Status(i32, String),
    #[error("request could not be built: {0}")]
    Build(String),
}

/// An endpoint of the Service `name` for `port`, picked by the waypoint's balancer, and
/// the HTTP version its port declares.
pub async fn service_endpoint(
    wp: &Waypoint,
    cfg: &Config,
    name: &str,
    port: u16,
) -> Result<(Endpoint, Option<bool>), CallError> {
    let svc = provider_service(&cfg.state, name)?;
    let from = Origin {
        me: wp.me_in(cfg),
        target: None,
        root_namespace: &wp.root_namespace,
    };
    let mut backend = Backend::service(cfg, &from, svc, port, None);
    backend
        .resolve(&wp.resolver, &wp.me)
        .await
        .map_err(|e| CallError::NoEndpoint(format!("{name} ({e})")))?;
    let picked = wp
        .balancer
        .pick(&backend.endpoints, &[])
        .ok_or_else(|| CallError::NoEndpoint(name.to_string()))?;
    Ok((
        Endpoint::of(&cfg.state, picked.addr, &picked.workload, Some(svc)),
        backend.http2,
    ))
}

/// Calls `path` on `ep` with one `message` (gRPC-framed here) and returns the answer's
/// message. `authority` is the Service's hostname; `deadline` goes in `grpc-timeout`.
pub async fn unary(
    wp: &Waypoint,
    ep: &Endpoint,
    authority: &str,
    path: &str,
    message: &impl prost::Message,
    deadline: Option<Duration>,
) -> Result<Bytes, CallError> {
    let authority = authority.rsplit('/').next().unwrap_or(authority);
    let mut parts = Request::new(()).into_parts().0;
    parts.method = Method::POST;
    let authority = Authority::parse(authority).map_err(|e| CallError::Build(e.to_string()))?;
    set_head_for(&mut parts, &authority, path, true)
        .map_err(|e| CallError::Build(e.to_string()))?;
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    parts
        .headers
        .insert(header::TE, HeaderValue::from_static("trailers"));
    if let Some(v) = deadline
        .and_then(|d| HeaderValue::from_str(&format!("{}m", d.as_millis().min(99_999_999))).ok())
    {
        parts.headers.insert("grpc-timeout", v);
    }
    let req = Request::from_parts(parts, full(grpc_frame(message)));
    let resp = wp
        .upstreams
        .send(ep, true, req)
        .await
        .map_err(|e| CallError::Upstream(Box::new(e)))?;
    let (rparts, body) = resp.into_parts();
    let collected = Limited::new(body, MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| CallError::Body(e.to_string()))?;
    let trailers = collected.trailers().cloned();
    // grpc-status is in the trailers, or in the head of a trailers-only response.
    let status_of = |h: &HeaderMap| {
        h.get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
    };
    let status = trailers
        .as_ref()
        .and_then(status_of)
        .or_else(|| status_of(&rparts.headers));
    if status != Some(0) {
        let msg = trailers
            .as_ref()
            .unwrap_or(&rparts.headers)
            .get("grpc-message")
            .and_then(|v| v.to_str().ok());
        return Err(CallError::Status(
            status.unwrap_or(-1),
            msg.map(|m| format!(": {m}")).unwrap_or_default(),
        ));
    }
    grpc_unframe(collected.to_bytes()).map_err(CallError::Body)
}
