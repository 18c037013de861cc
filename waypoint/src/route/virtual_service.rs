//! Istio `VirtualService` on a waypoint (what Istio's ambient waypoints apply to the
//! Services in `hosts`: `listener_waypoint.go` `waypointInboundRoute`, `route.go`
//! `TranslateRoute`), held as the HTTPRoute it amounts to, its rules tried in order
//! (`route::select`): matches (`match.rs` conditions in `matching`), destinations with
//! weights, ports, subsets and their own `headers`, rule `headers`, `rewrite` (authority,
//! `uri`, `uriRegexRewrite`), `redirect` and `directResponse` (`action`), `timeout`,
//! `retries` (`retry`) and `fault`. A match with `sourceLabels` is dropped, as Istio's
//! waypoint drops it. `mirror` / `mirrors` and `corsPolicy` become the rule's
//! RequestMirror and CORS filters. Valid fields the waypoint does not apply yet
//! (`delegate`, Envoy header substitutions) make their rule fail closed
//! (`RouteRule::unenforceable`); invalid values refuse the object with the field named.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::action::{self, Answer, UriRewrite};
use super::cors::{Cors, OriginRule};
use super::duration::GatewayDuration;
use super::l4::L4Route;
use super::model::{
    Fault, Filter, Fraction, HeaderModifier, HttpHeader, HttpRoute, RequestMirror, RouteKind,
    RouteMatch, RouteRule, Timeouts, UrlRewrite, VsConditions,
};
use crate::extauthz::provider::parse_duration;
use crate::object::ObjectRef;

mod destination;
mod l4;
mod matching;
mod retry;

use destination::service_ref;
pub use destination::VsDestination;

pub use l4::{VsTcpRoute, VsTlsRoute};

pub use matching::{StringMatch, VsMatch, VsRequest};
pub use retry::{mesh_default, MeshRetry, VsRetries};

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualService {
    pub name: String,
    pub namespace: String,
    /// Empty for a delegate (`is_delegate`).
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub gateways: Vec<String>,
    #[serde(default)]
    pub http: Vec<VsHttpRoute>,
    /// Passed through at L4, before any `tcp` rule (`route::l4`).
    #[serde(default)]
    pub tls: Vec<VsTlsRoute>,
    #[serde(default)]
    pub tcp: Vec<VsTcpRoute>,
    #[serde(default)]
    pub export_to: Vec<String>,
}

