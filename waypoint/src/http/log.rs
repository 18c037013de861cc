//! One access log line and the Istio request metrics per request.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use http::header::HeaderValue;
use http::Method;
use ztunnel::identity::Identity;
use ztunnel::metrics::http::HttpLabels;
use ztunnel::metrics::{Peer, TcpLabels};
use ztunnel::state::{Service, Workload};

use super::headers::{authority, header_bytes};
use super::tunnel::Tunnel;
use crate::config::Config;
use crate::context::Waypoint;
use crate::object::{ObjectName, Target};
use crate::telemetry::expr::Attributes;
use crate::telemetry::format::Entry;
use crate::telemetry::output::Output;
use crate::telemetry::{Applied, LogPolicy};
use crate::trace::{FinishedSpan, SpanContext};

/// What the access log and metrics say about one request; written when the response
/// body ends (or is dropped).
pub struct RequestLog {
    wp: Arc<Waypoint>,
    start: Instant,
    src_addr: SocketAddr,
    src_identity: Identity,
    src_workload: Option<Arc<Workload>>,
    dst_service: Option<Arc<Service>>,
    pub dst_workload: Option<Arc<Workload>>,
    pub dst_addr: Option<SocketAddr>,
    method: Method,
    path: String,
    host: String,
    protocol: &'static str,
    /// 0 until there is a response (Envoy's code for "no response sent").
    pub status: u16,
    /// As a label: 0-16 or `other` (the backend chooses it).
    pub grpc_status: Option<&'static str>,
    pub response_flags: &'static str,
    route: Option<String>,
    pub attempts: u32,
    pub request_bytes: Arc<AtomicU64>,
    request_header_bytes: u64,
    audited_by: Vec<String>,
    denied_by: Option<String>,
    request_principal: Option<String>,
    pub error: Option<String>,
    /// Set once written; a log dropped unwritten is a request the client abandoned.
    finished: bool,
    /// The request's span, when it is traced.
    span: Option<SpanContext>,
    port: u16,
    /// What the Telemetries in force do to this request's log line and metrics.
    telemetry: Arc<Applied>,
    /// For access-log filters and formats: the query, the HTTP version, the CONNECT
    /// target, the request headers they read, the response headers the formats read.
    query: Option<String>,
    version: http::Version,
    target: SocketAddr,
    filter_headers: Vec<(http::HeaderName, String)>,
    /// The built-in `envoy` provider's output, for `LogPolicy::Always`.
    envoy: Arc<Output>,
    start_time: SystemTime,
    response_wanted: Vec<http::HeaderName>,
    response_headers: Vec<(http::HeaderName, String)>,
}

