//! Gateway API `HTTPRoute`, as a waypoint applies it (GAMMA: routes attach to a Service
//! by `parentRefs`, or to the waypoint's own Gateway).
//!
//! Which rule serves a request follows the Gateway API's precedence over every match of
//! every route attached to the request's target: an `Exact` path, then a regular
//! expression, then the longest `PathPrefix`; then a method match; then the most header
//! matches; then the most query parameter matches; ties go to the route listed first in
//! the config, then the rule and match listed first. Routes attached to the Service win
//! over routes attached to the Gateway. When routes are attached but none matches, the
//! waypoint answers 404 (as Gateway API requires).
//!
//! Everything is parsed and compiled when the config loads (regexes, header names and
//! values, durations), so a request never meets a config error.

use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use regex::Regex;
use serde::Deserialize;

use super::{ObjectName, ParentRef, Target};

const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
/// Compiled regex size cap: a config's regex must not be able to take the proxy's memory.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Gateway API's largest backend weight.
const MAX_WEIGHT: u32 = 1_000_000;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRoute {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    /// Matched against Host for routes attached to the waypoint's Gateway; ignored for
    /// Service parents, where the Service (its VIP) already names the destination.
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// Absent: one rule matching every request, sent to the parent Service.
    #[serde(default = "default_rules")]
    pub rules: Vec<RouteRule>,
}

fn default_rules() -> Vec<RouteRule> {
    vec![RouteRule::default()]
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteRule {
    pub name: Option<String>,
    /// Empty: one match on the path prefix "/" (everything).
    pub matches: Vec<RouteMatch>,
    pub filters: Vec<Filter>,
    /// Empty: the request goes to the Service it was addressed to (GAMMA).
    pub backend_refs: Vec<BackendRef>,
    pub timeouts: Option<Timeouts>,
    pub retry: Option<Retry>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteMatch {
    /// Absent: the path prefix "/".
    pub path: Option<PathMatch>,
    pub headers: Vec<HeaderMatch>,
    pub query_params: Vec<QueryParamMatch>,
    pub method: Option<MethodMatch>,
}

/// A path match, compiled.
#[derive(Clone, Debug)]
pub enum PathMatch {
    Exact(String),
    /// Element-wise: `/api` matches `/api`, `/api/` and `/api/x`, never `/apix`. Stored
    /// without a trailing slash ("" for "/").
    Prefix(String),
    /// Must match the whole (normalized) path.
    Regex(Regex),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawPathMatch {
    #[serde(rename = "type", default = "path_prefix")]
    kind: String,
    #[serde(default = "slash")]
    value: String,
}

fn path_prefix() -> String {
    "PathPrefix".into()
}

fn slash() -> String {
    "/".into()
}

impl<'de> Deserialize<'de> for PathMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawPathMatch::deserialize(d)?;
        PathMatch::new(&raw.kind, &raw.value).map_err(serde::de::Error::custom)
    }
}

impl PathMatch {
    fn new(kind: &str, value: &str) -> Result<PathMatch, String> {
        match kind {
            "Exact" | "PathPrefix" => {
                if !value.starts_with('/') {
                    return Err(format!("path value {value:?} must start with '/'"));
                }
                // Requests are matched after `l7::path::normalize`; a value that isn't in
                // that form could never match, which would silently disable the rule.
                match super::path::normalize(value) {
                    Ok(n) if n == value || (kind == "PathPrefix" && n == value.trim_end_matches('/')) => {}
                    Ok(n) => {
                        return Err(format!(
                            "path value {value:?} is not in normalized form; requests are matched after \
                             normalization (merged slashes, dot segments, percent escapes), so write {n:?}"
                        ))
                    }
                    Err(e) => return Err(format!("path value {value:?} could never match: {e}")),
                }
                if kind == "Exact" {
                    Ok(PathMatch::Exact(value.to_string()))
                } else {
                    Ok(PathMatch::Prefix(value.trim_end_matches('/').to_string()))
                }
            }
            "RegularExpression" => Ok(PathMatch::Regex(full_match_regex(value)?)),
            _ => Err(format!("path type {kind:?} is not one of Exact, PathPrefix, RegularExpression")),
        }
    }

    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(v) => path == v,
            PathMatch::Prefix(p) => {
                path.strip_prefix(p.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
            }
            PathMatch::Regex(r) => r.is_match(path),
        }
    }

    /// Precedence among path kinds (higher wins), and among prefixes their length.
    fn rank(&self) -> (u8, usize) {
        match self {
            PathMatch::Exact(v) => (3, v.len()),
            PathMatch::Regex(_) => (2, 0),
            PathMatch::Prefix(p) => (1, p.len()),
        }
    }
}

/// Anchors the pattern: Gateway API (like Envoy's safe_regex) matches the whole value.
fn full_match_regex(pattern: &str) -> Result<Regex, String> {
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| format!("regular expression {pattern:?} does not compile: {e}"))
}

/// A string value match: exact (case-sensitive) or a full-match regular expression.
#[derive(Clone, Debug)]
pub enum ValueMatch {
    Exact(String),
    Regex(Regex),
}

impl ValueMatch {
    fn new(kind: &str, value: &str) -> Result<ValueMatch, String> {
        match kind {
            "Exact" => Ok(ValueMatch::Exact(value.to_string())),
            "RegularExpression" => Ok(ValueMatch::Regex(full_match_regex(value)?)),
            _ => Err(format!("match type {kind:?} is not one of Exact, RegularExpression")),
        }
    }

