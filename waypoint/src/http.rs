//! L7: HTTP/1.1 and HTTP/2 (gRPC included) requests inside an HBONE tunnel, served with
//! hyper. Each request is normalized, authorized (AuthorizationPolicy), routed
//! (HTTPRoute: matches, filters, weighted backends, timeouts, retries), balanced over
//! the backend's endpoints and sent over pooled HBONE; one access log line and the
//! Istio request metrics per request.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use ztunnel::hbone::H2Stream;
use ztunnel::identity::Identity;
use ztunnel::metrics::http::HttpLabels;
use ztunnel::metrics::{Peer, TcpLabels};
use ztunnel::state::{HealthStatus, Protocol as MeshProtocol, Service, Workload};

use crate::config::Config;
use crate::context::Waypoint;
use crate::detect::Protocol;
use crate::lb::Picked;
use crate::object::{ObjectName, Target};
use crate::route::{self, Filter, RouteRequest, Selected};
use crate::upstream::{Body, BoxError, Endpoint, UpstreamError};
use crate::authz;
use crate::path;

/// Request bodies up to this size are buffered when a retry or mirror needs a copy.
const MAX_BUFFERED_BODY: u64 = 64 * 1024;
const MAX_BACKOFF_FACTOR: u32 = 10;
/// Mirrored requests in flight at once; more are skipped.
pub const MAX_MIRRORS_IN_FLIGHT: usize = 256;
const MIRROR_TIMEOUT: Duration = Duration::from_secs(10);
/// A mirror's response is read (to reuse its connection) up to this size, then dropped.
const MIRROR_MAX_RESPONSE: usize = 1 << 20;

/// The tunnel a request arrived in.
pub struct Tunnel {
    /// Verified mTLS identity of the HBONE peer (the client's ztunnel speaks as the client).
    pub src_identity: Identity,
    /// The HBONE peer's address: in ambient, the client pod's own IP.
    pub src_addr: SocketAddr,
    /// The CONNECT target: a service VIP:port or a workload ip:port.
    pub target: SocketAddr,
}

/// Serves HTTP on one tunnel until the client closes it.
pub async fn serve(wp: Arc<Waypoint>, tunnel: Arc<Tunnel>, io: H2Stream, proto: Protocol) {
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (wp, tunnel) = (wp.clone(), tunnel.clone());
        async move { Ok::<_, Infallible>(handle(wp, tunnel, proto, req).await) }
    });
    let io = TokioIo::new(io);
    let r = match proto {
        Protocol::Http2 => {
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_concurrent_streams(100)
                .max_header_list_size(64 * 1024)
                .max_pending_accept_reset_streams(50)
                .serve_connection(io, svc)
                .await
        }
        _ => {
            hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .max_headers(100)
                .serve_connection(io, svc)
                .await
        }
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// What the access log and metrics say about one request; written when the response
/// body ends (or is dropped).
struct RequestLog {
    wp: Arc<Waypoint>,
    start: Instant,
    src_addr: SocketAddr,
    src_identity: Identity,
    src_workload: Option<Arc<Workload>>,
    dst_service: Option<Arc<Service>>,
    dst_workload: Option<Arc<Workload>>,
    dst_addr: Option<SocketAddr>,
    method: Method,
    path: String,
    host: String,
    protocol: &'static str,
    /// 0 until there is a response (Envoy's code for "no response sent").
    status: u16,
    /// As a label: 0-16 or `other` (the backend chooses it).
    grpc_status: Option<&'static str>,
    response_flags: &'static str,
    route: Option<String>,
    attempts: u32,
    request_bytes: Arc<AtomicU64>,
    request_header_bytes: u64,
    audited_by: Vec<String>,
    denied_by: Option<String>,
    error: Option<String>,
    /// Set once written; a log dropped unwritten is a request the client abandoned.
    finished: bool,
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        if !self.finished {
            self.response_flags = "DC";
            self.error.get_or_insert_with(|| "client went away before the response".into());
            self.status = 0;
            self.write(0);
        }
    }
}

