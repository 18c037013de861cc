//! Istio `AuthorizationPolicy` with `targetRefs`, enforced by the waypoint per request.
//!
//! Semantics (Istio): a policy matches if any rule matches; a rule matches when its
//! `from` (any source), `to` (any operation) and every `when` condition hold; inside a
//! source or operation every non-empty field must hold, a field holds if any value
//! matches and a `not*` field holds if none does. Any matching DENY denies; otherwise,
//! when ALLOW policies exist one must match; AUDIT policies only get reported.
//!
//! Values are Istio string matches (exact, `prefix*`, `*suffix`, `*` = non-empty),
//! compared as strings and never turned into regular expressions.
//!
//! Where the request leaves room for doubt (an attribute missing, a header sent several
//! times) matching fails closed through a polarity: for ALLOW the doubt counts against
//! the match, for DENY and AUDIT it counts for it. So an anonymous peer satisfies no
//! ALLOW field about identities (not even `notPrincipals`), and a repeated header must
//! match with every value to satisfy an ALLOW but with one value to trigger a DENY:
//! appending a value can neither sneak past an ALLOW nor dodge a DENY.

use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;

use super::{ParentRef, Target};
use crate::identity::Identity;
// One CIDR type for L4 and L7 policies, so both compare IPv4-mapped peers and rules alike.
use crate::rbac::Cidr;

const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
const SUPPORTED_KEYS: &str =
    "request.headers[<name>], source.ip, remote.ip, source.namespace, source.principal, destination.port";

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthorizationPolicy {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub target_refs: Vec<ParentRef>,
    #[serde(default)]
    pub action: Action,
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// Written as in Istio's CRD: `ALLOW`, `DENY`, `AUDIT`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Action {
    #[default]
    Allow,
    Deny,
    Audit,
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "ALLOW" => Ok(Action::Allow),
            "DENY" => Ok(Action::Deny),
            "AUDIT" => Ok(Action::Audit),
            "CUSTOM" => Err(serde::de::Error::custom(
                "action CUSTOM delegates to an external authorizer (ext-authz), which this waypoint does not support",
            )),
            _ => Err(serde::de::Error::custom(format!(
                "unknown action {s:?}: expected ALLOW, DENY or AUDIT (uppercase, as in Istio)"
            ))),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allow => "ALLOW",
            Action::Deny => "DENY",
            Action::Audit => "AUDIT",
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    pub from: Vec<From>,
    pub to: Vec<To>,
    pub when: Vec<Condition>,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct From {
    pub source: Source,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct To {
    pub operation: Operation,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Source {
    /// Peer identities without `spiffe://`: `td/ns/<ns>/sa/<sa>`.
    pub principals: Vec<String>,
    pub not_principals: Vec<String>,
    pub namespaces: Vec<String>,
    pub not_namespaces: Vec<String>,
    /// `<namespace>/<service account>`, exact.
    pub service_accounts: Vec<String>,
    pub not_service_accounts: Vec<String>,
    pub ip_blocks: Vec<Cidr>,
    pub not_ip_blocks: Vec<Cidr>,
    /// Same as `ipBlocks` here: the waypoint's source address is the original client's.
    pub remote_ip_blocks: Vec<Cidr>,
    pub not_remote_ip_blocks: Vec<Cidr>,
    /// Parsed only to be refused by `validate` with a clear message (needs JWT).
    pub request_principals: Vec<String>,
    pub not_request_principals: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Operation {
    /// Case-insensitive; the request's port and trailing dot are ignored.
    pub hosts: Vec<String>,
    pub not_hosts: Vec<String>,
    /// Port numbers written as strings, as in Istio.
    pub ports: Vec<String>,
    pub not_ports: Vec<String>,
    /// Exact and case-sensitive, as in Istio.
    pub methods: Vec<String>,
    pub not_methods: Vec<String>,
    /// Matched against the normalized path (see `l7::path`), without the query.
    pub paths: Vec<String>,
    pub not_paths: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Condition {
    pub key: String,
    #[serde(default)]
    pub values: Vec<String>,
    #[serde(default)]
    pub not_values: Vec<String>,
}

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
    /// Normalized (`l7::path`), without the query.
    pub path: &'a str,
    pub headers: &'a http::HeaderMap,
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
pub fn evaluate<'p>(policies: impl IntoIterator<Item = &'p AuthorizationPolicy>, req: &Request) -> Verdict {
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
        }
    }
    let allowed = denied_by.is_none() && (!have_allow || allow_matched);
    Verdict { allowed, denied_by, audited_by }
}

impl AuthorizationPolicy {
    /// `namespace/name`, the policy's resource name.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What stands in for a policy the waypoint cannot enforce exactly (CUSTOM, JWT
    /// fields, a condition it does not know...): a DENY of every request to what it
    /// targets, since dropping it would widen access. Each ref is taken wider (its port
    /// and sectionName dropped); if one cannot be placed (a kind we don't serve, another
    /// namespace, no name) the deny covers the whole waypoint, its Gateway `gateway`.
    pub fn deny_all(namespace: &str, name: &str, refs: &[ParentRef], gateway: &str) -> AuthorizationPolicy {
        let placed: Option<Vec<ParentRef>> = refs
            .iter()
            .map(|r| {
                let ok = ref_kind(r).is_some() && !r.name.is_empty() && r.namespace.as_deref().is_none_or(|ns| ns == namespace);
                ok.then(|| ParentRef { namespace: None, port: None, section_name: None, ..r.clone() })
            })
            .collect();
        let target_refs = match placed {
            Some(refs) if !refs.is_empty() => refs,
            _ => vec![ParentRef {
                group: Some(GATEWAY_GROUP.into()),
                kind: Some("Gateway".into()),
                name: gateway.into(),
                namespace: None,
                port: None,
                section_name: None,
            }],
        };
        AuthorizationPolicy {
            name: name.into(),
            namespace: namespace.into(),
            target_refs,
            action: Action::Deny,
            // A rule with no from, to or when matches every request.
            rules: vec![Rule::default()],
        }
    }

    /// Whether the policy targets the request's service or the waypoint's Gateway.
    pub fn applies_to(&self, target: &Target) -> bool {
        self.target_refs.iter().any(|r| {
            // `validate` rejects other namespaces; never let one widen the scope anyway.
            if r.namespace.as_deref().is_some_and(|ns| ns != self.namespace) {
                return false;
            }
            match ref_kind(r) {
                Some(RefKind::Service) => {
                    target.service.is_some_and(|s| s.name == r.name && s.namespace == self.namespace)
                }
                Some(RefKind::Gateway) => target.gateway.name == r.name && target.gateway.namespace == self.namespace,
                None => false,
            }
        })
    }

    /// The policy as it applies to opaque TCP, which has no HTTP attributes (Istio's
    /// rule): a DENY or AUDIT rule loses its HTTP-only fields, so it matches more
    /// (a client cannot dodge an HTTP deny by not speaking HTTP); an ALLOW rule that
    /// needs them is dropped, so it can never allow.
    pub fn for_tcp(&self) -> AuthorizationPolicy {
        let http_only_op = |o: &Operation| Operation { ports: o.ports.clone(), not_ports: o.not_ports.clone(), ..Default::default() };
        let rules = self
            .rules
            .iter()
            .filter_map(|r| {
                let needs_http = r.to.iter().any(|t| http_only_op(&t.operation) != t.operation)
                    || r.when.iter().any(|c| c.key.starts_with("request."));
                match (self.action, needs_http) {
                    (_, false) => Some(r.clone()),
                    (Action::Allow, true) => None,
                    (_, true) => Some(Rule {
                        from: r.from.clone(),
                        // An operation left with no field matches any connection.
                        to: r.to.iter().map(|t| To { operation: http_only_op(&t.operation) }).collect(),
                        when: r.when.iter().filter(|c| !c.key.starts_with("request.")).cloned().collect(),
                    }),
                }
            })
            .collect();
        AuthorizationPolicy { rules, ..self.clone() }
    }

    /// Checks what serde cannot. Errors start with the field path relative to the
    /// policy, e.g. `rules[0].to[1].operation.ports[0]: ...`.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name: must not be empty".into());
        }
        if self.namespace.is_empty() {
            return Err("namespace: must not be empty".into());
        }
        if self.target_refs.is_empty() {
            return Err("targetRefs: required: the waypoint enforces only policies that target its Gateway or a \
                        Service; policies without targetRefs belong in ztunnel's `policies` list"
                .into());
        }
        for (i, r) in self.target_refs.iter().enumerate() {
            validate_target_ref(r, &self.namespace).map_err(|e| format!("targetRefs[{i}].{e}"))?;
        }
        for (i, rule) in self.rules.iter().enumerate() {
            rule.validate(&format!("rules[{i}]"))?;
        }
        Ok(())
    }

    fn matches(&self, a: &Attrs) -> bool {
        let pol = match self.action {
            Action::Allow => Polarity::Allow,
            Action::Deny | Action::Audit => Polarity::Deny,
        };
        self.rules.iter().any(|r| r.matches(a, pol))
    }
}

