//! ztunnel: the ambient mesh node proxy. Shared mesh code (identity, TLS, HBONE,
//! config, L4 policy) lives here so the waypoint can reuse it; L7 (HTTPRoute, L7
//! AuthorizationPolicy) is the waypoint's own.

pub mod access_log;
pub mod admin;
pub mod capture;
pub mod cidr;
pub mod config;
pub mod dns;
pub mod drain;
#[doc(hidden)]
pub mod fuzzing;
pub mod hbone;
pub mod http_endpoint;
pub mod metrics;
pub mod identity;
pub mod istiod;
pub mod logging;
pub mod memory;
pub mod netns;
pub mod proxy;
pub mod proxy_protocol;
pub mod rbac;
pub mod state;
pub mod tls;
pub mod xds;
pub mod zds;

/// SO_MARK on every socket the proxy opens, so capture rules exempt its own traffic.
pub const PROXY_MARK: u32 = 1337;

/// SO_MARK on the proxy's transparent deliveries to a pod's app (connections that carry
/// the real client's address); replies to them are routed back over lo by this mark.
pub const DELIVERY_MARK: u32 = 0x111;

/// Ports the proxy listens on inside each pod; as an original destination they are self-calls.
pub mod ports {
    pub const OUTBOUND: u16 = 15001;
    pub const INBOUND_PLAINTEXT: u16 = 15006;
    pub const HBONE: u16 = 15008;
    pub const SOCKS5: u16 = 15080;

    pub fn is_proxy_port(p: u16) -> bool {
        matches!(p, OUTBOUND | INBOUND_PLAINTEXT | HBONE | SOCKS5)
    }
}