impl RequestLog {
    /// The log of a request just received: who sent it, and where to.
    pub fn start(
        wp: Arc<Waypoint>,
        tunnel: &Tunnel,
        cfg: &Config,
        parts: &http::request::Parts,
        grpc: bool,
    ) -> RequestLog {
        let src_workload = cfg
            .state
            .workload_by_ip(crate::network::get(), tunnel.src_addr.ip())
            .filter(|w| w.identity() == tunnel.src_identity)
            .cloned();
        let dst_service = cfg
            .state
            .service_by_vip(crate::network::get(), tunnel.target.ip())
            .cloned();
        let telemetry = if cfg.telemetry.is_empty() {
            crate::telemetry::Applied::defaults()
        } else {
            let svc = dst_service.as_deref().map(|s| ObjectName {
                namespace: s.namespace.clone(),
                name: s.name.clone(),
            });
            let service_kind = dst_service
                .as_deref()
                .map(crate::object::ServiceKind::of)
                .unwrap_or_default();
            cfg.telemetry.for_target(&Target {
                gateway: &wp.gateway,
                root_namespace: &wp.root_namespace,
                service: svc.as_ref(),
                service_kind,
                port: tunnel.target.port(),
            })
        };
        let span = match cfg.tracing.as_ref().filter(|_| !telemetry.spans_off) {
            Some(t) => crate::trace::start(
                &parts.headers,
                telemetry.sampling.unwrap_or(t.sampling),
                rand::random(),
            ),
            None => None,
        };
        let envoy = cfg.telemetry.envoy();
        let outputs: Vec<&Arc<Output>> = match &telemetry.log {
            LogPolicy::Always => vec![&envoy],
            LogPolicy::Off => Vec::new(),
            LogPolicy::Providers(p) => p.iter().map(|p| &p.output).collect(),
        };
        let formatted = outputs.iter().any(|o| !o.is_own_line());
        // Formats and formatter tags read the start time.
        let stamped = formatted || span.is_some();
        let mut wanted: Vec<&http::HeaderName> =
            telemetry.filters().flat_map(|f| f.headers()).collect();
        let mut response_wanted = Vec::new();
        for o in &outputs {
            wanted.extend(&o.request_headers);
            response_wanted.extend(o.response_headers.iter().cloned());
        }
        let mut tag_headers = Vec::new();
        if let (Some(tags), Some(_)) = (&telemetry.tags, &span) {
            tags.headers(&mut tag_headers, &mut response_wanted);
        }
        wanted.extend(&tag_headers);
        wanted.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        wanted.dedup();
        response_wanted.dedup();
        let all_headers = telemetry.filters().any(|f| f.all_headers())
            || outputs.iter().any(|o| o.all_request_headers);
        let filter_headers = if all_headers {
            parts
                .headers
                .iter()
                .filter_map(|(n, v)| Some((n.clone(), v.to_str().ok()?.to_string())))
                .collect()
        } else {
            wanted
                .into_iter()
                .flat_map(|name| {
                    parts
                        .headers
                        .get_all(name)
                        .iter()
                        .filter_map(move |v| Some((name.clone(), v.to_str().ok()?.to_string())))
                })
                .collect()
        };
        // Only access-log filters and formats read it.
        let query = (formatted || telemetry.filters().next().is_some())
            .then(|| parts.uri.query().map(str::to_string))
            .flatten();
        RequestLog {
            wp,
            start: Instant::now(),
            src_addr: tunnel.src_addr,
            src_identity: tunnel.src_identity.clone(),
            src_workload,
            dst_service,
            dst_workload: None,
            dst_addr: None,
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            host: authority(parts),
            protocol: if grpc { "grpc" } else { "http" },
            status: 0,
            grpc_status: None,
            response_flags: "-",
            route: None,
            attempts: 0,
            request_bytes: Arc::new(AtomicU64::new(0)),
            request_header_bytes: header_bytes(&parts.headers),
            audited_by: Vec::new(),
            denied_by: None,
            request_principal: None,
            error: None,
            finished: false,
            span,
            port: tunnel.target.port(),
            telemetry,
            query,
            version: parts.version,
            target: tunnel.target,
            filter_headers,
            envoy,
            start_time: if stamped {
                SystemTime::now()
            } else {
                SystemTime::UNIX_EPOCH
            },
            response_wanted,
            response_headers: Vec::new(),
        }
    }

    /// The response's headers that access-log formats read (`%RESP(...)%`).
    pub fn response_headers(&mut self, headers: &http::HeaderMap) {
        for name in &self.response_wanted {
            if let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) {
                self.response_headers.push((name.clone(), v.to_string()));
            }
        }
    }

    pub fn span(&self) -> Option<&SpanContext> {
        self.span.as_ref()
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        if !self.finished {
            self.response_flags = "DC";
            self.error
                .get_or_insert_with(|| "client went away before the response".into());
            self.status = 0;
            self.write(0);
        }
    }
}

impl RequestLog {
    pub fn finish(mut self, response_bytes: u64) {
        self.write(response_bytes);
    }

    fn write(&mut self, response_bytes: u64) {
        self.finished = true;
        let wp = &self.wp;
        let dst_identity = self.dst_workload.as_ref().map(|w| w.identity());
        let mut peers = TcpLabels::new(
            "waypoint",
            Peer {
                workload: self.src_workload.as_deref(),
                identity: Some(&self.src_identity),
            },
            Peer {
                workload: self.dst_workload.as_deref(),
                identity: dst_identity.as_ref(),
            },
            self.dst_service.as_deref(),
            true,
        );
        peers.request_protocol = self.protocol;
        peers.response_flags = self.response_flags;
        let labels = HttpLabels {
            peers,
            response_code: Some(self.status),
            grpc_response_status: self.grpc_status.unwrap_or_default(),
        };
        let duration = self.start.elapsed();
        let request_bytes = self.request_header_bytes + self.request_bytes.load(Ordering::Relaxed);
        match &self.telemetry.http {
            None => wp.http_metrics.record(
                &labels,
                duration.as_secs_f64() * 1000.0,
                request_bytes,
                response_bytes,
            ),
            Some(o) => wp.http_metrics.record_overridden(
                &labels,
                o,
                duration.as_secs_f64() * 1000.0,
                request_bytes,
                response_bytes,
            ),
        }
        self.log(request_bytes, response_bytes, duration);
        self.export_span(request_bytes, response_bytes, duration);
    }