impl RequestLog {
    fn finish(mut self, response_bytes: u64) {
        self.write(response_bytes);
    }

    fn write(&mut self, response_bytes: u64) {
        self.finished = true;
        let wp = &self.wp;
        let dst_identity = self.dst_workload.as_ref().map(|w| w.identity());
        let mut peers = TcpLabels::new(
            "waypoint",
            Peer { workload: self.src_workload.as_deref(), identity: Some(&self.src_identity) },
            Peer { workload: self.dst_workload.as_deref(), identity: dst_identity.as_ref() },
            self.dst_service.as_deref(),
            true,
        );
        peers.request_protocol = self.protocol;
        peers.response_flags = self.response_flags;
        let labels = HttpLabels {
            peers,
            response_code: self.status,
            grpc_response_status: self.grpc_status.unwrap_or_default(),
        };
        let duration = self.start.elapsed();
        let request_bytes = self.request_header_bytes + self.request_bytes.load(Ordering::Relaxed);
        wp.http_metrics.record(&labels, duration.as_secs_f64() * 1000.0, request_bytes, response_bytes);
        tracing::info!(
            src.addr = %self.src_addr,
            src.identity = %self.src_identity,
            src.workload = self.src_workload.as_ref().map(|w| w.name.as_str()),
            dst.service = self.dst_service.as_ref().map(|s| s.hostname.as_str()),
            dst.workload = self.dst_workload.as_ref().map(|w| w.name.as_str()),
            dst.addr = self.dst_addr.map(|a| a.to_string()),
            protocol = self.protocol,
            method = %self.method,
            host = %self.host,
            path = %self.path,
            status = self.status,
            grpc_status = self.grpc_status,
            response_flags = self.response_flags,
            route = self.route.as_deref(),
            attempts = self.attempts,
            bytes_recv = request_bytes,
            bytes_sent = response_bytes,
            duration_ms = duration.as_millis() as u64,
            authz.denied_by = self.denied_by.as_deref(),
            authz.audited_by = (!self.audited_by.is_empty()).then(|| self.audited_by.join(",")),
            error = self.error.as_deref(),
            "request complete"
        );
    }
}

/// The response body as sent downstream: counts bytes, notes gRPC trailers, holds the
/// endpoint's active-request slot, and writes the log when it ends.
struct Metered {
    inner: Body,
    bytes: u64,
    log: Option<RequestLog>,
    _picked: Option<Picked>,
}

impl Metered {
    fn finish(&mut self) {
        if let Some(log) = self.log.take() {
            log.finish(self.bytes);
        }
        self._picked = None;
    }
}

impl http_body::Body for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    this.bytes += d.len() as u64;
                } else if let (Some(t), Some(log)) = (f.trailers_ref(), this.log.as_mut()) {
                    if let Some(v) = t.get("grpc-status") {
                        log.grpc_status = Some(grpc_status_label(v));
                    }
                }
            }
            Poll::Ready(Some(Err(e))) => {
                if let Some(log) = this.log.as_mut() {
                    log.error = Some(format!("response body: {e}"));
                    log.response_flags = "UPE";
                }
                this.finish();
            }
            Poll::Ready(None) => this.finish(),
            Poll::Pending => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        if let Some(log) = self.log.as_mut() {
            if !self.inner.is_end_stream() && log.error.is_none() {
                log.response_flags = "DC";
                log.error = Some("client went away before the response ended".into());
            }
        }
        self.finish();
    }
}

