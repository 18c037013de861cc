//! Deciding a request under the policies that apply to its target (semantics in `authz`).

use std::net::IpAddr;

use super::model::{
    parse_key, parse_port, Action, AuthorizationPolicy, Condition, Key, Operation, Rule, Source,
};
use ztunnel::cidr::Cidr;
use ztunnel::identity::Identity;
use ztunnel::rbac::field::{negative, positive};

use crate::authn::{Claim, RequestAuth};
use crate::object::{applies, Target};

/// What a policy is checked against, for one request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// Verified peer identity (None if unknown).
    pub source_principal: Option<&'a Identity>,
    pub source_ip: IpAddr,
    pub destination_port: u16,
    /// Host / :authority as received (may include :port); empty when the request had none.
    pub host: &'a str,
    pub method: &'a str,
    /// Normalized (`path`), without the query.
    pub path: &'a str,
    pub headers: &'a http::HeaderMap,
    /// The request's verified JWT (RequestAuthentication), None without one.
    pub auth: Option<&'a RequestAuth>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// `ns/name` of the DENY policy that denied; None when denied for lack of an ALLOW match.
    pub denied_by: Option<String>,
    /// `ns/name` of every AUDIT policy that matched.
    pub audited_by: Vec<String>,
}

/// Decides a request under the policies that apply to its target (see `applies_to`).
pub fn evaluate<'p>(
    policies: impl IntoIterator<Item = &'p AuthorizationPolicy>,
    req: &Request,
) -> Verdict {
    let attrs = Attrs::new(req);
    let mut have_allow = false;
    let mut allow_matched = false;
    let mut denied_by = None;
    let mut audited_by = Vec::new();
    for p in policies {
        match p.action {
            Action::Deny => {
                if denied_by.is_none() && p.matches(&attrs) {
                    denied_by = Some(p.key());
                }
            }
            Action::Allow => {
                have_allow = true;
                allow_matched = allow_matched || p.matches(&attrs);
            }
            Action::Audit => {
                if p.matches(&attrs) {
                    audited_by.push(p.key());
                }
            }
            // Decided by the external authorizer (`custom_matches`, then `extauthz`).
            Action::Custom => {}
        }
    }
    let allowed = denied_by.is_none() && (!have_allow || allow_matched);
    Verdict {
        allowed,
        denied_by,
        audited_by,
    }
}

/// The CUSTOM policies among `policies` and, for each, whether it matches the request
/// (its rules read as a DENY's: doubt counts for the match, so for a check).
pub fn custom_matches<'p>(
    policies: impl IntoIterator<Item = &'p AuthorizationPolicy>,
    req: &Request,
) -> Vec<(&'p AuthorizationPolicy, bool)> {
    let attrs = Attrs::new(req);
    policies
        .into_iter()
        .filter(|p| p.action == Action::Custom)
        .map(|p| (p, p.matches(&attrs)))
        .collect()
}

impl AuthorizationPolicy {
    /// Whether the policy targets the request's service (a Service of the policy's own
    /// namespace), the waypoint's Gateway (from the Gateway's namespace), or, from the
    /// root namespace, the GatewayClass `istio-waypoint` (every waypoint), as Istio
    /// attaches policies to waypoints. A deny-all stand-in whose targets could not be
    /// placed covers what its namespace could target (`deny_all`).
    pub fn applies_to(&self, target: &Target) -> bool {
        applies(&self.namespace, &self.target_refs, self.unplaced, target)
    }

    fn matches(&self, a: &Attrs) -> bool {
        let pol = match self.action {
            Action::Allow => Polarity::Allow,
            Action::Deny | Action::Audit | Action::Custom => Polarity::Deny,
        };
        self.rules.iter().any(|r| r.matches(a, pol))
    }
}

impl Rule {
    fn matches(&self, a: &Attrs, pol: Polarity) -> bool {
        (self.from.is_empty() || self.from.iter().any(|f| f.source.matches(a, pol)))
            && (self.to.is_empty() || self.to.iter().any(|t| t.operation.matches(a, pol)))
            && self.when.iter().all(|c| c.holds(a, pol))
    }
}

