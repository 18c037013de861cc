//! L7: HTTP/1.1 and HTTP/2 (gRPC included) requests inside an HBONE tunnel, served with
//! hyper. Each request goes through two steps: `plan` normalizes it, authenticates it
//! (RequestAuthentication), authorizes it (AuthorizationPolicy) and routes it (HTTPRoute: matches, filters, weighted backends,
//! timeouts, retries) or answers it locally (`reply`); `forward` balances it over
//! the backend's endpoints and sends it over pooled HBONE, with retries and mirrors
//! (`mirror`). One access log line and the Istio request metrics per request (`log`).

pub mod authority;
pub(crate) mod backend;
mod body;
pub mod ext_authz;
mod forward;
mod grpc;
mod headers;
mod log;
pub mod log_export;
mod mirror;
mod plan;
mod reply;
mod stream_idle;
pub mod trace_export;
mod tunnel;
mod upgrade;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use ztunnel::hbone::H2Stream;

use crate::context::Waypoint;
use crate::detect::Protocol;
use crate::upstream::Body;

pub use backend::{Backend, Origin};
pub use mirror::MAX_MIRRORS_IN_FLIGHT;
pub use tunnel::Tunnel;

/// How long a client has for its request head (and, on a port that declares HTTP, for
/// its first bytes).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves HTTP on one tunnel until the client closes it.
pub async fn serve(wp: Arc<Waypoint>, tunnel: Arc<Tunnel>, io: H2Stream, proto: Protocol) {
    let idle = wp.idle_timeout;
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (wp, tunnel) = (wp.clone(), tunnel.clone());
        async move { Ok::<_, Infallible>(handle(wp, tunnel, proto, req).await) }
    });
    let (io, activity) = crate::idle::Counted::new(io);
    let io = TokioIo::new(io);
    let conn = async move {
        match proto {
            Protocol::Http2 => {
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .timer(TokioTimer::new())
                    .max_concurrent_streams(100)
                    .max_header_list_size(64 * 1024)
                    .max_pending_accept_reset_streams(50)
                    // RFC 8441 extended CONNECT, for WebSockets over HTTP/2.
                    .enable_connect_protocol()
                    .serve_connection(io, svc)
                    .await
            }
            _ => {
                hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .max_headers(100)
                    .serve_connection(io, svc)
                    .with_upgrades()
                    .await
            }
        }
    };
    // No byte either way for the idle timeout (no request in progress moved any):
    // the connection is closed, as Envoy's HTTP connection idle timeout does.
    let r = tokio::select! {
        r = conn => r,
        _ = activity.idle(idle) => return tracing::debug!("HTTP connection closed: idle"),
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// One request: plan it against one config snapshot, then forward it (or send the
/// plan's local reply).
async fn handle(
    wp: Arc<Waypoint>,
    tunnel: Arc<Tunnel>,
    proto: Protocol,
    req: Request<Incoming>,
) -> Response<Body> {
    let cfg = wp.config.load_full();
    let (mut parts, body) = req.into_parts();
    // Envoy's stream idle timeout: restarted by every frame of the request body read and
    // of the response body sent.
    let idle = stream_idle::StreamIdle::new(wp.stream_idle_timeout);
    let mut body = body::Downstream::new(body, idle.clone());
    let grpc = reply::is_grpc(&parts.headers);
    let mut log = log::RequestLog::start(wp.clone(), &tunnel, &cfg, &parts, grpc);
    // Envoy's HTTP/1 codec refuses HTTP/1.0 unless `accept_http_10` (PILOT_HTTP10):
    // before any route or policy, and the connection is closed.
    if parts.version < http::Version::HTTP_11 && !wp.accept_http10 {
        return reply::LocalReply::http10_refused().send(log, false);
    }
    // A traced request goes on as a child of the waypoint's span.
    if let Some(span) = log.span() {
        span.propagate(&mut parts.headers);
    }

    let inbound = plan::Inbound {
        me: wp.me_in(&cfg),
        gateway: &wp.gateway,
        root_namespace: &wp.root_namespace,
        identity: &wp.identity,
        tunnel: &tunnel,
        cfg: &cfg,
        proto,
        jwks: &wp.jwks,
    };
    let mut notes = log::Notes::default();
    let planned = match plan::admit(&inbound, &mut parts, &mut notes) {
        Ok(mut admitted) => {
            let check = ext_authz::run(
                &wp,
                &cfg,
                &tunnel,
                proto == Protocol::Http2,
                &mut admitted,
                &mut parts,
                &mut body,
                &mut notes,
            );
            match idle.within(check).await {
                Ok(Ok(())) => plan::build(&inbound, admitted, &mut parts, &mut notes),
                Ok(Err(reply)) => Err(reply),
                Err(_) => Err(idle.reply()),
            }
        }
        Err(reply) => Err(reply),
    };
    log.note(notes);
    match planned {
        Ok(plan) => {
            let x = forward::Exchange {
                wp: &wp,
                cfg: &cfg,
                log,
                grpc,
                trace: tunnel.trace,
                idle,
            };
            forward::forward(x, plan, Request::from_parts(parts, body)).await
        }
        Err(reply) => reply.send(log, grpc),
    }
}
