//! The mesh config's `extensionProviders` that CUSTOM policies name: Istio's
//! `envoyExtAuthzHttp` and `envoyExtAuthzGrpc`, as the `mesh` key of the `istio`
//! ConfigMap writes them (camelCase). Other kinds (tracing, access-log providers) are
//! kept by name only: a CUSTOM policy that names one is refused, as by istiod.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::proto::envoy::r#type::v3::StatusCode;

/// Istio's default check timeout (`timeout` unset): 600 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The part of Istio's MeshConfig the waypoint reads; its other fields are Istio's
/// business and are ignored.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MeshConfig {
    #[serde(default)]
    pub extension_providers: Vec<Value>,
    /// The mesh's trust domain (Istio's default `cluster.local`) and its aliases, which
    /// policies' principals are rewritten with (`authz::trust_domain`).
    #[serde(default)]
    pub trust_domain: Option<String>,
    #[serde(default)]
    pub trust_domain_aliases: Vec<String>,
}

impl MeshConfig {
    pub fn trust_domain_bundle(&self) -> crate::authz::trust_domain::Bundle {
        crate::authz::trust_domain::Bundle::new(
            self.trust_domain
                .as_deref()
                .filter(|t| !t.is_empty())
                .unwrap_or(crate::authz::trust_domain::CLUSTER_LOCAL),
            &self.trust_domain_aliases,
        )
    }
}

/// One provider, checked; `Err` says what is wrong with it (CUSTOM policies that name
/// it then deny what they match, as istiod's "deny due to bad CUSTOM action").
pub type Checked = Result<Provider, String>;

#[derive(Clone, Debug, PartialEq)]
pub enum Provider {
    Http(HttpProvider),
    Grpc(GrpcProvider),
    /// A provider of another kind (`zipkin`, `envoyFileAccessLog`...): not an authorizer.
    NotAuthz(String),
}

/// Where a provider's checks go, and what is done when they fail.
#[derive(Clone, Debug, PartialEq)]
pub struct Common {
    /// `[<namespace>/]<hostname>` of a mesh service, as Istio writes it.
    pub service: String,
    pub port: u16,
    pub timeout: Duration,
    /// Allow the request when the check cannot be made (not when it says deny).
    pub fail_open: bool,
    /// The status of the reply when the check cannot be made (default 403).
    pub status_on_error: u16,
    /// Whether (and how much of) the request body goes with the check.
    pub body: Option<BodySettings>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct HttpProvider {
    pub common: Common,
    /// Prepended to the request's path in the check request.
    pub path_prefix: String,
    /// Request headers sent in the check besides Host, Method, Path, Content-Length and
    /// Authorization (which Envoy always sends).
    pub include_request_headers: Vec<HeaderMatch>,
    pub include_additional_headers: BTreeMap<String, String>,
    /// Check response headers set on the request to the backend when allowed.
    pub headers_to_upstream_on_allow: Vec<HeaderMatch>,
    /// Check response headers in the reply when denied (all but a few when empty).
    pub headers_to_downstream_on_deny: Vec<HeaderMatch>,
    /// Check response headers added to the backend's response when allowed.
    pub headers_to_downstream_on_allow: Vec<HeaderMatch>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GrpcProvider {
    pub common: Common,
}

impl Provider {
    /// As MeshConfig names the kind.
    pub fn kind(&self) -> &str {
        match self {
            Provider::Http(_) => "envoyExtAuthzHttp",
            Provider::Grpc(_) => "envoyExtAuthzGrpc",
            Provider::NotAuthz(k) => k,
        }
    }

    pub fn common(&self) -> Option<&Common> {
        match self {
            Provider::Http(h) => Some(&h.common),
            Provider::Grpc(g) => Some(&g.common),
            Provider::NotAuthz(_) => None,
        }
    }
}

/// An Istio header name match: exact, `prefix*` or `*suffix`, ignoring case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
}

impl HeaderMatch {
    fn parse(field: &str, s: &str) -> Result<HeaderMatch, String> {
        if s == "*" {
            return Err(format!("{field}: a single wildcard (\"*\") is not supported, change it to either prefix or suffix match"));
        }
        let s = s.to_ascii_lowercase();
        Ok(if let Some(suffix) = s.strip_prefix('*') {
            HeaderMatch::Suffix(suffix.to_string())
        } else if let Some(prefix) = s.strip_suffix('*') {
            HeaderMatch::Prefix(prefix.to_string())
        } else {
            HeaderMatch::Exact(s)
        })
    }

    /// `name` is lowercase, as `http::HeaderName`s are.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            HeaderMatch::Exact(e) => name == e,
            HeaderMatch::Prefix(p) => name.starts_with(p.as_str()),
            HeaderMatch::Suffix(s) => name.ends_with(s.as_str()),
        }
    }
}

