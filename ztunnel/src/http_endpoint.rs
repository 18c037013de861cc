//! The small HTTP/1.1 server behind the proxy's own endpoints (admin, metrics, readiness).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub type HttpResponse = Response<Full<Bytes>>;

pub fn respond(status: StatusCode, content_type: &str, body: String) -> HttpResponse {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

pub fn text(status: StatusCode, body: String) -> HttpResponse {
    respond(status, "text/plain; charset=utf-8", body)
}

/// SO_REUSEPORT, so a new ztunnel can bind beside the old one during a hand-off. `[::]`
/// takes both families (whatever the host's `bindv6only`).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)?;
    }
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(128)?;
    TcpListener::from_std(s.into())
}

/// Serves `route` on every connection until the task is dropped.
pub async fn serve<F>(listener: TcpListener, name: &'static str, route: F)
where
    F: Fn(&Request<Incoming>) -> HttpResponse + Send + Sync + 'static,
{
    let route = Arc::new(route);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                crate::listen::accept_backoff(name, e).await;
                continue;
            }
        };
        let route = route.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let resp = route(&req);
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            // Answer clients that half-close after sending their request (hyper closes by default).
            let _ = hyper::server::conn::http1::Builder::new()
                .half_close(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
