//! What serde cannot check in a route: required and combined fields, references, and
//! limits. Errors start with the field path relative to the route, e.g.
//! `rules[0].backendRefs[1].port: ...`.

use http::header::HeaderName;

use super::cors::Cors;
use super::model::{
    parent_kind, Attachment, Filter, HeaderModifier, HttpRoute, PathMatch, PathModifier,
    RequestMirror, RequestRedirect, RouteRule,
};
use crate::object::{ObjectRef, GATEWAY_GROUP, NETWORKING_GROUP};

/// Gateway API's largest backend weight.
const MAX_WEIGHT: u32 = 1_000_000;

impl HttpRoute {
    /// Checks what serde cannot (module docs).
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name: must not be empty".into());
        }
        if self.namespace.is_empty() {
            return Err("namespace: must not be empty".into());
        }
        if self.parent_refs.is_empty() {
            return Err("parentRefs: required: attach the route to a Service (group \"\", kind Service) or to the \
                        waypoint's Gateway"
                .into());
        }
        for (i, r) in self.parent_refs.iter().enumerate() {
            let at = format!("parentRefs[{i}]");
            let Some(kind) = parent_kind(r) else {
                return Err(format!(
                    "{at}: kind {:?} (group {:?}) is not supported; use kind Service with group \"\", kind \
                     ServiceEntry with group {NETWORKING_GROUP} or kind Gateway with group {GATEWAY_GROUP}",
                    r.kind.as_deref().unwrap_or("Gateway"),
                    r.group.as_deref().unwrap_or(GATEWAY_GROUP)
                ));
            };
            if r.name.is_empty() {
                return Err(format!("{at}.name: must not be empty"));
            }
            if let Some(ns) = r.namespace.as_deref().filter(|ns| *ns != self.namespace) {
                return Err(format!(
                    "{at}.namespace: {ns:?} differs from the route's namespace {:?}; consumer routes (a route in \
                     the client's namespace for a Service elsewhere) are not supported",
                    self.namespace
                ));
            }
            match kind {
                Attachment::Service | Attachment::ServiceEntry if r.section_name.is_some() => {
                    return Err(format!(
                        "{at}.sectionName: select a service port with `port`"
                    ))
                }
                Attachment::Gateway if r.port.is_some() => {
                    return Err(format!(
                        "{at}.port: a waypoint Gateway has one listener; leave port out"
                    ))
                }
                Attachment::Gateway if r.section_name.as_deref().is_some_and(|s| s != "mesh") => {
                    return Err(format!(
                        "{at}.sectionName: the waypoint's only listener is \"mesh\""
                    ))
                }
                _ => {}
            }
        }
        for (i, h) in self.hostnames.iter().enumerate() {
            check_hostname(h, true).map_err(|e| format!("hostnames[{i}]: {e}"))?;
        }
        if self.rules.is_empty() {
            return Err("rules: leave rules out for one rule that sends everything to the Service, or list some".into());
        }
        for (i, r) in self.rules.iter().enumerate() {
            r.validate(&format!("rules[{i}]"), &self.namespace)?;
        }
        Ok(())
    }
}

