//! The DNS proxy, as Istio's ztunnel has it: UDP and TCP listeners on 127.0.0.1:15053
//! inside each enrolled pod (capture sends the pod's port-53 traffic there). A/AAAA
//! questions for mesh names (service hostnames, with Kubernetes search-domain expansion
//! from the asking pod's namespace; see `name`) are answered from the mesh state with
//! the services' VIPs; everything else is forwarded to the node's upstream resolvers
//! (`forwarder`) through a bounded, node-wide cache (`cache`). Counted in Istio's DNS
//! metrics (`metrics::dns`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, RecordType};

use crate::metrics::dns::{DnsLabels, DnsMetrics};
use crate::proxy::LocalPod;
use crate::state::{MeshState, SharedState};

pub mod cache;
pub mod forwarder;
pub mod message;
pub mod name;
pub mod resolver;
pub mod server;

/// The DNS proxy's port inside each pod (Istio's), on 127.0.0.1, UDP and TCP.
pub const PORT: u16 = 15053;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("no upstream DNS server (ztunnel's resolv.conf lists none); set --dns-upstream")]
    NoUpstream,
    #[error("cannot read {path}: {source}; set --dns-upstream")]
    ResolvConf { path: PathBuf, source: std::io::Error },
    #[error("invalid DNS upstream {0:?}: expected IP or IP:PORT")]
    BadUpstream(String),
    #[error("upstream DNS server {server}: {source}")]
    Upstream { server: SocketAddr, source: std::io::Error },
    #[error("upstream DNS server {server} did not answer within {timeout:?}")]
    Timeout { server: SocketAddr, timeout: Duration },
    #[error("upstream DNS server {server} sent an invalid answer: {reason}")]
    InvalidAnswer { server: SocketAddr, reason: &'static str },
    #[error("{0} DNS questions already in flight upstream; refusing more")]
    Overloaded(usize),
    #[error("cannot encode a DNS query: {0}")]
    Encode(String),
    #[error("cannot bind the DNS proxy on {addr} in pod {pod}: {source}")]
    Bind { pod: String, addr: SocketAddr, source: std::io::Error },
}

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
        }
    }
}

/// Questions in flight upstream, node-wide.
const MAX_UPSTREAM_IN_FLIGHT: usize = 1024;

