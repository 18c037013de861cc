//! The proxy's view of the mesh: workloads, services and authorization policies,
//! indexed for the lookups the data plane makes on every connection.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use rand::RngExt;

use crate::identity::Identity;
use crate::rbac::{Authorization, PolicyScope};

pub mod address;
#[cfg(test)]
mod inbound_service_tests;
pub mod index;
#[cfg(test)]
mod network_tests;
#[cfg(test)]
mod waypoint_tests;
pub mod workload;

pub use self::address::{NetworkAddress, NetworkCidr, PodIps};
pub use self::index::{MeshIndex, MeshState, Rank, StateError};
pub use self::workload::{
    AppProtocol, ApplicationTunnel, ApplicationTunnelProtocol, GatewayAddress, GatewayDestination,
    HealthStatus, IpFamily, LoadBalancer, LoadBalancerHealthPolicy, LoadBalancerMode,
    LoadBalancerScope, Locality, NamespacedHostname, NetworkMode, Protocol, Service, Visibility,
    WeightedWaypoint, Workload, WorkloadUid,
};

impl MeshState {
    /// For a config file: any conflict (two workloads on one IP, ...) is an error. (State
    /// pushed by istiod, which can briefly overlap, is kept by `MeshIndex` directly.)
    pub fn build(
        workloads: Vec<Workload>,
        services: Vec<Service>,
        policies: Vec<Authorization>,
    ) -> Result<MeshState, StateError> {
        let mut index = MeshIndex::default();
        let mut conflicts = Vec::new();
        let rank = |i: usize| Rank {
            precedence: 0,
            age: i as u64,
        };
        for (i, svc) in services.into_iter().enumerate() {
            index.insert_service(rank(i), Arc::new(svc), &mut conflicts);
        }
        if let Some(c) = conflicts.drain(..).next() {
            return Err(c);
        }
        for (i, wl) in workloads.into_iter().enumerate() {
            index.insert_workload(rank(i), Arc::new(wl), &mut conflicts);
        }
        if let Some(c) = conflicts.drain(..).next() {
            return Err(c);
        }
        for (i, p) in policies.into_iter().enumerate() {
            index.insert_policy(rank(i), Arc::new(p));
        }
        Ok(index.snapshot())
    }

    /// Whether `wl` is an east-west gateway (some workload's `network_gateway` names it):
    /// its connections carry other networks' clients, whose identities are not its own.
    pub fn is_network_gateway(&self, wl: &Workload) -> bool {
        self.gateways.contains(&wl.uid)
    }

    pub fn workload_by_uid(&self, uid: &WorkloadUid) -> Option<&Arc<Workload>> {
        self.workloads.get(uid)
    }

