//! The `envoyOtelAls` access-log provider: each request a log record, sent with OTLP/gRPC
//! (`/opentelemetry.proto.collector.logs.v1.LogsService/Export`) to the provider's
//! Service, as Istio configures Envoy's OpenTelemetry access logger: the body is the text
//! format (`logFormat.text`, else Istio's default text format), the attributes the
//! `logFormat.labels`, no built-in labels (istiod sets `disable_builtin_labels`). Records
//! wait in a bounded queue (dropped, counted, when it is full) and leave in batches
//! (`http/log_export.rs`): a request never waits on the collector.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use serde_json::Value;
use tokio::sync::mpsc;

use super::format::{Entry, Label, LogFormat, TextFormat};
use crate::trace::proto::common::{any_value, AnyValue, KeyValue};
use crate::trace::proto::logs::LogRecord;

/// Records waiting for export, at most.
const QUEUE: usize = 4096;

/// One `envoyOtelAls` provider.
#[derive(Clone, Debug, PartialEq)]
pub struct OtelLog {
    /// The collector's Service (`[namespace/]hostname`) and port.
    pub service: String,
    pub port: u16,
    pub log_name: String,
    body: TextFormat,
    attributes: BTreeMap<String, Label>,
}

/// A record on its way to its provider.
#[derive(Clone, Debug)]
pub struct FinishedLog {
    pub service: String,
    pub port: u16,
    pub log_name: String,
    pub record: LogRecord,
}

fn any(v: Value) -> Option<AnyValue> {
    let value = match v {
        Value::Null => return None,
        Value::String(s) => any_value::Value::StringValue(s),
        Value::Bool(b) => any_value::Value::BoolValue(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => any_value::Value::IntValue(i),
            None => any_value::Value::DoubleValue(n.as_f64().unwrap_or_default()),
        },
        other => any_value::Value::StringValue(other.to_string()),
    };
    Some(AnyValue { value: Some(value) })
}

impl OtelLog {
    /// From the provider's settings (`service`, `port`, `logName`, `logFormat`).
    pub fn parse(p: &Value) -> Result<OtelLog, String> {
        let service = p
            .get("service")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or("service: required")?
            .to_string();
        let port = p
            .get("port")
            .and_then(Value::as_u64)
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n != 0)
            .ok_or("port: a port number, 1 to 65535")?;
        let log_name = p
            .get("logName")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or("otel_envoy_accesslog")
            .to_string();
        let lf = p.get("logFormat");
        let body = match lf.and_then(|l| l.get("text")).and_then(Value::as_str) {
            Some(t) if !t.is_empty() => {
                TextFormat::parse(t).map_err(|e| format!("logFormat.text: {e}"))?
            }
            _ => TextFormat::parse(super::format::ISTIO_TEXT)
                .map_err(|e| format!("logFormat.text: {e}"))?,
        };
        let attributes = match lf.and_then(|l| l.get("labels")) {
            Some(Value::Object(o)) if !o.is_empty() => {
                match LogFormat::json(Some(&Value::Object(o.clone())))
                    .map_err(|e| format!("logFormat.labels: {e}"))?
                {
                    LogFormat::Json(l) => l,
                    LogFormat::Text(_) => BTreeMap::new(),
                }
            }
            _ => BTreeMap::new(),
        };
        Ok(OtelLog {
            service,
            port,
            log_name,
            body,
            attributes,
        })
    }

    /// The headers the body and labels read.
    pub fn headers(&self, req: &mut Vec<http::HeaderName>, resp: &mut Vec<http::HeaderName>) {
        LogFormat::Text(self.body.clone()).headers(req, resp);
        LogFormat::Json(self.attributes.clone()).headers(req, resp);
    }

    /// Whether a `%CEL%` of its body or labels reads every request header.
    pub fn all_headers(&self) -> bool {
        LogFormat::Text(self.body.clone()).all_headers()
            || LogFormat::Json(self.attributes.clone()).all_headers()
    }

    /// One request's record.
    pub fn record(&self, e: &Entry<'_>, trace: Option<(Vec<u8>, Vec<u8>)>) -> FinishedLog {
        let mut body = String::new();
        self.body.render(e, &mut body);
        let attributes = match super::format::render_labels(&self.attributes, e) {
            Value::Object(m) => m
                .into_iter()
                .filter_map(|(key, v)| {
                    Some(KeyValue {
                        key,
                        value: Some(any(v)?),
                        ..Default::default()
                    })
                })
                .collect(),
            _ => Vec::new(),
        };
        let time = e
            .start
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let (trace_id, span_id) = trace.unwrap_or_default();
        FinishedLog {
            service: self.service.clone(),
            port: self.port,
            log_name: self.log_name.clone(),
            record: LogRecord {
                time_unix_nano: time,
                observed_time_unix_nano: time,
                body: Some(AnyValue {
                    value: Some(any_value::Value::StringValue(body)),
                }),
                attributes,
                trace_id,
                span_id,
                ..Default::default()
            },
        }
    }
}

