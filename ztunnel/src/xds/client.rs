//! The delta ADS stream to istiod: subscribe (wildcard) to workloads/services and to
//! authorization policies, apply each response, ACK it or NACK it with the reasons,
//! reconnect with backoff and the versions already held. While istiod is away the last
//! applied state keeps serving.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use prost_types::value::Kind;
use prost_types::{Struct, Value};
use tokio::sync::mpsc;

use super::proto::envoy::service::discovery::v3::{
    aggregated_discovery_service_client::AggregatedDiscoveryServiceClient, DeltaDiscoveryRequest,
    DeltaDiscoveryResponse, Node,
};
use super::proto::google::rpc::Status;
use super::proto::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use super::store::{Incoming, Store};
use crate::istiod::channel::{IstiodConfig, IstiodError};

/// `ISTIO_VERSION` in the xDS node metadata unless ISTIO_META_ISTIO_VERSION sets it (as
/// Istio's ztunnel image does): the Istio release whose ztunnel xDS API this one
/// follows, so istiod's version-gated behaviour is that release's. Not the crate
/// version: istiod would read 1.x crate versions as ancient Istio releases.
/// ZTUNNEL_ISTIO_VERSION at build time overrides it.
pub const ISTIO_VERSION: &str = match option_env!("ZTUNNEL_ISTIO_VERSION") {
    Some(v) => v,
    None => "1.32",
};

const TYPES: [&str; 2] = [ADDRESS_TYPE, AUTHORIZATION_TYPE];
/// Istio's ztunnel's limit: a large mesh's first full state exceeds tonic's 4 MiB default.
const MAX_DECODING_MESSAGE_SIZE: usize = 200 * 1024 * 1024;
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(15);
/// google.rpc.Code INVALID_ARGUMENT, for NACKs.
const INVALID_ARGUMENT: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error(transparent)]
    Istiod(#[from] IstiodError),
    #[error("xDS stream to istiod failed: {0}")]
    Stream(#[from] tonic::Status),
    #[error("the request stream to istiod closed")]
    SendClosed,
}

/// Who this proxy is, as istiod's node id and metadata describe it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub pod_ip: String,
    pub pod_name: String,
    pub pod_namespace: String,
    pub node_name: String,
    pub cluster_id: String,
    /// `ztunnel` for the node proxy (Istio's proxy type in the node id).
    pub proxy_type: String,
    /// Further metadata (ISTIO_META_* / ISTIO_METAJSON_*), over the fields above as in
    /// Istio's ztunnel.
    pub metadata: std::collections::BTreeMap<String, serde_json::Value>,
}

/// A JSON value as a protobuf `Value` (numbers become doubles, as in JSON).
fn json_to_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    let kind = match v {
        J::Null => Kind::NullValue(0),
        J::Bool(b) => Kind::BoolValue(*b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        J::String(s) => Kind::StringValue(s.clone()),
        J::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(json_to_value).collect(),
        }),
        J::Object(o) => Kind::StructValue(Struct {
            fields: o
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        }),
    };
    Value { kind: Some(kind) }
}

impl NodeInfo {
    /// `ztunnel~<pod ip>~<pod name>.<pod namespace>~<pod namespace>.svc.cluster.local`.
    pub fn id(&self) -> String {
        format!(
            "{}~{}~{}.{}~{}.svc.cluster.local",
            self.proxy_type, self.pod_ip, self.pod_name, self.pod_namespace, self.pod_namespace
        )
    }

    fn node(&self) -> Node {
        let s = |v: &str| Value {
            kind: Some(Kind::StringValue(v.to_string())),
        };
        let fields = [
            ("NAME", s(&self.pod_name)),
            ("NAMESPACE", s(&self.pod_namespace)),
            ("INSTANCE_IPS", s(&self.pod_ip)),
            ("NODE_NAME", s(&self.node_name)),
            ("CLUSTER_ID", s(&self.cluster_id)),
            // istiod warns without it and gates version-dependent config on it; Istio's
            // image sets it as ISTIO_META_ISTIO_VERSION, which (in `metadata`) wins.
            ("ISTIO_VERSION", s(ISTIO_VERSION)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(
            self.metadata
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v))),
        )
        .collect();
        Node {
            id: self.id(),
            cluster: String::new(),
            metadata: Some(Struct { fields }),
        }
    }
}

