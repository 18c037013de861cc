//! Gateway API `TLSRoute` on a waypoint, as istiod converts it for a Service parent
//! (`convertTLSRoute`, `augmentTLSPortMatch`, `compatibleRoutesForHost`): one `tls` rule
//! per route rule, matching the route's `hostnames` as SNI hosts, which the waypoint
//! honours only when they come down to the Service's own hostname (`route::l4`). The
//! connection's TLS is passed through, never terminated.

use serde::Deserialize;

use super::l4::{L4Match, L4Route, L4Rule, SniHosts};
use super::model::{BackendRef, HttpRoute, RouteKind, RouteRule};
use crate::object::ObjectRef;

/// Bounds of the CRD (v1alpha2's are the loosest): config cannot grow without limit.
const MAX_HOSTNAMES: usize = 1024;
const MAX_RULES: usize = 16;
const MAX_BACKENDS: usize = 16;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TlsRoute {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub parent_refs: Vec<ObjectRef>,
    /// SNI hosts; required from `v1alpha3` on, optional in `v1alpha2`.
    #[serde(default)]
    pub hostnames: Vec<String>,
    pub rules: Vec<TlsRule>,
    /// Attaches to the cluster's default Gateways: none of them is a waypoint (ignored).
    #[serde(default)]
    pub use_default_gateways: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TlsRule {
    #[serde(default)]
    pub name: Option<String>,
    pub backend_refs: Vec<BackendRef>,
}

impl TlsRoute {
    /// Its L4 rules; errors name the field.
    pub fn to_l4(&self) -> Result<L4Route, String> {
        if self.rules.is_empty() || self.rules.len() > MAX_RULES {
            return Err(format!(
                "rules: 1 to {MAX_RULES} rules (found {})",
                self.rules.len()
            ));
        }
        if self.hostnames.len() > MAX_HOSTNAMES {
            return Err(format!("hostnames: at most {MAX_HOSTNAMES}"));
        }
        if let Some((i, h)) = self
            .hostnames
            .iter()
            .enumerate()
            .find(|(_, h)| !valid_hostname(h))
        {
            return Err(format!(
                "hostnames[{i}]: {h:?} is not a DNS name (a `*.` in front at most)"
            ));
        }
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.iter().enumerate() {
            if r.backend_refs.is_empty() || r.backend_refs.len() > MAX_BACKENDS {
                return Err(format!(
                    "rules[{i}].backendRefs: 1 to {MAX_BACKENDS} backends (where the connections go)"
                ));
            }
            if let Some(j) = r.backend_refs.iter().position(|b| !b.filters.is_empty()) {
                return Err(format!(
                    "rules[{i}].backendRefs[{j}].filters: a TLSRoute's backends have no filters"
                ));
            }
            rules.push(L4Rule {
                matches: vec![L4Match {
                    sni: SniHosts::Route(self.hostnames.clone()),
                    ..L4Match::default()
                }],
                rule: RouteRule {
                    name: r.name.clone(),
                    backend_refs: r.backend_refs.clone(),
                    ..RouteRule::default()
                },
            });
        }
        let meta = HttpRoute {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            parent_refs: self.parent_refs.clone(),
            kind: RouteKind::Tls,
            hostnames: Vec::new(),
            rules: rules.iter().map(|r| r.rule.clone()).collect(),
            export_to: Vec::new(),
        };
        // Parents and backends are checked as a TCPRoute's are.
        meta.validate()?;
        Ok(L4Route {
            meta: HttpRoute {
                rules: Vec::new(),
                ..meta
            },
            tls: rules,
            tcp: Vec::new(),
        })
    }
}

/// Gateway API's `Hostname`: DNS labels, optionally `*.` in front; no IP, no port.
fn valid_hostname(h: &str) -> bool {
    let name = h.strip_prefix("*.").unwrap_or(h);
    !name.is_empty()
        && h.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}