/// Records on their way to the collectors.
pub struct LogQueue {
    tx: mpsc::Sender<FinishedLog>,
    pub dropped: AtomicU64,
}

impl LogQueue {
    pub fn new() -> (LogQueue, mpsc::Receiver<FinishedLog>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (
            LogQueue {
                tx,
                dropped: AtomicU64::new(0),
            },
            rx,
        )
    }

    pub fn push(&self, log: FinishedLog) {
        if self.tx.try_send(log).is_err()
            && self
                .dropped
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(1000)
        {
            tracing::warn!(
                dropped = self.dropped.load(Ordering::Relaxed),
                "OpenTelemetry access log queue full; records dropped"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderName;
    use std::time::Duration;

    #[test]
    fn body_and_labels_as_istio_configures_them() {
        let p = serde_json::json!({"service": "observability/otel.observability.svc.cluster.local", "port": 4317,
            "logFormat": {"labels": {"code": "%RESPONSE_CODE%", "ua": "%REQ(USER-AGENT)%", "none": "%REQ(X-NONE)%"}}});
        let o = OtelLog::parse(&p).unwrap();
        assert_eq!(o.log_name, "otel_envoy_accesslog");
        let (mut rq, mut rs) = (Vec::new(), Vec::new());
        o.headers(&mut rq, &mut rs);
        assert!(rq.contains(&HeaderName::from_static("user-agent")));
        let req = [(HeaderName::from_static("user-agent"), "curl/8".to_string())];
        let e = Entry {
            start: UNIX_EPOCH + Duration::from_secs(1_796_677_710),
            duration: Duration::from_millis(3),
            method: "GET",
            path: "/x",
            authority: "echo",
            protocol: "HTTP/1.1",
            code: 503,
            response_flags: "UF",
            code_details: None,
            bytes_received: 0,
            bytes_sent: 0,
            request_headers: &req,
            response_headers: &[],
            upstream: None,
            upstream_cluster: None,
            downstream_local: "10.96.0.10:80".parse().unwrap(),
            downstream_remote: "10.0.0.1:4000".parse().unwrap(),
            peer_uri_san: None,
            route: None,
            hostname: "h",
            trace_id: None,
            grpc_status: None,
            attempts: 1,
        };
        let r = o.record(&e, None).record;
        let body = match r.body.and_then(|b| b.value) {
            Some(any_value::Value::StringValue(s)) => s,
            other => panic!("{other:?}"),
        };
        assert!(
            body.starts_with("[2026-12-07T21:08:30.000Z] \"GET /x HTTP/1.1\" 503 UF "),
            "{body}"
        );
        let attrs: Vec<(String, Option<any_value::Value>)> = r
            .attributes
            .into_iter()
            .map(|kv| (kv.key, kv.value.and_then(|v| v.value)))
            .collect();
        assert_eq!(
            attrs,
            [
                ("code".to_string(), Some(any_value::Value::IntValue(503))),
                (
                    "ua".to_string(),
                    Some(any_value::Value::StringValue("curl/8".into()))
                ),
            ],
            "a label without a value is left out"
        );
        assert_eq!(r.time_unix_nano, 1_796_677_710_000_000_000);
    }

    #[test]
    fn bad_providers_are_refused_by_field() {
        for (p, want) in [
            (serde_json::json!({"port": 4317}), "service: required"),
            (serde_json::json!({"service": "c", "port": 70000}), "port:"),
            (
                serde_json::json!({"service": "c", "port": 1, "logFormat": {"text": "%NOPE%"}}),
                "logFormat.text: %NOPE%",
            ),
            (
                serde_json::json!({"service": "c", "port": 1, "logFormat": {"labels": {"a": "%NOPE%"}}}),
                "logFormat.labels: a: %NOPE%",
            ),
        ] {
            let e = OtelLog::parse(&p).unwrap_err();
            assert!(e.contains(want), "{p}: {e}");
        }
    }
}
