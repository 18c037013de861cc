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
use ztunnel::state::{
    locality_preferred, AppProtocol, LoadBalancerMode, Protocol as MeshProtocol, Service, Workload,
};

use crate::config::Config;
use crate::destination::{self, Policy, TlsTarget};

/// Who asks for a backend: the waypoint's own workload (its locality picks endpoints) and
/// the original destination (where a PASSTHROUGH Service's traffic goes), if any.
pub struct Origin<'a> {
    pub me: &'a Workload,
    pub target: Option<SocketAddr>,
    /// The mesh's root namespace: with the waypoint's own, where its DestinationRules
    /// come from.
    pub root_namespace: &'a str,
}

impl Origin<'_> {
    /// Who looks DestinationRules up: the waypoint, in its own namespace.
    pub fn client(&self) -> destination::Client<'_> {
        destination::Client {
            namespace: &self.me.namespace,
            root_namespace: self.root_namespace,
        }
    }
}

/// A destination outside the mesh known only by its address (a PASSTHROUGH Service's).
fn outside(dst: SocketAddr) -> Workload {
    Workload {
        workload_ips: vec![dst.ip()],
        protocol: MeshProtocol::TCP,
        ..Workload::new(format!("passthrough/{dst}"), dst.ip().to_string(), "")
    }
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
    /// `unresolved` holds the request's own Host (a DYNAMIC_DNS ServiceEntry's, `egress`):
    /// looked up without `istio_on_demand_dns_total`, whose `hostname` label must stay
    /// bounded by the config, not by what clients send.
    pub dynamic_dns: bool,
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
    pub fn tls_target(
        &self,
        host: Option<&str>,
        endpoint: IpAddr,
        http2: bool,
    ) -> Option<TlsTarget> {
        let origination = self.policy.as_ref()?.tls.as_ref()?;
        Some(origination.target(host, endpoint, http2))
    }

    /// The service's endpoints for `port` (of `subset`, a DestinationRule's, when set):
    /// in the mesh (HBONE) or not (plain TCP from the waypoint, as Istio's waypoint sends
    /// to a ServiceEntry's endpoints), in the waypoint's network. A subset no rule defines
    /// has none. Each endpoint at its address of the client's family (the CONNECT
    /// target's; IPv4 for the waypoint's own calls) if it has one, within the service's IP
    /// families, as ztunnel picks endpoints: a dual-stack client keeps its family.
    pub fn service(
        cfg: &Config,
        from: &Origin<'_>,
        svc: &Arc<Service>,
        port: u16,
        subset: Option<&str>,
    ) -> Backend {
        let rule = destination::rule_for(&cfg.destination_rules, from.client(), svc);
        let policy = rule.and_then(|r| r.policy(subset, port)).cloned();
        let mut b = Backend {
            service: Some(svc.clone()),
            endpoints: Vec::new(),
            unresolved: Vec::new(),
            http2: port_speaks_http2(svc, port),
            policy,
            dynamic_dns: false,
        };
        // PASSTHROUGH: no endpoint is picked; the original destination is where it goes
        // (Envoy's ORIGINAL_DST cluster, ztunnel's passthrough).
        if svc.lb_mode() == LoadBalancerMode::Passthrough {
            if let Some(dst) = from.target {
                let wl = cfg
                    .state
                    .workload_by_ip(crate::network::get(), dst.ip())
                    .cloned()
                    .unwrap_or_else(|| Arc::new(outside(dst)));
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
        let mut eps = crate::network::same_network(cfg.state.usable_endpoints(
            svc,
            port,
            crate::network::get(),
        ));
        if let Some(sel) = selector {
            eps.retain(|(w, _)| cfg.labels.selects(&w.uid, sel));
        }
        let family = from
            .target
            .map_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), |t| t.ip());
        for (w, p) in locality_preferred(from.me, svc, eps) {
            match w.address_for(family, svc.ip_families) {
                Some(ip) => b.endpoints.push((SocketAddr::new(ip, p), w)),
                None if !w.hostname.is_empty() => b.unresolved.push((w, p)),
                None => {}
            }
        }
        b
    }

    /// The one workload a client addressed directly (a workload waypoint's target).
    pub fn workload(target: SocketAddr, wl: Arc<Workload>) -> Backend {
        Backend {
            service: None,
            endpoints: vec![(target, wl)],
            unresolved: Vec::new(),
            http2: None,
            policy: None,
            dynamic_dns: false,
        }
    }

    /// Whether there is nothing to send to, resolved or not.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty() && self.unresolved.is_empty()
    }

    /// Resolves the hostname endpoints (for `me`, counted in `istio_on_demand_dns_total`),
    /// each IPv4 address an endpoint (the IPv6 ones when a name has no IPv4 address). Fails, saying why, only when nothing is left to
    /// send to; a name that does not resolve while others do is logged.
    pub async fn resolve(
        &mut self,
        resolver: &OnDemandResolver,
        me: &Workload,
    ) -> Result<(), String> {
        if self.unresolved.is_empty() {
            return Ok(());
        }
        let names = std::mem::take(&mut self.unresolved);
        let dynamic = self.dynamic_dns;
        let lookups = futures_util::future::join_all(names.iter().map(|(w, _)| async move {
            if dynamic {
                resolver.addresses(&w.hostname).await
            } else {
                resolver.resolve_all(me, &w.hostname).await
            }
        }))
        .await;
        let mut failed = None;
        for ((w, port), found) in names.into_iter().zip(lookups) {
            match found {
                Ok(ips) => {
                    let before = self.endpoints.len();
                    let v4 = ips.iter().any(IpAddr::is_ipv4);
                    self.endpoints.extend(
                        ips.into_iter()
                            .filter(|ip| ip.is_ipv4() == v4)
                            .map(|ip| (SocketAddr::new(ip, port), w.clone())),
                    );
                    if self.endpoints.len() == before {
                        failed.get_or_insert(format!("endpoint {}: no address", w.hostname));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_in_the_clients_family_within_the_services() {
        let yaml = r#"
workloads:
- {uid: a, name: a, namespace: default, workloadIps: [10.0.0.1, "fd00::1"], protocol: HBONE, services: {default/dual.default.svc.cluster.local: {80: 8080}, default/v4.default.svc.cluster.local: {80: 8080}}}
- {uid: b, name: b, namespace: default, workloadIps: ["fd00::2"], protocol: HBONE, services: {default/dual.default.svc.cluster.local: {80: 8080}}}
services:
- {name: dual, namespace: default, hostname: dual.default.svc.cluster.local, vips: [/10.96.0.1, "/fd00:96::1"], ports: {80: 8080}}
- {name: v4, namespace: default, hostname: v4.default.svc.cluster.local, vips: [/10.96.0.2], ports: {80: 8080}, ipFamilies: IPv4}
"#;
        let cfg = Config::parse(std::path::Path::new("t.yaml"), yaml).expect("test config");
        let svc = |name: &str| {
            cfg.state
                .service_by_name("default", name)
                .expect("service")
                .clone()
        };
        let addrs = |b: Backend| {
            let mut v: Vec<String> = b.endpoints.iter().map(|(a, _)| a.to_string()).collect();
            v.sort();
            v
        };
        let me = Workload::new("wp", "wp", "default");
        let to = |target: Option<&str>| Origin {
            me: &me,
            target: target.map(|t| SocketAddr::new(t.parse().unwrap(), 80)),
            root_namespace: "istio-system",
        };
        let service =
            |name: &str, target| addrs(Backend::service(&cfg, &to(target), &svc(name), 80, None));
        assert_eq!(
            service("dual", Some("fd00:96::1")),
            ["[fd00::1]:8080", "[fd00::2]:8080"]
        );
        // An IPv6-only endpoint stays an endpoint of an IPv4 client's request (its only address).
        assert_eq!(
            service("dual", Some("10.96.0.1")),
            ["10.0.0.1:8080", "[fd00::2]:8080"]
        );
        // The waypoint's own calls (no client): IPv4 where there is one.
        assert_eq!(service("dual", None), ["10.0.0.1:8080", "[fd00::2]:8080"]);
        // An IPv4 service: IPv4 addresses only, whatever the client's family.
        assert_eq!(service("v4", Some("fd00:96::1")), ["10.0.0.1:8080"]);
    }
}
