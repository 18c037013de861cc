//! L4 authorization (Istio's `istio.security.Authorization`).
//!
//! Semantics, as Istio's ztunnel (`src/rbac.rs`): a policy matches if any rule matches
//! (a policy without rules matches nothing); a rule is the AND of its clauses (a rule
//! without clauses matches everything); a clause is the OR of its matches (a clause
//! without matches holds); a match is the AND of its non-empty fields, and a match with
//! no field at all matches nothing: istiod sends one where a policy's rule had only HTTP
//! attributes (`to.operation.methods`), which L4 cannot see, so such a DENY is a no-op
//! here, not a deny-all. Any matching DENY denies; with no ALLOW policy in scope the
//! connection is allowed; otherwise one ALLOW must match. Names are compared as strings,
//! never as patterns. A source without an identity has no principal and no service
//! account (positive fields fail, negative ones hold) and the empty namespace, as in
//! Istio's ztunnel.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

pub use crate::cidr::Cidr;
use crate::identity::Identity;

pub mod field;
use field::{negative, positive};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum PolicyScope {
    Global,
    Namespace,
    WorkloadSelector,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum PolicyAction {
    Allow,
    Deny,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Authorization {
    pub name: String,
    pub namespace: String,
    pub scope: PolicyScope,
    pub action: PolicyAction,
    #[serde(default)]
    pub dry_run: bool,
    /// rules -> clauses -> matches
    #[serde(default)]
    pub rules: Vec<Vec<Vec<Match>>>,
    /// Set when istiod's resource could not be converted exactly: this is then the
    /// deny-all that stands in for it (see `deny_all`), and this says why.
    #[serde(skip)]
    pub unenforceable: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    #[serde(default)]
    pub namespaces: Vec<StringMatch>,
    #[serde(default)]
    pub not_namespaces: Vec<StringMatch>,
    #[serde(default)]
    pub principals: Vec<StringMatch>,
    #[serde(default)]
    pub not_principals: Vec<StringMatch>,
    #[serde(default)]
    pub source_ips: Vec<Cidr>,
    #[serde(default)]
    pub not_source_ips: Vec<Cidr>,
    #[serde(default)]
    pub destination_ips: Vec<Cidr>,
    #[serde(default)]
    pub not_destination_ips: Vec<Cidr>,
    #[serde(default)]
    pub destination_ports: Vec<u16>,
    #[serde(default)]
    pub not_destination_ports: Vec<u16>,
    #[serde(default)]
    pub service_accounts: Vec<ServiceAccountMatch>,
    #[serde(default)]
    pub not_service_accounts: Vec<ServiceAccountMatch>,
}

/// Written as a one-key map, as Istio does: `{Exact: x}`, `{Prefix: x}`, `{Suffix: x}`, `{Presence: {}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    /// Any non-empty value.
    Presence,
}

impl<'de> Deserialize<'de> for StringMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(rename = "Exact")]
            exact: Option<String>,
            #[serde(rename = "Prefix")]
            prefix: Option<String>,
            #[serde(rename = "Suffix")]
            suffix: Option<String>,
            #[serde(rename = "Presence")]
            presence: Option<serde::de::IgnoredAny>,
        }
        let raw = Raw::deserialize(d)?;
        let mut found = Vec::with_capacity(1);
        found.extend(raw.exact.map(StringMatch::Exact));
        found.extend(raw.prefix.map(StringMatch::Prefix));
        found.extend(raw.suffix.map(StringMatch::Suffix));
        found.extend(raw.presence.map(|_| StringMatch::Presence));
        match (found.pop(), found.is_empty()) {
            (Some(m), true) => Ok(m),
            _ => Err(serde::de::Error::custom(
                "a string match needs exactly one of Exact, Prefix, Suffix or Presence",
            )),
        }
    }
}