    fn matches(&self, v: &[u8]) -> bool {
        match self {
            ValueMatch::Exact(e) => v == e.as_bytes(),
            ValueMatch::Regex(r) => std::str::from_utf8(v).is_ok_and(|s| r.is_match(s)),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawNameValueMatch {
    #[serde(rename = "type", default = "exact")]
    kind: String,
    name: String,
    value: String,
}

fn exact() -> String {
    "Exact".into()
}

/// A header match. A header sent several times matches when one of its values matches
/// on its own; values are never joined.
#[derive(Clone, Debug)]
pub struct HeaderMatch {
    pub name: HeaderName,
    pub value: ValueMatch,
}

impl<'de> Deserialize<'de> for HeaderMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawNameValueMatch::deserialize(d)?;
        let name = HeaderName::from_bytes(raw.name.as_bytes())
            .map_err(|_| serde::de::Error::custom(format!("{:?} is not a valid header name", raw.name)))?;
        Ok(HeaderMatch { name, value: ValueMatch::new(&raw.kind, &raw.value).map_err(serde::de::Error::custom)? })
    }
}

/// A query parameter match: the name is case-sensitive, the value is compared after
/// percent-decoding; a parameter given several times matches when one value does.
#[derive(Clone, Debug)]
pub struct QueryParamMatch {
    pub name: String,
    pub value: ValueMatch,
}

impl<'de> Deserialize<'de> for QueryParamMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawNameValueMatch::deserialize(d)?;
        if raw.name.is_empty() {
            return Err(serde::de::Error::custom("query parameter name must not be empty"));
        }
        Ok(QueryParamMatch { name: raw.name, value: ValueMatch::new(&raw.kind, &raw.value).map_err(serde::de::Error::custom)? })
    }
}

/// An HTTP method, as written in Gateway API (uppercase, exact).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MethodMatch(pub Method);

impl<'de> Deserialize<'de> for MethodMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const METHODS: [&str; 9] = ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"];
        let s = String::deserialize(d)?;
        if !METHODS.contains(&s.as_str()) {
            return Err(serde::de::Error::custom(format!("method {s:?} is not one of {}", METHODS.join(", "))));
        }
        Method::from_bytes(s.as_bytes()).map(MethodMatch).map_err(serde::de::Error::custom)
    }
}

/// A route filter (Gateway API `HTTPRouteFilter`), written as
/// `{type: <Kind>, <kindInCamelCase>: {...}}`.
#[derive(Clone, Debug)]
pub enum Filter {
    RequestHeaderModifier(HeaderModifier),
    ResponseHeaderModifier(HeaderModifier),
    RequestRedirect(RequestRedirect),
    UrlRewrite(UrlRewrite),
    RequestMirror(RequestMirror),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFilter {
    #[serde(rename = "type")]
    kind: String,
    request_header_modifier: Option<HeaderModifier>,
    response_header_modifier: Option<HeaderModifier>,
    request_redirect: Option<RequestRedirect>,
    #[serde(rename = "urlRewrite")]
    url_rewrite: Option<UrlRewrite>,
    request_mirror: Option<RequestMirror>,
}

impl<'de> Deserialize<'de> for Filter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawFilter::deserialize(d)?;
        let set = [
            raw.request_header_modifier.is_some(),
            raw.response_header_modifier.is_some(),
            raw.request_redirect.is_some(),
            raw.url_rewrite.is_some(),
            raw.request_mirror.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        let err = |field: &str| {
            serde::de::Error::custom(format!(
                "filter of type {} needs its `{field}` field, and only that one",
                raw.kind
            ))
        };
        let f = match raw.kind.as_str() {
            "RequestHeaderModifier" => raw.request_header_modifier.map(Filter::RequestHeaderModifier).ok_or_else(|| err("requestHeaderModifier"))?,
            "ResponseHeaderModifier" => raw.response_header_modifier.map(Filter::ResponseHeaderModifier).ok_or_else(|| err("responseHeaderModifier"))?,
            "RequestRedirect" => raw.request_redirect.map(Filter::RequestRedirect).ok_or_else(|| err("requestRedirect"))?,
            "URLRewrite" => raw.url_rewrite.map(Filter::UrlRewrite).ok_or_else(|| err("urlRewrite"))?,
            "RequestMirror" => raw.request_mirror.map(Filter::RequestMirror).ok_or_else(|| err("requestMirror"))?,
            "ExtensionRef" | "CORS" | "ExternalAuth" => {
                return Err(serde::de::Error::custom(format!("filter type {} is not supported by this waypoint", raw.kind)))
            }
            other => {
                return Err(serde::de::Error::custom(format!(
                    "filter type {other:?} is not one of RequestHeaderModifier, ResponseHeaderModifier, \
                     RequestRedirect, URLRewrite, RequestMirror"
                )))
            }
        };
        if set != 1 {
            return Err(err(match &f {
                Filter::RequestHeaderModifier(_) => "requestHeaderModifier",
                Filter::ResponseHeaderModifier(_) => "responseHeaderModifier",
                Filter::RequestRedirect(_) => "requestRedirect",
                Filter::UrlRewrite(_) => "urlRewrite",
                Filter::RequestMirror(_) => "requestMirror",
            }));
        }
        Ok(f)
    }
}

/// One header to set or add, parsed when the config loads.
#[derive(Clone, Debug)]
pub struct HttpHeader {
    pub name: HeaderName,
    pub value: HeaderValue,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttpHeader {
    name: String,
    value: String,
}

impl<'de> Deserialize<'de> for HttpHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawHttpHeader::deserialize(d)?;
        let name = HeaderName::from_bytes(raw.name.as_bytes())
            .map_err(|_| serde::de::Error::custom(format!("{:?} is not a valid header name", raw.name)))?;
        let value = HeaderValue::from_str(&raw.value)
            .map_err(|_| serde::de::Error::custom(format!("{:?} is not a valid header value", raw.value)))?;
        Ok(HttpHeader { name, value })
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeaderModifier {
    /// Replaces every value of the header.
    pub set: Vec<HttpHeader>,
    /// Appends a value (the header keeps the ones it had).
    pub add: Vec<HttpHeader>,
    pub remove: Vec<String>,
}

impl HeaderModifier {
    /// Gateway API order: set, add, then remove.
    pub fn apply(&self, h: &mut HeaderMap) {
        for s in &self.set {
            h.insert(s.name.clone(), s.value.clone());
        }
        for a in &self.add {
            h.append(a.name.clone(), a.value.clone());
        }
        for r in &self.remove {
            h.remove(r.as_str());
        }
    }

    fn validate(&self, at: &str) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        let names = self.set.iter().map(|h| h.name.as_str().to_string()).chain(self.add.iter().map(|h| h.name.as_str().to_string()));
        for (i, r) in self.remove.iter().enumerate() {
            if HeaderName::from_bytes(r.as_bytes()).is_err() {
                return Err(format!("{at}.remove[{i}]: {r:?} is not a valid header name"));
            }
        }
        for n in names.chain(self.remove.iter().map(|r| r.to_ascii_lowercase())) {
            if !seen.insert(n.clone()) {
                return Err(format!("{at}: header {n:?} appears more than once across set, add and remove"));
            }
        }
        if self.set.is_empty() && self.add.is_empty() && self.remove.is_empty() {
            return Err(format!("{at}: set at least one of set, add, remove"));
        }
        Ok(())
    }
}

