//! Configuration: the local (standalone) mesh config file and the proxy's own settings.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::rbac::Authorization;
use crate::state::{MeshState, Service, StateError, Workload};

// Istio ztunnel's environment variables (issue 18).
pub mod istio_env;
pub mod settings;

pub use settings::ProxyConfig;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// serde_yaml's message names the field path, line and column.
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("inconsistent config file {path}: {source}")]
    State { path: PathBuf, source: StateError },
}

/// Istio ztunnel's local config shape: three lists, camelCase keys; plus the waypoint's
/// L7 lists, since one file configures the whole local mesh.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalConfig {
    #[serde(default)]
    pub workloads: Vec<Workload>,
    #[serde(default)]
    pub services: Vec<Service>,
    #[serde(default)]
    pub policies: Vec<Authorization>,
    /// The waypoint's L7 routing (Gateway API HTTPRoute). Accepted so the shared file
    /// loads, not interpreted: ztunnel is L4 only, and the waypoint parses and
    /// validates these itself (a bad route fails the waypoint's load, not ztunnel's).
    #[serde(default)]
    pub http_routes: Vec<serde_yaml::Value>,
    /// The waypoint's gRPC routing (Gateway API GRPCRoute); accepted and not
    /// interpreted, as `http_routes`.
    #[serde(default)]
    pub grpc_routes: Vec<serde_yaml::Value>,
    /// The waypoint's L4 routing (Gateway API TCPRoute); accepted and not interpreted.
    #[serde(default)]
    pub tcp_routes: Vec<serde_yaml::Value>,
    /// The waypoint's TLS passthrough routing (Gateway API TLSRoute); accepted and not
    /// interpreted.
    #[serde(default)]
    pub tls_routes: Vec<serde_yaml::Value>,
    /// Gateway API ReferenceGrants (the waypoint's cross-namespace backends); accepted
    /// and not interpreted.
    #[serde(default)]
    pub reference_grants: Vec<serde_yaml::Value>,
    /// Istio DestinationRules (the waypoint's per-Service traffic policies); accepted and
    /// not interpreted.
    #[serde(default)]
    pub destination_rules: Vec<serde_yaml::Value>,
    /// Istio VirtualServices (the waypoint's routing and fault injection); accepted and
    /// not interpreted.
    #[serde(default)]
    pub virtual_services: Vec<serde_yaml::Value>,
    /// The waypoint's L7 authorization (Istio AuthorizationPolicy with targetRefs);
    /// accepted and not interpreted, as `http_routes`.
    #[serde(default)]
    pub authorization_policies: Vec<serde_yaml::Value>,
    /// The waypoint's JWT authentication (Istio RequestAuthentication with targetRefs);
    /// accepted and not interpreted, as `http_routes`.
    #[serde(default)]
    pub request_authentications: Vec<serde_yaml::Value>,
    /// Istio Telemetries (the waypoint's access logging, metric and tracing overrides);
    /// accepted and not interpreted.
    #[serde(default)]
    pub telemetries: Vec<serde_yaml::Value>,
    /// Istio's MeshConfig (as the `mesh` key of the `istio` ConfigMap); the waypoint
    /// reads its `extensionProviders` (CUSTOM policies' authorizers). Not interpreted here.
    #[serde(default)]
    pub mesh_config: Option<serde_yaml::Value>,
}

