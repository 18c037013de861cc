//! The mesh state's indexes ([`MeshState`]'s data; its lookups are in `state`) and their
//! incremental upkeep ([`MeshIndex`]): workloads, services and policies are added and
//! removed one at a time, each touching only the index entries it owns, and a snapshot
//! is a clone of persistent maps (shared structure, no copy). So an xDS push costs what
//! it changes, not what the mesh holds.
//!
//! Keys that must name one object (a workload uid, an IP or VIP in its network, a
//! service hostname, a service's Kubernetes name, a policy key) may be claimed by more
//! than one while istiod's state briefly overlaps; each key keeps its claimants in rank
//! order and the best one is in the index. When it goes, the next one takes its place.
//! Only the winner of a uid or hostname claims that object's addresses and endpoints.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;

use smallvec::SmallVec;

use super::address::{NetworkAddress, NetworkCidr};
use super::workload::{
    GatewayDestination, NamespacedHostname, NetworkMode, Service, Workload, WorkloadUid,
};
use crate::rbac::{Authorization, PolicyScope};

/// Who keeps a contested key: the lower rank. Unique per object held (the xDS store
/// ranks by precedence, then by when the resource was first seen; a config file by its
/// order), since an object is released by its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank {
    pub precedence: u8,
    pub age: u64,
}

/// The claimants of one key, best first. Nearly every key has one: kept inline.
struct Claims<T>(SmallVec<[(Rank, Arc<T>); 1]>);

enum Claimed<T> {
    /// The claimant is now the key's holder (it displaced this one, if any).
    Won(Option<Arc<T>>),
    /// Another one holds the key.
    Lost(Arc<T>),
}

fn claim<K: Hash + Eq, T>(
    claims: &mut HashMap<K, Claims<T>>,
    key: K,
    rank: Rank,
    value: &Arc<T>,
) -> Claimed<T> {
    let c = claims.entry(key).or_insert_with(|| Claims(SmallVec::new()));
    let at = c.0.partition_point(|(r, _)| *r < rank);
    c.0.insert(at, (rank, value.clone()));
    match (at, c.0.get(1)) {
        (0, displaced) => Claimed::Won(displaced.map(|(_, v)| v.clone())),
        _ => Claimed::Lost(c.0[0].1.clone()),
    }
}

/// Releases `rank`'s claim. `Some(next)` when it was the holder (`next`: who holds the
/// key now, if anyone), `None` when it was not.
fn unclaim<K: Hash + Eq, T>(
    claims: &mut HashMap<K, Claims<T>>,
    key: &K,
    rank: Rank,
) -> Option<Option<(Rank, Arc<T>)>> {
    let c = claims.get_mut(key)?;
    let at = c.0.iter().position(|(r, _)| *r == rank)?;
    c.0.remove(at);
    let next = c.0.first().cloned();
    if c.0.is_empty() {
        claims.remove(key);
    }
    (at == 0).then_some(next)
}

/// A workload's addresses: a host-network pod's IP is its node's, not the workload's.
fn addresses(wl: &Workload) -> &[IpAddr] {
    if wl.network_mode == NetworkMode::HostNetwork {
        &[]
    } else {
        &wl.workload_ips
    }
}

/// Values by address within a network: as in Istio, an address is unique only in its
/// network (two networks may reuse a pod CIDR), so every lookup names the network.
#[derive(Debug, Clone)]
pub(super) struct ByAddress<T: Clone>(imbl::HashMap<String, imbl::HashMap<IpAddr, T>>);

impl<T: Clone> Default for ByAddress<T> {
    fn default() -> Self {
        ByAddress(imbl::HashMap::new())
    }
}

impl<T: Clone> ByAddress<T> {
    pub(super) fn get(&self, network: &str, ip: IpAddr) -> Option<&T> {
        self.0.get(network)?.get(&ip)
    }

    fn insert(&mut self, network: &str, ip: IpAddr, value: T) {
        match self.0.get_mut(network) {
            Some(by_ip) => {
                by_ip.insert(ip, value);
            }
            None => {
                self.0
                    .insert(network.to_string(), imbl::HashMap::unit(ip, value));
            }
        }
    }

