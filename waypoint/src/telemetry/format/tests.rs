use super::*;
use std::time::{Duration, UNIX_EPOCH};

fn entry<'a>(req: &'a [(HeaderName, String)], resp: &'a [(HeaderName, String)]) -> Entry<'a> {
    Entry {
        start: UNIX_EPOCH + Duration::new(1_796_677_710, 123_456_789),
        duration: Duration::from_millis(12),
        method: "GET",
        path: "/api/items?x=1",
        authority: "echo.default.svc.cluster.local",
        protocol: "HTTP/1.1",
        code: 200,
        response_flags: "-",
        code_details: Some("via_upstream"),
        bytes_received: 0,
        bytes_sent: 42,
        request_headers: req,
        response_headers: resp,
        upstream: Some("10.0.1.5:8080".parse().unwrap()),
        upstream_cluster: Some("inbound-vip|80|http|echo.default.svc.cluster.local"),
        downstream_local: "10.96.0.10:80".parse().unwrap(),
        downstream_remote: "10.0.0.1:40000".parse().unwrap(),
        peer_uri_san: Some("spiffe://cluster.local/ns/default/sa/sleep"),
        route: None,
        hostname: "waypoint-abc",
        trace_id: None,
        grpc_status: None,
        attempts: 1,
    }
}

fn req() -> Vec<(HeaderName, String)> {
    vec![
        (HeaderName::from_static("user-agent"), "curl/8.5".into()),
        (HeaderName::from_static("x-request-id"), "rid-1".into()),
    ]
}

#[test]
fn istios_default_text_line() {
    let f = LogFormat::istio_text();
    let (mut rq, mut rs) = (Vec::new(), Vec::new());
    f.headers(&mut rq, &mut rs);
    let names: Vec<&str> = rq.iter().map(HeaderName::as_str).collect();
    assert_eq!(
        names,
        [
            "x-envoy-original-path",
            "x-forwarded-for",
            "user-agent",
            "x-request-id"
        ]
    );
    assert_eq!(
        rs,
        [HeaderName::from_static("x-envoy-upstream-service-time")]
    );
    let line = f.render(&entry(&req(), &[]));
    assert_eq!(
        line,
        "[2026-12-07T21:08:30.123Z] \"GET /api/items?x=1 HTTP/1.1\" 200 - via_upstream - \"-\" 0 42 12 - \"-\" \"curl/8.5\" \"rid-1\" \
\"echo.default.svc.cluster.local\" \"10.0.1.5:8080\" inbound-vip|80|http|echo.default.svc.cluster.local - 10.96.0.10:80 \
10.0.0.1:40000 - -\n"
    );
}

#[test]
fn operators_arguments_and_lengths() {
    let f = LogFormat::text(
        "%START_TIME(%s)% %REQ(X-MISSING?User-Agent):4% %REQ_WITHOUT_QUERY(:PATH)% %DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% \
%DOWNSTREAM_LOCAL_PORT% %UPSTREAM_REMOTE_PORT% %DOWNSTREAM_PEER_URI_SAN% %UPSTREAM_REQUEST_ATTEMPT_COUNT% %HOSTNAME%",
    )
    .unwrap();
    assert_eq!(
        f.render(&entry(&req(), &[])),
        "1796677710 curl /api/items 10.0.0.1 80 8080 spiffe://cluster.local/ns/default/sa/sleep 1 waypoint-abc\n"
    );
}

