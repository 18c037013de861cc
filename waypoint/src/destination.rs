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
//! wildcard; then the one listed first (`select`). Every field of Istio's proto is read
//! (`spec`); one the waypoint does not apply is refused when the rule loads, named (the
//! file is refused; in a cluster a stand-in fails the rule's host in its scope, `k8s`),
//! and one Istio's waypoint ignores is ignored. Connection settings: `connection`.

#[cfg(test)]
mod tests;

pub mod connection;
mod policy;
mod select;
pub mod spec;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use crate::extauthz::provider::parse_duration;
pub use connection::{Reuse, UpstreamProtocol};
pub use policy::{GeneratedCookie, OutlierConfig, Pick, Policy, Resolved, RetryShare};
pub use select::{for_service, rule_for, Client};
pub use spec::*;
pub use tls::{ClientTls, Origination, TlsTarget};

/// One traffic policy's four parts, as they merge (Istio's MergeTrafficPolicy).
#[derive(Clone, Copy, Default)]
struct Parts<'r> {
    load_balancer: Option<&'r LoadBalancer>,
    connection_pool: Option<&'r ConnectionPool>,
    outlier_detection: Option<&'r OutlierDetection>,
    tls: Option<&'r ClientTls>,
    /// Not port-level: a port's entry keeps the policy's (Istio's MergeTrafficPolicy).
    retry_budget: Option<&'r RetryBudget>,
    proxy_protocol: Option<&'r serde_json::Value>,
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
                retry_budget: tp.retry_budget.as_ref(),
                proxy_protocol: tp.proxy_protocol.as_ref(),
            };
            return (parts, true);
        }
        let parts = Parts {
            load_balancer: tp.load_balancer.as_ref(),
            connection_pool: tp.connection_pool.as_ref(),
            outlier_detection: tp.outlier_detection.as_ref(),
            tls: tp.tls.as_ref(),
            retry_budget: tp.retry_budget.as_ref(),
            proxy_protocol: tp.proxy_protocol.as_ref(),
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
            retry_budget: over.retry_budget.or(self.retry_budget),
            proxy_protocol: over.proxy_protocol.or(self.proxy_protocol),
        }
    }
}