    fn remove(&mut self, network: &str, ip: IpAddr) {
        if let Some(by_ip) = self.0.get_mut(network) {
            by_ip.remove(&ip);
            if by_ip.is_empty() {
                self.0.remove(network);
            }
        }
    }
}

/// A snapshot of mesh state. Readers hold one consistent version; updates (see
/// [`MeshIndex`]) change a copy, which shares all it does not change (persistent maps).
#[derive(Debug, Default, Clone)]
pub struct MeshState {
    pub(super) workloads: imbl::HashMap<WorkloadUid, Arc<Workload>>,
    pub(super) workload_by_ip: ByAddress<Arc<Workload>>,
    pub(super) services: imbl::HashMap<NamespacedHostname, Arc<Service>>,
    pub(super) service_by_vip: ByAddress<Arc<Service>>,
    /// CIDR VIPs, longest prefix first (looked up when no exact VIP matches).
    pub(super) service_by_cidr: Arc<Vec<(NetworkCidr, Arc<Service>)>>,
    /// (namespace, name) -> service: what HTTPRoute backendRefs name.
    pub(super) service_by_name: imbl::HashMap<(String, String), Arc<Service>>,
    /// Endpoints of each service by workload uid (the port map, service port -> target
    /// port, is the workload's `services` entry).
    pub(super) endpoints:
        imbl::HashMap<NamespacedHostname, imbl::OrdMap<WorkloadUid, Arc<Workload>>>,
    /// Every policy by key, and those of global and namespace scope again by scope, so a
    /// connection's evaluation looks at the policies in its scope only.
    pub(super) policies: imbl::OrdMap<String, Arc<Authorization>>,
    pub(super) global_policies: imbl::OrdMap<String, Arc<Authorization>>,
    pub(super) namespace_policies: imbl::HashMap<String, imbl::OrdMap<String, Arc<Authorization>>>,
    /// Workloads that name a node, by a hash of their namespace and name (`pod_key`): how
    /// a pod that istio-cni enrolls by its Kubernetes UID finds its workload
    /// (`workload_for_pod`) without a scan of the mesh. A hash, not the two strings, so
    /// the index costs a few words per workload; lookups compare the names.
    pub(super) pods: imbl::HashMap<u64, SmallVec<[Arc<Workload>; 1]>>,
    /// Workloads some workload names as its network gateway (directly or through a
    /// service): what may forward another network's connections.
    pub(super) gateways: Arc<HashSet<WorkloadUid>>,
}

/// The `pods` index key of a namespace and name.
pub(super) fn pod_key(namespace: &str, name: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(namespace.as_bytes());
    h.write_u8(0xff);
    h.write(name.as_bytes());
    h.finish()
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("workload uid {0:?} appears twice; every workload needs a unique uid")]
    DuplicateWorkload(String),
    #[error("workload IP {addr} (network/ip) is claimed by both {first} and {second}; an IP must map to one identity in its network")]
    DuplicateIp {
        addr: NetworkAddress,
        first: String,
        second: String,
    },
    #[error("service VIP {addr} (network/ip) is claimed by both {first} and {second}")]
    DuplicateVip {
        addr: NetworkAddress,
        first: String,
        second: String,
    },
    #[error("service {0} appears twice")]
    DuplicateService(String),
}

impl MeshState {
    /// The uids of the workloads behind the network gateways `named` (each looked up once).
    fn gateway_workloads<'a>(
        &self,
        named: impl Iterator<Item = &'a GatewayDestination>,
    ) -> HashSet<WorkloadUid> {
        let mut uids = HashSet::new();
        for dest in named {
            let svc = match dest {
                GatewayDestination::Address(a) => {
                    match self.workload_by_ip.get(&a.network, a.address) {
                        Some(w) => {
                            uids.insert(w.uid.clone());
                            continue;
                        }
                        None => self.service_by_vip(&a.network, a.address),
                    }
                }
                GatewayDestination::Hostname(h) => self.services.get(h),
            };
            let eps = svc.and_then(|s| self.endpoints.get(&s.namespaced_hostname()));
            uids.extend(eps.into_iter().flat_map(|eps| eps.keys().cloned()));
        }
        uids
    }
}

