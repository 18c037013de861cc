use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use prost::Message;
use serde_json::json;
use ztunnel::identity::Identity;
use ztunnel::xds::proto::google::rpc::Status;

use super::check::{
    check_message, decision, grpc_frame, grpc_unframe, CheckRequest, Decision, HeaderMode,
};
use super::proto::envoy::config::core::v3 as core;
use super::proto::envoy::r#type::v3::{HttpStatus, StatusCode as EnvoyStatus};
use super::proto::envoy::service::auth::v3 as auth;
use super::provider::{parse_all, parse_duration, Checked, HeaderMatch, Provider};
use super::{decide, decide_tcp, Custom};
use crate::authz::{self, AuthorizationPolicy};

fn providers(v: serde_json::Value) -> BTreeMap<String, Checked> {
    parse_all(v.as_array().expect("list")).expect("providers")
}

fn http_provider() -> serde_json::Value {
    json!([{"name": "http-authz", "envoyExtAuthzHttp": {
        "service": "default/authz.default.svc.cluster.local", "port": "8000", "timeout": "0.5s",
        "pathPrefix": "/check", "statusOnError": "503",
        "includeRequestHeadersInCheck": ["x-ext-authz", "x-pre-*", "*-suf"],
        "includeAdditionalHeadersInCheck": {"x-added": "1"},
        "headersToUpstreamOnAllow": ["x-user"], "headersToDownstreamOnDeny": ["x-reason"]}},
        {"name": "grpc-authz", "envoyExtAuthzGrpc": {"service": "authz.default.svc.cluster.local", "port": 9000, "failOpen": true}},
        {"name": "zipkin", "zipkin": {"service": "zipkin.istio-system.svc.cluster.local", "port": 9411}}])
}

#[test]
fn providers_parse_with_istio_defaults() {
    let all = providers(http_provider());
    let Ok(Provider::Http(h)) = &all["http-authz"] else {
        panic!("{all:?}")
    };
    assert_eq!(
        (
            h.common.port,
            h.common.timeout,
            h.common.status_on_error,
            h.common.fail_open
        ),
        (8000, Duration::from_millis(500), 503, false)
    );
    assert_eq!(h.path_prefix, "/check");
    assert_eq!(
        h.include_request_headers,
        vec![
            HeaderMatch::Exact("x-ext-authz".into()),
            HeaderMatch::Prefix("x-pre-".into()),
            HeaderMatch::Suffix("-suf".into())
        ]
    );
    let Ok(Provider::Grpc(g)) = &all["grpc-authz"] else {
        panic!("{all:?}")
    };
    // Istio's defaults: 600 s, 403, fail closed unless failOpen.
    assert_eq!(
        (
            g.common.timeout,
            g.common.status_on_error,
            g.common.fail_open
        ),
        (Duration::from_secs(600), 403, true)
    );
    assert_eq!(all["zipkin"], Ok(Provider::NotAuthz("zipkin".into())));
}

#[test]
fn bad_providers_name_the_field() {
    let one = |body: serde_json::Value| {
        let all = parse_all(&[json!({"name": "p", "envoyExtAuthzHttp": body})]).expect("list");
        all["p"]
            .clone()
            .expect_err("invalid")
            .trim_start_matches("extensionProviders[0].")
            .to_string()
    };
    let svc = |extra: serde_json::Value| {
        let mut m = json!({"service": "a.b.svc.cluster.local", "port": 80});
        m.as_object_mut()
            .expect("map")
            .extend(extra.as_object().expect("map").clone());
        m
    };
    assert!(one(json!({"service": "a", "port": 0}))
        .starts_with("envoyExtAuthzHttp.port: must be in the range"));
    assert!(one(json!({"port": 80})).contains("missing field `service`"));
    assert!(one(svc(json!({"statusOnError": "999"})))
        .starts_with("envoyExtAuthzHttp.statusOnError: unsupported"));
    assert!(one(svc(json!({"timeout": "soon"}))).starts_with("envoyExtAuthzHttp.timeout:"));
    assert!(one(svc(json!({"pathPrefix": "check"})))
        .starts_with("envoyExtAuthzHttp.pathPrefix: must be a path beginning with `/`"));
    assert!(one(svc(json!({"headersToUpstreamOnAllow": ["*"]})))
        .contains("headersToUpstreamOnAllow: a single wildcard"));
    assert!(one(svc(json!({"includeRequestBodyInCheck": {}})))
        .contains("includeRequestBodyInCheck.maxRequestBytes: must be 1 to"));
    assert!(one(svc(
        json!({"includeRequestBodyInCheck": {"maxRequestBytes": 100_000_000}})
    ))
    .contains("includeRequestBodyInCheck.maxRequestBytes"));
    assert!(one(svc(json!({"includeRequestBodyInCheck": {"maxRequestBytes": 10, "packAsBytes": true, "nope": 1}}))).contains("unknown field `nope`"));
    assert!(
        one(svc(json!({"headersToUpstream": ["x"]}))).contains("unknown field `headersToUpstream`")
    );
    let list_err =
        |v: serde_json::Value| parse_all(v.as_array().expect("list")).expect_err("invalid list");
    assert!(list_err(json!([{"name": "Bad_Name", "zipkin": {}}]))
        .starts_with("extensionProviders[0].name \"Bad_Name\""));
    assert!(
        list_err(json!([{"name": "a", "zipkin": {}}, {"name": "a", "zipkin": {}}]))
            .starts_with("extensionProviders[1].name: \"a\" is used twice")
    );
    let two = providers(json!([{"name": "a", "zipkin": {}, "opentelemetry": {}}]));
    assert!(two["a"]
        .clone()
        .expect_err("two kinds")
        .contains("exactly one provider kind"));
}

