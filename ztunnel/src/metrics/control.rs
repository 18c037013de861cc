//! Control-plane metrics: the xDS stream to istiod (Istio ztunnel's names) and the
//! certificates this proxy holds.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UrlLabel {
    /// The xDS type URL.
    pub url: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReporterLabel {
    /// `source` (outbound) or `destination` (inbound), as Istio's.
    pub reporter: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// Where the config came from: `xds` or `kubernetes`.
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// The xDS stream: only the two type URLs we subscribe to ever appear as labels.
#[derive(Clone, Default)]
pub struct XdsMetrics {
    terminations: Family<ReasonLabel, Counter>,
    messages: Family<UrlLabel, Counter>,
    message_bytes: Family<UrlLabel, Counter>,
    rejected: Family<UrlLabel, Counter>,
    unenforceable: Family<SourceLabel, Gauge>,
}

impl XdsMetrics {
    pub fn register(registry: &mut Registry) -> XdsMetrics {
        let m = XdsMetrics::default();
        registry.register(
            "istio_xds_connection_terminations",
            "xDS connections to istiod that ended, by reason",
            m.terminations.clone(),
        );
        registry.register(
            "istio_xds_message",
            "xDS responses received, by type",
            m.messages.clone(),
        );
        registry.register(
            "istio_xds_message_bytes",
            "Bytes of xDS resources received, by type",
            m.message_bytes.clone(),
        );
        registry.register(
            "ztunnel_xds_rejected_resources",
            "xDS resources NACKed (not applied), by type",
            m.rejected.clone(),
        );
        registry.register(
            "ztunnel_unenforceable_policies",
            "Authorization policies that could not be converted exactly and are enforced as deny-all in their scope, by config source",
            m.unenforceable.clone(),
        );
        m
    }

    pub fn message(&self, url: &str, bytes: u64, rejected: u64) {
        let l = UrlLabel {
            url: url.to_string(),
        };
        self.messages.get_or_create(&l).inc();
        self.message_bytes.get_or_create(&l).inc_by(bytes);
        if rejected > 0 {
            self.rejected.get_or_create(&l).inc_by(rejected);
        }
    }

    /// How many policies from `source` (`xds`, `kubernetes`) are deny-alls in place of ones
    /// that did not convert.
    pub fn set_unenforceable(&self, source: &'static str, n: usize) {
        self.unenforceable
            .get_or_create(&SourceLabel { source })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// `reason`: `error` (the stream failed) or `closed` (istiod ended it).
    pub fn terminated(&self, reason: &'static str) {
        self.terminations
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }
}

/// Certificate requests to the CA.
#[derive(Clone, Default)]
pub struct CertMetrics {
    requests: Family<ResultLabel, Counter>,
}

impl CertMetrics {
    pub fn register(registry: &mut Registry) -> CertMetrics {
        let m = CertMetrics::default();
        registry.register(
            "ztunnel_certificate_requests",
            "Certificate requests to the CA, by result",
            m.requests.clone(),
        );
        m
    }

    pub fn request(&self, ok: bool) {
        self.requests
            .get_or_create(&ResultLabel {
                result: if ok { "success" } else { "failure" },
            })
            .inc();
    }
}
