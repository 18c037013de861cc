//! The HTTPRoute model, as the config file and the Kubernetes API write it. Deserializing
//! compiles what a request will need (regexes, header names and values, methods, paths
//! checked against their normalized form), so a loaded route never meets a config error
//! at request time; what serde cannot check is in `validate`.

use std::time::Duration;

use http::header::HeaderName;
use http::Method;
use regex::Regex;
use serde::Deserialize;

use super::action::{Answer, Matched, UriRewrite};
use super::cors::Cors;
use super::duration::GatewayDuration;
use crate::object::{ObjectName, ObjectRef, GATEWAY_GROUP};

mod filter;

pub use filter::{
    Filter, Fraction, HeaderModifier, HttpHeader, PathModifier, RequestMirror, RequestRedirect,
    UrlRewrite,
};

/// Compiled regex size cap: a config's regex must not be able to take the proxy's memory.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRoute {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub parent_refs: Vec<ObjectRef>,
    /// Matched against Host for routes attached to the waypoint's Gateway; ignored for
    /// Service parents, where the Service (its VIP) already names the destination.
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// Absent: one rule matching every request, sent to the parent Service.
    #[serde(default = "default_rules")]
    pub rules: Vec<RouteRule>,
    /// What it was written as: GRPCRoutes and TCPRoutes are held as HTTPRoutes, a
    /// TLSRoute's parents as one (ReferenceGrants name the kind).
    #[serde(skip)]
    pub kind: RouteKind,
    /// A VirtualService's `exportTo`: it applies only through a waypoint of a namespace
    /// it is exported to (empty for Gateway API routes, which have none).
    #[serde(skip)]
    pub export_to: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RouteKind {
    #[default]
    Http,
    Grpc,
    Tcp,
    Tls,
    Virtual,
}

impl RouteKind {
    /// The Gateway API kind.
    pub fn name(self) -> &'static str {
        match self {
            RouteKind::Http => "HTTPRoute",
            RouteKind::Grpc => "GRPCRoute",
            RouteKind::Tcp => "TCPRoute",
            RouteKind::Tls => "TLSRoute",
            RouteKind::Virtual => "VirtualService",
        }
    }
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
    pub session_persistence: Option<SessionPersistence>,
    /// A VirtualService's fault injection (HTTPRoute has none).
    #[serde(skip)]
    pub fault: Option<Fault>,
    /// Why the rule cannot be applied as written (a valid field the waypoint cannot
    /// enforce): requests it matches fail closed with 503, naming it, instead of being
    /// served otherwise than asked.
    #[serde(skip)]
    pub unenforceable: Option<String>,
    /// A VirtualService's `redirect` or `directResponse`: the waypoint answers.
    #[serde(skip)]
    pub answer: Option<Answer>,
    /// A VirtualService's `rewrite.uri` or `rewrite.uriRegexRewrite`.
    #[serde(skip)]
    pub uri_rewrite: Option<UriRewrite>,
}