enum RefKind {
    Service,
    Gateway,
}

/// Service is in the core group ("" or absent), Gateway in Gateway API's (or absent).
fn ref_kind(r: &ParentRef) -> Option<RefKind> {
    match (r.kind.as_deref(), r.group.as_deref()) {
        (Some("Service"), None | Some("")) => Some(RefKind::Service),
        (Some("Gateway"), None | Some(GATEWAY_GROUP)) => Some(RefKind::Gateway),
        _ => None,
    }
}

fn validate_target_ref(r: &ParentRef, namespace: &str) -> Result<(), String> {
    let kind = r.kind.as_deref().ok_or("kind: required (Service or Gateway)")?;
    match kind {
        "Service" | "Gateway" if ref_kind(r).is_none() => {
            let want = if kind == "Service" { "\"\"" } else { "\"gateway.networking.k8s.io\"" };
            let group = r.group.as_deref().unwrap_or_default();
            return Err(format!("group: {group:?} is wrong for kind {kind}, whose group is {want}"));
        }
        "Service" | "Gateway" => {}
        _ => {
            return Err(format!(
                "kind: {kind:?} is not supported: the waypoint enforces policies that target a Service or its Gateway"
            ))
        }
    }
    if r.name.is_empty() {
        return Err("name: must not be empty".into());
    }
    if let Some(ns) = r.namespace.as_deref().filter(|ns| *ns != namespace) {
        return Err(format!(
            "namespace: {ns:?} differs from the policy's namespace {namespace:?}; Istio requires targetRefs in the \
             policy's own namespace"
        ));
    }
    if r.port.is_some() {
        return Err("port: AuthorizationPolicy targetRefs have no port; use to.operation.ports".into());
    }
    if r.section_name.is_some() {
        return Err("sectionName: AuthorizationPolicy targetRefs have no sectionName".into());
    }
    Ok(())
}

impl Rule {
    fn validate(&self, at: &str) -> Result<(), String> {
        for (i, f) in self.from.iter().enumerate() {
            f.source.validate(&format!("{at}.from[{i}].source"))?;
        }
        for (i, t) in self.to.iter().enumerate() {
            t.operation.validate(&format!("{at}.to[{i}].operation"))?;
        }
        for (i, c) in self.when.iter().enumerate() {
            c.validate(&format!("{at}.when[{i}]"))?;
        }
        Ok(())
    }

    fn matches(&self, a: &Attrs, pol: Polarity) -> bool {
        (self.from.is_empty() || self.from.iter().any(|f| f.source.matches(a, pol)))
            && (self.to.is_empty() || self.to.iter().any(|t| t.operation.matches(a, pol)))
            && self.when.iter().all(|c| c.holds(a, pol))
    }
}

impl Source {
    fn validate(&self, at: &str) -> Result<(), String> {
        const JWT: &str = "needs JWT authentication (RequestAuthentication), which this waypoint does not support";
        if !self.request_principals.is_empty() {
            return Err(format!("{at}.requestPrincipals: requestPrincipals {JWT}"));
        }
        if !self.not_request_principals.is_empty() {
            return Err(format!("{at}.notRequestPrincipals: notRequestPrincipals {JWT}"));
        }
        if *self == Source::default() {
            return Err(format!("{at}: must set at least one field; to match any source, leave `from` out"));
        }
        let identity_fields = [&self.principals, &self.not_principals, &self.namespaces, &self.not_namespaces];
        if identity_fields.iter().any(|l| !l.is_empty())
            && !(self.service_accounts.is_empty() && self.not_service_accounts.is_empty())
        {
            return Err(format!("{at}: cannot set serviceAccounts with namespaces or principals (as in Istio)"));
        }
        for (field, list) in [("principals", &self.principals), ("notPrincipals", &self.not_principals)] {
            check_list(at, field, list, check_principal)?;
        }
        for (field, list) in [("namespaces", &self.namespaces), ("notNamespaces", &self.not_namespaces)] {
            check_list(at, field, list, check_wildcard)?;
        }
        for (field, list) in
            [("serviceAccounts", &self.service_accounts), ("notServiceAccounts", &self.not_service_accounts)]
        {
            check_list(at, field, list, check_service_account)?;
        }
        Ok(())
    }

    fn matches(&self, a: &Attrs, pol: Polarity) -> bool {
        let id = a.req.source_principal;
        let principal = a.principal.as_deref().map(str::as_bytes);
        let ns = id.map(|i| i.namespace.as_bytes());
        let string = |p: &String, v: &[u8]| wildcard_match(p, v, false);
        let ip = a.req.source_ip;
        let in_block = |b: &Cidr, ip: IpAddr| b.contains(ip);
        let sa = |p: &String, id: &Identity| service_account_match(p, id);
        positive(&self.principals, principal, pol, string)
            && negative(&self.not_principals, principal, pol, string)
            && positive(&self.namespaces, ns, pol, string)
            && negative(&self.not_namespaces, ns, pol, string)
            && positive(&self.service_accounts, id, pol, sa)
            && negative(&self.not_service_accounts, id, pol, sa)
            && positive(&self.ip_blocks, Some(ip), pol, in_block)
            && negative(&self.not_ip_blocks, Some(ip), pol, in_block)
            && positive(&self.remote_ip_blocks, Some(ip), pol, in_block)
            && negative(&self.not_remote_ip_blocks, Some(ip), pol, in_block)
            // Without JWT support the request principal is always missing; `validate`
            // refuses these fields, and unvalidated ones fail closed.
            && positive(&self.request_principals, None, pol, string)
            && negative(&self.not_request_principals, None, pol, string)
    }
}

