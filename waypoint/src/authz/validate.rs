//! What serde cannot check in a policy: required fields, references, and values written
//! in a form that could never match (a DENY that silently never matches is a bypass).
//! Errors start with the field path relative to the policy, e.g.
//! `rules[0].to[1].operation.ports[0]: ...`.

use super::model::{
    parse_key, parse_port, ref_kind, Action, AuthorizationPolicy, Condition, Key, Operation, Rule,
    Source,
};
use ztunnel::cidr::Cidr;

use crate::object::ObjectRef;

impl AuthorizationPolicy {
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
            return Err("targetRefs: required: the waypoint enforces only policies that target its Gateway, a \
                        Service, a ServiceEntry or (from the root namespace) the GatewayClass istio-waypoint; policies without \
                        targetRefs belong in ztunnel's `policies` list"
                .into());
        }
        for (i, r) in self.target_refs.iter().enumerate() {
            validate_target_ref(r, &self.namespace).map_err(|e| format!("targetRefs[{i}].{e}"))?;
        }
        for (i, rule) in self.rules.iter().enumerate() {
            rule.validate(&format!("rules[{i}]"))?;
        }
        match (self.action, &self.provider) {
            (Action::Custom, None) => Err("provider: required with action CUSTOM (the name of a meshConfig extensionProvider)".into()),
            (Action::Custom, Some(p)) if p.name.is_empty() => Err("provider.name: must not be empty".into()),
            (Action::Custom, Some(_)) => Ok(()),
            (_, Some(_)) => Err(format!("provider: only with action CUSTOM, not {}", self.action)),
            (_, None) => Ok(()),
        }
    }
}