impl StringMatch {
    pub fn matches(&self, value: &str) -> bool {
        match self {
            StringMatch::Exact(s) => value == s,
            StringMatch::Prefix(s) => value.starts_with(s.as_str()),
            StringMatch::Suffix(s) => value.ends_with(s.as_str()),
            StringMatch::Presence => !value.is_empty(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceAccountMatch {
    pub namespace: String,
    pub service_account: String,
}

/// What L4 authorization knows about a connection.
#[derive(Clone, Debug)]
pub struct Connection {
    /// Peer identity from mTLS; `None` for plaintext clients. Shared with the HBONE
    /// connection it came over (an open connection's registration keeps this).
    pub src_identity: Option<std::sync::Arc<Identity>>,
    pub src_ip: IpAddr,
    /// The destination workload address and target port.
    pub dst: SocketAddr,
}

impl Match {
    /// No field set: istiod's stand-in for a rule's HTTP-only part.
    pub fn is_empty(&self) -> bool {
        let Match {
            namespaces,
            not_namespaces,
            principals,
            not_principals,
            source_ips,
            not_source_ips,
            destination_ips,
            not_destination_ips,
            destination_ports,
            not_destination_ports,
            service_accounts,
            not_service_accounts,
        } = self;
        namespaces.is_empty()
            && not_namespaces.is_empty()
            && principals.is_empty()
            && not_principals.is_empty()
            && source_ips.is_empty()
            && not_source_ips.is_empty()
            && destination_ips.is_empty()
            && not_destination_ips.is_empty()
            && destination_ports.is_empty()
            && not_destination_ports.is_empty()
            && service_accounts.is_empty()
            && not_service_accounts.is_empty()
    }

    /// Whether a non-empty match holds (the caller skips empty ones).
    fn matches(&self, conn: &Connection) -> bool {
        let id = conn.src_identity.as_deref();
        // Istio's ztunnel compares an anonymous peer's namespace as "" (so `Prefix: ""`
        // holds and `notNamespaces: [Exact: ""]` fails for it).
        let ns = Some(id.map_or("", |i| i.namespace.as_str()));
        let principal = id.map(|i| i.principal());
        let principal = principal.as_deref();

        // A missing principal or service account (no identity) fails a positive field and
        // passes a negative one.
        let (pos, neg) = (false, true);
        positive(&self.namespaces, ns, pos, |m, v| m.matches(v))
            && negative(&self.not_namespaces, ns, neg, |m, v| m.matches(v))
            && positive(&self.principals, principal, pos, |m, v| m.matches(v))
            && negative(&self.not_principals, principal, neg, |m, v| m.matches(v))
            && positive(&self.service_accounts, id, pos, sa_matches)
            && negative(&self.not_service_accounts, id, neg, sa_matches)
            && positive(&self.source_ips, Some(conn.src_ip), pos, |c, ip| {
                c.contains(ip)
            })
            && negative(&self.not_source_ips, Some(conn.src_ip), neg, |c, ip| {
                c.contains(ip)
            })
            && positive(&self.destination_ips, Some(conn.dst.ip()), pos, |c, ip| {
                c.contains(ip)
            })
            && negative(
                &self.not_destination_ips,
                Some(conn.dst.ip()),
                neg,
                |c, ip| c.contains(ip),
            )
            && positive(
                &self.destination_ports,
                Some(conn.dst.port()),
                pos,
                |p, v| *p == v,
            )
            && negative(
                &self.not_destination_ports,
                Some(conn.dst.port()),
                neg,
                |p, v| *p == v,
            )
    }
}

fn sa_matches(m: &ServiceAccountMatch, id: &Identity) -> bool {
    m.namespace == id.namespace && m.service_account == id.service_account
}

impl Authorization {
    /// `namespace/name`, the policy's resource name.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What stands in for a policy we cannot enforce exactly: a DENY of every connection
    /// in its scope. Dropping it instead would widen access (a lost DENY, or the only
    /// ALLOW in scope). A dry-run policy stays dry-run: it never decided anything.
    pub fn deny_all(
        namespace: &str,
        name: &str,
        scope: PolicyScope,
        dry_run: bool,
        reason: String,
    ) -> Authorization {
        Authorization {
            name: name.to_string(),
            namespace: namespace.to_string(),
            scope,
            action: PolicyAction::Deny,
            dry_run,
            // One rule without clauses matches every connection.
            rules: vec![Vec::new()],
            unenforceable: Some(reason),
        }
    }

    /// As Istio's ztunnel: no rules match nothing, a rule without clauses matches all,
    /// a clause without matches holds, an empty match is skipped (never holds).
    pub fn matches(&self, conn: &Connection) -> bool {
        self.rules.iter().any(|rule| {
            rule.iter().all(|clause| {
                clause.is_empty() || clause.iter().any(|m| !m.is_empty() && m.matches(conn))
            })
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// Denied; names the policy that denied, or says no ALLOW policy matched.
    Deny(DenyReason),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DenyReason {
    DenyPolicy(String),
    NoAllowMatch,
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DenyReason::DenyPolicy(p) => write!(f, "denied by DENY policy {p}"),
            DenyReason::NoAllowMatch => write!(f, "no ALLOW policy matched"),
        }
    }
}

/// Evaluates the policies in scope for the destination. Dry-run policies are logged, never enforced.
pub fn evaluate<'a>(
    policies: impl IntoIterator<Item = &'a Authorization>,
    conn: &Connection,
) -> Decision {
    let mut have_allow = false;
    let mut allowed = false;
    let mut denied_by = None;
    for p in policies {
        let m = p.matches(conn);
        if p.dry_run {
            tracing::info!(policy = %p.key(), action = ?p.action, matched = m, "dry-run policy evaluated");
            continue;
        }
        match p.action {
            PolicyAction::Deny if m => {
                denied_by.get_or_insert_with(|| p.key());
            }
            PolicyAction::Deny => {}
            PolicyAction::Allow => {
                have_allow = true;
                allowed |= m;
            }
        }
    }
    if let Some(p) = denied_by {
        Decision::Deny(DenyReason::DenyPolicy(p))
    } else if !have_allow || allowed {
        Decision::Allow
    } else {
        Decision::Deny(DenyReason::NoAllowMatch)
    }
}

#[cfg(test)]
mod tests;