/// How a redirect or rewrite changes the path.
#[derive(Clone, Debug)]
pub enum PathModifier {
    ReplaceFullPath(String),
    /// Replaces the matched `PathPrefix` (element-wise), keeping the rest of the path.
    ReplacePrefixMatch(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawPathModifier {
    #[serde(rename = "type")]
    kind: String,
    replace_full_path: Option<String>,
    replace_prefix_match: Option<String>,
}

impl<'de> Deserialize<'de> for PathModifier {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawPathModifier::deserialize(d)?;
        let (m, value) = match (raw.kind.as_str(), raw.replace_full_path, raw.replace_prefix_match) {
            ("ReplaceFullPath", Some(p), None) => (PathModifier::ReplaceFullPath(p.clone()), p),
            ("ReplacePrefixMatch", None, Some(p)) => (PathModifier::ReplacePrefixMatch(p.clone()), p),
            ("ReplaceFullPath", ..) => return Err(serde::de::Error::custom("type ReplaceFullPath needs replaceFullPath, and only that")),
            ("ReplacePrefixMatch", ..) => {
                return Err(serde::de::Error::custom("type ReplacePrefixMatch needs replacePrefixMatch, and only that"))
            }
            (other, ..) => {
                return Err(serde::de::Error::custom(format!(
                    "path modifier type {other:?} is not one of ReplaceFullPath, ReplacePrefixMatch"
                )))
            }
        };
        // The result goes upstream as is: it must already be a clean path.
        match super::path::normalize(&value) {
            Ok(n) if n == value => Ok(m),
            Ok(n) => Err(serde::de::Error::custom(format!("path {value:?} is not in normalized form; write {n:?}"))),
            Err(e) => Err(serde::de::Error::custom(format!("path {value:?}: {e}"))),
        }
    }
}

impl PathModifier {
    /// The new path. `matched_prefix` is the rule's matched `PathPrefix` (without its
    /// trailing slash); `path` is normalized and matched it.
    fn apply(&self, path: &str, matched_prefix: Option<&str>) -> String {
        match self {
            PathModifier::ReplaceFullPath(p) => p.clone(),
            PathModifier::ReplacePrefixMatch(replacement) => {
                let rest = matched_prefix.and_then(|p| path.strip_prefix(p)).unwrap_or(path);
                if rest.is_empty() {
                    return replacement.clone();
                }
                // `rest` starts with '/': join without doubling the slash.
                let joined = format!("{}{rest}", replacement.trim_end_matches('/'));
                if joined.is_empty() { "/".into() } else { joined }
            }
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestRedirect {
    pub scheme: Option<String>,
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
    pub port: Option<u16>,
    /// 301 or 302 (default).
    pub status_code: Option<u16>,
}

impl RequestRedirect {
    /// The status and `Location` for a request to `scheme://host[:port]path?query`.
    /// Port rules (Gateway API): the redirect's port, else the scheme's well-known one
    /// when the redirect sets a scheme, else the request's; a well-known port is left out.
    pub fn location(
        &self,
        scheme: &str,
        host: &str,
        port: Option<u16>,
        path: &str,
        query: Option<&str>,
        matched_prefix: Option<&str>,
    ) -> (StatusCode, String) {
        let scheme = self.scheme.as_deref().unwrap_or(scheme);
        let well_known = |s: &str| match s {
            "https" => Some(443),
            "http" => Some(80),
            _ => None,
        };
        let port = self.port.or(if self.scheme.is_some() { well_known(scheme) } else { port });
        let host = self.hostname.as_deref().unwrap_or(host);
        let path = self.path.as_ref().map_or_else(|| path.to_string(), |m| m.apply(path, matched_prefix));
        let mut loc = format!("{scheme}://{host}");
        if let Some(p) = port.filter(|p| Some(*p) != well_known(scheme)) {
            loc.push_str(&format!(":{p}"));
        }
        loc.push_str(&path);
        if let Some(q) = query {
            loc.push('?');
            loc.push_str(q);
        }
        let status = StatusCode::from_u16(self.status_code.unwrap_or(302)).unwrap_or(StatusCode::FOUND);
        (status, loc)
    }

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

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UrlRewrite {
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
}

impl UrlRewrite {
    /// Rewrites the upstream Host and path in place.
    pub fn apply(&self, host: &mut String, path: &mut String, matched_prefix: Option<&str>) {
        if let Some(h) = &self.hostname {
            h.clone_into(host);
        }
        if let Some(m) = &self.path {
            *path = m.apply(path, matched_prefix);
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestMirror {
    pub backend_ref: BackendObjectRef,
    /// Share of requests mirrored, 0-100 (all when neither this nor `fraction` is set).
    #[serde(default)]
    pub percent: Option<u32>,
    #[serde(default)]
    pub fraction: Option<Fraction>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fraction {
    pub numerator: u32,
    #[serde(default = "hundred")]
    pub denominator: u32,
}

fn hundred() -> u32 {
    100
}

impl RequestMirror {
    /// Whether this request is mirrored; `roll` is uniform in [0, 1).
    pub fn sampled(&self, roll: f64) -> bool {
        let share = match (&self.percent, &self.fraction) {
            (Some(p), _) => f64::from(*p) / 100.0,
            (None, Some(f)) => f64::from(f.numerator) / f64::from(f.denominator.max(1)),
            (None, None) => 1.0,
        };
        roll < share
    }

    fn validate(&self, at: &str, route_ns: &str) -> Result<(), String> {
        self.backend_ref.validate(&format!("{at}.backendRef"), route_ns)?;
        if self.percent.is_some() && self.fraction.is_some() {
            return Err(format!("{at}: set percent or fraction, not both"));
        }
        if self.percent.is_some_and(|p| p > 100) {
            return Err(format!("{at}.percent: must be 0-100"));
        }
        if let Some(f) = &self.fraction {
            if f.denominator == 0 || f.numerator > f.denominator {
                return Err(format!("{at}.fraction: needs 0 <= numerator <= denominator and denominator > 0"));
            }
        }
        Ok(())
    }
}

/// A backend for a mirror: a Service and its port.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendObjectRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
}

impl BackendObjectRef {
    pub fn service(&self, route_ns: &str) -> ObjectName {
        backend_service(&self.name, self.namespace.as_deref(), route_ns)
    }

    fn validate(&self, at: &str, route_ns: &str) -> Result<(), String> {
        validate_backend(at, self.group.as_deref(), self.kind.as_deref(), &self.name, self.namespace.as_deref(), self.port, route_ns)
    }
}

/// A weighted backend: a Service and its port.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
    /// Share of the rule's requests, relative to the other backends (default 1; 0: none).
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

impl BackendRef {
    pub fn service(&self, route_ns: &str) -> ObjectName {
        backend_service(&self.name, self.namespace.as_deref(), route_ns)
    }
}

fn backend_service(name: &str, namespace: Option<&str>, route_ns: &str) -> ObjectName {
    ObjectName { namespace: namespace.unwrap_or(route_ns).to_string(), name: name.to_string() }
}

fn validate_backend(
    at: &str,
    group: Option<&str>,
    kind: Option<&str>,
    name: &str,
    namespace: Option<&str>,
    port: Option<u16>,
    route_ns: &str,
) -> Result<(), String> {
    if !matches!(group, None | Some("")) || !matches!(kind, None | Some("Service")) {
        return Err(format!("{at}: only Services (group \"\", kind Service) can be backends"));
    }
    if name.is_empty() {
        return Err(format!("{at}.name: must not be empty"));
    }
    if let Some(ns) = namespace.filter(|ns| *ns != route_ns) {
        return Err(format!(
            "{at}.namespace: {ns:?} differs from the route's namespace {route_ns:?}; a backend in another \
             namespace needs a ReferenceGrant, which this waypoint does not support"
        ));
    }
    match port {
        None => Err(format!("{at}.port: required for a Service backend (the service port to send to)")),
        Some(0) => Err(format!("{at}.port: must be 1-65535")),
        Some(_) => Ok(()),
    }
}

/// A Gateway API duration (GEP-2257: up to four `<number><h|m|s|ms>` parts, e.g. `1h30m`,
/// `500ms`); `0s` turns the timeout off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatewayDuration(pub Duration);

impl std::str::FromStr for GatewayDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a duration like \"10s\", \"500ms\" or \"1h30m\" (units h, m, s, ms)");
        let mut total = Duration::ZERO;
        let mut rest = s;
        let mut parts = 0;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 || digits > 5 {
                return Err(bad());
            }
            let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
            rest = &rest[digits..];
            let (unit, len) = if rest.starts_with("ms") {
                (Duration::from_millis(1), 2)
            } else {
                match rest.bytes().next() {
                    Some(b'h') => (Duration::from_secs(3600), 1),
                    Some(b'm') => (Duration::from_secs(60), 1),
                    Some(b's') => (Duration::from_secs(1), 1),
                    _ => return Err(bad()),
                }
            };
            rest = &rest[len..];
            total += unit * u32::try_from(n).map_err(|_| bad())?;
            parts += 1;
        }
        if parts == 0 || parts > 4 {
            return Err(bad());
        }
        Ok(GatewayDuration(total))
    }
}

impl<'de> Deserialize<'de> for GatewayDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Timeouts {
    /// From the request's arrival to the end of the response headers, retries included.
    pub request: Option<GatewayDuration>,
    /// One attempt at one endpoint.
    pub backend_request: Option<GatewayDuration>,
}

/// Gateway API `HTTPRouteRetry`: `attempts` retries (after the first try) on the listed
/// status `codes` (default 503), with exponential `backoff` (default 25 ms). Only
/// idempotent requests are retried; a failed connect is always retried.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Retry {
    #[serde(default = "default_retry_codes")]
    pub codes: Vec<u16>,
    #[serde(default)]
    pub attempts: Option<u32>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub backoff: Option<Duration>,
}

fn default_retry_codes() -> Vec<u16> {
    vec![503]
}

fn opt_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    Ok(Some(GatewayDuration::deserialize(d)?.0))
}

impl RouteRule {
    fn timeout(d: Option<GatewayDuration>) -> Option<Duration> {
        d.map(|d| d.0).filter(|d| !d.is_zero())
    }