/// What a VirtualService amounts to: its `http` rules as an HTTP route, its `tls` and
/// `tcp` rules as an L4 route; either may be absent.
#[derive(Clone, Debug)]
pub struct VsRoutes {
    pub http: Option<HttpRoute>,
    pub l4: Option<L4Route>,
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
    pub redirect: Option<action::VsRedirect>,
    pub direct_response: Option<action::VsDirectResponse>,
    pub mirror: Option<VsDestination>,
    pub mirrors: Vec<VsMirror>,
    pub mirror_percentage: Option<Percent>,
    /// Deprecated integer percent.
    pub mirror_percent: Option<u32>,
    pub cors_policy: Option<VsCorsPolicy>,
    /// Replaced by the delegate's rules (`delegate::merged`) before the VirtualService is
    /// converted; one left (not merged) fails its rule closed.
    pub delegate: Option<VsDelegate>,
    /// A delegated rule that does not convert (`delegate::merged`): it stands, matching
    /// as merged, and fails closed with this reason.
    #[serde(skip)]
    pub refused: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsDelegate {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VsMirror {
    pub destination: VsDestination,
    #[serde(default)]
    pub percentage: Option<Percent>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsCorsPolicy {
    pub allow_origins: Vec<matching::StringMatch>,
    /// Deprecated exact origins.
    pub allow_origin: Vec<String>,
    pub allow_methods: Vec<String>,
    pub allow_headers: Vec<String>,
    pub expose_headers: Vec<String>,
    pub max_age: Option<String>,
    pub allow_credentials: Option<bool>,
    /// FORWARD (Istio's default) or IGNORE.
    pub unmatched_preflights: Option<String>,
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

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsRewrite {
    pub uri: Option<String>,
    pub authority: Option<String>,
    pub uri_regex_rewrite: Option<action::VsRegexRewrite>,
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

/// Header operations as Istio's `TranslateHeadersOperations` gives them to Envoy.
#[derive(Default)]
struct Ops {
    modifier: HeaderModifier,
    /// `:authority` or `host` in `set` (else `add`): Envoy's host rewrite, not a header.
    authority: Option<String>,
    /// A value using Envoy's `%COMMAND%` substitution, which the waypoint does not do.
    unsupported: Option<String>,
}

/// `:`-headers and `host` are not headers Envoy sets or removes (Istio drops them).
fn internal(k: &str) -> bool {
    k.starts_with(':') || k.eq_ignore_ascii_case("host")
}

fn ops(ops: &VsHeaderOps, field: &str) -> Result<Ops, String> {
    let mut out = Ops::default();
    let is_authority =
        |k: &String| k.eq_ignore_ascii_case(":authority") || k.eq_ignore_ascii_case("host");
    out.authority = ops
        .set
        .iter()
        .find(|(k, _)| is_authority(k))
        .or_else(|| ops.add.iter().find(|(k, _)| is_authority(k)))
        .map(|(_, v)| v.clone());
    let mut header = |k: &String, v: &String| -> Result<Option<HttpHeader>, String> {
        if internal(k) {
            return Ok(None);
        }
        let name = http::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| format!("{field}: {k:?} is not a header name"))?;
        // Envoy reads `%...%` in a value as a substitution, `%%` as a `%`.
        if v.replace("%%", "").contains('%') && out.unsupported.is_none() {
            out.unsupported = Some(format!(
                "{field}.{k}: {v:?} uses Envoy's %COMMAND% substitution, which this waypoint does not do"
            ));
        }
        let value = http::HeaderValue::from_str(&v.replace("%%", "%"))
            .map_err(|_| format!("{field}: {v:?} is not a header value"))?;
        Ok(Some(HttpHeader { name, value }))
    };
    let mut set = Vec::new();
    for (k, v) in &ops.set {
        set.extend(header(k, v)?);
    }
    let mut add = Vec::new();
    for (k, v) in &ops.add {
        add.extend(header(k, v)?);
    }
    out.modifier = HeaderModifier {
        set,
        add,
        remove: ops
            .remove
            .iter()
            .filter(|k| !internal(k))
            .cloned()
            .collect(),
        remove_first: true,
    };
    Ok(out)
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
    /// A delegate: rules for the roots that delegate to it, applied only through them.
    pub fn is_delegate(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The HTTPRoute its `http` rules amount to; errors name the field.
    pub fn to_http(&self) -> Result<HttpRoute, String> {
        self.routes()?
            .http
            .ok_or_else(|| "http: at least one route".into())
    }

    /// Its `http` rules as an HTTPRoute and its `tls` and `tcp` rules as an L4 route;
    /// errors name the field.
    pub fn routes(&self) -> Result<VsRoutes, String> {
        if let Some(g) = self.gateways.iter().find(|g| *g != "mesh") {
            return Err(format!(
                "gateways: {g:?}: only `mesh` (the waypoint) is served here"
            ));
        }
        let mut parent_refs = Vec::new();
        for (i, h) in self.hosts.iter().enumerate() {
            let (name, namespace) = service_ref(h, &self.namespace)
                .ok_or_else(|| format!("hosts[{i}]: {h:?} is not a Kubernetes Service (`name` or `name.namespace.svc.<domain>`)"))?;
            // A Service of another namespace: applied only by a waypoint of the
            // VirtualService's namespace (`route::select`), as Istio's waypoint does.
            parent_refs.push(ObjectRef {
                group: Some(String::new()),
                kind: Some("Service".into()),
                name,
                namespace: (namespace != self.namespace).then_some(namespace),
                ..ObjectRef::default()
            });
        }
        if parent_refs.is_empty() {
            return Err("hosts: required".into());
        }
        if self.http.is_empty() && self.tls.is_empty() && self.tcp.is_empty() {
            return Err("http, tcp or tls must be provided in virtual service".into());
        }
        let mut rules = Vec::new();
        for (i, r) in self.http.iter().enumerate() {
            rules.push(
                r.to_rule(&self.namespace)
                    .map_err(|e| format!("http[{i}].{e}"))?,
            );
        }
        let mut tls = Vec::with_capacity(self.tls.len());
        for (i, r) in self.tls.iter().enumerate() {
            tls.push(
                l4::rule(&r.matches, &r.route, true, &self.hosts, &self.namespace)
                    .map_err(|e| format!("tls[{i}].{e}"))?,
            );
        }
        let mut tcp = Vec::with_capacity(self.tcp.len());
        for (i, r) in self.tcp.iter().enumerate() {
            tcp.push(
                l4::rule(&r.matches, &r.route, false, &self.hosts, &self.namespace)
                    .map_err(|e| format!("tcp[{i}].{e}"))?,
            );
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
        // The L4 rules' destinations are checked as HTTP rules' are.
        let l4_rules = tls.iter().chain(&tcp).map(|r| r.rule.clone());
        // Checked as an HTTPRoute; a destination or mirror may leave out its port (the
        // request's).
        let mut check = route.clone();
        check.rules.extend(l4_rules);
        for b in check
            .rules
            .iter_mut()
            .flat_map(|r| r.backend_refs.iter_mut())
        {
            b.backend.port.get_or_insert(1);
        }
        for f in check.rules.iter_mut().flat_map(|r| r.filters.iter_mut()) {
            if let Filter::RequestMirror(m) = f {
                m.backend_ref.port.get_or_insert(1);
            }
        }
        for p in &mut check.parent_refs {
            p.namespace = None;
        }
        check.validate()?;
        let l4 = (!tls.is_empty() || !tcp.is_empty()).then(|| L4Route {
            meta: HttpRoute {
                rules: Vec::new(),
                ..route.clone()
            },
            tls,
            tcp,
        });
        Ok(VsRoutes {
            http: (!route.rules.is_empty()).then_some(route),
            l4,
        })
    }
}

impl VsHttpRoute {
    /// The rule it amounts to; when every match is one Istio's waypoint drops
    /// (`sourceLabels`, `gateways` without `mesh`) it matches nothing, as the rule does
    /// not exist there.
    pub(super) fn to_rule(&self, ns: &str) -> Result<RouteRule, String> {
        let mut matches = Vec::new();
        for (j, m) in self.matches.iter().enumerate() {
            let at = format!("match[{j}]");
            // Istio's waypoint drops a match with sourceLabels (`waypointInboundRoute`,
            // istio/istio#51565) and one naming gateways other than `mesh`
            // (`sourceMatchHTTP` with the waypoint's `mesh`).
            if !m.source_labels.is_empty()
                || (!m.gateways.is_empty() && !m.gateways.iter().any(|g| g == "mesh"))
            {
                continue;
            }
            matches.push(m.compile(&at)?);
        }
        if !self.matches.is_empty() && matches.is_empty() {
            // Kept (rule numbers stay as written), matching nothing.
            matches.push(RouteMatch {
                vs: Some(Box::new(VsConditions {
                    dropped: true,
                    ..VsConditions::default()
                })),
                ..RouteMatch::default()
            });
        }
        let mut backend_refs = Vec::new();
        let one = self.route.len() == 1;
        let mut unsupported: Option<String> = None;
        let mut dest_authority = None;
        for (k, d) in self.route.iter().enumerate() {
            let at = format!("route[{k}]");
            // Per-destination headers: the backend's own header modifiers (Istio's
            // weighted-cluster headers).
            let mut filters = Vec::new();
            if let Some(h) = &d.headers {
                if let Some(req) = &h.request {
                    let o = ops(req, &format!("{at}.headers.request"))?;
                    unsupported = unsupported.or(o.unsupported);
                    if let Some(a) = o.authority {
                        // Istio: the destination's host rewrite (per weighted cluster);
                        // the waypoint rewrites per rule only.
                        if one {
                            dest_authority = Some(a);
                        } else {
                            unsupported = unsupported.or(Some(format!("{at}.headers.request: an authority per weighted destination is not supported")));
                        }
                    }
                    filters.push(Filter::RequestHeaderModifier(o.modifier));
                }
                if let Some(resp) = &h.response {
                    let o = ops(resp, &format!("{at}.headers.response"))?;
                    unsupported = unsupported.or(o.unsupported);
                    filters.push(Filter::ResponseHeaderModifier(o.modifier));
                }
            }
            backend_refs.push(d.destination.backend_ref(
                d.weight,
                one,
                ns,
                &format!("{at}.destination"),
                filters,
            )?);
        }
        let mut filters = Vec::new();
        // The host rewrite: rewrite.authority, else the rule's headers', else the one
        // destination's (Istio's `applyHTTPRouteDestination` and `processDestination`).
        let mut authority = None;
        if let Some(h) = &self.headers {
            if let Some(req) = &h.request {
                let o = ops(req, "headers.request")?;
                unsupported = unsupported.or(o.unsupported);
                authority = o.authority;
                filters.push(Filter::RequestHeaderModifier(o.modifier));
            }
            if let Some(resp) = &h.response {
                let o = ops(resp, "headers.response")?;
                unsupported = unsupported.or(o.unsupported);
                filters.push(Filter::ResponseHeaderModifier(o.modifier));
            }
        }
        let mut uri_rewrite = None;
        if let Some(rw) = &self.rewrite {
            let uri = rw.uri.as_deref().filter(|u| !u.is_empty());
            uri_rewrite = match (uri, &rw.uri_regex_rewrite) {
                (Some(_), Some(_)) => {
                    return Err("rewrite: set one of uri and uriRegexRewrite".into())
                }
                (Some(u), None) => {
                    if u.bytes()
                        .any(|b| b.is_ascii_control() || b == b' ' || b == b'?' || b == b'#')
                    {
                        return Err(format!("rewrite.uri: {u:?} is not a path"));
                    }
                    Some(UriRewrite::Prefix(u.to_string()))
                }
                (None, Some(r)) => {
                    let re = regex::RegexBuilder::new(&r.pattern)
                        .size_limit(1 << 20)
                        .build()
                        .map_err(|e| format!("rewrite.uriRegexRewrite.match: {e}"))?;
                    let sub = action::re2_substitution(&r.rewrite, re.captures_len())
                        .map_err(|e| format!("rewrite.uriRegexRewrite.{e}"))?;
                    Some(UriRewrite::Regex(re, sub))
                }
                (None, None) => None,
            };
            if let Some(a) = rw.authority.as_ref().filter(|a| !a.is_empty()) {
                authority = Some(a.clone());
            }
        }
        if let Some(a) = authority.or(dest_authority) {
            if a.bytes().any(|b| b.is_ascii_control() || b == b' ') {
                return Err(format!("rewrite.authority: {a:?} is not an authority"));
            }
            filters.push(Filter::UrlRewrite(UrlRewrite {
                hostname: Some(a),
                path: None,
            }));
        }
        let answer = match (&self.redirect, &self.direct_response) {
            (Some(_), Some(_)) => return Err("set one of redirect and directResponse".into()),
            (Some(r), None) => Some(Answer::Redirect(r.compile()?)),
            (None, Some(d)) => Some(Answer::Direct(d.compile()?)),
            (None, None) => None,
        };
        if answer.is_some() && !self.route.is_empty() {
            return Err("route: a rule with redirect or directResponse sends nowhere".into());
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
        let converted = self
            .retries
            .as_ref()
            .map(|r| r.convert().map_err(|e| format!("retries.{e}")))
            .transpose()?;
        let per_try = converted
            .as_ref()
            .and_then(|c| c.per_try_timeout)
            .map(GatewayDuration);
        let timeouts = (request.is_some() || per_try.is_some()).then_some(Timeouts {
            request,
            backend_request: per_try,
        });
        let mut unenforceable = self.refused.clone();
        let retry = converted.map(|c| {
            unenforceable = c.unsupported.map(|u| format!("retries.{u}"));
            c.retry
        });
        // Valid fields the waypoint does not apply yet: the rule fails closed, named.
        unenforceable = unenforceable.or(unsupported);
        if self.delegate.is_some() && unenforceable.is_none() {
            unenforceable = Some("delegate: the delegate VirtualService was not merged".into());
        }
        filters.extend(self.mirror_filters(ns)?);
        if let Some(c) = &self.cors_policy {
            filters.push(Filter::Cors(
                c.compile().map_err(|e| format!("corsPolicy.{e}"))?,
            ));
        }
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
            unenforceable,
            answer,
            uri_rewrite,
        })
    }
}

impl VsHttpRoute {
    /// `mirror` (with `mirrorPercentage`, else the deprecated `mirrorPercent`, else all)
    /// and each of `mirrors` (its own `percentage`, else all), as Istio's `TranslateRoute`
    /// gives Envoy its request mirror policies.
    fn mirror_filters(&self, ns: &str) -> Result<Vec<Filter>, String> {
        let mut out = Vec::new();
        let mut one = |d: &VsDestination, pct: f64, at: &str| -> Result<(), String> {
            let (name, namespace) = service_ref(&d.host, ns)
                .ok_or_else(|| format!("{at}.host: {:?} is not a Kubernetes Service", d.host))?;
            if d.subset.as_deref() == Some("") {
                return Err(format!("{at}.subset: must not be empty"));
            }
            out.push(Filter::RequestMirror(RequestMirror {
                backend_ref: ObjectRef {
                    name,
                    namespace: (namespace != ns).then_some(namespace),
                    port: d.port.as_ref().map(|p| p.number),
                    ..ObjectRef::default()
                },
                percent: None,
                // Envoy's runtime fraction, per million.
                fraction: Some(Fraction {
                    numerator: (pct * 10_000.0).round() as u32,
                    denominator: 1_000_000,
                }),
                subset: d.subset.clone(),
            }));
            Ok(())
        };
        if let Some(m) = &self.mirror {
            let pct = percent(&self.mirror_percentage, self.mirror_percent, "mirror")?;
            one(m, pct, "mirror")?;
        }
        for (i, m) in self.mirrors.iter().enumerate() {
            let at = format!("mirrors[{i}]");
            let pct = percent(&m.percentage, None, &at)?;
            one(&m.destination, pct, &format!("{at}.destination"))?;
        }
        Ok(out)
    }
}

impl VsCorsPolicy {
    fn compile(&self) -> Result<Cors, String> {
        let mut origins = Vec::new();
        if !self.allow_origins.is_empty() {
            for (i, o) in self.allow_origins.iter().enumerate() {
                origins.push(match (&o.exact, &o.prefix, &o.regex) {
                    (Some(e), None, None) => OriginRule::Exact(e.clone()),
                    (None, Some(p), None) => OriginRule::Prefix(p.clone()),
                    (None, None, Some(r)) => OriginRule::Regex(r.clone()),
                    _ => {
                        return Err(format!(
                            "allowOrigins[{i}]: set exactly one of exact, prefix, regex"
                        ))
                    }
                });
            }
        } else {
            origins.extend(self.allow_origin.iter().cloned().map(OriginRule::Exact));
        }
        let max_age = self
            .max_age
            .as_deref()
            .map(|t| parse_duration(t).map_err(|e| format!("maxAge: {e}")))
            .transpose()?;
        let forward = match self.unmatched_preflights.as_deref() {
            None | Some("UNSPECIFIED") | Some("FORWARD") => true,
            Some("IGNORE") => false,
            Some(other) => {
                return Err(format!(
                    "unmatchedPreflights: {other:?} is not FORWARD or IGNORE"
                ))
            }
        };
        Cors::from_virtual_service(
            origins,
            self.allow_methods.clone(),
            self.allow_headers.clone(),
            self.expose_headers.clone(),
            max_age,
            self.allow_credentials.unwrap_or(false),
            forward,
        )
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
