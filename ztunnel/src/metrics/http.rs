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
    /// None only when a Telemetry removes the label (exported empty).
    pub response_code: Option<u16>,
    /// `grpc_status` of what the backend sent, or empty for non-gRPC requests.
    pub grpc_response_status: &'static str,
}

impl HttpLabels {
    /// Empties the label `name` (see `TcpLabels::blank`); false for a name it has not.
    pub fn blank(&mut self, name: &str) -> bool {
        match name {
            "response_code" => self.response_code = None,
            "grpc_response_status" => self.grpc_response_status = "",
            other => return self.peers.blank(other),
        }
        true
    }
}

/// Whether Istio's HTTP metrics have a label `name`.
pub fn is_label(name: &str) -> bool {
    matches!(name, "response_code" | "grpc_response_status")
        || super::labels::TCP_LABEL_NAMES.contains(&name)
}

/// What a Telemetry's overrides do to one metric: drop it, or empty some of its labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricOverride {
    pub disabled: bool,
    pub remove: Vec<String>,
}

impl MetricOverride {
    pub fn is_none(&self) -> bool {
        !self.disabled && self.remove.is_empty()
    }
}

/// The overrides of the four HTTP metrics (Istio's REQUEST_COUNT, REQUEST_DURATION,
/// REQUEST_SIZE, RESPONSE_SIZE).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HttpOverrides {
    pub requests: MetricOverride,
    pub duration: MetricOverride,
    pub request_bytes: MetricOverride,
    pub response_bytes: MetricOverride,
}

const GRPC_CODES: [&str; 17] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
];

/// A `grpc-status` value as a label: one of gRPC's codes 0-16, else `other` (the value
/// comes from the backend, so it must not become a label as is).
pub fn grpc_status(value: &str) -> &'static str {
    GRPC_CODES
        .iter()
        .find(|c| **c == value)
        .copied()
        .unwrap_or("other")
}

/// Envoy's default histogram buckets for durations (ms), which Istio keeps.
const DURATION_BUCKETS: [f64; 20] = [
    0.5,
    1.0,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10000.0,
    30000.0,
    60000.0,
    300000.0,
    600000.0,
    1800000.0,
    3600000.0,
    f64::MAX,
];

/// Istio's size buckets (bytes): 1, 10, ... 10^8.
fn size_histogram() -> Histogram {
    Histogram::new([
        1.0,
        10.0,
        100.0,
        1000.0,
        10000.0,
        100000.0,
        1000000.0,
        10000000.0,
        100000000.0,
    ])
}

