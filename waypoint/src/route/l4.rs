//! L4 routes on a waypoint: a VirtualService's `tls` and `tcp` rules, Gateway API
//! `TLSRoute`, and `TCPRoute`, as Istio's waypoint applies them to a connection its TCP
//! filter chain carries (a TCP or TLS port, or an unknown one whose first bytes are not
//! HTTP; `listener_waypoint.go` `buildWaypointNetworkFilters`, `getWaypointTCPRoutes`).
//!
//! The route is chosen per service port from config alone, never from the connection's
//! bytes: the TLS rules of every route first, then the TCP rules (GEP-1294's order), the
//! first rule with a matching match (or none) wins. A `tls` match counts only when its
//! `sniHosts` is exactly the service's own hostname: Istio's waypoint does no SNI
//! matching, so a match naming any other host is skipped, and the connection goes on to
//! the next rule, the TCP rules, or the service itself. The client's TLS is passed
//! through to the destination untouched.

use super::model::{HttpRoute, RouteKind, RouteRule};
use crate::object::Target;

/// A route's L4 rules, with what it attaches to.
#[derive(Clone, Debug)]
pub struct L4Route {
    /// Name, namespace, kind, `parentRefs` and `exportTo`: the route attaches to a
    /// target as an HTTP route of the same object would (`HttpRoute::attaches_to`). Its
    /// `rules` are unused.
    pub meta: HttpRoute,
    /// Tried before any route's `tcp` rules.
    pub tls: Vec<L4Rule>,
    pub tcp: Vec<L4Rule>,
}

/// One `tls` or `tcp` rule.
#[derive(Clone, Debug)]
pub struct L4Rule {
    /// Empty: every connection.
    pub matches: Vec<L4Match>,
    /// The destinations, as a rule's weighted backendRefs (port, subset).
    pub rule: RouteRule,
}

/// One match of an L4 rule, with what Istio's waypoint checks of it (`matchTLS`,
/// `matchTCP`, with no proxy labels and no proxy namespace).
#[derive(Clone, Debug, Default)]
pub struct L4Match {
    pub sni: SniHosts,
    /// The service port the connection was sent to.
    pub port: Option<u16>,
    /// `sourceLabels`, `sourceNamespace`, or `gateways` without `mesh`: Istio's waypoint
    /// checks them against no labels and no namespace, so the match never matches.
    pub never: bool,
}

/// Which SNI hosts a match names.
#[derive(Clone, Debug, Default)]
pub enum SniHosts {
    /// A `tcp` match: none.
    #[default]
    Any,
    /// A VirtualService `tls` match's `sniHosts`, as written.
    Listed(Vec<String>),
    /// A TLSRoute's `hostnames`, which istiod narrows for each parent Service
    /// (`augmentTLSPortMatch`, `compatibleRoutesForHost`): none means the Service's own
    /// hostname; of several, those matching it are kept.
    Route(Vec<String>),
}

impl SniHosts {
    /// Whether the match counts for the service with this hostname: exactly one SNI host,
    /// and it is the hostname (Istio compares the strings). A workload addressed directly
    /// (no hostname) has no `tls` match.
    fn applies(&self, hostname: Option<&str>) -> bool {
        let Some(hostname) = hostname else {
            return matches!(self, SniHosts::Any);
        };
        let hosts: Vec<&str> = match self {
            SniHosts::Any => return true,
            SniHosts::Listed(h) => h.iter().map(String::as_str).collect(),
            SniHosts::Route(h) if h.is_empty() => vec![hostname],
            SniHosts::Route(h) if h.len() > 1 => h
                .iter()
                .map(String::as_str)
                .filter(|s| host_matches(hostname, s))
                .collect(),
            SniHosts::Route(h) => h.iter().map(String::as_str).collect(),
        };
        hosts == [hostname]
    }
}

/// Istio's `host.Name.Matches` of a plain hostname against a host that may be a
/// wildcard (`*.example.com`, `*`).
fn host_matches(hostname: &str, host: &str) -> bool {
    match host.strip_prefix('*') {
        Some(suffix) => hostname.ends_with(suffix),
        None => hostname == host,
    }
}

impl L4Match {
    fn matches(&self, hostname: Option<&str>, port: u16) -> bool {
        !self.never && self.port.is_none_or(|p| p == port) && self.sni.applies(hostname)
    }
}

impl L4Rule {
    /// The first rule that matches: one without matches, or one of whose matches does.
    fn matches(&self, hostname: Option<&str>, port: u16) -> bool {
        self.matches.is_empty() || self.matches.iter().any(|m| m.matches(hostname, port))
    }
}

/// The rule a connection takes.
#[derive(Clone, Copy, Debug)]
pub struct L4Selected<'a> {
    /// The route (its name, namespace and kind: ReferenceGrants name the kind).
    pub route: &'a HttpRoute,
    pub rule: &'a RouteRule,
    /// A `tls` rule (else `tcp`).
    pub tls: bool,
    /// The rule's index in its list (`tls` or `tcp`), for logs.
    pub index: usize,
}

/// The L4 rule for a connection to `target` (a service with this `hostname`, or a
/// workload addressed directly: None), among
/// `routes` (VirtualServices and TLSRoutes) and `tcp_routes` (TCPRoutes, each one rule
/// without matches): TLS rules first, then TCP rules; within each, VirtualServices
/// before Gateway API routes (Istio orders them by creation; the waypoint keeps the
/// order of its HTTP routes, VirtualServices first), each in config order.
pub fn select_l4<'a>(
    routes: &'a [L4Route],
    tcp_routes: &'a [HttpRoute],
    target: &Target,
    hostname: Option<&str>,
) -> Option<L4Selected<'a>> {
    let attached: Vec<&L4Route> = routes
        .iter()
        .filter(|r| r.meta.kind == RouteKind::Virtual)
        .chain(routes.iter().filter(|r| r.meta.kind != RouteKind::Virtual))
        .filter(|r| r.meta.attaches_to(target))
        .collect();
    let first = |tls: bool| {
        attached.iter().find_map(|r| {
            let rules = if tls { &r.tls } else { &r.tcp };
            rules
                .iter()
                .position(|rule| rule.matches(hostname, target.port))
                .map(|index| L4Selected {
                    route: &r.meta,
                    rule: &rules[index].rule,
                    tls,
                    index,
                })
        })
    };
    first(true).or_else(|| first(false)).or_else(|| {
        tcp_routes
            .iter()
            .filter(|r| r.attaches_to(target))
            .find_map(|r| {
                r.rules.first().map(|rule| L4Selected {
                    route: r,
                    rule,
                    tls: false,
                    index: 0,
                })
            })
    })
}

#[cfg(test)]
mod tests;