#[derive(Default)]
pub struct MeshIndex {
    state: MeshState,
    workload_claims: HashMap<WorkloadUid, Claims<Workload>>,
    ip_claims: HashMap<(String, IpAddr), Claims<Workload>>,
    service_claims: HashMap<NamespacedHostname, Claims<Service>>,
    vip_claims: HashMap<(String, IpAddr), Claims<Service>>,
    name_claims: HashMap<(String, String), Claims<Service>>,
    policy_claims: HashMap<String, Claims<Authorization>>,
    /// Held services with CIDR VIPs, in rank order (ties between ranges go to the first).
    cidr_services: BTreeMap<Rank, Arc<Service>>,
    cidr_changed: bool,
    /// How many held workloads name each network gateway.
    gateway_refs: HashMap<GatewayDestination, usize>,
}

impl MeshIndex {
    /// The state as of now: clones of persistent maps, so it costs the number of maps.
    pub fn snapshot(&mut self) -> MeshState {
        if self.cidr_changed {
            let mut cidrs: Vec<_> = self
                .cidr_services
                .values()
                .flat_map(|s| s.cidr_vips.iter().map(move |c| (c.clone(), s.clone())))
                .collect();
            // Stable: among equal prefixes, the earlier (stronger) service wins.
            cidrs.sort_by_key(|(c, _)| std::cmp::Reverse(c.cidr.0.prefix_len()));
            self.state.service_by_cidr = Arc::new(cidrs);
            self.cidr_changed = false;
        }
        // Proportional to the gateways named (a handful), not to the workloads.
        self.state.gateways = Arc::new(self.state.gateway_workloads(self.gateway_refs.keys()));
        self.state.clone()
    }

    pub fn insert_workload(
        &mut self,
        rank: Rank,
        wl: Arc<Workload>,
        conflicts: &mut Vec<StateError>,
    ) {
        match claim(&mut self.workload_claims, wl.uid.clone(), rank, &wl) {
            Claimed::Won(displaced) => {
                if let Some(old) = displaced {
                    conflicts.push(StateError::DuplicateWorkload(wl.uid.to_string()));
                    self.deactivate_workload(&old);
                }
                self.activate_workload(rank, &wl, conflicts);
            }
            Claimed::Lost(_) => conflicts.push(StateError::DuplicateWorkload(wl.uid.to_string())),
        }
    }

    pub fn remove_workload(
        &mut self,
        rank: Rank,
        wl: &Arc<Workload>,
        conflicts: &mut Vec<StateError>,
    ) {
        if let Some(next) = unclaim(&mut self.workload_claims, &wl.uid, rank) {
            self.deactivate_workload(wl);
            if let Some((rank, next)) = next {
                self.activate_workload(rank, &next, conflicts);
            }
        }
    }

    fn activate_workload(
        &mut self,
        rank: Rank,
        wl: &Arc<Workload>,
        conflicts: &mut Vec<StateError>,
    ) {
        self.state.workloads.insert(wl.uid.clone(), wl.clone());
        for ip in addresses(wl) {
            match claim(&mut self.ip_claims, (wl.network.clone(), *ip), rank, wl) {
                Claimed::Won(displaced) => {
                    self.state
                        .workload_by_ip
                        .insert(&wl.network, *ip, wl.clone());
                    if let Some(d) = displaced {
                        conflicts.push(StateError::DuplicateIp {
                            addr: NetworkAddress {
                                network: wl.network.clone(),
                                address: *ip,
                            },
                            first: wl.uid.to_string(),
                            second: d.uid.to_string(),
                        });
                    }
                }
                Claimed::Lost(holder) => conflicts.push(StateError::DuplicateIp {
                    addr: NetworkAddress {
                        network: wl.network.clone(),
                        address: *ip,
                    },
                    first: holder.uid.to_string(),
                    second: wl.uid.to_string(),
                }),
            }
        }
        for svc in wl.services.keys() {
            self.state
                .endpoints
                .entry(svc.clone())
                .or_default()
                .insert(wl.uid.clone(), wl.clone());
        }
        if !wl.node.is_empty() {
            self.state
                .pods
                .entry(pod_key(&wl.namespace, &wl.name))
                .or_default()
                .push(wl.clone());
        }
        if let Some(gw) = &wl.network_gateway {
            *self.gateway_refs.entry(gw.destination.clone()).or_default() += 1;
        }
    }

