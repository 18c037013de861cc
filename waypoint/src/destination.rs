//! Istio `DestinationRule` traffic policies for the Services the waypoint sends to:
//! `loadBalancer` (simple ROUND_ROBIN / LEAST_REQUEST / RANDOM, or `consistentHash` on a
//! header, cookie, query parameter or the source IP), `outlierDetection` (per Service,
//! in place of the waypoint's flags), `connectionPool` circuit breaking
//! (`http.http2MaxRequests` concurrent requests, `http.maxRetries` concurrent retries,
//! `tcp.maxConnections` concurrent L4 connections: over the limit a request gets 503
//! with Envoy's flag `UO`, a connection a reset) and `tls` origination (`tls`), per port
//! (`portLevelSettings`, replacing the rule's policy whole for that port) and per subset
//! (`subsets`, merged over the rule's field by field, as Istio merges them).
//!
//! Which rule applies to a Service, as Istio picks it for the waypoint proxy: first
//! the rules of the waypoint's own namespace, then those of the Service's namespace
//! exported to the waypoint's (`exportTo`: empty or `*` all, `.` its own, or names),
//! then those of the root namespace exported likewise; a rule of any other namespace
//! never applies. Within a namespace the most specific `host` wins: the Service's
//! hostname (or its short name, in the rule's namespace), else the longest matching `*.`
//! wildcard; then the one listed first. Fields the
//! waypoint cannot apply are refused when the rule loads (in a cluster the rule then does
//! not apply, or, when it asked for TLS origination, its host's traffic fails rather than
//! go out in plaintext; the file is refused), with the field named.

#[cfg(test)]
mod tests;

pub mod tls;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use ztunnel::state::Service;

use crate::extauthz::provider::parse_duration;
pub use tls::{ClientTls, Origination, TlsTarget};

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

/// A DestinationRule's `connectionPool.http.maxRequestsPerConnection` (a connection
/// takes no request past that many) and `idleTimeout` (a connection without a request in
/// flight that long is closed; default: the waypoint's own limits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Reuse {
    pub max_requests: Option<u32>,
    pub idle: Option<std::time::Duration>,
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

/// What a rule asks of the traffic to one Service (one port, one subset), checked and
/// resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// None: the waypoint's `--lb-policy`.
    pub pick: Option<Pick>,
    /// None: the waypoint's outlier flags. `Some(0, _)` turns ejection off.
    pub outlier: Option<(u32, Duration)>,
    pub max_requests: Option<u32>,
    pub max_retries: Option<u32>,
    pub max_connections: Option<u32>,
    /// Requests that may wait for one of `max_connections` HTTP/1.1 connections.
    pub max_pending: Option<u32>,
    /// `http.maxRequestsPerConnection` and `http.idleTimeout`: how the Service's upstream
    /// HTTP connections are reused.
    pub reuse: Reuse,
    /// TLS from the waypoint to the endpoint (SIMPLE or MUTUAL).
    pub tls: Option<Arc<Origination>>,
    /// The rule, `namespace/name`, for logs.
    pub rule: String,
    /// Why the rule cannot be applied, when it asked for what must not be dropped (TLS
    /// origination): traffic it covers fails rather than go out in plaintext.
    pub refused: Option<String>,
}

/// Everything one rule asks for, per port and subset, resolved when it loads.
#[derive(Clone, Debug, Default)]
pub struct Resolved {
    /// (subset, port, policy): None for the Service itself or for any other port.
    policies: Vec<(Option<String>, Option<u16>, Arc<Policy>)>,
    /// The subsets' names and labels, in the rule's order.
    pub subsets: Vec<(String, BTreeMap<String, String>)>,
}