fn duration_histogram() -> Histogram {
    Histogram::new(
        DURATION_BUCKETS[..DURATION_BUCKETS.len() - 1]
            .iter()
            .copied(),
    )
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
        registry.register(
            "istio_request_duration_milliseconds",
            "Request duration",
            m.duration.clone(),
        );
        registry.register(
            "istio_request_bytes",
            "Request sizes (headers and body)",
            m.request_bytes.clone(),
        );
        registry.register(
            "istio_response_bytes",
            "Response sizes (headers and body)",
            m.response_bytes.clone(),
        );
        m
    }

    pub fn record(
        &self,
        labels: &HttpLabels,
        duration_ms: f64,
        request_bytes: u64,
        response_bytes: u64,
    ) {
        let overflow;
        let labels = if self.series.admit(labels) {
            labels
        } else {
            overflow = HttpLabels {
                peers: labels.peers.overflow(),
                ..labels.clone()
            };
            &overflow
        };
        self.requests.get_or_create(labels).inc();
        self.duration.get_or_create(labels).observe(duration_ms);
        self.request_bytes
            .get_or_create(labels)
            .observe(request_bytes as f64);
        self.response_bytes
            .get_or_create(labels)
            .observe(response_bytes as f64);
    }

    /// As `record`, each metric as `o` says: dropped, or with some labels emptied.
    pub fn record_overridden(
        &self,
        labels: &HttpLabels,
        o: &HttpOverrides,
        duration_ms: f64,
        request_bytes: u64,
        response_bytes: u64,
    ) {
        let trimmed = |m: &MetricOverride| {
            let mut l = labels.clone();
            for name in &m.remove {
                l.blank(name);
            }
            if self.series.admit(&l) {
                l
            } else {
                HttpLabels {
                    peers: l.peers.overflow(),
                    ..l
                }
            }
        };
        if !o.requests.disabled {
            self.requests.get_or_create(&trimmed(&o.requests)).inc();
        }
        if !o.duration.disabled {
            self.duration
                .get_or_create(&trimmed(&o.duration))
                .observe(duration_ms);
        }
        if !o.request_bytes.disabled {
            self.request_bytes
                .get_or_create(&trimmed(&o.request_bytes))
                .observe(request_bytes as f64);
        }
        if !o.response_bytes.disabled {
            self.response_bytes
                .get_or_create(&trimmed(&o.response_bytes))
                .observe(response_bytes as f64);
        }
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
            response_code: Some(200),
            grpc_response_status: "",
        };
        for i in 0..(MAX_SERIES + 5_000) {
            let l = HttpLabels {
                peers: TcpLabels {
                    source_workload: format!("peer-{i}"),
                    ..base.peers.clone()
                },
                ..base.clone()
            };
            m.record(&l, 1.0, 10, 10);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert_eq!(
            series(&text, "istio_requests_total{"),
            MAX_SERIES + 1,
            "the overflow set takes everything past the bound"
        );
        assert_eq!(
            series(&text, "istio_request_duration_milliseconds_count{"),
            MAX_SERIES + 1
        );
        let overflow = text
            .lines()
            .find(|l| {
                l.starts_with("istio_requests_total{") && l.contains("source_workload=\"unknown\"")
            })
            .unwrap();
        assert!(overflow.ends_with(" 5000"), "{overflow}");
    }

    /// A Telemetry's overrides: a dropped metric is not recorded, a removed label is
    /// exported empty (Prometheus's "absent"), so series differing only there merge.
    #[test]
    fn overrides_drop_metrics_and_empty_labels() {
        let mut registry = Registry::default();
        let m = HttpMetrics::register(&mut registry);
        let base = HttpLabels {
            peers: TcpLabels::new("waypoint", Peer::default(), Peer::default(), None, true),
            response_code: Some(200),
            grpc_response_status: "",
        };
        let remove = MetricOverride {
            disabled: false,
            remove: vec!["source_workload".into(), "response_code".into()],
        };
        let o = HttpOverrides {
            requests: remove,
            duration: MetricOverride {
                disabled: true,
                remove: vec![],
            },
            ..Default::default()
        };
        for (i, code) in [(1, 200), (2, 503)] {
            let l = HttpLabels {
                peers: TcpLabels {
                    source_workload: format!("w{i}"),
                    ..base.peers.clone()
                },
                response_code: Some(code),
                ..base.clone()
            };
            m.record_overridden(&l, &o, 1.0, 10, 10);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let requests: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("istio_requests_total{"))
            .collect();
        assert_eq!(requests.len(), 1, "{text}");
        assert!(
            requests[0].contains("source_workload=\"\"")
                && requests[0].contains("response_code=\"\"")
                && requests[0].ends_with(" 2"),
            "{}",
            requests[0]
        );
        assert_eq!(
            series(&text, "istio_request_duration_milliseconds_count{"),
            0,
            "dropped"
        );
        assert_eq!(series(&text, "istio_request_bytes_count{"), 2, "untouched");
        assert!(is_label("response_code") && is_label("destination_zone") && !is_label("nope"));
        let mut l = base.clone();
        assert!(!l.blank("nope"));
    }

    #[test]
    fn grpc_status_is_a_code_or_other() {
        for c in 0..=16 {
            assert_eq!(grpc_status(&c.to_string()), c.to_string());
        }
        for v in [
            "17",
            "-1",
            "01",
            " 1",
            "",
            "OK",
            "1; evil=\"x\"",
            &"9".repeat(10_000),
        ] {
            assert_eq!(grpc_status(v), "other", "{v:?}");
        }
    }
}
