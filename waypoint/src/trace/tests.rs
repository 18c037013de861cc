use http::{HeaderMap, HeaderValue};
use serde_json::json;

use super::*;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_str(v).expect("value"));
    }
    h
}

#[test]
fn settings_come_from_default_providers_and_default_config() {
    let mesh = json!({"defaultProviders": {"tracing": ["otel"]}, "defaultConfig": {"tracing": {"sampling": 25.0}},
        "extensionProviders": [{"name": "otel", "opentelemetry": {"service": "collector.observability.svc.cluster.local", "port": 4317}}]});
    let s = settings(&mesh).expect("valid").expect("tracing");
    assert_eq!(
        (s.service.as_str(), s.port, s.sampling),
        ("collector.observability.svc.cluster.local", 4317, 25.0)
    );
    assert_eq!(
        settings(&json!({})),
        Ok(None),
        "no default tracing provider: no tracing"
    );
    let bad = json!({"defaultProviders": {"tracing": ["z"]}, "extensionProviders": [{"name": "z", "zipkin": {"service": "z", "port": 9411}}]});
    assert!(settings(&bad)
        .expect_err("zipkin")
        .contains("not an opentelemetry provider"));
    assert!(settings(&json!({"defaultProviders": {"tracing": ["x"]}}))
        .expect_err("missing")
        .contains("not among extensionProviders"));
}

#[test]
fn incoming_decisions_are_kept_and_children_propagated() {
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let ctx = start(
        &headers(&[("traceparent", parent), ("tracestate", "a=b")]),
        0.0,
        0.99,
    )
    .expect("sampled by the client");
    assert_eq!(ctx.trace_id_hex(), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(
        ctx.parent,
        Some([0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31])
    );
    let mut out = HeaderMap::new();
    ctx.propagate(&mut out);
    let tp = out
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .expect("traceparent");
    assert!(
        tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-")
            && tp.ends_with("-01")
            && !tp.contains("b7ad6b7169203331"),
        "{tp}"
    );
    // Not sampled by the client: no span, whatever the percentage.
    assert!(start(
        &headers(&[(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        )]),
        100.0,
        0.0
    )
    .is_none());
    // B3, 64-bit trace id: padded, and B3 headers rewritten for the child.
    let ctx = start(
        &headers(&[
            ("x-b3-traceid", "463ac35c9f6413ad"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
            ("x-b3-sampled", "1"),
        ]),
        0.0,
        0.5,
    )
    .expect("b3");
    assert_eq!(ctx.trace_id_hex(), "0000000000000000463ac35c9f6413ad");
    let mut out = HeaderMap::new();
    ctx.propagate(&mut out);
    assert_eq!(
        out.get("x-b3-parentspanid").and_then(|v| v.to_str().ok()),
        Some("a2fb4a1d1a96d312")
    );
    // No context: the sampling percentage decides; a broken header starts a new trace.
    assert!(start(&HeaderMap::new(), 1.0, 0.5).is_none());
    assert!(start(&HeaderMap::new(), 100.0, 0.5).is_some_and(|c| c.parent.is_none()));
    assert!(start(&headers(&[("traceparent", "garbage")]), 100.0, 0.5)
        .is_some_and(|c| c.parent.is_none()));
}

#[test]
fn spans_export_as_otlp() {
    let ctx = start(&HeaderMap::new(), 100.0, 0.0).expect("span");
    let req = export_request(
        "waypoint.default",
        vec![FinishedSpan {
            ctx: ctx.clone(),
            name: "echo:80/*".into(),
            end: std::time::SystemTime::now(),
            attributes: vec![("http.status_code".into(), "503".into())],
            error: true,
        }],
    );
    let span = &req.resource_spans[0].scope_spans[0].spans[0];
    assert_eq!(
        (span.trace_id.as_slice(), span.name.as_str()),
        (&ctx.trace_id[..], "echo:80/*")
    );
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    assert_eq!(
        span.status.as_ref().map(|s| s.code),
        Some(proto::trace::status::StatusCode::Error as i32)
    );
}
