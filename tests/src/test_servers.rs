//! Test servers for the waypoint's end-to-end tests and bench, run in a pod's netns:
//! an OTLP trace collector, and ext_authz servers: an HTTP authorizer as Istio's sample (`x-ext-authz: allow` allows) and a gRPC one
//! serving Envoy's `envoy.service.auth.v3.Authorization` with tonic. Each records the
//! checks it saw.

use std::collections::HashMap;

use anyhow::Result;

use crate::netsim::Pod;

/// What an ext_authz test server saw: each check's path, method and headers.
#[derive(Clone, Debug)]
pub struct SeenCheck {
    pub path: String,
    pub method: String,
    pub headers: HashMap<String, String>,
    /// A connection's check (no request in it: Envoy's network ext_authz).
    pub network: bool,
    /// The gRPC CheckRequest's peers (gRPC only).
    pub source_principal: String,
    pub destination_principal: String,
    /// The request body the check carried (HTTP: its body; gRPC: `body`, else `raw_body`).
    pub body: Vec<u8>,
}

pub type Checks = std::sync::Arc<std::sync::Mutex<Vec<SeenCheck>>>;

/// An HTTP ext_authz server as Istio's sample: `x-ext-authz: allow` allows (and names
/// the user for the backend), anything else is denied with its own status, body and
/// headers.
pub fn start_http_authorizer(
    pod: &Pod,
    port: u16,
    checks: Checks,
) -> Result<tokio::task::JoinHandle<()>> {
    let l = pod.netns.listen(port)?;
    Ok(tokio::spawn(async move {
        while let Ok((stream, _)) = l.accept().await {
            let checks = checks.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let checks = checks.clone();
                        async move {
                            use http_body_util::BodyExt;
                            let headers = req
                                .headers()
                                .iter()
                                .map(|(k, v)| {
                                    (k.to_string(), v.to_str().unwrap_or_default().to_string())
                                })
                                .collect::<HashMap<_, _>>();
                            let allow =
                                headers.get("x-ext-authz").map(String::as_str) == Some("allow");
                            let (path, method) = (req.uri().to_string(), req.method().to_string());
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|c| c.to_bytes().to_vec())
                                .unwrap_or_default();
                            checks.lock().unwrap().push(SeenCheck {
                                network: false,
                                path,
                                method,
                                headers,
                                source_principal: String::new(),
                                destination_principal: String::new(),
                                body,
                            });
                            let resp = if allow {
                                http::Response::builder()
                                    .status(200)
                                    .header("x-user", "alice")
                                    .header("x-authz-said", "ok")
                                    .header("x-unlisted", "1")
                                    .body(String::new())
                            } else {
                                http::Response::builder()
                                    .status(403)
                                    .header("x-reason", "nope")
                                    .header("x-secret", "s")
                                    .body("denied by the authorizer".to_string())
                            };
                            Ok::<_, std::convert::Infallible>(resp.expect("response"))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    }))
}

/// A gRPC ext_authz server (Envoy's Authorization service, tonic): `x-ext-authz: allow`
/// allows with headers for the backend and the client, `unauth` answers
/// UNAUTHENTICATED, anything else is denied with 429 and a body.
#[derive(Clone)]
pub struct GrpcAuthorizer(pub Checks);

#[tonic::async_trait]
impl waypoint::extauthz::proto::envoy::service::auth::v3::authorization_server::Authorization
    for GrpcAuthorizer
{
    async fn check(
        &self,
        req: tonic::Request<waypoint::extauthz::proto::envoy::service::auth::v3::CheckRequest>,
    ) -> Result<
        tonic::Response<waypoint::extauthz::proto::envoy::service::auth::v3::CheckResponse>,
        tonic::Status,
    > {
        use waypoint::extauthz::proto::envoy::config::core::v3 as core;
        use waypoint::extauthz::proto::envoy::service::auth::v3 as auth;
        let attrs = req.into_inner().attributes.unwrap_or_default();
        // A connection's check (Envoy's network ext_authz) has no request: only a
        // source principal of service account `client` is allowed.
        let network = attrs.request.is_none();
        let http = attrs.request.and_then(|r| r.http).unwrap_or_default();
        let verdict = if network {
            let ok = attrs
                .source
                .as_ref()
                .is_some_and(|p| p.principal.ends_with("/sa/client"));
            if ok { "allow" } else { "deny" }.to_string()
        } else {
            http.headers.get("x-ext-authz").cloned().unwrap_or_default()
        };
        self.0.lock().unwrap().push(SeenCheck {
            network,
            path: http.path.clone(),
            method: http.method.clone(),
            headers: http.headers.into_iter().collect(),
            source_principal: attrs.source.map(|p| p.principal).unwrap_or_default(),
            destination_principal: attrs.destination.map(|p| p.principal).unwrap_or_default(),
            body: if http.body.is_empty() {
                http.raw_body
            } else {
                http.body.into_bytes()
            },
        });
        let header = |k: &str, v: &str| core::HeaderValueOption {
            header: Some(core::HeaderValue {
                key: k.into(),
                value: v.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let status = |code| {
            Some(ztunnel::xds::proto::google::rpc::Status {
                code,
                ..Default::default()
            })
        };
        let resp = match verdict.as_str() {
            "allow" => auth::CheckResponse {
                status: status(0),
                http_response: Some(auth::check_response::HttpResponse::OkResponse(
                    auth::OkHttpResponse {
                        headers: vec![header("x-user", "grpc-alice")],
                        headers_to_remove: vec!["x-ext-authz".into()],
                        response_headers_to_add: vec![header("x-grpc-said", "ok")],
                        ..Default::default()
                    },
                )),
                ..Default::default()
            },
            "unauth" => auth::CheckResponse {
                status: status(16),
                ..Default::default()
            },
            _ => auth::CheckResponse {
                status: status(7),
                http_response: Some(auth::check_response::HttpResponse::DeniedResponse(
                    auth::DeniedHttpResponse {
                        status: Some(waypoint::extauthz::proto::envoy::r#type::v3::HttpStatus {
                            code: 429,
                        }),
                        headers: vec![header("x-reason", "grpc-nope")],
                        body: "the gRPC authorizer says no".into(),
                    },
                )),
                ..Default::default()
            },
        };
        Ok(tonic::Response::new(resp))
    }
}

pub fn start_grpc_authorizer(
    pod: &Pod,
    port: u16,
    checks: Checks,
) -> Result<tokio::task::JoinHandle<()>> {
    let svc = waypoint::extauthz::proto::envoy::service::auth::v3::authorization_server::AuthorizationServer::new(GrpcAuthorizer(checks));
    serve_grpc(pod, port, svc)
}

/// Serves a tonic service on `port` in the pod (HTTP/2 only, as gRPC), until aborted.
fn serve_grpc<S>(pod: &Pod, port: u16, svc: S) -> Result<tokio::task::JoinHandle<()>>
where
    S: tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let l = pod.netns.listen(port)?;
    Ok(tokio::spawn(async move {
        while let Ok((stream, _)) = l.accept().await {
            let svc = svc.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let mut svc = svc.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                svc.call(req).await.unwrap_or_else(|e| match e {}),
                            )
                        }
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .http2_only()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    }))
}

/// Spans an OTLP collector received: (trace id, span id, parent span id, name).
pub type Spans = std::sync::Arc<std::sync::Mutex<Vec<(Vec<u8>, Vec<u8>, Vec<u8>, String)>>>;

/// Each span's string attributes, by span name, as an OTLP collector received them.
pub type SpanAttributes = std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<(String, String)>)>>>;