impl Resolved {
    /// The policy for `port` of the Service (`subset` None) or of one of its subsets;
    /// None for a subset the rule does not define.
    pub fn policy(&self, subset: Option<&str>, port: u16) -> Option<&Arc<Policy>> {
        let of_subset = |p: &&(Option<String>, Option<u16>, Arc<Policy>)| p.0.as_deref() == subset;
        let on_port = self
            .policies
            .iter()
            .filter(of_subset)
            .find(|p| p.1 == Some(port));
        on_port
            .or_else(|| {
                self.policies
                    .iter()
                    .filter(of_subset)
                    .find(|p| p.1.is_none())
            })
            .map(|p| &p.2)
    }

    /// The labels that make up `subset`.
    pub fn subset(&self, name: &str) -> Option<&BTreeMap<String, String>> {
        self.subsets.iter().find(|(n, _)| n == name).map(|(_, l)| l)
    }

    /// A rule that cannot be applied and must not be left out: its host's traffic fails.
    pub fn refusing(rule: String, reason: String) -> Resolved {
        Resolved {
            policies: vec![(
                None,
                None,
                Arc::new(Policy {
                    rule,
                    refused: Some(reason),
                    ..Policy::default()
                }),
            )],
            subsets: Vec::new(),
        }
    }

    /// Whether the rule asks for anything on this Service at all.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.policies.iter().map(|(_, _, p)| p)
    }
}

/// One traffic policy's four parts, as they merge (Istio's MergeTrafficPolicy).
#[derive(Clone, Copy, Default)]
struct Parts<'r> {
    load_balancer: Option<&'r LoadBalancer>,
    connection_pool: Option<&'r ConnectionPool>,
    outlier_detection: Option<&'r OutlierDetection>,
    tls: Option<&'r ClientTls>,
}

impl<'r> Parts<'r> {
    /// The parts in force on `port`: a port-level entry replaces the policy whole.
    fn on_port(tp: &'r TrafficPolicy, port: Option<u16>) -> (Parts<'r>, bool) {
        if let Some(pl) =
            port.and_then(|n| tp.port_level_settings.iter().find(|p| p.port.number == n))
        {
            let parts = Parts {
                load_balancer: pl.load_balancer.as_ref(),
                connection_pool: pl.connection_pool.as_ref(),
                outlier_detection: pl.outlier_detection.as_ref(),
                tls: pl.tls.as_ref(),
            };
            return (parts, true);
        }
        let parts = Parts {
            load_balancer: tp.load_balancer.as_ref(),
            connection_pool: tp.connection_pool.as_ref(),
            outlier_detection: tp.outlier_detection.as_ref(),
            tls: tp.tls.as_ref(),
        };
        (parts, false)
    }

    /// `self` with what `over` sets (all of it when `over` is port-level).
    fn merged(self, over: Parts<'r>, whole: bool) -> Parts<'r> {
        Parts {
            load_balancer: if whole || over.load_balancer.is_some() {
                over.load_balancer
            } else {
                self.load_balancer
            },
            connection_pool: if whole || over.connection_pool.is_some() {
                over.connection_pool
            } else {
                self.connection_pool
            },
            outlier_detection: if whole || over.outlier_detection.is_some() {
                over.outlier_detection
            } else {
                self.outlier_detection
            },
            tls: if whole || over.tls.is_some() {
                over.tls
            } else {
                self.tls
            },
        }
    }
}

impl DestinationRule {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn exports(&self, to: &str) -> bool {
        self.export_to.iter().any(|e| e == to)
    }

    /// In Istio's namespace-local index: seen by a proxy of its own namespace.
    fn visible_in_own_namespace(&self) -> bool {
        self.export_to.is_empty()
            || self.exports("*")
            || self.exports(".")
            || self.exports(&self.namespace)
    }

    /// Exported to its own namespace only (Istio's `isPrivateOnly`, the set of
    /// `exportTo` values being `.` or the rule's namespace alone).
    fn private_only(&self) -> bool {
        let mut set: Vec<&str> = self.export_to.iter().map(String::as_str).collect();
        set.sort_unstable();
        set.dedup();
        set.len() == 1 && (set[0] == "." || set[0] == self.namespace)
    }