impl Source {
    fn matches(&self, a: &Attrs, pol: Polarity) -> bool {
        let id = a.req.source_principal;
        let principal = a.principal.as_deref().map(str::as_bytes);
        let ns = id.map(|i| i.namespace.as_bytes());
        let string = |p: &String, v: &[u8]| wildcard_match(p, v, false);
        let ip = a.req.source_ip;
        let in_block = |b: &Cidr, ip: IpAddr| b.contains(ip);
        let sa = |p: &String, id: &Identity| service_account_match(p, id);
        let request_principal = a.req.auth.map(|r| r.principal.as_bytes());
        let missing = pol.if_missing();
        positive(&self.principals, principal, missing, string)
            && negative(&self.not_principals, principal, missing, string)
            && positive(&self.namespaces, ns, missing, string)
            && negative(&self.not_namespaces, ns, missing, string)
            && positive(&self.service_accounts, id, missing, sa)
            && negative(&self.not_service_accounts, id, missing, sa)
            && positive(&self.ip_blocks, Some(ip), missing, in_block)
            && negative(&self.not_ip_blocks, Some(ip), missing, in_block)
            && positive(&self.remote_ip_blocks, Some(ip), missing, in_block)
            && negative(&self.not_remote_ip_blocks, Some(ip), missing, in_block)
            // Without a token the request principal is known to be absent (authn
            // refused every bad one), not in doubt: Istio's `requestPrincipals` match
            // nothing and `notRequestPrincipals` everything, whatever the action.
            && positive(&self.request_principals, request_principal, false, string)
            && negative(&self.not_request_principals, request_principal, true, string)
    }
}

impl Operation {
    fn matches(&self, a: &Attrs, pol: Polarity) -> bool {
        // No Host / :authority is a missing attribute (fails closed), not an empty name
        // that every `notHosts` would let through.
        let host = (!a.host.is_empty()).then_some(a.host.as_bytes());
        let path = Some(a.req.path.as_bytes());
        let method = Some(a.req.method);
        let port = a.req.destination_port;
        let host_match = |p: &String, v: &[u8]| wildcard_match(p, v, true);
        let path_match = |p: &String, v: &[u8]| wildcard_match(p, v, false);
        let method_match = |p: &String, v: &str| p == v;
        let missing = pol.if_missing();
        positive(&self.hosts, host, missing, host_match)
            && negative(&self.not_hosts, host, missing, host_match)
            && ports_hold(&self.ports, port, false, pol)
            && ports_hold(&self.not_ports, port, true, pol)
            && positive(&self.methods, method, missing, method_match)
            && negative(&self.not_methods, method, missing, method_match)
            && positive(&self.paths, path, missing, path_match)
            && negative(&self.not_paths, path, missing, path_match)
    }
}

impl Condition {
    fn holds(&self, a: &Attrs, pol: Polarity) -> bool {
        // Only reachable without `validate`: an unknown key can't be checked, so it
        // fails closed.
        let Ok(key) = parse_key(&self.key) else {
            return pol == Polarity::Deny;
        };
        let string = |p: &String, v: &[u8]| wildcard_match(p, v, false);
        let missing = pol.if_missing();
        match key {
            Key::Header(name) => {
                let values = a.req.headers.get_all(name);
                let values = || values.iter().map(|v| v.as_bytes());
                header_values_hold(&self.values, values, pol)
                    && header_not_values_hold(&self.not_values, values, pol)
            }
            Key::SourceIp => {
                cidrs_hold(&self.values, a.req.source_ip, false, pol)
                    && cidrs_hold(&self.not_values, a.req.source_ip, true, pol)
            }
            Key::DestinationPort => {
                ports_hold(&self.values, a.req.destination_port, false, pol)
                    && ports_hold(&self.not_values, a.req.destination_port, true, pol)
            }
            Key::SourceNamespace => {
                let ns = a.req.source_principal.map(|i| i.namespace.as_bytes());
                positive(&self.values, ns, missing, string)
                    && negative(&self.not_values, ns, missing, string)
            }
            Key::SourcePrincipal => {
                let principal = a.principal.as_deref().map(str::as_bytes);
                positive(&self.values, principal, missing, string)
                    && negative(&self.not_values, principal, missing, string)
            }
            Key::AuthPrincipal => {
                let principal = a.req.auth.map(|r| r.principal.as_bytes());
                positive(&self.values, principal, false, string)
                    && negative(&self.not_values, principal, true, string)
            }
            Key::AuthAudiences => claim_holds(self, a.req.auth.map(|r| r.claim(&["aud"])), pol),
            Key::AuthPresenter => claim_holds(self, a.req.auth.map(|r| r.claim(&["azp"])), pol),
            Key::AuthClaim(path) => claim_holds(self, a.req.auth.map(|r| r.claim(&path)), pol),
        }
    }
}

