//! Exports the `envoyOtelAls` access-log records (see `telemetry::otel_log`) with
//! OTLP/gRPC to each provider's Service, over HBONE (or plain TCP) like any backend
//! request. Records wait in the waypoint's queue and leave in batches, one export call per
//! provider; a failed export drops its batch: logging never holds back a request.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::grpc::{service_endpoint, unary};
use crate::context::Waypoint;
use crate::telemetry::otel_log::FinishedLog;
use crate::trace::proto::{self, common::InstrumentationScope, LOGS_EXPORT_PATH};

/// Records per export call, at most.
const BATCH: usize = 256;
/// How long a record may wait for its batch to fill.
const FLUSH: Duration = Duration::from_secs(1);
/// One export call, at most.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs until the waypoint ends: batches records and sends each provider its own.
pub async fn run(wp: Arc<Waypoint>, mut rx: mpsc::Receiver<FinishedLog>) {
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
        let mut by_provider: BTreeMap<(String, u16), Vec<FinishedLog>> = BTreeMap::new();
        for l in batch {
            by_provider
                .entry((l.service.clone(), l.port))
                .or_default()
                .push(l);
        }
        for ((service, port), logs) in by_provider {
            let n = logs.len();
            if let Err(e) = export(&wp, &service, port, logs).await {
                tracing::warn!(records = n, service = %service, error = %e, "access log export failed; batch dropped");
            }
        }
    }
}

/// One export request: a resource per log name (Envoy's access logger sends its records
/// under no built-in labels, as istiod configures it).
pub fn export_request(logs: Vec<FinishedLog>) -> proto::logs_collector::ExportLogsServiceRequest {
    let mut by_name: BTreeMap<String, Vec<proto::logs::LogRecord>> = BTreeMap::new();
    for l in logs {
        by_name.entry(l.log_name).or_default().push(l.record);
    }
    proto::logs_collector::ExportLogsServiceRequest {
        resource_logs: by_name
            .into_iter()
            .map(|(name, records)| proto::logs::ResourceLogs {
                resource: Some(proto::resource::Resource::default()),
                scope_logs: vec![proto::logs::ScopeLogs {
                    scope: Some(InstrumentationScope {
                        name: name.clone(),
                        ..Default::default()
                    }),
                    log_records: records,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            })
            .collect(),
    }
}

async fn export(
    wp: &Waypoint,
    service: &str,
    port: u16,
    logs: Vec<FinishedLog>,
) -> Result<(), String> {
    let cfg = wp.config.load_full();
    let (ep, _) = service_endpoint(wp, &cfg, service, port)
        .await
        .map_err(|e| format!("access log {e}"))?;
    let message = export_request(logs);
    let call = unary(wp, &ep, service, LOGS_EXPORT_PATH, &message, None);
    match tokio::time::timeout(EXPORT_TIMEOUT, call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("collector {e}")),
        Err(_) => Err("timed out".into()),
    }
}
