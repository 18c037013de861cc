//! What every connection handler of the per-pod proxy needs, shared by all pods.

use std::sync::Arc;

use crate::capture;
use crate::config::ProxyConfig;
use crate::hbone::Pool;
use crate::identity::CertManager;
use crate::state::SharedState;

/// What every connection handler needs.
pub struct ProxyInputs {
    pub state: Arc<SharedState>,
    pub certs: Arc<CertManager>,
    pub pool: Pool,
    pub cfg: ProxyConfig,
    pub capture: capture::Backend,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub drain: Arc<crate::drain::Drain>,
    /// The HBONE server's limits (handshakes in flight are counted across all pods).
    pub hbone_server: Arc<crate::hbone::server::Server>,
    /// The DNS proxy, when on: each pod gets its listeners.
    pub dns: Option<Arc<crate::dns::DnsProxy>>,
    /// Each pod proxy's state, for the admin dump.
    pub workload_states: Arc<super::states::WorkloadStates>,
    /// Resolves the hostnames of workloads without an IP (always on, DNS proxy or not).
    pub on_demand_dns: Arc<crate::dns::on_demand::OnDemandResolver>,
    /// The CRLs of CRL_PATH, when set: peers they revoke are refused, and cut off when a
    /// reload revokes them (the pool holds the same set for outbound).
    pub crls: Option<crate::tls::Crls>,
}
