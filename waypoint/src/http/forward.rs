//! The forward step: sends a planned request upstream (body buffered when a retry or
//! mirror needs a copy), with attempts, retries, backoff and timeouts, and turns the
//! outcome into the downstream response.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;

use super::backend::Backend;
use super::body::{Counted, Downstream, Metered, RequestBody};
use super::headers::{authority, clone_parts, strip_hop_by_hop};
use super::log::{grpc_status_label, RequestLog};
use super::mirror::mirror_all;
use super::plan::Plan;
use super::reply::LocalReply;
use super::stream_idle::StreamIdle;
use super::upgrade;
use crate::config::Config;
use crate::context::Waypoint;
use crate::destination::RetryShare;
use crate::lb::{Choice, Limit, Outcome as Attempt, Picked};
use crate::upstream::{Body, BoxError, Endpoint};

/// Request bodies up to this size are buffered when a retry or mirror needs a copy.
const MAX_BUFFERED_BODY: u64 = 64 * 1024;
const MAX_BACKOFF_FACTOR: u32 = 10;

/// What one request is sent with, besides its plan.
pub struct Exchange<'a> {
    pub wp: &'a Arc<Waypoint>,
    /// The snapshot the plan was made from (mirror backends are looked up in it).
    pub cfg: &'a Config,
    pub log: RequestLog,
    /// Whether local replies are gRPC statuses.
    pub grpc: bool,
    /// The tunnel's trace (new upstream CONNECTs join the request's, else this one).
    pub trace: ztunnel::hbone::TraceParent,
    /// The stream idle timeout's clock (the request body's too).
    pub idle: StreamIdle,
}

/// How many times to try, which backend answers to retry on, and the timing.
struct Attempts<'a> {
    count: u32,
    /// Backend status codes that are retried (504 and 503 also stand for a timeout and
    /// a failed connection).
    codes: &'a [u16],
    backoff: Duration,
    per_try_timeout: Option<Duration>,
    /// How endpoints are picked (the backend Service's DestinationRule).
    choice: Choice,
    /// The backend Service (`namespace/hostname`) and its DestinationRule's maxRetries
    /// or retryBudget.
    service: String,
    max_retries: Option<u32>,
    retry_budget: Option<RetryShare>,
}

/// Istio's retries when a route sets none (`route/retry/retry.go`): 2 more attempts on
/// `connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes` with no
/// status codes listed, so no 5xx answer is retried; for any method, since none of
/// those conditions means the application acted on the request.
const DEFAULT_RETRIES: u32 = 2;

impl<'a> Attempts<'a> {
    /// Retries only for a body that can be sent again; a route's own policy only for
    /// idempotent methods, Istio's default one (no route policy) for any.
    fn new(plan: &Plan<'a>, method: &Method, body: &RequestBody, service: String) -> Self {
        let retry = plan.retry;
        let traffic = plan.backend.policy.as_deref();
        let resendable = matches!(body, RequestBody::Buffered(_));
        Attempts {
            count: 1 + match retry {
                Some(r) if resendable && idempotent(method) => r.attempts.unwrap_or(1),
                None if resendable => DEFAULT_RETRIES,
                _ => 0,
            },
            codes: retry.map(|r| r.codes.as_slice()).unwrap_or(&[]),
            backoff: retry
                .and_then(|r| r.backoff)
                .unwrap_or(Duration::from_millis(25)),
            per_try_timeout: plan.timeouts.backend,
            choice: Choice {
                prefer: plan.session.and_then(|(_, addr)| addr),
                pick: traffic.and_then(|t| t.pick.clone()),
                hash: plan.hash,
                outlier: traffic.and_then(|t| t.outlier),
            },
            service,
            max_retries: traffic.and_then(|t| t.max_retries),
            retry_budget: traffic.and_then(|t| t.retry_budget),
        }
    }
}

/// The request body, counted into the log; buffered when a copy is wanted and it is
/// small enough, else streamed (and then sent once).
async fn request_body(
    body: Downstream,
    want_copy: bool,
    log: &RequestLog,
    idle: &StreamIdle,
) -> Result<RequestBody, LocalReply> {
    let small = body
        .size_hint()
        .upper()
        .is_some_and(|n| n <= MAX_BUFFERED_BODY);
    let counted = Counted::new(body, log.request_bytes.clone());
    if !(want_copy && small) {
        return Ok(RequestBody::Streaming(Some(counted.boxed())));
    }
    match idle.within(counted.collect()).await {
        Ok(Ok(c)) => Ok(RequestBody::Buffered(c.to_bytes())),
        Ok(Err(_)) | Err(_) if idle.fired() => Err(idle.reply()),
        Ok(Err(e)) => Err(LocalReply::new(
            StatusCode::BAD_REQUEST,
            "DC",
            format!("reading the request body failed: {e}"),
        )),
        Err(_) => Err(idle.reply()),
    }
}

