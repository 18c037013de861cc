//! Prometheus scrape endpoint (15020: `/metrics`, `/stats/prometheus`) and readiness
//! (15021: `/healthz/ready`), in the proxy's own network namespace.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Metrics;

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

fn route(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/metrics" | "/stats/prometheus" => {
            respond(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode())
        }
        "/healthz/ready" if metrics.is_ready() => respond(StatusCode::OK, "text/plain", "ready\n".into()),
        "/healthz/ready" => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "not ready\n".into()),
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                crate::proxy::accept_backoff("metrics", e).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let resp = route(&metrics, &req);
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            // Answer clients that half-close after sending their request (hyper closes by default).
            let _ = hyper::server::conn::http1::Builder::new().half_close(true).serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// SO_REUSEPORT, so a new ztunnel can bind beside the old one during a hand-off.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(128)?;
    TcpListener::from_std(s.into())
}