impl RouteRule {
    fn validate(&self, at: &str, route_ns: &str) -> Result<(), String> {
        for (i, m) in self.matches.iter().enumerate() {
            let mut names = std::collections::HashSet::new();
            for (j, h) in m.headers.iter().enumerate() {
                if !names.insert(h.name.clone()) {
                    return Err(format!(
                        "{at}.matches[{i}].headers[{j}]: header {} is matched twice",
                        h.name
                    ));
                }
            }
            let mut params = std::collections::HashSet::new();
            for (j, q) in m.query_params.iter().enumerate() {
                if !params.insert(q.name.clone()) {
                    return Err(format!(
                        "{at}.matches[{i}].queryParams[{j}]: parameter {} is matched twice",
                        q.name
                    ));
                }
            }
        }
        let has = |f: fn(&Filter) -> bool| self.filters.iter().filter(|x| f(x)).count();
        let redirects = has(|f| matches!(f, Filter::RequestRedirect(_)));
        let rewrites = has(|f| matches!(f, Filter::UrlRewrite(_)));
        let req_mods = has(|f| matches!(f, Filter::RequestHeaderModifier(_)));
        let resp_mods = has(|f| matches!(f, Filter::ResponseHeaderModifier(_)));
        let cors = has(|f| matches!(f, Filter::Cors(_)));
        if redirects > 1 || rewrites > 1 || req_mods > 1 || resp_mods > 1 || cors > 1 {
            return Err(format!(
                "{at}.filters: RequestRedirect, URLRewrite, RequestHeaderModifier, ResponseHeaderModifier and CORS may \
                 each appear once"
            ));
        }
        if redirects > 0 && rewrites > 0 {
            return Err(format!(
                "{at}.filters: RequestRedirect and URLRewrite cannot be combined"
            ));
        }
        if redirects > 0 && !self.backend_refs.is_empty() {
            return Err(format!(
                "{at}: a rule with a RequestRedirect answers itself; remove its backendRefs"
            ));
        }
        let all_prefix = !self.matches.is_empty()
            && self
                .matches
                .iter()
                .all(|m| matches!(m.path, None | Some(PathMatch::Prefix(_))));
        for (i, f) in self.filters.iter().enumerate() {
            let fat = format!("{at}.filters[{i}]");
            let path_mod = match f {
                Filter::RequestHeaderModifier(m) => {
                    m.validate(&format!("{fat}.requestHeaderModifier"))?;
                    None
                }
                Filter::ResponseHeaderModifier(m) => {
                    m.validate(&format!("{fat}.responseHeaderModifier"))?;
                    None
                }
                Filter::RequestRedirect(r) => {
                    r.validate(&format!("{fat}.requestRedirect"))?;
                    r.path.as_ref()
                }
                Filter::UrlRewrite(r) => {
                    if let Some(h) = &r.hostname {
                        check_hostname(h, false)
                            .map_err(|e| format!("{fat}.urlRewrite.hostname: {e}"))?;
                    }
                    r.path.as_ref()
                }
                Filter::RequestMirror(m) => {
                    m.validate(&format!("{fat}.requestMirror"), route_ns)?;
                    None
                }
                Filter::Cors(c) => {
                    c.validate(&format!("{fat}.cors"))?;
                    None
                }
            };
            if matches!(path_mod, Some(PathModifier::ReplacePrefixMatch(_))) && !all_prefix {
                return Err(format!(
                    "{fat}: ReplacePrefixMatch needs every match of the rule to be a PathPrefix path match"
                ));
            }
        }
        for (i, b) in self.backend_refs.iter().enumerate() {
            let bat = format!("{at}.backendRefs[{i}]");
            validate_backend(&bat, &b.backend, route_ns)?;
            if b.weight > MAX_WEIGHT {
                return Err(format!("{bat}.weight: must be 0-{MAX_WEIGHT}"));
            }
            // Istio applies only header modifiers per backend (and refuses the route else).
            let (mut req, mut resp) = (0, 0);
            for (j, f) in b.filters.iter().enumerate() {
                let fat = format!("{bat}.filters[{j}]");
                match f {
                    Filter::RequestHeaderModifier(m) => {
                        req += 1;
                        m.validate(&format!("{fat}.requestHeaderModifier"))?;
                    }
                    Filter::ResponseHeaderModifier(m) => {
                        resp += 1;
                        m.validate(&format!("{fat}.responseHeaderModifier"))?;
                    }
                    _ => {
                        return Err(format!(
                            "{fat}: a backendRef's filters may only be RequestHeaderModifier and ResponseHeaderModifier \
                             (Istio refuses other filter types there); put it on the rule"
                        ))
                    }
                }
            }
            if req > 1 || resp > 1 {
                return Err(format!("{bat}.filters: RequestHeaderModifier and ResponseHeaderModifier may each appear once"));
            }
        }
        if let Some(sp) = &self.session_persistence {
            let at = format!("{at}.sessionPersistence");
            if http::HeaderName::from_bytes(sp.name().as_bytes()).is_err()
                || sp.name().contains(['=', ';', ','])
            {
                return Err(format!(
                    "{at}.sessionName: {:?} is not a cookie or header name",
                    sp.name()
                ));
            }
            if sp.idle_timeout.is_some() {
                return Err(format!("{at}.idleTimeout: not supported (sessions end with absoluteTimeout or the browser session)"));
            }
            let permanent = match sp
                .cookie_config
                .as_ref()
                .and_then(|c| c.lifetime_type.as_deref())
            {
                None | Some("Session") => false,
                Some("Permanent") => true,
                Some(other) => {
                    return Err(format!(
                        "{at}.cookieConfig.lifetimeType: {other:?} is not Session or Permanent"
                    ))
                }
            };
            if permanent && sp.absolute_timeout.is_none() {
                return Err(format!(
                    "{at}.absoluteTimeout: required for a Permanent cookie (its Max-Age)"
                ));
            }
        }
        if let (Some(req), Some(backend)) = (self.request_timeout(), self.backend_timeout()) {
            if backend > req {
                return Err(format!("{at}.timeouts.backendRequest: {backend:?} is longer than timeouts.request {req:?}"));
            }
        }
        if let Some(r) = &self.retry {
            for (i, c) in r.codes.iter().enumerate() {
                if !(400..=599).contains(c) {
                    return Err(format!(
                        "{at}.retry.codes[{i}]: {c} is not an HTTP error status (400-599)"
                    ));
                }
            }
            if r.attempts.is_some_and(|a| a > 10) {
                return Err(format!("{at}.retry.attempts: at most 10 retries"));
            }
        }
        Ok(())
    }
}

