//! Workloads and services in the shape of Istio's local config (camelCase keys).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;

use super::address::{NetworkAddress, NetworkCidr};
use crate::identity::{Identity, DEFAULT_TRUST_DOMAIN};
use crate::ports;

/// The workload uid (for Kubernetes pods: `cluster//Pod/namespace/name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(transparent)]
pub struct WorkloadUid(pub String);

impl fmt::Display for WorkloadUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `namespace/hostname`, the key of a service.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(transparent)]
pub struct NamespacedHostname(pub String);

impl fmt::Display for NamespacedHostname {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[allow(clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum Protocol {
    /// Plain TCP: the workload is not in the mesh; traffic to it is passed through.
    #[default]
    TCP,
    /// Reached over HBONE on port 15008.
    HBONE,
}

impl Protocol {
    /// As Istio's dumps name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::TCP => "TCP",
            Protocol::HBONE => "HBONE",
        }
    }
}

/// Where a destination's waypoint or network gateway is (Istio's GatewayAddress).
/// `destination` is `"<network>/<ip>"` (the workload's IP or its Service's VIP, in that
/// network) or `"<namespace>/<hostname>"` (its Service); HBONE goes to one of its
/// workloads on `hboneMtlsPort`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayAddress {
    pub destination: GatewayDestination,
    #[serde(default = "default_hbone_port")]
    pub hbone_mtls_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatewayDestination {
    Address(NetworkAddress),
    Hostname(NamespacedHostname),
}

impl<'de> Deserialize<'de> for GatewayDestination {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        // "x/<ip>" is an address; "namespace/<hostname>" a service.
        match s.rsplit_once('/') {
            Some((_, last)) if last.parse::<IpAddr>().is_err() => {
                if s.split('/').count() != 2 || s.starts_with('/') || last.is_empty() {
                    return Err(serde::de::Error::custom(format!(
                        "invalid gateway address {s:?}: expected \"<network>/<ip>\" or \"<namespace>/<hostname>\""
                    )));
                }
                Ok(GatewayDestination::Hostname(NamespacedHostname(s)))
            }
            _ => {
                let addr = serde::de::value::StrDeserializer::<D::Error>::new(&s);
                NetworkAddress::deserialize(addr).map(GatewayDestination::Address)
            }
        }
    }
}

impl fmt::Display for GatewayDestination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GatewayDestination::Address(a) => a.fmt(f),
            GatewayDestination::Hostname(h) => h.fmt(f),
        }
    }
}

fn default_hbone_port() -> u16 {
    ports::HBONE
}

fn default_trust_domain() -> String {
    DEFAULT_TRUST_DOMAIN.to_string()
}

/// Where a workload runs (Kubernetes topology labels), for locality-aware load balancing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Locality {
    #[serde(default)]
    pub region: String,
    #[serde(default)]
    pub zone: String,
    #[serde(default)]
    pub subzone: String,
}

/// Istio's NetworkMode: a host-network pod shares its node's IP, so it is never found
/// by address (traffic to that IP is the node's), only through its services.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum NetworkMode {
    #[default]
    Standard,
    HostNetwork,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum HealthStatus {
    #[default]
    Healthy,
    Unhealthy,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    pub uid: WorkloadUid,
    pub name: String,
    pub namespace: String,
    #[serde(default = "default_service_account")]
    pub service_account: String,
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    /// A DNS name to reach the workload by when it has no IP (Istio's DNS-resolved
    /// ServiceEntry endpoints): resolved through the node's resolvers per connection.
    #[serde(default)]
    pub hostname: String,
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default)]
    pub node: String,
    /// The network the workload is in (Istio's `topology.istio.io/network`): its
    /// addresses are unique only within it, and a proxy of another network reaches it
    /// through its `network_gateway`.
    #[serde(default)]
    pub network: String,
    /// Istio's `network_gateway`: the east-west gateway a proxy of another network
    /// reaches this workload through (double HBONE); None: not reachable from there.
    #[serde(default)]
    pub network_gateway: Option<GatewayAddress>,
    /// `ns/hostname` -> { service port: target port }
    #[serde(default)]
    pub services: HashMap<NamespacedHostname, BTreeMap<u16, u16>>,
    #[serde(default)]
    pub canonical_name: String,
    #[serde(default)]
    pub canonical_revision: String,
    #[serde(default)]
    pub workload_name: String,
    /// Istio's workload kind in lower case (`deployment`, `cronjob`, `pod`, `job`); it names
    /// the workload key in the HBONE baggage (`k8s.deployment.name`).
    #[serde(default)]
    pub workload_type: String,
    #[serde(default)]
    pub cluster_id: String,
    #[serde(default = "default_capacity")]
    pub capacity: u32,
    #[serde(default)]
    pub status: HealthStatus,
    #[serde(default)]
    pub network_mode: NetworkMode,
    #[serde(default)]
    pub locality: Locality,
    /// `namespace/name` of WorkloadSelector-scoped policies that select this workload.
    #[serde(default)]
    pub authorization_policies: Vec<String>,
    /// Traffic addressed to this workload directly goes through this waypoint.
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    /// How inbound HBONE connections are handed to the app (Istio's "sandwich" mode:
    /// a PROXY protocol header first); None: the tunnelled bytes alone.
    #[serde(default)]
    pub application_tunnel: Option<ApplicationTunnel>,
    /// The workload's labels, in the local config file: accepted for the waypoint (its
    /// DestinationRule subsets select endpoints by them; it reads them from the file
    /// itself) and not kept here (xDS has none).
    #[serde(default, rename = "labels")]
    pub _labels: serde::de::IgnoredAny,
}

