//! Admin endpoint, bound to localhost in the proxy's own netns so pods can never reach
//! it: `GET /logging` (current filter), `POST /logging?level=<filter>`, `POST /quitquitquit`
//! (graceful drain, like SIGTERM).

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// Reads or replaces the log filter (e.g. `info`, `ztunnel::proxy=debug`).
pub trait LogControl: Send + Sync {
    fn get(&self) -> String;
    fn set(&self, filter: &str) -> Result<(), String>;
}

pub struct Admin {
    pub log: Box<dyn LogControl>,
    /// Notified by /quitquitquit; the binary then drains as on SIGTERM.
    pub quit: Arc<Notify>,
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

fn query_param<'a>(req: &'a Request<Incoming>, key: &str) -> Option<&'a str> {
    req.uri().query()?.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn route(admin: &Admin, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/logging") => text(StatusCode::OK, format!("current log level is {}\n", admin.log.get())),
        (&Method::POST, "/logging") => match query_param(req, "level") {
            None => text(StatusCode::BAD_REQUEST, "usage: POST /logging?level=<filter>, e.g. level=debug\n".into()),
            Some(level) => match admin.log.set(level) {
                Ok(()) => {
                    tracing::info!(level, "log level changed");
                    text(StatusCode::OK, format!("current log level is {}\n", admin.log.get()))
                }
                Err(e) => text(StatusCode::BAD_REQUEST, format!("invalid log filter {level:?}: {e}\n")),
            },
        },
        (&Method::POST, "/quitquitquit") => {
            admin.quit.notify_one();
            text(StatusCode::OK, "draining\n".into())
        }
        (_, "/logging" | "/quitquitquit") => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n".into()),
        _ => text(StatusCode::NOT_FOUND, "not found; try /logging or /quitquitquit\n".into()),
    }
}

pub async fn serve(listener: TcpListener, admin: Arc<Admin>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                crate::proxy::accept_backoff("admin", e).await;
                continue;
            }
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let resp = route(&admin, &req);
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new().half_close(true).serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}