    /// Takes out what the uid's holder put in (its rank is found again in the IP claims).
    fn deactivate_workload(&mut self, wl: &Arc<Workload>) {
        self.state.workloads.remove(&wl.uid);
        for ip in addresses(wl) {
            let key = (wl.network.clone(), *ip);
            let Some(rank) = self
                .ip_claims
                .get(&key)
                .and_then(|c| c.0.iter().find(|(_, w)| Arc::ptr_eq(w, wl)))
                .map(|(r, _)| *r)
            else {
                continue;
            };
            match unclaim(&mut self.ip_claims, &key, rank) {
                Some(Some((_, next))) => {
                    self.state.workload_by_ip.insert(&wl.network, *ip, next);
                }
                Some(None) => self.state.workload_by_ip.remove(&wl.network, *ip),
                None => {}
            }
        }
        for svc in wl.services.keys() {
            if let Some(eps) = self.state.endpoints.get_mut(svc) {
                eps.remove(&wl.uid);
                if eps.is_empty() {
                    self.state.endpoints.remove(svc);
                }
            }
        }
        if !wl.node.is_empty() {
            let key = pod_key(&wl.namespace, &wl.name);
            if let Some(same_name) = self.state.pods.get_mut(&key) {
                same_name.retain(|w| !Arc::ptr_eq(w, wl));
                if same_name.is_empty() {
                    self.state.pods.remove(&key);
                }
            }
        }
        if let Some(gw) = &wl.network_gateway {
            if let Some(n) = self.gateway_refs.get_mut(&gw.destination) {
                *n -= 1;
                if *n == 0 {
                    self.gateway_refs.remove(&gw.destination);
                }
            }
        }
    }

    pub fn insert_service(
        &mut self,
        rank: Rank,
        svc: Arc<Service>,
        conflicts: &mut Vec<StateError>,
    ) {
        let key = svc.namespaced_hostname();
        match claim(&mut self.service_claims, key.clone(), rank, &svc) {
            Claimed::Won(displaced) => {
                if let Some(old) = displaced {
                    conflicts.push(StateError::DuplicateService(key.to_string()));
                    self.deactivate_service(&old);
                }
                self.activate_service(rank, &svc, conflicts);
            }
            Claimed::Lost(_) => conflicts.push(StateError::DuplicateService(key.to_string())),
        }
    }

    pub fn remove_service(
        &mut self,
        rank: Rank,
        svc: &Arc<Service>,
        conflicts: &mut Vec<StateError>,
    ) {
        if let Some(next) = unclaim(&mut self.service_claims, &svc.namespaced_hostname(), rank) {
            self.deactivate_service(svc);
            if let Some((rank, next)) = next {
                self.activate_service(rank, &next, conflicts);
            }
        }
    }

    fn activate_service(
        &mut self,
        rank: Rank,
        svc: &Arc<Service>,
        conflicts: &mut Vec<StateError>,
    ) {
        let key = svc.namespaced_hostname();
        self.state.services.insert(key.clone(), svc.clone());
        for vip in &svc.vips {
            match claim(
                &mut self.vip_claims,
                (vip.network.clone(), vip.address),
                rank,
                svc,
            ) {
                Claimed::Won(displaced) => {
                    self.state
                        .service_by_vip
                        .insert(&vip.network, vip.address, svc.clone());
                    if let Some(d) = displaced {
                        conflicts.push(StateError::DuplicateVip {
                            addr: vip.clone(),
                            first: key.to_string(),
                            second: d.namespaced_hostname().to_string(),
                        });
                    }
                }
                Claimed::Lost(holder) => conflicts.push(StateError::DuplicateVip {
                    addr: vip.clone(),
                    first: holder.namespaced_hostname().to_string(),
                    second: key.to_string(),
                }),
            }
        }
        if let Claimed::Won(_) = claim(
            &mut self.name_claims,
            (svc.namespace.clone(), svc.name.clone()),
            rank,
            svc,
        ) {
            self.state
                .service_by_name
                .insert((svc.namespace.clone(), svc.name.clone()), svc.clone());
        }
        if !svc.cidr_vips.is_empty() {
            self.cidr_services.insert(rank, svc.clone());
            self.cidr_changed = true;
        }
    }

