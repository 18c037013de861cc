//! Istio `VirtualService` on a waypoint (what Istio's ambient waypoints apply to the
//! Services in `hosts`), held as the HTTPRoute it amounts to, with its fault injection:
//! `match` (uri exact / prefix / regex, headers, method, queryParams), `route`
//! destinations with weights, ports, DestinationRule subsets and their own `headers`,
//! rule `headers`, `rewrite.authority`, `timeout`, `retries` and `fault` (delay and
//! abort, by percentage). What it cannot express exactly is refused with the field named
//! (the VirtualService then does not apply): redirects, mirrors, `rewrite.uri`, CORS,
//! `sourceLabels`, `gateways` other than `mesh`, hosts that are not Kubernetes Services.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::duration::GatewayDuration;
use super::model::{
    BackendRef, Fault, Filter, HeaderMatch, HeaderModifier, HttpHeader, HttpRoute, MethodMatch,
    PathMatch, QueryParamMatch, Retry, RouteKind, RouteMatch, RouteRule, Timeouts, UrlRewrite,
    ValueMatch,
};
use crate::extauthz::provider::parse_duration;
use crate::object::ObjectRef;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualService {
    pub name: String,
    pub namespace: String,
    pub hosts: Vec<String>,
    #[serde(default)]
    pub gateways: Vec<String>,
    #[serde(default)]
    pub http: Vec<VsHttpRoute>,
    #[serde(default)]
    pub export_to: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsHttpRoute {
    pub name: Option<String>,
    #[serde(rename = "match")]
    pub matches: Vec<VsMatch>,
    pub route: Vec<VsDestinationWeight>,
    pub rewrite: Option<VsRewrite>,
    pub timeout: Option<String>,
    pub retries: Option<VsRetries>,
    pub fault: Option<VsFault>,
    pub headers: Option<VsHeaders>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsMatch {
    pub name: Option<String>,
    pub uri: Option<StringMatch>,
    pub method: Option<StringMatch>,
    pub headers: BTreeMap<String, StringMatch>,
    pub query_params: BTreeMap<String, StringMatch>,
}

/// Istio's StringMatch: one of exact, prefix, regex.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StringMatch {
    pub exact: Option<String>,
    pub prefix: Option<String>,
    pub regex: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VsDestinationWeight {
    pub destination: VsDestination,
    #[serde(default)]
    pub weight: Option<u32>,
    #[serde(default)]
    pub headers: Option<VsHeaders>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VsDestination {
    pub host: String,
    #[serde(default)]
    pub subset: Option<String>,
    #[serde(default)]
    pub port: Option<VsPort>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsPort {
    pub number: u16,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsRewrite {
    pub uri: Option<String>,
    pub authority: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsRetries {
    pub attempts: Option<u32>,
    pub per_try_timeout: Option<String>,
    pub retry_on: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsFault {
    pub delay: Option<VsDelay>,
    pub abort: Option<VsAbort>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsDelay {
    pub fixed_delay: Option<String>,
    pub percentage: Option<Percent>,
    /// Deprecated integer percent.
    pub percent: Option<u32>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsAbort {
    pub http_status: Option<u16>,
    pub percentage: Option<Percent>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Percent {
    pub value: f64,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsHeaders {
    pub request: Option<VsHeaderOps>,
    pub response: Option<VsHeaderOps>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsHeaderOps {
    pub set: BTreeMap<String, String>,
    pub add: BTreeMap<String, String>,
    pub remove: Vec<String>,
}

/// The Service a VirtualService host names (in namespace `ns`), if it is one.
pub fn host_service(host: &str, ns: &str) -> Option<crate::object::ObjectName> {
    service_ref(host, ns).map(|(name, namespace)| crate::object::ObjectName { namespace, name })
}

/// `reviews` (in `ns`) or `reviews.<ns>.svc.<domain>`: the Service named, or None.
fn service_ref(host: &str, ns: &str) -> Option<(String, String)> {
    if !host.contains('.') {
        return (!host.is_empty() && host != "*").then(|| (host.to_string(), ns.to_string()));
    }
    let mut labels = host.split('.');
    let (name, svc_ns, svc) = (labels.next()?, labels.next()?, labels.next()?);
    (svc == "svc" && !name.is_empty() && !svc_ns.is_empty())
        .then(|| (name.to_string(), svc_ns.to_string()))
}

impl StringMatch {
    /// As a full-match regex source, or an exact value.
    fn value(&self, field: &str) -> Result<ValueMatch, String> {
        match (&self.exact, &self.prefix, &self.regex) {
            (Some(e), None, None) => Ok(ValueMatch::Exact(e.clone())),
            (None, Some(p), None) => {
                ValueMatch::new("RegularExpression", &format!("{}.*", regex::escape(p)))
                    .map_err(|e| format!("{field}: {e}"))
            }
            (None, None, Some(r)) => {
                ValueMatch::new("RegularExpression", r).map_err(|e| format!("{field}: {e}"))
            }
            _ => Err(format!("{field}: set exactly one of exact, prefix, regex")),
        }
    }
}

fn ops(ops: &VsHeaderOps, field: &str) -> Result<HeaderModifier, String> {
    let header = |k: &String, v: &String| -> Result<HttpHeader, String> {
        let name = http::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| format!("{field}: {k:?} is not a header name"))?;
        let value = http::HeaderValue::from_str(v)
            .map_err(|_| format!("{field}: {v:?} is not a header value"))?;
        Ok(HttpHeader { name, value })
    };
    Ok(HeaderModifier {
        set: ops
            .set
            .iter()
            .map(|(k, v)| header(k, v))
            .collect::<Result<_, _>>()?,
        add: ops
            .add
            .iter()
            .map(|(k, v)| header(k, v))
            .collect::<Result<_, _>>()?,
        remove: ops.remove.clone(),
    })
}

/// Istio's `retryOn` policies as the status codes the waypoint retries on (503 and
/// 504 also stand for a failed connection and a timeout).
fn retry_codes(on: &str) -> Result<Vec<u16>, String> {
    let mut codes = Vec::new();
    for p in on.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match p {
            "5xx" => codes.extend(500..=599),
            "gateway-error" => codes.extend([502, 503, 504]),
            "connect-failure" | "refused-stream" | "reset" | "unavailable" => codes.push(503),
            "retriable-4xx" => codes.push(409),
            "retriable-status-codes" | "cancelled" | "deadline-exceeded" | "resource-exhausted" => {
            }
            n => codes.push(
                n.parse::<u16>()
                    .ok()
                    .filter(|c| (100..600).contains(c))
                    .ok_or_else(|| {
                        format!("retryOn: {n:?} is not a retry policy or status code")
                    })?,
            ),
        }
    }
    codes.sort_unstable();
    codes.dedup();
    Ok(codes)
}

fn percent(p: &Option<Percent>, legacy: Option<u32>, field: &str) -> Result<f64, String> {
    let v = p
        .as_ref()
        .map(|p| p.value)
        .or(legacy.map(f64::from))
        .unwrap_or(100.0);
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("{field}.percentage.value: 0 to 100"));
    }
    Ok(v)
}

impl VirtualService {
    /// The HTTPRoute it amounts to; errors name the field.
    pub fn to_http(&self) -> Result<HttpRoute, String> {
        if let Some(g) = self.gateways.iter().find(|g| *g != "mesh") {
            return Err(format!(
                "gateways: {g:?}: only `mesh` (the waypoint) is served here"
            ));
        }
        let mut parent_refs = Vec::new();
        for (i, h) in self.hosts.iter().enumerate() {
            let (name, namespace) = service_ref(h, &self.namespace)
                .ok_or_else(|| format!("hosts[{i}]: {h:?} is not a Kubernetes Service (`name` or `name.namespace.svc.<domain>`)"))?;
            if namespace != self.namespace {
                return Err(format!("hosts[{i}]: {h:?} is in another namespace; the waypoint applies a VirtualService to its own namespace's Services"));
            }
            parent_refs.push(ObjectRef {
                group: Some(String::new()),
                kind: Some("Service".into()),
                name,
                ..ObjectRef::default()
            });
        }
        if parent_refs.is_empty() {
            return Err("hosts: required".into());
        }
        let mut rules = Vec::new();
        for (i, r) in self.http.iter().enumerate() {
            rules.push(
                r.to_rule(&self.namespace)
                    .map_err(|e| format!("http[{i}].{e}"))?,
            );
        }
        if rules.is_empty() {
            return Err("http: at least one route".into());
        }
        let route = HttpRoute {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            parent_refs,
            hostnames: Vec::new(),
            rules,
            kind: RouteKind::Virtual,
            export_to: self.export_to.clone(),
        };
        // Checked as an HTTPRoute; a destination may leave out its port (the request's).
        let mut check = route.clone();
        for b in check
            .rules
            .iter_mut()
            .flat_map(|r| r.backend_refs.iter_mut())
        {
            b.backend.port.get_or_insert(1);
        }
        check.validate()?;
        Ok(route)
    }
}

impl VsHttpRoute {
    fn to_rule(&self, ns: &str) -> Result<RouteRule, String> {
        let mut matches = Vec::new();
        for (j, m) in self.matches.iter().enumerate() {
            let at = format!("match[{j}]");
            let path = match &m.uri {
                None => None,
                Some(u) => Some(
                    match (&u.exact, &u.prefix, &u.regex) {
                        (Some(e), None, None) => PathMatch::new("Exact", e),
                        // Istio's prefix is a string prefix, not Gateway API's by path element.
                        (None, Some(p), None) => {
                            PathMatch::new("RegularExpression", &format!("{}.*", regex::escape(p)))
                        }
                        (None, None, Some(r)) => PathMatch::new("RegularExpression", r),
                        _ => Err("set exactly one of exact, prefix, regex".into()),
                    }
                    .map_err(|e| format!("{at}.uri: {e}"))?,
                ),
            };
            let method = match &m.method {
                None => None,
                Some(StringMatch {
                    exact: Some(e),
                    prefix: None,
                    regex: None,
                }) => Some(MethodMatch(
                    http::Method::from_bytes(e.as_bytes())
                        .map_err(|_| format!("{at}.method: {e:?} is not a method"))?,
                )),
                Some(_) => return Err(format!("{at}.method: only exact")),
            };
            let mut headers = Vec::new();
            for (k, v) in &m.headers {
                let name = http::HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| format!("{at}.headers: {k:?} is not a header name"))?;
                headers.push(HeaderMatch {
                    name,
                    value: v.value(&format!("{at}.headers.{k}"))?,
                });
            }
            let mut query_params = Vec::new();
            for (k, v) in &m.query_params {
                query_params.push(QueryParamMatch {
                    name: k.clone(),
                    value: v.value(&format!("{at}.queryParams.{k}"))?,
                });
            }
            matches.push(RouteMatch {
                path,
                headers,
                query_params,
                method,
            });
        }
        let mut backend_refs = Vec::new();
        let one = self.route.len() == 1;
        for (k, d) in self.route.iter().enumerate() {
            let at = format!("route[{k}]");
            if d.destination.subset.as_deref() == Some("") {
                return Err(format!("{at}.destination.subset: must not be empty"));
            }
            // Per-destination headers: the backend's own header modifiers (Istio's
            // weighted-cluster headers).
            let mut filters = Vec::new();
            if let Some(h) = &d.headers {
                if let Some(req) = &h.request {
                    filters.push(Filter::RequestHeaderModifier(ops(
                        req,
                        &format!("{at}.headers.request"),
                    )?));
                }
                if let Some(resp) = &h.response {
                    filters.push(Filter::ResponseHeaderModifier(ops(
                        resp,
                        &format!("{at}.headers.response"),
                    )?));
                }
            }
            let (name, namespace) = service_ref(&d.destination.host, ns).ok_or_else(|| {
                format!(
                    "{at}.destination.host: {:?} is not a Kubernetes Service",
                    d.destination.host
                )
            })?;
            let weight = match d.weight {
                None | Some(0) if one => 1,
                w => w.unwrap_or(0),
            };
            backend_refs.push(BackendRef {
                backend: ObjectRef {
                    name,
                    namespace: (namespace != ns).then_some(namespace),
                    port: d.destination.port.as_ref().map(|p| p.number),
                    ..ObjectRef::default()
                },
                weight,
                filters,
                subset: d.destination.subset.clone(),
            });
        }
        let mut filters = Vec::new();
        if let Some(h) = &self.headers {
            if let Some(req) = &h.request {
                filters.push(Filter::RequestHeaderModifier(ops(req, "headers.request")?));
            }
            if let Some(resp) = &h.response {
                filters.push(Filter::ResponseHeaderModifier(ops(
                    resp,
                    "headers.response",
                )?));
            }
        }
        if let Some(rw) = &self.rewrite {
            if rw.uri.is_some() {
                return Err("rewrite.uri: not supported (rewrite.authority is)".into());
            }
            if let Some(a) = &rw.authority {
                filters.push(Filter::UrlRewrite(UrlRewrite {
                    hostname: Some(a.clone()),
                    path: None,
                }));
            }
        }
        let dur = |s: &str, field: &str| {
            parse_duration(s)
                .map(GatewayDuration)
                .map_err(|e| format!("{field}: {e}"))
        };
        let request = self
            .timeout
            .as_deref()
            .map(|t| dur(t, "timeout"))
            .transpose()?;
        let per_try = self
            .retries
            .as_ref()
            .and_then(|r| r.per_try_timeout.as_deref())
            .map(|t| dur(t, "retries.perTryTimeout"))
            .transpose()?;
        let timeouts = (request.is_some() || per_try.is_some()).then_some(Timeouts {
            request,
            backend_request: per_try,
        });
        let retry = match &self.retries {
            Some(r) if r.attempts.unwrap_or(0) > 0 => Some(Retry {
                codes: retry_codes(
                    r.retry_on
                        .as_deref()
                        .unwrap_or("connect-failure,refused-stream,unavailable,cancelled,503"),
                )
                .map_err(|e| format!("retries.{e}"))?,
                attempts: r.attempts,
                backoff: None,
            }),
            // `attempts` 0 or unset turns retries off, Istio's defaults included
            // (`retry.ConvertPolicy`: attempts <= 0 is no policy at all).
            Some(_) => Some(Retry {
                codes: Vec::new(),
                attempts: Some(0),
                backoff: None,
            }),
            None => None,
        };
        let fault = match &self.fault {
            None => None,
            Some(f) => {
                let delay = match &f.delay {
                    None => None,
                    Some(d) => {
                        let t = d
                            .fixed_delay
                            .as_deref()
                            .ok_or("fault.delay.fixedDelay: required")?;
                        Some((
                            parse_duration(t)
                                .map_err(|e| format!("fault.delay.fixedDelay: {e}"))?,
                            percent(&d.percentage, d.percent, "fault.delay")?,
                        ))
                    }
                };
                let abort = match &f.abort {
                    None => None,
                    Some(a) => {
                        let status = a
                            .http_status
                            .filter(|s| (200..600).contains(s))
                            .ok_or("fault.abort.httpStatus: required, 200-599")?;
                        Some((status, percent(&a.percentage, None, "fault.abort")?))
                    }
                };
                Some(Fault { delay, abort })
            }
        };
        Ok(RouteRule {
            name: self.name.clone(),
            matches,
            filters,
            backend_refs,
            timeouts,
            retry,
            session_persistence: None,
            fault,
        })
    }
}

impl Fault {
    /// Whether this request gets the delay (and how long), rolled per request.
    pub fn delay_for(&self, roll: f64) -> Option<Duration> {
        self.delay
            .filter(|(_, pct)| roll * 100.0 < *pct)
            .map(|(d, _)| d)
    }

    /// Whether this request is aborted, and with which status.
    pub fn abort_for(&self, roll: f64) -> Option<u16> {
        self.abort
            .filter(|(_, pct)| roll * 100.0 < *pct)
            .map(|(s, _)| s)
    }
}
