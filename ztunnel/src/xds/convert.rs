//! istiod's resources into the proxy's own types. Every check a local config file gets
//! applies here too; a resource that fails one is refused with a reason that names the
//! field (the NACK carries it back to istiod).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use prost::Message;

use super::proto::istio::{security as pb_sec, workload as pb};
use crate::identity::{Identity, DEFAULT_TRUST_DOMAIN};
use crate::rbac::{
    self, Authorization, Cidr, PolicyAction, PolicyScope, ServiceAccountMatch, StringMatch,
};
use crate::state::{
    AppProtocol, ApplicationTunnel, ApplicationTunnelProtocol, GatewayAddress, GatewayDestination,
    HealthStatus, IpFamily, LoadBalancer, LoadBalancerHealthPolicy, LoadBalancerMode,
    LoadBalancerScope, Locality, NamespacedHostname, NetworkAddress, NetworkCidr, NetworkMode,
    Protocol, Service, Visibility, WeightedWaypoint, Workload, WorkloadUid,
};

/// A decoded `istio.workload.Address`. Not boxed: each one is moved into the store at once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Address {
    Workload(Workload),
    Service(Service),
}

pub fn decode_address(bytes: &[u8]) -> Result<Address, String> {
    let a = pb::Address::decode(bytes)
        .map_err(|e| format!("cannot decode istio.workload.Address: {e}"))?;
    match a.r#type {
        Some(pb::address::Type::Workload(w)) => workload(w).map(Address::Workload),
        Some(pb::address::Type::Service(s)) => service(s).map(Address::Service),
        None => Err("Address has neither a workload nor a service".into()),
    }
}

pub fn decode_authorization(bytes: &[u8]) -> Result<Authorization, String> {
    let a = pb_sec::Authorization::decode(bytes)
        .map_err(|e| format!("cannot decode istio.security.Authorization: {e}"))?;
    authorization(a)
}

/// An `Authorization` resource as it is to be enforced, and why it could not be
/// converted, if so (for the NACK). What cannot be converted exactly becomes a deny-all
/// in its scope; where the scope is unknown (the resource does not decode, or names a
/// scope we don't know) the deny-all is global: we cannot tell what it covered.
pub fn authorization_or_deny_all(resource: &str, bytes: &[u8]) -> (Authorization, Option<String>) {
    // istiod names the resource `namespace/name`, which is also the policy's key.
    let (res_ns, res_name) = resource.split_once('/').unwrap_or(("", resource));
    let a = match pb_sec::Authorization::decode(bytes) {
        Ok(a) => a,
        Err(e) => {
            let reason = format!("cannot decode istio.security.Authorization: {e}");
            return (
                Authorization::deny_all(
                    res_ns,
                    res_name,
                    PolicyScope::Global,
                    false,
                    reason.clone(),
                ),
                Some(reason),
            );
        }
    };
    let (namespace, name) = if a.namespace.is_empty() || a.name.is_empty() {
        (res_ns.to_string(), res_name.to_string())
    } else {
        (a.namespace.clone(), a.name.clone())
    };
    let (scope, dry_run) = (pb_sec::Scope::try_from(a.scope), a.dry_run);
    match authorization(a) {
        Ok(p) => (p, None),
        Err(reason) => {
            let known = !namespace.is_empty() && !name.is_empty();
            let scope = match scope {
                Ok(pb_sec::Scope::Namespace) if known => PolicyScope::Namespace,
                // Workloads name the selector policies that select them by `namespace/name`.
                Ok(pb_sec::Scope::WorkloadSelector) if known => PolicyScope::WorkloadSelector,
                _ => PolicyScope::Global,
            };
            (
                Authorization::deny_all(&namespace, &name, scope, dry_run, reason.clone()),
                Some(reason),
            )
        }
    }
}

fn ip(bytes: &[u8], field: &str) -> Result<IpAddr, String> {
    match bytes.len() {
        4 => Ok(IpAddr::V4(Ipv4Addr::from(
            <[u8; 4]>::try_from(bytes).map_err(|_| format!("{field}: bad IPv4"))?,
        ))),
        16 => Ok(IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(bytes).map_err(|_| format!("{field}: bad IPv6"))?,
        ))),
        n => Err(format!("{field}: an address is 4 or 16 bytes, not {n}")),
    }
}

fn port(p: u32, field: &str) -> Result<u16, String> {
    u16::try_from(p).map_err(|_| format!("{field}: {p} is not a port"))
}

/// A name that goes into an identity (namespace, service account, trust domain):
/// non-empty, no '/', no control characters. Istio's ztunnel checks none; a '/' would
/// make the SPIFFE id ambiguous, and Kubernetes names never have one.
fn name(value: &str, field: &str) -> Result<(), String> {
    if value.is_empty() || value.contains('/') || value.chars().any(char::is_control) {
        return Err(format!(
            "{field}: {value:?} must be non-empty, without '/' or control characters"
        ));
    }
    Ok(())
}

fn gateway(g: Option<pb::GatewayAddress>, field: &str) -> Result<Option<GatewayAddress>, String> {
    let Some(g) = g else { return Ok(None) };
    let destination = match g.destination {
        Some(pb::gateway_address::Destination::Address(a)) => {
            crate::state::workload::validate_network(&a.network)
                .map_err(|e| format!("{field}.address.network: {e}"))?;
            GatewayDestination::Address(NetworkAddress {
                network: a.network,
                address: ip(&a.address, field)?,
            })
        }
        Some(pb::gateway_address::Destination::Hostname(h)) => {
            if h.namespace.is_empty() || h.hostname.is_empty() {
                return Err(format!(
                    "{field}.hostname: namespace and hostname are required"
                ));
            }
            GatewayDestination::Hostname(NamespacedHostname(format!(
                "{}/{}",
                h.namespace, h.hostname
            )))
        }
        // A waypoint or gateway with no destination: refusing it is safer than routing
        // around it.
        None => return Err(format!("{field}: needs an address or a hostname")),
    };
    let hbone_mtls_port = match g.hbone_mtls_port {
        0 => crate::ports::HBONE,
        p => port(p, &format!("{field}.hbone_mtls_port"))?,
    };
    Ok(Some(GatewayAddress {
        destination,
        hbone_mtls_port,
    }))
}

