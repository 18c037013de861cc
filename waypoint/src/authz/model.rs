//! The AuthorizationPolicy model, as the config file and the Kubernetes API write it,
//! and the policies derived from one (its deny-all stand-in, its opaque-TCP form).

use std::fmt;

use serde::Deserialize;

// One CIDR type for L4 and L7 policies, so both compare IPv4-mapped peers and rules alike.
use ztunnel::cidr::Cidr;

pub(super) use crate::object::ref_kind;
use crate::object::{place_widely, ObjectRef};

const SUPPORTED_KEYS: &str = "request.headers[<name>], source.ip, remote.ip, source.namespace, source.principal, \
     destination.port, request.auth.principal, request.auth.audiences, request.auth.presenter, request.auth.claims[<name>]...";

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthorizationPolicy {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub target_refs: Vec<ObjectRef>,
    #[serde(default)]
    pub action: Action,
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// The authorizer of a CUSTOM policy (a meshConfig extensionProvider).
    #[serde(default)]
    pub provider: Option<ProviderRef>,
    /// Set on a deny-all stand-in (`deny_all`) whose targets could not all be placed.
    #[serde(skip)]
    pub unplaced: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderRef {
    pub name: String,
}

/// Written as in Istio's CRD: `ALLOW`, `DENY`, `AUDIT`, `CUSTOM`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Action {
    #[default]
    Allow,
    Deny,
    Audit,
    /// Delegated to an external authorizer (ext_authz, see `extauthz`) for the requests
    /// its rules match.
    Custom,
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "ALLOW" => Ok(Action::Allow),
            "DENY" => Ok(Action::Deny),
            "AUDIT" => Ok(Action::Audit),
            "CUSTOM" => Ok(Action::Custom),
            _ => Err(serde::de::Error::custom(format!(
                "unknown action {s:?}: expected ALLOW, DENY, AUDIT or CUSTOM (uppercase, as in Istio)"
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
            Action::Custom => "CUSTOM",
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
    /// `<iss>/<sub>` of the request's verified JWT (see `authn`).
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
    /// Matched against the normalized path (see `path`), without the query.
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

impl AuthorizationPolicy {
    /// `namespace/name`, the policy's resource name.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What stands in for a policy the waypoint cannot enforce exactly (CUSTOM, JWT
    /// fields, a condition it does not know...): a DENY of every request to what it
    /// targets, since dropping it would widen access. Each ref is taken wider (its port
    /// and sectionName dropped); if one cannot be placed (a kind we don't serve, another
    /// namespace, no name) the deny covers all its namespace could target: the whole
    /// waypoint from the waypoint's own or the root namespace, else every Service of
    /// its namespace (so one namespace's policy never denies another's traffic).
    pub fn deny_all(namespace: &str, name: &str, refs: &[ObjectRef]) -> AuthorizationPolicy {
        let (target_refs, unplaced) = place_widely(namespace, refs);
        AuthorizationPolicy {
            name: name.into(),
            namespace: namespace.into(),
            target_refs,
            action: Action::Deny,
            // A rule with no from, to or when matches every request.
            rules: vec![Rule::default()],
            provider: None,
            unplaced,
        }
    }

    /// The policy as it applies to opaque TCP, which has no HTTP attributes (Istio's
    /// rule): a DENY or AUDIT rule loses its HTTP-only fields, so it matches more
    /// (a client cannot dodge an HTTP deny by not speaking HTTP); an ALLOW rule that
    /// needs them is dropped, so it can never allow.
    pub fn for_tcp(&self) -> AuthorizationPolicy {
        let http_only_op = |o: &Operation| Operation {
            ports: o.ports.clone(),
            not_ports: o.not_ports.clone(),
            ..Default::default()
        };
        let rules = self
            .rules
            .iter()
            .filter_map(|r| {
                // A request principal (JWT) is HTTP-only as well.
                let http_only_src = |s: &Source| Source {
                    request_principals: Vec::new(),
                    not_request_principals: Vec::new(),
                    ..s.clone()
                };
                let needs_http =
                    r.to.iter()
                        .any(|t| http_only_op(&t.operation) != t.operation)
                        || r.from.iter().any(|f| http_only_src(&f.source) != f.source)
                        || r.when.iter().any(|c| c.key.starts_with("request."));
                match (self.action, needs_http) {
                    (_, false) => Some(r.clone()),
                    (Action::Allow, true) => None,
                    (_, true) => Some(Rule {
                        // A source left with no field matches any peer.
                        from: r
                            .from
                            .iter()
                            .map(|f| From {
                                source: http_only_src(&f.source),
                            })
                            .collect(),
                        // An operation left with no field matches any connection.
                        to: r
                            .to
                            .iter()
                            .map(|t| To {
                                operation: http_only_op(&t.operation),
                            })
                            .collect(),
                        when: r
                            .when
                            .iter()
                            .filter(|c| !c.key.starts_with("request."))
                            .cloned()
                            .collect(),
                    }),
                }
            })
            .collect();
        AuthorizationPolicy {
            rules,
            ..self.clone()
        }
    }
}

/// A supported `when` key.
pub(super) enum Key<'a> {
    /// The header name as written; `HeaderMap` lookups by `&str` ignore case.
    Header(&'a str),
    SourceIp,
    DestinationPort,
    SourceNamespace,
    SourcePrincipal,
    /// `request.auth.principal`, `request.auth.audiences`, `request.auth.presenter`.
    AuthPrincipal,
    AuthAudiences,
    AuthPresenter,
    /// `request.auth.claims[a][b]`: the path of names.
    AuthClaim(Vec<&'a str>),
}

pub(super) fn parse_key(key: &str) -> Result<Key<'_>, String> {
    if let Some(name) = key
        .strip_prefix("request.headers[")
        .and_then(|k| k.strip_suffix(']'))
    {
        return match http::HeaderName::from_bytes(name.as_bytes()) {
            Ok(_) => Ok(Key::Header(name)),
            Err(_) => Err(format!("{name:?} in {key:?} is not a valid header name")),
        };
    }
    if let Some(rest) = key.strip_prefix("request.auth.claims") {
        return parse_claim_path(rest).map(Key::AuthClaim).ok_or_else(|| {
            format!("{key:?}: claims are written request.auth.claims[<name>], nested as request.auth.claims[<a>][<b>]")
        });
    }
    match key {
        "request.auth.principal" => Ok(Key::AuthPrincipal),
        "request.auth.audiences" => Ok(Key::AuthAudiences),
        "request.auth.presenter" => Ok(Key::AuthPresenter),
        // The waypoint's peer address is the original client's, so both name it.
        "source.ip" | "remote.ip" => Ok(Key::SourceIp),
        "destination.port" => Ok(Key::DestinationPort),
        "source.namespace" => Ok(Key::SourceNamespace),
        "source.principal" => Ok(Key::SourcePrincipal),
        _ => Err(format!(
            "{key:?} is not supported; supported keys: {SUPPORTED_KEYS}"
        )),
    }
}

pub(super) fn parse_port(s: &str) -> Option<u16> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `[a][b]` -> `["a", "b"]`; None unless it is one or more non-empty `[...]`.
fn parse_claim_path(mut rest: &str) -> Option<Vec<&str>> {
    let mut path = Vec::new();
    while !rest.is_empty() {
        let inner = rest.strip_prefix('[')?;
        let end = inner.find(']')?;
        let name = &inner[..end];
        if name.is_empty() || name.contains('[') {
            return None;
        }
        path.push(name);
        rest = &inner[end + 1..];
    }
    (!path.is_empty()).then_some(path)
}