    /// Writes the request's line to each access log in force whose filter takes it.
    fn log(&self, request_bytes: u64, response_bytes: u64, duration: std::time::Duration) {
        let providers = match &self.telemetry.log {
            LogPolicy::Always => {
                return self.write_to(&self.envoy, request_bytes, response_bytes, duration)
            }
            LogPolicy::Off => return,
            LogPolicy::Providers(p) => p,
        };
        let san = self.src_identity.to_string();
        let a = Attributes {
            code: self.status,
            grpc_status: self.grpc_status,
            method: self.method.as_str(),
            path: &self.path,
            query: self.query.as_deref(),
            host: &self.host,
            protocol: self.http_version(),
            headers: &self.filter_headers,
            source: self.src_addr,
            destination: self.target,
            upstream: self.dst_addr,
            peer_san: &san,
            request_size: request_bytes.saturating_sub(self.request_header_bytes),
            request_total_size: request_bytes,
            response_size: response_bytes,
            response_flags: self.response_flags,
        };
        let mut own_line = false;
        for p in providers {
            if p.filter.as_ref().is_some_and(|f| !f.matches(&a)) {
                continue;
            }
            // Two providers that are the waypoint's own line write it once.
            if p.output.is_own_line() {
                if own_line {
                    continue;
                }
                own_line = true;
            }
            self.write_to(&p.output, request_bytes, response_bytes, duration);
        }
    }

    fn http_version(&self) -> &'static str {
        match self.version {
            http::Version::HTTP_2 => "HTTP/2",
            http::Version::HTTP_10 => "HTTP/1.0",
            _ => "HTTP/1.1",
        }
    }

    fn write_to(
        &self,
        output: &Output,
        request_bytes: u64,
        response_bytes: u64,
        duration: std::time::Duration,
    ) {
        if output.is_own_line() {
            return self.log_line(request_bytes, response_bytes, duration);
        }
        let trace = self
            .span
            .as_ref()
            .map(|s| (s.trace_id.to_vec(), s.span_id.to_vec()));
        let record = self.with_entry(request_bytes, response_bytes, duration, |e| {
            output.write(e, trace)
        });
        if let Some(r) = record {
            self.wp.otel_logs.push(r);
        }
    }

    /// The request as Envoy's format operators see it.
    fn with_entry<R>(
        &self,
        request_bytes: u64,
        response_bytes: u64,
        duration: std::time::Duration,
        f: impl FnOnce(&Entry<'_>) -> R,
    ) -> R {
        let path = match &self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone(),
        };
        let cluster = self
            .dst_service
            .as_ref()
            .map(|s| format!("inbound-vip|{}|http|{}", self.port, s.hostname));
        let san = self.src_identity.to_string();
        let details = match (&self.denied_by, self.dst_addr) {
            (Some(d), _) => Some(format!("rbac_access_denied_matched_policy[{d}]")),
            (None, Some(_)) if self.status != 0 && self.response_flags == "-" => {
                Some("via_upstream".to_string())
            }
            _ => None,
        };
        f(&Entry {
            start: self.start_time,
            duration,
            method: self.method.as_str(),
            path: &path,
            authority: &self.host,
            protocol: self.http_version(),
            code: self.status,
            response_flags: self.response_flags,
            code_details: details.as_deref(),
            bytes_received: request_bytes.saturating_sub(self.request_header_bytes),
            bytes_sent: response_bytes,
            request_headers: &self.filter_headers,
            response_headers: &self.response_headers,
            upstream: self.dst_addr,
            upstream_cluster: cluster.as_deref(),
            downstream_local: self.target,
            downstream_remote: self.src_addr,
            peer_uri_san: Some(&san),
            route: self.route.as_deref(),
            hostname: hostname(),
            trace_id: self.span.as_ref().map(|s| s.trace_id_hex()),
            grpc_status: self.grpc_status,
            attempts: self.attempts,
        })
    }

    fn log_line(&self, request_bytes: u64, response_bytes: u64, duration: std::time::Duration) {
        tracing::info!(
            src.addr = %self.src_addr,
            src.identity = %self.src_identity,
            src.workload = self.src_workload.as_ref().map(|w| w.name.as_str()),
            dst.service = self.dst_service.as_ref().map(|s| s.hostname.as_str()),
            dst.workload = self.dst_workload.as_ref().map(|w| w.name.as_str()),
            dst.addr = self.dst_addr.map(|a| a.to_string()),
            protocol = self.protocol,
            method = %self.method,
            host = %self.host,
            path = %self.path,
            status = self.status,
            grpc_status = self.grpc_status,
            response_flags = self.response_flags,
            route = self.route.as_deref(),
            attempts = self.attempts,
            bytes_recv = request_bytes,
            bytes_sent = response_bytes,
            duration_ms = duration.as_millis() as u64,
            authn.principal = self.request_principal.as_deref(),
            authz.denied_by = self.denied_by.as_deref(),
            authz.audited_by = (!self.audited_by.is_empty()).then(|| self.audited_by.join(",")),
            error = self.error.as_deref(),
            trace_id = self.span.as_ref().map(|s| s.trace_id_hex()),
            "request complete"
        );
    }

    fn export_span(
        &mut self,
        request_bytes: u64,
        response_bytes: u64,
        duration: std::time::Duration,
    ) {
        let wp = &self.wp;
        if let Some(ctx) = self.span.take() {
            let host = self
                .dst_service
                .as_ref()
                .map_or(self.host.as_str(), |s| s.hostname.as_str());
            let mut attributes: Vec<(Cow<'static, str>, String)> = [
                ("component", "proxy".to_string()),
                ("node_id", format!("waypoint~{}", wp.gateway.name)),
                ("http.method", self.method.to_string()),
                ("http.url", format!("http://{}{}", self.host, self.path)),
                ("http.protocol", self.protocol.to_string()),
                ("http.status_code", self.status.to_string()),
                ("response_flags", self.response_flags.to_string()),
                ("downstream_address", self.src_addr.to_string()),
                ("istio.source_principal", self.src_identity.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (Cow::Borrowed(k), v))
            .collect();
            if let Some(a) = self.dst_addr {
                attributes.push(("upstream_address".into(), a.to_string()));
            }
            if let Some(tags) = &self.telemetry.tags {
                let values: Vec<(String, String)> =
                    self.with_entry(request_bytes, response_bytes, duration, |e| {
                        tags.values(&self.filter_headers, Some(e)).collect()
                    });
                attributes.extend(values.into_iter().map(|(k, v)| (k.into(), v)));
            }
            wp.spans.push(FinishedSpan {
                ctx,
                name: format!("{host}:{}/*", self.port),
                end: std::time::SystemTime::now(),
                attributes,
                error: self.status == 0 || self.status >= 500,
            });
        }
    }
}