fn port_map(ports: &[pb::Port], field: &str) -> Result<BTreeMap<u16, u16>, String> {
    ports
        .iter()
        .map(|p| {
            // Target port 0 means "the service port"; a service port of 0 has no meaning
            // (no connection goes to port 0) and would make target 0.
            if p.service_port == 0 {
                return Err(format!("{field}: service port 0 is not a port"));
            }
            Ok((port(p.service_port, field)?, port(p.target_port, field)?))
        })
        .collect()
}

pub fn workload(w: pb::Workload) -> Result<Workload, String> {
    if w.uid.is_empty() {
        return Err("workload: uid is required".into());
    }
    let at = |f: &str| format!("workload {}: {f}", w.uid);
    // `name` and `uid` are only shown and keyed by, never parsed: any string, as Istio's
    // ztunnel (istiod names network gateways `NetworkGateway/<net>/<addr>/<port>` and
    // split-horizon workloads `<net>/SplitHorizonWorkload/<gw>/<ns>/<svc>`).
    name(&w.namespace, &at("namespace"))?;
    let service_account = if w.service_account.is_empty() {
        "default".to_string()
    } else {
        w.service_account.clone()
    };
    name(&service_account, &at("service_account"))?;
    let trust_domain = if w.trust_domain.is_empty() {
        DEFAULT_TRUST_DOMAIN.to_string()
    } else {
        w.trust_domain.clone()
    };
    name(&trust_domain, &at("trust_domain"))?;
    let protocol = match pb::TunnelProtocol::try_from(w.tunnel_protocol) {
        Ok(pb::TunnelProtocol::None) => Protocol::TCP,
        Ok(pb::TunnelProtocol::Hbone) => Protocol::HBONE,
        Ok(pb::TunnelProtocol::LegacyIstioMtls) => {
            return Err(at(
                "tunnel_protocol: LEGACY_ISTIO_MTLS (sidecar mTLS) is not supported; use HBONE",
            ))
        }
        Err(_) => {
            return Err(at(&format!(
                "tunnel_protocol: unknown value {}",
                w.tunnel_protocol
            )))
        }
    };
    let workload_ips = w
        .addresses
        .iter()
        .map(|a| ip(a, &at("addresses")))
        .collect::<Result<Vec<_>, _>>()?;
    if !w.hostname.is_empty() {
        crate::state::workload::validate_hostname(&w.hostname)
            .map_err(|e| at(&format!("hostname: {e}")))?;
    }
    crate::state::workload::validate_network(&w.network)
        .map_err(|e| at(&format!("network: {e}")))?;
    let mut services = HashMap::new();
    for (key, list) in &w.services {
        if key
            .split_once('/')
            .is_none_or(|(ns, host)| ns.is_empty() || host.is_empty())
        {
            return Err(at(&format!(
                "services: key {key:?} must be \"<namespace>/<hostname>\""
            )));
        }
        services.insert(
            NamespacedHostname(key.clone()),
            port_map(&list.ports, &at(&format!("services[{key}]")))?,
        );
    }
    // An unknown status refuses the workload (NACK), as Istio's ztunnel does: a newer
    // istiod's state we cannot read is not silently taken as one we can.
    let status = match pb::WorkloadStatus::try_from(w.status) {
        Ok(pb::WorkloadStatus::Healthy) => HealthStatus::Healthy,
        Ok(pb::WorkloadStatus::Unhealthy) => HealthStatus::Unhealthy,
        Err(_) => return Err(at(&format!("status: unknown value {}", w.status))),
    };
    let application_tunnel = match w.application_tunnel {
        None => None,
        Some(t) => {
            let protocol = match pb::application_tunnel::Protocol::try_from(t.protocol) {
                Ok(pb::application_tunnel::Protocol::None) => ApplicationTunnelProtocol::None,
                Ok(pb::application_tunnel::Protocol::Proxy) => ApplicationTunnelProtocol::PROXY,
                // Bytes the app does not expect would corrupt its connections: refuse.
                Err(_) => {
                    return Err(at(&format!(
                        "application_tunnel.protocol: unknown value {}",
                        t.protocol
                    )))
                }
            };
            let port = match t.port {
                0 => None,
                p => Some(port(p, &at("application_tunnel.port"))?),
            };
            let t = ApplicationTunnel { protocol, port };
            t.validate()
                .map_err(|e| at(&format!("application_tunnel.{e}")))?;
            ApplicationTunnel::effective(Some(t))
        }
    };
    let network_mode = match pb::NetworkMode::try_from(w.network_mode) {
        Ok(pb::NetworkMode::HostNetwork) => NetworkMode::HostNetwork,
        Ok(pb::NetworkMode::Standard) => NetworkMode::Standard,
        // Indexing an unknown kind of address by IP could steal another workload's.
        Err(_) => {
            return Err(at(&format!(
                "network_mode: unknown value {}",
                w.network_mode
            )))
        }
    };
    Ok(Workload {
        application_tunnel,
        waypoint: gateway(w.waypoint, &at("waypoint"))?,
        network_gateway: gateway(w.network_gateway, &at("network_gateway"))?,
        uid: WorkloadUid(w.uid),
        name: w.name,
        namespace: w.namespace,
        service_account,
        trust_domain,
        workload_ips,
        hostname: w.hostname,
        protocol,
        node: w.node,
        network: w.network,
        services,
        canonical_name: w.canonical_name,
        canonical_revision: w.canonical_revision,
        workload_name: w.workload_name,
        // Istio's form: the enum's name in lower case ("deployment", "cronjob", "pod", "job");
        // an unknown value reads as the enum's default DEPLOYMENT, as prost's getter in
        // Istio's ztunnel gives it.
        workload_type: pb::WorkloadType::try_from(w.workload_type)
            .unwrap_or_default()
            .as_str_name()
            .to_ascii_lowercase(),
        // istiod leaves it empty for its own cluster; Istio's ztunnel names that cluster
        // `Kubernetes` (istiod's default CLUSTER_ID).
        cluster_id: if w.cluster_id.is_empty() {
            "Kubernetes".to_string()
        } else {
            w.cluster_id
        },
        capacity: w.capacity.unwrap_or(1),
        status,
        network_mode,
        locality: w
            .locality
            .map(|l| Locality {
                region: l.region,
                zone: l.zone,
                subzone: l.subzone,
            })
            .unwrap_or_default(),
        authorization_policies: w.authorization_policies,
        _labels: serde::de::IgnoredAny,
    })
}

