//! Istio's HTTP metrics, reported by the waypoint (`reporter="waypoint"`). Bounded as
//! the TCP ones: at most `MAX_SERIES` label sets, then overflow sets with `unknown` peers;
//! the gRPC status, which the backend chooses, is one of the 17 codes or `other`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::labels::{SeriesBound, TcpLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    #[prometheus(flatten)]
    pub peers: TcpLabels,
    pub response_code: u16,
    /// `grpc_status` of what the backend sent, or empty for non-gRPC requests.
    pub grpc_response_status: &'static str,
}

const GRPC_CODES: [&str; 17] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16"];

/// A `grpc-status` value as a label: one of gRPC's codes 0-16, else `other` (the value
/// comes from the backend, so it must not become a label as is).
pub fn grpc_status(value: &str) -> &'static str {
    GRPC_CODES.iter().find(|c| **c == value).copied().unwrap_or("other")
}

/// Envoy's default histogram buckets for durations (ms), which Istio keeps.
const DURATION_BUCKETS: [f64; 20] = [
    0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0,
    300000.0, 600000.0, 1800000.0, 3600000.0, f64::MAX,
];

/// Istio's size buckets (bytes): 1, 10, ... 10^8.
fn size_histogram() -> Histogram {
    Histogram::new([1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0, 10000000.0, 100000000.0])
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS[..DURATION_BUCKETS.len() - 1].iter().copied())
}

type Hist = Family<HttpLabels, Histogram, fn() -> Histogram>;

#[derive(Clone)]
pub struct HttpMetrics {
    requests: Family<HttpLabels, Counter>,
    duration: Hist,
    request_bytes: Hist,
    response_bytes: Hist,
    series: std::sync::Arc<SeriesBound>,
}

impl HttpMetrics {
    pub fn register(registry: &mut Registry) -> HttpMetrics {
        let m = HttpMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            request_bytes: Family::new_with_constructor(size_histogram),
            response_bytes: Family::new_with_constructor(size_histogram),
            series: Default::default(),
        };
        registry.register("istio_requests", "Requests handled", m.requests.clone());
        registry.register("istio_request_duration_milliseconds", "Request duration", m.duration.clone());
        registry.register("istio_request_bytes", "Request sizes (headers and body)", m.request_bytes.clone());
        registry.register("istio_response_bytes", "Response sizes (headers and body)", m.response_bytes.clone());
        m
    }

    pub fn record(&self, labels: &HttpLabels, duration_ms: f64, request_bytes: u64, response_bytes: u64) {
        let overflow;
        let labels = if self.series.admit(labels) {
            labels
        } else {
            overflow = HttpLabels { peers: labels.peers.overflow(), ..labels.clone() };
            &overflow
        };
        self.requests.get_or_create(labels).inc();
        self.duration.get_or_create(labels).observe(duration_ms);
        self.request_bytes.get_or_create(labels).observe(request_bytes as f64);
        self.response_bytes.get_or_create(labels).observe(response_bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Peer, MAX_SERIES};

    fn series(text: &str, family: &str) -> usize {
        text.lines().filter(|l| l.starts_with(family)).count()
    }

    #[test]
    fn http_label_sets_are_bounded() {
        let mut registry = Registry::default();
        let m = HttpMetrics::register(&mut registry);
        let base = HttpLabels {
            peers: TcpLabels::new("waypoint", Peer::default(), Peer::default(), None, true),
            response_code: 200,
            grpc_response_status: "",
        };
        for i in 0..(MAX_SERIES + 5_000) {
            let l = HttpLabels { peers: TcpLabels { source_workload: format!("peer-{i}"), ..base.peers.clone() }, ..base.clone() };
            m.record(&l, 1.0, 10, 10);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert_eq!(series(&text, "istio_requests_total{"), MAX_SERIES + 1, "the overflow set takes everything past the bound");
        assert_eq!(series(&text, "istio_request_duration_milliseconds_count{"), MAX_SERIES + 1);
        let overflow = text
            .lines()
            .find(|l| l.starts_with("istio_requests_total{") && l.contains("source_workload=\"unknown\""))
            .unwrap();
        assert!(overflow.ends_with(" 5000"), "{overflow}");
    }

    #[test]
    fn grpc_status_is_a_code_or_other() {
        for c in 0..=16 {
            assert_eq!(grpc_status(&c.to_string()), c.to_string());
        }
        for v in ["17", "-1", "01", " 1", "", "OK", "1; evil=\"x\"", &"9".repeat(10_000)] {
            assert_eq!(grpc_status(v), "other", "{v:?}");
        }
    }
}