impl HeaderModifier {
    fn validate(&self, at: &str) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        let names = self
            .set
            .iter()
            .map(|h| h.name.as_str().to_string())
            .chain(self.add.iter().map(|h| h.name.as_str().to_string()));
        for (i, r) in self.remove.iter().enumerate() {
            if HeaderName::from_bytes(r.as_bytes()).is_err() {
                return Err(format!(
                    "{at}.remove[{i}]: {r:?} is not a valid header name"
                ));
            }
        }
        for n in names.chain(self.remove.iter().map(|r| r.to_ascii_lowercase())) {
            if !seen.insert(n.clone()) {
                return Err(format!(
                    "{at}: header {n:?} appears more than once across set, add and remove"
                ));
            }
        }
        if self.set.is_empty() && self.add.is_empty() && self.remove.is_empty() {
            return Err(format!("{at}: set at least one of set, add, remove"));
        }
        Ok(())
    }
}

impl RequestRedirect {
    fn validate(&self, at: &str) -> Result<(), String> {
        if let Some(s) = &self.scheme {
            if s != "http" && s != "https" {
                return Err(format!("{at}.scheme: {s:?} is not http or https"));
            }
        }
        if let Some(h) = &self.hostname {
            check_hostname(h, false).map_err(|e| format!("{at}.hostname: {e}"))?;
        }
        if let Some(c) = self.status_code {
            if c != 301 && c != 302 {
                return Err(format!("{at}.statusCode: {c} is not 301 or 302"));
            }
        }
        if self.port == Some(0) {
            return Err(format!("{at}.port: must be 1-65535"));
        }
        Ok(())
    }
}

impl RequestMirror {
    fn validate(&self, at: &str, route_ns: &str) -> Result<(), String> {
        validate_backend(&format!("{at}.backendRef"), &self.backend_ref, route_ns)?;
        if self.percent.is_some() && self.fraction.is_some() {
            return Err(format!("{at}: set percent or fraction, not both"));
        }
        if self.percent.is_some_and(|p| p > 100) {
            return Err(format!("{at}.percent: must be 0-100"));
        }
        if let Some(f) = &self.fraction {
            if f.denominator == 0 || f.numerator > f.denominator {
                return Err(format!(
                    "{at}.fraction: needs 0 <= numerator <= denominator and denominator > 0"
                ));
            }
        }
        Ok(())
    }
}

