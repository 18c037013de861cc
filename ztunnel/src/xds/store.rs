//! The resources istiod has sent, by name and version, and the mesh state built from
//! them. Each applied response changes only what it names in the index (`MeshIndex`)
//! and swaps in a new snapshot whole, so a connection always sees one consistent
//! version and a push costs what it changes, not what the mesh holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::convert::{self, Address};
use super::proto::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use crate::rbac::Authorization;
use crate::state::{MeshIndex, Rank, Service, SharedState, StateError, Workload};

/// One resource of a response: name, version, encoded message.
pub struct Incoming<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub bytes: &'a [u8],
}

/// A resource as held: its version, its rank in the index, the converted value.
struct Held<T> {
    version: String,
    rank: Rank,
    value: Arc<T>,
}

/// When each resource was first received (a counter): on a conflict over an IP, VIP or
/// hostname the older one keeps it, whatever the names sort as.
#[derive(Default)]
struct Ages {
    first_seen: HashMap<String, u64>,
    next: u64,
}

impl Ages {
    fn of(&mut self, name: &str) -> u64 {
        if let Some(age) = self.first_seen.get(name) {
            return *age;
        }
        self.next += 1;
        self.first_seen.insert(name.to_string(), self.next);
        self.next
    }

    fn forget(&mut self, name: &str) {
        self.first_seen.remove(name);
    }
}

#[derive(Default)]
struct Resources {
    workloads: BTreeMap<String, Held<Workload>>,
    services: BTreeMap<String, Held<Service>>,
    policies: BTreeMap<String, Held<Authorization>>,
    address_ages: Ages,
    policy_ages: Ages,
    index: MeshIndex,
}

impl Resources {
    /// Takes out the address resource `name`, whichever kind it was.
    fn remove_address(&mut self, name: &str, conflicts: &mut Vec<StateError>) {
        if let Some(h) = self.workloads.remove(name) {
            self.index.remove_workload(h.rank, &h.value, conflicts);
        }
        if let Some(h) = self.services.remove(name) {
            self.index.remove_service(h.rank, &h.value, conflicts);
        }
    }
}

pub struct Store {
    state: Arc<SharedState>,
    resources: Mutex<Resources>,
}