pub fn any_match(list: &[HeaderMatch], name: &str) -> bool {
    list.iter().any(|m| m.matches(name))
}

/// Istio's provider names: DNS-1123 labels.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!("name {name:?}: provider names are lowercase letters, digits and '-' (at most 63, not starting or ending with '-')"))
    }
}

/// Every provider of the list by name, each checked; `Err` for the list itself
/// (an entry without a name, two with one name) names the entry.
pub fn parse_all(list: &[Value]) -> Result<BTreeMap<String, Checked>, String> {
    let mut out = BTreeMap::new();
    for (i, v) in list.iter().enumerate() {
        let Some(obj) = v.as_object() else {
            return Err(format!(
                "extensionProviders[{i}]: expected a map with name and one provider"
            ));
        };
        let name = obj.get("name").and_then(Value::as_str).unwrap_or_default();
        check_name(name).map_err(|e| format!("extensionProviders[{i}].{e}"))?;
        let checked = parse_one(obj).map_err(|e| format!("extensionProviders[{i}].{e}"));
        if out.insert(name.to_string(), checked).is_some() {
            return Err(format!("extensionProviders[{i}].name: {name:?} is used twice; provider names must be unique"));
        }
    }
    Ok(out)
}

fn parse_one(obj: &serde_json::Map<String, Value>) -> Result<Provider, String> {
    let kinds: Vec<&String> = obj.keys().filter(|k| *k != "name").collect();
    let [kind] = kinds.as_slice() else {
        return Err(format!(
            "{}: exactly one provider kind per entry, found {}",
            kinds
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            kinds.len()
        ));
    };
    let body = &obj[kind.as_str()];
    match kind.as_str() {
        "envoyExtAuthzHttp" => {
            let raw: RawHttp = serde_json::from_value(body.clone())
                .map_err(|e| format!("envoyExtAuthzHttp: {e}"))?;
            raw.check()
                .map(Provider::Http)
                .map_err(|e| format!("envoyExtAuthzHttp.{e}"))
        }
        "envoyExtAuthzGrpc" => {
            let raw: RawGrpc = serde_json::from_value(body.clone())
                .map_err(|e| format!("envoyExtAuthzGrpc: {e}"))?;
            raw.check()
                .map(Provider::Grpc)
                .map_err(|e| format!("envoyExtAuthzGrpc.{e}"))
        }
        other => Ok(Provider::NotAuthz(other.to_string())),
    }
}

/// A port as a number or a string of digits (YAML writes both).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum RawPort {
    Number(u64),
    Text(String),
}

/// Istio's `includeRequestBodyInCheck` (Envoy's `with_request_body`).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawBody {
    #[serde(default)]
    max_request_bytes: u32,
    #[serde(default)]
    allow_partial_message: bool,
    #[serde(default)]
    pack_as_bytes: bool,
}

/// The most of a request body a check may carry: it is held in memory per request.
pub const MAX_CHECK_BODY: u32 = 8 << 20;

/// The request body in a check (Envoy's BufferSettings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodySettings {
    /// Bytes of the body the check carries, at most.
    pub max: usize,
    /// A longer body is checked by its first `max` bytes; else it is refused with 413.
    pub allow_partial: bool,
    /// gRPC: the body as `raw_body` (bytes) rather than `body` (a string).
    pub as_bytes: bool,
}

