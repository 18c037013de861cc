//! Answers from the mesh state: service hostnames (and wildcard hosts) with their VIPs,
//! headless Kubernetes services with their endpoints' addresses, as Istio's ztunnel does.
//! A name that is none of them is not ours: it is forwarded upstream (we never answer
//! NXDOMAIN ourselves). A mesh name without an address of the asked family (AAAA for a
//! service with only IPv4 VIPs) is answered NOERROR with no records: the name exists.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use hickory_proto::rr::RecordType;
use rand::seq::SliceRandom;

use super::name;
use crate::state::{HealthStatus, IpFamily, MeshState, NamespacedHostname, Service, Workload};

/// The TTL of mesh answers, in seconds (Istio's).
pub const MESH_TTL: u32 = 30;

/// Mesh names indexed for lookups; built once per mesh state version.
#[derive(Debug, Default)]
pub struct MeshIndex {
    /// Lower-case hostname -> the services declaring it (one per namespace), by namespace.
    hosts: HashMap<String, Vec<Arc<Service>>>,
    /// Endpoints of headless services (no VIP, hostname under `svc.<cluster domain>`).
    headless: HashMap<NamespacedHostname, Vec<Arc<Workload>>>,
    cluster_domain: String,
    /// Istio's IPV6_ENABLED: off, AAAA questions for mesh names get no records.
    ipv6: bool,
}

/// A mesh name's answer.
#[derive(Debug, PartialEq, Eq)]
pub struct MeshAnswer {
    /// The service that matched, for logs.
    pub service: NamespacedHostname,
    /// Set when the name was found by removing a search domain: the address records are
    /// under this name, and a CNAME points the asked name to it.
    pub canonical: Option<String>,
    /// In random order (the client's pick spreads over them).
    pub addrs: Vec<IpAddr>,
}

impl MeshIndex {
    pub fn build(state: &MeshState, cluster_domain: &str) -> MeshIndex {
        let svc_suffix = format!(".svc.{cluster_domain}");
        let mut hosts: HashMap<String, Vec<Arc<Service>>> = HashMap::new();
        let mut headless: HashMap<NamespacedHostname, Vec<Arc<Workload>>> = HashMap::new();
        for svc in state.services() {
            let host = svc.hostname.trim_end_matches('.').to_ascii_lowercase();
            // `x.prod.svc.<domain>` is prod's to define: a ServiceEntry elsewhere claiming
            // it would shadow the real service for every client.
            if host.ends_with(&svc_suffix) && svc.claims_foreign_namespace() {
                tracing::debug!(service = %svc.namespaced_hostname(), "ignoring a svc hostname of another namespace");
                continue;
            }
            if svc.vips.is_empty() {
                // Without a VIP only a Kubernetes headless service has addresses to give;
                // anything else is left to the upstream resolver.
                if !host.ends_with(&svc_suffix) {
                    continue;
                }
                headless.insert(svc.namespaced_hostname(), Vec::new());
            }
            hosts.entry(host).or_default().push(svc.clone());
        }
        for list in hosts.values_mut() {
            // A Kubernetes Service's own name before ServiceEntries sharing it.
            list.sort_by(|a, b| {
                (a.precedence(), &a.namespace).cmp(&(b.precedence(), &b.namespace))
            });
        }
        if !headless.is_empty() {
            for w in state
                .workloads()
                .filter(|w| w.status == HealthStatus::Healthy)
            {
                for key in w.services.keys() {
                    if let Some(eps) = headless.get_mut(key) {
                        eps.push(w.clone());
                    }
                }
            }
        }
        MeshIndex {
            hosts,
            headless,
            cluster_domain: cluster_domain.to_string(),
            ipv6: true,
        }
    }

    /// With IPv6 off (IPV6_ENABLED=false), mesh names answer AAAA with no records.
    pub fn with_ipv6(mut self, on: bool) -> MeshIndex {
        self.ipv6 = on;
        self
    }