/// A claim condition (Istio: `values` holds if one of the claim's strings matches one
/// pattern, `notValues` if none does). No token or no such claim: no strings. A claim
/// that is neither a string nor a list of strings is doubt, decided by the polarity.
fn claim_holds(c: &Condition, claim: Option<Claim>, pol: Polarity) -> bool {
    let values = match claim {
        None | Some(Claim::Missing) => Vec::new(),
        Some(Claim::Values(v)) => v,
        Some(Claim::Unsupported) => return pol == Polarity::Deny,
    };
    let any = |patterns: &[String]| {
        values.iter().any(|v| {
            patterns
                .iter()
                .any(|p| wildcard_match(p, v.as_bytes(), false))
        })
    };
    (c.values.is_empty() || any(&c.values)) && (c.not_values.is_empty() || !any(&c.not_values))
}

/// Which way doubt counts, so matching fails closed for the policy's action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Polarity {
    /// ALLOW: doubt counts against the match.
    Allow,
    /// DENY and AUDIT: doubt counts for the match.
    Deny,
}

impl Polarity {
    /// Whether a field holds when its attribute is missing from the request.
    fn if_missing(self) -> bool {
        self == Polarity::Deny
    }
}

/// Request attributes computed once per request.
struct Attrs<'r, 'a> {
    req: &'r Request<'a>,
    principal: Option<String>,
    /// Lowercase, without port or trailing dot.
    host: String,
}

impl<'r, 'a> Attrs<'r, 'a> {
    fn new(req: &'r Request<'a>) -> Self {
        Attrs {
            req,
            principal: req.source_principal.map(Identity::principal),
            host: normalize_host(req.host),
        }
    }
}

fn normalize_host(host: &str) -> String {
    let name = if host.starts_with('[') {
        // IPv6 literal: the port, if any, follows the ']'.
        host.find(']').map_or(host, |i| &host[..=i])
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

fn service_account_match(pattern: &str, id: &Identity) -> bool {
    pattern
        .split_once('/')
        .is_some_and(|(ns, sa)| ns == id.namespace && sa == id.service_account)
}

/// `values` on a header, each of its values matched alone (never joined): for DENY one
/// matching value is enough, for ALLOW every value must match and there must be one.
fn header_values_hold<'v, I: Iterator<Item = &'v [u8]>>(
    patterns: &[String],
    values: impl Fn() -> I,
    pol: Polarity,
) -> bool {
    let matches = |v: &[u8]| patterns.iter().any(|p| wildcard_match(p, v, false));
    patterns.is_empty()
        || match pol {
            Polarity::Deny => values().any(matches),
            Polarity::Allow => values().next().is_some() && values().all(matches),
        }
}

/// `notValues` on a header: for DENY it holds if the header is absent or one value
/// matches no pattern; for ALLOW only if no value matches any pattern.
fn header_not_values_hold<'v, I: Iterator<Item = &'v [u8]>>(
    patterns: &[String],
    values: impl Fn() -> I,
    pol: Polarity,
) -> bool {
    let matches = |v: &[u8]| patterns.iter().any(|p| wildcard_match(p, v, false));
    patterns.is_empty()
        || match pol {
            Polarity::Deny => values().next().is_none() || values().any(|v| !matches(v)),
            Polarity::Allow => !values().any(matches),
        }
}

/// `negate` for the `not*` form. An entry that doesn't parse (only without `validate`)
/// decides the field the fail-closed way.
fn ports_hold(list: &[String], port: u16, negate: bool, pol: Polarity) -> bool {
    let mut hit = false;
    for p in list {
        match parse_port(p) {
            Some(v) => hit |= v == port,
            None => return pol == Polarity::Deny,
        }
    }
    list.is_empty() || hit != negate
}

fn cidrs_hold(list: &[String], ip: IpAddr, negate: bool, pol: Polarity) -> bool {
    let mut hit = false;
    for c in list {
        match c.parse::<Cidr>() {
            Ok(b) => hit |= b.contains(ip),
            Err(_) => return pol == Polarity::Deny,
        }
    }
    list.is_empty() || hit != negate
}

/// Istio's string match: `*` any non-empty value, `abc*` prefix, `*abc` suffix, else exact.
fn wildcard_match(pattern: &str, value: &[u8], ignore_case: bool) -> bool {
    let eq = |a: &[u8], b: &[u8]| {
        if ignore_case {
            a.eq_ignore_ascii_case(b)
        } else {
            a == b
        }
    };
    if pattern == "*" {
        return !value.is_empty();
    }
    if let Some(suffix) = pattern.strip_prefix('*') {
        let s = suffix.as_bytes();
        return value.len() >= s.len() && eq(&value[value.len() - s.len()..], s);
    }
    if let Some(prefix) = pattern.strip_suffix('*') {
        let p = prefix.as_bytes();
        return value.len() >= p.len() && eq(&value[..p.len()], p);
    }
    eq(value, pattern.as_bytes())
}