/// Istio's ApplicationTunnel, as `applicationTunnel: {protocol: PROXY, port: 15088}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApplicationTunnel {
    pub protocol: ApplicationTunnelProtocol,
    /// Where the app listens for tunnelled connections; None: the CONNECT target port.
    #[serde(default)]
    pub port: Option<u16>,
}

#[allow(clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ApplicationTunnelProtocol {
    /// Plain bytes, as without a tunnel (Istio's NONE).
    #[serde(rename = "NONE")]
    None,
    /// A PROXY protocol v2 header with the client's addresses and SPIFFE id, then the bytes.
    PROXY,
}

impl ApplicationTunnel {
    /// The tunnel that changes anything: PROXY; NONE is the same as no tunnel.
    pub fn effective(t: Option<ApplicationTunnel>) -> Option<ApplicationTunnel> {
        t.filter(|t| t.protocol == ApplicationTunnelProtocol::PROXY)
    }

    /// Checks shared by the config file and xDS; the message names what to change.
    pub fn validate(&self) -> Result<(), String> {
        match self.port {
            Some(0) => Err("port: 0 is not a port; omit it to use the connection's target port".into()),
            Some(p) if ports::is_proxy_port(p) => {
                Err(format!("port: {p} is one of the proxy's own ports (15001, 15006, 15008, 15080); use the app's port"))
            }
            _ => Ok(()),
        }
    }

    /// Where an inbound connection for `target` is delivered.
    pub fn port_for(&self, target: u16) -> u16 {
        self.port.unwrap_or(target)
    }
}

fn default_service_account() -> String {
    "default".to_string()
}

fn default_capacity() -> u32 {
    1
}

impl Workload {
    /// A workload with Istio's defaults for everything but its names (service account
    /// `default`, trust domain `cluster.local`, capacity 1, healthy, plaintext, no
    /// addresses); set the rest with struct update syntax.
    pub fn new(
        uid: impl Into<String>,
        name: impl Into<String>,
        namespace: impl Into<String>,
    ) -> Workload {
        Workload {
            uid: WorkloadUid(uid.into()),
            name: name.into(),
            namespace: namespace.into(),
            service_account: default_service_account(),
            trust_domain: default_trust_domain(),
            workload_ips: Vec::new(),
            hostname: String::new(),
            protocol: Protocol::default(),
            node: String::new(),
            network: String::new(),
            network_gateway: None,
            services: HashMap::new(),
            canonical_name: String::new(),
            canonical_revision: String::new(),
            workload_name: String::new(),
            workload_type: String::new(),
            cluster_id: String::new(),
            capacity: default_capacity(),
            status: HealthStatus::default(),
            network_mode: NetworkMode::default(),
            locality: Locality::default(),
            authorization_policies: Vec::new(),
            waypoint: None,
            application_tunnel: None,
            _labels: serde::de::IgnoredAny,
        }
    }

    /// Who keeps a contested IP (lower wins): Kubernetes pods (`cluster//Pod/ns/name`)
    /// before Istio's WorkloadEntry/ServiceEntry endpoints
    /// (`cluster/networking.istio.io/<Kind>/ns/name`).
    pub fn precedence(&self) -> u8 {
        u8::from(self.uid.0.contains("/networking.istio.io/"))
    }

    pub fn identity(&self) -> Identity {
        Identity::new(&self.trust_domain, &self.namespace, &self.service_account)
    }