pub fn service(s: pb::Service) -> Result<Service, String> {
    let at = |f: &str| format!("service {}/{}: {f}", s.namespace, s.hostname);
    if s.hostname.is_empty() || s.namespace.is_empty() {
        return Err(at("namespace and hostname are required"));
    }
    let (mut vips, mut cidr_vips) = (Vec::new(), Vec::new());
    for a in &s.addresses {
        let address = ip(&a.address, &at("addresses"))?;
        crate::state::workload::validate_network(&a.network)
            .map_err(|e| at(&format!("addresses.network: {e}")))?;
        let full = if address.is_ipv4() { 32 } else { 128 };
        match a.length {
            Some(len) if len != full => {
                let net = u8::try_from(len)
                    .ok()
                    .and_then(|l| IpNet::new(address, l).ok())
                    .ok_or_else(|| {
                        at(&format!(
                            "addresses: prefix length {len} does not fit {address}"
                        ))
                    })?;
                cidr_vips.push(NetworkCidr {
                    network: a.network.clone(),
                    cidr: Cidr(net),
                });
            }
            _ => vips.push(NetworkAddress {
                network: a.network.clone(),
                address,
            }),
        }
    }
    let load_balancer = match s.load_balancing {
        None => None,
        Some(lb) => Some(load_balancer(lb).map_err(|e| at(&format!("load_balancing.{e}")))?),
    };
    // Kept as sent (and dumped so); only SPIFFE ids are ever expected of a peer. Istio's
    // ztunnel skips the others with a warning (a ServiceEntry's DNS SANs), never the service.
    for san in &s.subject_alt_names {
        if let Err(e) = san.parse::<Identity>() {
            tracing::warn!(service = %format!("{}/{}", s.namespace, s.hostname), san = %san, "ignoring a subject alt name that is not a SPIFFE id: {e}");
        }
    }
    let mut app_protocols = BTreeMap::new();
    for p in &s.ports {
        let proto = match pb::AppProtocol::try_from(p.app_protocol) {
            Ok(pb::AppProtocol::Http11) => AppProtocol::Http11,
            Ok(pb::AppProtocol::Http2) => AppProtocol::Http2,
            Ok(pb::AppProtocol::Grpc) => AppProtocol::Grpc,
            Ok(pb::AppProtocol::Tcp) => AppProtocol::Tcp,
            Ok(pb::AppProtocol::Tls) => AppProtocol::Tls,
            // A newer istiod's protocol we do not know: unknown, as for an unnamed port.
            Ok(pb::AppProtocol::Unknown) | Err(_) => continue,
        };
        app_protocols.insert(port(p.service_port, &at("ports"))?, proto);
    }
    let mut weighted_waypoints = Vec::with_capacity(s.weighted_waypoints.len());
    for (i, w) in s.weighted_waypoints.into_iter().enumerate() {
        let field = at(&format!("weighted_waypoints[{i}].destination"));
        // As for `waypoint`: an entry we cannot place is refused, never skipped.
        let destination = gateway(w.destination, &field)?
            .ok_or_else(|| format!("{field}: a weighted waypoint needs a destination"))?;
        weighted_waypoints.push(WeightedWaypoint {
            destination,
            weight: w.weight,
        });
    }
    let ip_families = match pb::IpFamilies::try_from(s.ip_families) {
        Ok(pb::IpFamilies::Automatic) => None,
        Ok(pb::IpFamilies::Ipv4Only) => Some(IpFamily::IPv4),
        Ok(pb::IpFamilies::Ipv6Only) => Some(IpFamily::IPv6),
        Ok(pb::IpFamilies::Dual) => Some(IpFamily::Dual),
        // Guessing could send the traffic over a family the service does not have.
        Err(_) => return Err(at(&format!("ip_families: unknown value {}", s.ip_families))),
    };
    Ok(Service {
        ip_families,
        app_protocols,
        ports: port_map(&s.ports, &at("ports"))?,
        waypoint: gateway(s.waypoint, &at("waypoint"))?,
        weighted_waypoints,
        ingress_use_waypoint: s.ingress_use_waypoint,
        name: s.name,
        namespace: s.namespace,
        hostname: s.hostname,
        vips,
        cidr_vips,
        load_balancer,
        subject_alt_names: s.subject_alt_names,
        canonical: s.canonical,
        // As Istio's ztunnel: a value this proto does not know is PUBLIC, not a refusal.
        visibility: match pb::service::Visibility::try_from(s.visibility) {
            Ok(pb::service::Visibility::Namespace) => Visibility::Namespace,
            Ok(pb::service::Visibility::Public) | Err(_) => Visibility::Public,
        },
    })
}