type Outcome = Result<(Response<Incoming>, Picked), LocalReply>;

fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// Sends the request as planned; the response is the backend's, or a local reply when
/// no attempt got one.
pub async fn forward(
    x: Exchange<'_>,
    mut plan: Plan<'_>,
    req: Request<Downstream>,
) -> Response<Body> {
    let Exchange {
        wp,
        cfg,
        mut log,
        grpc,
        trace,
        idle,
    } = x;
    // Endpoints known by hostname (DNS ServiceEntries): their addresses, from the cache
    // or asked now.
    let resolved = match idle
        .within(plan.backend.resolve(&wp.resolver, &wp.me))
        .await
    {
        Ok(r) => r,
        Err(_) => {
            return idle
                .reply()
                .with_headers(plan.cors.as_ref())
                .send(log, grpc)
        }
    };
    if let Err(why) = resolved {
        let reply = LocalReply::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "UH",
            format!("no healthy upstream ({why})"),
        );
        log.error = Some(reply.message.clone());
        return reply.with_headers(plan.cors.as_ref()).send(log, grpc);
    }
    // DestinationRule http2MaxRequests: over the limit, Envoy's overflow (503 UO).
    let policy = plan.backend.policy.as_deref();
    // The circuits' key, only formatted when a limit needs it (not per request otherwise).
    let limited = policy.is_some_and(|t| {
        t.max_requests.is_some()
            || t.max_connections.is_some()
            || t.max_retries.is_some()
            || t.retry_budget.is_some()
    });
    let service_key = match plan.backend.service.as_deref() {
        Some(s) if limited => s.namespaced_hostname().to_string(),
        _ => String::new(),
    };
    // A retry budget counts the Service's requests in flight, with or without a limit.
    let counted = policy.and_then(|t| t.max_requests.or(t.retry_budget.map(|_| u32::MAX)));
    let request_slot = match counted {
        Some(max) => match wp.circuits.take(&service_key, Limit::Requests, max) {
            Some(slot) => Some(slot),
            None => return overflow(log, grpc, policy),
        },
        None => None,
    };
    if let Some(d) = plan.fault_delay {
        log.response_flags = "DI";
        if idle.within(tokio::time::sleep(d)).await.is_err() {
            return idle
                .reply()
                .with_headers(plan.cors.as_ref())
                .send(log, grpc);
        }
    }
    let (mut parts, body) = req.into_parts();
    // A WebSocket is not mirrored: a shadow upgrade would hold a connection for nothing.
    let mirrors = plan.websocket.is_none() && !plan.mirrors.to.is_empty();
    // A copy for retries (Istio's default policy included) and mirrors.
    let want_copy = plan.retry.is_none() || idempotent(&parts.method) || mirrors;
    let mut req_body = match request_body(body, want_copy, &log, &idle).await {
        Ok(b) => b,
        Err(reply) => return reply.with_headers(plan.cors.as_ref()).send(log, grpc),
    };
    if let (RequestBody::Buffered(b), true) = (&req_body, mirrors) {
        mirror_all(wp, cfg, &plan.mirrors, &parts, b);
    }
    let attempts = Attempts::new(&plan, &parts.method, &req_body, service_key.clone());
    let exchange = async {
        // DestinationRule tcp.maxConnections: an HTTP/1.1 request takes one of the
        // Service's connections, or waits in the http1MaxPendingRequests queue (within the
        // request timeout); a full queue overflows.
        let connection = match (plan.http2, policy.and_then(|t| t.max_connections)) {
            (false, Some(max)) => match wp
                .circuits
                .connection(&service_key, max, policy.and_then(|t| t.max_pending))
                .await
            {
                Ok(slot) => Some(slot),
                Err(_) => return Err(overflow_reply(policy)),
            },
            _ => None,
        };
        let (resp, mut picked) = attempt_loop(
            wp,
            &plan.backend,
            plan.http2,
            &parts,
            &mut req_body,
            &attempts,
            &mut log,
            trace,
        )
        .await?;
        if let Some(slot) = connection {
            picked.hold(slot);
        }
        Ok((resp, picked))
    };
    let timed = async {
        match plan.timeouts.request {
            Some(t) => match tokio::time::timeout(t, exchange).await {
                Ok(o) => o,
                Err(_) => Err(LocalReply::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "UT",
                    "upstream request timeout",
                )),
            },
            None => exchange.await,
        }
    };
    // The stream idle timeout before the response head: the attempts (and what they
    // hold upstream) are dropped. A failure the request body's own timer caused is one.
    let outcome = match idle.within(timed).await {
        Ok(Err(_)) | Err(_) if idle.fired() => Err(idle.reply()),
        Ok(o) => o,
        Err(_) => Err(idle.reply()),
    };
    match outcome {
        Ok((resp, mut picked)) => {
            // The request counts against the limit until its response is done.
            if let Some(slot) = request_slot {
                picked.hold(slot);
            }
            let ws = plan.websocket.as_ref().filter(|ws| ws.accepted(&resp));
            let (mut rparts, rbody) = resp.into_parts();
            strip_hop_by_hop(&mut rparts.headers);
            for m in plan.response_modifiers {
                m.apply(&mut rparts.headers);
            }
            // Envoy's CORS filter sets its headers over the backend's.
            for (name, value) in plan.cors.iter().flat_map(|h| h.iter()) {
                rparts.headers.insert(name.clone(), value.clone());
            }
            for (name, value) in plan.response_headers {
                rparts.headers.append(name, value);
            }
            // A new session, or one whose endpoint is gone: name the endpoint it has now.
            if let Some((sp, _)) = plan.session.filter(|(_, had)| *had != Some(picked.addr)) {
                set_session(&mut rparts.headers, sp, picked.addr);
            }
            let ups = ws.and_then(|ws| {
                Some((
                    ws,
                    parts.extensions.remove::<OnUpgrade>()?,
                    rparts.extensions.remove::<OnUpgrade>()?,
                ))
            });
            if let Some((ws, client, backend)) = ups {
                return upgrade::relay(client, backend, rparts, ws, log, picked);
            }
            log.status = rparts.status.as_u16();
            log.response_headers(&rparts.headers);
            if let Some(v) = rparts.headers.get("grpc-status") {
                log.grpc_status = Some(grpc_status_label(v));
            }
            let body = Metered::new(rbody.map_err(BoxError::from).boxed(), log, Some(picked))
                .with_idle(idle);
            Response::from_parts(rparts, body.boxed())
        }
        Err(reply) => {
            log.error = Some(reply.message.clone());
            reply.with_headers(plan.cors.as_ref()).send(log, grpc)
        }
    }
}

