//! Where a request (or its mirror) goes: a service's healthy endpoints, or the one
//! workload the client addressed. A Service's endpoints are the ones ztunnel would pick
//! among for the waypoint (its load-balancing mode: STRICT / FAILOVER locality, health
//! policy), of the DestinationRule subset when a route names one; a PASSTHROUGH Service's
//! traffic goes to its original destination. Endpoints known only by hostname (a DNS
//! ServiceEntry's) are resolved before the request is sent, with the node proxy's
//! on-demand resolver: every address becomes an endpoint, as in Envoy's STRICT_DNS
//! clusters.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ztunnel::dns::on_demand::OnDemandResolver;
use ztunnel::state::{locality_preferred, AppProtocol, LoadBalancerMode, Protocol as MeshProtocol, Service, Workload};

use crate::config::Config;
use crate::destination::{self, Policy, TlsTarget};

/// Who asks for a backend: the waypoint's own workload (its locality picks endpoints) and
/// the original destination (where a PASSTHROUGH Service's traffic goes), if any.
pub struct Origin<'a> {
    pub me: &'a Workload,
    pub target: Option<SocketAddr>,
}

/// A destination outside the mesh known only by its address (a PASSTHROUGH Service's).
fn outside(dst: SocketAddr) -> Workload {
    Workload { workload_ips: vec![dst.ip()], protocol: MeshProtocol::TCP, ..Workload::new(format!("passthrough/{dst}"), dst.ip().to_string(), "") }
}

/// Where the router sends a request: a backend service, or the CONNECT target workload.
pub struct Backend {
    pub service: Option<Arc<Service>>,
    pub endpoints: Vec<(SocketAddr, Arc<Workload>)>,
    /// Endpoints known by hostname only, with their target port: `resolve` turns them
    /// into `endpoints`.
    pub unresolved: Vec<(Arc<Workload>, u16)>,
    /// The HTTP version the backend speaks, when its service port says (Some(true):
    /// HTTP/2 with prior knowledge); None: the client's, as Istio's waypoint does for
    /// ports of unknown protocol.
    pub http2: Option<bool>,
    /// The DestinationRule policy for the Service's port, if one applies.
    pub policy: Option<Arc<Policy>>,
}

/// What a service port's protocol says about the upstream HTTP version: `http` ports
/// get HTTP/1.1, `http2`/`grpc` (and h2c appProtocol) ports HTTP/2, others nothing.
pub fn port_speaks_http2(svc: &Service, port: u16) -> Option<bool> {
    match svc.app_protocol(port) {
        AppProtocol::Http11 => Some(false),
        AppProtocol::Http2 | AppProtocol::Grpc => Some(true),
        AppProtocol::Unknown | AppProtocol::Tcp | AppProtocol::Tls => None,
    }
}

impl Backend {
    /// How a connection to `endpoint` for a request to `host` (None: opaque TCP) makes its
    /// TLS, when the DestinationRule originates it.
    pub fn tls_target(&self, host: Option<&str>, endpoint: IpAddr, http2: bool) -> Option<TlsTarget> {
        let origination = self.policy.as_ref()?.tls.as_ref()?;
        Some(origination.target(host, endpoint, http2))
    }

    /// The service's endpoints for `port` (of `subset`, a DestinationRule's, when set):
    /// in the mesh (HBONE) or not (plain TCP from the waypoint, as Istio's waypoint sends
    /// to a ServiceEntry's endpoints). A subset no rule defines has none.
    pub fn service(cfg: &Config, from: &Origin<'_>, svc: &Arc<Service>, port: u16, subset: Option<&str>) -> Backend {
        let rule = destination::rule_for(&cfg.destination_rules, svc);
        let policy = rule.and_then(|r| r.policy(subset, port)).cloned();
        let mut b = Backend { service: Some(svc.clone()), endpoints: Vec::new(), unresolved: Vec::new(), http2: port_speaks_http2(svc, port), policy };
        // PASSTHROUGH: no endpoint is picked; the original destination is where it goes
        // (Envoy's ORIGINAL_DST cluster, ztunnel's passthrough).
        if svc.lb_mode() == LoadBalancerMode::Passthrough {
            if let Some(dst) = from.target {
                let wl = cfg.state.workload_by_ip(dst.ip()).cloned().unwrap_or_else(|| Arc::new(outside(dst)));
                b.endpoints.push((dst, wl));
            }
            return b;
        }
        let selector = match subset {
            None => None,
            Some(name) => match rule.and_then(|r| r.subset(name)) {
                Some(labels) => Some(labels),
                None => return b,
            },
        };
        let mut eps = cfg.state.usable_endpoints(svc, port);
        if let Some(sel) = selector {
            eps.retain(|(w, _)| cfg.labels.selects(&w.uid, sel));
        }
        for (w, p) in locality_preferred(from.me, svc, eps) {
            match w.workload_ips.iter().copied().find(IpAddr::is_ipv4) {
                Some(ip) => b.endpoints.push((SocketAddr::new(ip, p), w)),
                None if !w.hostname.is_empty() => b.unresolved.push((w, p)),
                None => {}
            }
        }
        b
    }

    /// The one workload a client addressed directly (a workload waypoint's target).
    pub fn workload(target: SocketAddr, wl: Arc<Workload>) -> Backend {
        Backend { service: None, endpoints: vec![(target, wl)], unresolved: Vec::new(), http2: None, policy: None }
    }

    /// Whether there is nothing to send to, resolved or not.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty() && self.unresolved.is_empty()
    }

    /// Resolves the hostname endpoints (for `me`, counted in `istio_on_demand_dns_total`),
    /// each IPv4 address an endpoint. Fails, saying why, only when nothing is left to
    /// send to; a name that does not resolve while others do is logged.
    pub async fn resolve(&mut self, resolver: &OnDemandResolver, me: &Workload) -> Result<(), String> {
        if self.unresolved.is_empty() {
            return Ok(());
        }
        let names = std::mem::take(&mut self.unresolved);
        let lookups = futures_util::future::join_all(names.iter().map(|(w, _)| resolver.resolve_all(me, &w.hostname))).await;
        let mut failed = None;
        for ((w, port), found) in names.into_iter().zip(lookups) {
            match found {
                Ok(ips) => {
                    let before = self.endpoints.len();
                    self.endpoints.extend(ips.into_iter().filter(IpAddr::is_ipv4).map(|ip| (SocketAddr::new(ip, port), w.clone())));
                    if self.endpoints.len() == before {
                        failed.get_or_insert(format!("endpoint {}: no IPv4 address", w.hostname));
                    }
                }
                Err(e) => {
                    tracing::debug!(hostname = %w.hostname, error = %e, "hostname endpoint not resolved");
                    failed.get_or_insert(format!("endpoint {}: {e}", w.hostname));
                }
            }
        }
        match failed {
            Some(why) if self.endpoints.is_empty() => Err(why),
            _ => Ok(()),
        }
    }
}