/// A request body that counts what passed through it.
struct Counted {
    inner: Incoming,
    count: Arc<AtomicU64>,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.count.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

fn empty() -> Body {
    Empty::<Bytes>::new().map_err(|never| match never {}).boxed()
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// The backend's `grpc-status` as a metric label (bounded: 0-16 or `other`).
fn grpc_status_label(v: &HeaderValue) -> &'static str {
    v.to_str().map_or("other", ztunnel::metrics::http::grpc_status)
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
fn local_reply(mut log: RequestLog, grpc: bool, status: StatusCode, flags: &'static str, message: &str) -> Response<Body> {
    log.status = status.as_u16();
    log.response_flags = flags;
    let mut resp = if grpc {
        // gRPC clients read errors from grpc-status, in a trailers-only response (HTTP
        // 200 on the wire, which is what Istio's metrics report too).
        let code = grpc_status_for(status);
        log.grpc_status = Some(ztunnel::metrics::http::grpc_status(&code.to_string()));
        log.status = 200;
        let mut r = Response::new(empty());
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        r.headers_mut().insert("grpc-status", HeaderValue::from(u16::from(code)));
        if let Ok(v) = HeaderValue::from_str(message) {
            r.headers_mut().insert("grpc-message", v);
        }
        r
    } else {
        let mut r = Response::new(full(format!("{message}\n")));
        *r.status_mut() = status;
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    let bytes = if grpc { 0 } else { message.len() as u64 + 1 };
    resp.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(bytes));
    if grpc {
        resp.headers_mut().remove(header::CONTENT_LENGTH);
    }
    resp.map(|b| Metered { inner: b, bytes: 0, log: Some(log), _picked: None }.boxed())
}

/// Hop-by-hop headers are per connection and never forwarded (RFC 9110 7.6.1).
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "proxy-authenticate", "proxy-authorization"] {
        h.remove(n);
    }
    // gRPC needs `te: trailers`; any other te value is hop-by-hop.
    if h.get(header::TE).is_some_and(|v| v != "trailers") {
        h.remove(header::TE);
    }
}

/// Identity and origin headers. `x-forwarded-client-cert` is the waypoint's to set
/// (Envoy's SANITIZE_SET): the client's is dropped, so a backend can trust it.
/// `x-forwarded-for` gets the peer's address appended, as Envoy does, so its last entry
/// is always the one the waypoint saw; `x-forwarded-proto` is kept (an ingress gateway
/// may have terminated TLS) or set to `http`. Unverifiable claims (`forwarded`,
/// `x-real-ip`) and Envoy-internal `x-envoy-*` headers are dropped.
fn set_trusted_headers(h: &mut HeaderMap, wp: &Waypoint, src_identity: &Identity, src_ip: IpAddr) {
    let client_set: Vec<HeaderName> = h
        .keys()
        .filter(|k| {
            let k = k.as_str();
            k.starts_with("x-envoy-") || k == "x-forwarded-client-cert" || k == "forwarded" || k == "x-real-ip"
        })
        .cloned()
        .collect();
    for k in client_set {
        h.remove(k);
    }
    // Several x-forwarded-for lines are one list (RFC 9110 5.3); join them first.
    let prior: Vec<&str> = h.get_all("x-forwarded-for").iter().filter_map(|v| v.to_str().ok()).collect();
    let xff = if prior.is_empty() { src_ip.to_string() } else { format!("{}, {src_ip}", prior.join(", ")) };
    match HeaderValue::from_str(&xff) {
        Ok(v) => {
            h.insert("x-forwarded-for", v);
        }
        Err(_) => {
            h.remove("x-forwarded-for");
        }
    }
    if !h.contains_key("x-forwarded-proto") {
        h.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    }
    if let Ok(v) = HeaderValue::from_str(&format!("By={};URI={}", wp.identity, src_identity)) {
        h.insert("x-forwarded-client-cert", v);
    }
    if !h.contains_key("x-request-id") {
        let id: u128 = rand::random();
        if let Ok(v) = HeaderValue::from_str(&format!("{id:032x}")) {
            h.insert("x-request-id", v);
        }
    }
}

fn header_bytes(h: &HeaderMap) -> u64 {
    h.iter().map(|(k, v)| (k.as_str().len() + v.len() + 4) as u64).sum()
}

