//! The plan step: from the request head, the tunnel and one config snapshot, decide
//! everything before a byte goes upstream (authentication, authorization, route, filters, backend,
//! retries, timeouts, mirrors) or the local reply that ends the request here.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, StatusCode, Uri};
use ztunnel::identity::Identity;
use ztunnel::state::Service;

use super::authority::Authority;
use super::backend::{Backend, Origin};
use super::headers::{set_trusted_headers, strip_hop_by_hop};
use super::log::Notes;
use super::reply::LocalReply;
use super::tunnel::Tunnel;
use super::upgrade::{self, WebSocket};
use crate::authn;
use crate::authz;
use crate::config::Config;
use crate::destination;
use crate::detect::Protocol;
use crate::egress;
use crate::extauthz;
use crate::grant;
use crate::object::{ObjectName, ServiceKind, Target};
use crate::path;
use crate::route::{
    self, CorsOutcome, Filter, HeaderModifier, RequestMirror, Retry, RouteRequest, Selected,
    SessionPersistence,
};

mod affinity;

pub use affinity::session_value;
use affinity::{hash_key, session_endpoint};

/// What the plan step reads: the waypoint's names, the tunnel, the config snapshot.
pub struct Inbound<'a> {
    /// The waypoint's own workload (its locality picks endpoints).
    pub me: &'a ztunnel::state::Workload,
    /// The waypoint's Gateway (policies and routes attach to it).
    pub gateway: &'a ObjectName,
    /// The mesh's root namespace (policies there may target every waypoint).
    pub root_namespace: &'a str,
    /// The waypoint's own identity (`x-forwarded-client-cert: By=`).
    pub identity: &'a Identity,
    pub tunnel: &'a Tunnel,
    pub cfg: &'a Config,
    pub proto: Protocol,
    /// The key sets of the config's jwksUris (RequestAuthentication).
    pub jwks: &'a authn::JwksStore,
}

/// How to send one request: the request head is already rewritten for the backend.
pub struct Plan<'c> {
    pub backend: Backend,
    pub http2: bool,
    pub retry: Option<&'c Retry>,
    pub timeouts: Timeouts,
    pub mirrors: Mirrors<'c>,
    /// The route's response header modifiers, applied to the backend's response.
    pub response_modifiers: Vec<&'c HeaderModifier>,
    /// Headers an ext_authz answer adds to the backend's response.
    pub response_headers: Vec<(http::HeaderName, HeaderValue)>,
    /// The rule's CORS headers for an allowed origin (set on the response after the
    /// route's modifiers, before ext_authz's, in Envoy's filter order).
    pub cors: Option<HeaderMap>,
    /// A WebSocket upgrade (HTTP/1.1 or extended CONNECT): relayed once accepted.
    pub websocket: Option<WebSocket>,
    /// The request's key for a consistent-hash policy (None: it has none).
    pub hash: Option<u64>,
    /// A VirtualService fault delay for this request.
    pub fault_delay: Option<Duration>,
    /// The rule's session persistence, and the endpoint the request's session names.
    pub session: Option<(&'c SessionPersistence, Option<std::net::SocketAddr>)>,
}

/// The route rule's timeouts (none without a route).
#[derive(Default)]
pub struct Timeouts {
    /// The whole exchange, retries included.
    pub request: Option<Duration>,
    /// Each attempt.
    pub backend: Option<Duration>,
}

/// The route's mirrors and what a mirrored request needs from the original.
pub struct Mirrors<'c> {
    pub to: Vec<&'c RequestMirror>,
    /// The request's host, port stripped (the mirror's gets `-shadow`).
    pub host: String,
    /// The port the client addressed (a mirror backendRef without a port uses it).
    pub port: u16,
    /// The original destination (a PASSTHROUGH mirror backend's).
    pub target: std::net::SocketAddr,
    /// The route's namespace (a mirror backendRef without one is in it).
    pub route_ns: Option<&'c str>,
    /// The route's kind, for ReferenceGrants.
    pub route_kind: &'static str,
    /// Whether the client spoke HTTP/2 (a mirror backend of unknown protocol gets that).
    pub client_http2: bool,
}