impl LocalConfig {
    pub fn parse(path: &Path, text: &str) -> Result<LocalConfig, ConfigError> {
        let cfg: LocalConfig = serde_yaml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<LocalConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        LocalConfig::parse(path, &text)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        for (i, w) in self.workloads.iter().enumerate() {
            for (field, value) in [
                ("uid", &w.uid.0),
                ("name", &w.name),
                ("namespace", &w.namespace),
                ("serviceAccount", &w.service_account),
                ("trustDomain", &w.trust_domain),
            ] {
                if value.is_empty()
                    || (value.contains('/') && field != "uid")
                    || value.chars().any(char::is_control)
                {
                    return Err(invalid(format!(
                        "workloads[{i}].{field}: {value:?} must be non-empty, without '/' or control characters"
                    )));
                }
            }
            if !w.hostname.is_empty() {
                crate::state::workload::validate_hostname(&w.hostname)
                    .map_err(|e| invalid(format!("workloads[{i}].hostname: {e}")))?;
            }
            crate::state::workload::validate_network(&w.network)
                .map_err(|e| invalid(format!("workloads[{i}].network: {e}")))?;
            if let Some(g) = &w.network_gateway {
                if g.hbone_mtls_port == 0 {
                    return Err(invalid(format!("workloads[{i}].networkGateway.hboneMtlsPort: 0 is not a port; omit it for 15008")));
                }
                if let crate::state::GatewayDestination::Address(a) = &g.destination {
                    crate::state::workload::validate_network(&a.network).map_err(|e| {
                        invalid(format!(
                            "workloads[{i}].networkGateway.destination: network {e}"
                        ))
                    })?;
                }
            }
            if let Some(t) = &w.application_tunnel {
                t.validate()
                    .map_err(|e| invalid(format!("workloads[{i}].applicationTunnel.{e}")))?;
            }
            for (svc, ports) in &w.services {
                if svc.0.split_once('/').is_none() {
                    return Err(invalid(format!(
                        "workloads[{i}].services: key {:?} must be \"<namespace>/<hostname>\"",
                        svc.0
                    )));
                }
                if ports.contains_key(&0) {
                    return Err(invalid(format!(
                        "workloads[{i}].services[{}]: service port 0 is not a port",
                        svc.0
                    )));
                }
            }
        }
        for (i, s) in self.services.iter().enumerate() {
            // Target port 0 means "the service port"; service port 0 means nothing.
            if s.ports.contains_key(&0) {
                return Err(invalid(format!(
                    "services[{i}].ports: service port 0 is not a port"
                )));
            }
            for san in &s.subject_alt_names {
                san.parse::<crate::identity::Identity>()
                    .map_err(|e| invalid(format!("services[{i}].subjectAltNames: {e}")))?;
            }
        }
        Ok(())
    }

    pub fn into_state(self, path: &Path) -> Result<MeshState, ConfigError> {
        MeshState::build(self.workloads, self.services, self.policies).map_err(|source| {
            ConfigError::State {
                path: path.to_path_buf(),
                source,
            }
        })
    }
}

/// What identifies a version of a file without reading it (a rename over it, as
/// Kubernetes ConfigMap updates do, changes the inode).
async fn file_stamp(path: &Path) -> Option<(std::time::SystemTime, u64, u64)> {
    let m = tokio::fs::metadata(path).await.ok()?;
    Some((
        m.modified().ok()?,
        m.len(),
        std::os::unix::fs::MetadataExt::ino(&m),
    ))
}

/// Polls `path` every `interval` and awaits `on_change` after each change (not for the
/// version present at the start).
pub async fn watch_file<F: std::future::Future<Output = ()>>(
    path: PathBuf,
    interval: Duration,
    mut on_change: impl FnMut() -> F,
) {
    let mut last = file_stamp(&path).await;
    loop {
        tokio::time::sleep(interval).await;
        let now = file_stamp(&path).await;
        if now != last {
            last = now;
            on_change().await;
        }
    }
}

/// How enrolled pods' traffic is captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CaptureMode {
    /// eBPF: cgroup connect4/sockops/getsockopt for outbound, sk_lookup for inbound.
    Ebpf,
    /// nftables REDIRECT rules inside each pod network namespace.
    Nftables,
    /// Capture is set up by someone else (e.g. istio-cni); ztunnel only binds its listeners.
    None,
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
workloads:
- uid: cluster1//Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["10.10.1.11"]
  protocol: HBONE
  node: node1
  services:
    default/echo.default.svc.cluster.local: {80: 8080}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/10.96.0.10"]
  ports: {80: 8080}