impl Store {
    pub fn new(state: Arc<SharedState>) -> Store {
        Store {
            state,
            resources: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Resources> {
        self.resources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one response: upserts and removals. An address that doesn't decode or
    /// convert is left out (its previous version, if any, stays); an authorization that
    /// doesn't is replaced by a deny-all in its scope. The errors are returned for the
    /// NACK. Unknown types are an error as a whole.
    pub fn apply(
        &self,
        type_url: &str,
        resources: &[Incoming<'_>],
        removed: &[String],
    ) -> Vec<String> {
        let mut errors = Vec::new();
        let mut conflicts = Vec::new();
        let state = {
            let mut r = self.lock();
            let r = &mut *r;
            match type_url {
                ADDRESS_TYPE => {
                    for name in removed {
                        r.remove_address(name, &mut conflicts);
                        r.address_ages.forget(name);
                    }
                    for res in resources {
                        match convert::decode_address(res.bytes) {
                            Ok(Address::Workload(w)) => {
                                r.remove_address(res.name, &mut conflicts);
                                let rank = Rank {
                                    precedence: w.precedence(),
                                    age: r.address_ages.of(res.name),
                                };
                                let value = Arc::new(w);
                                r.index.insert_workload(rank, value.clone(), &mut conflicts);
                                r.workloads.insert(
                                    res.name.to_string(),
                                    Held {
                                        version: res.version.to_string(),
                                        rank,
                                        value,
                                    },
                                );
                            }
                            Ok(Address::Service(s)) => {
                                r.remove_address(res.name, &mut conflicts);
                                let rank = Rank {
                                    precedence: s.precedence(),
                                    age: r.address_ages.of(res.name),
                                };
                                let value = Arc::new(s);
                                r.index.insert_service(rank, value.clone(), &mut conflicts);
                                r.services.insert(
                                    res.name.to_string(),
                                    Held {
                                        version: res.version.to_string(),
                                        rank,
                                        value,
                                    },
                                );
                            }
                            Err(e) => errors.push(format!("{}: {e}", res.name)),
                        }
                    }
                }
                AUTHORIZATION_TYPE => {
                    for name in removed {
                        if let Some(h) = r.policies.remove(name) {
                            r.index.remove_policy(h.rank, &h.value);
                        }
                        r.policy_ages.forget(name);
                    }
                    for res in resources {
                        // A policy that doesn't convert is NACKed, as any resource, but
                        // never just left out (nor left at its previous version): a
                        // deny-all takes its place in its scope.
                        let (p, error) = convert::authorization_or_deny_all(res.name, res.bytes);
                        if let Some(e) = error {
                            tracing::error!(policy = %p.key(), scope = ?p.scope, dry_run = p.dry_run, error = %e,
                                "authorization cannot be enforced exactly; denying every connection in its scope instead");
                            errors.push(format!("{}: {e}", res.name));
                        }
                        if let Some(h) = r.policies.remove(res.name) {
                            r.index.remove_policy(h.rank, &h.value);
                        }
                        let rank = Rank {
                            precedence: 0,
                            age: r.policy_ages.of(res.name),
                        };
                        let value = Arc::new(p);
                        r.index.insert_policy(rank, value.clone());
                        r.policies.insert(
                            res.name.to_string(),
                            Held {
                                version: res.version.to_string(),
                                rank,
                                value,
                            },
                        );
                    }
                }
                other => {
                    errors.push(format!("unsupported type {other:?}"));
                    return errors;
                }
            }
            r.index.snapshot()
        };
        for c in conflicts {
            tracing::warn!(conflict = %c, "istiod's state overlaps; the Kubernetes or older entry keeps the address");
        }
        self.state.store(state);
        errors
    }

    /// What we hold of a type, for `initial_resource_versions` after a reconnect.
    pub fn versions(&self, type_url: &str) -> HashMap<String, String> {
        let r = self.lock();
        let pairs: Vec<(&String, &String)> = match type_url {
            ADDRESS_TYPE => r
                .workloads
                .iter()
                .map(|(n, h)| (n, &h.version))
                .chain(r.services.iter().map(|(n, h)| (n, &h.version)))
                .collect(),
            AUTHORIZATION_TYPE => r.policies.iter().map(|(n, h)| (n, &h.version)).collect(),
            _ => Vec::new(),
        };
        pairs
            .into_iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect()
    }

    /// How many policies are deny-alls standing in for ones that did not convert.
    pub fn unenforceable_policies(&self) -> usize {
        self.lock()
            .policies
            .values()
            .filter(|h| h.value.unenforceable.is_some())
            .count()
    }

    /// How many resources of each kind are held (workloads, services, policies).
    pub fn counts(&self) -> (usize, usize, usize) {
        let r = self.lock();
        (r.workloads.len(), r.services.len(), r.policies.len())
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::xds::proto::istio::workload as pb;

    fn workload(uid: &str, sa: &str, ip: [u8; 4]) -> Vec<u8> {
        let w = pb::Workload {
            uid: uid.into(),
            name: sa.into(),
            namespace: "default".into(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            service_account: sa.into(),
            node: "node1".into(),
            ..Default::default()
        };
        pb::Address {
            r#type: Some(pb::address::Type::Workload(w)),
        }
        .encode_to_vec()
    }

    fn service(name: &str, namespace: &str, hostname: &str, vip: [u8; 4]) -> Vec<u8> {
        let s = pb::Service {
            name: name.into(),
            namespace: namespace.into(),
            hostname: hostname.into(),
            addresses: vec![pb::NetworkAddress {
                network: String::new(),
                address: vip.to_vec(),
                length: None,
            }],
            ..Default::default()
        };
        pb::Address {
            r#type: Some(pb::address::Type::Service(s)),
        }
        .encode_to_vec()
    }

    fn push(store: &Store, name: &str, bytes: &[u8]) {
        let errors = store.apply(
            ADDRESS_TYPE,
            &[Incoming {
                name,
                version: "1",
                bytes,
            }],
            &[],
        );
        assert!(errors.is_empty(), "{errors:?}");
    }

    fn owner_of_ip(store: &Store, ip: [u8; 4]) -> String {
        store
            .state
            .load()
            .workload_by_ip("", ip.into())
            .map(|w| w.uid.0.clone())
            .unwrap_or_default()
    }

    fn owner_of_vip(store: &Store, ip: [u8; 4]) -> String {
        store
            .state
            .load()
            .service_by_vip("", ip.into())
            .map(|s| s.namespaced_hostname().0)
            .unwrap_or_default()
    }

    #[test]
    fn a_later_or_weaker_resource_never_takes_an_address() {
        let store = Store::new(Arc::new(SharedState::default()));
        let pod = "Kubernetes//Pod/prod/db-0";
        // A WorkloadEntry in a namespace that sorts first claims the pod's IP.
        push(&store, pod, &workload(pod, "db", [10, 10, 2, 11]));
        let we = "Kubernetes/networking.istio.io/WorkloadEntry/aaa/fake";
        push(&store, we, &workload(we, "attacker", [10, 10, 2, 11]));
        assert_eq!(owner_of_ip(&store, [10, 10, 2, 11]), pod);
        // Even if the WorkloadEntry was there first, the pod wins.
        let ip2 = [10, 10, 2, 12];
        let we2 = "Kubernetes/networking.istio.io/WorkloadEntry/aaa/early";
        push(&store, we2, &workload(we2, "attacker", ip2));
        let pod2 = "Kubernetes//Pod/prod/db-1";
        push(&store, pod2, &workload(pod2, "db", ip2));
        assert_eq!(owner_of_ip(&store, ip2), pod2);
        // Two pods on one IP (a reused address whose removal is late): the older keeps it,
        // though the newer one's name sorts first.
        let ip3 = [10, 10, 2, 13];
        push(
            &store,
            "Kubernetes//Pod/zzz/old",
            &workload("Kubernetes//Pod/zzz/old", "old", ip3),
        );
        push(
            &store,
            "Kubernetes//Pod/aaa/new",
            &workload("Kubernetes//Pod/aaa/new", "new", ip3),
        );
        assert_eq!(owner_of_ip(&store, ip3), "Kubernetes//Pod/zzz/old");
        // Once the old one is removed, the new one has it.
        store.apply(ADDRESS_TYPE, &[], &["Kubernetes//Pod/zzz/old".to_string()]);
        assert_eq!(owner_of_ip(&store, ip3), "Kubernetes//Pod/aaa/new");

        // A ServiceEntry (in a namespace sorting first) claiming a Kubernetes Service's VIP.
        let vip = [10, 96, 0, 10];
        push(
            &store,
            "prod/db.prod.svc.cluster.local",
            &service("db", "prod", "db.prod.svc.cluster.local", vip),
        );
        push(
            &store,
            "aaa/db.example.com",
            &service("db-se", "aaa", "db.example.com", vip),
        );
        assert_eq!(owner_of_vip(&store, vip), "prod/db.prod.svc.cluster.local");
        // ... or arriving first, with a svc name of another namespace.
        let vip2 = [10, 96, 0, 11];
        push(
            &store,
            "aaa/web.prod.svc.cluster.local",
            &service("fake", "aaa", "web.prod.svc.cluster.local", vip2),
        );
        push(
            &store,
            "prod/web.prod.svc.cluster.local",
            &service("web", "prod", "web.prod.svc.cluster.local", vip2),
        );
        assert_eq!(
            owner_of_vip(&store, vip2),
            "prod/web.prod.svc.cluster.local"
        );
    }
}

#[cfg(test)]
mod policy_tests {
    use prost::Message;

    use super::*;
    use crate::rbac::{Connection, Decision, DenyReason, PolicyAction, PolicyScope};
    use crate::xds::proto::istio::security as pb_sec;

    fn push(store: &Store, name: &str, bytes: Vec<u8>) -> Vec<String> {
        store.apply(
            AUTHORIZATION_TYPE,
            &[Incoming {
                name,
                version: "1",
                bytes: &bytes,
            }],
            &[],
        )
    }

    fn bad_port_policy(name: &str, action: pb_sec::Action, scope: i32) -> Vec<u8> {
        pb_sec::Authorization {
            name: name.into(),
            namespace: "default".into(),
            scope,
            action: action as i32,
            rules: vec![pb_sec::Rule {
                clauses: vec![pb_sec::Clause {
                    matches: vec![pb_sec::Match {
                        destination_ports: vec![70000],
                        ..Default::default()
                    }],
                }],
            }],
            dry_run: false,
        }
        .encode_to_vec()
    }

    fn workload(namespace: &str, policies: &[&str]) -> Workload {
        serde_yaml::from_str(&format!(
            "{{uid: {namespace}-w, name: w, namespace: {namespace}, workloadIps: [10.0.0.2], authorizationPolicies: {policies:?}}}"
        ))
        .unwrap()
    }

    fn decide(state: &SharedState, wl: &Workload) -> Decision {
        let conn = Connection {
            src_identity: "spiffe://cluster.local/ns/default/sa/sleep"
                .parse()
                .ok()
                .map(std::sync::Arc::new),
            src_ip: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2:80".parse().unwrap(),
        };
        state.load().authorize(wl, &conn)
    }

    #[test]
    fn an_unconvertible_policy_denies_everything_in_its_scope() {
        let shared = Arc::new(SharedState::default());
        let store = Store::new(shared.clone());
        let (default, other) = (workload("default", &[]), workload("other", &[]));
        assert_eq!(decide(&shared, &default), Decision::Allow);

        // An ALLOW we cannot convert (a port that is no port) is NACKed, and in its place
        // a deny-all covers its namespace: dropping it would have allowed everything.
        let errors = push(
            &store,
            "default/allow-sleep",
            bad_port_policy(
                "allow-sleep",
                pb_sec::Action::Allow,
                pb_sec::Scope::Namespace as i32,
            ),
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("destination_ports"), "{errors:?}");
        assert_eq!(
            decide(&shared, &default),
            Decision::Deny(DenyReason::DenyPolicy("default/allow-sleep".into()))
        );
        assert_eq!(
            decide(&shared, &other),
            Decision::Allow,
            "other namespaces are out of its scope"
        );
        let st = shared.load();
        let p = st.policies().next().unwrap();
        assert_eq!(
            (p.action, p.scope, p.dry_run),
            (PolicyAction::Deny, PolicyScope::Namespace, false)
        );
        assert!(
            p.unenforceable
                .as_deref()
                .is_some_and(|r| r.contains("destination_ports")),
            "{p:?}"
        );
        assert_eq!(store.unenforceable_policies(), 1);

        // The fixed version replaces it.
        let good = pb_sec::Authorization {
            name: "allow-sleep".into(),
            namespace: "default".into(),
            scope: pb_sec::Scope::Namespace as i32,
            rules: vec![pb_sec::Rule::default()],
            ..Default::default()
        };
        assert!(push(&store, "default/allow-sleep", good.encode_to_vec()).is_empty());
        assert_eq!(decide(&shared, &default), Decision::Allow);
        assert_eq!(store.unenforceable_policies(), 0);

        // A selector policy: deny-all for the workloads it selects only.
        push(
            &store,
            "default/sel",
            bad_port_policy(
                "sel",
                pb_sec::Action::Deny,
                pb_sec::Scope::WorkloadSelector as i32,
            ),
        );
        assert!(matches!(
            decide(&shared, &workload("default", &["default/sel"])),
            Decision::Deny(_)
        ));
        assert_eq!(decide(&shared, &default), Decision::Allow);
        store.apply(AUTHORIZATION_TYPE, &[], &["default/sel".to_string()]);

        // Scope unknown (an undecodable resource, a scope we don't know): everything.
        assert!(!push(
            &store,
            "default/garbage",
            vec![0x12, 0x03, 0xff, 0xff, 0xff]
        )
        .is_empty());
        assert!(
            matches!(decide(&shared, &other), Decision::Deny(DenyReason::DenyPolicy(p)) if p == "default/garbage")
        );
        store.apply(AUTHORIZATION_TYPE, &[], &["default/garbage".to_string()]);
        assert_eq!(decide(&shared, &other), Decision::Allow);
        push(
            &store,
            "default/future",
            bad_port_policy("future", pb_sec::Action::Allow, 7),
        );
        assert!(matches!(decide(&shared, &other), Decision::Deny(_)));
    }

    #[test]
    fn an_unconvertible_dry_run_policy_stays_dry_run() {
        let shared = Arc::new(SharedState::default());
        let store = Store::new(shared.clone());
        let mut a = pb_sec::Authorization::decode(
            &bad_port_policy("dry", pb_sec::Action::Deny, pb_sec::Scope::Namespace as i32)[..],
        )
        .unwrap();
        a.dry_run = true;
        assert!(!push(&store, "default/dry", a.encode_to_vec()).is_empty());
        assert_eq!(
            shared.load().policies().count(),
            1,
            "kept, as a dry-run deny-all"
        );
        assert_eq!(decide(&shared, &workload("default", &[])), Decision::Allow);
    }
}
