//! Istio's HTTP metrics, reported by the waypoint (`reporter="waypoint"`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::TcpLabels;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    #[prometheus(flatten)]
    pub peers: TcpLabels,
    pub response_code: u16,
    pub grpc_response_status: String,
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
}

impl HttpMetrics {
    pub fn register(registry: &mut Registry) -> HttpMetrics {
        let m = HttpMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            request_bytes: Family::new_with_constructor(size_histogram),
            response_bytes: Family::new_with_constructor(size_histogram),
        };
        registry.register("istio_requests", "Requests handled", m.requests.clone());
        registry.register("istio_request_duration_milliseconds", "Request duration", m.duration.clone());
        registry.register("istio_request_bytes", "Request sizes (headers and body)", m.request_bytes.clone());
        registry.register("istio_response_bytes", "Response sizes (headers and body)", m.response_bytes.clone());
        m
    }

    pub fn record(&self, labels: &HttpLabels, duration_ms: f64, request_bytes: u64, response_bytes: u64) {
        self.requests.get_or_create(labels).inc();
        self.duration.get_or_create(labels).observe(duration_ms);
        self.request_bytes.get_or_create(labels).observe(request_bytes as f64);
        self.response_bytes.get_or_create(labels).observe(response_bytes as f64);
    }
}