    /// Exported to a proxy of namespace `ns` (a rule of another namespace).
    fn exported_to(&self, ns: &str) -> bool {
        self.export_to.is_empty() || self.exports("*") || self.exports(ns)
    }

    /// What the rule asks for on each port and subset, or what cannot be applied (the
    /// field path first).
    pub fn resolve(&self) -> Result<Resolved, String> {
        if self.name.is_empty() || self.namespace.is_empty() {
            return Err("name and namespace: required".into());
        }
        if self.host.is_empty() {
            return Err("host: required (the Service's hostname or short name)".into());
        }
        let none = TrafficPolicy::default();
        let tp = self.traffic_policy.as_ref().unwrap_or(&none);
        let mut origins: Vec<(*const ClientTls, Option<Arc<Origination>>)> = Vec::new();
        let build = |prefix: &str,
                     parts: Parts<'_>,
                     origins: &mut Vec<(*const ClientTls, Option<Arc<Origination>>)>|
         -> Result<Policy, String> {
            policy(self.key(), parts, origins).map_err(|e| format!("{prefix}{e}"))
        };
        let ports = |tp: &TrafficPolicy, prefix: &str| -> Result<Vec<u16>, String> {
            let mut seen = Vec::new();
            for (i, p) in tp.port_level_settings.iter().enumerate() {
                if p.port.number == 0 || seen.contains(&p.port.number) {
                    return Err(format!(
                        "{prefix}portLevelSettings[{i}].port.number: {} is 0 or listed twice",
                        p.port.number
                    ));
                }
                seen.push(p.port.number);
            }
            Ok(seen)
        };
        let rule_ports = ports(tp, "trafficPolicy.")?;
        let mut out = Resolved::default();
        // The rule's own policy: any port, then each port-level entry.
        let whole = |port: Option<u16>| Parts::on_port(tp, port).0;
        out.policies.push((
            None,
            None,
            Arc::new(build("trafficPolicy.", whole(None), &mut origins)?),
        ));
        for (i, &port) in rule_ports.iter().enumerate() {
            out.policies.push((
                None,
                Some(port),
                Arc::new(build(
                    &format!("trafficPolicy.portLevelSettings[{i}]."),
                    whole(Some(port)),
                    &mut origins,
                )?),
            ));
        }
        for (j, ss) in self.subsets.iter().enumerate() {
            let prefix = format!("subsets[{j}].");
            if ss.name.is_empty() || out.subsets.iter().any(|(n, _)| *n == ss.name) {
                return Err(format!(
                    "{prefix}name: {:?} is empty or used twice",
                    ss.name
                ));
            }
            let sp = ss.traffic_policy.as_ref().unwrap_or(&none);
            let mut sub_ports = ports(sp, &format!("{prefix}trafficPolicy."))?;
            // Every port either list names gets its own merged policy, as Istio merges per port.
            sub_ports.extend(
                rule_ports
                    .iter()
                    .copied()
                    .filter(|p| !sp.port_level_settings.iter().any(|s| s.port.number == *p)),
            );
            for port in std::iter::once(None).chain(sub_ports.into_iter().map(Some)) {
                let (over, port_level) = Parts::on_port(sp, port);
                let merged = whole(port).merged(over, port_level);
                let p = build(&format!("{prefix}trafficPolicy."), merged, &mut origins)?;
                out.policies
                    .push((Some(ss.name.clone()), port, Arc::new(p)));
            }
            out.subsets.push((ss.name.clone(), ss.labels.clone()));
        }
        Ok(out)
    }