    fn deactivate_service(&mut self, svc: &Arc<Service>) {
        self.state.services.remove(&svc.namespaced_hostname());
        let rank_in = |claims: &Claims<Service>| {
            claims
                .0
                .iter()
                .find(|(_, s)| Arc::ptr_eq(s, svc))
                .map(|(r, _)| *r)
        };
        for vip in &svc.vips {
            let key = (vip.network.clone(), vip.address);
            let Some(rank) = self.vip_claims.get(&key).and_then(rank_in) else {
                continue;
            };
            match unclaim(&mut self.vip_claims, &key, rank) {
                Some(Some((_, next))) => {
                    self.state
                        .service_by_vip
                        .insert(&vip.network, vip.address, next);
                }
                Some(None) => self.state.service_by_vip.remove(&vip.network, vip.address),
                None => {}
            }
        }
        let key = (svc.namespace.clone(), svc.name.clone());
        if let Some(rank) = self.name_claims.get(&key).and_then(rank_in) {
            match unclaim(&mut self.name_claims, &key, rank) {
                Some(Some((_, next))) => {
                    self.state.service_by_name.insert(key, next);
                }
                Some(None) => {
                    self.state.service_by_name.remove(&key);
                }
                None => {}
            }
        }
        if !svc.cidr_vips.is_empty() {
            self.cidr_services.retain(|_, s| !Arc::ptr_eq(s, svc));
            self.cidr_changed = true;
        }
    }

    pub fn insert_policy(&mut self, rank: Rank, p: Arc<Authorization>) {
        if let Claimed::Won(displaced) = claim(&mut self.policy_claims, p.key(), rank, &p) {
            if let Some(old) = displaced {
                self.unindex_policy(&old);
            }
            self.index_policy(&p);
        }
    }

    pub fn remove_policy(&mut self, rank: Rank, p: &Arc<Authorization>) {
        if let Some(next) = unclaim(&mut self.policy_claims, &p.key(), rank) {
            self.unindex_policy(p);
            if let Some((_, next)) = next {
                self.index_policy(&next);
            }
        }
    }

    fn index_policy(&mut self, p: &Arc<Authorization>) {
        let key = p.key();
        self.state.policies.insert(key.clone(), p.clone());
        match p.scope {
            PolicyScope::Global => {
                self.state.global_policies.insert(key, p.clone());
            }
            PolicyScope::Namespace => {
                self.state
                    .namespace_policies
                    .entry(p.namespace.clone())
                    .or_default()
                    .insert(key, p.clone());
            }
            // Looked up by key from the workloads that name it.
            PolicyScope::WorkloadSelector => {}
        }
    }