/// The fields both kinds share (each kind's struct lists them, since serde cannot
/// flatten into a struct that denies unknown fields).
struct RawCommon {
    service: String,
    port: RawPort,
    timeout: Option<String>,
    fail_open: bool,
    status_on_error: Option<RawPort>,
    include_request_body_in_check: Option<RawBody>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawHttp {
    service: String,
    port: RawPort,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    fail_open: bool,
    #[serde(default)]
    status_on_error: Option<RawPort>,
    #[serde(default)]
    include_request_body_in_check: Option<RawBody>,
    #[serde(default)]
    path_prefix: String,
    #[serde(default)]
    include_request_headers_in_check: Vec<String>,
    /// Deprecated by Istio; used only when `includeRequestHeadersInCheck` is empty.
    #[serde(default)]
    include_headers_in_check: Vec<String>,
    #[serde(default)]
    include_additional_headers_in_check: BTreeMap<String, String>,
    #[serde(default)]
    headers_to_upstream_on_allow: Vec<String>,
    #[serde(default)]
    headers_to_downstream_on_deny: Vec<String>,
    #[serde(default)]
    headers_to_downstream_on_allow: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawGrpc {
    service: String,
    port: RawPort,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    fail_open: bool,
    #[serde(default)]
    status_on_error: Option<RawPort>,
    #[serde(default)]
    include_request_body_in_check: Option<RawBody>,
}

impl RawCommon {
    fn check(self) -> Result<Common, String> {
        if self.service.is_empty() {
            return Err(
                "service: required ([<namespace>/]<hostname> of the authorizer's Service)".into(),
            );
        }
        let port = match &self.port {
            RawPort::Number(n) => u16::try_from(*n).ok(),
            RawPort::Text(s) => s.parse::<u16>().ok(),
        }
        .filter(|p| *p != 0)
        .ok_or_else(|| "port: must be in the range [1, 65535]".to_string())?;
        let timeout = match &self.timeout {
            None => DEFAULT_TIMEOUT,
            Some(t) => parse_duration(t).map_err(|e| format!("timeout: {e}"))?,
        };
        let status_on_error = match &self.status_on_error {
            None => 403,
            Some(s) => {
                let code = match s {
                    RawPort::Number(n) => i32::try_from(*n).ok(),
                    RawPort::Text(t) => t.parse::<i32>().ok(),
                };
                match code.map(StatusCode::try_from) {
                    Some(Ok(c)) if c != StatusCode::Empty => c as i32 as u16,
                    _ => return Err(format!("statusOnError: unsupported {s:?}: one of Envoy's HTTP status codes, e.g. \"403\" or \"503\"")),
                }
            }
        };
        let body = match self.include_request_body_in_check {
            None => None,
            Some(b) => {
                // Envoy requires a limit above 0; the waypoint bounds what a request may hold.
                if b.max_request_bytes == 0 || b.max_request_bytes > MAX_CHECK_BODY {
                    return Err(format!("includeRequestBodyInCheck.maxRequestBytes: must be 1 to {MAX_CHECK_BODY} (the bytes of the body the check carries)"));
                }
                Some(BodySettings {
                    max: b.max_request_bytes as usize,
                    allow_partial: b.allow_partial_message,
                    as_bytes: b.pack_as_bytes,
                })
            }
        };
        Ok(Common {
            service: self.service,
            port,
            timeout,
            fail_open: self.fail_open,
            status_on_error,
            body,
        })
    }
}

impl RawHttp {
    fn check(self) -> Result<HttpProvider, String> {
        let common = RawCommon {
            service: self.service,
            port: self.port,
            timeout: self.timeout,
            fail_open: self.fail_open,
            status_on_error: self.status_on_error,
            include_request_body_in_check: self.include_request_body_in_check,
        }
        .check()?;
        if !self.path_prefix.is_empty()
            && (!self.path_prefix.starts_with('/')
                || self.path_prefix.parse::<http::uri::PathAndQuery>().is_err())
        {
            return Err(format!(
                "pathPrefix: must be a path beginning with `/`, found {:?}",
                self.path_prefix
            ));
        }
        let list = |field: &str, v: &[String]| {
            v.iter()
                .map(|s| HeaderMatch::parse(field, s))
                .collect::<Result<Vec<_>, _>>()
        };
        let include = if self.include_request_headers_in_check.is_empty() {
            list("includeHeadersInCheck", &self.include_headers_in_check)?
        } else {
            list(
                "includeRequestHeadersInCheck",
                &self.include_request_headers_in_check,
            )?
        };
        for (k, v) in &self.include_additional_headers_in_check {
            if http::HeaderName::from_bytes(k.as_bytes()).is_err()
                || http::HeaderValue::from_str(v).is_err()
            {
                return Err(format!(
                    "includeAdditionalHeadersInCheck: {k:?}: {v:?} is not a valid header"
                ));
            }
        }
        Ok(HttpProvider {
            common,
            path_prefix: self.path_prefix,
            include_request_headers: include,
            include_additional_headers: self.include_additional_headers_in_check,
            headers_to_upstream_on_allow: list(
                "headersToUpstreamOnAllow",
                &self.headers_to_upstream_on_allow,
            )?,
            headers_to_downstream_on_deny: list(
                "headersToDownstreamOnDeny",
                &self.headers_to_downstream_on_deny,
            )?,
            headers_to_downstream_on_allow: list(
                "headersToDownstreamOnAllow",
                &self.headers_to_downstream_on_allow,
            )?,
        })
    }
}

impl RawGrpc {
    fn check(self) -> Result<GrpcProvider, String> {
        let common = RawCommon {
            service: self.service,
            port: self.port,
            timeout: self.timeout,
            fail_open: self.fail_open,
            status_on_error: self.status_on_error,
            include_request_body_in_check: self.include_request_body_in_check,
        };
        Ok(GrpcProvider {
            common: common.check()?,
        })
    }
}

/// A protobuf JSON duration (`"0.5s"`, `"10s"`), as MeshConfig writes its timeouts;
/// `ms`, `m` and `h` units are taken too.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration like \"0.5s\" or \"10s\"");
    let (num, unit) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        return Err(bad());
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad());
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    let secs = v * unit;
    if !secs.is_finite() || secs <= 0.0 || secs > 315_576_000_000.0 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}