/// Gateway API's list limits for `HTTPCORSFilter`.
const CORS_MAX_ORIGINS: usize = 64;
const CORS_MAX_HEADERS: usize = 64;
const CORS_METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "*",
];

impl Cors {
    /// Gateway API's CRD rules: origins `*` or `http(s)://host[:port]` (the host may
    /// start with `*.` or be `*`), methods from its list, header names as tokens, `*`
    /// alone in a list, no repeats, `maxAge` at least 1.
    fn validate(&self, at: &str) -> Result<(), String> {
        if self.virtual_service {
            // Checked when made (`Cors::from_virtual_service`); Istio's, not Gateway
            // API's, rules.
            return Ok(());
        }
        if self.allow_origins.len() > CORS_MAX_ORIGINS {
            return Err(format!(
                "{at}.allowOrigins: at most {CORS_MAX_ORIGINS} origins"
            ));
        }
        for (i, o) in self.allow_origins.iter().enumerate() {
            check_origin(o).map_err(|e| format!("{at}.allowOrigins[{i}]: {e}"))?;
        }
        set_of(
            &format!("{at}.allowOrigins"),
            &self.allow_origins,
            false,
            true,
        )?;
        for (i, m) in self.allow_methods.iter().enumerate() {
            if !CORS_METHODS.contains(&m.as_str()) {
                return Err(format!(
                    "{at}.allowMethods[{i}]: {m:?} is not one of {}",
                    CORS_METHODS.join(", ")
                ));
            }
        }
        set_of(
            &format!("{at}.allowMethods"),
            &self.allow_methods,
            false,
            true,
        )?;
        // `*` in exposeHeaders may come with other names (Gateway API sets no rule there).
        for (field, list, lone_star) in [
            ("allowHeaders", &self.allow_headers, true),
            ("exposeHeaders", &self.expose_headers, false),
        ] {
            if list.len() > CORS_MAX_HEADERS {
                return Err(format!("{at}.{field}: at most {CORS_MAX_HEADERS} headers"));
            }
            for (i, h) in list.iter().enumerate() {
                if h.len() > 256 || HeaderName::from_bytes(h.as_bytes()).is_err() {
                    return Err(format!("{at}.{field}[{i}]: {h:?} is not a header name"));
                }
            }
            set_of(&format!("{at}.{field}"), list, true, lone_star)?;
        }
        if self.max_age < 1 || self.max_age > i64::from(i32::MAX) {
            return Err(format!(
                "{at}.maxAge: {} is not 1-{} seconds",
                self.max_age,
                i32::MAX
            ));
        }
        Ok(())
    }
}

/// `*`, or `http(s)://host[:port]` with a host of DNS labels (letters, digits, `-`),
/// maybe `*.` in front, or `*` alone; port 1-65535.
fn check_origin(o: &str) -> Result<(), String> {
    if o == "*" {
        return Ok(());
    }
    let bad = |why: &str| {
        Err(format!("{o:?} is not an origin ({why}); write \"*\" or scheme://host[:port], e.g. https://app.example.com, https://*.example.com"))
    };
    let Some((scheme, authority)) = o.split_once("://") else {
        return bad("no scheme");
    };
    if scheme != "http" && scheme != "https" {
        return bad("the scheme is http or https");
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (authority, None),
    };
    if let Some(p) = port {
        if !p.bytes().all(|b| b.is_ascii_digit()) || !p.parse::<u16>().is_ok_and(|p| p > 0) {
            return bad("the port is 1-65535");
        }
    }
    let name = if host == "*" {
        ""
    } else {
        host.strip_prefix("*.").unwrap_or(host)
    };
    let label_ok =
        |l: &str| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if host != "*" && (name.is_empty() || !name.split('.').all(label_ok)) {
        return bad("the host is DNS labels, maybe after `*.`, or `*`; no path");
    }
    if o.len() > 253 {
        return bad("longer than 253 characters");
    }
    Ok(())
}