/// This host's name (Envoy's `%HOSTNAME%`).
fn hostname() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "-".into())
    })
}

/// What the plan step learned about a request, for its log line.
#[derive(Default)]
pub struct Notes {
    /// The normalized path, once normalization succeeded.
    pub path: Option<String>,
    /// `namespace/name#rule` of the matched route rule.
    pub route: Option<String>,
    pub audited_by: Vec<String>,
    pub denied_by: Option<String>,
    /// `<iss>/<sub>` of the request's verified JWT.
    pub request_principal: Option<String>,
    /// The backend service the route picked (else the log keeps the addressed one).
    pub backend_service: Option<Arc<Service>>,
}

impl RequestLog {
    pub fn note(&mut self, n: Notes) {
        if let Some(p) = n.path {
            self.path = p;
        }
        self.route = n.route;
        self.audited_by = n.audited_by;
        self.denied_by = n.denied_by;
        self.request_principal = n.request_principal;
        if let Some(s) = n.backend_service {
            self.dst_service = Some(s);
        }
    }
}

/// The backend's `grpc-status` as a metric label (bounded: 0-16 or `other`).
pub fn grpc_status_label(v: &HeaderValue) -> &'static str {
    v.to_str()
        .map_or("other", ztunnel::metrics::http::grpc_status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_grpc_status_becomes_a_bounded_label() {
        assert_eq!(grpc_status_label(&HeaderValue::from_static("14")), "14");
        assert_eq!(grpc_status_label(&HeaderValue::from_static("0")), "0");
        for v in ["17", "deadbeef", "1 ", "00"] {
            assert_eq!(
                grpc_status_label(&HeaderValue::from_static(v)),
                "other",
                "{v}"
            );
        }
        assert_eq!(
            grpc_status_label(&HeaderValue::from_bytes(b"\xff").unwrap()),
            "other"
        );
    }
}