    /// What Istio's ztunnel says about this workload in HBONE baggage (Istio's
    /// `Workload::baggage`): cluster, namespace, workload name, canonical service and
    /// revision, region and zone, each when known.
    pub fn baggage(&self) -> crate::baggage::Baggage {
        let known = |s: &str| Some(s.to_string()).filter(|s| !s.is_empty());
        crate::baggage::Baggage {
            cluster_id: known(&self.cluster_id),
            namespace: known(&self.namespace),
            workload_name: known(&self.workload_name),
            service_name: known(&self.canonical_name),
            revision: known(&self.canonical_revision),
            region: known(&self.locality.region),
            zone: known(&self.locality.zone),
        }
    }

    /// The `baggage` header about this workload, as Istio's ztunnel sends it on each
    /// CONNECT (request) and, at the destination, on each 200 (response): the workload
    /// key names its kind (`k8s.deployment.name`; `deployment` when config names none).
    pub fn baggage_header(&self) -> String {
        let kind = if self.workload_type.is_empty() {
            "deployment"
        } else {
            self.workload_type.as_str()
        };
        self.baggage().header_value(kind)
    }

    /// Whether a connection can be sent to this workload at all: it has an IP, or a
    /// hostname to resolve (Istio's ztunnel skips endpoints with neither).
    pub fn has_address(&self) -> bool {
        !self.workload_ips.is_empty() || !self.hostname.is_empty()
    }

    /// The address a connection whose original destination was `original` goes to, as
    /// Istio's ztunnel picks it among the addresses `family` allows (a service's IP
    /// families; None: all): `original` itself when it is one of them (the pod dialed by
    /// address), else the first of `original`'s family (a dual-stack pod keeps the
    /// client's family), else the first (a single-stack pod, whatever the client used).
    pub fn address_for(&self, original: IpAddr, family: Option<IpFamily>) -> Option<IpAddr> {
        let allowed = |ip: &&IpAddr| family.is_none_or(|f| f.accepts(**ip));
        let mut ips = self.workload_ips.iter().filter(allowed);
        if self.workload_ips.contains(&original) && allowed(&&original) {
            return Some(original);
        }
        let first = ips.clone().next().copied();
        ips.find(|ip| ip.is_ipv6() == original.is_ipv6())
            .copied()
            .or(first)
    }
}

/// Istio's IP families of a service (the Kubernetes Service's `ipFamilies`): which of an
/// endpoint's addresses may carry the service's traffic. A single-stack service of a
/// dual-stack pod must not be reached on the pod's other address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum IpFamily {
    IPv4,
    IPv6,
    Dual,
}

impl IpFamily {
    pub fn accepts(self, ip: IpAddr) -> bool {
        match self {
            IpFamily::IPv4 => ip.is_ipv4(),
            IpFamily::IPv6 => ip.is_ipv6(),
            IpFamily::Dual => true,
        }
    }

    /// Istio's name in `/config_dump`.
    pub fn name(self) -> &'static str {
        match self {
            IpFamily::IPv4 => "IPv4",
            IpFamily::IPv6 => "IPv6",
            IpFamily::Dual => "Dual",
        }
    }
}

/// Checks a network name (shared by the config file and xDS): Istio's networks are label
/// values; a '/' would make `"<network>/<ip>"` ambiguous.
pub fn validate_network(n: &str) -> Result<(), String> {
    if n.contains('/') || n.chars().any(char::is_control) {
        return Err(format!("{n:?} must be without '/' or control characters"));
    }
    Ok(())
}

