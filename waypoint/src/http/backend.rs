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
    /// TCP from the waypoint, as Istio's waypoint sends to a ServiceEntry's endpoints).
    pub fn service(cfg: &Config, svc: &Arc<Service>, port: u16) -> Backend {
        let endpoints = crate::network::same_network(cfg.state.usable_endpoints(svc, port, crate::network::get()))
            .into_iter()
            .filter_map(|(w, p)| w.workload_ips.iter().copied().find(IpAddr::is_ipv4).map(|ip| (SocketAddr::new(ip, p), w)))
            .collect();
        Backend { service: Some(svc.clone()), endpoints, http2: port_speaks_http2(svc, port) }
    }
}