    /// The answer to an A or AAAA query for `name` (lower case, no trailing dot) from
    /// `client`, or None when `name` is not a mesh name.
    pub fn lookup(&self, name: &str, client: &Workload, qtype: RecordType) -> Option<MeshAnswer> {
        for alias in name::aliases(name, &client.namespace, &self.cluster_domain) {
            for candidate in name::wildcards(&alias.host) {
                let Some(list) = self.hosts.get(&candidate) else {
                    continue;
                };
                // As Istio's `get_best_by_host`: only services visible to the client; its
                // own namespace's wins, else the one istiod marks canonical, else the first.
                let mut visible = list.iter().filter(|s| s.visible_to(&client.namespace));
                let first = visible.clone().next();
                let Some(svc) = visible
                    .clone()
                    .find(|s| s.namespace == client.namespace)
                    .or_else(|| visible.find(|s| s.canonical))
                    .or(first)
                else {
                    continue;
                };
                let wildcard = candidate.starts_with("*.");
                return Some(MeshAnswer {
                    service: svc.namespaced_hostname(),
                    canonical: alias.stripped.filter(|_| !wildcard),
                    addrs: self.addresses(svc, client, qtype),
                });
            }
        }
        None
    }

    fn addresses(&self, svc: &Service, client: &Workload, qtype: RecordType) -> Vec<IpAddr> {
        // As Istio: a single-family service (a headless one's pods may be dual-stack) has
        // no records of the other family, and none of IPv6 when IPv6 is off.
        let allowed = match (qtype, svc.ip_families) {
            (RecordType::AAAA, _) if !self.ipv6 => false,
            (RecordType::AAAA, Some(IpFamily::IPv4)) | (RecordType::A, Some(IpFamily::IPv6)) => {
                false
            }
            _ => true,
        };
        if !allowed {
            return Vec::new();
        }
        let family = |ip: &IpAddr| {
            matches!(
                (ip, qtype),
                (IpAddr::V4(_), RecordType::A) | (IpAddr::V6(_), RecordType::AAAA)
            )
        };
        let mut addrs: Vec<IpAddr> = match self.headless.get(&svc.namespaced_hostname()) {
            // Only endpoints in the client's network: another's addresses are not its own.
            Some(eps) => eps
                .iter()
                .filter(|w| w.network == client.network)
                .filter_map(|w| w.workload_ips.iter().copied().find(family))
                .collect(),
            // Only VIPs reachable from the client's network.
            None => svc
                .vips
                .iter()
                .filter(|v| v.network == client.network && family(&v.address))
                .map(|v| v.address)
                .collect(),
        };
        addrs.shuffle(&mut rand::rng());
        addrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LocalConfig;

    const MESH: &str = r#"
workloads:
- {uid: client, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE, node: n1}
- {uid: other-client, name: oc, namespace: other, workloadIps: [10.10.1.12], protocol: HBONE, node: n1}
- {uid: db-0, name: db-0, namespace: default, workloadIps: [10.10.2.21], protocol: HBONE, node: n2,
   services: {default/db.default.svc.cluster.local: {5432: 5432}}}
- {uid: db-1, name: db-1, namespace: default, workloadIps: [10.10.2.22], protocol: HBONE, node: n2, status: Unhealthy,
   services: {default/db.default.svc.cluster.local: {5432: 5432}}}
- {uid: db-2, name: db-2, namespace: default, workloadIps: [10.10.2.23], protocol: HBONE, network: remote,
   services: {default/db.default.svc.cluster.local: {5432: 5432}}}
services:
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10"]}
- {name: echo, namespace: other, hostname: echo.other.svc.cluster.local, vips: ["/10.96.1.10"]}
- {name: dual, namespace: default, hostname: dual.default.svc.cluster.local, vips: ["/10.96.0.11", "/fd00::11", "remote/10.200.0.11"]}
- {name: ext, namespace: default, hostname: api.example.com, vips: ["/240.240.0.1"]}
- {name: ext-other, namespace: other, hostname: api.example.com, vips: ["/240.240.0.2"]}
- {name: wild, namespace: default, hostname: "*.wild.example", vips: ["/240.240.0.3"]}
- {name: db, namespace: default, hostname: db.default.svc.cluster.local}
- {name: novip, namespace: default, hostname: novip.example.com}
- {name: shadow, namespace: aaa, hostname: db.prod.svc.cluster.local, vips: ["/240.240.0.9"]}
- {name: db, namespace: prod, hostname: db.prod.svc.cluster.local, vips: ["/10.96.2.10"]}
- {name: se, namespace: aaa, hostname: echo.default.svc.cluster.local, vips: ["/240.240.0.8"]}
"#;

    fn setup() -> (Arc<MeshState>, MeshIndex) {
        let st = LocalConfig::parse(std::path::Path::new("t.yaml"), MESH)
            .unwrap()
            .into_state(std::path::Path::new("t.yaml"))
            .unwrap();
        let idx = MeshIndex::build(&st, "cluster.local");
        (Arc::new(st), idx)
    }

    fn ask(name: &str, from: &str, qtype: RecordType) -> Option<MeshAnswer> {
        let (st, idx) = setup();
        let client = st
            .workload_by_uid(&crate::state::WorkloadUid(from.into()))
            .unwrap()
            .clone();
        idx.lookup(name, &client, qtype)
    }

    fn ips(a: &Option<MeshAnswer>) -> Vec<String> {
        let mut v: Vec<String> = a
            .as_ref()
            .map(|a| a.addrs.iter().map(|i| i.to_string()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn service_names_from_the_pods_namespace() {
        for name in [
            "echo",
            "echo.default",
            "echo.default.svc",
            "echo.default.svc.cluster.local",
        ] {
            let a = ask(name, "client", RecordType::A);
            assert_eq!(ips(&a), vec!["10.96.0.10"], "{name}");
            assert_eq!(a.unwrap().canonical, None, "{name}");
        }
        // The same short name from another namespace is that namespace's service.
        assert_eq!(
            ips(&ask("echo", "other-client", RecordType::A)),
            vec!["10.96.1.10"]
        );
        assert_eq!(
            ips(&ask("echo.default", "other-client", RecordType::A)),
            vec!["10.96.0.10"]
        );
    }

    #[test]
    fn search_domain_appended_gives_a_cname() {
        let a = ask(
            "echo.default.default.svc.cluster.local",
            "client",
            RecordType::A,
        )
        .unwrap();
        assert_eq!(a.canonical.as_deref(), Some("echo.default"));
        assert_eq!(a.addrs, vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        let a = ask(
            "api.example.com.default.svc.cluster.local",
            "client",
            RecordType::A,
        )
        .unwrap();
        assert_eq!(a.canonical.as_deref(), Some("api.example.com"));
    }

    #[test]
    fn families_and_networks() {
        assert_eq!(
            ips(&ask("dual", "client", RecordType::A)),
            vec!["10.96.0.11"],
            "VIPs of other networks are left out"
        );
        assert_eq!(
            ips(&ask("dual", "client", RecordType::AAAA)),
            vec!["fd00::11"]
        );
        // An IPv4-only service asked for AAAA: the name is ours, with no records.
        let a = ask("echo", "client", RecordType::AAAA).expect("a mesh name");
        assert!(a.addrs.is_empty());
    }

    #[test]
    fn ip_families_and_ipv6_off() {
        let yaml = r#"
workloads:
- {uid: client, name: client, namespace: default, workloadIps: [10.10.1.11, "fd00:10:1::11"], protocol: HBONE}
- {uid: db-0, name: db-0, namespace: default, workloadIps: [10.10.2.21, "fd00:10:2::21"], services: {default/hl.default.svc.cluster.local: {80: 80}, default/hl6.default.svc.cluster.local: {80: 80}}}
services:
- {name: dual, namespace: default, hostname: dual.default.svc.cluster.local, vips: ["/10.96.0.11", "/fd00:96::11"]}
- {name: hl, namespace: default, hostname: hl.default.svc.cluster.local, ipFamilies: IPv4}
- {name: hl6, namespace: default, hostname: hl6.default.svc.cluster.local, ipFamilies: IPv6}
"#;
        let path = std::path::Path::new("t.yaml");
        let st = LocalConfig::parse(path, yaml)
            .unwrap()
            .into_state(path)
            .unwrap();
        let client = st
            .workload_by_uid(&crate::state::WorkloadUid("client".into()))
            .unwrap()
            .clone();
        let idx = MeshIndex::build(&st, "cluster.local");
        let ask = |idx: &MeshIndex, n: &str, t| ips(&idx.lookup(n, &client, t));
        assert_eq!(ask(&idx, "dual", RecordType::AAAA), ["fd00:96::11"]);
        // A headless single-family service of dual-stack pods answers only its family.
        assert_eq!(ask(&idx, "hl", RecordType::A), ["10.10.2.21"]);
        assert!(ask(&idx, "hl", RecordType::AAAA).is_empty());
        assert_eq!(ask(&idx, "hl6", RecordType::AAAA), ["fd00:10:2::21"]);
        assert!(ask(&idx, "hl6", RecordType::A).is_empty());
        // IPV6_ENABLED=false: no AAAA records for mesh names (the name still ours).
        let off = MeshIndex::build(&st, "cluster.local").with_ipv6(false);
        assert!(off
            .lookup("dual", &client, RecordType::AAAA)
            .is_some_and(|a| a.addrs.is_empty()));
        assert_eq!(ask(&off, "dual", RecordType::A), ["10.96.0.11"]);
    }

    #[test]
    fn svc_names_of_another_namespace_are_not_shadowed() {
        // A ServiceEntry in `aaa` (sorting before `prod`) claims prod's Kubernetes name.
        assert_eq!(
            ips(&ask("db.prod.svc.cluster.local", "client", RecordType::A)),
            vec!["10.96.2.10"]
        );
        assert_eq!(
            ips(&ask("db.prod", "other-client", RecordType::A)),
            vec!["10.96.2.10"]
        );
        assert_eq!(
            ips(&ask(
                "echo.default.svc.cluster.local",
                "other-client",
                RecordType::A
            )),
            vec!["10.96.0.10"]
        );
    }

    #[test]
    fn same_host_in_several_namespaces_prefers_the_clients() {
        assert_eq!(
            ips(&ask("api.example.com", "client", RecordType::A)),
            vec!["240.240.0.1"]
        );
        assert_eq!(
            ips(&ask("api.example.com", "other-client", RecordType::A)),
            vec!["240.240.0.2"]
        );
    }

    /// As Istio's `get_best_by_host`: a NAMESPACE-visible entry only for its namespace
    /// (others go upstream, or get a visible entry of the host); among entries of other
    /// namespaces the canonical one, whatever the order.
    #[test]
    fn visibility_and_canonical_pick_as_istio() {
        let yaml = r#"
workloads:
- {uid: client, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE}
- {uid: other-client, name: oc, namespace: other, workloadIps: [10.10.1.12], protocol: HBONE}
services:
- {name: a, namespace: aaa, hostname: shared.example.com, vips: ["/240.240.1.1"]}
- {name: b, namespace: bbb, hostname: shared.example.com, vips: ["/240.240.1.2"], canonical: true}
- {name: p, namespace: default, hostname: private.example.com, vips: ["/240.240.2.1"], visibility: Namespace}
- {name: p, namespace: other, hostname: both.example.com, vips: ["/240.240.3.1"], visibility: Namespace}
- {name: q, namespace: zzz, hostname: both.example.com, vips: ["/240.240.3.2"]}
"#;
        let path = std::path::Path::new("t.yaml");
        let st = LocalConfig::parse(path, yaml)
            .unwrap()
            .into_state(path)
            .unwrap();
        let idx = MeshIndex::build(&st, "cluster.local");
        let ask = |from: &str, n: &str| {
            let client = st
                .workload_by_uid(&crate::state::WorkloadUid(from.into()))
                .unwrap()
                .clone();
            ips(&idx.lookup(n, &client, RecordType::A))
        };
        assert_eq!(
            ask("client", "shared.example.com"),
            ["240.240.1.2"],
            "the canonical entry, not the first"
        );
        assert_eq!(ask("client", "private.example.com"), ["240.240.2.1"]);
        assert!(
            idx.lookup(
                "private.example.com",
                st.workload_by_uid(&crate::state::WorkloadUid("other-client".into()))
                    .unwrap(),
                RecordType::A
            )
            .is_none(),
            "not a mesh name for another namespace"
        );
        assert_eq!(ask("other-client", "both.example.com"), ["240.240.3.1"]);
        assert_eq!(
            ask("client", "both.example.com"),
            ["240.240.3.2"],
            "the visible one"
        );
    }

    #[test]
    fn wildcards_headless_and_unknown_names() {
        let a = ask("x.wild.example", "client", RecordType::A).unwrap();
        assert_eq!(ips(&Some(a)), vec!["240.240.0.3"]);
        // Found through a search domain but as a wildcard: no CNAME (as Istio).
        assert_eq!(
            ask("x.wild.example.svc.cluster.local", "client", RecordType::A)
                .unwrap()
                .canonical,
            None
        );
        // Headless: the healthy endpoints of the client's network.
        assert_eq!(ips(&ask("db", "client", RecordType::A)), vec!["10.10.2.21"]);
        // Not ours: forwarded.
        assert_eq!(ask("novip.example.com", "client", RecordType::A), None);
        assert_eq!(ask("www.example.com", "client", RecordType::A), None);
        assert_eq!(ask("echo.nowhere", "client", RecordType::A), None);
        assert_eq!(
            ask("wild.example", "client", RecordType::A),
            None,
            "*.wild.example does not cover wild.example"
        );
    }

    #[test]
    fn service_entries_with_hostname_endpoints() {
        // DNS-resolved ServiceEntries: their endpoints are workloads known by hostname.
        let yaml = r#"
workloads:
- {uid: client, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE}
- {uid: se-1, name: se-1, namespace: default, hostname: db.external.example,
   services: {default/db.external.example: {80: 80}, default/direct.external.example: {80: 80}, default/hl.default.svc.cluster.local: {80: 80}}}
- {uid: pod, name: pod, namespace: default, workloadIps: [10.10.2.30], services: {default/hl.default.svc.cluster.local: {80: 80}}}
services:
- {name: db, namespace: default, hostname: db.external.example, vips: ["/240.240.0.5"], ports: {80: 80}}
- {name: direct, namespace: default, hostname: direct.external.example, ports: {80: 80}}
- {name: hl, namespace: default, hostname: hl.default.svc.cluster.local, ports: {80: 80}}
"#;
        let path = std::path::Path::new("t.yaml");
        let st = LocalConfig::parse(path, yaml)
            .unwrap()
            .into_state(path)
            .unwrap();
        let idx = MeshIndex::build(&st, "cluster.local");
        let client = st
            .workload_by_uid(&crate::state::WorkloadUid("client".into()))
            .unwrap()
            .clone();
        let ask = |n: &str| idx.lookup(n, &client, RecordType::A);
        // With a VIP: the VIP, whose connections resolve the endpoint's name (on demand).
        assert_eq!(ips(&ask("db.external.example")), vec!["240.240.0.5"]);
        // Without one: not ours to answer, the upstream resolver has the name (as Istio).
        assert_eq!(ask("direct.external.example"), None);
        // Headless: the endpoints' IPs; one known only by hostname has none to give.
        assert_eq!(ips(&ask("hl")), vec!["10.10.2.30"]);
    }
}
