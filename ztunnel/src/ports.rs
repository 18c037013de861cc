//! The well-known ports of a node proxy, Istio's numbers.

/// Outbound listener inside each pod (loopback; capture REDIRECTs the pod's connections here).
pub const OUTBOUND: u16 = 15001;
/// Inbound plaintext listener inside each pod (non-mesh clients).
pub const INBOUND_PLAINTEXT: u16 = 15006;
/// Inbound HBONE listener inside each pod (mTLS tunnels).
pub const HBONE: u16 = 15008;
/// Istio's SOCKS5 listener; there is none here, but the port stays reserved.
pub const SOCKS5: u16 = 15080;
/// The DNS proxy inside each pod, on 127.0.0.1, UDP and TCP.
pub const DNS: u16 = 15053;
/// Defaults of the node-level endpoints in the proxy's own netns: admin (loopback),
/// Prometheus metrics, readiness.
pub const ADMIN: u16 = 15000;
pub const STATS: u16 = 15020;
pub const READINESS: u16 = 15021;

/// Ports the proxy listens on inside each pod: as an original destination they are self-calls.
pub fn is_proxy_port(p: u16) -> bool {
    matches!(p, OUTBOUND | INBOUND_PLAINTEXT | HBONE | SOCKS5)
}