impl Operation {
    fn validate(&self, at: &str) -> Result<(), String> {
        if *self == Operation::default() {
            return Err(format!("{at}: must set at least one field; to match any operation, leave `to` out"));
        }
        for (field, list) in [("hosts", &self.hosts), ("notHosts", &self.not_hosts)] {
            check_list(at, field, list, check_host)?;
        }
        for (field, list) in [("ports", &self.ports), ("notPorts", &self.not_ports)] {
            check_list(at, field, list, check_port)?;
        }
        for (field, list) in [("methods", &self.methods), ("notMethods", &self.not_methods)] {
            check_list(at, field, list, check_method)?;
        }
        for (field, list) in [("paths", &self.paths), ("notPaths", &self.not_paths)] {
            check_list(at, field, list, check_path)?;
        }
        Ok(())
    }

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
        positive(&self.hosts, host, pol, host_match)
            && negative(&self.not_hosts, host, pol, host_match)
            && ports_hold(&self.ports, port, false, pol)
            && ports_hold(&self.not_ports, port, true, pol)
            && positive(&self.methods, method, pol, method_match)
            && negative(&self.not_methods, method, pol, method_match)
            && positive(&self.paths, path, pol, path_match)
            && negative(&self.not_paths, path, pol, path_match)
    }
}

/// A supported `when` key.
enum Key<'a> {
    /// The header name as written; `HeaderMap` lookups by `&str` ignore case.
    Header(&'a str),
    SourceIp,
    DestinationPort,
    SourceNamespace,
    SourcePrincipal,
}

fn parse_key(key: &str) -> Result<Key<'_>, String> {
    if let Some(name) = key.strip_prefix("request.headers[").and_then(|k| k.strip_suffix(']')) {
        return match http::HeaderName::from_bytes(name.as_bytes()) {
            Ok(_) => Ok(Key::Header(name)),
            Err(_) => Err(format!("{name:?} in {key:?} is not a valid header name")),
        };
    }
    match key {
        // The waypoint's peer address is the original client's, so both name it.
        "source.ip" | "remote.ip" => Ok(Key::SourceIp),
        "destination.port" => Ok(Key::DestinationPort),
        "source.namespace" => Ok(Key::SourceNamespace),
        "source.principal" => Ok(Key::SourcePrincipal),
        _ => Err(format!("{key:?} is not supported; supported keys: {SUPPORTED_KEYS}")),
    }
}

impl Condition {
    fn validate(&self, at: &str) -> Result<(), String> {
        if self.key.is_empty() {
            return Err(format!("{at}.key: must not be empty"));
        }
        let key = parse_key(&self.key).map_err(|e| format!("{at}.key: {e}"))?;
        if self.values.is_empty() && self.not_values.is_empty() {
            return Err(format!("{at}: at least one of values or notValues must be set for key {:?}", self.key));
        }
        let check: fn(&str) -> Result<(), String> = match key {
            Key::Header(_) | Key::SourceNamespace => check_wildcard,
            Key::SourcePrincipal => check_principal,
            Key::SourceIp => |v| v.parse::<Cidr>().map(|_| ()),
            Key::DestinationPort => check_port,
        };
        check_list(at, "values", &self.values, check)?;
        check_list(at, "notValues", &self.not_values, check)
    }

    fn holds(&self, a: &Attrs, pol: Polarity) -> bool {
        // Only reachable without `validate`: an unknown key can't be checked, so it
        // fails closed.
        let Ok(key) = parse_key(&self.key) else {
            return pol == Polarity::Deny;
        };
        let string = |p: &String, v: &[u8]| wildcard_match(p, v, false);
        match key {
            Key::Header(name) => {
                let values = a.req.headers.get_all(name);
                let values = || values.iter().map(|v| v.as_bytes());
                header_values_hold(&self.values, values, pol) && header_not_values_hold(&self.not_values, values, pol)
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
                positive(&self.values, ns, pol, string) && negative(&self.not_values, ns, pol, string)
            }
            Key::SourcePrincipal => {
                let principal = a.principal.as_deref().map(str::as_bytes);
                positive(&self.values, principal, pol, string) && negative(&self.not_values, principal, pol, string)
            }
        }
    }
}

/// Which way doubt counts, so matching fails closed for the policy's action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Polarity {
    /// ALLOW: doubt counts against the match.
    Allow,
    /// DENY and AUDIT: doubt counts for the match.
    Deny,
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
        Attrs { req, principal: req.source_principal.map(Identity::principal), host: normalize_host(req.host) }
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

/// Empty list: no constraint. A missing attribute holds only for DENY; otherwise one
/// entry must match.
fn positive<M, V: Copy>(list: &[M], value: Option<V>, pol: Polarity, f: impl Fn(&M, V) -> bool) -> bool {
    list.is_empty() || value.map_or(pol == Polarity::Deny, |v| list.iter().any(|m| f(m, v)))
}

/// Empty list: no constraint. A missing attribute holds only for DENY; otherwise no
/// entry may match.
fn negative<M, V: Copy>(list: &[M], value: Option<V>, pol: Polarity, f: impl Fn(&M, V) -> bool) -> bool {
    list.is_empty() || value.map_or(pol == Polarity::Deny, |v| !list.iter().any(|m| f(m, v)))
}

fn service_account_match(pattern: &str, id: &Identity) -> bool {
    pattern.split_once('/').is_some_and(|(ns, sa)| ns == id.namespace && sa == id.service_account)
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
    let eq = |a: &[u8], b: &[u8]| if ignore_case { a.eq_ignore_ascii_case(b) } else { a == b };
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

fn parse_port(s: &str) -> Option<u16> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn check_list(
    at: &str,
    field: &str,
    list: &[String],
    check: impl Fn(&str) -> Result<(), String>,
) -> Result<(), String> {
    for (i, v) in list.iter().enumerate() {
        let r = if v.is_empty() { Err("must not be empty".to_string()) } else { check(v) };
        r.map_err(|e| format!("{at}.{field}[{i}]: {e}"))?;
    }
    Ok(())
}

fn check_wildcard(v: &str) -> Result<(), String> {
    let stars = v.matches('*').count();
    if stars == 0 || v == "*" || (stars == 1 && (v.starts_with('*') || v.ends_with('*'))) {
        return Ok(());
    }
    Err(format!(
        "{v:?}: a '*' may only be the whole value or its first or last character (Istio supports only exact, \
         prefix, suffix and presence matches)"
    ))
}

fn check_principal(v: &str) -> Result<(), String> {
    check_wildcard(v)?;
    if v.starts_with("spiffe://") {
        return Err(format!(
            "{v:?}: principals are written without the spiffe:// scheme, e.g. \"cluster.local/ns/default/sa/client\""
        ));
    }
    Ok(())
}

fn check_service_account(v: &str) -> Result<(), String> {
    match v.split_once('/') {
        Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') && !v.contains('*') => Ok(()),
        _ => Err(format!("{v:?} is not \"<namespace>/<service account>\" (matched exactly, without wildcards)")),
    }
}

fn check_host(v: &str) -> Result<(), String> {
    check_wildcard(v)?;
    if v.rsplit_once(':').is_some_and(|(_, port)| port.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!("{v:?}: the port in Host is ignored for matching; write the host alone and use ports"));
    }
    if v.ends_with('.') {
        return Err(format!("{v:?}: write the host without the trailing dot (the request's is ignored)"));
    }
    Ok(())
}

fn check_port(v: &str) -> Result<(), String> {
    parse_port(v).map(|_| ()).ok_or_else(|| format!("{v:?} is not a port number (0-65535)"))
}

fn check_method(v: &str) -> Result<(), String> {
    let token = v.bytes().next().is_some_and(|b| b.is_ascii_uppercase())
        && v.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if token {
        return Ok(());
    }
    Err(format!("{v:?} is not an uppercase HTTP method; methods match exactly and case-sensitively, e.g. \"GET\""))
}

