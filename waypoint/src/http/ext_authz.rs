//! The CUSTOM step of the request path: one check of one request with an ext_authz
//! provider, as Envoy's ext_authz filter makes it: an HTTP request to an
//! `envoyExtAuthzHttp` service, or the gRPC call `envoy.service.auth.v3.Authorization/Check`
//! to an `envoyExtAuthzGrpc` one. Both go over HBONE to a mesh endpoint of the
//! provider's Service, like any backend request (see `extauthz` for the semantics).

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use prost::Message;

use super::body::empty;
use super::grpc::{service_endpoint, unary, CallError, MAX_RESPONSE_BYTES};
use super::plan::set_head_for;
use crate::config::Config;
use crate::context::Waypoint;
use crate::extauthz::check::{check_message, decision, Allowed, CheckRequest, Decision, Denied, HeaderMode};
use crate::extauthz::proto::envoy::service::auth::v3 as auth;
use crate::extauthz::provider::{any_match, Common, GrpcProvider, HttpProvider, Provider};
use crate::upstream::Endpoint;

/// The gRPC method, exactly Envoy's.
pub const CHECK_PATH: &str = "/envoy.service.auth.v3.Authorization/Check";

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("check timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// Finding the authorizer, sending the check or reading its answer.
    #[error("check {0}")]
    Call(#[from] CallError),
    #[error("check response is not a CheckResponse: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Checks one request with `provider` (an authorizer: the caller never passes
/// `Provider::NotAuthz`). A failed check gives `statusOnError`, or an allow when the
/// provider fails open.
pub async fn check(wp: &Waypoint, cfg: &Config, provider: &Provider, req: &CheckRequest<'_>) -> Decision {
    let Some(common) = provider.common() else {
        return error_reply(403, "not an ext_authz provider".into());
    };
    let result = tokio::time::timeout(common.timeout, async {
        match provider {
            Provider::Http(h) => check_http(wp, cfg, h, req).await,
            Provider::Grpc(g) => check_grpc(wp, cfg, g, req).await,
            Provider::NotAuthz(_) => Err(CallError::Build("not an ext_authz provider".into()).into()),
        }
    })
    .await
    .unwrap_or(Err(CheckError::Timeout(common.timeout)));
    match result {
        Ok(d) => d,
        Err(e) if common.fail_open => Decision::Allow(Allowed { failed_open: Some(e.to_string()), ..Allowed::default() }),
        Err(e) => error_reply(common.status_on_error, e.to_string()),
    }
}

fn error_reply(status: u16, error: String) -> Decision {
    Decision::Deny(Denied {
        status: StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN),
        headers: HeaderMap::new(),
        body: Bytes::new(),
        error: Some(error),
    })
}

/// The endpoint a check goes to, and the HTTP version its port declares.
async fn endpoint(wp: &Waypoint, cfg: &Config, common: &Common) -> Result<(Endpoint, Option<bool>), CheckError> {
    Ok(service_endpoint(wp, cfg, &common.service, common.port).await?)
}

async fn check_http(wp: &Waypoint, cfg: &Config, p: &HttpProvider, req: &CheckRequest<'_>) -> Result<Decision, CheckError> {
    let (ep, http2) = endpoint(wp, cfg, &p.common).await?;
    // Envoy's HTTP check: the request's method and path (after the prefix), its Host,
    // no body, Authorization and the listed headers, plus the provider's own.
    let http2 = http2.unwrap_or(false);
    let mut parts = Request::new(()).into_parts().0;
    parts.method = req.parts.method.clone();
    let headers = &mut parts.headers;
    for (name, value) in &req.parts.headers {
        if name == header::AUTHORIZATION || any_match(&p.include_request_headers, name.as_str()) {
            headers.append(name.clone(), value.clone());
        }
    }
    for (k, v) in &p.include_additional_headers {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
            headers.insert(k, v);
        }
    }
    headers.remove(header::HOST);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    let path = format!("{}{}", p.path_prefix, req.path);
    set_head_for(&mut parts, req.host, &path, http2).map_err(|e| CallError::Build(e.to_string()))?;
    let resp = wp.upstreams.send(&ep, http2, Request::from_parts(parts, empty())).await.map_err(|e| CallError::Upstream(Box::new(e)))?;
    let (rparts, body) = resp.into_parts();
    let body = Limited::new(body, MAX_RESPONSE_BYTES).collect().await.map_err(|e| CallError::Body(e.to_string()))?.to_bytes();
    if rparts.status == StatusCode::OK {
        let mut allowed = Allowed::default();
        for (name, value) in &rparts.headers {
            if any_match(&p.headers_to_upstream_on_allow, name.as_str()) {
                allowed.upstream.push((name.clone(), value.clone(), HeaderMode::Overwrite));
            }
            if any_match(&p.headers_to_downstream_on_allow, name.as_str()) {
                allowed.downstream.push((name.clone(), value.clone()));
            }
        }
        // Envoy's way for an HTTP authorizer to consume headers (as gRPC's headers_to_remove).
        if let Some(list) = rparts.headers.get("x-envoy-auth-headers-to-remove").and_then(|v| v.to_str().ok()) {
            allowed.remove.extend(list.split(',').filter_map(|h| HeaderName::from_bytes(h.trim().as_bytes()).ok()));
        }
        return Ok(Decision::Allow(allowed));
    }
    // Denied: the authorizer's status and body; its headers as listed, or all but those
    // that describe its own message.
    let mut headers = HeaderMap::new();
    for (name, value) in &rparts.headers {
        let keep = if p.headers_to_downstream_on_deny.is_empty() {
            !matches!(name.as_str(), "content-length" | "transfer-encoding" | "connection" | "host")
        } else {
            any_match(&p.headers_to_downstream_on_deny, name.as_str())
        };
        if keep {
            headers.append(name.clone(), value.clone());
        }
    }
    Ok(Decision::Deny(Denied { status: rparts.status, headers, body, error: None }))
}