    pub fn request_timeout(&self) -> Option<Duration> {
        Self::timeout(self.timeouts.as_ref().and_then(|t| t.request))
    }

    pub fn backend_timeout(&self) -> Option<Duration> {
        Self::timeout(self.timeouts.as_ref().and_then(|t| t.backend_request))
    }

    /// A backend by weight; `roll` is any random number. None when every weight is 0
    /// (Gateway API: such requests get a 500).
    pub fn pick_backend(&self, roll: u64) -> Option<&BackendRef> {
        let total: u64 = self.backend_refs.iter().map(|b| u64::from(b.weight)).sum();
        if total == 0 {
            return None;
        }
        let mut x = roll % total;
        for b in &self.backend_refs {
            let w = u64::from(b.weight);
            if x < w {
                return Some(b);
            }
            x -= w;
        }
        None
    }

    fn validate(&self, at: &str, route_ns: &str) -> Result<(), String> {
        for (i, m) in self.matches.iter().enumerate() {
            let mut names = std::collections::HashSet::new();
            for (j, h) in m.headers.iter().enumerate() {
                if !names.insert(h.name.clone()) {
                    return Err(format!("{at}.matches[{i}].headers[{j}]: header {} is matched twice", h.name));
                }
            }
            let mut params = std::collections::HashSet::new();
            for (j, q) in m.query_params.iter().enumerate() {
                if !params.insert(q.name.clone()) {
                    return Err(format!("{at}.matches[{i}].queryParams[{j}]: parameter {} is matched twice", q.name));
                }
            }
        }
        let has = |f: fn(&Filter) -> bool| self.filters.iter().filter(|x| f(x)).count();
        let redirects = has(|f| matches!(f, Filter::RequestRedirect(_)));
        let rewrites = has(|f| matches!(f, Filter::UrlRewrite(_)));
        let req_mods = has(|f| matches!(f, Filter::RequestHeaderModifier(_)));
        let resp_mods = has(|f| matches!(f, Filter::ResponseHeaderModifier(_)));
        if redirects > 1 || rewrites > 1 || req_mods > 1 || resp_mods > 1 {
            return Err(format!(
                "{at}.filters: RequestRedirect, URLRewrite, RequestHeaderModifier and ResponseHeaderModifier may each \
                 appear once"
            ));
        }
        if redirects > 0 && rewrites > 0 {
            return Err(format!("{at}.filters: RequestRedirect and URLRewrite cannot be combined"));
        }
        if redirects > 0 && !self.backend_refs.is_empty() {
            return Err(format!("{at}: a rule with a RequestRedirect answers itself; remove its backendRefs"));
        }
        let all_prefix = !self.matches.is_empty()
            && self.matches.iter().all(|m| matches!(m.path, None | Some(PathMatch::Prefix(_))));
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
                        check_hostname(h, false).map_err(|e| format!("{fat}.urlRewrite.hostname: {e}"))?;
                    }
                    r.path.as_ref()
                }
                Filter::RequestMirror(m) => {
                    m.validate(&format!("{fat}.requestMirror"), route_ns)?;
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
            validate_backend(&bat, b.group.as_deref(), b.kind.as_deref(), &b.name, b.namespace.as_deref(), b.port, route_ns)?;
            if b.weight > MAX_WEIGHT {
                return Err(format!("{bat}.weight: must be 0-{MAX_WEIGHT}"));
            }
        }
        if let Some(t) = &self.timeouts {
            if let (Some(req), Some(backend)) = (Self::timeout(t.request), Self::timeout(t.backend_request)) {
                if backend > req {
                    return Err(format!(
                        "{at}.timeouts.backendRequest: {backend:?} is longer than timeouts.request {req:?}"
                    ));
                }
            }
        }
        if let Some(r) = &self.retry {
            for (i, c) in r.codes.iter().enumerate() {
                if !(400..=599).contains(c) {
                    return Err(format!("{at}.retry.codes[{i}]: {c} is not an HTTP error status (400-599)"));
                }
            }
            if r.attempts.is_some_and(|a| a > 10) {
                return Err(format!("{at}.retry.attempts: at most 10 retries"));
            }
        }
        Ok(())
    }
}

