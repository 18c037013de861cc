//! Request tracing as Istio's waypoint does it: W3C `traceparent` / `tracestate` and B3
//! (`x-b3-*`) propagated, a span per request (kind SERVER, named `<host>:<port>/*` as Envoy names them)
//! exported with OTLP over gRPC to the mesh config's tracing provider
//! (`extensionProviders[].opentelemetry`, chosen by `defaultProviders.tracing`), sampled
//! at `defaultConfig.tracing.sampling` percent (Istio's default 1%) unless the request
//! arrives with a sampling decision, which is kept. Export is best effort: spans queue in
//! a bounded buffer (see `http::trace_export`) and are dropped, counted, when it is full.

pub mod proto;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use tokio::sync::mpsc;

use http::header::{HeaderMap, HeaderValue};
use serde::Deserialize;
use serde_json::Value;

/// Istio's default sampling, percent.
pub const DEFAULT_SAMPLING: f64 = 1.0;

/// Where spans go and how many requests get one.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSettings {
    /// The provider's name, `[<namespace>/]<hostname>` and port.
    pub provider: String,
    pub service: String,
    pub port: u16,
    /// Percent of requests without a sampling decision that are traced.
    pub sampling: f64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawMesh {
    #[serde(default)]
    default_providers: RawDefaultProviders,
    #[serde(default)]
    default_config: RawDefaultConfig,
    #[serde(default)]
    extension_providers: Vec<Value>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawDefaultProviders {
    #[serde(default)]
    tracing: Vec<String>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawDefaultConfig {
    #[serde(default)]
    tracing: Option<RawTracing>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawTracing {
    #[serde(default)]
    sampling: Option<f64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawOtel {
    service: String,
    port: u64,
}

/// The tracing a mesh config asks for (None: no tracing provider), or what is wrong.
pub fn settings(mesh: &Value) -> Result<Option<TraceSettings>, String> {
    let raw: RawMesh = serde_json::from_value(mesh.clone()).map_err(|e| e.to_string())?;
    let Some(name) = raw.default_providers.tracing.first() else {
        return Ok(None);
    };
    let entry = raw
        .extension_providers
        .iter()
        .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
        .ok_or_else(|| {
            format!("defaultProviders.tracing: {name:?} is not among extensionProviders")
        })?;
    let Some(otel) = entry.get("opentelemetry") else {
        return Err(format!("defaultProviders.tracing: {name:?} is not an opentelemetry provider (the one kind this waypoint exports to)"));
    };
    let o: RawOtel = serde_json::from_value(otel.clone())
        .map_err(|e| format!("extensionProviders {name:?}.opentelemetry: {e}"))?;
    let port = u16::try_from(o.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("extensionProviders {name:?}.opentelemetry.port: 1-65535"))?;
    let sampling = raw
        .default_config
        .tracing
        .and_then(|t| t.sampling)
        .unwrap_or(DEFAULT_SAMPLING);
    if !(0.0..=100.0).contains(&sampling) {
        return Err("defaultConfig.tracing.sampling: a percentage, 0 to 100".into());
    }
    Ok(Some(TraceSettings {
        provider: name.clone(),
        service: o.service,
        port,
        sampling,
    }))
}

/// This request's span: its trace, its own id and its parent's (the client's span).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    pub trace_state: String,
    /// Whether the request arrived with B3 headers (they are then rewritten too).
    b3: bool,
    pub start: SystemTime,
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    (out != [0u8; N]).then_some(out)
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A request's incoming trace context: trace id, parent span id, the sampling decision
/// if any, and whether it came as B3.
type Incoming = ([u8; 16], [u8; 8], Option<bool>, bool);

/// The incoming trace context from `traceparent`, else B3. An invalid header is ignored
/// (a new trace starts), as Envoy does.
fn incoming(headers: &HeaderMap) -> Option<Incoming> {
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        let parts: Vec<&str> = tp.trim().split('-').collect();
        if let [version, trace, span, flags] = parts.as_slice() {
            if *version != "ff" && version.len() == 2 {
                if let (Some(t), Some(s), Some(f)) = (
                    hex::<16>(trace),
                    hex::<8>(span),
                    hex::<1>(flags).or(Some([0])),
                ) {
                    return Some((t, s, Some(f[0] & 1 == 1), false));
                }
            }
        }
    }
    let b3 = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let trace = b3("x-b3-traceid")?;
    // 64-bit B3 trace ids are left-padded to 128.
    let trace = if trace.len() == 16 {
        format!("{:0>32}", trace)
    } else {
        trace.to_string()
    };
    let t = hex::<16>(&trace)?;
    let s = hex::<8>(b3("x-b3-spanid")?)?;
    let sampled = b3("x-b3-sampled").map(|v| v == "1" || v == "true");
    Some((t, s, sampled, true))
}

/// The span for a request with these headers, when it is traced: its decision if it
/// came with one, else `sampling` percent (`roll` in [0, 1)).
pub fn start(headers: &HeaderMap, sampling: f64, roll: f64) -> Option<SpanContext> {
    let span_id: [u8; 8] = rand::random();
    let trace_state = headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    match incoming(headers) {
        Some((trace_id, parent, decision, b3)) => {
            let sampled = decision.unwrap_or(roll * 100.0 < sampling);
            sampled.then_some(SpanContext {
                trace_id,
                span_id,
                parent: Some(parent),
                trace_state,
                b3,
                start: SystemTime::now(),
            })
        }
        None => (roll * 100.0 < sampling).then(|| SpanContext {
            trace_id: rand::random(),
            span_id,
            parent: None,
            trace_state,
            b3: false,
            start: SystemTime::now(),
        }),
    }
}

impl SpanContext {
    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The request goes on as a child of this span: `traceparent` (and B3 when the
    /// client used it) name it; `tracestate` passes as is.
    pub fn propagate(&self, headers: &mut HeaderMap) {
        let tp = format!("00-{}-{}-01", to_hex(&self.trace_id), to_hex(&self.span_id));
        if let Ok(v) = HeaderValue::from_str(&tp) {
            headers.insert("traceparent", v);
        }
        if self.b3 {
            let set = |h: &mut HeaderMap, k: &'static str, v: String| {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    h.insert(k, v);
                }
            };
            set(headers, "x-b3-traceid", to_hex(&self.trace_id));
            set(headers, "x-b3-spanid", to_hex(&self.span_id));
            if let Some(p) = self.parent {
                set(headers, "x-b3-parentspanid", to_hex(&p));
            }
            set(headers, "x-b3-sampled", "1".into());
        }
    }
}

/// One finished request, as its span will be exported.
#[derive(Clone, Debug)]
pub struct FinishedSpan {
    pub ctx: SpanContext,
    pub name: String,
    pub end: SystemTime,
    /// Envoy's attributes, then the Telemetry's custom tags.
    pub attributes: Vec<(std::borrow::Cow<'static, str>, String)>,
    /// 5xx (or no response): the span's status is an error.
    pub error: bool,
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The OTLP request for a batch of spans of one waypoint (`service_name`).
pub fn export_request(
    service_name: &str,
    spans: Vec<FinishedSpan>,
) -> proto::collector::ExportTraceServiceRequest {
    use proto::common::{any_value, AnyValue, InstrumentationScope, KeyValue};
    let kv = |k: &str, v: String| KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v)),
        }),
        ..Default::default()
    };
    let spans = spans
        .into_iter()
        .map(|s| proto::trace::Span {
            trace_id: s.ctx.trace_id.to_vec(),
            span_id: s.ctx.span_id.to_vec(),
            trace_state: s.ctx.trace_state.clone(),
            parent_span_id: s.ctx.parent.map(|p| p.to_vec()).unwrap_or_default(),
            name: s.name,
            kind: proto::trace::span::SpanKind::Server as i32,
            start_time_unix_nano: nanos(s.ctx.start),
            end_time_unix_nano: nanos(s.end),
            attributes: s.attributes.into_iter().map(|(k, v)| kv(&k, v)).collect(),
            dropped_attributes_count: 0,
            status: s.error.then(|| proto::trace::Status {
                message: String::new(),
                code: proto::trace::status::StatusCode::Error as i32,
            }),
            ..Default::default()
        })
        .collect();
    proto::collector::ExportTraceServiceRequest {
        resource_spans: vec![proto::trace::ResourceSpans {
            resource: Some(proto::resource::Resource {
                attributes: vec![kv("service.name", service_name.to_string())],
                ..Default::default()
            }),
            scope_spans: vec![proto::trace::ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "waypoint".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

/// Spans waiting for export, at most.
pub const QUEUE: usize = 4096;

/// Finished spans on their way to the exporter (`http::trace_export`): a bounded queue
/// that never waits; a full one drops the span (counted, logged once per 1000).
pub struct SpanQueue {
    tx: mpsc::Sender<FinishedSpan>,
    pub dropped: AtomicU64,
}

impl SpanQueue {
    pub fn new() -> (SpanQueue, mpsc::Receiver<FinishedSpan>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (
            SpanQueue {
                tx,
                dropped: AtomicU64::new(0),
            },
            rx,
        )
    }

    pub fn push(&self, span: FinishedSpan) {
        if self.tx.try_send(span).is_err()
            && self
                .dropped
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(1000)
        {
            tracing::warn!(
                dropped = self.dropped.load(Ordering::Relaxed),
                "span export queue full; spans dropped"
            );
        }
    }
}
