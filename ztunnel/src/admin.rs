//! Admin endpoint, bound to localhost in the proxy's own netns so pods can never reach
//! it: `GET /config_dump` (Istio ztunnel's JSON), `GET /logging` (current filter),
//! `POST /logging?level=<filter>`, `POST /quitquitquit` (graceful drain, like SIGTERM).

pub mod config_dump;

use std::sync::Arc;

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::http_endpoint::{self, text, HttpResponse};

/// Reads or replaces the log filter (e.g. `info`, `ztunnel::proxy=debug`).
pub trait LogControl: Send + Sync {
    fn get(&self) -> String;
    fn set(&self, filter: &str) -> Result<(), String>;
}

pub struct Admin {
    pub log: Box<dyn LogControl>,
    /// Notified by /quitquitquit; the binary then drains as on SIGTERM.
    pub quit: Arc<Notify>,
    /// Produces the /config_dump document.
    pub config_dump: Box<dyn Fn() -> serde_json::Value + Send + Sync>,
}

fn query_param<'a>(req: &'a Request<Incoming>, key: &str) -> Option<&'a str> {
    req.uri().query()?.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn route(admin: &Admin, req: &Request<Incoming>) -> HttpResponse {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/config_dump") => {
            let body = serde_json::to_string_pretty(&(admin.config_dump)()).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
            crate::http_endpoint::respond(StatusCode::OK, "application/json", body)
        }
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
        (_, "/logging" | "/quitquitquit" | "/config_dump") => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n".into()),
        _ => text(StatusCode::NOT_FOUND, "not found; try /config_dump, /logging or /quitquitquit\n".into()),
    }
}

pub async fn serve(listener: TcpListener, admin: Arc<Admin>) {
    http_endpoint::serve(listener, "admin", move |req| route(&admin, req)).await
}