fn idempotent(m: &Method) -> bool {
    matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE)
}

/// A request body that may be sent more than once (retries, mirrors) or only once.
enum RequestBody {
    Buffered(Bytes),
    Streaming(Option<Body>),
}

impl RequestBody {
    fn take(&mut self) -> Option<Body> {
        match self {
            RequestBody::Buffered(b) => Some(full(b.clone())),
            RequestBody::Streaming(b) => b.take(),
        }
    }
}

/// Where the router sends a request: a backend service, or the CONNECT target workload.
struct Backend {
    service: Option<Arc<Service>>,
    endpoints: Vec<(SocketAddr, Arc<Workload>)>,
}

fn backend_endpoints(cfg: &Config, svc: &Arc<Service>, port: u16) -> Backend {
    let endpoints = cfg
        .state
        .endpoints_for(svc, port)
        .into_iter()
        .filter(|(w, _)| w.status == HealthStatus::Healthy && w.protocol == MeshProtocol::HBONE)
        .filter_map(|(w, p)| w.workload_ips.iter().copied().find(IpAddr::is_ipv4).map(|ip| (SocketAddr::new(ip, p), w)))
        .collect();
    Backend { service: Some(svc.clone()), endpoints }
}

fn object_name(s: &Service) -> ObjectName {
    ObjectName { namespace: s.namespace.clone(), name: s.name.clone() }
}