/// Rewrites the request head for an upstream of that HTTP version: HTTP/2 takes the
/// authority in the URI and no Host; HTTP/1.1 an origin-form URI and Host. h2 and hyper
/// translate the rest (connection-specific headers are already gone, trailers pass).
/// The URI is built from the parsed authority and path, so neither can spill into the
/// other, and the client's own Host never reaches the backend.
pub fn set_head_for(
    parts: &mut http::request::Parts,
    authority: &Authority,
    path_and_query: &str,
    http2: bool,
) -> Result<(), http::Error> {
    let pq = PathAndQuery::try_from(path_and_query)?;
    if http2 {
        parts.uri = authority.uri_with(pq)?;
        parts.headers.remove(header::HOST);
    } else {
        parts.uri = Uri::from(pq);
        let host = HeaderValue::from_str(authority.as_str())?;
        parts.headers.insert(header::HOST, host);
    }
    parts.version = if http2 {
        http::Version::HTTP_2
    } else {
        http::Version::HTTP_11
    };
    Ok(())
}

fn object_name(s: &Service) -> ObjectName {
    ObjectName {
        namespace: s.namespace.clone(),
        name: s.name.clone(),
    }
}

/// A request admitted by the first half of the plan step: its head checked, normalized
/// and authenticated. The CUSTOM step (`ext_authz`) runs on it before `build`.
pub struct Admitted<'c> {
    target_service: Option<Arc<Service>>,
    target_name: Option<ObjectName>,
    /// The request's authority (Host, :authority or an absolute-form target's), valid.
    pub authority: Authority,
    /// Its host, lowercase, without the port.
    host: String,
    /// Normalized, without the query.
    pub norm_path: String,
    pub query: Option<String>,
    websocket: bool,
    auth: Option<authn::RequestAuth>,
    /// What the CUSTOM policies of the target make of the request.
    pub custom: extauthz::Custom<'c>,
    /// Headers an ext_authz answer adds to the response.
    pub response_headers: Vec<(http::HeaderName, HeaderValue)>,
}

/// Checks, normalizes and authenticates the request head (`parts`), and decides whether
/// a CUSTOM policy sends it to an external authorizer; or says which local reply it
/// gets. `notes` gets what the log line reports.
pub fn admit<'c>(
    inb: &Inbound<'c>,
    parts: &mut http::request::Parts,
    notes: &mut Notes,
) -> Result<Admitted<'c>, LocalReply> {
    let (cfg, tunnel) = (inb.cfg, inb.tunnel);
    let target_service = cfg
        .state
        .service_by_vip(crate::network::get(), tunnel.target.ip())
        .cloned();
    // A WebSocket is planned as a GET with `upgrade: websocket`, whatever the version.
    let websocket = upgrade::detect(parts);
    // Tunnelling inside a tunnel is not proxied: CONNECT's target is no path to authorize.
    if parts.method == Method::CONNECT {
        return Err(LocalReply::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "-",
            "CONNECT is not supported through the waypoint",
        ));
    }
    // Host policies and routes need a host: without Host or :authority (HTTP/1.0, or an
    // HTTP/2 request without it) there is none to check, so the request is refused. One
    // that is not exactly `host[:port]` (`web/admin#`, `user@web`) would be matched by
    // policy as one string and read by the backend as another: refused too (Envoy: 400).
    let authority = match Authority::of_request(parts) {
        Ok(a) => a,
        Err(e) => return Err(LocalReply::new(StatusCode::BAD_REQUEST, "-", e.to_string())),
    };
    // One normalized path for policy, routing and the backend alike.
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let (norm_path, query) = match path::normalize_path_and_query(pq) {
        Ok(x) => x,
        Err(e) => {
            return Err(LocalReply::new(
                StatusCode::BAD_REQUEST,
                "-",
                format!("bad request path: {e}"),
            ))
        }
    };
    notes.path = Some(norm_path.clone());
    let host = authority.host().to_ascii_lowercase();
    // Headers as the backend will get them, before policy and routes look at them: a
    // client's `Connection: x-foo` must not remove a header after it was authorized or
    // set by a route, and identity headers are the waypoint's.
    strip_hop_by_hop(&mut parts.headers);
    set_trusted_headers(
        &mut parts.headers,
        inb.identity,
        &tunnel.src_identity,
        tunnel.src_addr.ip(),
    );
    if websocket {
        upgrade::mark(&mut parts.headers);
    }

    let target_name = target_service.as_deref().map(object_name);
    let target = inb.target(
        target_name.as_ref(),
        target_service
            .as_deref()
            .map(ServiceKind::of)
            .unwrap_or_default(),
    );

    // RequestAuthentication before AuthorizationPolicy: a bad token is refused whatever
    // the policies say; a good one gives them the request principal and claims.
    let authns: Vec<&authn::RequestAuthentication> = cfg
        .authentications
        .iter()
        .filter(|a| a.applies_to(&target))
        .collect();
    let auth = if authns.is_empty() {
        None
    } else {
        match authn::authenticate(&authns, inb.jwks, &mut parts.headers, query.as_deref()) {
            Ok(a) => a,
            Err(f) => {
                let challenge = (f.status() == StatusCode::UNAUTHORIZED).then(|| {
                    format!(
                        "Bearer realm=\"http://{authority}{norm_path}\", error=\"invalid_token\""
                    )
                });
                return Err(LocalReply {
                    www_authenticate: challenge,
                    ..LocalReply::new(f.status(), "-", f.to_string())
                });
            }
        }
    };
    notes.request_principal = auth.as_ref().map(|a| a.principal.clone());

    let custom = {
        let policies: Vec<&authz::AuthorizationPolicy> = cfg
            .policies
            .iter()
            .filter(|p| p.applies_to(&target) && p.action == authz::Action::Custom)
            .collect();
        if policies.is_empty() {
            extauthz::Custom::Skip
        } else {
            extauthz::decide(
                &cfg.providers,
                &policies,
                &inb.authz_request(parts, authority.as_str(), &norm_path, auth.as_ref()),
            )
        }
    };
    Ok(Admitted {
        target_service,
        target_name,
        authority,
        host,
        norm_path,
        query,
        websocket,
        auth,
        custom,
        response_headers: Vec::new(),
    })
}