    /// How well `host` names the Service: 2 for its hostname (or short name in the
    /// rule's namespace), 1 for a wildcard suffix (longer suffixes are compared by the
    /// caller), None when it does not.
    fn matches(&self, svc: &Service) -> Option<(u8, usize)> {
        let host = self.host.to_ascii_lowercase();
        let short = format!("{host}.{}.svc.", self.namespace);
        if svc.hostname.eq_ignore_ascii_case(&host)
            || (!host.contains('.') && svc.hostname.to_ascii_lowercase().starts_with(&short))
        {
            return Some((2, host.len()));
        }
        if host == "*" {
            return Some((1, 0));
        }
        let suffix = host.strip_prefix('*')?;
        svc.hostname
            .to_ascii_lowercase()
            .ends_with(suffix)
            .then_some((1, suffix.len()))
    }
}

/// One resolved policy from its parts; `origins` shares one TLS origination between the
/// port and subset policies made from the same `tls` (its files are read once).
fn policy(
    rule: String,
    parts: Parts<'_>,
    origins: &mut Vec<(*const ClientTls, Option<Arc<Origination>>)>,
) -> Result<Policy, String> {
    let mut p = Policy {
        rule,
        ..Policy::default()
    };
    if let Some(lb) = parts.load_balancer {
        p.pick = Some(lb.pick().map_err(|e| format!("loadBalancer.{e}"))?);
    }
    if let Some(od) = parts.outlier_detection {
        p.outlier = Some(od.settings().map_err(|e| format!("outlierDetection.{e}"))?);
    }
    if let Some(cp) = parts.connection_pool {
        if let Some(tcp) = &cp.tcp {
            p.max_connections = tcp.max_connections.filter(|n| *n > 0);
            if let Some(t) = &tcp.connect_timeout {
                parse_duration(t).map_err(|e| format!("connectionPool.tcp.connectTimeout: {e}"))?;
            }
        }
        if let Some(http) = &cp.http {
            p.max_requests = http.http2_max_requests.filter(|n| *n > 0);
            p.max_retries = http.max_retries;
            p.max_pending = http.http1_max_pending_requests;
            // Istio: 0 (or unset) is no limit.
            p.reuse.max_requests = http.max_requests_per_connection.filter(|n| *n > 0);
            if let Some(t) = &http.idle_timeout {
                // Istio: 0s turns the idle timeout off.
                let zero = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
                p.reuse.idle = if !zero.is_empty() && zero.chars().all(|c| c == '0' || c == '.') {
                    None
                } else {
                    Some(
                        parse_duration(t)
                            .map_err(|e| format!("connectionPool.http.idleTimeout: {e}"))?,
                    )
                };
            }
        }
    }
    if let Some(tls) = parts.tls {
        let key = tls as *const ClientTls;
        p.tls = match origins.iter().find(|(k, _)| *k == key) {
            Some((_, o)) => o.clone(),
            None => {
                let o = tls.origination().map_err(|e| format!("tls.{e}"))?;
                origins.push((key, o.clone()));
                o
            }
        };
    }
    Ok(p)
}

impl LoadBalancer {
    fn pick(&self) -> Result<Pick, String> {
        match (&self.simple, &self.consistent_hash) {
            (Some(_), Some(_)) => Err("simple: set either simple or consistentHash".into()),
            (Some(s), None) => match s.as_str() {
                "ROUND_ROBIN" => Ok(Pick::RoundRobin),
                "LEAST_REQUEST" | "LEAST_CONN" | "UNSPECIFIED" => Ok(Pick::LeastRequest),
                "RANDOM" => Ok(Pick::Random),
                other => Err(format!(
                    "simple: {other:?} is not supported (ROUND_ROBIN, LEAST_REQUEST, RANDOM)"
                )),
            },
            (None, Some(h)) => h.pick().map_err(|e| format!("consistentHash.{e}")),
            (None, None) => Err("simple: set either simple or consistentHash".into()),
        }
    }
}

impl ConsistentHash {
    fn pick(&self) -> Result<Pick, String> {
        let set = [
            self.http_header_name.is_some(),
            self.http_cookie.is_some(),
            self.use_source_ip == Some(true),
            self.http_query_parameter_name.is_some(),
        ];
        if set.iter().filter(|b| **b).count() != 1 {
            return Err("httpHeaderName: set exactly one of httpHeaderName, httpCookie, useSourceIp, httpQueryParameterName".into());
        }
        if let Some(h) = &self.http_header_name {
            return http::HeaderName::from_bytes(h.as_bytes())
                .map(Pick::HashHeader)
                .map_err(|_| format!("httpHeaderName: {h:?} is not a header name"));
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
        let n = self
            .consecutive_5xx_errors
            .or(self.consecutive_gateway_errors)
            .unwrap_or(5);
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

/// Who looks a rule up: Istio's proxy `ConfigNamespace` (the waypoint's own namespace)
/// and the mesh's root namespace.
#[derive(Clone, Copy, Debug)]
pub struct Client<'a> {
    pub namespace: &'a str,
    pub root_namespace: &'a str,
}

/// The rule for traffic from `client` to `svc`, as Istio's `PushContext.destinationRule`
/// picks it (module docs): the client's namespace, then the Service's namespace for
/// rules exported to the client, then the root namespace's likewise. A rule of any other
/// namespace never applies, so one tenant cannot throttle or weaken another's traffic.
pub fn rule_for<'r>(
    rules: &'r [(DestinationRule, Resolved)],
    client: Client<'_>,
    svc: &Service,
) -> Option<&'r Resolved> {
    let in_ns = |ns: &str| -> Vec<&'r (DestinationRule, Resolved)> {
        rules.iter().filter(|(r, _)| r.namespace == ns).collect()
    };
    // 1. The client's own namespace: every rule it can see there (Istio's namespace-local
    // index; from the root namespace, only the root's private rules, as Istio does).
    let own: Vec<_> = if client.namespace != client.root_namespace {
        in_ns(client.namespace)
            .into_iter()
            .filter(|(r, _)| r.visible_in_own_namespace())
            .collect()
    } else {
        in_ns(client.namespace)
            .into_iter()
            .filter(|(r, _)| r.private_only())
            .collect()
    };
    if let Some(found) = most_specific(&own, svc).into_iter().next() {
        return Some(&found.1);
    }
    // 2. and 3. The Service's namespace, then the root's: the most specific host among
    // the rules they export, kept only when exported to the client.
    for ns in [svc.namespace.as_str(), client.root_namespace] {
        let exported: Vec<_> = in_ns(ns)
            .into_iter()
            .filter(|(r, _)| !r.private_only())
            .collect();
        let best = most_specific(&exported, svc);
        if let Some(found) = best.into_iter().find(|r| r.0.exported_to(client.namespace)) {
            return Some(&found.1);
        }
    }
    None
}

/// How specifically a rule's host matches a service (greater: more specific).
type HostRank = (u8, usize);

/// The rules among `rules` for the most specific host that matches `svc` (an exact
/// hostname over wildcards, a longer wildcard over a shorter one), in listed order.
fn most_specific<'r>(
    rules: &[&'r (DestinationRule, Resolved)],
    svc: &Service,
) -> Vec<&'r (DestinationRule, Resolved)> {
    let ranked: Vec<(HostRank, &'r (DestinationRule, Resolved))> = rules
        .iter()
        .filter_map(|r| Some((r.0.matches(svc)?, *r)))
        .collect();
    let Some(best) = ranked.iter().map(|(rank, _)| *rank).max() else {
        return Vec::new();
    };
    ranked
        .into_iter()
        .filter(|(rank, _)| *rank == best)
        .map(|(_, r)| r)
        .collect()
}

/// The policy for traffic from `client` to `port` of `svc` (or of its `subset`), if a rule has one.
pub fn for_service<'r>(
    rules: &'r [(DestinationRule, Resolved)],
    client: Client<'_>,
    svc: &Service,
    port: u16,
    subset: Option<&str>,
) -> Option<&'r Arc<Policy>> {
    rule_for(rules, client, svc)?.policy(subset, port)
}
