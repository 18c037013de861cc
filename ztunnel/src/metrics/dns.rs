//! Istio ztunnel's DNS proxy metrics: `istio_dns_requests_total`,
//! `istio_dns_upstream_requests_total`, `istio_dns_upstream_failures_total` and
//! `istio_dns_upstream_request_duration_seconds`, with Istio's labels. Every label has a
//! bounded set of values: the query type is one of a fixed list (anything else is
//! `other`), the protocol `udp` or `tcp`, and the source canonical service and revision
//! come from the mesh config of the pod that asked.

use hickory_proto::rr::RecordType;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::state::Workload;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsLabels {
    pub request_query_type: &'static str,
    pub request_protocol: &'static str,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
}

impl DnsLabels {
    pub fn new(
        query_type: RecordType,
        protocol: &'static str,
        source: Option<&Workload>,
    ) -> DnsLabels {
        let or_unknown = |s: &str| {
            if s.is_empty() {
                "unknown".to_string()
            } else {
                s.to_string()
            }
        };
        DnsLabels {
            request_query_type: query_type_label(query_type),
            request_protocol: protocol,
            source_canonical_service: source
                .map(|w| or_unknown(&w.canonical_name))
                .unwrap_or_else(|| "unknown".into()),
            source_canonical_revision: source
                .map(|w| or_unknown(&w.canonical_revision))
                .unwrap_or_else(|| "unknown".into()),
        }
    }
}

/// The query type as Istio labels it (lower case), from a fixed list so that clients
/// cannot mint new series with made-up types.
pub fn query_type_label(t: RecordType) -> &'static str {
    match t {
        RecordType::A => "a",
        RecordType::AAAA => "aaaa",
        RecordType::ANY => "any",
        RecordType::CAA => "caa",
        RecordType::CNAME => "cname",
        RecordType::HTTPS => "https",
        RecordType::MX => "mx",
        RecordType::NAPTR => "naptr",
        RecordType::NS => "ns",
        RecordType::PTR => "ptr",
        RecordType::SOA => "soa",
        RecordType::SRV => "srv",
        RecordType::SVCB => "svcb",
        RecordType::TXT => "txt",
        _ => "other",
    }
}

/// Istio's buckets (seconds), in order.
const UPSTREAM_BUCKETS: [f64; 6] = [0.001, 0.005, 0.01, 0.1, 1.0, 5.0];

#[derive(Clone)]
pub struct DnsMetrics {
    requests: Family<DnsLabels, Counter>,
    upstream_requests: Family<DnsLabels, Counter>,
    upstream_failures: Family<DnsLabels, Counter>,
    upstream_duration: Family<DnsLabels, Histogram, fn() -> Histogram>,
}

fn upstream_histogram() -> Histogram {
    Histogram::new(UPSTREAM_BUCKETS.iter().copied())
}

impl DnsMetrics {
    /// Registers the DNS metrics (names prefixed `istio_` as the rest of ztunnel's).
    pub fn register(registry: &mut Registry) -> DnsMetrics {
        let m = DnsMetrics {
            requests: Family::default(),
            upstream_requests: Family::default(),
            upstream_failures: Family::default(),
            upstream_duration: Family::new_with_constructor(upstream_histogram),
        };
        // The text encoder appends `_total` to counters and the unit to the histogram.
        registry.register(
            "istio_dns_requests",
            "Total number of DNS requests",
            m.requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream",
            m.upstream_requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream",
            m.upstream_failures.clone(),
        );
        registry.register_with_unit(
            "istio_dns_upstream_request_duration",
            "Time taken to get a DNS response from upstream",
            Unit::Seconds,
            m.upstream_duration.clone(),
        );
        m
    }

    pub fn request(&self, l: &DnsLabels) {
        self.requests.get_or_create(l).inc();
    }

    pub fn upstream_request(&self, l: &DnsLabels) {
        self.upstream_requests.get_or_create(l).inc();
    }

    pub fn upstream_failure(&self, l: &DnsLabels) {
        self.upstream_failures.get_or_create(l).inc();
    }

    pub fn upstream_duration(&self, l: &DnsLabels, d: std::time::Duration) {
        self.upstream_duration
            .get_or_create(l)
            .observe(d.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_bounded_labels() {
        let mut r = Registry::default();
        let m = DnsMetrics::register(&mut r);
        let l = DnsLabels::new(RecordType::A, "udp", None);
        m.request(&l);
        m.upstream_request(&DnsLabels::new(RecordType::Unknown(65280), "tcp", None));
        m.upstream_failure(&l);
        m.upstream_duration(&l, std::time::Duration::from_millis(3));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for want in [
            "istio_dns_requests_total{request_query_type=\"a\",request_protocol=\"udp\",source_canonical_service=\"unknown\",source_canonical_revision=\"unknown\"} 1",
            "istio_dns_upstream_requests_total{request_query_type=\"other\",request_protocol=\"tcp\"",
            "istio_dns_upstream_failures_total{",
            "istio_dns_upstream_request_duration_seconds_bucket{le=\"0.005\",request_query_type=\"a\"",
        ] {
            assert!(out.contains(want), "{want} missing in:\n{out}");
        }
    }
}
