//! Workload labels, which DestinationRule subsets select endpoints by. Istio's workload
//! xDS carries none, so the waypoint keeps its own: from the local config file (the
//! workloads' `labels`), or in a cluster from the Pods' metadata (a watch, see `k8s`),
//! by workload uid (`<cluster>//Pod/<namespace>/<name>`). A workload whose labels are
//! not known is in no subset: a subset route to it fails rather than reach a pod the
//! subset may not mean.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use serde::Deserialize;
use ztunnel::state::WorkloadUid;

pub type LabelSet = BTreeMap<String, String>;

/// Labels by workload uid, shared by every config snapshot of a cluster waypoint (the Pod
/// watch updates them in place).
#[derive(Debug, Default)]
pub struct Labels {
    by_uid: RwLock<HashMap<WorkloadUid, Arc<LabelSet>>>,
}

impl Labels {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<WorkloadUid, Arc<LabelSet>>> {
        self.by_uid.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<WorkloadUid, Arc<LabelSet>>> {
        self.by_uid.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the workload's labels include every one of `selector`'s (an empty selector
    /// takes every workload, labels known or not).
    pub fn selects(&self, uid: &WorkloadUid, selector: &LabelSet) -> bool {
        if selector.is_empty() {
            return true;
        }
        let all = self.read();
        let Some(have) = all.get(uid) else {
            return false;
        };
        selector.iter().all(|(k, v)| have.get(k) == Some(v))
    }

    pub fn set(&self, uid: WorkloadUid, labels: LabelSet) {
        self.write().insert(uid, Arc::new(labels));
    }

    pub fn remove(&self, uid: &WorkloadUid) {
        self.write().remove(uid);
    }

    /// Replaces them all (a watch's relist).
    pub fn replace(&self, all: HashMap<WorkloadUid, Arc<LabelSet>>) {
        *self.write() = all;
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The labels the local config file gives its workloads.
    pub fn from_file(text: &str) -> Result<Labels, serde_yaml::Error> {
        #[derive(Deserialize)]
        struct File {
            #[serde(default)]
            workloads: Vec<Labelled>,
        }
        #[derive(Deserialize)]
        struct Labelled {
            uid: String,
            #[serde(default)]
            labels: LabelSet,
        }
        let f: File = serde_yaml::from_str(text)?;
        let by_uid = f
            .workloads
            .into_iter()
            .filter(|w| !w.labels.is_empty())
            .map(|w| (WorkloadUid(w.uid), Arc::new(w.labels)))
            .collect();
        Ok(Labels {
            by_uid: RwLock::new(by_uid),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selector_needs_all_its_labels() {
        let l = Labels::from_file("workloads:\n- {uid: a, name: a, namespace: d, labels: {app: web, version: v1}}\n- {uid: b, name: b, namespace: d}\n").unwrap();
        let sel = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<LabelSet>()
        };
        let (a, b) = (WorkloadUid("a".into()), WorkloadUid("b".into()));
        assert!(
            l.selects(&a, &sel(&[("version", "v1")]))
                && l.selects(&a, &sel(&[("app", "web"), ("version", "v1")]))
        );
        assert!(
            !l.selects(&a, &sel(&[("version", "v2")]))
                && !l.selects(&a, &sel(&[("version", "v1"), ("tier", "x")]))
        );
        assert!(
            !l.selects(&b, &sel(&[("version", "v1")])),
            "labels not known: in no subset"
        );
        assert!(
            l.selects(&b, &LabelSet::new()),
            "an empty selector takes everything"
        );
        l.set(b.clone(), sel(&[("version", "v1")]));
        assert!(l.selects(&b, &sel(&[("version", "v1")])));
        l.remove(&b);
        assert!(!l.selects(&b, &sel(&[("version", "v1")])));
    }
}