async fn check_grpc(wp: &Waypoint, cfg: &Config, p: &GrpcProvider, req: &CheckRequest<'_>) -> Result<Decision, CheckError> {
    let (ep, _) = endpoint(wp, cfg, &p.common).await?;
    let answer = unary(wp, &ep, &p.common.service, CHECK_PATH, &check_message(req), Some(p.common.timeout)).await?;
    Ok(decision(auth::CheckResponse::decode(answer)?))
}

/// The CUSTOM step: checks the admitted request when a CUSTOM policy matches it, and
/// applies an allowing answer to the request (`parts`) and its future response, or
/// gives the denying answer's reply.
pub async fn run(
    wp: &Waypoint,
    cfg: &Config,
    tunnel: &super::tunnel::Tunnel,
    client_http2: bool,
    admitted: &mut super::plan::Admitted<'_>,
    parts: &mut http::request::Parts,
    notes: &mut super::log::Notes,
) -> Result<(), super::reply::LocalReply> {
    use super::reply::LocalReply;
    use crate::extauthz::Custom;
    let (provider, policy) = match &admitted.custom {
        Custom::Skip => return Ok(()),
        Custom::Deny { policy, reason } => {
            tracing::warn!(policy = %policy, reason = %reason, "CUSTOM policy cannot be enforced; denying what it matches");
            notes.denied_by = Some(policy.clone());
            return Err(LocalReply::new(StatusCode::FORBIDDEN, "DENY", "RBAC: access denied"));
        }
        Custom::Check { provider, policy } => (*provider, policy.clone()),
    };
    let path = match &admitted.query {
        Some(q) => format!("{}?{q}", admitted.norm_path),
        None => admitted.norm_path.clone(),
    };
    let req = CheckRequest {
        parts,
        host: &admitted.host_full,
        path: &path,
        client_http2,
        source: tunnel.src_addr,
        source_principal: &tunnel.src_identity,
        destination: tunnel.target,
        destination_principal: &wp.identity,
    };
    match check(wp, cfg, provider, &req).await {
        Decision::Allow(allowed) => {
            if let Some(e) = &allowed.failed_open {
                tracing::warn!(policy = %policy, error = %e, "ext_authz check failed; the provider fails open");
            }
            apply(allowed, parts, admitted);
            Ok(())
        }
        Decision::Deny(Denied { status, headers, body, error }) => {
            notes.denied_by = Some(policy.clone());
            let message = match &error {
                Some(e) => {
                    tracing::warn!(policy = %policy, error = %e, "ext_authz check failed");
                    format!("ext_authz error: {e}")
                }
                None => "denied by ext_authz".to_string(),
            };
            Err(LocalReply { external: Some(Box::new((headers, body))), ..LocalReply::new(status, "UAEX", message) })
        }
    }
}

fn apply(allowed: Allowed, parts: &mut http::request::Parts, admitted: &mut super::plan::Admitted<'_>) {
    for (name, value, mode) in allowed.upstream {
        // The authorizer may not rewrite where the request goes.
        if name != header::HOST {
            mode.apply(&mut parts.headers, name, value);
        }
    }
    for name in allowed.remove {
        if name != header::HOST {
            parts.headers.remove(name);
        }
    }
    admitted.response_headers.extend(allowed.downstream);
}