async fn handle(wp: Arc<Waypoint>, tunnel: Arc<Tunnel>, proto: Protocol, req: Request<Incoming>) -> Response<Body> {
    let cfg = wp.config.load_full();
    let (mut parts, body) = req.into_parts();
    let grpc = is_grpc(&parts.headers);
    let target_service = cfg.state.service_by_vip(tunnel.target.ip()).cloned();
    let src_workload = cfg
        .state
        .workload_by_ip(tunnel.src_addr.ip())
        .filter(|w| w.identity() == tunnel.src_identity)
        .cloned();
    let host_full = parts
        .uri
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| parts.headers.get(header::HOST).and_then(|v| v.to_str().ok()).map(str::to_string))
        .unwrap_or_default();
    let mut log = RequestLog {
        wp: wp.clone(),
        start: Instant::now(),
        src_addr: tunnel.src_addr,
        src_identity: tunnel.src_identity.clone(),
        src_workload,
        dst_service: target_service.clone(),
        dst_workload: None,
        dst_addr: None,
        method: parts.method.clone(),
        path: parts.uri.path().to_string(),
        host: host_full.clone(),
        protocol: if grpc { "grpc" } else { "http" },
        status: 0,
        grpc_status: None,
        response_flags: "-",
        route: None,
        attempts: 0,
        request_bytes: Arc::new(AtomicU64::new(0)),
        request_header_bytes: header_bytes(&parts.headers),
        audited_by: Vec::new(),
        denied_by: None,
        error: None,
        finished: false,
    };

    // Tunnelling inside a tunnel is not proxied: CONNECT's target is no path to authorize.
    if parts.method == Method::CONNECT {
        return local_reply(log, grpc, StatusCode::METHOD_NOT_ALLOWED, "-", "CONNECT is not supported through the waypoint");
    }
    // Host policies and routes need a host: without Host or :authority (HTTP/1.0, or an
    // HTTP/2 request without it) there is none to check, so the request is refused.
    if host_full.is_empty() {
        return local_reply(log, grpc, StatusCode::BAD_REQUEST, "-", "the request has no Host or :authority");
    }
    // `user@host` would match host policies as one string and reach the backend as another.
    if host_full.contains('@') {
        return local_reply(log, grpc, StatusCode::BAD_REQUEST, "-", "userinfo in the request authority is not allowed");
    }
    // One normalized path for policy, routing and the backend alike.
    let pq = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let (norm_path, query) = match path::normalize_path_and_query(pq) {
        Ok(x) => x,
        Err(e) => return local_reply(log, grpc, StatusCode::BAD_REQUEST, "-", &format!("bad request path: {e}")),
    };
    log.path = norm_path.clone();
    let host = strip_port(&host_full).to_ascii_lowercase();
    // Headers as the backend will get them, before policy and routes look at them: a
    // client's `Connection: x-foo` must not remove a header after it was authorized or
    // set by a route, and identity headers are the waypoint's.
    strip_hop_by_hop(&mut parts.headers);
    set_trusted_headers(&mut parts.headers, &wp, &tunnel.src_identity, tunnel.src_addr.ip());

    let target_name = target_service.as_deref().map(object_name);
    let target = Target { gateway: &wp.gateway, service: target_name.as_ref(), port: tunnel.target.port() };

    let policies: Vec<&authz::AuthorizationPolicy> = cfg.policies.iter().filter(|p| p.applies_to(&target)).collect();
    if !policies.is_empty() {
        let verdict = authz::evaluate(
            policies,
            &authz::Request {
                source_principal: Some(&tunnel.src_identity),
                source_ip: tunnel.src_addr.ip(),
                destination_port: tunnel.target.port(),
                host: &host_full,
                method: parts.method.as_str(),
                path: &norm_path,
                headers: &parts.headers,
            },
        );
        log.audited_by = verdict.audited_by;
        if !verdict.allowed {
            log.denied_by = verdict.denied_by;
            return local_reply(log, grpc, StatusCode::FORBIDDEN, "DENY", "RBAC: access denied");
        }
    }

    let routes: Vec<&route::HttpRoute> = cfg.routes.iter().collect();
    let rreq = RouteRequest { method: &parts.method, path: &norm_path, query: query.as_deref(), headers: &parts.headers, host: &host };
    let selected = match route::select(&routes, &target, &rreq) {
        route::Selection::NoRoutes => None,
        route::Selection::NoMatch => return local_reply(log, grpc, StatusCode::NOT_FOUND, "NR", "no route matched"),
        route::Selection::Matched(s) => Some(s),
    };
    if let Some(s) = &selected {
        log.route = Some(format!("{}/{}#{}", s.route.namespace, s.route.name, s.rule_index));
    }

    let mut up_path = norm_path.clone();
    let mut up_host = host_full.clone();
    let mut response_modifiers = Vec::new();
    let mut mirrors = Vec::new();
    if let Some(Selected { rule, matched_prefix, .. }) = &selected {
        for f in &rule.filters {
            match f {
                Filter::RequestHeaderModifier(m) => m.apply(&mut parts.headers),
                Filter::ResponseHeaderModifier(m) => response_modifiers.push(m),
                Filter::UrlRewrite(rw) => rw.apply(&mut up_host, &mut up_path, *matched_prefix),
                Filter::RequestMirror(m) => mirrors.push(m),
                Filter::RequestRedirect(r) => {
                    // The request's port: from Host, else the service port it was sent to.
                    let port = host_full.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).or(Some(tunnel.target.port()));
                    let (status, location) = r.location("http", &host, port, &norm_path, query.as_deref(), *matched_prefix);
                    let mut resp = local_reply(log, false, status, "-", "");
                    if let Ok(v) = HeaderValue::from_str(&location) {
                        resp.headers_mut().insert(header::LOCATION, v);
                    }
                    return resp;
                }
            }
        }
    }

    // The backend: the route's weighted pick, else (no route, or a rule without
    // backendRefs) the service or workload the client addressed.
    let backend = match selected.as_ref().filter(|s| !s.rule.backend_refs.is_empty()) {
        Some(s) => {
            let Some(b) = s.rule.pick_backend(rand::random()) else {
                return local_reply(log, grpc, StatusCode::INTERNAL_SERVER_ERROR, "NR", "route has no backend with weight");
            };
            let name = b.service(&s.route.namespace);
            let Some(svc) = cfg.state.service_by_name(&name.namespace, &name.name) else {
                return local_reply(log, grpc, StatusCode::INTERNAL_SERVER_ERROR, "NR", &format!("backend service {}/{} not found", name.namespace, name.name));
            };
            backend_endpoints(&cfg, svc, b.backend.port.unwrap_or(tunnel.target.port()))
        }
        None => match &target_service {
            Some(svc) => backend_endpoints(&cfg, svc, tunnel.target.port()),
            None => match cfg.state.workload_by_ip(tunnel.target.ip()) {
                Some(w) if w.protocol == MeshProtocol::HBONE => Backend { service: None, endpoints: vec![(tunnel.target, w.clone())] },
                _ => return local_reply(log, grpc, StatusCode::SERVICE_UNAVAILABLE, "UH", "no mesh workload at the target address"),
            },
        },
    };
    log.dst_service = backend.service.clone().or(log.dst_service.take());
    if backend.endpoints.is_empty() {
        return local_reply(log, grpc, StatusCode::SERVICE_UNAVAILABLE, "UH", "no healthy upstream");
    }

    let retry = selected.as_ref().and_then(|s| s.rule.retry.as_ref());
    let (request_timeout, backend_timeout) =
        selected.as_ref().map(|s| (s.rule.request_timeout(), s.rule.backend_timeout())).unwrap_or((None, None));
    let want_copy = (retry.is_some() && idempotent(&parts.method)) || !mirrors.is_empty();
    let small = body.size_hint().upper().is_some_and(|n| n <= MAX_BUFFERED_BODY);
    let counted = Counted { inner: body, count: log.request_bytes.clone() };
    let mut req_body = if want_copy && small {
        match counted.collect().await {
            Ok(c) => RequestBody::Buffered(c.to_bytes()),
            Err(e) => return local_reply(log, grpc, StatusCode::BAD_REQUEST, "DC", &format!("reading the request body failed: {e}")),
        }
    } else {
        RequestBody::Streaming(Some(counted.boxed()))
    };

    // Upstream request head: the normalized (maybe rewritten) path.
    let pq = match &query {
        Some(q) => format!("{up_path}?{q}"),
        None => up_path.clone(),
    };
    let http2 = proto == Protocol::Http2;
    let uri = if http2 { format!("http://{up_host}{pq}") } else { pq.clone() };
    let Ok(uri) = uri.parse::<Uri>() else {
        return local_reply(log, grpc, StatusCode::BAD_REQUEST, "-", "request URI cannot be rebuilt");
    };
    if http2 {
        parts.headers.remove(header::HOST);
    } else if let Ok(v) = HeaderValue::from_str(&up_host) {
        parts.headers.insert(header::HOST, v);
    }
    parts.uri = uri;
    parts.version = if http2 { http::Version::HTTP_2 } else { http::Version::HTTP_11 };

    if let RequestBody::Buffered(b) = &req_body {
        for m in &mirrors {
            mirror(&wp, &cfg, m, &parts, b.clone(), http2, &host, tunnel.target.port(), selected.as_ref().map(|s| s.route.namespace.as_str()));
        }
    }

    let attempts = 1 + match retry {
        Some(r) if matches!(req_body, RequestBody::Buffered(_)) && idempotent(&parts.method) => r.attempts.unwrap_or(1),
        _ => 0,
    };
    let codes: &[u16] = retry.map(|r| r.codes.as_slice()).unwrap_or(&[]);
    let backoff = retry.and_then(|r| r.backoff).unwrap_or(Duration::from_millis(25));

    let exchange = attempt_loop(&wp, &backend, &parts, &mut req_body, http2, attempts, codes, backoff, backend_timeout, &mut log);
    let outcome = match request_timeout {
        Some(t) => match tokio::time::timeout(t, exchange).await {
            Ok(o) => o,
            Err(_) => Err((StatusCode::GATEWAY_TIMEOUT, "UT", "upstream request timeout".to_string())),
        },
        None => exchange.await,
    };
    match outcome {
        Ok((resp, picked)) => {
            let (mut rparts, rbody) = resp.into_parts();
            strip_hop_by_hop(&mut rparts.headers);
            for m in response_modifiers {
                m.apply(&mut rparts.headers);
            }
            log.status = rparts.status.as_u16();
            if let Some(v) = rparts.headers.get("grpc-status") {
                log.grpc_status = Some(grpc_status_label(v));
            }
            let body = Metered { inner: rbody.map_err(BoxError::from).boxed(), bytes: 0, log: Some(log), _picked: Some(picked) };
            Response::from_parts(rparts, body.boxed())
        }
        Err((status, flags, message)) => {
            log.error = Some(message.clone());
            local_reply(log, grpc, status, flags, &message)
        }
    }
}

