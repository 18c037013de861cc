//! A VirtualService's `tls` and `tcp` routes (Istio's `TLSRoute`, `TCPRoute`), checked
//! as istiod's validation checks them and held as `route::l4` rules. What Istio's
//! waypoint does with each match field (`getTLSRouteMatch`, `getTCPRouteMatch`,
//! `matchTLS`, `matchTCP`): `sniHosts` counts only as exactly the service's hostname;
//! `port` is the service port; `sourceLabels` and `sourceNamespace` are compared with
//! nothing, so such a match never matches; `destinationSubnets` is not looked at.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::super::l4::{L4Match, L4Rule, SniHosts};
use super::super::model::RouteRule;
use super::destination::VsDestination;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsTlsRoute {
    #[serde(rename = "match")]
    pub matches: Vec<VsL4Match>,
    pub route: Vec<VsRouteDestination>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsTcpRoute {
    #[serde(rename = "match")]
    pub matches: Vec<VsL4Match>,
    pub route: Vec<VsRouteDestination>,
}

/// Istio's `TLSMatchAttributes` and `L4MatchAttributes` (`sniHosts` only in a `tls`
/// match, the deprecated `sourceSubnet` only in a `tcp` one).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsL4Match {
    pub sni_hosts: Vec<String>,
    pub destination_subnets: Vec<String>,
    pub port: Option<u32>,
    pub source_labels: BTreeMap<String, String>,
    pub gateways: Vec<String>,
    pub source_namespace: Option<String>,
    pub source_subnet: Option<String>,
}

/// Istio's `RouteDestination` (no per-destination headers at L4).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VsRouteDestination {
    pub destination: VsDestination,
    #[serde(default)]
    pub weight: Option<u32>,
}

/// Istio's `host.Name.SubsetOf`: `h` is `host` or, `host` being a wildcard, under it.
fn subset_of(h: &str, host: &str) -> bool {
    match (h.strip_prefix('*'), host.strip_prefix('*')) {
        (_, None) => h == host,
        (Some(hs), Some(s)) => hs.ends_with(s),
        (None, Some(s)) => h.ends_with(s),
    }
}

/// An IP address or CIDR (`destinationSubnets`, `sourceSubnet`).
fn valid_subnet(s: &str) -> bool {
    let (ip, len) = match s.split_once('/') {
        Some((ip, len)) => (ip, Some(len)),
        None => (s, None),
    };
    match ip.parse::<std::net::IpAddr>() {
        Ok(addr) => len.is_none_or(|l| {
            l.parse::<u8>()
                .is_ok_and(|l| l <= if addr.is_ipv4() { 32 } else { 128 })
        }),
        Err(_) => false,
    }
}

impl VsL4Match {
    fn compile(&self, tls: bool, hosts: &[String], at: &str) -> Result<L4Match, String> {
        if tls {
            if self.sni_hosts.is_empty() {
                return Err(format!(
                    "{at}.sniHosts: a TLS match must have at least one SNI host (write the service's hostname, e.g. reviews.default.svc.cluster.local)"
                ));
            }
            for (i, h) in self.sni_hosts.iter().enumerate() {
                if !hosts.iter().any(|host| subset_of(h, host)) {
                    return Err(format!(
                        "{at}.sniHosts[{i}]: {h:?} is not a compatible subset of any of the virtual service hosts [{}]",
                        hosts.join(", ")
                    ));
                }
            }
        } else if !self.sni_hosts.is_empty() {
            return Err(format!("{at}.sniHosts: only a `tls` match has SNI hosts"));
        }
        if let Some(s) = self
            .destination_subnets
            .iter()
            .chain(&self.source_subnet)
            .find(|s| !valid_subnet(s))
        {
            return Err(format!("{at}: {s:?} is not an IP address or CIDR"));
        }
        let port = match self.port {
            None | Some(0) => None,
            Some(p) => Some(
                u16::try_from(p).map_err(|_| format!("{at}.port: {p} is not a port (1-65535)"))?,
            ),
        };
        Ok(L4Match {
            sni: if tls {
                SniHosts::Listed(self.sni_hosts.clone())
            } else {
                SniHosts::Any
            },
            port,
            never: !self.source_labels.is_empty()
                || self
                    .source_namespace
                    .as_deref()
                    .is_some_and(|n| !n.is_empty())
                || (!self.gateways.is_empty() && !self.gateways.iter().any(|g| g == "mesh")),
        })
    }
}

/// One `tls` (`tls` true) or `tcp` rule; `hosts` are the VirtualService's, `ns` its
/// namespace.
pub(super) fn rule(
    matches: &[VsL4Match],
    route: &[VsRouteDestination],
    tls: bool,
    hosts: &[String],
    ns: &str,
) -> Result<L4Rule, String> {
    if tls && matches.is_empty() {
        return Err("match: a TLS route must have at least one match condition (sniHosts)".into());
    }
    let matches = matches
        .iter()
        .enumerate()
        .map(|(j, m)| m.compile(tls, hosts, &format!("match[{j}]")))
        .collect::<Result<Vec<_>, _>>()?;
    if route.is_empty() {
        return Err("route: required (where the connections go)".into());
    }
    let one = route.len() == 1;
    let mut backend_refs = Vec::with_capacity(route.len());
    for (k, d) in route.iter().enumerate() {
        let at = format!("route[{k}].destination");
        backend_refs.push(
            d.destination
                .backend_ref(d.weight, one, ns, &at, Vec::new())?,
        );
    }
    if backend_refs.iter().all(|b| b.weight == 0) {
        return Err("route: total destination weight = 0".into());
    }
    Ok(L4Rule {
        matches,
        rule: RouteRule {
            backend_refs,
            ..RouteRule::default()
        },
    })
}
