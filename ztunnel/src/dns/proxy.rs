//! The node's DNS proxy: settings, the mesh index it answers from, the cache and the
//! upstream forwarder, shared by every pod's listeners (`server`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, Query, ResponseCode};

use super::answer::{answer_locally, Local, Transport};
use super::cache;
use super::error::DnsError;
use super::forwarder;
use super::message;
use super::resolver;
use crate::metrics::dns::{DnsLabels, DnsMetrics};
use crate::proxy::pod::LocalPod;
use crate::state::{MeshState, SharedState};

/// DNS proxy settings.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// The Kubernetes cluster domain (Istio's CLUSTER_DOMAIN).
    pub cluster_domain: String,
    /// Upstream resolvers, tried in order.
    pub upstreams: Vec<SocketAddr>,
    /// Cache bounds; `cache_entries` 0 turns the cache off.
    pub cache_entries: usize,
    pub cache_bytes: usize,
    /// One upstream try, and the whole question.
    pub attempt_timeout: Duration,
    pub total_timeout: Duration,
    /// Istio's IPV6_ENABLED: off, mesh names answer AAAA with no records.
    pub ipv6: bool,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            cluster_domain: "cluster.local".into(),
            upstreams: Vec::new(),
            cache_entries: 4096,
            cache_bytes: 4 << 20,
            attempt_timeout: Duration::from_secs(2),
            total_timeout: Duration::from_secs(5),
            ipv6: true,
        }
    }
}

/// Questions in flight upstream, node-wide.
const MAX_UPSTREAM_IN_FLIGHT: usize = 1024;

/// The node's DNS proxy, shared by every pod's listeners.
pub struct DnsProxy {
    state: Arc<SharedState>,
    cluster_domain: String,
    ipv6: bool,
    forwarder: forwarder::Forwarder,
    cache: cache::Cache,
    metrics: DnsMetrics,
    /// The mesh index for the state version it was built from.
    index: Mutex<Option<(Arc<MeshState>, Arc<resolver::MeshIndex>)>>,
    /// When the last upstream failure was logged at WARN (they come in bursts).
    last_warn: Mutex<Option<std::time::Instant>>,
}

impl DnsProxy {
    pub fn new(cfg: DnsConfig, state: Arc<SharedState>, metrics: DnsMetrics) -> DnsProxy {
        if cfg.upstreams.is_empty() {
            tracing::warn!("the DNS proxy has no upstream resolver: names outside the mesh get SERVFAIL; set --dns-upstream");
        }
        tracing::info!(upstreams = ?cfg.upstreams, cluster_domain = %cfg.cluster_domain, cache_entries = cfg.cache_entries, "DNS proxy configured");
        DnsProxy {
            state,
            cluster_domain: cfg
                .cluster_domain
                .trim_end_matches('.')
                .to_ascii_lowercase(),
            ipv6: cfg.ipv6,
            forwarder: forwarder::Forwarder::new(
                cfg.upstreams,
                cfg.attempt_timeout,
                cfg.total_timeout,
                MAX_UPSTREAM_IN_FLIGHT,
            ),
            cache: cache::Cache::new(cfg.cache_entries, cfg.cache_bytes),
            metrics,
            index: Mutex::new(None),
            last_warn: Mutex::new(None),
        }
    }

    /// The mesh index of `state`, rebuilt when the state has changed since the last question.
    fn index(&self, state: &Arc<MeshState>) -> Arc<resolver::MeshIndex> {
        let mut slot = self.index.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((built_from, idx)) = slot.as_ref() {
            if Arc::ptr_eq(built_from, state) {
                return idx.clone();
            }
        }
        let idx =
            Arc::new(resolver::MeshIndex::build(state, &self.cluster_domain).with_ipv6(self.ipv6));
        *slot = Some((state.clone(), idx.clone()));
        idx
    }

    /// The response to one message from `pod`, if it deserves one.
    pub async fn handle(
        &self,
        pod: &LocalPod,
        wire: &[u8],
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let state = self.state.load_full();
        let client = pod.workload_in(&state).clone();
        match answer_locally(&self.index(&state), &client, wire, transport) {
            Local::Drop(reason) => {
                tracing::debug!(pod = %pod.workload.name, reason, "DNS message dropped");
                None
            }
            Local::Reject(resp, reason) => {
                tracing::debug!(pod = %pod.workload.name, reason, "malformed DNS message");
                Some(resp)
            }
            Local::Mesh { response, query } => {
                self.metrics.request(&DnsLabels::new(
                    query.query_type(),
                    transport.label(),
                    Some(&client),
                ));
                Some(response)
            }
            Local::Forward {
                request,
                query,
                limit,
            } => {
                let labels = DnsLabels::new(query.query_type(), transport.label(), Some(&client));
                self.metrics.request(&labels);
                let resp = self.forward(&request, &query, &labels, &client).await;
                Some(message::encode(&resp, limit))
            }
        }
    }

