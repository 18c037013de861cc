//! Exports finished request spans (see `trace`) with OTLP/gRPC to the mesh config's
//! tracing provider, over HBONE (or plain TCP) like any backend request. Spans wait in
//! `trace::SpanQueue` and leave in batches; a failed export drops its batch: tracing
//! never holds back a request.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::grpc::{service_endpoint, unary};
use crate::context::Waypoint;
use crate::trace::{export_request, proto::EXPORT_PATH, FinishedSpan};

/// Spans per export call, at most.
const BATCH: usize = 256;
/// How long a span may wait for its batch to fill.
const FLUSH: Duration = Duration::from_secs(1);
/// One export call, at most.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

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
    let t = cfg
        .tracing
        .clone()
        .ok_or("tracing is off in the current config")?;
    let (ep, _) = service_endpoint(wp, &cfg, &t.service, t.port)
        .await
        .map_err(|e| format!("tracing {e}"))?;
    let message = export_request(service_name, spans);
    let call = unary(wp, &ep, &t.service, EXPORT_PATH, &message, None);
    match tokio::time::timeout(EXPORT_TIMEOUT, call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("collector {e}")),
        Err(_) => Err("timed out".into()),
    }
}