/// Checks a workload `hostname` (shared by the config file and xDS): a DNS name of
/// letters, digits, `-` and `_` labels (an IP literal is taken as that address), at most
/// 253 characters, no wildcard: it is looked up as it is, as an absolute name.
pub fn validate_hostname(h: &str) -> Result<(), String> {
    if h.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    let name = h.strip_suffix('.').unwrap_or(h);
    if name.is_empty() || name.len() > 253 {
        return Err(format!("{h:?} must be a DNS name of 1 to 253 characters"));
    }
    for label in name.split('.') {
        let ok_chars = label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if label.is_empty() || label.len() > 63 || !ok_chars {
            return Err(format!(
                "{h:?} is not a DNS name (label {label:?}: 1 to 63 letters, digits, '-' or '_'; wildcards cannot be resolved)"
            ));
        }
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    #[serde(default)]
    pub vips: Vec<NetworkAddress>,
    /// service port -> target port (0 = same as the service port)
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    /// Traffic to this service's VIPs goes through this waypoint.
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    /// Istio's weighted set of waypoints (a canary between two): when not empty, each
    /// connection goes through one picked by weight (`state::pick_waypoint`); `waypoint`
    /// stays the primary, for proxies that do not know the set.
    #[serde(default)]
    pub weighted_waypoints: Vec<WeightedWaypoint>,
    /// Istio's `ingress_use_waypoint`: ingress (and east-west) gateways send this
    /// service's traffic through its waypoint rather than straight to its endpoints.
    /// Gateways act on it (istiod programs them by it); a node proxy's routing does not
    /// change by it, as in Istio's ztunnel.
    #[serde(default)]
    pub ingress_use_waypoint: bool,
    /// VIP ranges (Istio's CIDR VIPs, `NetworkAddress.length`): every address in them
    /// (in their network) is this service's, unless an exact VIP or a longer range says
    /// otherwise.
    #[serde(default)]
    pub cidr_vips: Vec<NetworkCidr>,
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    /// service port -> the protocol istiod derived from the Kubernetes port's name or
    /// `appProtocol` (Istio's `Port.app_protocol`); ports not listed are unknown. Only the
    /// waypoint uses it, to pick the upstream HTTP version.
    #[serde(default)]
    pub app_protocols: BTreeMap<u16, AppProtocol>,
    /// Istio's `ip_families` (istiod's AUTOMATIC is None): which endpoint addresses may
    /// carry this service's traffic (`Workload::address_for`).
    #[serde(default)]
    pub ip_families: Option<IpFamily>,
    /// Istio's `canonical`: among services of one hostname, the one a client outside
    /// all their namespaces gets (istiod marks one per hostname).
    #[serde(default)]
    pub canonical: bool,
    /// Istio's `visibility`: a `Namespace` service is resolved and routed to only for
    /// clients in its namespace.
    #[serde(default)]
    pub visibility: Visibility,
}

/// Istio's `Service.Visibility`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum Visibility {
    #[default]
    Public,
    Namespace,
}

impl Visibility {
    /// Istio's name in `/config_dump`.
    pub fn name(self) -> &'static str {
        match self {
            Visibility::Public => "Public",
            Visibility::Namespace => "Namespace",
        }
    }
}

/// Istio's AppProtocol of a service port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum AppProtocol {
    #[default]
    #[serde(rename = "UNKNOWN")]
    Unknown,
    #[serde(rename = "HTTP11")]
    Http11,
    #[serde(rename = "HTTP2")]
    Http2,
    #[serde(rename = "GRPC")]
    Grpc,
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "TLS")]
    Tls,
}

impl Service {
    /// The protocol of `service_port` (unknown when istiod did not say).
    pub fn app_protocol(&self, service_port: u16) -> AppProtocol {
        self.app_protocols
            .get(&service_port)
            .copied()
            .unwrap_or_default()
    }
}

/// One waypoint of a weighted set (Istio's WeightedWaypoint): picked for a share
/// `weight / sum of weights` of the connections; weight 0 is listed but never picked.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WeightedWaypoint {
    pub destination: GatewayAddress,
    #[serde(default)]
    pub weight: u32,
}