/// Names the session's endpoint in the response: a cookie (Max-Age from absoluteTimeout
/// for a Permanent one) or the header.
fn set_session(
    headers: &mut http::HeaderMap,
    sp: &crate::route::SessionPersistence,
    addr: std::net::SocketAddr,
) {
    let value = super::plan::session_value(addr);
    let v = match sp.kind {
        crate::route::SessionKind::Header => value,
        crate::route::SessionKind::Cookie => {
            let permanent = sp
                .cookie_config
                .as_ref()
                .and_then(|c| c.lifetime_type.as_deref())
                == Some("Permanent");
            match sp.absolute_timeout.filter(|_| permanent) {
                Some(t) => format!(
                    "{}={value}; Path=/; HttpOnly; Max-Age={}",
                    sp.name(),
                    t.0.as_secs()
                ),
                None => format!("{}={value}; Path=/; HttpOnly", sp.name()),
            }
        }
    };
    let name = match sp.kind {
        crate::route::SessionKind::Header => {
            http::HeaderName::from_bytes(sp.name().as_bytes()).ok()
        }
        crate::route::SessionKind::Cookie => Some(http::header::SET_COOKIE),
    };
    if let (Some(name), Ok(v)) = (name, http::HeaderValue::from_str(&v)) {
        headers.append(name, v);
    }
}

/// Envoy's reply when a DestinationRule's connection pool limit is reached.
fn overflow(
    log: RequestLog,
    grpc: bool,
    traffic: Option<&crate::destination::Policy>,
) -> Response<Body> {
    overflow_reply(traffic).send(log, grpc)
}

fn overflow_reply(traffic: Option<&crate::destination::Policy>) -> LocalReply {
    let rule = traffic.map(|t| t.rule.as_str()).unwrap_or("-");
    tracing::debug!(
        destination_rule = rule,
        "circuit open: too many requests in flight or waiting for the backend"
    );
    LocalReply::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "UO",
        "upstream connect error or disconnect/reset before headers. reset reason: overflow",
    )
}

