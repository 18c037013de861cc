//! Where a request (or its mirror) goes: a service's healthy mesh endpoints, or the one
//! workload the client addressed.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ztunnel::state::{Service, Workload};

use crate::config::Config;

/// Where the router sends a request: a backend service, or the CONNECT target workload.
pub struct Backend {
    pub service: Option<Arc<Service>>,
    pub endpoints: Vec<(SocketAddr, Arc<Workload>)>,
}

impl Backend {
    /// The service's healthy HBONE endpoints for `port`.
    pub fn service(cfg: &Config, svc: &Arc<Service>, port: u16) -> Backend {
        let endpoints = cfg
            .state
            .usable_hbone_endpoints(svc, port)
            .into_iter()
            .filter_map(|(w, p)| w.workload_ips.iter().copied().find(IpAddr::is_ipv4).map(|ip| (SocketAddr::new(ip, p), w)))
            .collect();
        Backend { service: Some(svc.clone()), endpoints }
    }
}
