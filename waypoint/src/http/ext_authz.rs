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

use super::authority::Authority;
use super::body::{empty, full, Downstream};
use super::grpc::{service_endpoint, unary, CallError, MAX_RESPONSE_BYTES};
use super::plan::set_head_for;
use crate::config::Config;
use crate::context::Waypoint;
use crate::extauthz::check::{
    check_message, decision, Allowed, CheckBody, CheckRequest, Decision, Denied, HeaderMode,
    PARTIAL_BODY_HEADER,
};
use crate::extauthz::proto::envoy::service::auth::v3 as auth;
use crate::extauthz::provider::{
    any_match, BodySettings, Common, GrpcProvider, HttpProvider, Provider,
};
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
pub async fn check(
    wp: &Waypoint,
    cfg: &Config,
    provider: &Provider,
    req: &CheckRequest<'_>,
) -> Decision {
    let Some(common) = provider.common() else {
        return error_reply(403, "not an ext_authz provider".into());
    };
    let result = tokio::time::timeout(common.timeout, async {
        match provider {
            Provider::Http(h) => check_http(wp, cfg, h, req).await,
            Provider::Grpc(g) => check_grpc(wp, cfg, g, req).await,
            Provider::NotAuthz(_) => {
                Err(CallError::Build("not an ext_authz provider".into()).into())
            }
        }
    })
    .await
    .unwrap_or(Err(CheckError::Timeout(common.timeout)));
    match result {
        Ok(d) => d,
        Err(e) if common.fail_open => Decision::Allow(Allowed {
            failed_open: Some(e.to_string()),
            ..Allowed::default()
        }),
        Err(e) => error_reply(common.status_on_error, e.to_string()),
    }
}

/// Checks one opaque TCP connection with a gRPC provider, as Envoy's network ext_authz
/// filter: `msg` from `check::tcp_check_message`. A failed check denies unless the
/// provider fails open (the network filter has no status to answer with).
pub async fn check_connection(
    wp: &Waypoint,
    cfg: &Config,
    provider: &GrpcProvider,
    msg: &auth::CheckRequest,
) -> Decision {
    let common = &provider.common;
    let result = tokio::time::timeout(common.timeout, async {
        let (ep, _) = endpoint(wp, cfg, common).await?;
        let answer = unary(
            wp,
            &ep,
            &common.service,
            CHECK_PATH,
            msg,
            Some(common.timeout),
        )
        .await?;
        Ok::<_, CheckError>(decision(auth::CheckResponse::decode(answer)?))
    })
    .await
    .unwrap_or(Err(CheckError::Timeout(common.timeout)));
    match result {
        Ok(d) => d,
        Err(e) if common.fail_open => Decision::Allow(Allowed {
            failed_open: Some(e.to_string()),
            ..Allowed::default()
        }),
        Err(e) => error_reply(403, e.to_string()),
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
async fn endpoint(
    wp: &Waypoint,
    cfg: &Config,
    common: &Common,
) -> Result<(Endpoint, Option<bool>), CheckError> {
    Ok(service_endpoint(wp, cfg, &common.service, common.port).await?)
}

async fn check_http(
    wp: &Waypoint,
    cfg: &Config,
    p: &HttpProvider,
    req: &CheckRequest<'_>,
) -> Result<Decision, CheckError> {
    let (ep, http2) = endpoint(wp, cfg, &p.common).await?;
    // Envoy's HTTP check: the request's method and path (after the prefix), its Host,
    // the body when the provider includes it (else none), Authorization and the listed
    // headers, plus the provider's own.
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
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.insert(k, v);
        }
    }
    headers.remove(header::HOST);
    let body = match &req.body {
        Some(b) => {
            headers.insert(
                PARTIAL_BODY_HEADER,
                HeaderValue::from_static(if b.partial { "true" } else { "false" }),
            );
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(b.data.len()));
            full(b.data.clone())
        }
        None => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
            empty()
        }
    };
    let path = format!("{}{}", p.path_prefix, req.path);
    let authority = Authority::parse(req.host).map_err(|e| CallError::Build(e.to_string()))?;
    set_head_for(&mut parts, &authority, &path, http2)
        .map_err(|e| CallError::Build(e.to_string()))?;
    let resp = wp
        .upstreams
        .send(&ep, http2, Request::from_parts(parts, body))
        .await
        .map_err(|e| CallError::Upstream(Box::new(e)))?;
    let (rparts, body) = resp.into_parts();
    let body = Limited::new(body, MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| CallError::Body(e.to_string()))?
        .to_bytes();
    if rparts.status == StatusCode::OK {
        let mut allowed = Allowed::default();
        for (name, value) in &rparts.headers {
            if any_match(&p.headers_to_upstream_on_allow, name.as_str()) {
                allowed
                    .upstream
                    .push((name.clone(), value.clone(), HeaderMode::Overwrite));
            }
            if any_match(&p.headers_to_downstream_on_allow, name.as_str()) {
                allowed.downstream.push((name.clone(), value.clone()));
            }
        }
        // Envoy's way for an HTTP authorizer to consume headers (as gRPC's headers_to_remove).
        if let Some(list) = rparts
            .headers
            .get("x-envoy-auth-headers-to-remove")
            .and_then(|v| v.to_str().ok())
        {
            allowed.remove.extend(
                list.split(',')
                    .filter_map(|h| HeaderName::from_bytes(h.trim().as_bytes()).ok()),
            );
        }
        return Ok(Decision::Allow(allowed));
    }
    // Denied: the authorizer's status and body; its headers as listed, or all but those
    // that describe its own message.
    let mut headers = HeaderMap::new();
    for (name, value) in &rparts.headers {
        let keep = if p.headers_to_downstream_on_deny.is_empty() {
            !matches!(
                name.as_str(),
                "content-length" | "transfer-encoding" | "connection" | "host"
            )
        } else {
            any_match(&p.headers_to_downstream_on_deny, name.as_str())
        };
        if keep {
            headers.append(name.clone(), value.clone());
        }
    }
    Ok(Decision::Deny(Denied {
        status: rparts.status,
        headers,
        body,
        error: None,
    }))
}

