//! Egress through the waypoint, as Istio's waypoint does it for ServiceEntries:
//!
//! - a route backend naming a ServiceEntry's host: Istio's backendRef kind `Hostname`
//!   (group `networking.istio.io`, `name` the host; istiod's route conversion has no
//!   `ServiceEntry` backend kind), looked up from the route's namespace;
//! - `resolution: DYNAMIC_DNS` wildcard ServiceEntries, which Istio's waypoint serves
//!   with Envoy's dynamic forward proxy (`cluster_waypoint.go` `buildDFPCluster`,
//!   `listener_builder.go` `BuildWaypointInboundDFPFilter`): the request's Host is the
//!   upstream, resolved by the proxy, and only a Host the wildcard covers gets a route
//!   (`buildRouteVHostDomains`: the virtual host's one domain is the ServiceEntry's
//!   host, so any other Host is answered 404 and never resolved).
//!
//! Istio's workload xDS carries no `resolution`, so a DYNAMIC_DNS entry is told by what
//! istiod sends for one (`serviceentry` → `workloadapi.Service`): a wildcard host with
//! a VIP (istiod allocates one for wildcard hosts only when DYNAMIC_DNS; user
//! `addresses` are refused for it) that is not PASSTHROUGH (resolution NONE) and has
//! no endpoint (DYNAMIC_DNS refuses `endpoints`). The one other ServiceEntry of that
//! shape, a STATIC wildcard with `addresses` and no endpoint yet, is then forwarded by
//! Host within its own wildcard where Istio answers 503: nothing outside the hosts its
//! author declared is reachable either way (docs/waypoint/egress.md).

use std::net::IpAddr;
use std::sync::Arc;

use ztunnel::state::{
    LoadBalancerMode, MeshState, NamespacedHostname, Protocol as MeshProtocol, Service, Workload,
};

use crate::http::authority::Authority;
use crate::http::backend::Backend;
use crate::object::{ObjectRef, ServiceKind, NETWORKING_GROUP};

/// The longest DNS name (RFC 1035), without the trailing dot.
const MAX_NAME: usize = 253;

/// Why a request through an egress entry is not sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    #[error(
        "backend {0} is no service of the mesh; name a Service, or declare the host in a ServiceEntry in the \
         route's namespace"
    )]
    NotFound(String),
    #[error(
        "backend host {host} is declared in several namespaces {namespaces:?} and none is the route's; \
         declare it in the route's namespace"
    )]
    Ambiguous {
        host: String,
        namespaces: Vec<String>,
    },
    #[error(
        "Host {host:?} is not covered by the DYNAMIC_DNS ServiceEntry host {pattern} ({why}); the waypoint \
         forwards only to the hosts its wildcard names, written without a port"
    )]
    NotCovered {
        host: String,
        pattern: String,
        why: &'static str,
    },
    #[error(
        "TLS to the DYNAMIC_DNS ServiceEntry host {pattern} without an SNI: the waypoint reaches only the host \
         the ClientHello names"
    )]
    NoSni { pattern: String },
}

/// A backendRef naming a ServiceEntry's host (Istio's `Hostname` kind).
pub fn is_hostname_ref(r: &ObjectRef) -> bool {
    r.kind.as_deref() == Some("Hostname") && r.group.as_deref() == Some(NETWORKING_GROUP)
}

/// The service a route backend names: a Service by name (namespace from the ref or the
/// route), or, for a `Hostname` ref, the service of that host as the route's namespace
/// sees it: its own namespace's declaration first (a ServiceEntry there), else the one
/// namespace that declares it. A host several other namespaces declare is refused
/// rather than picked: any tenant may declare any host, and must not capture another
/// namespace's egress.
pub fn backend_service<'s>(
    state: &'s MeshState,
    route_ns: &str,
    r: &ObjectRef,
) -> Result<&'s Arc<Service>, EgressError> {
    if !is_hostname_ref(r) {
        // A Service ref is the Kubernetes Service's hostname in Istio: where a
        // ServiceEntry of the same name and namespace is indexed by that name instead,
        // the Service is looked for among all (a rare collision, so scanning is fine).
        let ns = r.namespace.as_deref().unwrap_or(route_ns);
        let named = state.service_by_name(ns, &r.name);
        if let Some(s) = named.filter(|s| ServiceKind::of(s) == ServiceKind::Kubernetes) {
            return Ok(s);
        }
        return state
            .services()
            .find(|s| {
                s.namespace == ns
                    && s.name == r.name
                    && ServiceKind::of(s) == ServiceKind::Kubernetes
            })
            .or(named)
            .ok_or_else(|| EgressError::NotFound(format!("{ns}/{}", r.name)));
    }
    let host = r.name.to_ascii_lowercase();
    if let Some(s) = state.service_by_hostname(&NamespacedHostname(format!("{route_ns}/{host}"))) {
        return Ok(s);
    }
    let mut found: Vec<&Arc<Service>> = state
        .services()
        .filter(|s| s.hostname.eq_ignore_ascii_case(&host))
        .collect();
    match found.len() {
        0 => Err(EgressError::NotFound(host)),
        1 => Ok(found.remove(0)),
        _ => {
            let mut namespaces: Vec<String> = found.iter().map(|s| s.namespace.clone()).collect();
            namespaces.sort();
            namespaces.dedup();
            Err(EgressError::Ambiguous { host, namespaces })
        }
    }
}