fn validate_target_ref(r: &ObjectRef, namespace: &str) -> Result<(), String> {
    let kind = r
        .kind
        .as_deref()
        .ok_or("kind: required (Service, ServiceEntry, Gateway or GatewayClass)")?;
    match kind {
        "Service" | "ServiceEntry" | "Gateway" | "GatewayClass" if ref_kind(r).is_none() => {
            let want = match kind {
                "Service" => "\"\" (or \"core\")",
                "ServiceEntry" => "\"networking.istio.io\"",
                _ => "\"gateway.networking.k8s.io\"",
            };
            let group = r.group.as_deref().unwrap_or_default();
            return Err(format!("group: {group:?} is wrong for kind {kind}, whose group is {want}"));
        }
        "Service" | "ServiceEntry" | "Gateway" | "GatewayClass" => {}
        _ => {
            return Err(format!(
                "kind: {kind:?} is not supported: the waypoint enforces policies that target a Service, a ServiceEntry, \
                 its Gateway or the GatewayClass istio-waypoint"
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
        return Err(
            "port: AuthorizationPolicy targetRefs have no port; use to.operation.ports".into(),
        );
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
}

impl Source {
    fn validate(&self, at: &str) -> Result<(), String> {
        if *self == Source::default() {
            return Err(format!(
                "{at}: must set at least one field; to match any source, leave `from` out"
            ));
        }
        let identity_fields = [
            &self.principals,
            &self.not_principals,
            &self.namespaces,
            &self.not_namespaces,
        ];
        if identity_fields.iter().any(|l| !l.is_empty())
            && !(self.service_accounts.is_empty() && self.not_service_accounts.is_empty())
        {
            return Err(format!(
                "{at}: cannot set serviceAccounts with namespaces or principals (as in Istio)"
            ));
        }
        for (field, list) in [
            ("principals", &self.principals),
            ("notPrincipals", &self.not_principals),
        ] {
            check_list(at, field, list, check_principal)?;
        }
        for (field, list) in [
            ("requestPrincipals", &self.request_principals),
            ("notRequestPrincipals", &self.not_request_principals),
        ] {
            check_list(at, field, list, check_wildcard)?;
        }
        for (field, list) in [
            ("namespaces", &self.namespaces),
            ("notNamespaces", &self.not_namespaces),
        ] {
            check_list(at, field, list, check_wildcard)?;
        }
        for (field, list) in [
            ("serviceAccounts", &self.service_accounts),
            ("notServiceAccounts", &self.not_service_accounts),
        ] {
            check_list(at, field, list, check_service_account)?;
        }
        Ok(())
    }
}

impl Operation {
    fn validate(&self, at: &str) -> Result<(), String> {
        if *self == Operation::default() {
            return Err(format!(
                "{at}: must set at least one field; to match any operation, leave `to` out"
            ));
        }
        for (field, list) in [("hosts", &self.hosts), ("notHosts", &self.not_hosts)] {
            check_list(at, field, list, check_host)?;
        }
        for (field, list) in [("ports", &self.ports), ("notPorts", &self.not_ports)] {
            check_list(at, field, list, check_port)?;
        }
        for (field, list) in [
            ("methods", &self.methods),
            ("notMethods", &self.not_methods),
        ] {
            check_list(at, field, list, check_method)?;
        }
        for (field, list) in [("paths", &self.paths), ("notPaths", &self.not_paths)] {
            check_list(at, field, list, check_path)?;
        }
        Ok(())
    }
}

impl Condition {
    fn validate(&self, at: &str) -> Result<(), String> {
        if self.key.is_empty() {
            return Err(format!("{at}.key: must not be empty"));
        }
        let key = parse_key(&self.key).map_err(|e| format!("{at}.key: {e}"))?;
        if self.values.is_empty() && self.not_values.is_empty() {
            return Err(format!(
                "{at}: at least one of values or notValues must be set for key {:?}",
                self.key
            ));
        }
        let check: fn(&str) -> Result<(), String> = match key {
            Key::Header(_) | Key::SourceNamespace => check_wildcard,
            Key::AuthPrincipal | Key::AuthAudiences | Key::AuthPresenter | Key::AuthClaim(_) => {
                check_wildcard
            }
            Key::SourcePrincipal => check_principal,
            Key::SourceIp => |v| v.parse::<Cidr>().map(|_| ()),
            Key::DestinationPort => check_port,
        };
        check_list(at, "values", &self.values, check)?;
        check_list(at, "notValues", &self.not_values, check)
    }
}

fn check_list(
    at: &str,
    field: &str,
    list: &[String],
    check: impl Fn(&str) -> Result<(), String>,
) -> Result<(), String> {
    for (i, v) in list.iter().enumerate() {
        let r = if v.is_empty() {
            Err("must not be empty".to_string())
        } else {
            check(v)
        };
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
        Some((ns, sa))
            if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') && !v.contains('*') =>
        {
            Ok(())
        }
        _ => Err(format!(
            "{v:?} is not \"<namespace>/<service account>\" (matched exactly, without wildcards)"
        )),
    }
}

fn check_host(v: &str) -> Result<(), String> {
    check_wildcard(v)?;
    if v.rsplit_once(':')
        .is_some_and(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "{v:?}: the port in Host is ignored for matching; write the host alone and use ports"
        ));
    }
    if v.ends_with('.') {
        return Err(format!(
            "{v:?}: write the host without the trailing dot (the request's is ignored)"
        ));
    }
    Ok(())
}

fn check_port(v: &str) -> Result<(), String> {
    parse_port(v)
        .map(|_| ())
        .ok_or_else(|| format!("{v:?} is not a port number (0-65535)"))
}

fn check_method(v: &str) -> Result<(), String> {
    let token = v.bytes().next().is_some_and(|b| b.is_ascii_uppercase())
        && v.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if token {
        return Ok(());
    }
    Err(format!("{v:?} is not an uppercase HTTP method; methods match exactly and case-sensitively, e.g. \"GET\""))
}

/// Requests are matched after `path::normalize`, so a path written any other way
/// could never match: refused rather than left to silently not match (which for a DENY
/// would be a bypass).
fn check_path(v: &str) -> Result<(), String> {
    if v.contains('{') || v.contains('}') {
        return Err(format!(
            "{v:?}: path templates ({{*}}, {{**}}) are not supported"
        ));
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
    match crate::path::normalize(&probe) {
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
