//! Exports finished request spans (see `trace`) with OTLP/gRPC to the mesh config's
//! tracing provider, over HBONE (or plain TCP) like any backend request. Spans wait in
//! `trace::SpanQueue` and leave in batches; a failed export drops its batch: tracing
//! never holds back a request.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Method, Request};
use http_body_util::{BodyExt, Limited};
use tokio::sync::mpsc;

use super::backend::Backend;
use super::body::full;
use super::plan::set_head_for;
use crate::context::Waypoint;
use crate::extauthz::check::grpc_frame;
use crate::trace::{export_request, proto::EXPORT_PATH, FinishedSpan};
use crate::upstream::Endpoint;

/// Spans per export call, at most.
const BATCH: usize = 256;
/// How long a span may wait for its batch to fill.
const FLUSH: Duration = Duration::from_secs(1);

/// Runs until the waypoint ends: batches spans and sends each batch.
pub async fn run(wp: Arc<Waypoint>, mut rx: mpsc::Receiver<FinishedSpan>) {
    let service_name = format!("{}.{}", wp.gateway.name, wp.gateway.namespace);
    loop {
        let Some(first) = rx.recv().await else { return };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + FLUSH;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(s)) => batch.push(s),
                Ok(None) | Err(_) => break,
            }
        }
        let n = batch.len();
        if let Err(e) = export(&wp, &service_name, batch).await {
            tracing::warn!(spans = n, error = %e, "span export failed; batch dropped");
        }
    }
}

async fn export(wp: &Waypoint, service_name: &str, spans: Vec<FinishedSpan>) -> Result<(), String> {
    let cfg = wp.config.load_full();
    let t = cfg.tracing.clone().ok_or("tracing is off in the current config")?;
    let svc = super::ext_authz::find_service(&cfg, &t.service).ok_or_else(|| format!("tracing service {} is not in the mesh state", t.service))?;
    let backend = Backend::service(&cfg, svc, t.port);
    let picked = wp.balancer.pick(&backend.endpoints, &[]).ok_or_else(|| format!("tracing service {} has no healthy endpoint", t.service))?;
    let ep = Endpoint::of(&cfg.state, picked.addr, &picked.workload, Some(svc));
    let mut parts = Request::new(()).into_parts().0;
    parts.method = Method::POST;
    let authority = t.service.rsplit('/').next().unwrap_or(&t.service);
    set_head_for(&mut parts, authority, EXPORT_PATH, true).map_err(|e| e.to_string())?;
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
    let body = full(grpc_frame(&export_request(service_name, spans)));
    let send = wp.upstreams.send(&ep, true, Request::from_parts(parts, body));
    let resp = tokio::time::timeout(Duration::from_secs(10), send).await.map_err(|_| "timed out".to_string())?.map_err(|e| e.to_string())?;
    let (rparts, body) = resp.into_parts();
    let collected = Limited::new(body, 64 * 1024).collect().await.map_err(|e| e.to_string())?;
    let status = collected
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .or(rparts.headers.get("grpc-status"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_string();
    if status != "0" {
        return Err(format!("collector answered gRPC status {status}"));
    }
    Ok(())
}