pub struct XdsConfig {
    pub istiod: IstiodConfig,
    pub node: NodeInfo,
    pub metrics: Option<crate::metrics::control::XdsMetrics>,
}

/// Readiness as Istio's ztunnel gates it on xDS: once a response of every subscribed
/// type was ACKed (a NACKed one leaves the state unknown, so it does not count).
struct Readiness<F: FnOnce()> {
    waiting: HashSet<&'static str>,
    ready: Option<F>,
}

impl<F: FnOnce()> Readiness<F> {
    fn new(ready: F) -> Self {
        Readiness {
            waiting: TYPES.into_iter().collect(),
            ready: Some(ready),
        }
    }

    /// A response of `type_url` was applied and answered (`acked`: without a NACK).
    fn answered(&mut self, type_url: &str, acked: bool) {
        if !acked {
            return;
        }
        self.waiting.remove(type_url);
        if self.waiting.is_empty() {
            if let Some(r) = self.ready.take() {
                tracing::info!("istiod's first full state received and ACKed");
                r();
            }
        }
    }
}

/// Keeps the stream up forever. `ready` runs once, when a response of each type has
/// been ACKed (the first full state).
pub async fn run(cfg: XdsConfig, store: Arc<Store>, ready: impl FnOnce() + Send + 'static) {
    let mut readiness = Readiness::new(ready);
    let mut backoff = BACKOFF_START;
    let channel = match cfg.istiod.channel() {
        Ok(c) => c,
        Err(e) => {
            // A bad address never gets better: say so loudly, keep serving what we have.
            tracing::error!(error = %e, "xDS disabled: cannot use the istiod address");
            return;
        }
    };
    loop {
        let mut progressed = false;
        let r = session(&cfg, &channel, &store, &mut |type_url, acked| {
            progressed = true;
            readiness.answered(type_url, acked);
        })
        .await;
        if progressed {
            backoff = BACKOFF_START;
        }
        let (w, s, p) = store.counts();
        if let Some(m) = &cfg.metrics {
            m.terminated(if r.is_ok() { "closed" } else { "error" });
        }
        match r {
            Ok(()) => {
                tracing::info!(retry_in = ?backoff, "istiod closed the xDS stream; reconnecting")
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, workloads = w, services = s, policies = p,
                "xDS stream to istiod lost; serving the last known state")
            }
        }
        // Full jitter keeps a fleet of proxies from reconnecting in lockstep.
        let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        tokio::time::sleep(jittered).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn session(
    cfg: &XdsConfig,
    channel: &tonic::transport::Channel,
    store: &Store,
    on_applied: &mut (dyn FnMut(&str, bool) + Send),
) -> Result<(), XdsError> {
    let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(16);
    let requests =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let node = cfg.node.node();
    for type_url in TYPES {
        // Wildcard subscription (no names); what we hold is announced so istiod sends
        // only what changed while we were away.
        let first = DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url: type_url.to_string(),
            initial_resource_versions: store.versions(type_url),
            ..Default::default()
        };
        tx.send(first).await.map_err(|_| XdsError::SendClosed)?;
    }
    let mut client = AggregatedDiscoveryServiceClient::new(channel.clone())
        .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE);
    let mut responses = client
        .delta_aggregated_resources(cfg.istiod.request(requests))
        .await?
        .into_inner();
    tracing::info!(address = %cfg.istiod.address, node = %node.id, "xDS stream to istiod open");
    while let Some(resp) = responses.message().await? {
        let errors = apply(store, &resp);
        if let Some(m) = &cfg.metrics {
            let bytes = resp
                .resources
                .iter()
                .filter_map(|r| r.resource.as_ref())
                .map(|a| a.value.len() as u64)
                .sum();
            m.message(&resp.type_url, bytes, errors.len() as u64);
            m.set_unenforceable("xds", store.unenforceable_policies());
        }
        let acked = errors.is_empty();
        let error_detail = (!acked).then(|| Status {
            code: INVALID_ARGUMENT,
            message: errors.join("; "),
            details: Vec::new(),
        });
        let ack = DeltaDiscoveryRequest {
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            error_detail,
            ..Default::default()
        };
        tx.send(ack).await.map_err(|_| XdsError::SendClosed)?;
        on_applied(&resp.type_url, acked);
    }
    Ok(())
}