impl RouteMatch {
    fn path(&self) -> Option<&PathMatch> {
        self.path.as_ref()
    }

    fn matches(&self, req: &RouteRequest) -> bool {
        self.path().is_none_or(|p| p.matches(req.path))
            && self.method.as_ref().is_none_or(|m| m.0 == *req.method)
            && self.headers.iter().all(|h| req.headers.get_all(&h.name).iter().any(|v| h.value.matches(v.as_bytes())))
            && self.query_params.iter().all(|q| query_values(req.query, &q.name).any(|v| q.value.matches(&v)))
    }

    /// Gateway API precedence, higher first.
    fn precedence(&self) -> (u8, usize, bool, usize, usize) {
        let (kind, len) = self.path().map_or((1, 0), PathMatch::rank);
        (kind, len, self.method.is_some(), self.headers.len(), self.query_params.len())
    }
}

/// The values of query parameter `name`, percent-decoded.
fn query_values<'q>(query: Option<&'q str>, name: &'q str) -> impl Iterator<Item = Vec<u8>> + 'q {
    query.into_iter().flat_map(|q| q.split('&')).filter_map(move |pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k.as_bytes()) == name.as_bytes()).then(|| percent_decode(v.as_bytes()))
    })
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            if let (Some(h), Some(l)) = (s.get(i + 1).and_then(|c| hex(*c)), s.get(i + 2).and_then(|c| hex(*c))) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// The request attributes routing looks at.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    pub method: &'a Method,
    /// Normalized (`l7::path`), without the query.
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    /// Lowercase, without the port.
    pub host: &'a str,
}

/// What routing decided for a request.
#[derive(Clone, Copy, Debug)]
pub enum Selection<'a> {
    /// No route applies to the target: the request goes where it was addressed.
    NoRoutes,
    /// Routes apply but none matches: 404.
    NoMatch,
    Matched(Selected<'a>),
}

/// The rule chosen for a request.
#[derive(Clone, Copy, Debug)]
pub struct Selected<'a> {
    pub route: &'a HttpRoute,
    pub rule: &'a RouteRule,
    pub rule_index: usize,
    /// The `PathPrefix` (without trailing slash) that matched, for ReplacePrefixMatch.
    pub matched_prefix: Option<&'a str>,
}

enum Attachment {
    Service,
    Gateway,
}

impl HttpRoute {
    fn attachment(&self, target: &Target) -> Option<Attachment> {
        let mut via_gateway = false;
        for r in &self.parent_refs {
            let ns = r.namespace.as_deref().unwrap_or(&self.namespace);
            match parent_kind(r) {
                Some(Attachment::Service) => {
                    let svc = target.service.is_some_and(|s| s.name == r.name && s.namespace == ns);
                    if svc && r.port.is_none_or(|p| p == target.port) {
                        return Some(Attachment::Service);
                    }
                }
                Some(Attachment::Gateway) => {
                    via_gateway |= target.gateway.name == r.name && target.gateway.namespace == ns;
                }
                None => {}
            }
        }
        via_gateway.then_some(Attachment::Gateway)
    }

    /// Whether the route applies to requests for `target`.
    pub fn attaches_to(&self, target: &Target) -> bool {
        self.attachment(target).is_some()
    }

    fn host_matches(&self, host: &str) -> bool {
        self.hostnames.is_empty()
            || self.hostnames.iter().any(|h| match h.strip_prefix('*') {
                // `*.example.com` matches one or more labels in front of `.example.com`.
                Some(suffix) => host.len() > suffix.len() && host.ends_with(&suffix.to_ascii_lowercase()),
                None => host.eq_ignore_ascii_case(h),
            })
    }

