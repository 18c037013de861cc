//! Istio `DestinationRule` traffic policies for the Services the waypoint sends to:
//! `loadBalancer` (simple ROUND_ROBIN / LEAST_REQUEST / RANDOM, or `consistentHash` on a
//! header, cookie, query parameter or the source IP), `outlierDetection` (per Service,
//! in place of the waypoint's flags) and `connectionPool` circuit breaking
//! (`http.http2MaxRequests` concurrent requests, `http.maxRetries` concurrent retries,
//! `tcp.maxConnections` concurrent L4 connections: over the limit a request gets 503
//! with Envoy's flag `UO`, a connection a reset).
//!
//! Which rule applies to a Service: one whose `host` is the Service's hostname (or its
//! short name, in the rule's namespace), else the longest matching `*.` wildcard; a rule
//! in the Service's own namespace wins over others, then the one listed first. Fields the
//! waypoint cannot apply are refused when the rule loads (the rule then does not apply,
//! in a cluster; the file is refused, with the field named), except `subsets` and their
//! policies, which only VirtualServices use (not supported here) and are kept out.

#[cfg(test)]
mod tests;

use std::time::Duration;

use serde::Deserialize;
use ztunnel::state::Service;

use crate::extauthz::provider::parse_duration;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DestinationRule {
    pub name: String,
    pub namespace: String,
    pub host: String,
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
    /// For VirtualServices, which the waypoint does not serve: read and left out.
    #[serde(default)]
    pub subsets: Vec<serde_json::Value>,
    /// Visibility; the waypoint applies the rule to what it sends wherever it is.
    #[serde(default)]
    pub export_to: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TrafficPolicy {
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    /// Only `ISTIO_MUTUAL` (what the mesh does anyway) is accepted.
    #[serde(default)]
    pub tls: Option<ClientTls>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancer {
    #[serde(default)]
    pub simple: Option<String>,
    #[serde(default)]
    pub consistent_hash: Option<ConsistentHash>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConsistentHash {
    #[serde(default)]
    pub http_header_name: Option<String>,
    #[serde(default)]
    pub http_cookie: Option<HttpCookie>,
    #[serde(default)]
    pub use_source_ip: Option<bool>,
    #[serde(default)]
    pub http_query_parameter_name: Option<String>,
    /// Envoy's ring size: the waypoint hashes onto its endpoints directly (rendezvous), so
    /// it is accepted and has nothing to tune.
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpCookie {
    pub name: String,
    #[serde(default)]
    pub path: Option<String>,
    /// Envoy generates the cookie when a TTL is set; the waypoint hashes only on a
    /// cookie the client sends, so a TTL is refused.
    #[serde(default)]
    pub ttl: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectionPool {
    #[serde(default)]
    pub tcp: Option<TcpSettings>,
    #[serde(default)]
    pub http: Option<HttpSettings>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TcpSettings {
    #[serde(default)]
    pub max_connections: Option<u32>,
    #[serde(default)]
    pub connect_timeout: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpSettings {
    /// Requests waiting for a connection: the waypoint does not queue (each request gets
    /// a pooled or new connection), so this only bounds nothing and is accepted.
    #[serde(default)]
    pub http1_max_pending_requests: Option<u32>,
    #[serde(default)]
    pub http2_max_requests: Option<u32>,
    #[serde(default)]
    pub max_requests_per_connection: Option<u32>,
    #[serde(default)]
    pub max_retries: Option<u32>,
    #[serde(default)]
    pub idle_timeout: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutlierDetection {
    #[serde(default, rename = "consecutive5xxErrors")]
    pub consecutive_5xx_errors: Option<u32>,
    #[serde(default)]
    pub consecutive_gateway_errors: Option<u32>,
    #[serde(default)]
    pub interval: Option<String>,
    #[serde(default)]
    pub base_ejection_time: Option<String>,
    #[serde(default)]
    pub max_ejection_percent: Option<u32>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientTls {
    pub mode: String,
}

/// How endpoints are picked for one Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pick {
    RoundRobin,
    LeastRequest,
    Random,
    /// The same key goes to the same endpoint while the endpoint set is the same.
    HashHeader(http::HeaderName),
    HashCookie(String),
    HashQuery(String),
    HashSourceIp,
}

/// What a rule asks of the traffic to one Service, checked and resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// None: the waypoint's `--lb-policy`.
    pub pick: Option<Pick>,
    /// None: the waypoint's outlier flags. `Some(0, _)` turns ejection off.
    pub outlier: Option<(u32, Duration)>,
    pub max_requests: Option<u32>,
    pub max_retries: Option<u32>,
    pub max_connections: Option<u32>,
    /// The rule, `namespace/name`, for logs.
    pub rule: String,
}

impl DestinationRule {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The policy it asks for, or what cannot be applied (the field path first).
    pub fn policy(&self) -> Result<Policy, String> {
        if self.name.is_empty() || self.namespace.is_empty() {
            return Err("name and namespace: required".into());
        }
        if self.host.is_empty() {
            return Err("host: required (the Service's hostname or short name)".into());
        }
        let mut p = Policy { rule: self.key(), ..Policy::default() };
        let Some(tp) = &self.traffic_policy else { return Ok(p) };
        if let Some(lb) = &tp.load_balancer {
            p.pick = Some(lb.pick().map_err(|e| format!("trafficPolicy.loadBalancer.{e}"))?);
        }
        if let Some(od) = &tp.outlier_detection {
            p.outlier = Some(od.settings().map_err(|e| format!("trafficPolicy.outlierDetection.{e}"))?);
        }
        if let Some(cp) = &tp.connection_pool {
            if let Some(tcp) = &cp.tcp {
                p.max_connections = tcp.max_connections.filter(|n| *n > 0);
                if let Some(t) = &tcp.connect_timeout {
                    parse_duration(t).map_err(|e| format!("trafficPolicy.connectionPool.tcp.connectTimeout: {e}"))?;
                }
            }
            if let Some(http) = &cp.http {
                p.max_requests = http.http2_max_requests.filter(|n| *n > 0);
                p.max_retries = http.max_retries;
                if let Some(t) = &http.idle_timeout {
                    parse_duration(t).map_err(|e| format!("trafficPolicy.connectionPool.http.idleTimeout: {e}"))?;
                }
            }
        }
        if let Some(tls) = &tp.tls {
            if tls.mode != "ISTIO_MUTUAL" {
                return Err(format!(
                    "trafficPolicy.tls.mode: {:?} is not supported; mesh traffic is always Istio mTLS (ISTIO_MUTUAL)",
                    tls.mode
                ));
            }
        }
        Ok(p)
    }

    /// How well `host` names the Service: 2 for its hostname (or short name in the
    /// rule's namespace), 1 for a wildcard suffix (longer suffixes are compared by the
    /// caller), None when it does not.
    fn matches(&self, svc: &Service) -> Option<(u8, usize)> {
        let host = self.host.to_ascii_lowercase();
        let short = format!("{host}.{}.svc.", self.namespace);
        if svc.hostname.eq_ignore_ascii_case(&host) || (!host.contains('.') && svc.hostname.to_ascii_lowercase().starts_with(&short)) {
            return Some((2, host.len()));
        }
        if host == "*" {
            return Some((1, 0));
        }
        let suffix = host.strip_prefix('*')?;
        svc.hostname.to_ascii_lowercase().ends_with(suffix).then_some((1, suffix.len()))
    }
}

impl LoadBalancer {
    fn pick(&self) -> Result<Pick, String> {
        match (&self.simple, &self.consistent_hash) {
            (Some(_), Some(_)) => Err("simple: set either simple or consistentHash".into()),
            (Some(s), None) => match s.as_str() {
                "ROUND_ROBIN" => Ok(Pick::RoundRobin),
                "LEAST_REQUEST" | "LEAST_CONN" | "UNSPECIFIED" => Ok(Pick::LeastRequest),
                "RANDOM" => Ok(Pick::Random),
                other => Err(format!("simple: {other:?} is not supported (ROUND_ROBIN, LEAST_REQUEST, RANDOM)")),
            },
            (None, Some(h)) => h.pick().map_err(|e| format!("consistentHash.{e}")),
            (None, None) => Err("simple: set either simple or consistentHash".into()),
        }
    }
}

impl ConsistentHash {
    fn pick(&self) -> Result<Pick, String> {
        let set = [self.http_header_name.is_some(), self.http_cookie.is_some(), self.use_source_ip == Some(true), self.http_query_parameter_name.is_some()];
        if set.iter().filter(|b| **b).count() != 1 {
            return Err("httpHeaderName: set exactly one of httpHeaderName, httpCookie, useSourceIp, httpQueryParameterName".into());
        }
        if let Some(h) = &self.http_header_name {
            return http::HeaderName::from_bytes(h.as_bytes()).map(Pick::HashHeader).map_err(|_| format!("httpHeaderName: {h:?} is not a header name"));
        }
        if let Some(c) = &self.http_cookie {
            if c.ttl.is_some() {
                return Err("httpCookie.ttl: the waypoint hashes on a cookie the client sends and does not set one".into());
            }
            if c.name.is_empty() {
                return Err("httpCookie.name: required".into());
            }
            return Ok(Pick::HashCookie(c.name.clone()));
        }
        if let Some(q) = &self.http_query_parameter_name {
            return Ok(Pick::HashQuery(q.clone()));
        }
        Ok(Pick::HashSourceIp)
    }
}

impl OutlierDetection {
    /// (consecutive failures that eject, base ejection time). Istio's defaults: 5
    /// consecutive 5xx, 30 s. Gateway errors (502-504) count with the 5xx ones.
    fn settings(&self) -> Result<(u32, Duration), String> {
        let n = self.consecutive_5xx_errors.or(self.consecutive_gateway_errors).unwrap_or(5);
        let base = match &self.base_ejection_time {
            Some(t) => parse_duration(t).map_err(|e| format!("baseEjectionTime: {e}"))?,
            None => Duration::from_secs(30),
        };
        if let Some(t) = &self.interval {
            parse_duration(t).map_err(|e| format!("interval: {e}"))?;
        }
        if self.max_ejection_percent.is_some_and(|p| p > 100) {
            return Err("maxEjectionPercent: at most 100".into());
        }
        Ok((n, base))
    }
}

/// The policy for traffic to `svc`: the best-matching rule's (module docs), if any.
pub fn for_service<'r>(rules: &'r [(DestinationRule, Policy)], svc: &Service) -> Option<&'r Policy> {
    let mut best: Option<((u8, bool, usize), &Policy)> = None;
    for (r, p) in rules {
        let Some((exact, len)) = r.matches(svc) else { continue };
        let rank = (exact, r.namespace == svc.namespace, len);
        if best.as_ref().is_none_or(|(b, _)| rank > *b) {
            best = Some((rank, p));
        }
    }
    best.map(|(_, p)| p)
}