impl DestinationRule {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
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
        p.pick = lb.pick().map_err(|e| format!("loadBalancer.{e}"))?;
        p.cookie = lb
            .generated_cookie()
            .map_err(|e| format!("loadBalancer.{e}"))?;
        lb.unapplied().map_err(|e| format!("loadBalancer.{e}"))?;
    }
    if let Some(od) = parts.outlier_detection {
        p.outlier = Some(od.settings().map_err(|e| format!("outlierDetection.{e}"))?);
    }
    if let Some(cp) = parts.connection_pool {
        if let Some(tcp) = &cp.tcp {
            p.max_connections = tcp.max_connections.filter(|n| *n > 0);
        }
        if let Some(http) = &cp.http {
            p.max_requests = http.http2_max_requests.filter(|n| *n > 0);
            p.max_retries = http.max_retries;
            p.max_pending = http.http1_max_pending_requests;
        }
        (p.reuse, p.protocol) =
            connection::settings(cp).map_err(|e| format!("connectionPool.{e}"))?;
    }
    if let Some(b) = parts.retry_budget {
        p.retry_budget = Some(b.share().map_err(|e| format!("retryBudget.{e}"))?);
    }
    if parts.proxy_protocol.is_some() {
        return Err(
            "proxyProtocol: the waypoint does not send PROXY protocol headers to endpoints \
                    (Istio's waypoint does); remove it to apply the rule"
                .into(),
        );
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
    /// The way endpoints are picked; None: Istio's default (the waypoint's `--lb-policy`).
    fn pick(&self) -> Result<Option<Pick>, String> {
        match (&self.simple, &self.consistent_hash) {
            (Some(_), Some(_)) => Err("simple: set either simple or consistentHash".into()),
            (Some(s), None) => match s.as_str() {
                "ROUND_ROBIN" => Ok(Some(Pick::RoundRobin)),
                "LEAST_REQUEST" | "LEAST_CONN" => Ok(Some(Pick::LeastRequest)),
                "UNSPECIFIED" => Ok(None),
                "RANDOM" => Ok(Some(Pick::Random)),
                // Envoy's ORIGINAL_DST: the waypoint would send to the address the client
                // dialled, which for a Service is its VIP, not an endpoint.
                "PASSTHROUGH" => Err("simple: PASSTHROUGH (send to the original destination) is not applied by \
                                      the waypoint, which sends to the Service's endpoints; use a ServiceEntry with \
                                      resolution NONE for traffic to pass through"
                    .into()),
                other => Err(format!(
                    "simple: {other:?} is not one of ROUND_ROBIN, LEAST_REQUEST, RANDOM, PASSTHROUGH"
                )),
            },
            (None, Some(h)) => h
                .pick()
                .map(Some)
                .map_err(|e| format!("consistentHash.{e}")),
            (None, None) => Ok(None),
        }
    }

    /// The cookie to give requests without one, for `consistentHash.httpCookie.ttl`.
    fn generated_cookie(&self) -> Result<Option<Arc<GeneratedCookie>>, String> {
        let Some(c) = self
            .consistent_hash
            .as_ref()
            .and_then(|h| h.http_cookie.as_ref())
        else {
            return Ok(None);
        };
        let Some(ttl) = &c.ttl else { return Ok(None) };
        let ttl = parse_duration(ttl).map_err(|e| format!("consistentHash.httpCookie.ttl: {e}"))?;
        let token = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
        };
        let value_ok = |s: &str| s.bytes().all(|b| b.is_ascii_graphic() && b != b';');
        if !token(&c.name) {
            return Err(format!(
                "consistentHash.httpCookie.name: {:?} is not a cookie name",
                c.name
            ));
        }
        if c.path.as_deref().is_some_and(|p| !value_ok(p)) {
            return Err("consistentHash.httpCookie.path: not a cookie path".into());
        }
        let mut attributes = Vec::new();
        for (i, a) in c.attributes.iter().enumerate() {
            if !token(&a.name) || a.value.as_deref().is_some_and(|v| !value_ok(v)) {
                return Err(format!(
                    "consistentHash.httpCookie.attributes[{i}]: not a cookie attribute"
                ));
            }
            attributes.push((a.name.clone(), a.value.clone()));
        }
        Ok(Some(Arc::new(GeneratedCookie {
            name: c.name.clone(),
            path: c.path.clone(),
            ttl,
            attributes,
        })))
    }

    /// What Istio's waypoint applies and this one does not: its Service's traffic fails.
    fn unapplied(&self) -> Result<(), String> {
        let disabled =
            |v: &serde_json::Value| v.get("enabled") == Some(&serde_json::Value::Bool(false));
        if self
            .locality_lb_setting
            .as_ref()
            .is_some_and(|v| !disabled(v))
        {
            return Err(
                "localityLbSetting: locality weights and failover are not applied by the waypoint \
                        (only `enabled: false`); remove it to apply the rule"
                    .into(),
            );
        }
        if self
            .zone_aware_lb_setting
            .as_ref()
            .is_some_and(|v| !disabled(v))
        {
            return Err(
                "zoneAwareLbSetting: not applied by the waypoint (only `enabled: false`); \
                        remove it to apply the rule"
                    .into(),
            );
        }
        // Istio gives the slow start to ROUND_ROBIN and LEAST_REQUEST (its default) only.
        let slow_start = matches!(
            self.simple.as_deref(),
            None | Some("ROUND_ROBIN" | "LEAST_REQUEST" | "LEAST_CONN" | "UNSPECIFIED")
        ) && self.consistent_hash.is_none();
        if slow_start && (self.warmup.is_some() || self.warmup_duration_secs.is_some()) {
            let field = if self.warmup.is_some() {
                "warmup"
            } else {
                "warmupDurationSecs"
            };
            return Err(format!(
                "{field}: the slow start of new endpoints is not applied by the waypoint; remove it to apply the rule"
            ));
        }
        Ok(())
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
        if self.ring_hash.is_some() && self.maglev.is_some() {
            return Err("ringHash: set either ringHash or maglev".into());
        }
        if let Some(h) = &self.http_header_name {
            return http::HeaderName::from_bytes(h.as_bytes())
                .map(Pick::HashHeader)
                .map_err(|_| format!("httpHeaderName: {h:?} is not a header name"));
        }
        if let Some(c) = &self.http_cookie {
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

impl RetryBudget {
    /// Istio's defaults: 20 %, at least 3.
    fn share(&self) -> Result<RetryShare, String> {
        let percent = self.percent.unwrap_or(20.0);
        if !(0.0..=100.0).contains(&percent) {
            return Err(format!("percent: {percent} is not between 0 and 100"));
        }
        if let Some(t) = &self.budget_interval {
            parse_duration(t).map_err(|e| format!("budgetInterval: {e}"))?;
        }
        Ok(RetryShare {
            basis_points: (percent * 100.0).round() as u32,
            min: self.min_retry_concurrency.filter(|n| *n > 0).unwrap_or(3),
        })
    }
}

impl OutlierDetection {
    /// Istio's defaults: 5 consecutive 5xx, 30 s. Gateway errors (502-504) count with the
    /// 5xx ones; with `splitExternalLocalOriginErrors`, connect failures, timeouts and
    /// resets count apart (`consecutiveLocalOriginFailures`, default 5) and not as 5xx.
    fn settings(&self) -> Result<OutlierConfig, String> {
        let n = self
            .consecutive_5xx_errors
            .or(self.consecutive_gateway_errors)
            .or(self.consecutive_errors)
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
        if self.min_health_percent.is_some_and(|p| p > 0) {
            return Err("minHealthPercent: Envoy's panic threshold is not applied by the waypoint (it sends to \
                        every endpoint only when all are ejected); remove it to apply the rule"
                .into());
        }
        let local_origin = (self.split_external_local_origin_errors == Some(true))
            .then(|| self.consecutive_local_origin_failures.unwrap_or(5));
        Ok(OutlierConfig {
            consecutive_5xx: n,
            base_ejection: base,
            local_origin,
        })
    }
}