impl Inbound<'_> {
    fn target<'t>(
        &'t self,
        service: Option<&'t ObjectName>,
        service_kind: ServiceKind,
    ) -> Target<'t> {
        Target {
            gateway: self.gateway,
            service,
            service_kind,
            root_namespace: self.root_namespace,
            port: self.tunnel.target.port(),
        }
    }

    fn authz_request<'r>(
        &'r self,
        parts: &'r http::request::Parts,
        authority: &'r str,
        norm_path: &'r str,
        auth: Option<&'r authn::RequestAuth>,
    ) -> authz::Request<'r> {
        authz::Request {
            source_principal: Some(&self.tunnel.src_identity),
            source_ip: self.tunnel.src_addr.ip(),
            destination_port: self.tunnel.target.port(),
            host: authority,
            method: parts.method.as_str(),
            path: norm_path,
            headers: &parts.headers,
            auth,
        }
    }
}

/// Authorizes, routes and rewrites an admitted request head (`parts`) for its backend
/// and plans its sending, or says which local reply it gets.
pub fn build<'c>(
    inb: &Inbound<'c>,
    admitted: Admitted<'c>,
    parts: &mut http::request::Parts,
    notes: &mut Notes,
) -> Result<Plan<'c>, LocalReply> {
    // An allowed origin's CORS headers go on whatever answers the request once the rule's
    // CORS filter has seen it: the backend's response or a later local reply.
    let mut cors = None;
    match plan_request(inb, admitted, parts, notes, &mut cors) {
        Ok(plan) => Ok(Plan { cors, ..plan }),
        Err(reply) => Err(reply.with_headers(cors.as_ref())),
    }
}