/// Istio's LoadBalancing of a service (local config: `loadBalancer`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancer {
    /// Locality scopes for STRICT / FAILOVER (kept; locality-aware picking is not built yet).
    #[serde(default)]
    pub routing_preferences: Vec<LoadBalancerScope>,
    #[serde(default)]
    pub mode: LoadBalancerMode,
    #[serde(default)]
    pub health_policy: LoadBalancerHealthPolicy,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum LoadBalancerMode {
    #[default]
    Standard,
    Strict,
    Failover,
    /// No endpoint is picked: the connection goes to the original destination.
    Passthrough,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum LoadBalancerHealthPolicy {
    #[default]
    OnlyHealthy,
    /// Unhealthy endpoints are used too.
    AllowAll,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum LoadBalancerScope {
    Region,
    Zone,
    Subzone,
    Node,
    Cluster,
    Network,
}

impl Service {
    /// Every waypoint the service names: the primary, then the weighted set. A proxy
    /// that is any of them serves the service (and its own traffic to it goes direct).
    pub fn waypoints(&self) -> impl Iterator<Item = &GatewayAddress> {
        self.waypoint
            .iter()
            .chain(self.weighted_waypoints.iter().map(|w| &w.destination))
    }

    pub fn lb_mode(&self) -> LoadBalancerMode {
        self.load_balancer
            .as_ref()
            .map(|lb| lb.mode)
            .unwrap_or_default()
    }

    pub fn namespaced_hostname(&self) -> NamespacedHostname {
        NamespacedHostname(format!("{}/{}", self.namespace, self.hostname))
    }

    /// The namespace a Kubernetes-style `<name>.<namespace>.svc.<domain>` hostname names.
    pub fn svc_namespace(&self) -> Option<&str> {
        let mut labels = self.hostname.split('.');
        let (_, ns, svc) = (labels.next()?, labels.next()?, labels.next()?);
        (svc.eq_ignore_ascii_case("svc") && labels.next().is_some()).then_some(ns)
    }

    /// Whether a client in `client_namespace` may resolve and route to this service (as
    /// Istio's `visible_to`).
    pub fn visible_to(&self, client_namespace: &str) -> bool {
        self.visibility != Visibility::Namespace || self.namespace == client_namespace
    }

    /// A `*.svc.*` hostname claimed from another namespace (a ServiceEntry in `evil`
    /// naming `db.prod.svc.cluster.local`): never allowed to shadow the real one.
    pub fn claims_foreign_namespace(&self) -> bool {
        self.svc_namespace()
            .is_some_and(|ns| !ns.eq_ignore_ascii_case(&self.namespace))
    }

    /// Who keeps a contested VIP or hostname (lower wins): a Kubernetes Service's own
    /// `<name>.<namespace>.svc.` hostname, then other names (ServiceEntry), then names
    /// that claim another namespace's `svc` domain.
    pub fn precedence(&self) -> u8 {
        if self.claims_foreign_namespace() {
            2
        } else if self.svc_namespace().is_some()
            && self.hostname.split('.').next() == Some(self.name.as_str())
        {
            0
        } else {
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baggage_as_istios_ztunnel_sends_it() {
        let mut w = Workload::new("u", "echo-7d9f-abc", "default");
        assert_eq!(w.baggage_header(), "k8s.namespace.name=default");
        w.cluster_id = "Kubernetes".into();
        w.workload_name = "echo".into();
        w.workload_type = "deployment".into();
        w.canonical_name = "echo".into();
        w.canonical_revision = "v1".into();
        w.locality = Locality {
            region: "r1".into(),
            zone: "z1".into(),
            subzone: String::new(),
        };
        assert_eq!(
            w.baggage_header(),
            "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=echo,service.name=echo,service.version=v1,cloud.region=r1,cloud.availability_zone=z1"
        );
        w.workload_type = "cronjob".into();
        assert!(w.baggage_header().contains("k8s.cronjob.name=echo"));
        // What the other end parses back is the workload's.
        let mut h = http::HeaderMap::new();
        h.insert("baggage", w.baggage_header().parse().unwrap());
        assert_eq!(crate::baggage::Baggage::of(&h), Ok(w.baggage()));
    }

    #[test]
    fn address_for_prefers_the_dialed_address_then_its_family() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut w = Workload::new("u", "n", "ns");
        w.workload_ips = vec![ip("10.0.0.1"), ip("10.0.0.2"), ip("fd00::1"), ip("fd00::2")];
        assert_eq!(w.address_for(ip("10.0.0.2"), None), Some(ip("10.0.0.2")));
        assert_eq!(w.address_for(ip("fd00::2"), None), Some(ip("fd00::2")));
        assert_eq!(w.address_for(ip("10.96.0.1"), None), Some(ip("10.0.0.1")));
        assert_eq!(w.address_for(ip("fd00:96::1"), None), Some(ip("fd00::1")));
        // The families a service allows come first, even over the dialed address.
        assert_eq!(
            w.address_for(ip("fd00::2"), Some(IpFamily::IPv4)),
            Some(ip("10.0.0.1"))
        );
        assert_eq!(
            w.address_for(ip("10.0.0.2"), Some(IpFamily::IPv6)),
            Some(ip("fd00::1"))
        );
        assert_eq!(
            w.address_for(ip("10.0.0.2"), Some(IpFamily::Dual)),
            Some(ip("10.0.0.2"))
        );
        // Single stack: its address, whatever the family asked for; nothing allowed: none.
        w.workload_ips = vec![ip("fd00::1")];
        assert_eq!(w.address_for(ip("10.96.0.1"), None), Some(ip("fd00::1")));
        assert_eq!(w.address_for(ip("10.96.0.1"), Some(IpFamily::IPv4)), None);
        w.workload_ips.clear();
        assert_eq!(w.address_for(ip("10.96.0.1"), None), None);
    }
}
