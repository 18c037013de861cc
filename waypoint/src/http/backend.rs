//! Where a request (or its mirror) goes: a service's healthy mesh endpoints, or the one
//! workload the client addressed.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ztunnel::state::{AppProtocol, Service, Workload};

use crate::config::Config;

/// Where the router sends a request: a backend service, or the CONNECT target workload.
pub struct Backend {
    pub service: Option<Arc<Service>>,
    pub endpoints: Vec<(SocketAddr, Arc<Workload>)>,
    /// The HTTP version the backend speaks, when its service port says (Some(true):
    /// HTTP/2 with prior knowledge); None: the client's, as Istio's waypoint does for
    /// ports of unknown protocol.
    pub http2: Option<bool>,
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
    /// The service's healthy endpoints for `port`: in the mesh (HBONE) or not (plain
    /// TCP from the waypoint, as Istio's waypoint sends to a ServiceEntry's endpoints),
    /// each at its IPv4 address if it has one (the waypoint's own calls: no client family
    /// to keep).
    pub fn service(cfg: &Config, svc: &Arc<Service>, port: u16) -> Backend {
        Self::service_from(cfg, svc, port, IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
    }

    /// [`Backend::service`] for a client's request to `original` (the CONNECT target): each
    /// endpoint at its address of that family if it has one (a dual-stack client keeps
    /// its family), within the service's IP families, as ztunnel picks endpoints.
    pub fn service_from(cfg: &Config, svc: &Arc<Service>, port: u16, original: IpAddr) -> Backend {
        let endpoints = crate::network::same_network(cfg.state.usable_endpoints(svc, port, crate::network::get()))
            .into_iter()
            .filter_map(|(w, p)| w.address_for(original, svc.ip_families).map(|ip| (SocketAddr::new(ip, p), w)))
            .collect();
        Backend { service: Some(svc.clone()), endpoints, http2: port_speaks_http2(svc, port) }
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
        let svc = |name: &str| cfg.state.service_by_name("default", name).expect("service").clone();
        let addrs = |b: Backend| {
            let mut v: Vec<String> = b.endpoints.iter().map(|(a, _)| a.to_string()).collect();
            v.sort();
            v
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(addrs(Backend::service_from(&cfg, &svc("dual"), 80, ip("fd00:96::1"))), ["[fd00::1]:8080", "[fd00::2]:8080"]);
        // An IPv6-only endpoint stays an endpoint of an IPv4 client's request (its only address).
        assert_eq!(addrs(Backend::service_from(&cfg, &svc("dual"), 80, ip("10.96.0.1"))), ["10.0.0.1:8080", "[fd00::2]:8080"]);
        assert_eq!(addrs(Backend::service(&cfg, &svc("dual"), 80)), ["10.0.0.1:8080", "[fd00::2]:8080"]);
        // An IPv4 service: IPv4 addresses only, whatever the client's family.
        assert_eq!(addrs(Backend::service_from(&cfg, &svc("v4"), 80, ip("fd00:96::1"))), ["10.0.0.1:8080"]);
    }
}