#[derive(Clone)]
struct Collector(Spans, Option<SpanAttributes>);

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService
    for Collector
{
    async fn export(
        &self,
        req: tonic::Request<waypoint::trace::proto::collector::ExportTraceServiceRequest>,
    ) -> Result<
        tonic::Response<waypoint::trace::proto::collector::ExportTraceServiceResponse>,
        tonic::Status,
    > {
        let mut seen = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                for s in ss.spans {
                    if let Some(attrs) = &self.1 {
                        use waypoint::trace::proto::common::any_value::Value;
                        let kv = s
                            .attributes
                            .iter()
                            .filter_map(|a| match a.value.as_ref()?.value.as_ref()? {
                                Value::StringValue(v) => Some((a.key.clone(), v.clone())),
                                _ => None,
                            })
                            .collect();
                        attrs.lock().unwrap().push((s.name.clone(), kv));
                    }
                    seen.push((s.trace_id, s.span_id, s.parent_span_id, s.name));
                }
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

/// An OpenTelemetry collector (OTLP/gRPC trace export, tonic) in the pod.
pub fn start_otlp_collector(
    pod: &Pod,
    port: u16,
    spans: Spans,
) -> Result<tokio::task::JoinHandle<()>> {
    serve_grpc(
        pod,
        port,
        opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer::new(
            Collector(spans, None),
        ),
    )
}

/// The same, keeping each span's string attributes too.
pub fn start_otlp_collector_with_attributes(
    pod: &Pod,
    port: u16,
    spans: Spans,
    attributes: SpanAttributes,
) -> Result<tokio::task::JoinHandle<()>> {
    serve_grpc(
        pod,
        port,
        opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer::new(
            Collector(spans, Some(attributes)),
        ),
    )
}

/// Log records an OTLP logs collector received: (scope name, body, string and integer
/// attributes as text).
pub type LogRecords =
    std::sync::Arc<std::sync::Mutex<Vec<(String, String, Vec<(String, String)>)>>>;

#[derive(Clone)]
struct LogsCollector(LogRecords);

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsService
    for LogsCollector
{
    async fn export(
        &self,
        req: tonic::Request<waypoint::trace::proto::logs_collector::ExportLogsServiceRequest>,
    ) -> Result<
        tonic::Response<waypoint::trace::proto::logs_collector::ExportLogsServiceResponse>,
        tonic::Status,
    > {
        use waypoint::trace::proto::common::any_value::Value;
        let text = |v: Option<&Value>| match v {
            Some(Value::StringValue(s)) => Some(s.clone()),
            Some(Value::IntValue(i)) => Some(i.to_string()),
            Some(Value::BoolValue(b)) => Some(b.to_string()),
            Some(Value::DoubleValue(d)) => Some(d.to_string()),
            _ => None,
        };
        let mut seen = self.0.lock().unwrap();
        for rl in req.into_inner().resource_logs {
            for sl in rl.scope_logs {
                let scope = sl.scope.map(|s| s.name).unwrap_or_default();
                for r in sl.log_records {
                    let body =
                        text(r.body.as_ref().and_then(|b| b.value.as_ref())).unwrap_or_default();
                    let attrs = r
                        .attributes
                        .iter()
                        .filter_map(|a| {
                            Some((a.key.clone(), text(a.value.as_ref()?.value.as_ref())?))
                        })
                        .collect();
                    seen.push((scope.clone(), body, attrs));
                }
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

/// An OpenTelemetry logs collector (OTLP/gRPC logs export, tonic) in the pod.
pub fn start_otlp_logs_collector(
    pod: &Pod,
    port: u16,
    records: LogRecords,
) -> Result<tokio::task::JoinHandle<()>> {
    serve_grpc(
        pod,
        port,
        opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsServiceServer::new(
            LogsCollector(records),
        ),
    )
}