async fn check_grpc(
    wp: &Waypoint,
    cfg: &Config,
    p: &GrpcProvider,
    req: &CheckRequest<'_>,
) -> Result<Decision, CheckError> {
    let (ep, _) = endpoint(wp, cfg, &p.common).await?;
    let answer = unary(
        wp,
        &ep,
        &p.common.service,
        CHECK_PATH,
        &check_message(req),
        Some(p.common.timeout),
    )
    .await?;
    Ok(decision(auth::CheckResponse::decode(answer)?))
}

/// The CUSTOM step: checks the admitted request when a CUSTOM policy matches it, and
/// applies an allowing answer to the request (`parts`) and its future response, or
/// gives the denying answer's reply.
// The request's parts are borrowed apart (several mutably), so they cannot travel as one.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    wp: &Waypoint,
    cfg: &Config,
    tunnel: &super::tunnel::Tunnel,
    client_http2: bool,
    admitted: &mut super::plan::Admitted<'_>,
    parts: &mut http::request::Parts,
    downstream: &mut Downstream,
    notes: &mut super::log::Notes,
) -> Result<(), super::reply::LocalReply> {
    use super::reply::LocalReply;
    use crate::extauthz::Custom;
    let (provider, policy) = match &admitted.custom {
        Custom::Skip => return Ok(()),
        Custom::Deny { policy, reason } => {
            tracing::warn!(policy = %policy, reason = %reason, "CUSTOM policy cannot be enforced; denying what it matches");
            notes.denied_by = Some(policy.clone());
            return Err(LocalReply::new(
                StatusCode::FORBIDDEN,
                "DENY",
                "RBAC: access denied",
            ));
        }
        Custom::Check { provider, policy } => (*provider, policy.clone()),
    };
    let path = match &admitted.query {
        Some(q) => format!("{}?{q}", admitted.norm_path),
        None => admitted.norm_path.clone(),
    };
    let body = match provider.common() {
        Some(
            common @ Common {
                body: Some(settings),
                ..
            },
        ) => match check_body(downstream, common, *settings).await {
            Ok(b) => Some(b),
            Err(BodyFailure::TooLarge) => {
                notes.denied_by = Some(policy.clone());
                return Err(LocalReply::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "-",
                    "Payload Too Large",
                ));
            }
            Err(BodyFailure::Unread(e)) => {
                if common.fail_open {
                    tracing::warn!(policy = %policy, error = %e, "ext_authz check failed; the provider fails open");
                    return Ok(());
                }
                tracing::warn!(policy = %policy, error = %e, "ext_authz check failed");
                notes.denied_by = Some(policy.clone());
                let status =
                    StatusCode::from_u16(common.status_on_error).unwrap_or(StatusCode::FORBIDDEN);
                return Err(LocalReply::new(
                    status,
                    "UAEX",
                    format!("ext_authz error: {e}"),
                ));
            }
        },
        _ => None,
    };
    let req = CheckRequest {
        parts,
        host: admitted.authority.as_str(),
        path: &path,
        client_http2,
        source: tunnel.src_addr,
        source_principal: &tunnel.src_identity,
        destination: tunnel.target,
        destination_principal: &wp.identity,
        body,
    };
    match check(wp, cfg, provider, &req).await {
        Decision::Allow(allowed) => {
            if let Some(e) = &allowed.failed_open {
                tracing::warn!(policy = %policy, error = %e, "ext_authz check failed; the provider fails open");
            }
            apply(allowed, parts, admitted);
            Ok(())
        }
        Decision::Deny(Denied {
            status,
            headers,
            body,
            error,
        }) => {
            notes.denied_by = Some(policy.clone());
            let message = match &error {
                Some(e) => {
                    tracing::warn!(policy = %policy, error = %e, "ext_authz check failed");
                    format!("ext_authz error: {e}")
                }
                None => "denied by ext_authz".to_string(),
            };
            Err(LocalReply {
                external: Some(Box::new((headers, body))),
                ..LocalReply::new(status, "UAEX", message)
            })
        }
    }
}