/// Unknown enum values are refused: guessing a mode could send traffic where the
/// service's owner did not mean it to go.
fn load_balancer(lb: pb::LoadBalancing) -> Result<LoadBalancer, String> {
    use pb::load_balancing::{HealthPolicy, Mode, Scope};
    let mode = match Mode::try_from(lb.mode) {
        Ok(Mode::UnspecifiedMode) => LoadBalancerMode::Standard,
        Ok(Mode::Strict) => LoadBalancerMode::Strict,
        Ok(Mode::Failover) => LoadBalancerMode::Failover,
        Ok(Mode::Passthrough) => LoadBalancerMode::Passthrough,
        Err(_) => return Err(format!("mode: unknown value {}", lb.mode)),
    };
    let health_policy = match HealthPolicy::try_from(lb.health_policy) {
        Ok(HealthPolicy::OnlyHealthy) => LoadBalancerHealthPolicy::OnlyHealthy,
        Ok(HealthPolicy::AllowAll) => LoadBalancerHealthPolicy::AllowAll,
        Err(_) => return Err(format!("health_policy: unknown value {}", lb.health_policy)),
    };
    let routing_preferences = lb
        .routing_preference
        .iter()
        .map(|&v| match Scope::try_from(v) {
            Ok(Scope::Region) => Ok(LoadBalancerScope::Region),
            Ok(Scope::Zone) => Ok(LoadBalancerScope::Zone),
            Ok(Scope::Subzone) => Ok(LoadBalancerScope::Subzone),
            Ok(Scope::Node) => Ok(LoadBalancerScope::Node),
            Ok(Scope::Cluster) => Ok(LoadBalancerScope::Cluster),
            Ok(Scope::Network) => Ok(LoadBalancerScope::Network),
            _ => Err(format!("routing_preference: invalid value {v}")),
        })
        .collect::<Result<_, _>>()?;
    Ok(LoadBalancer {
        routing_preferences,
        mode,
        health_policy,
    })
}

fn string_match(m: pb_sec::StringMatch, field: &str) -> Result<StringMatch, String> {
    use pb_sec::string_match::MatchType;
    match m.match_type {
        Some(MatchType::Exact(s)) => Ok(StringMatch::Exact(s)),
        Some(MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s)),
        Some(MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s)),
        Some(MatchType::Presence(_)) => Ok(StringMatch::Presence),
        None => Err(format!(
            "{field}: a string match needs exact, prefix, suffix or presence"
        )),
    }
}

fn cidr(a: pb_sec::Address, field: &str) -> Result<Cidr, String> {
    let addr = ip(&a.address, field)?;
    let len = u8::try_from(a.length)
        .map_err(|_| format!("{field}: prefix length {} is too long", a.length))?;
    IpNet::new(addr, len)
        .map(Cidr)
        .map_err(|_| format!("{field}: prefix length {len} is too long for {addr}"))
}

fn rbac_match(m: pb_sec::Match, at: &str) -> Result<rbac::Match, String> {
    let strings = |v: Vec<pb_sec::StringMatch>, f: &str| -> Result<Vec<StringMatch>, String> {
        v.into_iter()
            .map(|m| string_match(m, &format!("{at}.{f}")))
            .collect()
    };
    let cidrs = |v: Vec<pb_sec::Address>, f: &str| -> Result<Vec<Cidr>, String> {
        v.into_iter()
            .map(|a| cidr(a, &format!("{at}.{f}")))
            .collect()
    };
    let ports = |v: Vec<u32>, f: &str| -> Result<Vec<u16>, String> {
        v.into_iter()
            .map(|p| port(p, &format!("{at}.{f}")))
            .collect()
    };
    let sas = |v: Vec<pb_sec::ServiceAccountMatch>| -> Vec<ServiceAccountMatch> {
        v.into_iter()
            .map(|s| ServiceAccountMatch {
                namespace: s.namespace,
                service_account: s.service_account,
            })
            .collect()
    };
    Ok(rbac::Match {
        namespaces: strings(m.namespaces, "namespaces")?,
        not_namespaces: strings(m.not_namespaces, "not_namespaces")?,
        principals: strings(m.principals, "principals")?,
        not_principals: strings(m.not_principals, "not_principals")?,
        source_ips: cidrs(m.source_ips, "source_ips")?,
        not_source_ips: cidrs(m.not_source_ips, "not_source_ips")?,
        destination_ips: cidrs(m.destination_ips, "destination_ips")?,
        not_destination_ips: cidrs(m.not_destination_ips, "not_destination_ips")?,
        destination_ports: ports(m.destination_ports, "destination_ports")?,
        not_destination_ports: ports(m.not_destination_ports, "not_destination_ports")?,
        service_accounts: sas(m.service_accounts),
        not_service_accounts: sas(m.not_service_accounts),
    })
}

