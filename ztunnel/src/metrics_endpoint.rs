//! Prometheus scrape endpoint (15020: `/metrics`, `/stats/prometheus`) and readiness
//! (15021: `/healthz/ready`), in the proxy's own network namespace.

use std::sync::Arc;

use http::{Request, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;

use crate::http_endpoint::{self, respond, text, HttpResponse};
use crate::metrics::Metrics;

fn route(metrics: &Metrics, req: &Request<Incoming>) -> HttpResponse {
    match req.uri().path() {
        "/metrics" | "/stats/prometheus" => respond(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        "/healthz/ready" if metrics.is_ready() => text(StatusCode::OK, "ready\n".into()),
        "/healthz/ready" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", metrics.not_ready_reason()),
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    http_endpoint::serve(listener, "metrics", move |req| route(&metrics, req)).await
}