/// Gateway API `SessionPersistence`: requests of one session go to the endpoint the
/// first was sent to, named in a cookie (default) or header the waypoint sets.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionPersistence {
    #[serde(default)]
    pub session_name: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: SessionKind,
    #[serde(default)]
    pub absolute_timeout: Option<GatewayDuration>,
    #[serde(default)]
    pub idle_timeout: Option<GatewayDuration>,
    #[serde(default)]
    pub cookie_config: Option<CookieConfig>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum SessionKind {
    #[default]
    Cookie,
    Header,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CookieConfig {
    #[serde(default)]
    pub lifetime_type: Option<String>,
}

impl SessionPersistence {
    /// The cookie or header name (Gateway API leaves the default to the implementation).
    pub fn name(&self) -> &str {
        self.session_name.as_deref().unwrap_or("x-waypoint-session")
    }
}

/// Istio's HTTPFaultInjection: a fixed delay and/or an abort with a status, each for a
/// percentage of requests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fault {
    pub delay: Option<(Duration, f64)>,
    pub abort: Option<(u16, f64)>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteMatch {
    /// Absent: the path prefix "/".
    pub path: Option<PathMatch>,
    pub headers: Vec<HeaderMatch>,
    pub query_params: Vec<QueryParamMatch>,
    pub method: Option<MethodMatch>,
    /// A VirtualService match's other conditions (Gateway API has none of them).
    #[serde(skip)]
    pub vs: Option<Box<VsConditions>>,
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
    pub(super) fn new(kind: &str, value: &str) -> Result<PathMatch, String> {
        match kind {
            "Exact" | "PathPrefix" => {
                if !value.starts_with('/') {
                    return Err(format!("path value {value:?} must start with '/'"));
                }
                // Requests are matched after `path::normalize`; a value that isn't in
                // that form could never match, which would silently disable the rule.
                match crate::path::normalize(value) {
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
            _ => Err(format!(
                "path type {kind:?} is not one of Exact, PathPrefix, RegularExpression"
            )),
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
    pub(super) fn new(kind: &str, value: &str) -> Result<ValueMatch, String> {
        match kind {
            "Exact" => Ok(ValueMatch::Exact(value.to_string())),
            "RegularExpression" => Ok(ValueMatch::Regex(full_match_regex(value)?)),
            _ => Err(format!(
                "match type {kind:?} is not one of Exact, RegularExpression"
            )),
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
        let name = HeaderName::from_bytes(raw.name.as_bytes()).map_err(|_| {
            serde::de::Error::custom(format!("{:?} is not a valid header name", raw.name))
        })?;
        Ok(HeaderMatch {
            name,
            value: ValueMatch::new(&raw.kind, &raw.value).map_err(serde::de::Error::custom)?,
        })
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
            return Err(serde::de::Error::custom(
                "query parameter name must not be empty",
            ));
        }
        Ok(QueryParamMatch {
            name: raw.name,
            value: ValueMatch::new(&raw.kind, &raw.value).map_err(serde::de::Error::custom)?,
        })
    }
}

/// An HTTP method, as written in Gateway API (uppercase, exact).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MethodMatch(pub Method);

impl<'de> Deserialize<'de> for MethodMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const METHODS: [&str; 9] = [
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ];
        let s = String::deserialize(d)?;
        if !METHODS.contains(&s.as_str()) {
            return Err(serde::de::Error::custom(format!(
                "method {s:?} is not one of {}",
                METHODS.join(", ")
            )));
        }
        Method::from_bytes(s.as_bytes())
            .map(MethodMatch)
            .map_err(serde::de::Error::custom)
    }
}

/// A weighted backend: a Service and its port.
#[derive(Clone, Debug, Default)]
pub struct BackendRef {
    pub backend: ObjectRef,
    /// Share of the rule's requests, relative to the other backends (default 1; 0: none).
    pub weight: u32,
    /// Applied only to requests sent to this backend: header modifiers, as Istio
    /// supports them there (validation refuses the rest).
    pub filters: Vec<Filter>,
    /// A DestinationRule subset of the Service (VirtualService destinations only).
    pub subset: Option<String>,
}

/// Gateway API's `HTTPBackendRef` shape: an object reference without `sectionName`,
/// plus `weight` and `filters`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawBackendRef {
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    filters: Vec<Filter>,
}

fn one() -> u32 {
    1
}

impl BackendRef {
    /// The backend's Service, its namespace defaulting to the route's.
    pub fn service(&self, route_ns: &str) -> ObjectName {
        self.backend.object_name(route_ns)
    }

    /// Its RequestHeaderModifier (validation allows one).
    pub fn request_modifier(&self) -> Option<&HeaderModifier> {
        self.filters.iter().find_map(|f| match f {
            Filter::RequestHeaderModifier(m) => Some(m),
            _ => None,
        })
    }

    /// Its ResponseHeaderModifier (validation allows one).
    pub fn response_modifier(&self) -> Option<&HeaderModifier> {
        self.filters.iter().find_map(|f| match f {
            Filter::ResponseHeaderModifier(m) => Some(m),
            _ => None,
        })
    }
}

impl<'de> Deserialize<'de> for BackendRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let RawBackendRef {
            group,
            kind,
            name,
            namespace,
            port,
            weight,
            filters,
        } = RawBackendRef::deserialize(d)?;
        Ok(BackendRef {
            backend: ObjectRef {
                group,
                kind,
                name,
                namespace,
                port,
                section_name: None,
            },
            weight,
            filters,
            subset: None,
        })
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
    pub fn request_timeout(&self) -> Option<Duration> {
        self.timeouts
            .as_ref()
            .and_then(|t| t.request)
            .and_then(GatewayDuration::as_timeout)
    }

    pub fn backend_timeout(&self) -> Option<Duration> {
        self.timeouts
            .as_ref()
            .and_then(|t| t.backend_request)
            .and_then(GatewayDuration::as_timeout)
    }

    /// The rule's CORS policy (validation allows one).
    pub fn cors(&self) -> Option<&Cors> {
        self.filters.iter().find_map(|f| match f {
            Filter::Cors(c) => Some(c),
            _ => None,
        })
    }
}

/// How a route attaches to what a request is addressed to.
pub(super) enum Attachment {
    Service,
    /// A ServiceEntry: every one of its hosts (Istio's route conversion gives the route
    /// the ServiceEntry's `hosts`).
    ServiceEntry,
    Gateway,
}

/// What a parent ref names, by Gateway API's defaults (group gateway.networking.k8s.io,
/// kind Gateway); None for kinds a waypoint does not serve.
pub(super) fn parent_kind(r: &ObjectRef) -> Option<Attachment> {
    match (r.kind.as_deref().unwrap_or("Gateway"), r.group.as_deref()) {
        ("Service", Some("")) => Some(Attachment::Service),
        ("ServiceEntry", Some(crate::object::NETWORKING_GROUP)) => Some(Attachment::ServiceEntry),
        ("Gateway", None | Some(GATEWAY_GROUP)) => Some(Attachment::Gateway),
        _ => None,
    }
}

/// The extra conditions of one VirtualService match.
#[derive(Clone, Debug, Default)]
pub struct VsConditions {
    /// How much of the path the uri match covers (for `rewrite.uri`).
    pub matched: Matched,
    /// The service port the request was sent to (Istio drops the match on other ports).
    pub port: Option<u16>,
    /// Against `:authority` as the client sent it (Host for HTTP/1.1, port included).
    pub authority: Option<ValueMatch>,
    /// Against `:scheme`: `http` at the waypoint (plain HTTP inside the tunnel).
    pub scheme: Option<ValueMatch>,
    /// A `method` prefix or regex (Istio: a `:method` header match); exact ones are
    /// the route match's own.
    pub method: Option<ValueMatch>,
    /// Each must not match: a missing header counts as the empty value, except for a
    /// presence-only match (`regex: ".*"`, `prefix: ""`...), which then matches only a
    /// request without the header (Envoy's `invert_match` with
    /// `treat_missing_header_as_empty`).
    pub without_headers: Vec<(HeaderMatch, bool)>,
    /// `sourceNamespace`: the match applies only when it is the waypoint's namespace
    /// (Istio's `sourceMatchHTTP` with the waypoint as the proxy).
    pub source_namespace: Option<String>,
    /// A match Istio's waypoint drops (`sourceLabels`, `gateways` without `mesh`): kept
    /// so rule numbers stay as written, never matching.
    pub dropped: bool,
}