#[test]
fn json_labels_keep_types_and_nulls() {
    let labels = serde_json::json!({
        "code": "%RESPONSE_CODE%",
        "ua": "%REQ(USER-AGENT)%",
        "missing": "%REQ(X-NONE)%",
        "mixed": "%REQ(:METHOD)% %REQ(X-NONE)%",
        "fixed": 7,
        "nested": {"bytes": "%BYTES_SENT%"}
    });
    let f = LogFormat::json(Some(&labels)).unwrap();
    let line = f.render(&entry(&req(), &[]));
    assert!(line.ends_with('\n'));
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"code": 200, "ua": "curl/8.5", "missing": null, "mixed": "GET -", "fixed": 7,
            "nested": {"bytes": 42}})
    );
    // Istio's default labels, for `accessLogEncoding: JSON` without a format.
    let d = LogFormat::json_text("").unwrap();
    let v: Value = serde_json::from_str(&d.render(&entry(&req(), &[]))).unwrap();
    assert_eq!(v["response_code"], 200);
    assert_eq!(v["start_time"], "2026-12-07T21:08:30.123Z");
    assert_eq!(
        v["upstream_cluster"],
        "inbound-vip|80|http|echo.default.svc.cluster.local"
    );
    assert_eq!(v["x_forwarded_for"], Value::Null);
    assert_eq!(v.as_object().unwrap().len(), ISTIO_JSON.len());
}

#[test]
fn bad_formats_are_refused_with_the_place() {
    for (f, want) in [
        ("%NOPE%", "%NOPE% is not supported"),
        (
            "%CEL(xds.node)%",
            "CEL: the attribute xds.node is not supported",
        ),
        ("%CEL%", "CEL takes an expression"),
        ("100% sure", "at byte 3: a '%' that does not start"),
        ("%REQ(:PATH%", "no closing ')'"),
        ("%REQ%", "take a header name"),
        ("%PROTOCOL(x)%", "takes no argument"),
        ("%RESPONSE_CODE", "no closing '%'"),
        ("%REQ(bad header)%", "is not a header name"),
        ("%START_TIME(%Q)%", "%Q is not supported"),
    ] {
        let e = LogFormat::text(f).expect_err(f).to_string();
        assert!(e.contains(want), "{f}: {e}");
    }
    let e = LogFormat::json(Some(&serde_json::json!({"a": {"b": "%NOPE%"}})))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("a: b: %NOPE%"), "{e}");
    assert!(LogFormat::json_text("[1]").is_err());
}

#[test]
fn hostile_formats_are_bounded() {
    let huge = "%PROTOCOL%".repeat(MAX_LEN);
    assert!(matches!(
        LogFormat::text(&huge),
        Err(FormatError::TooLong(_))
    ));
    let mut deep = serde_json::json!("%PROTOCOL%");
    for _ in 0..20 {
        deep = serde_json::json!({ "a": deep });
    }
    assert!(LogFormat::json(Some(&deep)).is_err());
    let many: serde_json::Map<String, Value> = (0..1000)
        .map(|i| (format!("k{i}"), Value::from("%PROTOCOL%")))
        .collect();
    assert!(LogFormat::json(Some(&Value::Object(many))).is_err());
    // Odd input never panics.
    for f in [
        "%",
        "%%",
        "%(",
        "%A(",
        "%A:",
        "%A:x%",
        "%A:99999999999999999999999%",
        "é%é",
        "%REQ(?)%",
    ] {
        let _ = LogFormat::text(f);
    }
}

#[test]
fn cel_operator_renders_the_expressions_value() {
    let f = LogFormat::text(
        "%CEL(response.code / 100)% %CEL(request.headers['user-agent'] == 'curl/8.5')% %CEL(request.url_path)% \
%CEL(request.headers['x-none'])% %CEL(request.query):3%",
    )
    .unwrap();
    let (mut rq, mut rs) = (Vec::new(), Vec::new());
    f.headers(&mut rq, &mut rs);
    assert!(rq.contains(&HeaderName::from_static("user-agent")) && !f.all_headers());
    assert_eq!(f.render(&entry(&req(), &[])), "2 true /api/items - x=1\n");
    let j = LogFormat::json(Some(&serde_json::json!({"c": "%CEL(response.code)%"}))).unwrap();
    let v: Value = serde_json::from_str(&j.render(&entry(&req(), &[]))).unwrap();
    assert_eq!(v["c"], "200", "ours: CEL's value as text");
    assert!(LogFormat::text("%CEL('a' in request.headers)%")
        .unwrap()
        .all_headers());
}