    /// Checks what serde cannot. Errors start with the field path relative to the
    /// route, e.g. `rules[0].backendRefs[1].port: ...`.
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
                    "{at}: kind {:?} (group {:?}) is not supported; use kind Service with group \"\" or kind Gateway \
                     with group {GATEWAY_GROUP}",
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
                Attachment::Service if r.section_name.is_some() => {
                    return Err(format!("{at}.sectionName: select a Service port with `port`"))
                }
                Attachment::Gateway if r.port.is_some() => {
                    return Err(format!("{at}.port: a waypoint Gateway has one listener; leave port out"))
                }
                Attachment::Gateway if r.section_name.as_deref().is_some_and(|s| s != "mesh") => {
                    return Err(format!("{at}.sectionName: the waypoint's only listener is \"mesh\""))
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

fn parent_kind(r: &ParentRef) -> Option<Attachment> {
    // Gateway API defaults: group gateway.networking.k8s.io, kind Gateway.
    match (r.kind.as_deref().unwrap_or("Gateway"), r.group.as_deref()) {
        ("Service", Some("")) => Some(Attachment::Service),
        ("Gateway", None | Some(GATEWAY_GROUP)) => Some(Attachment::Gateway),
        _ => None,
    }
}

fn check_hostname(h: &str, wildcard: bool) -> Result<(), String> {
    let name = if wildcard { h.strip_prefix("*.").unwrap_or(h) } else { h };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.is_empty() || h.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!(
            "{h:?} is not a lowercase DNS name{}",
            if wildcard { " (a leading \"*.\" is allowed)" } else { "" }
        ));
    }
    if name.parse::<std::net::IpAddr>().is_ok() || name.split('.').all(|l| l.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!("{h:?}: IP addresses are not allowed, only host names"));
    }
    Ok(())
}

/// A rule without matches matches every path.
static DEFAULT_MATCH: RouteMatch = RouteMatch { path: None, headers: Vec::new(), query_params: Vec::new(), method: None };

