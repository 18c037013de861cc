//! Istio's TCP metrics. Label values come from workload metadata in mesh config, and a
//! peer that is not in config is `unknown`, so cardinality follows the config, not the
//! number of distinct peers; on top of that each family holds at most `MAX_SERIES` label
//! sets, and connections beyond it are counted under `unknown` peers, so no amount of
//! traffic can grow the metrics without limit.

use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub mod control;
pub mod dns;
pub mod http;
pub mod labels;
pub mod meta;
pub mod on_demand_dns;
pub mod process;

pub use labels::{Peer, SeriesBound, TcpLabels, MAX_SERIES};

pub struct Metrics {
    pub registry: Registry,
    opened: Family<TcpLabels, Counter>,
    closed: Family<TcpLabels, Counter>,
    failed: Family<TcpLabels, Counter>,
    received: Family<TcpLabels, Counter>,
    sent: Family<TcpLabels, Counter>,
    series: SeriesBound,
    sockets_open: Family<control::ReporterLabel, Gauge>,
    connections_refused: Family<control::ReasonLabel, Counter>,
    hbone_rejections: Family<control::ReasonLabel, Counter>,
    crl_rejections: Family<control::ReporterLabel, Counter>,
    pub xds: control::XdsMetrics,
    pub certs: control::CertMetrics,
    pub process: std::sync::Arc<process::ProcessCollector>,
    pub build: meta::Build,
    pub workload_manager: meta::WorkloadManager,
    /// What readiness still waits for ("startup", "xds", "zds", ...).
    pending: std::sync::Mutex<std::collections::BTreeSet<&'static str>>,
    draining: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let opened = Family::<TcpLabels, Counter>::default();
        let closed = Family::<TcpLabels, Counter>::default();
        let failed = Family::<TcpLabels, Counter>::default();
        let received = Family::<TcpLabels, Counter>::default();
        let sent = Family::<TcpLabels, Counter>::default();
        // The text encoder appends `_total` to counters.
        registry.register(
            "istio_tcp_connections_opened",
            "TCP connections opened",
            opened.clone(),
        );
        registry.register(
            "istio_tcp_connections_closed",
            "TCP connections closed",
            closed.clone(),
        );
        registry.register(
            "istio_tcp_connections_failed",
            "TCP connections that failed",
            failed.clone(),
        );
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes received from the connection's client",
            received.clone(),
        );
        registry.register(
            "istio_tcp_sent_bytes",
            "Bytes sent to the connection's client",
            sent.clone(),
        );
        let sockets_open = Family::<control::ReporterLabel, Gauge>::default();
        registry.register(
            "istio_tcp_sockets_open",
            "The current number of open TCP sockets",
            sockets_open.clone(),
        );
        let connections_refused = Family::<control::ReasonLabel, Counter>::default();
        registry.register(
            "ztunnel_connections_refused",
            "Connections that could not be accepted (fd_exhaustion: refused for lack of file descriptors)",
            connections_refused.clone(),
        );
        let hbone_rejections = Family::<control::ReasonLabel, Counter>::default();
        registry.register(
            "ztunnel_hbone_rejections",
            "HBONE connections or requests refused before reaching policy (handshake_limit: too many handshakes in flight, tls_handshake, bad_request, h2_flood: rapid reset or CONTINUATION flood, empty_data_flood, h2_protocol)",
            hbone_rejections.clone(),
        );
        let crl_rejections = Family::<control::ReporterLabel, Counter>::default();
        registry.register(
            "istio_crl_policy_rejections",
            "Connections refused or closed because a CRL (CRL_PATH) revokes the peer's certificate (reporter destination: a client at our HBONE server; source: a server we connected to)",
            crl_rejections.clone(),
        );
        let xds = control::XdsMetrics::register(&mut registry);
        let certs = control::CertMetrics::register(&mut registry);
        let process = std::sync::Arc::new(process::ProcessCollector::default());
        registry.register_collector(Box::new(process.clone()));
        let build = meta::Build::register(&mut registry);
        let workload_manager = meta::WorkloadManager::register(&mut registry);
        Metrics {
            registry,
            opened,
            closed,
            failed,
            received,
            sent,
            series: Default::default(),
            sockets_open,
            connections_refused,
            hbone_rejections,
            crl_rejections,
            xds,
            certs,
            process,
            build,
            workload_manager,
            pending: std::sync::Mutex::new(["startup"].into()),
            draining: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    /// `l` itself while there is room for another label set, else the overflow set.
    fn bounded<'l>(&self, l: &'l TcpLabels) -> std::borrow::Cow<'l, TcpLabels> {
        if self.series.admit(l) {
            std::borrow::Cow::Borrowed(l)
        } else {
            std::borrow::Cow::Owned(l.overflow())
        }
    }

    /// An accepted socket, counted in `istio_tcp_sockets_open{reporter}` until the guard
    /// drops (`source`: a pod's outbound connection; `destination`: inbound, HBONE or
    /// plaintext).
    pub fn socket_open(&self, reporter: &'static str) -> SocketGuard {
        let gauge = self
            .sockets_open
            .get_or_create(&control::ReporterLabel { reporter })
            .clone();
        gauge.inc();
        SocketGuard(gauge)
    }

    /// A connection refused before it was proxied (`fd_exhaustion`, `pod_limit`, `accept_error`).
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&control::ReasonLabel { reason })
            .inc();
    }

    /// An inbound HBONE connection or request refused for `reason` (a fixed set).
    pub fn hbone_rejected(&self, reason: &'static str) {
        self.hbone_rejections
            .get_or_create(&control::ReasonLabel { reason })
            .inc();
    }

    /// A peer refused (at its handshake) or cut off (after a CRL reload) because a CRL
    /// revokes its certificate; `reporter` is `destination` inbound, `source` outbound.
    pub fn crl_rejected(&self, reporter: &'static str) {
        self.crl_rejections
            .get_or_create(&control::ReporterLabel { reporter })
            .inc();
    }

    /// A connection that opened. Its counters are looked up now, so the connection keeps
    /// three counter handles instead of its label set (about 1 KB of strings) until it ends.
    pub fn opened(&self, l: &TcpLabels) -> OpenConnection {
        let l = self.bounded(l);
        self.opened.get_or_create(&l).inc();
        OpenConnection {
            closed: self.closed.get_or_create(&l).clone(),
            received: self.received.get_or_create(&l).clone(),
            sent: self.sent.get_or_create(&l).clone(),
        }
    }

    /// As `opened`, each of the four counters (opened, closed, received, sent; Istio's
    /// TCP_OPENED_CONNECTIONS, TCP_CLOSED_CONNECTIONS, TCP_RECEIVED_BYTES,
    /// TCP_SENT_BYTES) as a Telemetry's overrides say: dropped (None: a counter no
    /// family holds), or with some labels emptied.
    pub fn opened_overridden(
        &self,
        l: &TcpLabels,
        o: &[http::MetricOverride; 4],
    ) -> OpenConnection {
        let trimmed = |m: &http::MetricOverride| {
            let mut l = l.clone();
            for name in &m.remove {
                l.blank(name);
            }
            self.bounded(&l).into_owned()
        };
        let counter = |family: &Family<TcpLabels, Counter>, m: &http::MetricOverride| {
            if m.disabled {
                Counter::default()
            } else {
                family.get_or_create(&trimmed(m)).clone()
            }
        };
        counter(&self.opened, &o[0]).inc();
        OpenConnection {
            closed: counter(&self.closed, &o[1]),
            received: counter(&self.received, &o[2]),
            sent: counter(&self.sent, &o[3]),
        }
    }

    /// A connection that could not be set up (denied, no upstream, TLS failure...).
    pub fn failed(&self, l: &TcpLabels, response_flags: &'static str) {
        let l = TcpLabels {
            response_flags,
            ..l.clone()
        };
        self.failed.get_or_create(&self.bounded(&l)).inc();
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<&'static str>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start-up is done (listeners bound, start-up pods enrolled).
    pub fn set_ready(&self) {
        self.ready_part("startup");
    }

    /// Readiness also waits for `part` (e.g. "xds" until istiod's first full state).
    pub fn wait_for(&self, part: &'static str) {
        self.pending().insert(part);
    }

    pub fn ready_part(&self, part: &'static str) {
        self.pending().remove(part);
    }

    /// Draining: stop advertising readiness so nothing new is sent here.
    pub fn set_not_ready(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire) && self.pending().is_empty()
    }

    /// Why readiness is not reported, for the 503 body.
    pub fn not_ready_reason(&self) -> String {
        if self.draining.load(Ordering::Acquire) {
            return "draining".into();
        }
        let p = self.pending();
        format!(
            "waiting for {}",
            p.iter().copied().collect::<Vec<_>>().join(", ")
        )
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The counters of an open connection, from [`Metrics::opened`].
pub struct OpenConnection {
    closed: Counter,
    received: Counter,
    sent: Counter,
}

impl OpenConnection {
    /// The connection is still open: counts bytes it carried since the caller last
    /// counted (Envoy's periodic TCP reporting; the caller keeps the totals, so that
    /// this, held by every connection, stays small).
    pub fn count(&self, received: u64, sent: u64) {
        self.received.inc_by(received);
        self.sent.inc_by(sent);
    }

    /// The connection ended; `received` is what its client sent, `sent` what it got back
    /// (since the last [`OpenConnection::count`]).
    pub fn closed(self, received: u64, sent: u64) {
        self.closed.inc();
        self.received.inc_by(received);
        self.sent.inc_by(sent);
    }
}

/// Keeps one socket counted as open.
pub struct SocketGuard(Gauge);

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_sets_are_bounded() {
        let m = Metrics::default();
        let base = TcpLabels::new("destination", Peer::default(), Peer::default(), None, true);
        for i in 0..(MAX_SERIES + 5_000) {
            let l = TcpLabels {
                source_workload: format!("peer-{i}"),
                ..base.clone()
            };
            m.opened(&l).closed(1, 1);
        }
        let text = m.encode();
        let series = text
            .lines()
            .filter(|l| l.starts_with("istio_tcp_connections_opened_total{"))
            .count();
        assert_eq!(
            series,
            MAX_SERIES + 1,
            "the overflow set takes everything past the bound"
        );
        let overflow = text
            .lines()
            .find(|l| {
                l.starts_with("istio_tcp_connections_opened_total{")
                    && l.contains("source_workload=\"unknown\"")
            })
            .unwrap();
        assert!(overflow.ends_with(" 5000"), "{overflow}");
        // Known label sets still count after the bound is reached.
        let _open = m.opened(&TcpLabels {
            source_workload: "peer-7".into(),
            ..base.clone()
        });
        assert!(m.encode().contains("source_workload=\"peer-7\""));
    }

    #[test]
    fn open_sockets_are_counted_until_their_guard_drops() {
        let m = Metrics::default();
        let a = m.socket_open("source");
        let _b = m.socket_open("source");
        let _c = m.socket_open("destination");
        drop(a);
        let text = m.encode();
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"source\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"destination\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn process_metrics_are_exported() {
        let text = Metrics::default().encode();
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
    }
}