/// Requests are matched after `l7::path::normalize`, so a path written any other way
/// could never match: refused rather than left to silently not match (which for a DENY
/// would be a bypass).
fn check_path(v: &str) -> Result<(), String> {
    if v.contains('{') || v.contains('}') {
        return Err(format!("{v:?}: path templates ({{*}}, {{**}}) are not supported"));
    }
    check_wildcard(v)?;
    if !(v.starts_with('/') || v.starts_with('*')) {
        return Err(format!("{v:?} must start with '/' or '*'"));
    }
    if v == "*" {
        return Ok(());
    }
    // A prefix or suffix is a partial path: complete it with a plain character so only
    // what normalization would really change shows up.
    let (probe, exact) = if let Some(suffix) = v.strip_prefix('*') {
        (format!("/x{suffix}"), false)
    } else if let Some(prefix) = v.strip_suffix('*') {
        (format!("{prefix}x"), false)
    } else {
        (v.to_string(), true)
    };
    match super::path::normalize(&probe) {
        Err(e) => Err(format!("{v:?} can never match: requests with such a path are refused ({e})")),
        Ok(n) if n == probe => Ok(()),
        Ok(n) if exact => {
            Err(format!("{v:?} is not in normalized form; requests are matched after normalization, so write {n:?}"))
        }
        Ok(_) => Err(format!(
            "{v:?} is not in normalized form (merged slashes, dot segments, percent escapes); requests are matched \
             after normalization, so it could never match"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l7::ObjectName;

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    struct File {
        authorization_policies: Vec<AuthorizationPolicy>,
    }

    fn parse(yaml: &str) -> Result<Vec<AuthorizationPolicy>, String> {
        serde_yaml::from_str::<File>(yaml).map(|f| f.authorization_policies).map_err(|e| e.to_string())
    }

    fn policy(yaml: &str) -> AuthorizationPolicy {
        let head = "name: p\nnamespace: default\ntargetRefs: [{kind: Service, group: \"\", name: echo}]\n";
        let p: AuthorizationPolicy = serde_yaml::from_str(&format!("{head}{yaml}")).unwrap();
        p.validate().unwrap();
        p
    }

    struct Req {
        id: Option<Identity>,
        ip: IpAddr,
        port: u16,
        host: String,
        method: String,
        path: String,
        headers: http::HeaderMap,
    }

    fn req() -> Req {
        Req {
            id: Some(Identity::new("cluster.local", "default", "client")),
            ip: "10.10.1.7".parse().unwrap(),
            port: 80,
            host: "echo.default.svc.cluster.local".into(),
            method: "GET".into(),
            path: "/".into(),
            headers: http::HeaderMap::new(),
        }
    }

    impl Req {
        fn id(mut self, id: Option<(&str, &str)>) -> Self {
            self.id = id.map(|(ns, sa)| Identity::new("cluster.local", ns, sa));
            self
        }
        fn ip(mut self, ip: &str) -> Self {
            self.ip = ip.parse().unwrap();
            self
        }
        fn port(mut self, port: u16) -> Self {
            self.port = port;
            self
        }
        fn host(mut self, host: &str) -> Self {
            self.host = host.into();
            self
        }
        fn method(mut self, method: &str) -> Self {
            self.method = method.into();
            self
        }
        fn path(mut self, path: &str) -> Self {
            self.path = path.into();
            self
        }
        fn header(mut self, name: &'static str, value: &[u8]) -> Self {
            self.headers.append(name, http::HeaderValue::from_bytes(value).unwrap());
            self
        }
        fn verdict(&self, policies: &[&AuthorizationPolicy]) -> Verdict {
            let r = Request {
                source_principal: self.id.as_ref(),
                source_ip: self.ip,
                destination_port: self.port,
                host: &self.host,
                method: &self.method,
                path: &self.path,
                headers: &self.headers,
            };
            evaluate(policies.iter().copied(), &r)
        }
        fn allowed(&self, policies: &[&AuthorizationPolicy]) -> bool {
            self.verdict(policies).allowed
        }
    }

    const EXAMPLE: &str = r#"
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/default/sa/client", "*/sa/admin"]
        notPrincipals: ["cluster.local/ns/default/sa/root"]
        namespaces: [default]
        notNamespaces: [kube-system]
        ipBlocks: ["10.10.1.0/24", "10.10.2.5"]
        notIpBlocks: ["10.10.1.128/25"]
        remoteIpBlocks: ["fd00::/8"]
        notRemoteIpBlocks: ["fd00::1"]
    - source:
        serviceAccounts: ["default/client"]
        notServiceAccounts: ["default/other"]
    to:
    - operation:
        hosts: ["echo.default.svc.cluster.local", "*.example.com"]
        notHosts: ["internal.example.com"]
        ports: ["80"]
        notPorts: ["9090"]
        methods: ["GET"]
        notMethods: ["DELETE"]
        paths: ["/admin", "/admin/*", "*/info"]
        notPaths: ["/admin/public"]
    when:
    - key: request.headers[x-token]
      values: ["secret"]
      notValues: ["public"]
    - key: source.ip
      values: ["10.10.1.0/24"]
    - key: remote.ip
      notValues: ["10.10.9.9"]
    - key: source.namespace
      values: ["default"]
    - key: source.principal
      values: ["cluster.local/*"]
    - key: destination.port
      values: ["80"]
- name: gw
  namespace: default
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  rules: [{}]
"#;

    #[test]
    fn parses_example() {
        let ps = parse(EXAMPLE).unwrap();
        assert_eq!(ps.len(), 2);
        for p in &ps {
            p.validate().unwrap();
        }
        let p = &ps[0];
        assert_eq!(p.key(), "default/deny-admin");
        assert_eq!(p.action, Action::Deny);
        let src = &p.rules[0].from[0].source;
        assert_eq!(src.ip_blocks, vec!["10.10.1.0/24".parse().unwrap(), "10.10.2.5/32".parse().unwrap()]);
        assert_eq!(src.remote_ip_blocks[0].0, "fd00::/8".parse::<ipnet::IpNet>().unwrap());
        assert_eq!(p.rules[0].to[0].operation.paths, ["/admin", "/admin/*", "*/info"]);
        assert_eq!(p.rules[0].when.len(), 6);
        assert_eq!(ps[1].action, Action::Allow, "ALLOW is the default");
    }

    #[test]
    fn rejected_when_loading() {
        let base =
            "authorizationPolicies:\n- name: p\n  namespace: default\n  targetRefs: [{kind: Service, name: echo}]\n";
        let cases = [
            (
                "  rules:\n  - from:\n    - source:\n        ipBlocks: [\"10.0.0.1\", \"10.0.0.300\"]\n",
                // serde_yaml names the list, not the element; line and column point at it.
                "authorizationPolicies[0].rules[0].from[0].source.ipBlocks: invalid IP or CIDR \"10.0.0.300\": expected e.g. \"10.0.0.0/8\" or \"10.1.2.3\" at line 8 column 19",
            ),
            ("  action: CUSTOM\n", "authorizationPolicies[0]: action CUSTOM delegates to an external authorizer"),
            ("  action: Deny\n", "authorizationPolicies[0]: unknown action \"Deny\""),
            ("  selector: {matchLabels: {app: echo}}\n", "authorizationPolicies[0]: unknown field `selector`"),
            ("  rules:\n  - to: [{operation: {path: [\"/a\"]}}]\n", "authorizationPolicies[0].rules[0].to[0].operation: unknown field `path`"),
            ("  rules:\n  - from: [{}]\n", "authorizationPolicies[0].rules[0].from[0]: missing field `source`"),
        ];
        for (extra, want) in cases {
            let err = parse(&format!("{base}{extra}")).unwrap_err();
            assert!(err.starts_with(want), "{extra}: {err}");
        }
    }

    #[test]
    fn validation_errors() {
        let ok_ref = "targetRefs: [{kind: Service, name: echo}]";
        let cases: &[(&str, &str)] = &[
            ("name: ''\nnamespace: default\ntargetRefs: [{kind: Service, name: echo}]", "name: must not be empty"),
            ("name: p\nnamespace: ''\ntargetRefs: [{kind: Service, name: echo}]", "namespace: must not be empty"),
            ("name: p\nnamespace: default", "targetRefs: required"),
            ("name: p\nnamespace: default\ntargetRefs: []", "targetRefs: required"),
            ("name: p\nnamespace: default\ntargetRefs: [{name: echo}]", "targetRefs[0].kind: required"),
            (
                "name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a}, {kind: ServiceEntry, group: networking.istio.io, name: x}]",
                "targetRefs[1].kind: \"ServiceEntry\" is not supported",
            ),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, group: apps, name: a}]", "targetRefs[0].group:"),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Gateway, group: example.com, name: a}]", "targetRefs[0].group:"),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Gateway, group: '', name: a}]", "targetRefs[0].group: \"\" is wrong for kind Gateway"),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a, namespace: other}]", "targetRefs[0].namespace:"),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a, port: 80}]", "targetRefs[0].port:"),
            ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: ''}]", "targetRefs[0].name: must not be empty"),
        ];
        for (yaml, want) in cases {
            let p: AuthorizationPolicy = serde_yaml::from_str(yaml).unwrap();
            let err = p.validate().unwrap_err();
            assert!(err.starts_with(want), "{yaml}: {err}");
        }
        let rule_cases: &[(&str, &str)] = &[
            ("from: [{source: {requestPrincipals: ['*']}}]", "rules[0].from[0].source.requestPrincipals: requestPrincipals needs JWT authentication (RequestAuthentication), which this waypoint does not support"),
            ("from: [{source: {notRequestPrincipals: ['*']}}]", "rules[0].from[0].source.notRequestPrincipals: notRequestPrincipals needs JWT"),
            ("from: [{source: {}}]", "rules[0].from[0].source: must set at least one field"),
            ("from: [{source: {principals: ['']}}]", "rules[0].from[0].source.principals[0]: must not be empty"),
            ("from: [{source: {principals: [a, 'cluster.local/ns/*/sa/admin']}}]", "rules[0].from[0].source.principals[1]: \"cluster.local/ns/*/sa/admin\": a '*' may only"),
            ("from: [{source: {notPrincipals: ['spiffe://cluster.local/ns/a/sa/b']}}]", "rules[0].from[0].source.notPrincipals[0]:"),
            ("from: [{source: {namespaces: ['*a*']}}]", "rules[0].from[0].source.namespaces[0]:"),
            ("from: [{source: {serviceAccounts: [client]}}]", "rules[0].from[0].source.serviceAccounts[0]: \"client\" is not"),
            ("from: [{source: {notServiceAccounts: ['default/*']}}]", "rules[0].from[0].source.notServiceAccounts[0]:"),
            ("from: [{source: {serviceAccounts: [default/a], namespaces: [default]}}]", "rules[0].from[0].source: cannot set serviceAccounts"),
            ("to: [{operation: {}}]", "rules[0].to[0].operation: must set at least one field"),
            ("to: [{operation: {ports: ['80']}}, {operation: {ports: ['http']}}]", "rules[0].to[1].operation.ports[0]: \"http\" is not a port"),
            ("to: [{operation: {notPorts: ['70000']}}]", "rules[0].to[0].operation.notPorts[0]:"),
            ("to: [{operation: {methods: [get]}}]", "rules[0].to[0].operation.methods[0]: \"get\" is not an uppercase HTTP method"),
            ("to: [{operation: {notMethods: ['*']}}]", "rules[0].to[0].operation.notMethods[0]:"),
            ("to: [{operation: {hosts: ['echo:80']}}]", "rules[0].to[0].operation.hosts[0]: \"echo:80\": the port"),
            ("to: [{operation: {notHosts: ['a.*.com']}}]", "rules[0].to[0].operation.notHosts[0]:"),
            ("to: [{operation: {paths: [admin]}}]", "rules[0].to[0].operation.paths[0]: \"admin\" must start with '/' or '*'"),
            ("to: [{operation: {paths: ['/a/*/b']}}]", "rules[0].to[0].operation.paths[0]:"),
            ("to: [{operation: {paths: ['/a/{*}/b']}}]", "rules[0].to[0].operation.paths[0]: \"/a/{*}/b\": path templates"),
            ("to: [{operation: {paths: ['/a//b']}}]", "rules[0].to[0].operation.paths[0]: \"/a//b\" is not in normalized form; requests are matched after normalization, so write \"/a/b\""),
            ("to: [{operation: {paths: ['/%61dmin']}}]", "rules[0].to[0].operation.paths[0]: \"/%61dmin\" is not in normalized form"),
            ("to: [{operation: {notPaths: ['/a/../b*']}}]", "rules[0].to[0].operation.notPaths[0]:"),
            ("to: [{operation: {paths: ['*/./info']}}]", "rules[0].to[0].operation.paths[0]:"),
            ("to: [{operation: {paths: ['/a%2Fb']}}]", "rules[0].to[0].operation.paths[0]: \"/a%2Fb\" can never match"),
            ("when: [{key: 'request.auth.claims[iss]', values: [x]}]", "rules[0].when[0].key: \"request.auth.claims[iss]\" is not supported; supported keys: request.headers[<name>], source.ip"),
            ("when: [{key: connection.sni, values: [x]}]", "rules[0].when[0].key: \"connection.sni\" is not supported"),
            ("when: [{key: 'request.headers[a b]', values: [x]}]", "rules[0].when[0].key: \"a b\""),
            ("when: [{key: '', values: [x]}]", "rules[0].when[0].key: must not be empty"),
            ("when: [{key: source.ip}]", "rules[0].when[0]: at least one of values or notValues"),
            ("when: [{key: source.ip, values: ['10.0.0.300']}]", "rules[0].when[0].values[0]: invalid IP or CIDR \"10.0.0.300\""),
            ("when: [{key: destination.port, notValues: ['80', x]}]", "rules[0].when[0].notValues[1]:"),
            ("when: [{key: 'request.headers[x]', values: ['']}]", "rules[0].when[0].values[0]: must not be empty"),
            ("when: [{key: 'request.headers[x]', values: ['a*b']}]", "rules[0].when[0].values[0]:"),
        ];
        for (rule, want) in rule_cases {
            let yaml = format!("name: p\nnamespace: default\n{ok_ref}\nrules:\n- {rule}");
            let p: AuthorizationPolicy = serde_yaml::from_str(&yaml).unwrap();
            let err = p.validate().unwrap_err();
            assert!(err.starts_with(want), "{rule}: {err}");
        }
    }

    #[test]
    fn validation_accepts() {
        for rules in [
            "rules: []",
            "rules: [{}]",
            "rules: [{from: [], to: [], when: []}]",
            "rules: [{to: [{operation: {paths: ['*', '/', '/admin*', '/admin/*', '*/info', '*.json', '/a/.well-known*']}}]}]",
            "rules: [{to: [{operation: {methods: [GET, M-SEARCH], hosts: ['*', '*.example.com', 'echo*', '[::1]']}}]}]",
            "rules: [{when: [{key: 'request.headers[X-Token]', values: ['*'], notValues: [a*, '*b']}]}]",
        ] {
            policy(rules);
        }
        // serde_yaml reads a plain scalar as a string, so unquoted ports work too.
        let p = policy("rules: [{to: [{operation: {ports: [80, '8080']}}]}]");
        assert_eq!(p.rules[0].to[0].operation.ports, ["80", "8080"]);
    }

    #[test]
    fn applies_to() {
        let ps = parse(EXAMPLE).unwrap();
        let gw = ObjectName { namespace: "default".into(), name: "waypoint".into() };
        let echo = ObjectName { namespace: "default".into(), name: "echo".into() };
        let other_ns = ObjectName { namespace: "prod".into(), name: "echo".into() };
        let other_gw = ObjectName { namespace: "prod".into(), name: "waypoint".into() };
        let t = |gateway, service| Target { gateway, service, port: 80 };
        assert!(ps[0].applies_to(&t(&gw, Some(&echo))));
        assert!(!ps[0].applies_to(&t(&gw, Some(&other_ns))));
        assert!(!ps[0].applies_to(&t(&gw, None)));
        assert!(ps[1].applies_to(&t(&gw, None)));
        assert!(ps[1].applies_to(&t(&gw, Some(&other_ns))));
        assert!(!ps[1].applies_to(&t(&other_gw, Some(&echo))));
    }

    #[test]
    fn applies_to_refs() {
        let gw = ObjectName { namespace: "default".into(), name: "waypoint".into() };
        let echo = ObjectName { namespace: "default".into(), name: "echo".into() };
        let t = Target { gateway: &gw, service: Some(&echo), port: 80 };
        let p = |refs: &str| -> AuthorizationPolicy {
            serde_yaml::from_str(&format!("name: p\nnamespace: default\ntargetRefs: {refs}")).unwrap()
        };
        assert!(p("[{kind: Gateway, name: waypoint}]").applies_to(&t));
        assert!(p("[{kind: Service, name: echo, namespace: default}]").applies_to(&t));
        assert!(p("[{kind: Service, name: other}, {kind: Service, name: echo}]").applies_to(&t));
        assert!(!p("[{kind: Service, name: echo, namespace: prod}]").applies_to(&t));
        assert!(!p("[{kind: Gateway, name: echo}]").applies_to(&t));
        assert!(!p("[{kind: Service, name: waypoint}]").applies_to(&t));
        assert!(!p("[{kind: ServiceEntry, group: networking.istio.io, name: echo}]").applies_to(&t));
        assert!(!p("[{name: echo}]").applies_to(&t));
    }

    /// The policies of the waypoint end-to-end test (tests/waypoint.rs).
    #[test]
    fn e2e_policies() {
        let ps = parse(
            r#"
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - to: [{operation: {ports: ["80"], paths: ["/admin", "/admin/*"]}}]
  - to: [{operation: {ports: ["80"], methods: ["DELETE"]}}]
  - to: [{operation: {ports: ["80"]}}]
    when: [{key: "request.headers[x-block]", values: ["yes"]}]
- name: allow-client
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: ALLOW
  rules:
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {notPaths: ["/admin-only"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {ports: ["9000"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/admin"]}}]
"#,
        )
        .unwrap();
        for p in &ps {
            p.validate().unwrap();
        }
        let all: Vec<&AuthorizationPolicy> = ps.iter().collect();
        assert!(req().path("/hello").allowed(&all));
        let v = req().path(&crate::l7::path::normalize("/x/%2e%2e/admin").unwrap()).verdict(&all);
        assert_eq!(v.denied_by.as_deref(), Some("default/deny-admin"));
        assert!(!req().path("/admin/x").allowed(&all));
        assert!(req().port(8080).path("/admin").allowed(&all), "the DENY rules name port 80");
        assert!(!req().method("DELETE").allowed(&all));
        assert!(!req().header("x-block", b"no").header("x-block", b"yes").allowed(&all));
        let v = req().path("/admin-only").verdict(&all);
        assert_eq!(v, Verdict { allowed: false, denied_by: None, audited_by: vec![] });
        assert!(req().port(9000).path("/admin-only").allowed(&all));
        assert!(req().id(Some(("default", "admin"))).path("/admin-only").allowed(&all));
        assert!(!req().id(Some(("default", "other"))).allowed(&all));
        // Opaque TCP: the DENY rules keep only their ports (port 80 is denied outright),
        // and the ALLOW rules that need paths are gone (port 9000 stays allowed).
        let tcp: Vec<AuthorizationPolicy> = ps.iter().map(AuthorizationPolicy::for_tcp).collect();
        let tcp: Vec<&AuthorizationPolicy> = tcp.iter().collect();
        let opaque = |port: u16, sa: &str| req().id(Some(("default", sa))).port(port).method("").path("").host("").allowed(&tcp);
        assert!(!opaque(80, "client"), "HTTP-only DENY fields must not let TCP through");
        assert!(opaque(9000, "client"));
        assert!(!opaque(8080, "client"), "the client's other ALLOW rule needs HTTP");
        assert!(!opaque(80, "admin") && opaque(8080, "admin"));
    }

    #[test]
    fn deny_by_path_and_method() {
        let deny = policy("action: DENY\nrules:\n- to: [{operation: {paths: ['/admin', '/admin/*']}}]\n- to: [{operation: {methods: [DELETE]}}]");
        let v = req().path("/admin").verdict(&[&deny]);
        assert_eq!(v, Verdict { allowed: false, denied_by: Some("default/p".into()), audited_by: vec![] });
        assert!(!req().path("/admin/x/y").allowed(&[&deny]));
        assert!(req().path("/administrator").allowed(&[&deny]), "'/admin/*' is the prefix '/admin/'");
        assert!(req().path("/x").allowed(&[&deny]));
        assert!(!req().method("DELETE").allowed(&[&deny]));
        assert!(req().method("delete").allowed(&[&deny]), "methods are case-sensitive, as in Istio");
    }

    #[test]
    fn allow_principal_only() {
        let allow = policy("rules:\n- from: [{source: {principals: ['cluster.local/ns/default/sa/client']}}]");
        assert_eq!(req().verdict(&[&allow]), Verdict { allowed: true, denied_by: None, audited_by: vec![] });
        assert_eq!(
            req().id(Some(("default", "other"))).verdict(&[&allow]),
            Verdict { allowed: false, denied_by: None, audited_by: vec![] }
        );
        // A dot in a principal is a dot, never a regex wildcard.
        assert!(!req().id(Some(("defaultX", "client"))).allowed(&[&allow]));
    }

    #[test]
    fn decisions_without_and_with_allow() {
        assert!(req().allowed(&[]), "no policy: allowed");
        let deny = policy("action: DENY\nrules: [{to: [{operation: {paths: ['/admin']}}]}]");
        assert!(req().allowed(&[&deny]), "no ALLOW policy and no DENY match: allowed");
        let allow = policy("rules: [{to: [{operation: {paths: ['/public*']}}]}]");
        assert!(!req().path("/x").allowed(&[&deny, &allow]), "an ALLOW exists but none matches");
        assert!(req().path("/public/a").allowed(&[&deny, &allow]));
        let allow_nothing = policy("rules: []");
        assert!(!req().allowed(&[&allow_nothing]), "ALLOW without rules matches nothing");
        let deny_nothing = policy("action: DENY\nrules: []");
        assert!(req().allowed(&[&deny_nothing]));
        let allow_all = policy("rules: [{}]");
        assert!(req().allowed(&[&allow_all]));
        let deny_all = policy("action: DENY\nrules: [{}]");
        assert!(!req().allowed(&[&allow_all, &deny_all]), "DENY wins over ALLOW");
    }

    #[test]
    fn audit_does_not_decide() {
        let audit = policy("action: AUDIT\nrules: [{to: [{operation: {paths: ['/secret*']}}]}]");
        let v = req().path("/secret/x").verdict(&[&audit]);
        assert_eq!(v, Verdict { allowed: true, denied_by: None, audited_by: vec!["default/p".into()] });
        assert_eq!(req().path("/x").verdict(&[&audit]).audited_by, Vec::<String>::new());
        let allow = policy("rules: [{to: [{operation: {paths: ['/public']}}]}]");
        let v = req().path("/secret/x").verdict(&[&audit, &allow]);
        assert!(!v.allowed, "an AUDIT match doesn't allow");
        assert_eq!(v.audited_by, ["default/p"]);
    }

    #[test]
    fn not_forms() {
        let allow = policy(
            "rules:\n- from: [{source: {notNamespaces: [kube-system], notPrincipals: ['*/sa/evil']}}]\n  to: [{operation: {notPaths: ['/admin*'], notMethods: [DELETE], notPorts: ['9090'], notHosts: ['*.internal']}}]",
        );
        assert!(req().allowed(&[&allow]));
        assert!(!req().id(Some(("kube-system", "x"))).allowed(&[&allow]));
        assert!(!req().id(Some(("default", "evil"))).allowed(&[&allow]));
        assert!(!req().path("/admin/x").allowed(&[&allow]));
        assert!(!req().method("DELETE").allowed(&[&allow]));
        assert!(!req().port(9090).allowed(&[&allow]));
        assert!(!req().host("db.internal:80").allowed(&[&allow]));
        let sa = policy("rules: [{from: [{source: {notServiceAccounts: [default/evil]}}]}]");
        assert!(req().allowed(&[&sa]));
        assert!(!req().id(Some(("default", "evil"))).allowed(&[&sa]));
        let sa = policy("rules: [{from: [{source: {serviceAccounts: [default/client]}}]}]");
        assert!(req().allowed(&[&sa]));
        assert!(!req().id(Some(("other", "client"))).allowed(&[&sa]));
    }

    #[test]
    fn ip_blocks() {
        let allow = policy(
            "rules: [{from: [{source: {ipBlocks: ['10.10.1.0/24', '10.10.2.5'], notIpBlocks: ['10.10.1.128/25']}}]}]",
        );
        assert!(req().ip("10.10.1.7").allowed(&[&allow]));
        assert!(req().ip("10.10.2.5").allowed(&[&allow]));
        assert!(req().ip("::ffff:10.10.2.5").allowed(&[&allow]), "IPv4-mapped peers compare as IPv4");
        assert!(!req().ip("10.10.2.6").allowed(&[&allow]));
        assert!(!req().ip("10.10.1.200").allowed(&[&allow]));
        let deny = policy("action: DENY\nrules: [{from: [{source: {remoteIpBlocks: ['192.168.0.0/16']}}]}]");
        assert!(!req().ip("::ffff:192.168.3.4").allowed(&[&deny]));
        assert!(req().ip("10.0.0.1").allowed(&[&deny]));
        let when = policy(
            "rules: [{when: [{key: source.ip, values: ['10.10.0.0/16']}, {key: remote.ip, notValues: ['10.10.9.9']}]}]",
        );
        assert!(req().ip("10.10.3.3").allowed(&[&when]));
        assert!(!req().ip("10.10.9.9").allowed(&[&when]));
        assert!(!req().ip("10.11.0.1").allowed(&[&when]));
    }

    #[test]
    fn ipv4_mapped_ip_blocks_match_ipv4_peers() {
        // `::ffff:10.0.0.0/104` names the IPv4 peers 10.0.0.0/8, as in L4 policies.
        let deny = policy("action: DENY\nrules: [{from: [{source: {ipBlocks: ['::ffff:10.0.0.0/104']}}]}]");
        assert!(!req().ip("10.1.2.3").allowed(&[&deny]), "an IPv4 peer in the mapped block is denied");
        assert!(!req().ip("::ffff:10.1.2.3").allowed(&[&deny]), "so is its IPv4-mapped form");
        assert!(req().ip("11.1.2.3").allowed(&[&deny]));
        let when = policy("action: DENY\nrules: [{when: [{key: source.ip, values: ['::ffff:10.0.0.0/104']}]}]");
        assert!(!req().ip("10.1.2.3").allowed(&[&when]));
        let allow = policy("rules: [{from: [{source: {remoteIpBlocks: ['::ffff:192.168.0.0/112']}}]}]");
        assert!(req().ip("192.168.4.5").allowed(&[&allow]));
        assert!(!req().ip("192.169.4.5").allowed(&[&allow]));
    }

    #[test]
    fn a_request_without_host_is_missing_the_host() {
        // No Host / :authority is a missing attribute, not the empty name: it satisfies
        // no ALLOW field about hosts (not even notHosts) and triggers any host DENY.
        let not_evil = policy("rules: [{to: [{operation: {notHosts: ['evil.com']}}]}]");
        assert!(req().host("echo").allowed(&[&not_evil]));
        assert!(!req().host("").allowed(&[&not_evil]), "a missing host passed an ALLOW notHosts");
        let deny = policy("action: DENY\nrules: [{to: [{operation: {notHosts: ['echo']}}]}]");
        assert!(req().host("echo").allowed(&[&deny]));
        assert!(!req().host("").allowed(&[&deny]));
        let deny_hosts = policy("action: DENY\nrules: [{to: [{operation: {hosts: ['evil.com']}}]}]");
        assert!(!req().host("").allowed(&[&deny_hosts]), "doubt counts for a DENY");
    }

    #[test]
    fn hosts_ignore_port_and_case() {
        let allow = policy(
            "rules: [{to: [{operation: {hosts: ['echo.default.svc.cluster.local', '*.example.com', 'api.*']}}]}]",
        );
        for host in [
            "echo.default.svc.cluster.local",
            "ECHO.Default.svc.cluster.local:80",
            "echo.default.svc.cluster.local.",
            "a.example.com:8080",
            "A.EXAMPLE.COM",
            "api.foo",
        ] {
            assert!(req().host(host).allowed(&[&allow]), "{host}");
        }
        for host in
            ["example.com", "echo", "", "evil.com:80", "echo.default.svc.cluster.local.evil.com", "x.example.com.evil"]
        {
            assert!(!req().host(host).allowed(&[&allow]), "{host}");
        }
        let deny = policy("action: DENY\nrules: [{to: [{operation: {hosts: ['evil.com']}}]}]");
        assert!(!req().host("EVIL.com:1234").allowed(&[&deny]), "a port can't dodge a DENY");
        assert!(!req().host("evil.com.").allowed(&[&deny]), "a trailing dot can't dodge a DENY");
        assert!(!req().host("[::1]:80").allowed(&[&policy("rules: [{to: [{operation: {hosts: ['[::2]']}}]}]")]));
        assert!(req().host("[::1]:80").allowed(&[&policy("rules: [{to: [{operation: {hosts: ['[::1]']}}]}]")]));
    }

    #[test]
    fn paths_prefix_suffix_any() {
        let allow = policy("rules: [{to: [{operation: {paths: ['/exact', '/api/*', '/pre*', '*/info']}}]}]");
        for path in ["/exact", "/api/", "/api/v1/x", "/pre", "/prefix/a", "/info", "/a/b/info"] {
            assert!(req().path(path).allowed(&[&allow]), "{path}");
        }
        for path in ["/exact/", "/Exact", "/api", "/info/", "/xinfo", "/", "/ex"] {
            assert!(!req().path(path).allowed(&[&allow]), "{path}");
        }
        let any = policy("rules: [{to: [{operation: {paths: ['*']}}]}]");
        assert!(req().path("/").allowed(&[&any]));
    }

    #[test]
    fn ports() {
        let allow = policy("rules: [{to: [{operation: {ports: ['80', '8080']}}]}]");
        assert!(req().port(80).allowed(&[&allow]));
        assert!(req().port(8080).allowed(&[&allow]));
        assert!(!req().port(9090).allowed(&[&allow]));
        let when = policy("rules: [{when: [{key: destination.port, values: ['80']}]}]");
        assert!(req().port(80).allowed(&[&when]));
        assert!(!req().port(81).allowed(&[&when]));
    }

    #[test]
    fn repeated_headers_allow() {
        let allow = policy("rules: [{when: [{key: 'request.headers[X-Role]', values: [good]}]}]");
        assert!(req().header("x-role", b"good").allowed(&[&allow]));
        assert!(req().header("x-role", b"good").header("x-role", b"good").allowed(&[&allow]));
        assert!(
            !req().header("x-role", b"good").header("x-role", b"evil").allowed(&[&allow]),
            "every value must match"
        );
        assert!(!req().header("x-role", b"evil").header("x-role", b"good").allowed(&[&allow]));
        assert!(!req().allowed(&[&allow]), "an absent header matches no value");
        // Never joined: "good,good" is one value and not "good".
        assert!(!req().header("x-role", b"good,good").allowed(&[&allow]));
        // Bytes that aren't UTF-8 compare as bytes and match no plain pattern.
        assert!(!req().header("x-role", b"go\xffod").allowed(&[&allow]));
        let not = policy("rules: [{when: [{key: 'request.headers[x-role]', notValues: [evil]}]}]");
        assert!(req().allowed(&[&not]), "absent header: notValues hold");
        assert!(req().header("x-role", b"good").allowed(&[&not]));
        assert!(!req().header("x-role", b"good").header("x-role", b"evil").allowed(&[&not]));
        let presence = policy("rules: [{when: [{key: 'request.headers[x-token]', values: ['*']}]}]");
        assert!(req().header("x-token", b"t").allowed(&[&presence]));
        assert!(!req().header("x-token", b"").allowed(&[&presence]), "'*' needs a non-empty value");
        assert!(!req().header("x-token", b"t").header("x-token", b"").allowed(&[&presence]));
    }

    #[test]
    fn repeated_headers_deny() {
        let deny = policy("action: DENY\nrules: [{when: [{key: 'request.headers[x-role]', values: [evil]}]}]");
        assert!(!req().header("x-role", b"good").header("x-role", b"evil").allowed(&[&deny]), "one value is enough");
        assert!(!req().header("X-Role", b"evil").allowed(&[&deny]));
        assert!(req().header("x-role", b"good").allowed(&[&deny]));
        assert!(req().allowed(&[&deny]));
        let not = policy("action: DENY\nrules: [{when: [{key: 'request.headers[x-role]', notValues: [good]}]}]");
        assert!(req().header("x-role", b"good").allowed(&[&not]));
        assert!(
            !req().header("x-role", b"good").header("x-role", b"evil").allowed(&[&not]),
            "an innocent value can't hide another"
        );
        assert!(!req().allowed(&[&not]), "absent header: a DENY notValues holds");
        let prefix =
            policy("action: DENY\nrules: [{when: [{key: 'request.headers[user-agent]', values: ['curl*', '*bot']}]}]");
        assert!(!req().header("user-agent", b"curl/8").allowed(&[&prefix]));
        assert!(!req().header("user-agent", b"xbot").allowed(&[&prefix]));
        assert!(req().header("user-agent", b"Curl/8").allowed(&[&prefix]));
    }

    #[test]
    fn unknown_principal() {
        let anon = || req().id(None);
        // ALLOW: a missing identity satisfies no identity field, negative ones included,
        // or "anyone but the attacker" would let in someone we know nothing about.
        let not = policy("rules: [{from: [{source: {notPrincipals: ['cluster.local/ns/default/sa/evil']}}]}]");
        assert!(!anon().allowed(&[&not]));
        assert!(!anon().allowed(&[&policy("rules: [{from: [{source: {principals: ['*']}}]}]")]));
        assert!(!anon().allowed(&[&policy("rules: [{from: [{source: {notNamespaces: [evil]}}]}]")]));
        assert!(!anon().allowed(&[&policy("rules: [{from: [{source: {notServiceAccounts: [default/evil]}}]}]")]));
        assert!(!anon().allowed(&[&policy("rules: [{when: [{key: source.namespace, notValues: [evil]}]}]")]));
        // DENY principals ["*"]: Istio would NOT deny here ('*' is a presence match and
        // the principal is absent). We deny: a missing attribute counts for a DENY
        // match, so presenting no identity can never dodge a DENY; the doubt is
        // resolved against the unknown peer. (The waypoint always knows the peer from
        // HBONE mTLS, so this only concerns callers without one.)
        let deny_any = policy("action: DENY\nrules: [{from: [{source: {principals: ['*']}}]}]");
        let v = anon().verdict(&[&deny_any]);
        assert_eq!(v.denied_by.as_deref(), Some("default/p"));
        assert!(!req().allowed(&[&deny_any]), "and any known principal is denied too");
        // The usual Istio "deny unauthenticated" policy still denies the anonymous peer
        // and lets known ones through.
        let deny_anon = policy("action: DENY\nrules: [{from: [{source: {notPrincipals: ['*']}}]}]");
        assert!(!anon().allowed(&[&deny_anon]));
        assert!(req().allowed(&[&deny_anon]));
        let deny_ns = policy("action: DENY\nrules: [{when: [{key: source.principal, values: ['*/sa/evil']}]}]");
        assert!(!anon().allowed(&[&deny_ns]));
        assert!(req().allowed(&[&deny_ns]));
    }

    #[test]
    fn rule_and_or_semantics() {
        // Fields inside an operation are ANDed, operations ORed, rules ORed.
        let allow = policy(
            "rules:\n- to: [{operation: {methods: [GET], paths: ['/read*']}}, {operation: {methods: [POST], paths: ['/write']}}]\n  when: [{key: 'request.headers[x-ok]', values: ['1']}]\n- from: [{source: {principals: ['*/sa/admin']}}]",
        );
        let ok = || req().header("x-ok", b"1");
        assert!(ok().path("/read/a").allowed(&[&allow]));
        assert!(ok().method("POST").path("/write").allowed(&[&allow]));
        assert!(!ok().method("POST").path("/read").allowed(&[&allow]));
        assert!(!req().path("/read").allowed(&[&allow]), "when must hold too");
        assert!(req().id(Some(("ops", "admin"))).method("PUT").path("/x").allowed(&[&allow]));
    }

    #[test]
    fn unvalidated_values_fail_closed() {
        let bad_allow = AuthorizationPolicy {
            name: "p".into(),
            namespace: "default".into(),
            target_refs: vec![],
            action: Action::Allow,
            rules: vec![Rule {
                when: vec![Condition {
                    key: "request.auth.claims[iss]".into(),
                    values: vec!["x".into()],
                    not_values: vec![],
                }],
                ..Rule::default()
            }],
        };
        assert!(!req().allowed(&[&bad_allow]));
        let bad_deny = AuthorizationPolicy { action: Action::Deny, ..bad_allow.clone() };
        assert!(!req().allowed(&[&bad_deny]));
        let mut ports = bad_deny.clone();
        ports.rules[0] = Rule {
            to: vec![To { operation: Operation { not_ports: vec!["http".into()], ..Operation::default() } }],
            ..Rule::default()
        };
        assert!(!req().allowed(&[&ports]));
    }
}