/// Applies a response and returns what to NACK (empty: ACK).
fn apply(store: &Store, resp: &DeltaDiscoveryResponse) -> Vec<String> {
    let mut errors = Vec::new();
    let mut incoming = Vec::with_capacity(resp.resources.len());
    for r in &resp.resources {
        match &r.resource {
            Some(any) if any.type_url == resp.type_url => incoming.push(Incoming {
                name: &r.name,
                version: &r.version,
                bytes: &any.value,
            }),
            Some(any) => errors.push(format!(
                "{}: resource of type {} in a {} response",
                r.name, any.type_url, resp.type_url
            )),
            None => errors.push(format!("{}: resource without a body", r.name)),
        }
    }
    errors.extend(store.apply(&resp.type_url, &incoming, &resp.removed_resources));
    let kind = if resp.type_url == ADDRESS_TYPE {
        "addresses"
    } else {
        "authorizations"
    };
    if errors.is_empty() {
        tracing::info!(
            kind,
            updated = incoming.len(),
            removed = resp.removed_resources.len(),
            "xDS update applied (ACK)"
        );
    } else {
        tracing::warn!(kind, updated = incoming.len(), removed = resp.removed_resources.len(), rejected = errors.len(),
            errors = %errors.join("; "), "xDS update applied without rejected resources (NACK)");
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_has_istio_shape() {
        let n = NodeInfo {
            pod_ip: "10.244.1.5".into(),
            pod_name: "ztunnel-abcde".into(),
            pod_namespace: "istio-system".into(),
            node_name: "node1".into(),
            cluster_id: "Kubernetes".into(),
            proxy_type: "ztunnel".into(),
            metadata: [
                ("DNS_CAPTURE".to_string(), serde_json::json!("true")),
                (
                    "LABELS".to_string(),
                    serde_json::json!({"app": "ztunnel", "n": 2}),
                ),
            ]
            .into(),
        };
        assert_eq!(
            n.id(),
            "ztunnel~10.244.1.5~ztunnel-abcde.istio-system~istio-system.svc.cluster.local"
        );
        let node = n.node();
        let md = node.metadata.unwrap().fields;
        assert_eq!(
            md["NODE_NAME"].kind,
            Some(Kind::StringValue("node1".into()))
        );
        assert_eq!(
            md["INSTANCE_IPS"].kind,
            Some(Kind::StringValue("10.244.1.5".into()))
        );
        assert_eq!(
            md["ISTIO_VERSION"].kind,
            Some(Kind::StringValue(ISTIO_VERSION.into()))
        );
        // ISTIO_META_ISTIO_VERSION (as Istio's image sets it) wins over ours.
        let own = NodeInfo {
            metadata: [("ISTIO_VERSION".to_string(), serde_json::json!("1.29.1"))].into(),
            ..n.clone()
        };
        assert_eq!(
            own.node().metadata.unwrap().fields["ISTIO_VERSION"].kind,
            Some(Kind::StringValue("1.29.1".into()))
        );
        // ISTIO_META_* as strings, ISTIO_METAJSON_* as structured values.
        assert_eq!(
            md["DNS_CAPTURE"].kind,
            Some(Kind::StringValue("true".into()))
        );
        let Some(Kind::StructValue(labels)) = &md["LABELS"].kind else {
            panic!("{:?}", md["LABELS"])
        };
        assert_eq!(
            labels.fields["app"].kind,
            Some(Kind::StringValue("ztunnel".into()))
        );
        assert_eq!(labels.fields["n"].kind, Some(Kind::NumberValue(2.0)));
    }

    #[test]
    fn ready_once_each_type_was_acked() {
        let fired = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let f = fired.clone();
        let mut r = Readiness::new(move || {
            f.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let count = || fired.load(std::sync::atomic::Ordering::SeqCst);
        r.answered(ADDRESS_TYPE, true);
        // Both types arrived, but the policies were NACKed: not ready.
        r.answered(AUTHORIZATION_TYPE, false);
        assert_eq!(count(), 0);
        r.answered(ADDRESS_TYPE, true);
        assert_eq!(count(), 0);
        r.answered(AUTHORIZATION_TYPE, true);
        assert_eq!(count(), 1);
        r.answered(AUTHORIZATION_TYPE, true);
        assert_eq!(count(), 1, "once");
    }

    #[test]
    fn decodes_messages_up_to_istios_limit() {
        assert_eq!(MAX_DECODING_MESSAGE_SIZE, 200 * 1024 * 1024);
    }
}
