//! Which rule serves a request: matching, and the Gateway API's precedence among the
//! matches of every route attached to the request's target (see `route`); then which
//! weighted backend.

use http::header::HeaderMap;
use http::Method;

use super::model::{
    parent_kind, Attachment, BackendRef, HttpRoute, PathMatch, RouteKind, RouteMatch, RouteRule,
    ValueMatch,
};
use super::virtual_service::VsRequest;
use crate::object::{ServiceKind, Target};

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(v) => path == v,
            PathMatch::Prefix(p) => path
                .strip_prefix(p.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
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

impl ValueMatch {
    pub(super) fn matches(&self, v: &[u8]) -> bool {
        match self {
            ValueMatch::Exact(e) => v == e.as_bytes(),
            ValueMatch::Regex(r) => std::str::from_utf8(v).is_ok_and(|s| r.is_match(s)),
        }
    }
}

impl RouteRule {
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
}

/// A match's rank (higher wins): path kind, prefix length, method, header count,
/// query parameter count.
type Precedence = (u8, usize, bool, usize, usize);

impl RouteMatch {
    fn path(&self) -> Option<&PathMatch> {
        self.path.as_ref()
    }

    fn matches(&self, req: &RouteRequest, target: &Target) -> bool {
        self.vs.as_ref().is_none_or(|c| c.matches(&req.vs(target)))
            && self.path().is_none_or(|p| p.matches(req.path))
            && self.method.as_ref().is_none_or(|m| m.0 == *req.method)
            && self.headers.iter().all(|h| {
                req.headers
                    .get_all(&h.name)
                    .iter()
                    .any(|v| h.value.matches(v.as_bytes()))
            })
            && self
                .query_params
                .iter()
                .all(|q| query_values(req.query, &q.name).any(|v| q.value.matches(&v)))
    }

    /// Gateway API precedence, higher first.
    fn precedence(&self) -> Precedence {
        let (kind, len) = self.path().map_or((1, 0), PathMatch::rank);
        (
            kind,
            len,
            self.method.is_some(),
            self.headers.len(),
            self.query_params.len(),
        )
    }
}

/// The values of query parameter `name`, percent-decoded.
fn query_values<'q>(query: Option<&'q str>, name: &'q str) -> impl Iterator<Item = Vec<u8>> + 'q {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter_map(move |pair| {
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
            if let (Some(h), Some(l)) = (
                s.get(i + 1).and_then(|c| hex(*c)),
                s.get(i + 2).and_then(|c| hex(*c)),
            ) {
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
    /// Normalized (`path`), without the query.
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    /// Lowercase, without the port.
    pub host: &'a str,
    /// The authority as the client sent it (VirtualService `authority` matches).
    pub authority: &'a str,
}

impl RouteRequest<'_> {
    fn vs<'t>(&'t self, target: &'t Target<'_>) -> VsRequest<'t> {
        VsRequest {
            method: self.method.as_str(),
            authority: self.authority,
            port: target.port,
            headers: self.headers,
            waypoint_namespace: &target.gateway.namespace,
        }
    }
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
    /// The match that matched (a rule without matches: the catch-all).
    pub matched: &'a RouteMatch,
}

impl HttpRoute {
    fn attachment(&self, target: &Target) -> Option<Attachment> {
        // A VirtualService not exported to the waypoint's namespace is not in its scope.
        if !crate::object::exported_to(&self.export_to, &self.namespace, &target.gateway.namespace)
        {
            return None;
        }
        let mut via_gateway = false;
        for r in &self.parent_refs {
            let ns = r.namespace.as_deref().unwrap_or(&self.namespace);
            match parent_kind(r) {
                Some(kind @ (Attachment::Service | Attachment::ServiceEntry)) => {
                    // Istio's waypoint: a VirtualService of the Service's namespace, or of
                    // the waypoint's own, may name it (`getVirtualServiceForWaypoint`).
                    if ns != self.namespace && target.gateway.namespace != self.namespace {
                        continue;
                    }
                    // A Service parent is the Kubernetes Service's hostname, a ServiceEntry
                    // parent its hosts: one never stands for the other of the same name.
                    let registry = match kind {
                        Attachment::ServiceEntry => ServiceKind::ServiceEntry,
                        _ => ServiceKind::Kubernetes,
                    };
                    let svc = target.service_kind == registry
                        && target
                            .service
                            .is_some_and(|s| s.name == r.name && s.namespace == ns);
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
                Some(suffix) => {
                    host.len() > suffix.len() && host.ends_with(&suffix.to_ascii_lowercase())
                }
                None => host.eq_ignore_ascii_case(h),
            })
    }
}

/// A rule without matches matches every path.
static DEFAULT_MATCH: RouteMatch = RouteMatch {
    path: None,
    headers: Vec::new(),
    query_params: Vec::new(),
    method: None,
    vs: None,
};

/// The rule for a request among `routes`, by Gateway API precedence (see `route`).
/// Routes on the Gateway whose `hostnames` don't cover the request's host don't apply.
pub fn select<'a>(routes: &[&'a HttpRoute], target: &Target, req: &RouteRequest) -> Selection<'a> {
    let attached: Vec<(&HttpRoute, Attachment)> = routes
        .iter()
        .filter_map(|r| r.attachment(target).map(|a| (*r, a)))
        .collect();
    let service_routes = attached
        .iter()
        .any(|(_, a)| matches!(a, Attachment::Service));
    let applying = attached.into_iter().filter(|(route, att)| match att {
        Attachment::Service | Attachment::ServiceEntry => true,
        Attachment::Gateway => !service_routes && route.host_matches(req.host),
    });
    let (virtual_services, routes): (Vec<_>, Vec<_>) =
        applying.partition(|(r, _)| r.kind == RouteKind::Virtual);
    let mut any = false;
    // VirtualServices: Istio's (Envoy's) order, before the HTTPRoutes: the first rule
    // and match that matches wins, VirtualServices in config order; a rule without
    // matches ends the list (`waypointInboundRoute`).
    for (route, _) in virtual_services {
        any = true;
        for (rule_index, rule) in route.rules.iter().enumerate() {
            let matches = if rule.matches.is_empty() {
                std::slice::from_ref(&DEFAULT_MATCH)
            } else {
                &rule.matches
            };
            if let Some(m) = matches.iter().find(|m| m.matches(req, target)) {
                return Selection::Matched(Selected {
                    route,
                    rule,
                    rule_index,
                    matched_prefix: None,
                    matched: m,
                });
            }
        }
    }
    let mut best: Option<(Precedence, Selected<'a>)> = None;
    for (route, _) in routes {
        any = true;
        for (rule_index, rule) in route.rules.iter().enumerate() {
            let matches = if rule.matches.is_empty() {
                std::slice::from_ref(&DEFAULT_MATCH)
            } else {
                &rule.matches
            };
            for m in matches {
                if !m.matches(req, target) {
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
                best = Some((
                    p,
                    Selected {
                        route,
                        rule,
                        rule_index,
                        matched_prefix,
                        matched: m,
                    },
                ));
            }
        }
    }
    match (best, any) {
        (Some((_, s)), _) => Selection::Matched(s),
        (None, true) => Selection::NoMatch,
        (None, false) => Selection::NoRoutes,
    }
}
