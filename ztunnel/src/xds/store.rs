//! The resources istiod has sent, by name and version, and the mesh state built from
//! them. Every applied response rebuilds the state and swaps it in whole, so a
//! connection always sees one consistent version.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::convert::{self, Address};
use super::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use crate::rbac::Authorization;
use crate::state::{MeshState, Service, SharedState, Workload};

/// One resource of a response: name, version, encoded message.
pub struct Incoming<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub bytes: &'a [u8],
}

#[derive(Default)]
struct Resources {
    workloads: BTreeMap<String, (String, Workload)>,
    services: BTreeMap<String, (String, Service)>,
    policies: BTreeMap<String, (String, Authorization)>,
}

pub struct Store {
    state: Arc<SharedState>,
    resources: Mutex<Resources>,
}

impl Store {
    pub fn new(state: Arc<SharedState>) -> Store {
        Store { state, resources: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Resources> {
        self.resources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one response: upserts and removals. A resource that doesn't decode or
    /// convert is left out (its previous version, if any, stays); the errors are returned
    /// for the NACK. Unknown types are an error as a whole.
    pub fn apply(&self, type_url: &str, resources: &[Incoming<'_>], removed: &[String]) -> Vec<String> {
        let mut errors = Vec::new();
        {
            let mut r = self.lock();
            match type_url {
                ADDRESS_TYPE => {
                    for name in removed {
                        r.workloads.remove(name);
                        r.services.remove(name);
                    }
                    for res in resources {
                        match convert::decode_address(res.bytes) {
                            Ok(Address::Workload(w)) => {
                                r.services.remove(res.name);
                                r.workloads.insert(res.name.to_string(), (res.version.to_string(), w));
                            }
                            Ok(Address::Service(s)) => {
                                r.workloads.remove(res.name);
                                r.services.insert(res.name.to_string(), (res.version.to_string(), s));
                            }
                            Err(e) => errors.push(format!("{}: {e}", res.name)),
                        }
                    }
                }
                AUTHORIZATION_TYPE => {
                    for name in removed {
                        r.policies.remove(name);
                    }
                    for res in resources {
                        match convert::decode_authorization(res.bytes) {
                            Ok(p) => {
                                r.policies.insert(res.name.to_string(), (res.version.to_string(), p));
                            }
                            Err(e) => errors.push(format!("{}: {e}", res.name)),
                        }
                    }
                }
                other => {
                    errors.push(format!("unsupported type {other:?}"));
                    return errors;
                }
            }
        }
        self.rebuild();
        errors
    }

    fn rebuild(&self) {
        let (state, conflicts) = {
            let r = self.lock();
            MeshState::build_lenient(
                r.workloads.values().map(|(_, w)| w.clone()).collect(),
                r.services.values().map(|(_, s)| s.clone()).collect(),
                r.policies.values().map(|(_, p)| p.clone()).collect(),
            )
        };
        for c in conflicts {
            tracing::warn!(conflict = %c, "istiod's state overlaps; the later entry wins");
        }
        self.state.store(state);
    }

    /// What we hold of a type, for `initial_resource_versions` after a reconnect.
    pub fn versions(&self, type_url: &str) -> HashMap<String, String> {
        let r = self.lock();
        let pairs: Vec<(&String, &String)> = match type_url {
            ADDRESS_TYPE => r.workloads.iter().map(|(n, (v, _))| (n, v)).chain(r.services.iter().map(|(n, (v, _))| (n, v))).collect(),
            AUTHORIZATION_TYPE => r.policies.iter().map(|(n, (v, _))| (n, v)).collect(),
            _ => Vec::new(),
        };
        pairs.into_iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    }

    /// How many resources of each kind are held (workloads, services, policies).
    pub fn counts(&self) -> (usize, usize, usize) {
        let r = self.lock();
        (r.workloads.len(), r.services.len(), r.policies.len())
    }
}