    fn unindex_policy(&mut self, p: &Arc<Authorization>) {
        let key = p.key();
        self.state.policies.remove(&key);
        match p.scope {
            PolicyScope::Global => {
                self.state.global_policies.remove(&key);
            }
            PolicyScope::Namespace => {
                if let Some(ns) = self.state.namespace_policies.get_mut(&p.namespace) {
                    ns.remove(&key);
                    if ns.is_empty() {
                        self.state.namespace_policies.remove(&p.namespace);
                    }
                }
            }
            PolicyScope::WorkloadSelector => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rbac::PolicyAction;

    /// A tiny deterministic generator (the test must not depend on a seed's luck).
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    enum Object {
        Workload(Arc<Workload>),
        Service(Arc<Service>),
        Policy(Arc<Authorization>),
    }

    fn random_object(g: &mut Lcg, tag: usize) -> Object {
        let ip = |g: &mut Lcg| format!("10.0.0.{}", 1 + g.below(4));
        match g.below(3) {
            0 => {
                // Pods and WorkloadEntries (weaker) over few uids, IPs and services.
                let uid = match g.below(4) {
                    0 => "Kubernetes//Pod/ns/a".to_string(),
                    1 => "Kubernetes//Pod/ns/b".to_string(),
                    n => format!("Kubernetes/networking.istio.io/WorkloadEntry/ns/e{n}"),
                };
                let ips = if g.below(2) == 0 {
                    ip(g)
                } else {
                    format!("{}, {}", ip(g), ip(g))
                };
                let network = if g.below(4) == 0 { "net-b" } else { "" };
                let svc = format!("ns/s{}.ns.svc.cluster.local", g.below(2));
                let policies = if g.below(2) == 0 { "[ns/p0]" } else { "[]" };
                let node = ["", "n0", "n1"][g.below(3) as usize];
                let yaml = format!(
                    "{{uid: '{uid}', name: v{tag}, namespace: ns, node: '{node}', workloadIps: [{ips}], network: '{network}', services: {{'{svc}': {{80: 8080}}}}, authorizationPolicies: {policies}}}"
                );
                Object::Workload(Arc::new(serde_yaml::from_str(&yaml).unwrap()))
            }
            1 => {
                let host = format!("s{}.ns.svc.cluster.local", g.below(2));
                let name = if g.below(3) == 0 {
                    "other".to_string()
                } else {
                    host[..2].to_string()
                };
                let yaml = format!("{{name: {name}, namespace: ns, hostname: '{host}', vips: [/10.96.0.{}], ports: {{80: 8080}}}}", 1 + g.below(3));
                Object::Service(Arc::new(serde_yaml::from_str(&yaml).unwrap()))
            }
            _ => {
                let scope = [
                    PolicyScope::Global,
                    PolicyScope::Namespace,
                    PolicyScope::WorkloadSelector,
                ][g.below(3) as usize];
                let mut p = Authorization::deny_all(
                    "ns",
                    &format!("p{}", g.below(2)),
                    scope,
                    false,
                    format!("v{tag}"),
                );
                p.action = if g.below(2) == 0 {
                    PolicyAction::Allow
                } else {
                    PolicyAction::Deny
                };
                Object::Policy(Arc::new(p))
            }
        }
    }

    /// Everything a lookup can observe, as text.
    fn observe(st: &MeshState) -> Vec<String> {
        let mut out = Vec::new();
        for w in st.workloads() {
            out.push(format!("workload {} {}", w.uid, w.name));
        }
        for net in ["", "net-b"] {
            for i in 1..=4 {
                let ip: IpAddr = format!("10.0.0.{i}").parse().unwrap();
                if let Some(w) = st.workload_by_ip(net, ip) {
                    out.push(format!("ip {net}/{ip} {} {}", w.uid, w.name));
                }
            }
        }
        for s in st.services() {
            out.push(format!(
                "service {} {} {:?}",
                s.namespaced_hostname(),
                s.name,
                s.vips
            ));
            let eps: Vec<String> = st
                .endpoints_for(s, 80)
                .iter()
                .map(|(w, p)| format!("{} {} {p}", w.uid, w.name))
                .collect();
            out.push(format!("endpoints {} {eps:?}", s.namespaced_hostname()));
        }
        for i in 1..=3 {
            let ip: IpAddr = format!("10.96.0.{i}").parse().unwrap();
            if let Some(s) = st.service_by_vip("", ip) {
                out.push(format!("vip {ip} {}", s.namespaced_hostname()));
            }
        }
        for name in ["s0", "s1", "other"] {
            if let Some(s) = st.service_by_name("ns", name) {
                out.push(format!("by name {name} {}", s.namespaced_hostname()));
            }
        }
        let unknown = WorkloadUid("not-a-uid".into());
        for w in st.workloads() {
            for node in ["n0", "n1"] {
                if let Some(found) =
                    st.workload_for_pod(&unknown, Some((&w.namespace, &w.name)), node)
                {
                    out.push(format!(
                        "pod {}/{} on {node} {}",
                        w.namespace, w.name, found.uid
                    ));
                }
            }
        }
        for p in st.policies() {
            out.push(format!(
                "policy {} {:?} {:?} {:?}",
                p.key(),
                p.scope,
                p.action,
                p.unenforceable
            ));
        }
        for w in st.workloads() {
            let keys: Vec<String> = st
                .policies_for(w)
                .iter()
                .map(|p| format!("{}:{:?}", p.key(), p.unenforceable))
                .collect();
            out.push(format!("policies for {} {keys:?}", w.uid));
        }
        out.sort();
        out
    }

    fn insert(index: &mut MeshIndex, rank: Rank, o: &Object) {
        match o {
            Object::Workload(w) => index.insert_workload(rank, w.clone(), &mut Vec::new()),
            Object::Service(s) => index.insert_service(rank, s.clone(), &mut Vec::new()),
            Object::Policy(p) => index.insert_policy(rank, p.clone()),
        }
    }

    fn remove(index: &mut MeshIndex, rank: Rank, o: &Object) {
        match o {
            Object::Workload(w) => index.remove_workload(rank, w, &mut Vec::new()),
            Object::Service(s) => index.remove_service(rank, s, &mut Vec::new()),
            Object::Policy(p) => index.remove_policy(rank, p),
        }
    }

    fn rank_of(o: &Object, age: u64) -> Rank {
        let precedence = match o {
            Object::Workload(w) => w.precedence(),
            Object::Service(s) => s.precedence(),
            Object::Policy(_) => 0,
        };
        Rank { precedence, age }
    }

    /// Objects added and removed one at a time, in any order, leave the index as one
    /// built from scratch from what is held then, in rank order: the holder of every
    /// contested key is the best claimant whatever arrived or left in between.
    #[test]
    fn updates_in_any_order_equal_a_build_from_scratch() {
        for seed in 0..40 {
            let mut g = Lcg(seed);
            let mut index = MeshIndex::default();
            // slot -> (age, object): a slot is a resource name.
            let mut held: BTreeMap<u64, (u64, Object)> = BTreeMap::new();
            let mut next_age = 0;
            for step in 0..60 {
                let slot = g.below(10);
                if let Some((age, old)) = held.remove(&slot) {
                    remove(&mut index, rank_of(&old, age), &old);
                    if g.below(3) == 0 {
                        // Removed for good; otherwise replaced by a new version of the slot.
                        let incremental = observe(&index.snapshot());
                        assert_eq!(incremental, rebuilt(&held), "seed {seed} step {step}");
                        continue;
                    }
                    let o = random_object(&mut g, step);
                    insert(&mut index, rank_of(&o, age), &o);
                    held.insert(slot, (age, o));
                } else {
                    next_age += 1;
                    let o = random_object(&mut g, step);
                    insert(&mut index, rank_of(&o, next_age), &o);
                    held.insert(slot, (next_age, o));
                }
                assert_eq!(
                    observe(&index.snapshot()),
                    rebuilt(&held),
                    "seed {seed} step {step}"
                );
            }
            // And everything removed leaves nothing behind.
            for (age, o) in std::mem::take(&mut held).into_values() {
                remove(&mut index, rank_of(&o, age), &o);
            }
            assert!(observe(&index.snapshot()).is_empty());
            assert!(index.snapshot().pods.is_empty());
            assert!(
                index.workload_claims.is_empty()
                    && index.ip_claims.is_empty()
                    && index.service_claims.is_empty()
            );
            assert!(
                index.vip_claims.is_empty()
                    && index.name_claims.is_empty()
                    && index.policy_claims.is_empty()
            );
            assert!(index.cidr_services.is_empty() && index.gateway_refs.is_empty());
        }
    }

    fn rebuilt(held: &BTreeMap<u64, (u64, Object)>) -> Vec<String> {
        let mut all: Vec<(Rank, &Object)> = held
            .values()
            .map(|(age, o)| (rank_of(o, *age), o))
            .collect();
        all.sort_by_key(|(r, _)| *r);
        let mut index = MeshIndex::default();
        for (rank, o) in all {
            insert(&mut index, rank, o);
        }
        observe(&index.snapshot())
    }

    /// A pod enrolled by its Kubernetes UID finds its workload by namespace and name on
    /// this node only; of two that match, the lower uid, whatever the order of arrival.
    #[test]
    fn a_pod_finds_its_workload_by_name_on_its_node() {
        let wl = |uid: &str, name: &str, node: &str| -> Arc<Workload> {
            Arc::new(
                serde_yaml::from_str(&format!(
                    "{{uid: '{uid}', name: {name}, namespace: ns, node: '{node}'}}"
                ))
                .unwrap(),
            )
        };
        let (a, b, elsewhere, no_node) = (
            wl("c//Pod/ns/a", "a", "n1"),
            wl("c//Pod/ns/a2", "a", "n1"),
            wl("c//Pod/ns/x", "x", "n2"),
            wl("c//WE/ns/y", "y", ""),
        );
        for order in [[&b, &a], [&a, &b]] {
            let mut index = MeshIndex::default();
            for (age, w) in order.into_iter().chain([&elsewhere, &no_node]).enumerate() {
                index.insert_workload(
                    Rank {
                        precedence: 0,
                        age: age as u64,
                    },
                    w.clone(),
                    &mut Vec::new(),
                );
            }
            let st = index.snapshot();
            let k8s_uid = WorkloadUid("0b5c6f3e-kubernetes-pod-uid".into());
            let find = |name: &str, node: &str| {
                st.workload_for_pod(&k8s_uid, Some(("ns", name)), node)
                    .map(|w| w.uid.to_string())
            };
            assert_eq!(find("a", "n1").as_deref(), Some("c//Pod/ns/a"));
            assert_eq!(find("a", "n2"), None, "a pod on another node");
            assert_eq!(find("x", "n2").as_deref(), Some("c//Pod/ns/x"));
            assert_eq!(find("y", ""), None, "a workload without a node is no pod");
            assert_eq!(
                st.workload_for_pod(&k8s_uid, Some(("other", "a")), "n1")
                    .map(|w| w.uid.to_string()),
                None
            );
            // By uid first, as local config names pods.
            assert_eq!(
                st.workload_for_pod(&b.uid, Some(("ns", "a")), "n1")
                    .map(|w| w.uid.to_string())
                    .as_deref(),
                Some("c//Pod/ns/a2")
            );
            let age_of_a = order.iter().position(|w| Arc::ptr_eq(w, &a)).unwrap() as u64;
            index.remove_workload(
                Rank {
                    precedence: 0,
                    age: age_of_a,
                },
                &a,
                &mut Vec::new(),
            );
            let st = index.snapshot();
            assert_eq!(
                st.workload_for_pod(&k8s_uid, Some(("ns", "a")), "n1")
                    .map(|w| w.uid.to_string())
                    .as_deref(),
                Some("c//Pod/ns/a2")
            );
        }
    }

    /// A snapshot is a version: later updates never show through it.
    #[test]
    fn a_snapshot_does_not_change_after_it_is_taken() {
        let mut index = MeshIndex::default();
        let w: Workload = serde_yaml::from_str("{uid: a, name: a, namespace: ns, workloadIps: [10.0.0.1], services: {ns/s.ns.svc.cluster.local: {80: 80}}}").unwrap();
        index.insert_workload(
            Rank {
                precedence: 0,
                age: 1,
            },
            Arc::new(w),
            &mut Vec::new(),
        );
        let before = index.snapshot();
        let seen = observe(&before);
        let w: Workload = serde_yaml::from_str("{uid: b, name: b, namespace: ns, workloadIps: [10.0.0.2], services: {ns/s.ns.svc.cluster.local: {80: 80}}}").unwrap();
        index.insert_workload(
            Rank {
                precedence: 0,
                age: 2,
            },
            Arc::new(w),
            &mut Vec::new(),
        );
        let wa = before
            .workload_by_uid(&WorkloadUid("a".into()))
            .unwrap()
            .clone();
        index.remove_workload(
            Rank {
                precedence: 0,
                age: 1,
            },
            &wa,
            &mut Vec::new(),
        );
        assert_eq!(observe(&before), seen);
        assert_eq!(
            index
                .snapshot()
                .workloads()
                .map(|w| w.uid.to_string())
                .collect::<Vec<_>>(),
            ["b"]
        );
    }
}
