//! Istio's TCP metric labels, and the bound on label sets per metric family.

use prometheus_client::encoding::EncodeLabelSet;

use crate::baggage::Baggage;
use crate::identity::Identity;
use crate::state::{Service, Workload};

/// Label sets kept per metric family (TCP and HTTP); more are folded into an overflow set.
pub const MAX_SERIES: usize = 10_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    pub reporter: &'static str,
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub destination_workload: String,
    pub destination_canonical_service: String,
    pub destination_canonical_revision: String,
    pub destination_workload_namespace: String,
    pub destination_principal: String,
    pub destination_app: String,
    pub destination_version: String,
    pub destination_cluster: String,
    pub destination_service: String,
    pub destination_service_name: String,
    pub destination_service_namespace: String,
    pub request_protocol: &'static str,
    pub response_flags: &'static str,
    pub connection_security_policy: &'static str,
    pub source_region: String,
    pub source_zone: String,
    pub destination_region: String,
    pub destination_zone: String,
}

const UNKNOWN: &str = "unknown";

fn or_unknown(s: &str) -> String {
    if s.is_empty() {
        UNKNOWN.to_string()
    } else {
        s.to_string()
    }
}

/// One side of a connection as the labels describe it.
#[derive(Default)]
pub struct Peer<'a> {
    pub workload: Option<&'a Workload>,
    /// The mTLS identity, when there is one (it may exist for a peer not in config).
    pub identity: Option<&'a Identity>,
}

impl TcpLabels {
    pub fn new(
        reporter: &'static str,
        src: Peer<'_>,
        dst: Peer<'_>,
        service: Option<&Service>,
        mtls: bool,
    ) -> TcpLabels {
        let wl = |p: &Peer<'_>, f: fn(&Workload) -> &str| {
            p.workload
                .map(|w| or_unknown(f(w)))
                .unwrap_or_else(|| UNKNOWN.into())
        };
        // Only a verified identity names a principal; a config entry alone does not.
        let principal = |p: &Peer<'_>| {
            p.identity
                .map(|i| i.to_string())
                .unwrap_or_else(|| UNKNOWN.into())
        };
        TcpLabels {
            reporter,
            source_workload: wl(&src, |w| {
                if w.workload_name.is_empty() {
                    &w.name
                } else {
                    &w.workload_name
                }
            }),
            source_canonical_service: wl(&src, |w| &w.canonical_name),
            source_canonical_revision: wl(&src, |w| &w.canonical_revision),
            source_workload_namespace: wl(&src, |w| &w.namespace),
            source_principal: principal(&src),
            // Istio's app/version are the canonical service and revision.
            source_app: wl(&src, |w| &w.canonical_name),
            source_version: wl(&src, |w| &w.canonical_revision),
            source_cluster: wl(&src, |w| &w.cluster_id),
            destination_workload: wl(&dst, |w| {
                if w.workload_name.is_empty() {
                    &w.name
                } else {
                    &w.workload_name
                }
            }),
            destination_canonical_service: wl(&dst, |w| &w.canonical_name),
            destination_canonical_revision: wl(&dst, |w| &w.canonical_revision),
            destination_workload_namespace: wl(&dst, |w| &w.namespace),
            destination_principal: principal(&dst),
            destination_app: wl(&dst, |w| &w.canonical_name),
            destination_version: wl(&dst, |w| &w.canonical_revision),
            destination_cluster: wl(&dst, |w| &w.cluster_id),
            destination_service: service
                .map(|s| s.hostname.clone())
                .unwrap_or_else(|| UNKNOWN.into()),
            destination_service_name: service
                .map(|s| s.name.clone())
                .unwrap_or_else(|| UNKNOWN.into()),
            destination_service_namespace: service
                .map(|s| s.namespace.clone())
                .unwrap_or_else(|| UNKNOWN.into()),
            request_protocol: "tcp",
            response_flags: "-",
            connection_security_policy: if mtls { "mutual_tls" } else { UNKNOWN },
            source_region: wl(&src, |w| &w.locality.region),
            source_zone: wl(&src, |w| &w.locality.zone),
            destination_region: wl(&dst, |w| &w.locality.region),
            destination_zone: wl(&dst, |w| &w.locality.zone),
        }
    }
}