#[test]
fn durations_as_mesh_config_writes_them() {
    assert_eq!(parse_duration("0.5s"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    for bad in ["", "s", "-1s", "1", "1.2.3s", "0s"] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
}

fn policy(yaml: &str) -> AuthorizationPolicy {
    let head = "name: c\nnamespace: default\ntargetRefs: [{kind: Service, group: \"\", name: echo}]\naction: CUSTOM\n";
    let p: AuthorizationPolicy = serde_yaml::from_str(&format!("{head}{yaml}")).expect("policy");
    p.validate().expect("valid");
    p
}

fn with_request<T>(path: &str, f: impl FnOnce(&authz::Request) -> T) -> T {
    let id = Identity::new("cluster.local", "default", "sleep");
    let headers = HeaderMap::new();
    let req = authz::Request {
        source_principal: Some(&id),
        source_ip: "10.0.0.1".parse().expect("ip"),
        destination_port: 80,
        host: "echo",
        method: "GET",
        path,
        headers: &headers,
        auth: None,
    };
    f(&req)
}

#[test]
fn custom_policies_pick_their_provider_or_deny() {
    let all = providers(http_provider());
    let admin = policy(
        "provider: {name: http-authz}\nrules: [{to: [{operation: {paths: [\"/admin*\"]}}]}]\n",
    );
    // Only what the rules match is checked.
    let d = with_request("/admin/x", |r| decide(&all, &[&admin], r));
    assert!(
        matches!(d, Custom::Check { provider: Provider::Http(_), ref policy } if policy == "default/c"),
        "{d:?}"
    );
    assert_eq!(
        with_request("/public", |r| decide(&all, &[&admin], r)),
        Custom::Skip
    );
    // No rules: never matches (Istio's "match never" for a CUSTOM policy without rules).
    assert_eq!(
        with_request("/admin", |r| decide(
            &all,
            &[&policy("provider: {name: http-authz}\n")],
            r
        )),
        Custom::Skip
    );
    // A provider that is missing or not an authorizer: deny what the policy matches.
    for name in ["missing", "zipkin"] {
        let p = policy(&format!("provider: {{name: {name}}}\nrules: [{{}}]\n"));
        assert!(
            matches!(
                with_request("/", |r| decide(&all, &[&p], r)),
                Custom::Deny { .. }
            ),
            "{name}"
        );
    }
    // Two providers on one target: Istio (without its feature flag) denies.
    let other = policy(
        "provider: {name: grpc-authz}\nrules: [{to: [{operation: {paths: [\"/other\"]}}]}]\n",
    );
    let d = with_request("/admin", |r| decide(&all, &[&admin, &other], r));
    assert!(
        matches!(d, Custom::Deny { ref reason, .. } if reason.contains("grpc-authz, http-authz")),
        "{d:?}"
    );
    // CUSTOM does not take part in ALLOW/DENY evaluation.
    assert!(with_request("/admin", |r| authz::evaluate([&admin], r)).allowed);
}

/// Opaque TCP cannot be checked by an HTTP authorizer: a CUSTOM policy with one that
/// would check the connection denies it, naming itself and why (fail closed; a client
/// must not skip the authorizer by making its request look opaque). A gRPC authorizer
/// checks it (Envoy's network ext_authz).
#[test]
fn custom_policies_deny_opaque_tcp_an_http_authorizer_would_check() {
    let all = providers(http_provider());
    let tcp = |yaml: &str| policy(yaml).for_tcp();
    let denied = |p: AuthorizationPolicy| match with_request("", |r| decide_tcp(&all, &[p], r)) {
        Custom::Deny { policy, reason } => format!("{policy}: {reason}"),
        other => panic!("{other:?}"),
    };
    let name = "http-authz";
    let why = denied(tcp(&format!("provider: {{name: {name}}}\nrules: [{{}}]\n")));
    assert!(
        why.starts_with("default/c: ")
            && why.contains(name)
            && why.contains("cannot check opaque TCP"),
        "{why}"
    );
    // A rule on HTTP attributes has no such attributes to miss on TCP: it applies.
    let why = denied(tcp(&format!("provider: {{name: {name}}}\nrules: [{{to: [{{operation: {{paths: [\"/private*\"]}}}}]}}]\n")));
    assert!(why.contains("cannot check opaque TCP"), "{why}");
    // A gRPC authorizer is asked.
    assert!(matches!(
        with_request("", |r| decide_tcp(
            &all,
            &[tcp("provider: {name: grpc-authz}\nrules: [{}]\n")],
            r
        )),
        Custom::Check {
            provider: super::Provider::Grpc(_),
            ..
        }
    ));
    // A provider that is missing still says so.
    assert!(denied(tcp("provider: {name: missing}\nrules: [{}]\n"))
        .contains("not among meshConfig extensionProviders"));
    // What the policy would not check on HTTP either (another peer, another port) passes.
    let other_peer = tcp("provider: {name: http-authz}\nrules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/other\"]}}]}]\n");
    assert_eq!(
        with_request("", |r| decide_tcp(&all, &[other_peer], r)),
        Custom::Skip
    );
    let other_port =
        tcp("provider: {name: http-authz}\nrules: [{to: [{operation: {ports: [\"9000\"]}}]}]\n");
    assert_eq!(
        with_request("", |r| decide_tcp(&all, &[other_port], r)),
        Custom::Skip
    );
}

#[test]
fn custom_needs_a_provider_and_only_custom_has_one() {
    let p = |yaml: &str| {
        serde_yaml::from_str::<AuthorizationPolicy>(yaml)
            .expect("parses")
            .validate()
    };
    let head =
        "name: c\nnamespace: default\ntargetRefs: [{kind: Service, group: \"\", name: echo}]\n";
    assert!(p(&format!("{head}action: CUSTOM\n"))
        .expect_err("no provider")
        .starts_with("provider: required with action CUSTOM"));
    assert!(p(&format!("{head}action: DENY\nprovider: {{name: x}}\n"))
        .expect_err("provider on DENY")
        .starts_with("provider: only with action CUSTOM"));
}

#[test]
fn check_responses_read_as_envoy_reads_them() {
    let hv = |k: &str, v: &str, append: Option<bool>| core::HeaderValueOption {
        header: Some(core::HeaderValue {
            key: k.into(),
            value: v.into(),
            ..Default::default()
        }),
        append,
        ..Default::default()
    };
    let ok = auth::CheckResponse {
        status: Some(Status {
            code: 0,
            ..Default::default()
        }),
        http_response: Some(auth::check_response::HttpResponse::OkResponse(
            auth::OkHttpResponse {
                headers: vec![hv("x-user", "alice", None), hv("x-tag", "b", Some(true))],
                headers_to_remove: vec!["authorization".into()],
                response_headers_to_add: vec![hv("x-checked", "yes", None)],
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let Decision::Allow(a) = decision(ok) else {
        panic!("allowed")
    };
    assert_eq!(
        a.upstream
            .iter()
            .map(|(n, v, m)| (n.as_str(), v.to_str().unwrap_or_default(), *m))
            .collect::<Vec<_>>(),
        [
            ("x-user", "alice", HeaderMode::Overwrite),
            ("x-tag", "b", HeaderMode::Append)
        ]
    );
    assert_eq!(a.remove[0].as_str(), "authorization");
    assert_eq!(a.downstream[0].0.as_str(), "x-checked");

    let denied = auth::CheckResponse {
        status: Some(Status {
            code: 7,
            ..Default::default()
        }),
        http_response: Some(auth::check_response::HttpResponse::DeniedResponse(
            auth::DeniedHttpResponse {
                status: Some(HttpStatus {
                    code: EnvoyStatus::TooManyRequests as i32,
                }),
                headers: vec![hv("x-reason", "quota", None)],
                body: "slow down".into(),
            },
        )),
        ..Default::default()
    };
    let Decision::Deny(d) = decision(denied) else {
        panic!("denied")
    };
    assert_eq!(
        (
            d.status,
            d.body.as_ref(),
            d.headers.get("x-reason").map(|v| v.as_bytes())
        ),
        (
            StatusCode::TOO_MANY_REQUESTS,
            &b"slow down"[..],
            Some(&b"quota"[..])
        )
    );
    // No denied_response: 403, or 401 for UNAUTHENTICATED.
    for (code, want) in [(7, 403), (16, 401)] {
        let r = auth::CheckResponse {
            status: Some(Status {
                code,
                ..Default::default()
            }),
            ..Default::default()
        };
        let Decision::Deny(d) = decision(r) else {
            panic!("denied")
        };
        assert_eq!(d.status.as_u16(), want);
    }
    let mut h = HeaderMap::new();
    h.insert("x-a", HeaderValue::from_static("1"));
    HeaderMode::AddIfAbsent.apply(
        &mut h,
        "x-a".parse().expect("name"),
        HeaderValue::from_static("2"),
    );
    HeaderMode::OverwriteIfExists.apply(
        &mut h,
        "x-b".parse().expect("name"),
        HeaderValue::from_static("3"),
    );
    assert_eq!(
        (h.get("x-a").map(|v| v.as_bytes()), h.get("x-b")),
        (Some(&b"1"[..]), None)
    );
}

#[test]
fn check_requests_carry_envoys_attributes() {
    let req = http::Request::post("/api?x=1")
        .header("host", "echo.default.svc.cluster.local")
        .header("x-request-id", "rid")
        .header("x-multi", "a")
        .header("x-multi", "b")
        .header("content-length", "12")
        .body(())
        .expect("request");
    let (parts, ()) = req.into_parts();
    let src = Identity::new("cluster.local", "default", "sleep");
    let dst = Identity::new("cluster.local", "default", "waypoint");
    let msg = check_message(&CheckRequest {
        parts: &parts,
        host: "echo.default.svc.cluster.local",
        path: "/api?x=1",
        client_http2: true,
        source: "10.0.0.1:4000".parse().expect("addr"),
        source_principal: &src,
        destination: "10.96.0.10:80".parse().expect("addr"),
        destination_principal: &dst,
        body: None,
    });
    let attrs = msg.attributes.as_ref().expect("attributes");
    assert_eq!(
        attrs.source.as_ref().map(|p| p.principal.as_str()),
        Some("spiffe://cluster.local/ns/default/sa/sleep")
    );
    let http = attrs
        .request
        .as_ref()
        .and_then(|r| r.http.as_ref())
        .expect("http");
    assert_eq!(
        (
            http.method.as_str(),
            http.path.as_str(),
            http.protocol.as_str(),
            http.size,
            http.id.as_str()
        ),
        ("POST", "/api?x=1", "HTTP/2", 12, "rid")
    );
    assert_eq!(http.headers.get("x-multi").map(String::as_str), Some("a,b"));
    assert_eq!(
        http.headers.get(":authority").map(String::as_str),
        Some("echo.default.svc.cluster.local")
    );
    // Framed and read back as gRPC carries it.
    let back =
        auth::CheckRequest::decode(grpc_unframe(grpc_frame(&msg)).expect("frame")).expect("decode");
    assert_eq!(back, msg);
    assert!(
        grpc_unframe(bytes::Bytes::from_static(&[1, 0, 0, 0, 0])).is_err(),
        "compressed messages are refused"
    );
}

/// With includeRequestBodyInCheck: the body as text (`body`) or, packed as bytes, in
/// `raw_body`; whether it is partial in `x-envoy-auth-partial-body`.
#[test]
fn a_check_carries_the_body_when_asked() {
    use super::check::CheckBody;
    let (parts, ()) = http::Request::post("/upload")
        .header("host", "echo")
        .body(())
        .expect("request")
        .into_parts();
    let id = Identity::new("cluster.local", "default", "sleep");
    let req = |body: Option<CheckBody>| CheckRequest {
        parts: &parts,
        host: "echo",
        path: "/upload",
        client_http2: false,
        source: "10.0.0.1:4000".parse().expect("addr"),
        source_principal: &id,
        destination: "10.96.0.10:80".parse().expect("addr"),
        destination_principal: &id,
        body,
    };
    let http = |m: auth::CheckRequest| {
        m.attributes
            .and_then(|a| a.request)
            .and_then(|r| r.http)
            .expect("http")
    };
    let h = http(check_message(&req(Some(CheckBody {
        data: bytes::Bytes::from_static(b"hello"),
        partial: true,
        as_bytes: false,
    }))));
    assert_eq!((h.body.as_str(), h.raw_body.len()), ("hello", 0));
    assert_eq!(
        h.headers
            .get("x-envoy-auth-partial-body")
            .map(String::as_str),
        Some("true")
    );
    let h = http(check_message(&req(Some(CheckBody {
        data: bytes::Bytes::from_static(b"\xff\x00"),
        partial: false,
        as_bytes: true,
    }))));
    assert_eq!(
        (h.body.as_str(), h.raw_body.as_slice()),
        ("", &b"\xff\x00"[..])
    );
    assert_eq!(
        h.headers
            .get("x-envoy-auth-partial-body")
            .map(String::as_str),
        Some("false")
    );
    let h = http(check_message(&req(None)));
    assert!(h.body.is_empty() && !h.headers.contains_key("x-envoy-auth-partial-body"));
}
