//! Istio ztunnel's `istio_on_demand_dns_total`: connections routed to a workload known only
//! by hostname (a DNS-resolved ServiceEntry endpoint), which needed its name resolved,
//! with Istio's labels (the source pod's and the hostname). Label values come from mesh
//! config only (the local pod and the workload's hostname), so the series stay bounded
//! by the config.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::state::Workload;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OnDemandDnsLabels {
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub hostname: String,
}

impl OnDemandDnsLabels {
    pub fn new(src: &Workload, hostname: &str) -> OnDemandDnsLabels {
        let or_unknown = |s: &str| {
            if s.is_empty() {
                "unknown".to_string()
            } else {
                s.to_string()
            }
        };
        // Named as the TCP metrics name the same pod (workload name, else the pod's).
        let workload = if src.workload_name.is_empty() {
            &src.name
        } else {
            &src.workload_name
        };
        OnDemandDnsLabels {
            source_workload: or_unknown(workload),
            source_canonical_service: or_unknown(&src.canonical_name),
            source_canonical_revision: or_unknown(&src.canonical_revision),
            source_workload_namespace: or_unknown(&src.namespace),
            source_principal: src.identity().to_string(),
            // Istio fills app and version from the canonical service and revision.
            source_app: or_unknown(&src.canonical_name),
            source_version: or_unknown(&src.canonical_revision),
            source_cluster: or_unknown(&src.cluster_id),
            hostname: or_unknown(hostname),
        }
    }
}

#[derive(Clone, Default)]
pub struct OnDemandDnsMetrics {
    requests: Family<OnDemandDnsLabels, Counter>,
}

impl OnDemandDnsMetrics {
    pub fn register(registry: &mut Registry) -> OnDemandDnsMetrics {
        let m = OnDemandDnsMetrics::default();
        // The text encoder appends `_total`.
        registry.register(
            "istio_on_demand_dns",
            "The total number of requests that used on-demand DNS (unstable)",
            m.requests.clone(),
        );
        m
    }

    /// A connection from `src` that needed `hostname` resolved.
    pub fn request(&self, src: &Workload, hostname: &str) {
        self.requests
            .get_or_create(&OnDemandDnsLabels::new(src, hostname))
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istio_name_and_labels() {
        let mut r = Registry::default();
        let m = OnDemandDnsMetrics::register(&mut r);
        let src = Workload {
            canonical_name: "sleep".into(),
            cluster_id: "c1".into(),
            ..Workload::new("u", "sleep-1", "default")
        };
        m.request(&src, "api.example.com");
        m.request(&src, "api.example.com");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        let want = "istio_on_demand_dns_total{source_workload=\"sleep-1\",source_canonical_service=\"sleep\",\
source_canonical_revision=\"unknown\",source_workload_namespace=\"default\",\
source_principal=\"spiffe://cluster.local/ns/default/sa/default\",source_app=\"sleep\",source_version=\"unknown\",\
source_cluster=\"c1\",hostname=\"api.example.com\"} 2";
        assert!(text.contains(want), "{text}");
    }
}