/// The rule for a request among `routes`, by Gateway API precedence (module docs).
/// Routes on the Gateway whose `hostnames` don't cover the request's host don't apply.
pub fn select<'a>(routes: &[&'a HttpRoute], target: &Target, req: &RouteRequest) -> Selection<'a> {
    let attached: Vec<(&HttpRoute, Attachment)> =
        routes.iter().filter_map(|r| r.attachment(target).map(|a| (*r, a))).collect();
    let service_routes = attached.iter().any(|(_, a)| matches!(a, Attachment::Service));
    let applying = attached.into_iter().filter(|(route, att)| match att {
        Attachment::Service => true,
        Attachment::Gateway => !service_routes && route.host_matches(req.host),
    });
    let mut any = false;
    let mut best: Option<((u8, usize, bool, usize, usize), Selected<'a>)> = None;
    for (route, _) in applying {
        any = true;
        for (rule_index, rule) in route.rules.iter().enumerate() {
            let matches = if rule.matches.is_empty() { std::slice::from_ref(&DEFAULT_MATCH) } else { &rule.matches };
            for m in matches {
                if !m.matches(req) {
                    continue;
                }
                let p = m.precedence();
                if best.as_ref().is_some_and(|(bp, _)| *bp >= p) {
                    continue;
                }
                let matched_prefix = match m.path() {
                    Some(PathMatch::Prefix(p)) => Some(p.as_str()),
                    None => Some(""),
                    _ => None,
                };
                best = Some((p, Selected { route, rule, rule_index, matched_prefix }));
            }
        }
    }
    match (best, any) {
        (Some((_, s)), _) => Selection::Matched(s),
        (None, true) => Selection::NoMatch,
        (None, false) => Selection::NoRoutes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(yaml: &str) -> Vec<HttpRoute> {
        let routes: Vec<HttpRoute> = serde_yaml::from_str(yaml).expect("route yaml");
        for r in &routes {
            r.validate().expect("valid route");
        }
        routes
    }

    fn err(yaml: &str) -> String {
        match serde_yaml::from_str::<Vec<HttpRoute>>(yaml) {
            Err(e) => e.to_string(),
            Ok(rs) => rs.iter().find_map(|r| r.validate().err()).expect("route must be refused"),
        }
    }

    struct Req {
        method: Method,
        path: String,
        query: Option<String>,
        headers: HeaderMap,
        host: String,
    }

    fn req(path: &str) -> Req {
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p.to_string(), Some(q.to_string())),
            None => (path.to_string(), None),
        };
        Req { method: Method::GET, path, query, headers: HeaderMap::new(), host: "echo.default.svc.cluster.local".into() }
    }

    impl Req {
        fn header(mut self, k: &'static str, v: &'static str) -> Req {
            self.headers.append(k, HeaderValue::from_static(v));
            self
        }
        fn method(mut self, m: Method) -> Req {
            self.method = m;
            self
        }
        fn host(mut self, h: &str) -> Req {
            self.host = h.into();
            self
        }
        /// `route#rule` chosen for the echo service on port 80.
        fn pick(&self, routes: &[HttpRoute]) -> Option<String> {
            let gw = ObjectName { namespace: "default".into(), name: "waypoint".into() };
            let svc = ObjectName { namespace: "default".into(), name: "echo".into() };
            let target = Target { gateway: &gw, service: Some(&svc), port: 80 };
            let refs: Vec<&HttpRoute> = routes.iter().collect();
            let r = RouteRequest {
                method: &self.method,
                path: &self.path,
                query: self.query.as_deref(),
                headers: &self.headers,
                host: &self.host,
            };
            match select(&refs, &target, &r) {
                Selection::Matched(s) => Some(format!("{}#{}", s.route.name, s.rule_index)),
                Selection::NoMatch => Some("404".into()),
                Selection::NoRoutes => None,
            }
        }
    }

    const SVC: &str = "parentRefs: [{group: '', kind: Service, name: echo}]";

    #[test]
    fn precedence_follows_gateway_api() {
        let rs = routes(&format!(
            "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /}}}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api/v1/}}}}]\n\
             \x20 - matches: [{{path: {{type: Exact, value: /api/v1/x}}}}]\n\
             \x20 - matches: [{{path: {{type: RegularExpression, value: '/api/v[0-9]+/y.*'}}}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, method: POST}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, headers: [{{name: x-a, value: '1'}}]}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, headers: [{{name: x-a, value: '1'}}, {{name: x-b, value: '1'}}]}}]\n\
             \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, queryParams: [{{name: q, value: 'a b'}}]}}]\n"
        ));
        assert_eq!(req("/other").pick(&rs).as_deref(), Some("a#0"));
        assert_eq!(req("/api").pick(&rs).as_deref(), Some("a#1"));
        assert_eq!(req("/api/").pick(&rs).as_deref(), Some("a#1"));
        assert_eq!(req("/apix").pick(&rs).as_deref(), Some("a#0"), "prefixes match whole segments");
        assert_eq!(req("/api/v1").pick(&rs).as_deref(), Some("a#2"), "'/api/v1/' is the prefix /api/v1");
        assert_eq!(req("/api/v1/x").pick(&rs).as_deref(), Some("a#3"), "exact beats everything");
        assert_eq!(req("/api/v1/yes").pick(&rs).as_deref(), Some("a#4"), "regex beats a prefix");
        assert_eq!(req("/api/v1/nope/y").pick(&rs).as_deref(), Some("a#2"), "regexes match the whole path");
        assert_eq!(req("/api/z").method(Method::POST).pick(&rs).as_deref(), Some("a#5"), "method beats headers");
        assert_eq!(req("/api/z").header("x-a", "1").pick(&rs).as_deref(), Some("a#6"));
        assert_eq!(req("/api/z").header("x-a", "1").header("x-b", "1").pick(&rs).as_deref(), Some("a#7"));
        assert_eq!(req("/api/z?q=a%20b").pick(&rs).as_deref(), Some("a#8"), "query values are decoded");
        assert_eq!(req("/api/z?x=1&q=a%20b&q=c").pick(&rs).as_deref(), Some("a#8"));
        assert_eq!(req("/api/z?Q=a%20b").pick(&rs).as_deref(), Some("a#1"), "names are case-sensitive");
    }

    #[test]
    fn header_values_match_one_by_one() {
        let rs = routes(&format!(
            "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
             \x20 - matches: [{{headers: [{{name: X-Version, value: v2}}]}}]\n\
             \x20 - matches: [{{headers: [{{type: RegularExpression, name: x-user, value: 'adm.n'}}]}}]\n"
        ));
        assert_eq!(req("/").header("x-version", "v2").pick(&rs).as_deref(), Some("a#0"));
        assert_eq!(req("/").header("x-version", "v1").header("x-version", "v2").pick(&rs).as_deref(), Some("a#0"));
        assert_eq!(req("/").header("x-version", "v1,v2").pick(&rs).as_deref(), Some("404"), "never split or joined");
        assert_eq!(req("/").header("x-version", "V2").pick(&rs).as_deref(), Some("404"), "values are case-sensitive");
        assert_eq!(req("/").header("x-user", "admin").pick(&rs).as_deref(), Some("a#1"));
        assert_eq!(req("/").header("x-user", "xadmin").pick(&rs).as_deref(), Some("404"), "regexes are anchored");
    }

    #[test]
    fn ties_go_to_the_first_route_and_rule() {
        let rs = routes(&format!(
            "- name: a\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: PathPrefix, value: /x}}}}]}}, {{matches: [{{path: {{type: PathPrefix, value: /x}}}}]}}]\n\
             - name: b\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: PathPrefix, value: /x/}}}}]}}]\n"
        ));
        assert_eq!(req("/x/1").pick(&rs).as_deref(), Some("a#0"));
    }

    #[test]
    fn attachment_by_service_port_and_gateway() {
        let rs = routes(
            "- name: svc81\n  namespace: default\n  parentRefs: [{group: '', kind: Service, name: echo, port: 81}]\n\
             - name: gw\n  namespace: default\n  parentRefs: [{name: waypoint}]\n  hostnames: ['*.example.com']\n\
             - name: other\n  namespace: default\n  parentRefs: [{group: '', kind: Service, name: other}]\n",
        );
        // Port 80: the Service route is for port 81, so the Gateway route applies, by host.
        assert_eq!(req("/").host("a.example.com").pick(&rs).as_deref(), Some("gw#0"));
        assert_eq!(req("/").host("example.com").pick(&rs), None, "a Gateway route for other hosts does not apply");
        assert_eq!(req("/").pick(&rs), None);
        // A Service route for the request's port takes precedence over Gateway routes.
        let rs = routes(&format!(
            "- name: gw\n  namespace: default\n  parentRefs: [{{name: waypoint}}]\n\
             - name: svc\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: Exact, value: /only}}}}]}}]\n"
        ));
        assert_eq!(req("/only").pick(&rs).as_deref(), Some("svc#0"));
        assert_eq!(req("/x").pick(&rs).as_deref(), Some("404"), "Gateway routes don't apply to a Service with routes");
    }

    #[test]
    fn weighted_backends() {
        let rs = routes(&format!(
            "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
             \x20 - backendRefs: [{{name: v1, port: 80, weight: 90}}, {{name: v2, port: 80, weight: 10}}, {{name: v3, port: 80, weight: 0}}]\n\
             \x20 - backendRefs: [{{name: v1, port: 80, weight: 0}}]\n"
        ));
        let rule = &rs[0].rules[0];
        let mut counts = std::collections::HashMap::new();
        for roll in 0..1000u64 {
            *counts.entry(rule.pick_backend(roll).map(|b| b.name.clone())).or_insert(0) += 1;
        }
        assert_eq!(counts[&Some("v1".to_string())], 900);
        assert_eq!(counts[&Some("v2".to_string())], 100);
        assert!(!counts.contains_key(&Some("v3".to_string())));
        assert!(rs[0].rules[1].pick_backend(7).is_none(), "all weights 0: no backend");
        assert_eq!(rule.backend_refs[0].service("default"), ObjectName { namespace: "default".into(), name: "v1".into() });
    }

    #[test]
    fn filters_rewrite_and_redirect() {
        let rw = |kind: &str, value: &str, path: &str, prefix: Option<&str>| {
            let m: PathModifier = serde_yaml::from_str(&format!(
                "{{type: {kind}, {}: '{value}'}}",
                if kind == "ReplaceFullPath" { "replaceFullPath" } else { "replacePrefixMatch" }
            ))
            .expect("modifier");
            m.apply(path, prefix)
        };
        assert_eq!(rw("ReplacePrefixMatch", "/v2", "/api/items", Some("/api")), "/v2/items");
        assert_eq!(rw("ReplacePrefixMatch", "/v2", "/api", Some("/api")), "/v2");
        assert_eq!(rw("ReplacePrefixMatch", "/v2", "/api/", Some("/api")), "/v2/");
        assert_eq!(rw("ReplacePrefixMatch", "/", "/api/items", Some("/api")), "/items");
        assert_eq!(rw("ReplacePrefixMatch", "/", "/api", Some("/api")), "/");
        assert_eq!(rw("ReplacePrefixMatch", "/v2/", "/api/x", Some("/api")), "/v2/x");
        assert_eq!(rw("ReplacePrefixMatch", "/pre", "/x", Some("")), "/pre/x", "prefix '/' keeps the whole path");
        assert_eq!(rw("ReplaceFullPath", "/new", "/old/x", None), "/new");

        let redirect: RequestRedirect = serde_yaml::from_str("{path: {type: ReplaceFullPath, replaceFullPath: /new}, statusCode: 301}").expect("redirect");
        let (s, l) = redirect.location("http", "echo", Some(80), "/old", Some("q=1"), None);
        assert_eq!((s.as_u16(), l.as_str()), (301, "http://echo/new?q=1"));
        let (s, l) = redirect.location("http", "echo", Some(8080), "/old", None, None);
        assert_eq!((s.as_u16(), l.as_str()), (301, "http://echo:8080/new"));
        let https: RequestRedirect = serde_yaml::from_str("{scheme: https, hostname: secure.example.com}").expect("redirect");
        let (s, l) = https.location("http", "echo", Some(8080), "/a", None, None);
        assert_eq!((s.as_u16(), l.as_str()), (302, "https://secure.example.com/a"), "the scheme's own port");
        let port: RequestRedirect = serde_yaml::from_str("{scheme: https, port: 8443}").expect("redirect");
        assert_eq!(port.location("http", "h", None, "/", None, None).1, "https://h:8443/");

        let mut h = HeaderMap::new();
        h.insert("x-a", HeaderValue::from_static("old"));
        h.append("x-b", HeaderValue::from_static("1"));
        h.insert("x-gone", HeaderValue::from_static("1"));
        let m: HeaderModifier =
            serde_yaml::from_str("{set: [{name: X-A, value: new}], add: [{name: x-b, value: '2'}], remove: [X-Gone]}").expect("modifier");
        m.apply(&mut h);
        assert_eq!(h.get_all("x-a").iter().collect::<Vec<_>>(), ["new"]);
        assert_eq!(h.get_all("x-b").iter().collect::<Vec<_>>(), ["1", "2"]);
        assert!(!h.contains_key("x-gone"));

        let mirror: RequestMirror = serde_yaml::from_str("{backendRef: {name: shadow, port: 80}, percent: 25}").expect("mirror");
        assert!(mirror.sampled(0.2) && !mirror.sampled(0.3));
        let all: RequestMirror = serde_yaml::from_str("{backendRef: {name: shadow, port: 80}}").expect("mirror");
        assert!(all.sampled(0.999));
        let frac: RequestMirror = serde_yaml::from_str("{backendRef: {name: s, port: 80}, fraction: {numerator: 1, denominator: 1000}}").expect("mirror");
        assert!(frac.sampled(0.0005) && !frac.sampled(0.002));
    }

    #[test]
    fn durations() {
        let d = |s: &str| s.parse::<GatewayDuration>().map(|d| d.0);
        assert_eq!(d("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(d("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(d("1m0s500ms"), Ok(Duration::from_millis(60_500)));
        assert_eq!(d("0s"), Ok(Duration::ZERO));
        for bad in ["", "10", "1.5s", "s", "10us", "-1s", "1h1m1s1ms1ms", "123456s", " 1s"] {
            assert!(d(bad).is_err(), "{bad:?}");
        }
        let rs = routes(&format!(
            "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
             \x20 - timeouts: {{request: 3s, backendRequest: 300ms}}\n    retry: {{attempts: 2, backoff: 10ms}}\n\
             \x20 - timeouts: {{request: 0s}}\n"
        ));
        assert_eq!(rs[0].rules[0].request_timeout(), Some(Duration::from_secs(3)));
        assert_eq!(rs[0].rules[0].backend_timeout(), Some(Duration::from_millis(300)));
        let retry = rs[0].rules[0].retry.as_ref().expect("retry");
        assert_eq!((retry.attempts, retry.codes.as_slice(), retry.backoff), (Some(2), &[503][..], Some(Duration::from_millis(10))));
        assert_eq!(rs[0].rules[1].request_timeout(), None, "0s disables the timeout");
    }

    #[test]
    fn bad_routes_are_refused_with_the_field_named() {
        let cases: &[(&str, &str)] = &[
            ("- {name: a, namespace: default}", "parentRefs: required"),
            ("- {name: a, namespace: default, parentRefs: [{kind: Service, name: echo}]}", "parentRefs[0]: kind \"Service\""),
            ("- {name: a, namespace: default, parentRefs: [{group: '', kind: Service, name: echo, namespace: other}]}", "parentRefs[0].namespace"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1}}]}}]}}"), "rules[0].backendRefs[0].port: required"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, namespace: x}}]}}]}}"), "ReferenceGrant"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Exact, value: /a/../b}}}}]}}]}}"), "write \"/b\""),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Regex, value: /a}}}}]}}]}}"), "path type \"Regex\""),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: RegularExpression, value: '(/a'}}}}]}}]}}"), "does not compile"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{method: get}}]}}]}}"), "method \"get\""),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{headers: [{{name: 'bad name', value: x}}]}}]}}]}}"), "not a valid header name"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{timeouts: {{request: 10}}}}]}}"), "is not a duration"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{timeouts: {{request: 1s, backendRequest: 2s}}}}]}}"), "longer than timeouts.request"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestRedirect}}]}}]}}"), "needs its `requestRedirect` field"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: Nope}}]}}]}}"), "filter type \"Nope\""),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Exact, value: /a}}}}], filters: [{{type: URLRewrite, urlRewrite: {{path: {{type: ReplacePrefixMatch, replacePrefixMatch: /b}}}}}}]}}]}}"), "ReplacePrefixMatch needs"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestRedirect, requestRedirect: {{statusCode: 307}}}}]}}]}}"), "statusCode: 307"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{retry: {{codes: [200]}}}}]}}"), "retry.codes[0]"),
            (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRef: [{{name: v1, port: 80}}]}}]}}"), "unknown field `backendRef`"),
            ("- {name: a, namespace: default, parentRefs: [{name: waypoint}], hostnames: ['10.0.0.1']}", "hostnames[0]"),
        ];
        for (yaml, want) in cases {
            let e = err(yaml);
            assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
        }
    }
}