fn plan_request<'c>(
    inb: &Inbound<'c>,
    admitted: Admitted<'c>,
    parts: &mut http::request::Parts,
    notes: &mut Notes,
    cors: &mut Option<HeaderMap>,
) -> Result<Plan<'c>, LocalReply> {
    let (cfg, tunnel) = (inb.cfg, inb.tunnel);
    let Admitted {
        target_service,
        target_name,
        authority,
        host,
        norm_path,
        query,
        websocket,
        auth,
        mut response_headers,
        ..
    } = admitted;
    let target = inb.target(
        target_name.as_ref(),
        target_service
            .as_deref()
            .map(ServiceKind::of)
            .unwrap_or_default(),
    );
    let policies: Vec<&authz::AuthorizationPolicy> = cfg
        .policies
        .iter()
        .filter(|p| p.applies_to(&target))
        .collect();
    if !policies.is_empty() {
        let verdict = authz::evaluate(
            policies,
            &inb.authz_request(parts, authority.as_str(), &norm_path, auth.as_ref()),
        );
        notes.audited_by = verdict.audited_by;
        if !verdict.allowed {
            notes.denied_by = verdict.denied_by;
            return Err(LocalReply::new(
                StatusCode::FORBIDDEN,
                "DENY",
                "RBAC: access denied",
            ));
        }
    }
    // A DYNAMIC_DNS ServiceEntry (Envoy's dynamic forward proxy in Istio's waypoint):
    // its virtual host's one domain is its wildcard, so a Host it does not cover has no
    // route, after RBAC as in Envoy, and is never resolved.
    if let Some(svc) = target_service
        .as_deref()
        .filter(|s| egress::is_dynamic_dns(&cfg.state, s))
    {
        if let Err(e) = egress::dynamic_host(&svc.hostname, &authority) {
            return Err(LocalReply::new(StatusCode::NOT_FOUND, "NR", e.to_string()));
        }
    }

    let routes: Vec<&route::HttpRoute> = cfg.routes.iter().collect();
    let rreq = RouteRequest {
        method: &parts.method,
        path: &norm_path,
        query: query.as_deref(),
        headers: &parts.headers,
        host: &host,
        authority: authority.as_str(),
    };
    let selected = match route::select(&routes, &target, &rreq) {
        route::Selection::NoRoutes => None,
        route::Selection::NoMatch => {
            return Err(LocalReply::new(
                StatusCode::NOT_FOUND,
                "NR",
                "no route matched",
            ))
        }
        route::Selection::Matched(s) => Some(s),
    };
    if let Some(s) = &selected {
        notes.route = Some(format!(
            "{}/{}#{}",
            s.route.namespace, s.route.name, s.rule_index
        ));
        // A rule asking for what the waypoint cannot do fails closed, named.
        if let Some(why) = &s.rule.unenforceable {
            return Err(LocalReply::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "NR",
                format!(
                    "{} {}/{} rule {} cannot be applied: {why}",
                    s.route.kind.name(),
                    s.route.namespace,
                    s.route.name,
                    s.rule_index
                ),
            ));
        }
    }

    // Envoy's CORS filter runs after authorization, on the matched route, before the
    // router: a preflight is answered here (never redirected, mirrored or sent on).
    if let Some(c) = selected.as_ref().and_then(|s| s.rule.cors()) {
        match c.on_request(&parts.method, &parts.headers) {
            CorsOutcome::Preflight(h) => return Err(LocalReply::preflight(h)),
            CorsOutcome::Response(h) => *cors = Some(h),
            CorsOutcome::NotCors => {}
        }
    }

    // The rule's weighted backend, picked first: its own header modifiers apply before the
    // rule's (Envoy's weighted-cluster headers come before the route's).
    let picked_ref = match selected
        .as_ref()
        .filter(|s| !s.rule.backend_refs.is_empty())
    {
        Some(s) => match s.rule.pick_backend(rand::random()) {
            Some(b) => Some(b),
            None => {
                return Err(LocalReply::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "NR",
                    "route has no backend with weight",
                ))
            }
        },
        None => None,
    };
    let mut up_path = norm_path.clone();
    let mut up_host = authority.as_str().to_string();
    let mut response_modifiers = Vec::new();
    let mut mirrors = Vec::new();
    if let Some(b) = picked_ref {
        if let Some(m) = b.request_modifier() {
            m.apply(&mut parts.headers);
        }
        response_modifiers.extend(b.response_modifier());
    }
    if let Some(Selected {
        rule,
        matched_prefix,
        ..
    }) = &selected
    {
        for f in &rule.filters {
            match f {
                Filter::RequestHeaderModifier(m) => m.apply(&mut parts.headers),
                Filter::ResponseHeaderModifier(m) => response_modifiers.push(m),
                Filter::UrlRewrite(rw) => rw.apply(&mut up_host, &mut up_path, *matched_prefix),
                Filter::RequestMirror(m) => mirrors.push(m),
                // Applied above, before the other filters.
                Filter::Cors(_) => {}
                Filter::RequestRedirect(r) => {
                    // The request's port: from Host, else the service port it was sent to.
                    let port = authority.port().or(Some(tunnel.target.port()));
                    let (status, location) = r.location(
                        "http",
                        &host,
                        port,
                        &norm_path,
                        query.as_deref(),
                        *matched_prefix,
                    );
                    return Err(LocalReply {
                        redirect: Some(location),
                        ..LocalReply::new(status, "-", "")
                    });
                }
            }
        }
    }

    // A VirtualService's fault injection: an abort ends the request here (Envoy's
    // "fault filter abort", flag FI); a delay holds it before it is sent (DI).
    let fault = selected.as_ref().and_then(|s| s.rule.fault);
    if let Some(status) = fault.and_then(|f| f.abort_for(rand::random())) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return Err(LocalReply::new(status, "FI", "fault filter abort"));
    }
    // A VirtualService's redirect or direct response (Envoy's router answers, after
    // the fault filter), else its path rewrite.
    if let Some(s) = &selected {
        match &s.rule.answer {
            Some(route::Answer::Redirect(r)) => {
                let location = r.location(
                    authority.as_str(),
                    tunnel.target.port(),
                    &norm_path,
                    query.as_deref(),
                );
                return Err(LocalReply {
                    redirect: Some(location),
                    ..LocalReply::new(r.status, "-", "")
                });
            }
            Some(route::Answer::Direct(d)) => {
                return Err(LocalReply::direct(d.status, d.body.clone()))
            }
            None => {}
        }
        if let Some(rw) = &s.rule.uri_rewrite {
            let matched = s
                .matched
                .vs
                .as_ref()
                .map_or(route::Matched::Prefix(1), |c| c.matched);
            up_path = rw.apply(&up_path, matched);
        }
    }
    let fault_delay = fault.and_then(|f| f.delay_for(rand::random()));
    let session = selected
        .as_ref()
        .and_then(|s| s.rule.session_persistence.as_ref())
        .map(|sp| (sp, session_endpoint(sp, &parts.headers)));

    // The backend: the route's weighted pick, else (no route, or a rule without
    // backendRefs) the service or workload the client addressed.
    let from = Origin {
        me: inb.me,
        target: Some(tunnel.target),
        root_namespace: inb.root_namespace,
    };
    let mut backend = match selected.as_ref().zip(picked_ref) {
        Some((s, b)) => {
            let name = b.service(&s.route.namespace);
            if !grant::permitted(&cfg.grants, s.route.kind.name(), &s.route.namespace, &name) {
                return Err(LocalReply::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "NR",
                    format!("backend {}/{} is in another namespace and no ReferenceGrant there allows it", name.namespace, name.name),
                ));
            }
            let svc = match egress::backend_service(&cfg.state, &s.route.namespace, &b.backend) {
                Ok(svc) => svc,
                Err(e) => {
                    return Err(LocalReply::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "NR",
                        e.to_string(),
                    ))
                }
            };
            if let Some(ss) = b.subset.as_deref().filter(|ss| {
                destination::rule_for(&cfg.destination_rules, from.client(), svc)
                    .and_then(|r| r.subset(ss))
                    .is_none()
            }) {
                return Err(LocalReply::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "NC",
                    format!(
                        "no DestinationRule defines subset {ss:?} of {}",
                        svc.hostname
                    ),
                ));
            }
            Backend::service(
                cfg,
                &from,
                svc,
                b.backend.port.unwrap_or(tunnel.target.port()),
                b.subset.as_deref(),
            )
        }
        None => match &target_service {
            Some(svc) => Backend::service(cfg, &from, svc, tunnel.target.port(), None),
            None => match cfg
                .state
                .workload_by_ip(crate::network::get(), tunnel.target.ip())
            {
                Some(w) => Backend::workload(tunnel.target, w.clone()),
                None => {
                    return Err(LocalReply::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "UH",
                        "no mesh workload at the target address",
                    ))
                }
            },
        },
    };
    notes.backend_service = backend.service.clone();
    // A DestinationRule that asked for TLS origination and cannot be applied: failing
    // beats sending in plaintext what was meant to be encrypted.
    if let Some(why) = backend
        .policy
        .as_ref()
        .and_then(|p| p.refused.as_ref().map(|r| (p.rule.as_str(), r)))
    {
        return Err(LocalReply::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "UF",
            format!("DestinationRule {} cannot be applied: {}", why.0, why.1),
        ));
    }
    // The client's authority, or the one a URLRewrite set (a hostname checked when the
    // config loaded).
    let up_authority = if up_host == authority.as_str() {
        authority
    } else {
        match Authority::parse(&up_host) {
            Ok(a) => a,
            Err(e) => {
                let why = format!("the route's hostname rewrite {up_host:?} is no authority: {e}");
                return Err(LocalReply::new(StatusCode::INTERNAL_SERVER_ERROR, "-", why));
            }
        }
    };
    // A DYNAMIC_DNS backend goes to the Host the request carries upstream (a rewrite
    // included, as Envoy's dynamic forward proxy reads it), if its wildcard covers it.
    if let Err(e) = egress::send_to_host(&cfg.state, &mut backend, &up_authority) {
        return Err(LocalReply::new(StatusCode::NOT_FOUND, "NR", e.to_string()));
    }
    if backend.is_empty() {
        return Err(LocalReply::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "UH",
            "no healthy upstream",
        ));
    }

    // Upstream request head: the normalized (maybe rewritten) path.
    let pq = match &query {
        Some(q) => format!("{up_path}?{q}"),
        None => up_path,
    };
    // The backend's HTTP version: its service port's protocol, else the client's.
    let client_http2 = inb.proto == Protocol::Http2;
    // A DestinationRule's h2UpgradePolicy / useClientProtocol, or the mesh's upgrade.
    let http2 = crate::destination::connection::upstream_http2(
        backend.policy.as_ref().and_then(|p| p.protocol),
        cfg.h2_upgrade,
        backend.http2,
        client_http2,
    );
    if let Err(e) = set_head_for(parts, &up_authority, &pq, http2) {
        let why = format!("request URI cannot be rebuilt: {e}");
        return Err(LocalReply::new(StatusCode::BAD_REQUEST, "-", why));
    }
    let websocket = websocket.then(|| upgrade::set_upstream_head(parts, client_http2, http2));
    let hash = hash_key(
        backend.policy.as_ref().and_then(|t| t.pick.as_ref()),
        parts,
        query.as_deref(),
        tunnel.src_addr.ip(),
    );
    let hash = affinity::generated_cookie(
        hash,
        backend.policy.as_deref(),
        tunnel.src_addr,
        &mut response_headers,
    );

    let rule = selected.as_ref().map(|s| s.rule);
    // The route's retry policy, else the mesh config's defaultHttpRetryPolicy (with its
    // perTryTimeout), else Istio's own default (`forward`).
    let own_retry = rule.and_then(|r| r.retry.as_ref());
    let retry = cfg.default_retry.as_ref().filter(|_| own_retry.is_none());
    Ok(Plan {
        backend,
        http2,
        retry: retry.map(|r| &r.retry).or(own_retry),
        timeouts: Timeouts {
            request: rule.and_then(|r| r.request_timeout()),
            backend: rule
                .and_then(|r| r.backend_timeout())
                .or(retry.and_then(|r| r.per_try_timeout)),
        },
        mirrors: Mirrors {
            to: mirrors,
            host,
            port: tunnel.target.port(),
            target: tunnel.target,
            route_ns: selected.as_ref().map(|s| s.route.namespace.as_str()),
            route_kind: selected
                .as_ref()
                .map_or("HTTPRoute", |s| s.route.kind.name()),
            client_http2,
        },
        response_modifiers,
        response_headers,
        cors: None,
        websocket,
        hash,
        fault_delay,
        session,
    })
}

#[cfg(test)]
mod tests;