/// A Gateway API set: no value twice (header names compared case-insensitively), and
/// `*` only on its own where `lone_star`.
fn set_of(
    at: &str,
    list: &[String],
    case_insensitive: bool,
    lone_star: bool,
) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for (i, v) in list.iter().enumerate() {
        let key = if case_insensitive {
            v.to_ascii_lowercase()
        } else {
            v.clone()
        };
        if !seen.insert(key) {
            return Err(format!("{at}[{i}]: {v:?} is listed twice"));
        }
    }
    if lone_star && list.len() > 1 && list.iter().any(|v| v == "*") {
        return Err(format!(
            "{at}: `*` allows everything; it cannot be listed with other values"
        ));
    }
    Ok(())
}

/// A backend (weighted or a mirror's): a Service, or a ServiceEntry's host (Istio's
/// `Hostname` kind), and its port. A Service in another namespace is resolved only with
/// a ReferenceGrant there (checked per request, `grant`).
fn validate_backend(at: &str, r: &ObjectRef, route_ns: &str) -> Result<(), String> {
    if crate::egress::is_hostname_ref(r) {
        // Istio: "namespace may not be set with Hostname type"; the host is looked up
        // from the route's namespace (`egress::backend_service`).
        if r.namespace.is_some() {
            return Err(format!(
                "{at}.namespace: a Hostname backend has no namespace; leave it out"
            ));
        }
        if r.section_name.is_some() {
            return Err(format!("{at}.sectionName: a backend reference has none"));
        }
        check_hostname(&r.name, true).map_err(|e| format!("{at}.name: {e}"))?;
        return match r.port {
            None | Some(0) => Err(format!(
                "{at}.port: required for a Hostname backend (the service port to send to, 1-65535)"
            )),
            Some(_) => Ok(()),
        };
    }
    if r.kind.as_deref() == Some("ServiceEntry") {
        // Istio's route conversion has no ServiceEntry backend kind (it refuses it as an
        // unsupported backendRef); a ServiceEntry is reached by one of its hosts.
        return Err(format!(
            "{at}: kind ServiceEntry cannot be a backend (Istio does not take it either); name one of its \
             hosts: {{group: {NETWORKING_GROUP}, kind: Hostname, name: <host>, port: <port>}}"
        ));
    }
    if !matches!(r.group.as_deref(), None | Some(""))
        || !matches!(r.kind.as_deref(), None | Some("Service"))
    {
        return Err(format!(
            "{at}: only Services (group \"\", kind Service) and ServiceEntry hosts (group \
             {NETWORKING_GROUP}, kind Hostname) can be backends"
        ));
    }
    if r.section_name.is_some() {
        return Err(format!(
            "{at}.sectionName: a backend reference has none; name the Service port with `port`"
        ));
    }
    if r.name.is_empty() {
        return Err(format!("{at}.name: must not be empty"));
    }
    if r.namespace.as_deref().is_some_and(str::is_empty) {
        return Err(format!("{at}.namespace: must not be empty (leave it out for the route's namespace {route_ns:?})"));
    }
    match r.port {
        None => Err(format!(
            "{at}.port: required for a Service backend (the service port to send to)"
        )),
        Some(0) => Err(format!("{at}.port: must be 1-65535")),
        Some(_) => Ok(()),
    }
}

fn check_hostname(h: &str, wildcard: bool) -> Result<(), String> {
    let name = if wildcard {
        h.strip_prefix("*.").unwrap_or(h)
    } else {
        h
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.is_empty() || h.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!(
            "{h:?} is not a lowercase DNS name{}",
            if wildcard {
                " (a leading \"*.\" is allowed)"
            } else {
                ""
            }
        ));
    }
    if name.parse::<std::net::IpAddr>().is_ok()
        || name
            .split('.')
            .all(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "{h:?}: IP addresses are not allowed, only host names"
        ));
    }
    Ok(())
}
