//! What a DestinationRule asks of the traffic to a Service, resolved: per port and subset,
//! the way endpoints are picked, outlier ejection, circuit-breaking limits, connection
//! settings, TLS origination, or why it cannot be applied.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::connection::{Reuse, UpstreamProtocol};
use super::tls::Origination;

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
    /// None: the waypoint's outlier flags. A `consecutive_5xx` of 0 turns ejection off.
    pub outlier: Option<OutlierConfig>,
    pub max_requests: Option<u32>,
    pub max_retries: Option<u32>,
    /// `retryBudget`: retries in flight allowed, in place of `max_retries`.
    pub retry_budget: Option<RetryShare>,
    pub max_connections: Option<u32>,
    /// Requests that may wait for one of `max_connections` HTTP/1.1 connections.
    pub max_pending: Option<u32>,
    /// How the Service's upstream connections are made and reused (`connection`).
    pub reuse: Reuse,
    /// `h2UpgradePolicy` / `useClientProtocol`; None: the port's protocol (and the mesh's
    /// `h2UpgradePolicy`).
    pub protocol: Option<UpstreamProtocol>,
    /// `consistentHash.httpCookie` with a `ttl`: the cookie given to a request without one.
    pub cookie: Option<Arc<GeneratedCookie>>,
    /// TLS from the waypoint to the endpoint (SIMPLE or MUTUAL).
    pub tls: Option<Arc<Origination>>,
    /// The rule, `namespace/name`, for logs.
    pub rule: String,
    /// Why the rule cannot be applied exactly: traffic it covers fails (503 `UF`) rather
    /// than go out other than it asks.
    pub refused: Option<String>,
}

/// Outlier ejection for a Service (a DestinationRule's `outlierDetection`, or the
/// waypoint's flags), as `lb` applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutlierConfig {
    /// 0 disables ejection.
    pub consecutive_5xx: u32,
    pub base_ejection: Duration,
    /// Envoy's `split_external_local_origin_errors`: connect failures, resets and
    /// timeouts count apart from the answers' 5xx, ejecting after this many in a row.
    /// None: they count as 5xx.
    pub local_origin: Option<u32>,
}

/// Envoy's retry budget: at any time, `max(min, percent% of the Service's requests in
/// flight)` retries may be in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryShare {
    /// Hundredths of a percent.
    pub basis_points: u32,
    pub min: u32,
}

impl RetryShare {
    /// The retries allowed with `in_flight` requests to the Service.
    pub fn allowed(&self, in_flight: usize) -> u32 {
        let share = (in_flight as u64 * self.basis_points as u64) / 10_000;
        (share.min(u32::MAX as u64) as u32).max(self.min)
    }
}

/// The cookie Envoy generates for a consistent hash on a cookie with a TTL: its value
/// names the client (a hash of its address), so the client's requests hash alike from
/// then on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedCookie {
    pub name: String,
    pub path: Option<String>,
    /// 0: a session cookie (no Max-Age).
    pub ttl: Duration,
    pub attributes: Vec<(String, Option<String>)>,
}

impl GeneratedCookie {
    /// The cookie's value for a client at `client` (Envoy: the hash of its address, hex).
    pub fn value_for(&self, client: std::net::SocketAddr) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        client.to_string().hash(&mut h);
        format!("{:016x}", h.finish())
    }

    /// The `Set-Cookie` value, as Envoy's `makeSetCookieValue` writes it.
    pub fn set_cookie(&self, value: &str) -> String {
        let mut out = format!("{}=\"{value}\"", self.name);
        if !self.ttl.is_zero() {
            out.push_str(&format!("; Max-Age={}", self.ttl.as_secs()));
        }
        if let Some(p) = self.path.as_deref().filter(|p| !p.is_empty()) {
            out.push_str(&format!("; Path={p}"));
        }
        for (k, v) in &self.attributes {
            match v.as_deref().filter(|v| !v.is_empty()) {
                Some(v) => out.push_str(&format!("; {k}={v}")),
                None => out.push_str(&format!("; {k}")),
            }
        }
        out.push_str("; HttpOnly");
        out
    }
}

/// Everything one rule asks for, per port and subset, resolved when it loads.
#[derive(Clone, Debug, Default)]
pub struct Resolved {
    /// (subset, port, policy): None for the Service itself or for any other port.
    pub(super) policies: Vec<(Option<String>, Option<u16>, Arc<Policy>)>,
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