/// A field a peer's baggage carries, or `unknown`.
fn claimed(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| UNKNOWN.into())
}

impl TcpLabels {
    /// The source as its baggage describes it (Istio's `with_derived_source`), for a
    /// source config does not describe: every source label but the principal (the
    /// verified identity stays), `unknown` where the baggage says nothing. As Istio's,
    /// `source_app` is the workload name and `source_version` the revision.
    pub fn with_derived_source(&mut self, b: &Baggage) {
        self.source_workload = claimed(&b.workload_name);
        self.source_canonical_service = claimed(&b.service_name);
        self.source_canonical_revision = claimed(&b.revision);
        self.source_workload_namespace = claimed(&b.namespace);
        self.source_app = claimed(&b.workload_name);
        self.source_version = claimed(&b.revision);
        self.source_cluster = claimed(&b.cluster_id);
        self.source_region = claimed(&b.region);
        self.source_zone = claimed(&b.zone);
    }

    /// The destination as its response baggage describes it (Istio's
    /// `with_derived_destination`: behind an east-west gateway, where the labels were the
    /// gateway's): every destination label but the service ones, the principal being
    /// the identity the destination proved (`unknown` without one).
    pub fn with_derived_destination(&mut self, b: &Baggage, identity: Option<&Identity>) {
        self.destination_workload = claimed(&b.workload_name);
        self.destination_canonical_service = claimed(&b.service_name);
        self.destination_canonical_revision = claimed(&b.revision);
        self.destination_workload_namespace = claimed(&b.namespace);
        self.destination_principal = identity
            .map(|i| i.to_string())
            .unwrap_or_else(|| UNKNOWN.into());
        self.destination_app = claimed(&b.workload_name);
        self.destination_version = claimed(&b.revision);
        self.destination_cluster = claimed(&b.cluster_id);
        self.destination_region = claimed(&b.region);
        self.destination_zone = claimed(&b.zone);
    }
}

/// The labels of Istio's TCP metrics, by name.
pub const TCP_LABEL_NAMES: [&str; 27] = [
    "reporter",
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "destination_workload",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_cluster",
    "destination_service",
    "destination_service_name",
    "destination_service_namespace",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "source_region",
    "source_zone",
    "destination_region",
    "destination_zone",
];

impl TcpLabels {
    /// Empties the label `name` (false: it has none by that name). An empty label is the
    /// same series as one without it to Prometheus: this is how a Telemetry's tag
    /// removal (`tagOverrides: {x: {operation: REMOVE}}`) is exported.
    pub fn blank(&mut self, name: &str) -> bool {
        match name {
            "reporter" => self.reporter = "",
            "source_workload" => self.source_workload.clear(),
            "source_canonical_service" => self.source_canonical_service.clear(),
            "source_canonical_revision" => self.source_canonical_revision.clear(),
            "source_workload_namespace" => self.source_workload_namespace.clear(),
            "source_principal" => self.source_principal.clear(),
            "source_app" => self.source_app.clear(),
            "source_version" => self.source_version.clear(),
            "source_cluster" => self.source_cluster.clear(),
            "destination_workload" => self.destination_workload.clear(),
            "destination_canonical_service" => self.destination_canonical_service.clear(),
            "destination_canonical_revision" => self.destination_canonical_revision.clear(),
            "destination_workload_namespace" => self.destination_workload_namespace.clear(),
            "destination_principal" => self.destination_principal.clear(),
            "destination_app" => self.destination_app.clear(),
            "destination_version" => self.destination_version.clear(),
            "destination_cluster" => self.destination_cluster.clear(),
            "destination_service" => self.destination_service.clear(),
            "destination_service_name" => self.destination_service_name.clear(),
            "destination_service_namespace" => self.destination_service_namespace.clear(),
            "request_protocol" => self.request_protocol = "",
            "response_flags" => self.response_flags = "",
            "connection_security_policy" => self.connection_security_policy = "",
            "source_region" => self.source_region.clear(),
            "source_zone" => self.source_zone.clear(),
            "destination_region" => self.destination_region.clear(),
            "destination_zone" => self.destination_zone.clear(),
            _ => return false,
        }
        true
    }
}