    /// Answers from the cache or the upstream resolvers; SERVFAIL when they fail.
    async fn forward(
        &self,
        req: &Message,
        q: &Query,
        labels: &DnsLabels,
        client: &crate::state::Workload,
    ) -> Message {
        let dnssec_ok = message::dnssec_ok(req);
        let cd = req.metadata.checking_disabled;
        let key = cache::CacheKey {
            name: q.name().to_lowercase().to_ascii(),
            qtype: q.query_type(),
            qclass: q.query_class(),
            dnssec_ok,
            checking_disabled: cd,
        };
        let log = |result: &str, answers: usize| {
            tracing::debug!(src.workload = %client.name, src.namespace = %client.namespace,
                query = %q.query_type(), domain = %key.name.trim_end_matches('.'), result, answers, "dns request");
        };
        if let Some(hit) = self.cache.get(&key, std::time::Instant::now()) {
            if let Ok(mut m) = Message::from_vec(&hit.wire) {
                cache::age_ttls(&mut m, hit.age);
                log("cached", m.answers.len());
                return message::forwarded_response(req, m);
            }
        }
        self.metrics.upstream_request(labels);
        let started = std::time::Instant::now();
        let r = self.forwarder.ask(q, dnssec_ok, cd).await;
        self.metrics.upstream_duration(labels, started.elapsed());
        match r {
            Ok(answer) => {
                if let Some(ttl) = cache::cache_ttl(&answer.message) {
                    self.cache
                        .insert(key.clone(), answer.wire, ttl, std::time::Instant::now());
                }
                log("forwarded", answer.message.answers.len());
                message::forwarded_response(req, answer.message)
            }
            Err(e) => {
                self.metrics.upstream_failure(labels);
                self.warn_upstream(&e, &key.name);
                message::response_to(req, ResponseCode::ServFail)
            }
        }
    }

    /// Logs an upstream failure at WARN at most every 10 s (DEBUG otherwise): a dead
    /// upstream would otherwise log every question of every pod.
    fn warn_upstream(&self, e: &DnsError, name: &str) {
        let now = std::time::Instant::now();
        let mut last = self.last_warn.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
            *last = Some(now);
            tracing::warn!(error = %e, domain = name, upstreams = ?self.forwarder.upstreams(), "DNS forwarding failed; answering SERVFAIL");
        } else {
            tracing::debug!(error = %e, domain = name, "DNS forwarding failed; answering SERVFAIL");
        }
    }

    /// (entries, bytes) in the cache.
    pub fn cache_usage(&self) -> (usize, usize) {
        self.cache.usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode};
    use hickory_proto::rr::{Name, RData, RecordType};

    fn mesh(services: &str) -> MeshState {
        let yaml = format!(
            "workloads:\n- {{uid: c, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE, node: n1, canonicalName: sleep}}\nservices:\n{services}"
        );
        let path = std::path::Path::new("t.yaml");
        crate::config::LocalConfig::parse(path, &yaml)
            .unwrap()
            .into_state(path)
            .unwrap()
    }

    const ECHO: &str = "- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"]}\n";
    const NEW: &str = "- {name: new, namespace: default, hostname: new.default.svc.cluster.local, vips: [\"/10.96.0.20\"]}\n";

    fn pod(state: &SharedState) -> LocalPod {
        let workload = state
            .load()
            .workload_by_uid(&crate::state::WorkloadUid("c".into()))
            .unwrap()
            .clone();
        LocalPod {
            identity: workload.identity(),
            ips: crate::state::PodIps {
                v4: Some("10.10.1.11".parse().unwrap()),
                v6: None,
            },
            workload,
            netns: crate::netns::InPodNetns::open(std::path::Path::new("/proc/self/ns/net"))
                .unwrap(),
            active: Default::default(),
            inbound: Default::default(),
            outbound: Default::default(),
        }
    }

    async fn ask(proxy: &DnsProxy, pod: &LocalPod, name: &str) -> Message {
        let mut q = Message::new(7, MessageType::Query, OpCode::Query);
        q.queries
            .push(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        let wire = proxy
            .handle(pod, &q.to_vec().unwrap(), Transport::Udp)
            .await
            .expect("an answer");
        Message::from_vec(&wire).unwrap()
    }

    #[tokio::test]
    async fn answers_follow_the_mesh_state_and_fail_without_upstream() {
        let state = Arc::new(SharedState::new(mesh(ECHO)));
        let mut registry = prometheus_client::registry::Registry::default();
        let proxy = DnsProxy::new(
            DnsConfig::default(),
            state.clone(),
            DnsMetrics::register(&mut registry),
        );
        let pod = pod(&state);
        let r = ask(&proxy, &pod, "echo.").await;
        assert_eq!(
            r.answers[0].data,
            RData::A("10.96.0.10".parse::<std::net::Ipv4Addr>().unwrap().into())
        );
        // Not a mesh name (yet), and no upstream: SERVFAIL, counted as a failure.
        assert_eq!(
            ask(&proxy, &pod, "new.").await.metadata.response_code,
            ResponseCode::ServFail
        );
        // A service pushed later is answered at once (the index follows the state).
        state.store(mesh(&format!("{ECHO}{NEW}")));
        let r = ask(&proxy, &pod, "new.default.").await;
        assert_eq!(
            r.answers[0].data,
            RData::A("10.96.0.20".parse::<std::net::Ipv4Addr>().unwrap().into())
        );
        state.store(mesh(NEW));
        assert_eq!(
            ask(&proxy, &pod, "echo.").await.metadata.response_code,
            ResponseCode::ServFail,
            "removed service"
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let labels = "{request_query_type=\"a\",request_protocol=\"udp\",source_canonical_service=\"sleep\",source_canonical_revision=\"unknown\"}";
        for want in [
            format!("istio_dns_requests_total{labels} 4"),
            format!("istio_dns_upstream_requests_total{labels} 2"),
            format!("istio_dns_upstream_failures_total{labels} 2"),
        ] {
            assert!(text.contains(&want), "{want} in\n{text}");
        }
    }
}
