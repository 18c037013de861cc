//! Istio's `DestinationRule` as it is written (networking.istio.io/v1 `spec`), every
//! field of its proto, so that a field the waypoint does not apply is seen and either
//! ignored as Istio's waypoint ignores it or refused in its scope (`super::resolve`),
//! never silently dropped. A field that is not in Istio's proto is an error.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::tls::ClientTls;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DestinationRule {
    pub name: String,
    pub namespace: String,
    pub host: String,
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
    /// Named endpoint sets (by labels) that VirtualService destinations pick.
    #[serde(default)]
    pub subsets: Vec<Subset>,
    /// The namespaces the rule is visible to: `.` its own, `*` all (also when empty,
    /// Istio's default), or names.
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
    #[serde(default)]
    pub tls: Option<ClientTls>,
    /// Per service port: replaces the policy above whole for that port (Istio: fields
    /// left out get their defaults, not the rule's).
    #[serde(default)]
    pub port_level_settings: Vec<PortTrafficPolicy>,
    /// A sidecar's egress tunnel: Istio's waypoint does not read it
    /// (`selectTrafficPolicyComponents`), nor does this one.
    #[serde(default)]
    pub tunnel: Option<serde_json::Value>,
    /// PROXY protocol to the endpoint: Istio's waypoint sends it; this one does not, so
    /// the rule's host fails (`super::resolve`).
    #[serde(default)]
    pub proxy_protocol: Option<serde_json::Value>,
    /// Retries allowed as a share of the requests in flight, in place of `maxRetries`.
    #[serde(default)]
    pub retry_budget: Option<RetryBudget>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortTrafficPolicy {
    pub port: PortSelector,
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    #[serde(default)]
    pub tls: Option<ClientTls>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortSelector {
    pub number: u16,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryBudget {
    /// Percent of the requests in flight (Istio's default 20).
    #[serde(default)]
    pub percent: Option<f64>,
    /// Retries always allowed (Istio's default 3).
    #[serde(default)]
    pub min_retry_concurrency: Option<u32>,
    /// Envoy's window for counting requests: the waypoint counts the ones in flight now.
    #[serde(default)]
    pub budget_interval: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Subset {
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Over the rule's policy, field by field (a port-level one replaces it whole).
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancer {
    #[serde(default)]
    pub simple: Option<String>,
    #[serde(default)]
    pub consistent_hash: Option<ConsistentHash>,
    /// Locality weights and failover: not applied, so the rule's host fails unless it
    /// says `enabled: false`.
    #[serde(default)]
    pub locality_lb_setting: Option<serde_json::Value>,
    #[serde(default)]
    pub zone_aware_lb_setting: Option<serde_json::Value>,
    /// Envoy's slow start (deprecated form and current): not applied, the host fails.
    #[serde(default)]
    pub warmup_duration_secs: Option<String>,
    #[serde(default)]
    pub warmup: Option<serde_json::Value>,
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
    /// Envoy's ring size and hash algorithms: the waypoint hashes onto its endpoints
    /// directly (rendezvous: a key stays on its endpoint while others come and go, what
    /// both algorithms give), so they are accepted and have nothing to tune.
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
    #[serde(default)]
    pub ring_hash: Option<serde_json::Value>,
    #[serde(default)]
    pub maglev: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpCookie {
    pub name: String,
    #[serde(default)]
    pub path: Option<String>,
    /// With a TTL, a request without the cookie gets one (Envoy's generated cookie).
    #[serde(default)]
    pub ttl: Option<String>,
    #[serde(default)]
    pub attributes: Vec<CookieAttribute>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CookieAttribute {
    pub name: String,
    #[serde(default)]
    pub value: Option<String>,
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
    #[serde(default)]
    pub tcp_keepalive: Option<TcpKeepalive>,
    #[serde(default)]
    pub max_connection_duration: Option<String>,
    #[serde(default)]
    pub idle_timeout: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TcpKeepalive {
    #[serde(default)]
    pub probes: Option<u32>,
    #[serde(default)]
    pub time: Option<String>,
    #[serde(default)]
    pub interval: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpSettings {
    /// Requests waiting for one of the Service's HTTP/1.1 connections when
    /// `tcp.maxConnections` are all in use; over it, 503 `UO`.
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
    /// DEFAULT, DO_NOT_UPGRADE or UPGRADE (HTTP/1.1 requests go upstream as HTTP/2).
    #[serde(default)]
    pub h2_upgrade_policy: Option<String>,
    /// The upstream speaks whatever the client spoke.
    #[serde(default)]
    pub use_client_protocol: Option<bool>,
    /// Streams per upstream HTTP/2 connection: Envoy opens another connection past it;
    /// not applied, so the rule's host fails.
    #[serde(default)]
    pub max_concurrent_streams: Option<u32>,
    /// HTTP/2 PINGs on the upstream connections.
    #[serde(default)]
    pub http2_keep_alive: Option<Http2KeepAlive>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Http2KeepAlive {
    #[serde(default)]
    pub interval: Option<String>,
    #[serde(default)]
    pub timeout: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutlierDetection {
    /// Deprecated in Istio for `consecutiveGatewayErrors`.
    #[serde(default)]
    pub consecutive_errors: Option<u32>,
    #[serde(default, rename = "consecutive5xxErrors")]
    pub consecutive_5xx_errors: Option<u32>,
    #[serde(default)]
    pub consecutive_gateway_errors: Option<u32>,
    /// Connect failures, timeouts and resets counted apart from the responses' 5xx.
    #[serde(default)]
    pub split_external_local_origin_errors: Option<bool>,
    #[serde(default)]
    pub consecutive_local_origin_failures: Option<u32>,
    #[serde(default)]
    pub interval: Option<String>,
    #[serde(default)]
    pub base_ejection_time: Option<String>,
    #[serde(default)]
    pub max_ejection_percent: Option<u32>,
    /// Envoy's panic threshold: not applied, so the rule's host fails when it is set.
    #[serde(default)]
    pub min_health_percent: Option<i32>,
}