/// The label sets in use by a group of families (by hash), to bound them at `MAX_SERIES`.
#[derive(Default)]
pub struct SeriesBound(std::sync::Mutex<std::collections::HashSet<u64>>);

impl SeriesBound {
    /// Whether `l` may have its own series: already in use, or there is room for one more.
    pub fn admit<L: std::hash::Hash>(&self, l: &L) -> bool {
        use std::hash::Hasher;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        l.hash(&mut h);
        let key = h.finish();
        let mut series = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if series.contains(&key) {
            return true;
        }
        if series.len() < MAX_SERIES {
            series.insert(key);
            return true;
        }
        false
    }
}

impl TcpLabels {
    /// The overflow set for `self`: every peer label `unknown`.
    pub fn overflow(&self) -> TcpLabels {
        let u = || UNKNOWN.to_string();
        TcpLabels {
            source_workload: u(),
            source_canonical_service: u(),
            source_canonical_revision: u(),
            source_workload_namespace: u(),
            source_principal: u(),
            source_app: u(),
            source_version: u(),
            source_cluster: u(),
            destination_workload: u(),
            destination_canonical_service: u(),
            destination_canonical_revision: u(),
            destination_workload_namespace: u(),
            destination_principal: u(),
            destination_app: u(),
            destination_version: u(),
            destination_cluster: u(),
            destination_service: u(),
            destination_service_name: u(),
            destination_service_namespace: u(),
            source_region: u(),
            source_zone: u(),
            destination_region: u(),
            destination_zone: u(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_peers_are_labelled_as_istios() {
        let client = Identity::new("cluster.local", "default", "client");
        let echo = Identity::new("cluster.local", "default", "echo");
        let gateway = Workload::new("gw", "eastwest", "istio-system");
        let mut l = TcpLabels::new(
            "source",
            Peer {
                workload: None,
                identity: Some(&client),
            },
            Peer {
                workload: Some(&gateway),
                identity: None,
            },
            None,
            true,
        );
        assert_eq!(l.destination_workload, "eastwest");
        let b = Baggage {
            cluster_id: Some("east".into()),
            namespace: Some("default".into()),
            workload_name: Some("echo".into()),
            service_name: Some("echo-svc".into()),
            revision: Some("v1".into()),
            region: Some("r1".into()),
            zone: None,
        };
        l.with_derived_destination(&b, Some(&echo));
        assert_eq!(
            (
                l.destination_workload.as_str(),
                l.destination_canonical_service.as_str(),
                l.destination_canonical_revision.as_str(),
                l.destination_workload_namespace.as_str(),
                l.destination_principal.as_str(),
                // Istio's derived app is the workload name, its version the revision.
                l.destination_app.as_str(),
                l.destination_version.as_str(),
                l.destination_cluster.as_str(),
                l.destination_region.as_str(),
                l.destination_zone.as_str(),
            ),
            (
                "echo",
                "echo-svc",
                "v1",
                "default",
                "spiffe://cluster.local/ns/default/sa/echo",
                "echo",
                "v1",
                "east",
                "r1",
                "unknown"
            )
        );
        // Nothing said, nothing proved: unknown (not the gateway).
        l.with_derived_destination(&Baggage::default(), None);
        assert_eq!(l.destination_workload, "unknown");
        assert_eq!(l.destination_principal, "unknown");
        // The source side: every label but the principal, which stays the verified one.
        l.with_derived_source(&b);
        assert_eq!(
            (
                l.source_workload.as_str(),
                l.source_canonical_service.as_str(),
                l.source_app.as_str(),
                l.source_cluster.as_str(),
                l.source_principal.as_str(),
            ),
            (
                "echo",
                "echo-svc",
                "echo",
                "east",
                "spiffe://cluster.local/ns/default/sa/client"
            )
        );
    }
}