    /// The workload of a pod the CNI agent enrolls: by uid (local config uses the same
    /// uid), else by namespace and name on this node (istio-cni sends the Kubernetes pod
    /// UID, istiod names workloads `cluster//Pod/namespace/name`), through an index, not
    /// a scan: an enrollment waits here across pushes. Should two workloads match, the
    /// lower uid, so the answer does not depend on the order they arrived in.
    pub fn workload_for_pod(
        &self,
        uid: &WorkloadUid,
        pod: Option<(&str, &str)>,
        node: &str,
    ) -> Option<&Arc<Workload>> {
        self.workloads.get(uid).or_else(|| {
            let (namespace, name) = pod?;
            let same_name = self.pods.get(&index::pod_key(namespace, name))?;
            same_name
                .iter()
                .filter(|w| w.namespace == namespace && w.name == name && w.node == node)
                .min_by(|a, b| a.uid.cmp(&b.uid))
        })
    }

    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values()
    }

    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services.values()
    }

    pub fn policies(&self) -> impl Iterator<Item = &Arc<Authorization>> {
        self.policies.values()
    }

    pub fn service_by_hostname(&self, key: &NamespacedHostname) -> Option<&Arc<Service>> {
        self.services.get(key)
    }

    /// The identity of the waypoint `gw` names: the workload's at that address, or the one
    /// identity every workload of the waypoint Service (by VIP or hostname) has. None when
    /// there is no such workload, or when they disagree: a pod whose labels put it in the
    /// waypoint's selector must not pass for the waypoint, and callers fail closed.
    pub fn waypoint_identity(&self, gw: &GatewayAddress) -> Option<Identity> {
        let svc = match &gw.destination {
            GatewayDestination::Address(a) => {
                if let Some(w) = self.workload_by_ip.get(&a.network, a.address) {
                    return Some(w.identity());
                }
                self.service_by_vip.get(&a.network, a.address)?
            }
            GatewayDestination::Hostname(h) => self.services.get(h)?,
        };
        let mut ids = self
            .endpoints
            .get(&svc.namespaced_hostname())?
            .values()
            .map(|w| w.identity());
        let first = ids.next()?;
        ids.all(|i| i == first).then_some(first)
    }

    /// Whether `id` is the identity of the waypoint `gw` names (see `waypoint_identity`):
    /// decided by identity, not by membership of the waypoint Service.
    pub fn is_waypoint(&self, gw: &GatewayAddress, id: &Identity) -> bool {
        self.waypoint_identity(gw).is_some_and(|w| w == *id)
    }

    /// Whether `me` is a waypoint of the destination at `target` in `network` (the
    /// service with that VIP, any of its waypoints; else the workload with that IP): what lets a CONNECT
    /// whose target is not `me` itself in (Istio's sandwich, a waypoint behind ztunnel).
    /// The waypoint must name `me` (its IP, or a Service `me` is an endpoint of) and `me`
    /// must have the identity the waypoint is known by (`waypoint_identity`), so a pod
    /// that joined the waypoint Service's selector is never taken for it.
    pub fn is_waypoint_of(&self, network: &str, target: IpAddr, me: &Workload) -> bool {
        let names_me = |gw: &GatewayAddress| match &gw.destination {
            GatewayDestination::Address(a) => {
                (a.network == me.network && me.workload_ips.contains(&a.address))
                    || self
                        .service_by_vip
                        .get(&a.network, a.address)
                        .is_some_and(|s| me.services.contains_key(&s.namespaced_hostname()))
            }
            GatewayDestination::Hostname(h) => {
                self.services.contains_key(h) && me.services.contains_key(h)
            }
        };
        let verified = |gw: &GatewayAddress| names_me(gw) && self.is_waypoint(gw, &me.identity());
        match self.service_by_vip(network, target) {
            Some(svc) => svc.waypoints().any(verified),
            None => self
                .workload_by_ip
                .get(network, target)
                .and_then(|w| w.waypoint.as_ref())
                .is_some_and(verified),
        }
    }

    /// The waypoint workload behind a GatewayAddress, for a client in `src_network`: the
    /// workload at that IP, or an endpoint of the service with that VIP or hostname
    /// (picked by capacity among those reachable from there). As Istio's ztunnel
    /// (`load_balance` in waypoint mode): whatever the workload's own protocol, since a
    /// waypoint is reached over HBONE on `hbone_mtls_port` and istiod describes Istio's
    /// waypoint pods, which are not captured, as TCP; an endpoint counts when the
    /// waypoint Service lists that port, or when it takes an application tunnel.
    pub fn waypoint_workload(
        &self,
        gw: &GatewayAddress,
        src_network: &str,
    ) -> Option<Arc<Workload>> {
        let svc = match &gw.destination {
            GatewayDestination::Address(a) => {
                if let Some(w) = self.workload_by_ip.get(&a.network, a.address) {
                    return Some(w.clone());
                }
                self.service_by_vip.get(&a.network, a.address)?
            }
            GatewayDestination::Hostname(h) => self.services.get(h)?,
        };
        let eps = if svc.ports.contains_key(&gw.hbone_mtls_port) {
            self.usable_endpoints(svc, gw.hbone_mtls_port, src_network)
        } else {
            // Not a port of the Service: the ztunnel in front of an application tunnel
            // takes it (Istio's sandwich), so only such workloads qualify.
            let all = self
                .endpoints
                .get(&svc.namespaced_hostname())
                .map(|v| {
                    v.values()
                        .map(|w| (w.clone(), gw.hbone_mtls_port))
                        .collect()
                })
                .unwrap_or_default();
            let mut eps = self.usable(svc, all, src_network);
            eps.retain(|(w, _)| w.application_tunnel.is_some());
            eps
        };
        pick_weighted(&eps).map(|(w, _)| w)
    }

    /// The east-west gateway `gw` names (a remote endpoint's `network_gateway`), as Istio's
    /// ztunnel finds it for a client `src` connecting to `dst`: the workload at that
    /// address in its network (dialed there, on `hbone_mtls_port`), or an endpoint of the
    /// service with that VIP or hostname (on the port `hbone_mtls_port` maps to, picked as
    /// any service endpoint is). None when it is neither: then nothing says what identity
    /// the gateway must prove, and the caller refuses.
    pub fn network_gateway(
        &self,
        gw: &GatewayAddress,
        src: &Workload,
        dst: SocketAddr,
    ) -> Option<GatewayUpstream> {
        let (wl, port, ip, svc) = match &gw.destination {
            GatewayDestination::Address(a) => {
                match self.workload_by_ip.get(&a.network, a.address) {
                    Some(w) => (w.clone(), gw.hbone_mtls_port, Some(a.address), None),
                    None => {
                        let svc = self.service_by_vip(&a.network, a.address)?;
                        let (w, port) = self.pick_endpoint(src, svc, gw.hbone_mtls_port)?;
                        (w, port, None, Some(svc))
                    }
                }
            }
            GatewayDestination::Hostname(h) => {
                let svc = self.services.get(h)?;
                let (w, port) = self.pick_endpoint(src, svc, gw.hbone_mtls_port)?;
                (w, port, None, Some(svc))
            }
        };
        // The address the gateway was named by, else one of the client's family.
        let ip = ip.or_else(|| {
            wl.workload_ips
                .iter()
                .find(|i| i.is_ipv4() == dst.is_ipv4())
                .or(wl.workload_ips.first())
                .copied()
        })?;
        let mut identities = vec![wl.identity()];
        identities.extend(svc.into_iter().flat_map(|s| {
            s.subject_alt_names
                .iter()
                .filter_map(|san| san.parse::<Identity>().ok())
        }));
        Some(GatewayUpstream {
            workload: wl,
            addr: SocketAddr::new(ip, port),
            identities,
        })
    }

    /// The workload with address `ip` in `network`.
    pub fn workload_by_ip(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.workload_by_ip.get(network, ip)
    }

    /// A service by its Kubernetes name (what HTTPRoute backendRefs name).
    pub fn service_by_name(&self, namespace: &str, name: &str) -> Option<&Arc<Service>> {
        self.service_by_name
            .get(&(namespace.to_string(), name.to_string()))
    }

    /// The service with VIP `ip` in `network` (exact, else the longest range holding it).
    pub fn service_by_vip(&self, network: &str, ip: IpAddr) -> Option<&Arc<Service>> {
        self.service_by_vip.get(network, ip).or_else(|| {
            self.service_by_cidr
                .iter()
                .find(|(c, _)| c.network == network && c.cidr.contains(ip))
                .map(|(_, s)| s)
        })
    }

    /// The service with VIP `ip` in `network` as a client in namespace `client_ns` sees
    /// it, as Istio's `get_best_by_vip`: a service not visible to it (NAMESPACE
    /// visibility, another namespace) is not there, and a range holding the address may
    /// be; with neither, the address is no service's for this client.
    pub fn service_by_vip_for(
        &self,
        network: &str,
        ip: IpAddr,
        client_ns: &str,
    ) -> Option<&Arc<Service>> {
        self.service_by_vip
            .get(network, ip)
            .filter(|s| s.visible_to(client_ns))
            .or_else(|| {
                self.service_by_cidr
                    .iter()
                    .find(|(c, s)| {
                        c.network == network && c.cidr.contains(ip) && s.visible_to(client_ns)
                    })
                    .map(|(_, s)| s)
            })
    }

    /// The service an inbound connection to `wl` on `target_port` was meant for, as
    /// Istio's ztunnel guesses it: among the services `wl` is an endpoint of (so a client
    /// cannot name just any), the one the client side named in `forwarded` (`host=`),
    /// else the first (by name) whose port maps to `target_port`.
    pub fn inbound_service(
        &self,
        wl: &Workload,
        forwarded_host: Option<&str>,
        target_port: u16,
    ) -> Option<&Arc<Service>> {
        let mut mine: Vec<(&Arc<Service>, &BTreeMap<u16, u16>)> = wl
            .services
            .iter()
            .filter_map(|(key, ports)| Some((self.services.get(key)?, ports)))
            .collect();
        mine.sort_by(|a, b| {
            a.0.namespaced_hostname()
                .0
                .cmp(&b.0.namespaced_hostname().0)
        });
        if let Some(found) = forwarded_host.and_then(|h| mine.iter().find(|(s, _)| s.hostname == h))
        {
            return Some(found.0);
        }
        let serves = |svc: &Service, ports: &BTreeMap<u16, u16>| {
            svc.ports.iter().any(|(&sport, &tport)| {
                let tport = ports
                    .get(&sport)
                    .copied()
                    .filter(|&p| p != 0)
                    .unwrap_or(if tport == 0 { sport } else { tport });
                tport == target_port
            }) || ports.values().any(|&p| p == target_port)
        };
        mine.into_iter().find(|(s, p)| serves(s, p)).map(|(s, _)| s)
    }

    /// Endpoints of a service that serve `service_port`, with the target port on each.
    pub fn endpoints_for(&self, svc: &Service, service_port: u16) -> Vec<(Arc<Workload>, u16)> {
        let key = svc.namespaced_hostname();
        let Some(eps) = self.endpoints.get(&key) else {
            return Vec::new();
        };
        eps.values()
            .filter_map(|wl| {
                Some((
                    wl.clone(),
                    target_port(svc, wl.services.get(&key)?, service_port)?,
                ))
            })
            .collect()
    }

    /// What a CONNECT naming a service by `hostname` and `service_port` (double HBONE,
    /// through an east-west gateway) reaches on `wl`: the service of that hostname `wl` is
    /// an endpoint of (one in `wl`'s namespace first, as Istio prefers), and the target
    /// port the service port maps to there. None: no such service of `wl`, or a port it
    /// does not serve; a CONNECT can never name a service the pod is not in.
    pub fn hostname_target(
        &self,
        wl: &Workload,
        hostname: &str,
        service_port: u16,
    ) -> Option<(&Arc<Service>, u16)> {
        let mut mine: Vec<(&Arc<Service>, &BTreeMap<u16, u16>)> = wl
            .services
            .iter()
            .filter_map(|(key, ports)| Some((self.services.get(key)?, ports)))
            .filter(|(s, _)| {
                s.hostname
                    .trim_end_matches('.')
                    .eq_ignore_ascii_case(hostname.trim_end_matches('.'))
            })
            .collect();
        mine.sort_by_key(|(s, _)| (s.namespace != wl.namespace, s.namespaced_hostname()));
        let (svc, ports) = mine.into_iter().next()?;
        Some((svc, target_port(svc, ports, service_port)?))
    }

    /// The endpoints of `svc` a connection from `src_network` to `service_port` may go
    /// to, with their target ports: healthy ones (all of them under health policy
    /// ALLOW_ALL) that have an IP or a hostname to resolve, or, in another network, a
    /// gateway to go through (Istio's remote endpoints have no address). One with none
    /// could never be connected to; a gateway is never used within its own network.
    pub fn usable_endpoints(
        &self,
        svc: &Service,
        service_port: u16,
        src_network: &str,
    ) -> Vec<(Arc<Workload>, u16)> {
        self.usable(svc, self.endpoints_for(svc, service_port), src_network)
    }

    /// Of `eps` (endpoints of `svc`), the usable ones (see `usable_endpoints`).
    fn usable(
        &self,
        svc: &Service,
        mut eps: Vec<(Arc<Workload>, u16)>,
        src_network: &str,
    ) -> Vec<(Arc<Workload>, u16)> {
        let allow_all = svc
            .load_balancer
            .as_ref()
            .is_some_and(|lb| lb.health_policy == LoadBalancerHealthPolicy::AllowAll);
        let reachable = |w: &Workload| {
            w.has_address() || (w.network != src_network && w.network_gateway.is_some())
        };
        eps.retain(|(w, _)| (allow_all || w.status == HealthStatus::Healthy) && reachable(w));
        eps
    }

    /// The endpoint of `svc` a connection from `src` to `service_port` goes to, as
    /// Istio's ztunnel picks it: one of `preferred_endpoints` at random, weighted by
    /// capacity.
    pub fn pick_endpoint(
        &self,
        src: &Workload,
        svc: &Service,
        service_port: u16,
    ) -> Option<(Arc<Workload>, u16)> {
        pick_weighted(&self.preferred_endpoints(src, svc, service_port))
    }

    /// The usable endpoints a connection from `src` may go to: for STRICT and FAILOVER
    /// only those matching the most of the service's routing preferences in order
    /// (STRICT: all of them, else none); for the other modes all of them. (A waypoint
    /// balances over these as ztunnel picks among them.)
    pub fn preferred_endpoints(
        &self,
        src: &Workload,
        svc: &Service,
        service_port: u16,
    ) -> Vec<(Arc<Workload>, u16)> {
        locality_preferred(
            src,
            svc,
            self.usable_endpoints(svc, service_port, &src.network),
        )
    }

    /// The usable endpoints of `svc` that speak HBONE (what a waypoint may tunnel to).
    pub fn usable_hbone_endpoints(
        &self,
        svc: &Service,
        service_port: u16,
        src_network: &str,
    ) -> Vec<(Arc<Workload>, u16)> {
        let mut eps = self.usable_endpoints(svc, service_port, src_network);
        eps.retain(|(w, _)| w.protocol == Protocol::HBONE);
        eps
    }

    /// L4 authorization of a connection to a local workload, under the policies in scope.
    pub fn authorize(
        &self,
        wl: &Workload,
        conn: &crate::rbac::Connection,
    ) -> crate::rbac::Decision {
        crate::rbac::evaluate(self.policies_for(wl).iter().map(|p| &**p), conn)
    }

    /// Policies that apply to a destination workload, in key order: the global ones,
    /// its namespace's and the selector policies it names (not every policy held).
    pub fn policies_for(&self, wl: &Workload) -> Vec<Arc<Authorization>> {
        let mut found: Vec<(&String, &Arc<Authorization>)> = self.global_policies.iter().collect();
        if let Some(ns) = self.namespace_policies.get(&wl.namespace) {
            found.extend(ns.iter());
        }
        found.extend(
            wl.authorization_policies
                .iter()
                .filter_map(|k| self.policies.get_key_value(k))
                .filter(|(_, p)| p.scope == PolicyScope::WorkloadSelector),
        );
        found.sort_by(|a, b| a.0.cmp(b.0));
        found.dedup_by(|a, b| a.0 == b.0);
        found.into_iter().map(|(_, p)| p.clone()).collect()
    }

    /// Identities acceptable for a destination workload (its own, plus its services' SANs).
    pub fn expected_identities(
        &self,
        wl: &Workload,
        via_service: Option<&Service>,
    ) -> Vec<Identity> {
        let mut ids = vec![wl.identity()];
        if let Some(svc) = via_service {
            for san in &svc.subject_alt_names {
                if let Ok(id) = san.parse::<Identity>() {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
        }
        ids
    }
}

/// Of `eps` (endpoints of `svc`), those a connection from `src` may go to: for STRICT
/// and FAILOVER only those matching the most of the service's routing preferences in
/// order (STRICT: all of them, else none); for the other modes all of them.
pub fn locality_preferred(
    src: &Workload,
    svc: &Service,
    eps: Vec<(Arc<Workload>, u16)>,
) -> Vec<(Arc<Workload>, u16)> {
    let Some(lb) = svc.load_balancer.as_ref().filter(|lb| {
        matches!(
            lb.mode,
            LoadBalancerMode::Strict | LoadBalancerMode::Failover
        )
    }) else {
        return eps;
    };
    let prefs = &lb.routing_preferences;
    // A NETWORK scope first is "prefer my network, then the rest in order": a match
    // counts, and lifts the endpoint above every one of another network.
    let network_first = prefs.first() == Some(&LoadBalancerScope::Network);
    let rank = |wl: &Workload| {
        let (mut rank, mut adjust) = (0, 0);
        for scope in prefs {
            let matches = match scope {
                LoadBalancerScope::Region => src.locality.region == wl.locality.region,
                LoadBalancerScope::Zone => src.locality.zone == wl.locality.zone,
                LoadBalancerScope::Subzone => src.locality.subzone == wl.locality.subzone,
                LoadBalancerScope::Node => src.node == wl.node,
                LoadBalancerScope::Cluster => src.cluster_id == wl.cluster_id,
                LoadBalancerScope::Network if network_first => {
                    if src.network != wl.network {
                        continue;
                    }
                    adjust = prefs.len() - 1;
                    true
                }
                LoadBalancerScope::Network => src.network == wl.network,
            };
            if !matches {
                break;
            }
            rank += 1;
        }
        (rank, rank + adjust)
    };
    let ranked: Vec<(usize, (Arc<Workload>, u16))> = eps
        .into_iter()
        .filter_map(|ep| {
            let (matched, adjusted) = rank(&ep.0);
            // STRICT: an endpoint short of any preference is never used.
            (lb.mode != LoadBalancerMode::Strict || matched == prefs.len())
                .then_some((adjusted, ep))
        })
        .collect();
    let Some(best) = ranked.iter().map(|(r, _)| *r).max() else {
        return Vec::new();
    };
    ranked
        .into_iter()
        .filter(|(r, _)| *r == best)
        .map(|(_, ep)| ep)
        .collect()
}

/// The port `service_port` of `svc` maps to on an endpoint with port map `ports`: the
/// endpoint's map wins, else the service's, else (neither lists ports) the same port;
/// a target port 0 is the service port.
fn target_port(svc: &Service, ports: &BTreeMap<u16, u16>, service_port: u16) -> Option<u16> {
    let target = ports
        .get(&service_port)
        .copied()
        .or_else(|| svc.ports.get(&service_port).copied())
        .or(if ports.is_empty() && svc.ports.is_empty() {
            Some(service_port)
        } else {
            None
        })?;
    Some(if target == 0 { service_port } else { target })
}

/// Where a connection through an east-west gateway goes first (`MeshState::network_gateway`).
#[derive(Clone, Debug)]
pub struct GatewayUpstream {
    pub workload: Arc<Workload>,
    /// The gateway's HBONE address.
    pub addr: SocketAddr,
    /// What the gateway's certificate must name: its own identity, or one of its
    /// service's SANs.
    pub identities: Vec<Identity>,
}

/// Random endpoint, weighted by capacity (Istio's default capacity is 1).
pub fn pick_weighted(eps: &[(Arc<Workload>, u16)]) -> Option<(Arc<Workload>, u16)> {
    let total: u64 = eps.iter().map(|(w, _)| u64::from(w.capacity)).sum();
    if total == 0 {
        return eps.first().cloned();
    }
    let mut n = rand::rng().random_range(0..total);
    for (w, p) in eps {
        let c = u64::from(w.capacity);
        if n < c {
            return Some((w.clone(), *p));
        }
        n -= c;
    }
    None
}

/// The waypoint a connection to `svc` goes through, as Istio's ztunnel picks it: one of
/// `weighted_waypoints` at random, in proportion to the weights; with no weighted set,
/// or one whose weights are all 0, the single `waypoint` (None: no waypoint).
pub fn pick_waypoint(svc: &Service) -> Option<&GatewayAddress> {
    let total: u64 = svc
        .weighted_waypoints
        .iter()
        .map(|w| u64::from(w.weight))
        .sum();
    let point = if total == 0 {
        0
    } else {
        rand::rng().random_range(0..total)
    };
    pick_waypoint_at(svc, point)
}

/// `pick_waypoint` for a given point in `0..sum of weights`.
fn pick_waypoint_at(svc: &Service, mut point: u64) -> Option<&GatewayAddress> {
    for w in &svc.weighted_waypoints {
        let weight = u64::from(w.weight);
        if point < weight {
            return Some(&w.destination);
        }
        point -= weight;
    }
    svc.waypoint.as_ref()
}

/// The current mesh state, replaced as a whole on every change; `changes` lets
/// subscribers (pods waiting to be enrolled, connections re-checked against new
/// policy) react to each new version.
pub struct SharedState {
    current: arc_swap::ArcSwap<MeshState>,
    generation: tokio::sync::watch::Sender<u64>,
}

impl SharedState {
    pub fn new(state: MeshState) -> SharedState {
        SharedState {
            current: arc_swap::ArcSwap::from_pointee(state),
            generation: tokio::sync::watch::Sender::new(0),
        }
    }

    pub fn load(&self) -> arc_swap::Guard<Arc<MeshState>> {
        self.current.load()
    }

    pub fn load_full(&self) -> Arc<MeshState> {
        self.current.load_full()
    }

    pub fn store(&self, state: MeshState) {
        self.current.store(Arc::new(state));
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

impl Default for SharedState {
    fn default() -> Self {
        SharedState::new(MeshState::default())
    }
}