// The request's parts are borrowed apart (several mutably), so they cannot travel as one.
#[allow(clippy::too_many_arguments)]
async fn attempt_loop(
    wp: &Arc<Waypoint>,
    backend: &Backend,
    http2: bool,
    parts: &http::request::Parts,
    body: &mut RequestBody,
    attempts: &Attempts<'_>,
    log: &mut RequestLog,
    tunnel_trace: ztunnel::hbone::TraceParent,
) -> Outcome {
    let Attempts {
        count: attempts,
        codes,
        backoff,
        per_try_timeout: backend_timeout,
        ref choice,
        ref service,
        max_retries,
        retry_budget,
    } = *attempts;
    let mut tried = Vec::new();
    let mut last = LocalReply::new(StatusCode::SERVICE_UNAVAILABLE, "UH", "no healthy upstream");
    // A new upstream CONNECT joins the request's trace (the waypoint's span, or the
    // client's), else its tunnel's.
    let trace = parts
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(ztunnel::hbone::TraceParent::parse)
        .unwrap_or(tunnel_trace)
        .child();
    for attempt in 0..attempts.max(1) {
        // DestinationRule maxRetries: retries in flight to the Service; over it, no retry.
        // A retryBudget replaces it (Envoy): a share of the requests in flight.
        let max_retries = match retry_budget {
            Some(b) => Some(b.allowed(wp.circuits.in_flight(service, Limit::Requests))),
            None => max_retries,
        };
        let _retry_slot = match (attempt > 0, max_retries) {
            (true, Some(max)) => match wp.circuits.take(service, Limit::Retries, max) {
                Some(slot) => Some(slot),
                None => {
                    last.flags = "UO";
                    return Err(last);
                }
            },
            _ => None,
        };
        if attempt > 0 {
            // Exponential backoff with full jitter (Envoy's), capped.
            let factor = 1u32 << (attempt - 1).min(4);
            let max = backoff * factor.min(MAX_BACKOFF_FACTOR);
            let jitter = rand::random_range(0..=max.as_millis().max(1) as u64);
            tokio::time::sleep(Duration::from_millis(jitter)).await;
        }
        let Some(picked) = wp.balancer.pick_with(&backend.endpoints, &tried, choice) else {
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
        let mut ep = Endpoint::of(
            &wp.config.load().state,
            picked.addr,
            &picked.workload,
            backend.service.as_deref(),
        );
        ep.tls = backend.tls_target(Some(&authority(parts)), picked.addr.ip(), http2);
        ep.reuse = backend.policy.as_ref().map(|t| t.reuse).unwrap_or_default();
        ep.trace = trace;
        let send = wp.upstreams.send(&ep, http2, req);
        let r = match backend_timeout {
            Some(t) => tokio::time::timeout(t, send).await.ok(),
            None => Some(send.await),
        };
        let more = attempt + 1 < attempts;
        match r {
            None => {
                picked.report(Attempt::LocalFailure);
                last = LocalReply::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "UT",
                    format!("upstream request timeout ({})", picked.addr),
                );
                if !(more && codes.contains(&504)) {
                    return Err(last);
                }
            }
            Some(Err(e)) => {
                picked.report(Attempt::LocalFailure);
                let flags = if e.is_connect() { "UF" } else { "UC" };
                tracing::debug!(error = %e, attempt, "upstream attempt failed");
                last = LocalReply::new(StatusCode::SERVICE_UNAVAILABLE, flags, e.to_string());
                // A request that never reached the app (no connection, or a stream the
                // server refused unprocessed) may always go elsewhere.
                let retriable = e.is_connect() || e.is_refused_stream() || codes.contains(&503);
                if !(more && retriable) {
                    return Err(last);
                }
            }
            Some(Ok(resp)) => {
                let status = resp.status();
                picked.report(if status.is_server_error() {
                    Attempt::ServerError
                } else {
                    Attempt::Success
                });
                if more
                    && (codes.contains(&status.as_u16()) || grpc_unavailable_or_cancelled(&resp))
                {
                    last = LocalReply::new(status, "URX", format!("upstream answered {status}"));
                    continue;
                }
                return Ok((resp, picked));
            }
        }
    }
    if attempts > 1 {
        last.flags = "URX";
    }
    Err(last)
}

/// Envoy's `unavailable` and `cancelled` retry conditions: a gRPC answer whose status
/// (in the headers: a trailers-only response) is UNAVAILABLE (14) or CANCELLED (1).
fn grpc_unavailable_or_cancelled<B>(resp: &Response<B>) -> bool {
    resp.headers()
        .get("grpc-status")
        .is_some_and(|v| v == "14" || v == "1")
}