/// How a question arrived (the `request_protocol` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    fn label(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// The node's DNS proxy, shared by every pod's listeners.
pub struct DnsProxy {
    state: Arc<SharedState>,
    cluster_domain: String,
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
            cluster_domain: cfg.cluster_domain.trim_end_matches('.').to_ascii_lowercase(),
            forwarder: forwarder::Forwarder::new(cfg.upstreams, cfg.attempt_timeout, cfg.total_timeout, MAX_UPSTREAM_IN_FLIGHT),
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
        let idx = Arc::new(resolver::MeshIndex::build(state, &self.cluster_domain));
        *slot = Some((state.clone(), idx.clone()));
        idx
    }

    /// The response to one message from `pod`, if it deserves one.
    pub async fn handle(&self, pod: &LocalPod, wire: &[u8], transport: Transport) -> Option<Vec<u8>> {
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
                self.metrics.request(&DnsLabels::new(query.query_type(), transport.label(), Some(&client)));
                Some(response)
            }
            Local::Forward { request, query, limit } => {
                let labels = DnsLabels::new(query.query_type(), transport.label(), Some(&client));
                self.metrics.request(&labels);
                let resp = self.forward(&request, &query, &labels, &client).await;
                Some(message::encode(&resp, limit))
            }
        }
    }

    /// Answers from the cache or the upstream resolvers; SERVFAIL when they fail.
    async fn forward(&self, req: &Message, q: &Query, labels: &DnsLabels, client: &crate::state::Workload) -> Message {
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
                    self.cache.insert(key.clone(), answer.wire, ttl, std::time::Instant::now());
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

/// What a message from a pod gets, decided without I/O (so it is testable and fuzzable).
#[derive(Debug)]
pub enum Local {
    /// Not worth an answer.
    Drop(&'static str),
    /// Refused at once (FORMERR, NOTIMP, BADVERS).
    Reject(Vec<u8>, &'static str),
    /// A mesh name, answered from the mesh state.
    Mesh { response: Vec<u8>, query: Query },
    /// Not ours: ask the upstream resolvers; the answer may be `limit` bytes.
    Forward { request: Box<Message>, query: Query, limit: usize },
}

/// Classifies `wire` from `client` and answers it if it is a mesh name in `index`.
pub fn answer_locally(index: &resolver::MeshIndex, client: &crate::state::Workload, wire: &[u8], transport: Transport) -> Local {
    let req = match message::classify(wire) {
        message::Incoming::Query(m) => m,
        message::Incoming::Reject(resp, reason) => return Local::Reject(resp, reason),
        message::Incoming::Drop(reason) => return Local::Drop(reason),
    };
    let limit = match transport {
        Transport::Udp => message::udp_limit(&req),
        Transport::Tcp => usize::from(u16::MAX),
    };
    // classify() lets through only messages with exactly one question.
    let Some(q) = req.queries.first().cloned() else { return Local::Drop("no question") };
    let asked = q.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
    let mesh = matches!(q.query_type(), RecordType::A | RecordType::AAAA) && q.query_class() == DNSClass::IN && !asked.is_empty();
    if let Some(answer) = mesh.then(|| index.lookup(&asked, client, q.query_type())).flatten() {
        tracing::debug!(src.workload = %client.name, src.namespace = %client.namespace,
            query = %q.query_type(), domain = %asked, service = %answer.service, endpoints = answer.addrs.len(), result = "mesh", "dns request");
        return Local::Mesh { response: message::encode(&message::mesh_response(&req, &answer), limit), query: q };
    }
    Local::Forward { request: req, query: q, limit }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode};
    use hickory_proto::rr::{Name, RData};

    fn mesh(services: &str) -> MeshState {
        let yaml = format!(
            "workloads:\n- {{uid: c, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE, node: n1, canonicalName: sleep}}\nservices:\n{services}"
        );
        let path = std::path::Path::new("t.yaml");
        crate::config::LocalConfig::parse(path, &yaml).unwrap().into_state(path).unwrap()
    }

    const ECHO: &str = "- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"]}\n";
    const NEW: &str = "- {name: new, namespace: default, hostname: new.default.svc.cluster.local, vips: [\"/10.96.0.20\"]}\n";

    fn pod(state: &SharedState) -> LocalPod {
        let workload = state.load().workload_by_uid(&crate::state::WorkloadUid("c".into())).unwrap().clone();
        LocalPod {
            identity: workload.identity(),
            ip: "10.10.1.11".parse().unwrap(),
            ipv4: "10.10.1.11".parse().unwrap(),
            workload,
            netns: crate::netns::InPodNetns::open(std::path::Path::new("/proc/self/ns/net")).unwrap(),
            active: Default::default(),
            inbound: Default::default(),
        }
    }

    async fn ask(proxy: &DnsProxy, pod: &LocalPod, name: &str) -> Message {
        let mut q = Message::new(7, MessageType::Query, OpCode::Query);
        q.queries.push(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        let wire = proxy.handle(pod, &q.to_vec().unwrap(), Transport::Udp).await.expect("an answer");
        Message::from_vec(&wire).unwrap()
    }

    #[tokio::test]
    async fn answers_follow_the_mesh_state_and_fail_without_upstream() {
        let state = Arc::new(SharedState::new(mesh(ECHO)));
        let mut registry = prometheus_client::registry::Registry::default();
        let proxy = DnsProxy::new(DnsConfig::default(), state.clone(), DnsMetrics::register(&mut registry));
        let pod = pod(&state);
        let r = ask(&proxy, &pod, "echo.").await;
        assert_eq!(r.answers[0].data, RData::A("10.96.0.10".parse::<std::net::Ipv4Addr>().unwrap().into()));
        // Not a mesh name (yet), and no upstream: SERVFAIL, counted as a failure.
        assert_eq!(ask(&proxy, &pod, "new.").await.metadata.response_code, ResponseCode::ServFail);
        // A service pushed later is answered at once (the index follows the state).
        state.store(mesh(&format!("{ECHO}{NEW}")));
        let r = ask(&proxy, &pod, "new.default.").await;
        assert_eq!(r.answers[0].data, RData::A("10.96.0.20".parse::<std::net::Ipv4Addr>().unwrap().into()));
        state.store(mesh(NEW));
        assert_eq!(ask(&proxy, &pod, "echo.").await.metadata.response_code, ResponseCode::ServFail, "removed service");
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