pub fn authorization(a: pb_sec::Authorization) -> Result<Authorization, String> {
    let key = format!("{}/{}", a.namespace, a.name);
    if a.name.is_empty() || a.namespace.is_empty() {
        return Err(format!(
            "authorization {key:?}: name and namespace are required"
        ));
    }
    let scope = match pb_sec::Scope::try_from(a.scope) {
        Ok(pb_sec::Scope::Global) => PolicyScope::Global,
        Ok(pb_sec::Scope::Namespace) => PolicyScope::Namespace,
        Ok(pb_sec::Scope::WorkloadSelector) => PolicyScope::WorkloadSelector,
        Err(_) => return Err(format!("authorization {key}: unknown scope {}", a.scope)),
    };
    // An action we don't know could be a deny we'd silently skip: refuse the policy.
    let action = match pb_sec::Action::try_from(a.action) {
        Ok(pb_sec::Action::Allow) => PolicyAction::Allow,
        Ok(pb_sec::Action::Deny) => PolicyAction::Deny,
        Err(_) => return Err(format!("authorization {key}: unknown action {}", a.action)),
    };
    let mut rules = Vec::with_capacity(a.rules.len());
    for (i, r) in a.rules.into_iter().enumerate() {
        let mut clauses = Vec::with_capacity(r.clauses.len());
        for (j, c) in r.clauses.into_iter().enumerate() {
            let matches = c
                .matches
                .into_iter()
                .enumerate()
                .map(|(k, m)| {
                    rbac_match(
                        m,
                        &format!("authorization {key}: rules[{i}].clauses[{j}].matches[{k}]"),
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            clauses.push(matches);
        }
        rules.push(clauses);
    }
    Ok(Authorization {
        name: a.name,
        namespace: a.namespace,
        scope,
        action,
        dry_run: a.dry_run,
        rules,
        unenforceable: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn pb_workload(uid: &str, ip: [u8; 4]) -> pb::Workload {
        pb::Workload {
            uid: uid.into(),
            name: "echo-1".into(),
            namespace: "default".into(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            service_account: "echo".into(),
            node: "node2".into(),
            services: [(
                "default/echo.default.svc.cluster.local".to_string(),
                pb::PortList {
                    ports: vec![pb::Port {
                        service_port: 80,
                        target_port: 8080,
                        app_protocol: 0,
                    }],
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn workload_converts_with_istio_defaults() {
        let w = workload(pb_workload(
            "Kubernetes//Pod/default/echo-1",
            [10, 10, 2, 11],
        ))
        .unwrap();
        assert_eq!(
            w.identity().to_string(),
            "spiffe://cluster.local/ns/default/sa/echo"
        );
        assert_eq!(
            w.workload_ips,
            vec!["10.10.2.11".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(w.protocol, Protocol::HBONE);
        assert_eq!(w.capacity, 1);
        assert_eq!(w.status, HealthStatus::Healthy);
        assert_eq!(w.network_mode, NetworkMode::Standard);
        // Unset: Istio's defaults for the dump and telemetry.
        assert_eq!(
            (w.cluster_id.as_str(), w.workload_type.as_str()),
            ("Kubernetes", "deployment")
        );
        let named = pb::Workload {
            cluster_id: "east".into(),
            workload_type: pb::WorkloadType::Cronjob as i32,
            ..pb_workload("c", [10, 0, 0, 8])
        };
        let named = workload(named).unwrap();
        assert_eq!(
            (named.cluster_id.as_str(), named.workload_type.as_str()),
            ("east", "cronjob")
        );
        let unknown_type = pb::Workload {
            workload_type: 42,
            ..pb_workload("t", [10, 0, 0, 7])
        };
        assert_eq!(workload(unknown_type).unwrap().workload_type, "deployment");
        let unhealthy = pb::Workload {
            status: pb::WorkloadStatus::Unhealthy as i32,
            ..pb_workload("s", [10, 0, 0, 6])
        };
        assert_eq!(workload(unhealthy).unwrap().status, HealthStatus::Unhealthy);
        let host = pb::Workload {
            network_mode: pb::NetworkMode::HostNetwork as i32,
            ..pb_workload("h", [10, 0, 0, 9])
        };
        assert_eq!(
            workload(host).unwrap().network_mode,
            NetworkMode::HostNetwork
        );
        let ports =
            &w.services[&NamespacedHostname("default/echo.default.svc.cluster.local".into())];
        assert_eq!(ports.get(&80), Some(&8080));
        // A DNS-resolved ServiceEntry endpoint: a hostname, no address.
        let se = pb::Workload {
            addresses: Vec::new(),
            hostname: "api.example.com".into(),
            ..pb_workload("se", [0, 0, 0, 0])
        };
        let se = workload(se).unwrap();
        assert_eq!(
            (se.hostname.as_str(), se.workload_ips.len()),
            ("api.example.com", 0)
        );
        // Round trip through the wire format as istiod sends it.
        let bytes = pb::Address {
            r#type: Some(pb::address::Type::Workload(pb_workload("u", [10, 0, 0, 1]))),
        }
        .encode_to_vec();
        assert!(matches!(decode_address(&bytes), Ok(Address::Workload(w)) if w.uid.0 == "u"));
    }

    #[test]
    fn bad_workloads_are_refused_with_the_field() {
        let cases: Vec<(pb::Workload, &str)> = vec![
            (
                pb::Workload {
                    uid: String::new(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "uid is required",
            ),
            (
                pb::Workload {
                    addresses: vec![vec![1, 2, 3]],
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "addresses: an address is 4 or 16 bytes",
            ),
            (
                pb::Workload {
                    service_account: "a/b".into(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "service_account",
            ),
            (
                pb::Workload {
                    network_mode: 7,
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "network_mode: unknown value 7",
            ),
            (
                pb::Workload {
                    status: 5,
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "status: unknown value 5",
            ),
            (
                pb::Workload {
                    namespace: "bad\0ns".into(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "namespace",
            ),
            (
                pb::Workload {
                    tunnel_protocol: 2,
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "LEGACY_ISTIO_MTLS",
            ),
            (
                pb::Workload {
                    tunnel_protocol: 9,
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "tunnel_protocol: unknown",
            ),
            (
                pb::Workload {
                    waypoint: Some(pb::GatewayAddress {
                        destination: None,
                        hbone_mtls_port: 15008,
                    }),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "waypoint: needs an address or a hostname",
            ),
            (
                pb::Workload {
                    hostname: "*.example.com".into(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "hostname: \"*.example.com\" is not a DNS name",
            ),
            (
                pb::Workload {
                    hostname: "a..b".into(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "hostname:",
            ),
        ];
        for (w, want) in cases {
            let e = workload(w).unwrap_err();
            assert!(e.contains(want), "{e} (want {want})");
        }
        assert!(decode_address(b"\xff\xff\xff")
            .unwrap_err()
            .contains("cannot decode"));
    }

    #[test]
    fn network_and_network_gateway_convert_and_bad_ones_are_refused() {
        let by_ip = pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Address(
                pb::NetworkAddress {
                    network: "net-b".into(),
                    address: vec![172, 18, 0, 9],
                    length: None,
                },
            )),
            hbone_mtls_port: 15008,
        };
        // Istio's remote endpoint (a split-horizon workload): no address, a network, a gateway.
        let remote = pb::Workload {
            network: "net-b".into(),
            addresses: Vec::new(),
            network_gateway: Some(by_ip.clone()),
            ..pb_workload("r", [0, 0, 0, 0])
        };
        let w = workload(remote).unwrap();
        assert_eq!((w.network.as_str(), w.workload_ips.len()), ("net-b", 0));
        let g = w.network_gateway.unwrap();
        assert_eq!(
            (g.destination.to_string(), g.hbone_mtls_port),
            ("net-b/172.18.0.9".to_string(), 15008)
        );
        // istiod's own names for these (uid and name alike): with '/', accepted as Istio's ztunnel.
        let gw_uid = "NetworkGateway/net-b/172.18.0.9/15008";
        let gw = pb::Workload {
            name: gw_uid.into(),
            network: "net-b".into(),
            ..pb_workload(gw_uid, [172, 18, 0, 9])
        };
        assert_eq!(workload(gw).unwrap().name, gw_uid);
        let sh_uid = "net-b/SplitHorizonWorkload/istio-system/eastwest/default/echo.default.svc.cluster.local";
        let sh = pb::Workload {
            name: sh_uid.into(),
            service_account: String::new(),
            network_gateway: Some(by_ip.clone()),
            addresses: Vec::new(),
            ..pb_workload(sh_uid, [0, 0, 0, 0])
        };
        let sh = workload(sh).unwrap();
        assert_eq!(
            (
                sh.uid.0.as_str(),
                sh.name.as_str(),
                sh.service_account.as_str()
            ),
            (sh_uid, sh_uid, "default")
        );
        let by_name = pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Hostname(
                pb::NamespacedHostname {
                    namespace: "istio-system".into(),
                    hostname: "eastwest.istio-system.svc.cluster.local".into(),
                },
            )),
            hbone_mtls_port: 0,
        };
        let g = workload(pb::Workload {
            network_gateway: Some(by_name),
            ..pb_workload("x", [1, 1, 1, 1])
        })
        .unwrap()
        .network_gateway
        .unwrap();
        assert_eq!(
            (g.destination.to_string(), g.hbone_mtls_port),
            (
                "istio-system/eastwest.istio-system.svc.cluster.local".to_string(),
                15008
            )
        );
        // Istio's field number for network_gateway (19, a message).
        let only = pb::Workload {
            network_gateway: Some(pb::GatewayAddress {
                destination: None,
                hbone_mtls_port: 1,
            }),
            ..Default::default()
        };
        assert_eq!(
            prost::Message::encode_to_vec(&only),
            [
                0x80 | (19 << 3 | 2) & 0x7f,
                (19 << 3 | 2) >> 7,
                2,
                3 << 3,
                1
            ]
        );
        let cases: Vec<(pb::Workload, &str)> = vec![
            (
                pb::Workload {
                    network_gateway: Some(pb::GatewayAddress {
                        destination: None,
                        hbone_mtls_port: 0,
                    }),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "network_gateway: needs an address or a hostname",
            ),
            (
                pb::Workload {
                    network_gateway: Some(pb::GatewayAddress {
                        hbone_mtls_port: 70000,
                        ..by_ip.clone()
                    }),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "network_gateway.hbone_mtls_port",
            ),
            (
                pb::Workload {
                    network: "a/b".into(),
                    ..pb_workload("x", [1, 1, 1, 1])
                },
                "network: \"a/b\"",
            ),
        ];
        for (w, want) in cases {
            let e = workload(w).unwrap_err();
            assert!(e.contains(want), "{e} (want {want})");
        }
        let bad_vip = pb::Service {
            name: "s".into(),
            namespace: "n".into(),
            hostname: "s.n".into(),
            addresses: vec![pb::NetworkAddress {
                network: "x\ny".into(),
                address: vec![10, 0, 0, 1],
                length: None,
            }],
            ..Default::default()
        };
        assert!(service(bad_vip).unwrap_err().contains("addresses.network"));
        let cidr = pb::Service {
            name: "s".into(),
            namespace: "n".into(),
            hostname: "s.n".into(),
            addresses: vec![pb::NetworkAddress {
                network: "net-b".into(),
                address: vec![10, 200, 0, 0],
                length: Some(16),
            }],
            ..Default::default()
        };
        assert_eq!(
            service(cidr).unwrap().cidr_vips[0].to_string(),
            "net-b/10.200.0.0/16"
        );
    }

    #[test]
    fn application_tunnel_converts_and_bad_ones_are_refused() {
        let with = |protocol: i32, port: u32| pb::Workload {
            application_tunnel: Some(pb::ApplicationTunnel { protocol, port }),
            ..pb_workload("x", [1, 1, 1, 1])
        };
        let t = workload(with(1, 15088))
            .unwrap()
            .application_tunnel
            .unwrap();
        assert_eq!(
            (t.protocol, t.port),
            (ApplicationTunnelProtocol::PROXY, Some(15088))
        );
        assert_eq!(
            workload(with(1, 0))
                .unwrap()
                .application_tunnel
                .unwrap()
                .port,
            None
        );
        assert_eq!(
            workload(with(0, 15088)).unwrap().application_tunnel,
            None,
            "NONE is no tunnel"
        );
        assert!(workload(with(7, 0))
            .unwrap_err()
            .contains("application_tunnel.protocol: unknown value 7"));
        assert!(workload(with(1, 70000))
            .unwrap_err()
            .contains("application_tunnel.port"));
        assert!(workload(with(1, 15006))
            .unwrap_err()
            .contains("proxy's own ports"));
    }

    #[test]
    fn weighted_waypoints_and_ingress_use_waypoint() {
        let at_ip = |ip: [u8; 4]| pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Address(
                pb::NetworkAddress {
                    network: String::new(),
                    address: ip.to_vec(),
                    length: None,
                },
            )),
            hbone_mtls_port: 0,
        };
        let base = pb::Service {
            name: "echo".into(),
            namespace: "default".into(),
            hostname: "echo.default.svc.cluster.local".into(),
            waypoint: Some(at_ip([10, 0, 0, 9])),
            ingress_use_waypoint: true,
            ..Default::default()
        };
        let s = service(pb::Service {
            weighted_waypoints: vec![
                pb::WeightedWaypoint {
                    destination: Some(at_ip([10, 0, 0, 9])),
                    weight: 90,
                },
                pb::WeightedWaypoint {
                    destination: Some(pb::GatewayAddress {
                        hbone_mtls_port: 15009,
                        ..at_ip([10, 0, 0, 8])
                    }),
                    weight: 10,
                },
            ],
            ..base.clone()
        })
        .unwrap();
        assert!(s.ingress_use_waypoint);
        // Istio's field numbers: ingress_use_waypoint 12 (varint), weighted_waypoints 13
        // (a message: destination 1, weight 2).
        let only = pb::Service {
            ingress_use_waypoint: true,
            weighted_waypoints: vec![pb::WeightedWaypoint {
                destination: None,
                weight: 7,
            }],
            ..Default::default()
        };
        assert_eq!(
            prost::Message::encode_to_vec(&only),
            [12 << 3, 1, 13 << 3 | 2, 2, 2 << 3, 7]
        );
        let got: Vec<(String, u16, u32)> = s
            .weighted_waypoints
            .iter()
            .map(|w| {
                (
                    w.destination.destination.to_string(),
                    w.destination.hbone_mtls_port,
                    w.weight,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("/10.0.0.9".to_string(), 15008, 90),
                ("/10.0.0.8".to_string(), 15009, 10)
            ]
        );
        // An entry without a place to go is refused (NACKed), never dropped from the set.
        let err = service(pb::Service {
            weighted_waypoints: vec![pb::WeightedWaypoint {
                destination: None,
                weight: 1,
            }],
            ..base.clone()
        })
        .unwrap_err();
        assert!(
            err.contains(
                "weighted_waypoints[0].destination: a weighted waypoint needs a destination"
            ),
            "{err}"
        );
        let empty = pb::GatewayAddress {
            destination: None,
            hbone_mtls_port: 0,
        };
        let err = service(pb::Service {
            weighted_waypoints: vec![pb::WeightedWaypoint {
                destination: Some(empty),
                weight: 1,
            }],
            ..base
        })
        .unwrap_err();
        assert!(
            err.contains("weighted_waypoints[0].destination: needs an address or a hostname"),
            "{err}"
        );
    }

    #[test]
    fn services_and_waypoints() {
        let s = service(pb::Service {
            name: "echo".into(),
            namespace: "default".into(),
            hostname: "echo.default.svc.cluster.local".into(),
            addresses: vec![pb::NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 10],
                length: None,
            }],
            ports: vec![
                pb::Port {
                    service_port: 80,
                    target_port: 8080,
                    app_protocol: 0,
                },
                pb::Port {
                    service_port: 9090,
                    target_port: 9090,
                    app_protocol: pb::AppProtocol::Grpc as i32,
                },
                pb::Port {
                    service_port: 81,
                    target_port: 81,
                    app_protocol: 99,
                },
            ],
            subject_alt_names: vec!["spiffe://cluster.local/ns/default/sa/echo".into()],
            waypoint: Some(pb::GatewayAddress {
                destination: Some(pb::gateway_address::Destination::Hostname(
                    pb::NamespacedHostname {
                        namespace: "default".into(),
                        hostname: "waypoint.default.svc.cluster.local".into(),
                    },
                )),
                hbone_mtls_port: 0,
            }),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.vips[0].address, "10.96.0.10".parse::<IpAddr>().unwrap());
        // istiod's port protocols (for the waypoint); unknown and future values are unknown.
        assert_eq!(
            (s.app_protocol(9090), s.app_protocol(80), s.app_protocol(81)),
            (
                AppProtocol::Grpc,
                AppProtocol::Unknown,
                AppProtocol::Unknown
            )
        );
        let wp = s.waypoint.unwrap();
        assert_eq!(wp.hbone_mtls_port, 15008);
        assert_eq!(
            wp.destination,
            GatewayDestination::Hostname(NamespacedHostname(
                "default/waypoint.default.svc.cluster.local".into()
            ))
        );
        assert!(s.weighted_waypoints.is_empty() && !s.ingress_use_waypoint);
        assert!(!s.canonical && s.visibility == Visibility::Public);
        // Istio's fields 11 and 14; a visibility this proto does not know is PUBLIC, as Istio's.
        let base = pb::Service {
            hostname: "h".into(),
            namespace: "n".into(),
            ..Default::default()
        };
        let ns = service(pb::Service {
            canonical: true,
            visibility: pb::service::Visibility::Namespace as i32,
            ..base.clone()
        })
        .unwrap();
        assert!(ns.canonical && ns.visibility == Visibility::Namespace);
        assert_eq!(
            service(pb::Service {
                visibility: 7,
                ..base.clone()
            })
            .unwrap()
            .visibility,
            Visibility::Public
        );
        let wire = pb::Service {
            canonical: true,
            visibility: 1,
            ..Default::default()
        }
        .encode_to_vec();
        assert_eq!(wire, [11 << 3, 1, 14 << 3, 1]);
        // A ServiceEntry's DNS SAN: the service stays, the SAN is never expected of a peer.
        let dns = service(pb::Service {
            hostname: "h".into(),
            namespace: "n".into(),
            subject_alt_names: vec![
                "api.example.com".into(),
                "spiffe://cluster.local/ns/n/sa/x".into(),
            ],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            dns.subject_alt_names,
            vec![
                "api.example.com".to_string(),
                "spiffe://cluster.local/ns/n/sa/x".to_string()
            ]
        );
        // Istio's IP families (field 9): AUTOMATIC is none; a value we do not know is refused.
        assert_eq!(s.ip_families, None);
        let fam = |v: i32| {
            service(pb::Service {
                hostname: "h".into(),
                namespace: "n".into(),
                ip_families: v,
                ..Default::default()
            })
        };
        assert_eq!(
            fam(pb::IpFamilies::Ipv4Only as i32).unwrap().ip_families,
            Some(IpFamily::IPv4)
        );
        assert_eq!(
            fam(pb::IpFamilies::Ipv6Only as i32).unwrap().ip_families,
            Some(IpFamily::IPv6)
        );
        assert_eq!(
            fam(pb::IpFamilies::Dual as i32).unwrap().ip_families,
            Some(IpFamily::Dual)
        );
        assert!(fam(9).unwrap_err().contains("ip_families: unknown value 9"));
        assert_eq!(
            prost::Message::encode_to_vec(&pb::Service {
                ip_families: 3,
                ..Default::default()
            }),
            [9 << 3, 3]
        );
        // Found by the xds_resources fuzzer (fuzz/regressions/xds_resources/service-port-0):
        // service port 0 with target 0 made an endpoint target port 0.
        let zero = vec![pb::Port {
            service_port: 0,
            target_port: 0,
            app_protocol: 0,
        }];
        let bad = service(pb::Service {
            hostname: "h".into(),
            namespace: "n".into(),
            ports: zero,
            ..Default::default()
        });
        assert!(bad.unwrap_err().contains("service port 0 is not a port"));
    }

    #[test]
    fn cidr_vips_and_load_balancing() {
        let addr = |a: Vec<u8>, length| pb::NetworkAddress {
            network: String::new(),
            address: a,
            length,
        };
        let base = pb::Service {
            name: "s".into(),
            namespace: "n".into(),
            hostname: "s.example.com".into(),
            ..Default::default()
        };
        let s = service(pb::Service {
            addresses: vec![
                addr(vec![10, 200, 0, 0], Some(16)),
                addr(vec![10, 96, 0, 1], Some(32)),
                addr(vec![10, 96, 0, 2], None),
            ],
            load_balancing: Some(pb::LoadBalancing {
                routing_preference: vec![pb::load_balancing::Scope::Zone as i32],
                mode: pb::load_balancing::Mode::Passthrough as i32,
                health_policy: pb::load_balancing::HealthPolicy::AllowAll as i32,
            }),
            ..base.clone()
        })
        .unwrap();
        assert_eq!(
            s.cidr_vips,
            vec![NetworkCidr {
                network: String::new(),
                cidr: "10.200.0.0/16".parse::<Cidr>().unwrap()
            }]
        );
        assert_eq!(s.vips.len(), 2, "a full-length prefix is a plain VIP");
        let lb = s.load_balancer.unwrap();
        assert_eq!(
            (lb.mode, lb.health_policy),
            (
                LoadBalancerMode::Passthrough,
                LoadBalancerHealthPolicy::AllowAll
            )
        );
        assert_eq!(lb.routing_preferences, vec![LoadBalancerScope::Zone]);
        let err = service(pb::Service {
            addresses: vec![addr(vec![10, 0, 0, 0], Some(40))],
            ..base.clone()
        })
        .unwrap_err();
        assert!(err.contains("prefix length 40"), "{err}");
        let lb = pb::LoadBalancing {
            mode: 9,
            ..Default::default()
        };
        let err = service(pb::Service {
            load_balancing: Some(lb),
            ..base
        })
        .unwrap_err();
        assert!(
            err.contains("load_balancing.mode: unknown value 9"),
            "{err}"
        );
    }

    #[test]
    fn authorizations() {
        use pb_sec::string_match::MatchType;
        let a = authorization(pb_sec::Authorization {
            name: "allow-sleep".into(),
            namespace: "default".into(),
            scope: pb_sec::Scope::Namespace as i32,
            action: pb_sec::Action::Deny as i32,
            rules: vec![pb_sec::Rule {
                clauses: vec![pb_sec::Clause {
                    matches: vec![pb_sec::Match {
                        principals: vec![pb_sec::StringMatch {
                            match_type: Some(MatchType::Exact(
                                "cluster.local/ns/default/sa/sleep".into(),
                            )),
                        }],
                        source_ips: vec![pb_sec::Address {
                            address: vec![10, 0, 0, 0],
                            length: 8,
                        }],
                        destination_ports: vec![8080],
                        ..Default::default()
                    }],
                }],
            }],
            dry_run: false,
        })
        .unwrap();
        assert_eq!(
            (a.scope, a.action),
            (PolicyScope::Namespace, PolicyAction::Deny)
        );
        let m = &a.rules[0][0][0];
        assert_eq!(
            m.principals,
            vec![StringMatch::Exact(
                "cluster.local/ns/default/sa/sleep".into()
            )]
        );
        assert!(m.source_ips[0].contains("10.1.2.3".parse().unwrap()));
        assert_eq!(m.destination_ports, vec![8080]);
        let bad = |a: pb_sec::Authorization| authorization(a).unwrap_err();
        let base = pb_sec::Authorization {
            name: "p".into(),
            namespace: "n".into(),
            ..Default::default()
        };
        assert!(bad(pb_sec::Authorization {
            action: 7,
            ..base.clone()
        })
        .contains("unknown action"));
        let bad_port = pb_sec::Rule {
            clauses: vec![pb_sec::Clause {
                matches: vec![pb_sec::Match {
                    destination_ports: vec![70000],
                    ..Default::default()
                }],
            }],
        };
        assert!(bad(pb_sec::Authorization {
            rules: vec![bad_port],
            ..base.clone()
        })
        .contains("rules[0].clauses[0].matches[0].destination_ports"));
        let empty_match = pb_sec::Rule {
            clauses: vec![pb_sec::Clause {
                matches: vec![pb_sec::Match {
                    namespaces: vec![pb_sec::StringMatch { match_type: None }],
                    ..Default::default()
                }],
            }],
        };
        assert!(bad(pb_sec::Authorization {
            rules: vec![empty_match],
            ..base.clone()
        })
        .contains("namespaces"));
        let long = pb_sec::Rule {
            clauses: vec![pb_sec::Clause {
                matches: vec![pb_sec::Match {
                    source_ips: vec![pb_sec::Address {
                        address: vec![1, 2, 3, 4],
                        length: 33,
                    }],
                    ..Default::default()
                }],
            }],
        };
        assert!(bad(pb_sec::Authorization {
            rules: vec![long],
            ..base
        })
        .contains("too long"));
    }
}