type Outcome = Result<(Response<Incoming>, Picked), (StatusCode, &'static str, String)>;

#[allow(clippy::too_many_arguments)]
async fn attempt_loop(
    wp: &Arc<Waypoint>,
    backend: &Backend,
    parts: &http::request::Parts,
    body: &mut RequestBody,
    http2: bool,
    attempts: u32,
    codes: &[u16],
    backoff: Duration,
    backend_timeout: Option<Duration>,
    log: &mut RequestLog,
) -> Outcome {
    let mut tried = Vec::new();
    let mut last = (StatusCode::SERVICE_UNAVAILABLE, "UH", "no healthy upstream".to_string());
    for attempt in 0..attempts.max(1) {
        if attempt > 0 {
            // Exponential backoff with full jitter (Envoy's), capped.
            let factor = 1u32 << (attempt - 1).min(4);
            let max = backoff * factor.min(MAX_BACKOFF_FACTOR);
            let jitter = rand::random_range(0..=max.as_millis().max(1) as u64);
            tokio::time::sleep(Duration::from_millis(jitter)).await;
        }
        let Some(picked) = wp.balancer.pick(&backend.endpoints, &tried) else {
            return Err(last);
        };
        tried.push(picked.addr);
        log.attempts = attempt + 1;
        log.dst_addr = Some(picked.addr);
        log.dst_workload = Some(picked.workload.clone());
        let Some(b) = body.take() else {
            return Err(last);
        };
        let req = Request::from_parts(clone_parts(parts), b);
        let ep = Endpoint { addr: picked.addr, identities: wp.config.load().state.expected_identities(&picked.workload, backend.service.as_deref()) };
        let send = wp.upstreams.send(&ep, http2, req);
        let r = match backend_timeout {
            Some(t) => tokio::time::timeout(t, send).await.ok(),
            None => Some(send.await),
        };
        let more = attempt + 1 < attempts;
        match r {
            None => {
                picked.report(false);
                last = (StatusCode::GATEWAY_TIMEOUT, "UT", format!("upstream request timeout ({})", picked.addr));
                if !(more && codes.contains(&504)) {
                    return Err(last);
                }
            }
            Some(Err(e)) => {
                picked.report(false);
                let flags = if e.is_connect() { "UF" } else { "UC" };
                tracing::debug!(error = %e, attempt, "upstream attempt failed");
                last = (StatusCode::SERVICE_UNAVAILABLE, flags, e.to_string());
                // A request that never reached the app may always go elsewhere.
                let retriable = matches!(e, UpstreamError::Connect { .. } | UpstreamError::Handshake { .. }) || codes.contains(&503);
                if !(more && retriable) {
                    return Err(last);
                }
            }
            Some(Ok(resp)) => {
                let status = resp.status();
                picked.report(!status.is_server_error());
                if more && codes.contains(&status.as_u16()) {
                    last = (status, "URX", format!("upstream answered {status}"));
                    continue;
                }
                return Ok((resp, picked));
            }
        }
    }
    Err((last.0, if attempts > 1 { "URX" } else { last.1 }, last.2))
}

fn clone_parts(p: &http::request::Parts) -> http::request::Parts {
    let mut r = Request::new(());
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map(|(h, _)| &host[..h.len() + 1]).unwrap_or(host);
    }
    host.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map(|(h, _)| h).unwrap_or(host)
}

