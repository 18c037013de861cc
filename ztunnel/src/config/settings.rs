//! The node proxy's settings after flags and Istio's environment are read: one struct,
//! built once at start, that the proxy runs with (`proxy`) and that `/config_dump`
//! serializes under Istio ztunnel's `Config` field names and serde shapes (durations as
//! `{secs, nanos}`, listen addresses as `{"Localhost": [v6, port]}` / `{"SocketAddr": ..}`,
//! root certificates as `{"File": path}` / `"Static"` / `"Default"`), followed by ours.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::ProxyConfig;

/// Istio's `Address`: loopback as (dual stack, port), anything else as it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ListenAddress {
    Localhost(bool, u16),
    SocketAddr(SocketAddr),
}

impl From<SocketAddr> for ListenAddress {
    fn from(a: SocketAddr) -> Self {
        if a.ip().is_loopback() {
            ListenAddress::Localhost(a.is_ipv6(), a.port())
        } else {
            ListenAddress::SocketAddr(a)
        }
    }
}

/// Istio's `RootCert`: a file, an inline PEM (`Static`), or the system's (`Default`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RootCertSource {
    File(PathBuf),
    Static,
    Default,
}

impl RootCertSource {
    pub fn of(setting: &str) -> RootCertSource {
        match crate::istiod::RootCert::from_setting(setting) {
            crate::istiod::RootCert::File(p) => RootCertSource::File(p),
            crate::istiod::RootCert::Pem(_) => RootCertSource::Static,
            crate::istiod::RootCert::System => RootCertSource::Default,
        }
    }
}

/// Istio's `SocketConfig` (TCP keepalive of the proxy's sockets).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SocketConfig {
    pub keepalive_time: Duration,
    pub keepalive_interval: Duration,
    pub keepalive_retries: u32,
    pub keepalive_enabled: bool,
    pub user_timeout_enabled: bool,
}

/// A header sent to istiod: the name only (values may be credentials).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedactedHeader(pub String);

impl Serialize for RedactedHeader {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (&self.0, "<redacted>").serialize(s)
    }
}

/// Everything the node proxy was started with.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    pub proxy: bool,
    pub dns_proxy: bool,
    pub window_size: u32,
    pub connection_window_size: u32,
    pub frame_size: u32,
    pub socks5_addr: Option<ListenAddress>,
    pub admin_addr: ListenAddress,
    pub stats_addr: ListenAddress,
    pub readiness_addr: ListenAddress,
    pub inbound_addr: String,
    pub inbound_plaintext_addr: String,
    pub outbound_addr: String,
    pub dns_proxy_addr: ListenAddress,
    pub illegal_ports: Vec<u16>,
    pub network: String,
    pub proxy_mode: &'static str,
    pub proxy_workload_information: Option<()>,
    pub cluster_id: String,
    pub cluster_domain: String,
    pub ca_address: Option<String>,
    pub ca_root_cert: RootCertSource,
    pub alt_ca_hostname: Option<String>,
    pub xds_address: Option<String>,
    pub xds_root_cert: RootCertSource,
    pub alt_xds_hostname: Option<String>,
    pub prefered_service_namespace: Option<String>,
    pub secret_ttl: Duration,
    pub xds_on_demand: bool,
    pub fake_ca: bool,
    pub fake_self_inbound: bool,
    pub self_termination_deadline: Duration,
    pub proxy_metadata: BTreeMap<String, serde_json::Value>,
    pub num_worker_threads: usize,
    pub require_original_source: bool,
    pub proxy_args: String,
    pub inpod_uds: Option<PathBuf>,
    pub inpod_port_reuse: bool,
    pub packet_mark: u32,
    pub socket_config: SocketConfig,
    pub xds_headers: Vec<RedactedHeader>,
    pub ca_headers: Vec<RedactedHeader>,
    pub localhost_app_tunnel: bool,
    pub ztunnel_identity: Option<String>,
    pub ipv6_enabled: bool,
    pub crl_path: Option<PathBuf>,
    /// What the per-pod proxies run with (Istio's `localNode`, `poolMaxStreamsPerConn`,
    /// `poolUnusedReleaseTimeout`, and our own limits).
    #[serde(flatten)]
    pub proxy_config: ProxyConfig,
    // Ours.
    pub local_xds_path: Option<PathBuf>,
    pub capture_mode: String,
    pub dns_capture: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn j<T: Serialize>(v: T) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    #[test]
    fn istios_serde_shapes() {
        let a = |s: &str| ListenAddress::from(s.parse::<SocketAddr>().unwrap());
        assert_eq!(j(a("127.0.0.1:15000")), serde_json::json!({"Localhost": [false, 15000]}));
        assert_eq!(j(a("[::1]:15000")), serde_json::json!({"Localhost": [true, 15000]}));
        assert_eq!(j(a("0.0.0.0:15020")), serde_json::json!({"SocketAddr": "0.0.0.0:15020"}));
        assert_eq!(j(RootCertSource::File("/a.pem".into())), serde_json::json!({"File": "/a.pem"}));
        assert_eq!(j(RootCertSource::Static), serde_json::json!("Static"));
        assert_eq!(j(Duration::from_millis(1500)), serde_json::json!({"secs": 1, "nanos": 500_000_000}));
        assert_eq!(j(RedactedHeader("x-tenant".into())), serde_json::json!(["x-tenant", "<redacted>"]));
    }
}