/// Whether `svc` is a DYNAMIC_DNS ServiceEntry host (module docs).
pub fn is_dynamic_dns(state: &MeshState, svc: &Service) -> bool {
    svc.hostname.starts_with("*.")
        && svc.lb_mode() != LoadBalancerMode::Passthrough
        && svc
            .ports
            .keys()
            .all(|p| state.endpoints_for(svc, *p).is_empty())
}

/// The upstream host of a request to the DYNAMIC_DNS entry `pattern` (`*.wild.test`):
/// the authority's host, lowercase, when the wildcard covers it as Envoy's virtual host
/// domain does: one or more labels in front of the suffix, compared without case; a
/// port, a trailing dot or an IP literal is not covered (Envoy matches the Host as sent,
/// port included, istiod not setting `ignore_port_in_host_matching` there).
pub fn dynamic_host(pattern: &str, authority: &Authority) -> Result<String, EgressError> {
    let not = |why| {
        Err(EgressError::NotCovered {
            host: authority.as_str().to_string(),
            pattern: pattern.to_string(),
            why,
        })
    };
    let Some(suffix) = pattern.strip_prefix('*') else {
        return not("the entry's host is no wildcard");
    };
    if authority.port().is_some() {
        return not("it has a port");
    }
    let host = authority.host().to_ascii_lowercase();
    if host.starts_with('[') || host.parse::<IpAddr>().is_ok() {
        return not("it is an IP address");
    }
    let Some(front) = host.strip_suffix(&suffix.to_ascii_lowercase()) else {
        return not("another domain");
    };
    // The labels in front must be DNS labels: `.wild.test` or `a..wild.test` is no
    // name to look up.
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if front.is_empty() || !front.split('.').all(label_ok) {
        return not("no DNS name");
    }
    if host.len() > MAX_NAME {
        return not("longer than a DNS name");
    }
    Ok(host)
}

/// The endpoint a DYNAMIC_DNS request goes to: `host` outside the mesh, at port 443 when
/// the DestinationRule originates TLS and 80 otherwise (Envoy's dynamic forward proxy
/// default ports; a Host with a port never gets this far). Resolved when the request is
/// sent (`Backend::resolve`).
pub fn dynamic_endpoint(svc: &Service, host: &str, tls: bool) -> (Arc<Workload>, u16) {
    let wl = Workload {
        hostname: host.to_string(),
        protocol: MeshProtocol::TCP,
        ..Workload::new(
            format!("dynamic-dns/{}/{host}", svc.namespace),
            host,
            svc.namespace.clone(),
        )
    };
    (Arc::new(wl), if tls { 443 } else { 80 })
}

/// Points a DYNAMIC_DNS `backend` at the request's upstream authority `up` (its
/// endpoint, looked up when the request is sent); any other backend is left as it is.
pub fn send_to_host(
    state: &MeshState,
    backend: &mut Backend,
    up: &Authority,
) -> Result<(), EgressError> {
    let Some(svc) = backend.service.clone().filter(|s| is_dynamic_dns(state, s)) else {
        return Ok(());
    };
    let host = dynamic_host(&svc.hostname, up)?;
    let tls = backend.policy.as_ref().is_some_and(|p| p.tls.is_some());
    backend.unresolved.push(dynamic_endpoint(&svc, &host, tls));
    backend.dynamic_dns = true;
    Ok(())
}

/// With `ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS`: points a TLS connection to a
/// DYNAMIC_DNS `backend` at the host its ClientHello's SNI names, at `port` (the service
/// port, as istiod sets Envoy's SNI dynamic forward proxy); any other backend is left as
/// it is. Only a name the wildcard covers, as for a Host (`dynamic_host`): Istio's flag
/// forwards any SNI (it warns of SNI spoofing); this waypoint does not.
pub fn send_to_sni(
    state: &MeshState,
    backend: &mut Backend,
    sni: Option<&str>,
    port: u16,
) -> Result<(), EgressError> {
    let Some(svc) = backend.service.clone().filter(|s| is_dynamic_dns(state, s)) else {
        return Ok(());
    };
    let Some(sni) = sni else {
        return Err(EgressError::NoSni {
            pattern: svc.hostname.clone(),
        });
    };
    let authority = Authority::parse(sni).map_err(|_| EgressError::NotCovered {
        host: sni.to_string(),
        pattern: svc.hostname.clone(),
        why: "no host name",
    })?;
    let host = dynamic_host(&svc.hostname, &authority)?;
    let (wl, _) = dynamic_endpoint(&svc, &host, false);
    backend.unresolved.push((wl, port));
    backend.dynamic_dns = true;
    Ok(())
}

#[cfg(test)]
mod tests;
