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

/// Flags whose value is a credential (Istio's AUTH_TOKEN may be the token itself).
const SECRET_FLAGS: [&str; 1] = ["--auth-token"];

/// The command line as `/config_dump` shows it (`proxyArgs`): the values of
/// [`SECRET_FLAGS`] replaced by `<redacted>`, in both `--flag value` and `--flag=value`
/// forms, so the admin endpoint never hands out a credential.
pub fn redacted_args(args: impl IntoIterator<Item = String>) -> String {
    let mut out = Vec::new();
    let mut hide_next = false;
    for a in args {
        if std::mem::take(&mut hide_next) {
            out.push("<redacted>".to_string());
            continue;
        }
        match a.split_once('=') {
            Some((flag, _)) if SECRET_FLAGS.contains(&flag) => {
                out.push(format!("{flag}=<redacted>"))
            }
            _ => {
                hide_next = SECRET_FLAGS.contains(&a.as_str());
                out.push(a);
            }
        }
    }
    out.join(" ")
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
    /// Istio's ENABLE_RESPONSE_BAGGAGE, under Istio's name in its dump.
    pub enable_enhanced_baggage: bool,
    /// What the per-pod proxies run with (Istio's `localNode`, `poolMaxStreamsPerConn`,
    /// `poolUnusedReleaseTimeout`, and our own limits).
    #[serde(flatten)]
    pub proxy_config: ProxyConfig,
    // Ours.
    pub local_xds_path: Option<PathBuf>,
    pub capture_mode: String,
    pub dns_capture: bool,
}

/// Proxy settings that are not mesh state (in `/config_dump` under Istio's names where
/// it has them, see [`Settings`]).
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyConfig {
    #[serde(rename = "localNode")]
    pub node_name: String,
    /// Streams per pooled HBONE connection before another connection opens (Istio: 100).
    #[serde(rename = "poolMaxStreamsPerConn")]
    pub pool_max_streams: usize,
    /// Idle pooled HBONE connections close after this (Istio: 5 min).
    #[serde(rename = "poolUnusedReleaseTimeout")]
    pub pool_idle_timeout: Duration,
    pub connect_timeout: Duration,
    /// A proxied connection with no bytes either way for this long is closed (Envoy's
    /// TCP proxy default: 1 h); None: never.
    pub idle_timeout: Option<Duration>,
    /// Connections a pod may have open through its proxy at once (0: no limit); more are
    /// refused (reset) and counted.
    pub max_connections_per_pod: usize,
    /// Concurrent streams an HBONE peer may open on one connection (Istio: 200).
    pub hbone_max_streams: u32,
    /// Largest header block an HBONE peer may send.
    pub hbone_max_header_bytes: u32,
    /// TLS + HTTP/2 handshakes in flight on 15008, all pods together (0: no limit); a
    /// connection over the limit is closed at once.
    pub hbone_max_handshakes: usize,
    /// The same from one source address (an IPv6 /64) (0: no limit).
    pub hbone_max_handshakes_per_ip: usize,
    /// An HBONE connection with no stream open this long gets GOAWAY and is closed; None: never.
    pub hbone_idle_timeout: Option<Duration>,
    /// Istio's LOCALHOST_APP_TUNNEL (default true): inbound connections to a workload with
    /// a PROXY application tunnel go to 127.0.0.1:<tunnel port> from loopback instead of
    /// to the pod's IP from the client's (the client is in the PROXY header). Dumped as
    /// Istio's `localhostAppTunnel` by [`Settings`].
    #[serde(skip)]
    pub localhost_app_tunnel: bool,
    /// Istio's NETWORK: the network this node's pods are in. Addresses are looked up in
    /// it, and a destination of another network is reached through its gateway. Dumped
    /// as Istio's `network` by [`Settings`].
    #[serde(skip)]
    pub network: String,
    /// Istio's IPV6_ENABLED (default true): a pod's IPv6 address gets listeners and
    /// capture, and on-demand DNS asks AAAA too. Off, IPv6 from and to pods is refused
    /// (fail closed) and the DNS proxy answers AAAA questions for mesh names with no
    /// records. Dumped as Istio's `ipv6Enabled` by [`Settings`].
    #[serde(skip)]
    pub ipv6_enabled: bool,
    /// Istio's ENABLE_RESPONSE_BAGGAGE (default true): the 200 that opens an inbound
    /// tunnel carries the destination workload's baggage, and an inbound tunnel's source
    /// that config does not describe (behind an east-west gateway) is labelled by its
    /// request baggage. Off: neither (the client's own reading of response baggage does
    /// not depend on it, as in Istio). Dumped as Istio's `enableEnhancedBaggage` by
    /// [`Settings`].
    #[serde(skip)]
    pub response_baggage: bool,
}

#[cfg(test)]
mod tests {
    #[test]
    fn credentials_in_the_command_line_are_redacted() {
        let args = |v: &[&str]| super::redacted_args(v.iter().map(|s| s.to_string()));
        assert_eq!(
            args(&["--auth-token", "s3cret", "--node-name", "n1"]),
            "--auth-token <redacted> --node-name n1"
        );
        assert_eq!(args(&["--auth-token=s3cret"]), "--auth-token=<redacted>");
        assert_eq!(
            args(&["--node-name", "--auth-token"]),
            "--node-name --auth-token"
        );
        assert_eq!(args(&["--auth-token-file", "x"]), "--auth-token-file x");
    }

    use super::*;

    fn j<T: Serialize>(v: T) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    #[test]
    fn istios_serde_shapes() {
        let a = |s: &str| ListenAddress::from(s.parse::<SocketAddr>().unwrap());
        assert_eq!(
            j(a("127.0.0.1:15000")),
            serde_json::json!({"Localhost": [false, 15000]})
        );
        assert_eq!(
            j(a("[::1]:15000")),
            serde_json::json!({"Localhost": [true, 15000]})
        );
        assert_eq!(
            j(a("0.0.0.0:15020")),
            serde_json::json!({"SocketAddr": "0.0.0.0:15020"})
        );
        assert_eq!(
            j(RootCertSource::File("/a.pem".into())),
            serde_json::json!({"File": "/a.pem"})
        );
        assert_eq!(j(RootCertSource::Static), serde_json::json!("Static"));
        assert_eq!(
            j(Duration::from_millis(1500)),
            serde_json::json!({"secs": 1, "nanos": 500_000_000})
        );
        assert_eq!(
            j(RedactedHeader("x-tenant".into())),
            serde_json::json!(["x-tenant", "<redacted>"])
        );
    }
}