/// Why a check could not carry the request body.
enum BodyFailure {
    /// Longer than the provider's `maxRequestBytes` without `allowPartialMessage`: 413,
    /// as Envoy answers when the body overflows the buffer the check needs.
    TooLarge,
    /// Not read within the provider's timeout, or the client's body failed: the check
    /// cannot be made.
    Unread(String),
}

/// Reads the request body ahead for the check, as Envoy buffers it (`with_request_body`):
/// all of it up to `maxRequestBytes`; a longer one is refused, or with
/// `allowPartialMessage` checked by its first `maxRequestBytes`. All of it is still sent
/// on to the backend. Bounded by the provider's timeout.
async fn check_body(
    downstream: &mut Downstream,
    common: &Common,
    s: BodySettings,
) -> Result<CheckBody, BodyFailure> {
    let until = if s.allow_partial { s.max } else { s.max + 1 };
    let (data, ended) =
        match tokio::time::timeout(common.timeout, downstream.read_ahead(until)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                return Err(BodyFailure::Unread(format!(
                    "reading the request body failed: {e}"
                )))
            }
            Err(_) => {
                return Err(BodyFailure::Unread(format!(
                    "the request body did not arrive within {:?}",
                    common.timeout
                )))
            }
        };
    if data.len() > s.max && !s.allow_partial {
        return Err(BodyFailure::TooLarge);
    }
    let partial = !ended || data.len() > s.max;
    Ok(CheckBody {
        data: data.slice(..data.len().min(s.max)),
        partial,
        as_bytes: s.as_bytes,
    })
}

fn apply(
    allowed: Allowed,
    parts: &mut http::request::Parts,
    admitted: &mut super::plan::Admitted<'_>,
) {
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
