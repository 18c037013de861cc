//! The tunnel a request arrived in: what every step knows about its client.

use std::net::SocketAddr;

use ztunnel::hbone::TraceParent;
use ztunnel::identity::Identity;

/// The tunnel a request arrived in.
pub struct Tunnel {
    /// Verified mTLS identity of the HBONE peer (the client's ztunnel speaks as the client).
    pub src_identity: Identity,
    /// The HBONE peer's address: in ambient, the client pod's own IP.
    pub src_addr: SocketAddr,
    /// The CONNECT target: a service VIP:port or a workload ip:port.
    pub target: SocketAddr,
    /// The CONNECT's trace (Istio ztunnel's per-connection traceparent): the tunnel's log
    /// lines carry its id, and the waypoint's own CONNECTs for it pass it on.
    pub trace: TraceParent,
}