policies:
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/client}]
"#;

    #[test]
    fn parses_istio_shape() {
        let cfg = LocalConfig::parse(Path::new("x.yaml"), GOOD).unwrap();
        assert_eq!(cfg.workloads[0].trust_domain, "cluster.local");
        assert_eq!(cfg.workloads[0].capacity, 1);
        let st = cfg.into_state(Path::new("x.yaml")).unwrap();
        let svc = st
            .service_by_vip("", "10.96.0.10".parse().unwrap())
            .unwrap()
            .clone();
        let eps = st.endpoints_for(&svc, 80);
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].1, 8080);
    }

    #[test]
    fn unknown_field_names_file_line_and_field() {
        let bad = GOOD.replace("  node: node1", "  node: node1\n  nodeName: oops");
        let err = LocalConfig::parse(Path::new("/etc/zt/local.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/etc/zt/local.yaml"), "{err}");
        assert!(err.contains("unknown field `nodeName`"), "{err}");
        assert!(err.contains("line 10"), "{err}");
        assert!(err.contains("workloads[0]"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        let bad = GOOD.replace("10.10.1.11", "10.10.1.300");
        let err = LocalConfig::parse(Path::new("f.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("workloads[0].workloadIps"), "{err}");
        let bad = GOOD.replace("scope: Namespace", "scope: Cluster");
        let err = LocalConfig::parse(Path::new("f.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("policies[0].scope") && err.contains("line"),
            "{err}"
        );
        let bad = GOOD.replace("serviceAccount: client", "serviceAccount: \"a/b\"");
        let err = LocalConfig::parse(Path::new("f.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("workloads[0].serviceAccount"), "{err}");
    }

    #[test]
    fn waypoint_addresses_parse_and_bad_ones_are_named() {
        let svc = "services:\n- {name: s, namespace: d, hostname: s.d.svc, vips: [\"/10.96.0.1\"], waypoint: {destination: \"/10.0.0.9\", hboneMtlsPort: 15008}}\n";
        let cfg = LocalConfig::parse(Path::new("f.yaml"), svc).unwrap();
        let wp = cfg.services[0].waypoint.clone().unwrap();
        let crate::state::GatewayDestination::Address(a) = &wp.destination else {
            panic!("{wp:?}")
        };
        assert_eq!(a.address, "10.0.0.9".parse::<std::net::IpAddr>().unwrap());
        let by_name = svc.replace(
            "/10.0.0.9",
            "istio-system/waypoint.istio-system.svc.cluster.local",
        );
        let wp = LocalConfig::parse(Path::new("f.yaml"), &by_name)
            .unwrap()
            .services[0]
            .waypoint
            .clone()
            .unwrap();
        assert_eq!(
            wp.destination,
            crate::state::GatewayDestination::Hostname(crate::state::NamespacedHostname(
                "istio-system/waypoint.istio-system.svc.cluster.local".into()
            ))
        );
        assert_eq!(wp.hbone_mtls_port, 15008);
        let defaulted = svc.replace(", hboneMtlsPort: 15008", "");
        assert_eq!(
            LocalConfig::parse(Path::new("f.yaml"), &defaulted)
                .unwrap()
                .services[0]
                .waypoint
                .as_ref()
                .unwrap()
                .hbone_mtls_port,
            15008
        );
        let bad = svc.replace("/10.0.0.9", "/not-an-ip");
        let err = LocalConfig::parse(Path::new("f.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("services[0].waypoint") && err.contains("not-an-ip"),
            "{err}"
        );
    }

    #[test]
    fn network_and_network_gateway_parse_and_bad_ones_are_named() {
        let wl = |extra: &str| {
            format!("workloads:\n- {{uid: a, name: a, namespace: d, network: net-b, serviceAccount: s{extra}}}\n")
        };
        let cfg = LocalConfig::parse(
            Path::new("f.yaml"),
            &wl(", networkGateway: {destination: \"net-b/172.18.0.9\"}"),
        )
        .unwrap();
        let w = &cfg.workloads[0];
        let g = w.network_gateway.clone().unwrap();
        assert_eq!(
            (
                w.network.as_str(),
                g.hbone_mtls_port,
                g.destination.to_string().as_str()
            ),
            ("net-b", 15008, "net-b/172.18.0.9")
        );
        let by_name = wl(", networkGateway: {destination: istio-system/eastwest.istio-system.svc.cluster.local, hboneMtlsPort: 15009}");
        let g = LocalConfig::parse(Path::new("f.yaml"), &by_name)
            .unwrap()
            .workloads[0]
            .network_gateway
            .clone()
            .unwrap();
        assert_eq!(
            (g.destination, g.hbone_mtls_port),
            (
                crate::state::GatewayDestination::Hostname(crate::state::NamespacedHostname(
                    "istio-system/eastwest.istio-system.svc.cluster.local".into()
                )),
                15009
            )
        );
        for (bad, want) in [
            (
                ", networkGateway: {destination: \"net-b/172.18.0.9\", hboneMtlsPort: 0}",
                "workloads[0].networkGateway.hboneMtlsPort: 0 is not a port",
            ),
            (
                ", networkGateway: {destination: \"a/b/172.18.0.9\"}",
                "workloads[0].networkGateway.destination: network \"a/b\"",
            ),
            (
                ", networkGateway: {destination: \"net-b/not-an-ip/x\"}",
                "workloads[0].networkGateway",
            ),
            (
                ", networkGateway: {address: \"net-b/172.18.0.9\"}",
                "unknown field `address`",
            ),
        ] {
            let err = LocalConfig::parse(Path::new("f.yaml"), &wl(bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains("f.yaml") && err.contains(want), "{bad}: {err}");
        }
        let err = LocalConfig::parse(Path::new("f.yaml"), &wl("").replace("net-b", "\"a/b\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("workloads[0].network: \"a/b\" must be without '/'"),
            "{err}"
        );
    }

    #[test]
    fn service_port_zero_is_refused_with_the_field_named() {
        let svc = "services:\n- {name: s, namespace: n, hostname: s.n.svc, ports: {0: 80}}\n";
        let e = LocalConfig::parse(Path::new("f.yaml"), svc)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.yaml") && e.contains("services[0].ports: service port 0"),
            "{e}"
        );
        let wl = "workloads:\n- {uid: u, name: a, namespace: n, workloadIps: [10.0.0.1], services: {n/s.n.svc: {0: 0}}}\n";
        let e = LocalConfig::parse(Path::new("f.yaml"), wl)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("workloads[0].services[n/s.n.svc]: service port 0"),
            "{e}"
        );
    }

    #[test]
    fn application_tunnel_parses_and_bad_ports_are_named() {
        let wl = |t: &str| {
            format!("workloads:\n- {{uid: a, name: a, namespace: d, workloadIps: [10.0.0.1], applicationTunnel: {t}}}\n")
        };
        let cfg =
            LocalConfig::parse(Path::new("f.yaml"), &wl("{protocol: PROXY, port: 15088}")).unwrap();
        let t = cfg.workloads[0].application_tunnel.unwrap();
        assert_eq!(
            (t.protocol, t.port, t.port_for(80)),
            (
                crate::state::ApplicationTunnelProtocol::PROXY,
                Some(15088),
                15088
            )
        );
        let t = LocalConfig::parse(Path::new("f.yaml"), &wl("{protocol: PROXY}"))
            .unwrap()
            .workloads[0]
            .application_tunnel
            .unwrap();
        assert_eq!(t.port_for(80), 80);
        let none = LocalConfig::parse(Path::new("f.yaml"), &wl("{protocol: NONE}"))
            .unwrap()
            .workloads[0]
            .application_tunnel;
        assert_eq!(crate::state::ApplicationTunnel::effective(none), None);
        for (bad, want) in [
            (
                "{protocol: PROXY, port: 0}",
                "workloads[0].applicationTunnel.port: 0",
            ),
            (
                "{protocol: PROXY, port: 15008}",
                "workloads[0].applicationTunnel.port: 15008 is one of the proxy's own ports",
            ),
            ("{protocol: PROXY, port: 70000}", "applicationTunnel.port"),
            ("{protocol: HTTP}", "unknown variant `HTTP`"),
            ("{protocol: PROXY, prot: 1}", "unknown field `prot`"),
        ] {
            let err = LocalConfig::parse(Path::new("f.yaml"), &wl(bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{bad}: {err}");
        }
    }

    #[test]
    fn workload_hostnames_parse_and_bad_ones_are_named() {
        let wl =
            |h: &str| format!("workloads:\n- {{uid: a, name: a, namespace: d, hostname: {h:?}}}\n");
        for good in [
            "api.example.com",
            "API.example.com.",
            "_svc.example",
            "192.0.2.5",
            "2001:db8::5",
        ] {
            let cfg = LocalConfig::parse(Path::new("f.yaml"), &wl(good)).unwrap();
            assert_eq!(cfg.workloads[0].hostname, good);
        }
        let long = format!("{}.example", "a".repeat(64));
        for bad in ["*.example.com", "a..b", "a b.example", "", long.as_str()] {
            let text = if bad.is_empty() { wl(".") } else { wl(bad) };
            let err = LocalConfig::parse(Path::new("f.yaml"), &text)
                .unwrap_err()
                .to_string();
            assert!(err.contains("workloads[0].hostname:"), "{bad}: {err}");
        }
    }

    #[test]
    fn l7_lists_are_accepted_not_interpreted() {
        // The waypoint's business (it validates them); ztunnel loads the shared file
        // whatever they say.
        let l7 = format!("{GOOD}httpRoutes:\n- {{name: a, rules: [{{backendRef: []}}]}}\nauthorizationPolicies:\n- {{action: CUSTOM}}\n");
        let cfg = LocalConfig::parse(Path::new("f.yaml"), &l7).unwrap();
        assert_eq!(
            (cfg.http_routes.len(), cfg.authorization_policies.len()),
            (1, 1)
        );
        cfg.into_state(Path::new("f.yaml")).unwrap();
    }

    #[test]
    fn duplicate_ip_is_rejected() {
        let cfg = LocalConfig::parse(
            Path::new("f.yaml"),
            "workloads:\n- {uid: a, name: a, namespace: d, workloadIps: [10.0.0.1]}\n- {uid: b, name: b, namespace: d, workloadIps: [10.0.0.1]}\n",
        )
        .unwrap();
        let err = cfg.into_state(Path::new("f.yaml")).unwrap_err().to_string();
        assert!(err.contains("10.0.0.1") && err.contains("f.yaml"), "{err}");
    }
}