/// Sends a copy of the request to the mirror backend and forgets it (Envoy's shadowing:
/// the Host gets a `-shadow` suffix, the response is dropped).
#[allow(clippy::too_many_arguments)]
fn mirror(
    wp: &Arc<Waypoint>,
    cfg: &Config,
    m: &route::RequestMirror,
    parts: &http::request::Parts,
    body: Bytes,
    http2: bool,
    host: &str,
    port: u16,
    route_ns: Option<&str>,
) {
    if !m.sampled(rand::random::<f64>()) {
        return;
    }
    let name = m.service(route_ns.unwrap_or_default());
    let Some(svc) = cfg.state.service_by_name(&name.namespace, &name.name) else {
        return tracing::debug!(backend = %format!("{}/{}", name.namespace, name.name), "mirror backend not found");
    };
    let backend = backend_endpoints(cfg, svc, m.backend_ref.port.unwrap_or(port));
    let mut parts = clone_parts(parts);
    let shadow = format!("{host}-shadow");
    if http2 {
        if let Ok(u) = format!("http://{shadow}{}", parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/")).parse() {
            parts.uri = u;
        }
    } else if let Ok(v) = HeaderValue::from_str(&shadow) {
        parts.headers.insert(header::HOST, v);
    }
    // Mirrors are best effort and must not pile up behind a slow mirror backend.
    let Ok(slot) = wp.mirror_slots.clone().try_acquire_owned() else {
        return tracing::debug!("mirror skipped: too many mirrored requests in flight");
    };
    let wp = wp.clone();
    tokio::spawn(async move {
        let _slot = slot;
        let Some(picked) = wp.balancer.pick(&backend.endpoints, &[]) else { return };
        let ep = Endpoint { addr: picked.addr, identities: wp.config.load().state.expected_identities(&picked.workload, backend.service.as_deref()) };
        let exchange = async {
            let resp = wp.upstreams.send(&ep, http2, Request::from_parts(parts, full(body))).await?;
            // Read (and drop) the response so the connection can be reused, up to a cap.
            let mut body = resp.into_body();
            let mut read = 0usize;
            while let Some(Ok(frame)) = body.frame().await {
                read += frame.data_ref().map_or(0, |d| d.len());
                if read > MIRROR_MAX_RESPONSE {
                    break;
                }
            }
            Ok::<_, UpstreamError>(())
        };
        match tokio::time::timeout(MIRROR_TIMEOUT, exchange).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "mirrored request failed"),
            Err(_) => tracing::debug!("mirrored request timed out"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("gzip"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut g = HeaderMap::new();
        g.insert("te", HeaderValue::from_static("trailers"));
        strip_hop_by_hop(&mut g);
        assert!(g.contains_key("te"));
    }

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("echo:80"), "echo");
        assert_eq!(strip_port("echo"), "echo");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("10.96.0.10:80"), "10.96.0.10");
    }

    #[test]
    fn grpc_local_replies_map_status() {
        assert_eq!(grpc_status_for(StatusCode::FORBIDDEN), 7);
        assert_eq!(grpc_status_for(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(grpc_status_for(StatusCode::NOT_FOUND), 12);
    }

    #[test]
    fn backend_grpc_status_becomes_a_bounded_label() {
        assert_eq!(grpc_status_label(&HeaderValue::from_static("14")), "14");
        assert_eq!(grpc_status_label(&HeaderValue::from_static("0")), "0");
        for v in ["17", "deadbeef", "1 ", "00"] {
            assert_eq!(grpc_status_label(&HeaderValue::from_static(v)), "other", "{v}");
        }
        assert_eq!(grpc_status_label(&HeaderValue::from_bytes(b"\xff").unwrap()), "other");
    }
}
