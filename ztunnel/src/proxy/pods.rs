//! The pods enrolled on this node, by workload uid, whoever enrolled them (the `--pod`
//! list at start, the CNI agent over ZDS).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Mutex;

use super::lifecycle::EnrolledPod;
use crate::capture;
use crate::netns::InPodNetns;
use crate::state::WorkloadUid;

/// The enrolled pods; clones share them.
#[derive(Clone, Default)]
pub struct Pods(Arc<Mutex<HashMap<WorkloadUid, EnrolledPod>>>);

impl Pods {
    pub async fn contains(&self, uid: &WorkloadUid) -> bool {
        self.0.lock().await.contains_key(uid)
    }

    /// For an enrolled pod, whether it was enrolled in `netns`; None if not enrolled.
    pub async fn enrolled_in(&self, uid: &WorkloadUid, netns: &InPodNetns) -> Option<bool> {
        self.0
            .lock()
            .await
            .get(uid)
            .map(|p| p.pod.netns.same_as(netns))
    }

    pub async fn insert(&self, uid: WorkloadUid, pod: EnrolledPod) {
        self.0.lock().await.insert(uid, pod);
    }

    /// Takes the pod out of the registry; the caller removes it (`EnrolledPod::remove`).
    pub async fn take(&self, uid: &WorkloadUid) -> Option<EnrolledPod> {
        self.0.lock().await.remove(uid)
    }

    pub async fn uids(&self) -> Vec<WorkloadUid> {
        self.0.lock().await.keys().cloned().collect()
    }

    pub async fn count(&self) -> usize {
        self.0.lock().await.len()
    }

    /// Drops the capture state left for pods that are not enrolled here (removed while
    /// no ztunnel ran), once the list of enrolled pods is complete.
    pub async fn retain_capture(&self, capture: &capture::Backend) {
        let pods = self.0.lock().await;
        let netns: Vec<&InPodNetns> = pods.values().map(|p| &p.pod.netns).collect();
        capture.retain(&netns);
    }
}
