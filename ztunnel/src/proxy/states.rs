//! Each pod proxy's state as the admin dump shows it (Istio's `workloadState`): pending
//! while its enrollment waits for the workload, up with its open connections once its
//! listeners run. A sync registry, so the dump never waits on an enrollment.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::pod::{InboundView, LocalPod, OutboundView};
use crate::state::WorkloadUid;

/// Who a pod proxy is for: Istio's `WorkloadInfo`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyInfo {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
}

/// One pod proxy's state at the time of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyStateView {
    pub uid: WorkloadUid,
    pub info: ProxyInfo,
    /// None while pending; the open connections once up.
    pub connections: Option<(Vec<InboundView>, Vec<OutboundView>)>,
}

struct Entry {
    info: ProxyInfo,
    /// Enrollments waiting for the workload.
    pending: usize,
    /// Running proxies by id (two for a moment while a re-added pod's proxy is replaced).
    up: Vec<(u64, LocalPod)>,
}

#[derive(Default)]
pub struct WorkloadStates {
    next: std::sync::atomic::AtomicU64,
    entries: Mutex<HashMap<WorkloadUid, Entry>>,
}

/// Keeps a pod listed as pending; dropping it unlists it unless a proxy is up.
pub struct PendingGuard {
    states: Arc<WorkloadStates>,
    uid: WorkloadUid,
}

/// Keeps a pod proxy listed as up; dropping it unlists it.
pub struct UpGuard {
    states: Arc<WorkloadStates>,
    uid: WorkloadUid,
    id: u64,
}

impl WorkloadStates {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<WorkloadUid, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn entry<'a>(
        map: &'a mut HashMap<WorkloadUid, Entry>,
        uid: &WorkloadUid,
        info: ProxyInfo,
    ) -> &'a mut Entry {
        map.entry(uid.clone()).or_insert_with(|| Entry {
            info,
            pending: 0,
            up: Vec::new(),
        })
    }

    pub fn pending(self: &Arc<Self>, uid: &WorkloadUid, info: ProxyInfo) -> PendingGuard {
        Self::entry(&mut self.lock(), uid, info).pending += 1;
        PendingGuard {
            states: self.clone(),
            uid: uid.clone(),
        }
    }

    pub fn up(self: &Arc<Self>, pod: &LocalPod) -> UpGuard {
        let w = &pod.workload;
        let info = ProxyInfo {
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            service_account: w.service_account.clone(),
        };
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self.lock();
        let e = Self::entry(&mut map, &w.uid, info.clone());
        e.info = info;
        e.up.push((id, pod.clone()));
        UpGuard {
            states: self.clone(),
            uid: w.uid.clone(),
            id,
        }
    }

    fn settle(map: &mut HashMap<WorkloadUid, Entry>, uid: &WorkloadUid) {
        if map
            .get(uid)
            .is_some_and(|e| e.pending == 0 && e.up.is_empty())
        {
            map.remove(uid);
        }
    }

    /// Every pod proxy, by uid; an up proxy shows the newest instance's connections.
    pub fn snapshot(&self) -> Vec<ProxyStateView> {
        let map = self.lock();
        let mut out: Vec<ProxyStateView> = map
            .iter()
            .map(|(uid, e)| ProxyStateView {
                uid: uid.clone(),
                info: e.info.clone(),
                connections: e
                    .up
                    .last()
                    .map(|(_, pod)| (pod.inbound.snapshot(), pod.outbound.snapshot())),
            })
            .collect();
        out.sort_by(|a, b| a.uid.cmp(&b.uid));
        out
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        let mut map = self.states.lock();
        if let Some(e) = map.get_mut(&self.uid) {
            e.pending = e.pending.saturating_sub(1);
        }
        WorkloadStates::settle(&mut map, &self.uid);
    }
}

impl Drop for UpGuard {
    fn drop(&mut self) {
        let mut map = self.states.lock();
        if let Some(e) = map.get_mut(&self.uid) {
            e.up.retain(|(id, _)| *id != self.id);
        }
        WorkloadStates::settle(&mut map, &self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> LocalPod {
        let mut w = crate::state::Workload::new(uid, "a", "ns");
        w.service_account = "sa".into();
        LocalPod {
            identity: w.identity(),
            ips: crate::state::PodIps {
                v4: Some("10.0.0.1".parse().unwrap()),
                v6: None,
            },
            workload: Arc::new(w),
            netns: crate::netns::InPodNetns::open(std::path::Path::new("/proc/self/ns/net"))
                .unwrap(),
            active: Default::default(),
            inbound: Default::default(),
            outbound: Default::default(),
        }
    }

    #[test]
    fn pending_then_up_then_gone() {
        let states = Arc::new(WorkloadStates::default());
        let uid = WorkloadUid("u1".into());
        let pending = states.pending(
            &uid,
            ProxyInfo {
                name: "a".into(),
                ..Default::default()
            },
        );
        let snap = states.snapshot();
        assert_eq!(snap.len(), 1);
        assert!(snap[0].connections.is_none(), "pending");
        let p = pod("u1");
        let up = states.up(&p);
        drop(pending);
        let _conn = p.outbound.register(OutboundView {
            src: "10.0.0.1:4000".parse().unwrap(),
            original_dst: "10.96.0.1:80".parse().unwrap(),
            actual_dst: "10.0.0.2:15008".parse().unwrap(),
            protocol: crate::state::Protocol::HBONE,
        });
        let snap = states.snapshot();
        let (inbound, outbound) = snap[0].connections.clone().expect("up");
        assert!(inbound.is_empty());
        assert_eq!(outbound.len(), 1);
        assert_eq!(
            snap[0].info.service_account, "sa",
            "the workload's own info once up"
        );
        drop(up);
        assert!(states.snapshot().is_empty());
    }

    #[test]
    fn a_replaced_proxy_stays_up_until_the_last_instance_goes() {
        let states = Arc::new(WorkloadStates::default());
        let (old, new) = (pod("u1"), pod("u1"));
        let old_up = states.up(&old);
        let new_up = states.up(&new);
        drop(old_up);
        assert!(states.snapshot()[0].connections.is_some());
        // A failed enrollment's pending mark does not unlist the running proxy.
        drop(states.pending(&WorkloadUid("u1".into()), ProxyInfo::default()));
        assert_eq!(states.snapshot().len(), 1);
        drop(new_up);
        assert!(states.snapshot().is_empty());
    }
}
