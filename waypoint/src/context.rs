//! What every tunnel and request handler of one waypoint shares.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use ztunnel::drain::Drain;
use ztunnel::hbone::Pool;
use ztunnel::identity::Identity;
use ztunnel::metrics::http::HttpMetrics;
use ztunnel::netns::InPodNetns;
use ztunnel::state::Workload;

use crate::authn::JwksStore;
use crate::config::Config;
use crate::lb::{Balancer, Circuits};
use crate::object::ObjectName;
use crate::upstream::Upstreams;

/// Everything a tunnel or request handler needs.
pub struct Waypoint {
    pub config: Arc<ArcSwap<Config>>,
    pub me: Arc<Workload>,
    pub identity: Identity,
    pub gateway: ObjectName,
    /// The mesh's root namespace (`--root-namespace`).
    pub root_namespace: String,
    pub ip: IpAddr,
    pub pool: Pool,
    pub netns: InPodNetns,
    pub upstreams: Upstreams,
    pub balancer: Arc<Balancer>,
    /// DestinationRule connection pool limits: what is in flight per Service.
    pub circuits: Circuits,
    pub http_metrics: HttpMetrics,
    /// Istio's TCP metrics (`reporter="waypoint"`) for tunnels relayed at L4.
    pub metrics: Arc<ztunnel::metrics::Metrics>,
    pub drain: Arc<Drain>,
    pub detect_timeout: Duration,
    /// `ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS`: TLS to a DYNAMIC_DNS wildcard
    /// entry goes to the host its SNI names (`egress`).
    pub wildcard_tls: bool,
    /// The key sets of the config's jwksUris, kept fresh in the background.
    pub jwks: Arc<JwksStore>,
    /// Finished request spans on their way to the tracing provider.
    pub spans: crate::trace::SpanQueue,
    /// `envoyOtelAls` access-log records on their way to their collectors.
    pub otel_logs: crate::telemetry::otel_log::LogQueue,
    /// Bounds mirrored requests in flight.
    pub mirror_slots: Arc<tokio::sync::Semaphore>,
    /// Resolves backends' endpoints known by hostname only (DNS ServiceEntries), as the
    /// node proxy's on-demand DNS does (its cache and bounds).
    pub resolver: Arc<ztunnel::dns::on_demand::OnDemandResolver>,
    /// CRL_PATH's revocation lists, when set: clients are checked at the handshake and
    /// again on every reload (the pool checks upstreams).
    pub crls: Option<ztunnel::tls::Crls>,
    /// The waypoint's certificates (the roots a client's chain is re-checked against).
    pub certs: Arc<ztunnel::identity::CertManager>,
    /// Relayed tunnels and HTTP connections with no byte either way for this long close.
    pub idle_timeout: Option<Duration>,
    /// A request stream with no frame of its request or response body either way for
    /// this long is ended (Envoy's stream_idle_timeout); WebSockets once upgraded aside.
    pub stream_idle_timeout: Option<Duration>,
    /// HTTP/1.0 requests are served (PILOT_HTTP10); otherwise answered 426, as Envoy
    /// does without `accept_http_10`.
    pub accept_http10: bool,
}

impl Waypoint {
    /// The waypoint's own workload as `cfg`'s mesh state has it now (its locality may
    /// have changed since it started), else as it started.
    pub fn me_in<'c>(&'c self, cfg: &'c Config) -> &'c Workload {
        cfg.state
            .workload_by_uid(&self.me.uid)
            .map(|w| &**w)
            .unwrap_or(&self.me)
    }
}
