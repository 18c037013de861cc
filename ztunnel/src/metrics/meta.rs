//! Metrics about ztunnel itself, under Istio's names: `istio_build` and the pod
//! manager's `workload_manager_*` (the panels of Istio's ztunnel dashboard).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub component: String,
    pub tag: String,
}

/// `istio_build{component, tag} 1`.
#[derive(Clone, Default)]
pub struct Build(Family<BuildLabels, Gauge>);

impl Build {
    pub fn register(registry: &mut Registry) -> Build {
        let b = Build::default();
        registry.register("istio_build", "Istio component build info", b.0.clone());
        b.set_component("ztunnel");
        b
    }

    /// Names the binary reporting (`ztunnel`, `waypoint`).
    pub fn set_component(&self, component: &str) {
        self.0.clear();
        self.0
            .get_or_create(&BuildLabels {
                component: component.into(),
                tag: env!("CARGO_PKG_VERSION").into(),
            })
            .set(1);
    }
}

/// Pods with a running proxy, pods waiting for one, and proxies started and stopped.
#[derive(Clone, Default)]
pub struct WorkloadManager {
    active: Gauge,
    pending: Gauge,
    started: Counter,
    stopped: Counter,
}

impl WorkloadManager {
    pub fn register(registry: &mut Registry) -> WorkloadManager {
        let m = WorkloadManager::default();
        registry.register(
            "workload_manager_active_proxy_count",
            "Workloads with a running proxy",
            m.active.clone(),
        );
        registry.register(
            "workload_manager_pending_proxy_count",
            "Workloads whose proxy is being set up",
            m.pending.clone(),
        );
        registry.register(
            "workload_manager_proxies_started",
            "Proxies started",
            m.started.clone(),
        );
        registry.register(
            "workload_manager_proxies_stopped",
            "Proxies stopped",
            m.stopped.clone(),
        );
        m
    }

    /// A proxy started: counted active until the returned guard drops.
    pub fn started(&self) -> ActiveProxy {
        self.started.inc();
        self.active.inc();
        ActiveProxy(self.clone())
    }

    /// A pod waiting for its proxy, until the returned guard drops.
    pub fn pending(&self) -> PendingProxy {
        self.pending.inc();
        PendingProxy(self.pending.clone())
    }
}

pub struct ActiveProxy(WorkloadManager);

impl Drop for ActiveProxy {
    fn drop(&mut self) {
        self.0.active.dec();
        self.0.stopped.inc();
    }
}

pub struct PendingProxy(Gauge);

impl Drop for PendingProxy {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_and_workload_manager_as_istio_names_them() {
        let mut r = Registry::default();
        let b = Build::register(&mut r);
        let wm = WorkloadManager::register(&mut r);
        let p = wm.pending();
        let a = wm.started();
        let _b = wm.started();
        drop(p);
        drop(a);
        b.set_component("waypoint");
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        assert!(
            out.contains(&format!(
                "istio_build{{component=\"waypoint\",tag=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{out}"
        );
        assert!(!out.contains("component=\"ztunnel\""), "{out}");
        assert!(
            out.contains("workload_manager_active_proxy_count 1\n"),
            "{out}"
        );
        assert!(
            out.contains("workload_manager_pending_proxy_count 0\n"),
            "{out}"
        );
        assert!(
            out.contains("workload_manager_proxies_started_total 2\n"),
            "{out}"
        );
        assert!(
            out.contains("workload_manager_proxies_stopped_total 1\n"),
            "{out}"
        );
    }
}
