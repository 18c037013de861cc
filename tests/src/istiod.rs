//! Istio's istiod itself as the control plane of end-to-end tests: `pilot-discovery
//! discovery`, built from Istio's Go module (the version tests/istio pins; its go.mod's
//! `tool` line), against the real API server of [`crate::kube_apiserver`]. Where
//! [`crate::istio_xds`] runs istiod's discovery server and CA as a library over a fake
//! cluster, this is the program Istio ships, reading the cluster as it does in one: its
//! informers, its ambient index, its self-signed CA (the root it writes into every
//! namespace as ConfigMap `istio-ca-root-cert`), its token authentication by TokenReview
//! and its node authorizer (`CA_TRUSTED_NODE_ACCOUNTS`), xDS and CA over TLS on 15012.
//!
//! It runs in a network namespace the test gives (node 1's, so every node's ztunnel
//! reaches it at [`ISTIOD`]), with the API server's admin kubeconfig, its working
//! directory and log under the test's directory; it is stopped on drop (SIGTERM, then
//! SIGKILL), also when the test fails.
//!
//! The program is built once per test process with `go build` (Go's cache makes that
//! seconds once tests/istio's other programs are built: it shares their packages), or
//! taken ready-built from `ZTUNNEL_TEST_PILOT_DISCOVERY` (scripts/test.sh builds it
//! beside the Rust build). Without Go the tests fail saying so.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::fake_istiod::{http_get, ISTIOD_SAN};
use crate::kube_apiserver::KubeApiServer;
use crate::netsim::{Child, Netns};

/// istiod's xDS and CA (gRPC over TLS, its port 15012) on node 1.
pub const ISTIOD: &str = "10.0.0.1:15012";
/// Its readiness endpoint (`/ready` on its HTTP port, what its pod's probe reads).
const READY_AT: &str = "127.0.0.1:8080";
/// The node agents' service account, the one `CA_TRUSTED_NODE_ACCOUNTS` trusts (as in
/// Istio's charts).
pub const ZTUNNEL_NS: &str = "istio-system";
pub const ZTUNNEL_SA: &str = "ztunnel";
/// The audience of the tokens istiod takes (Istio's charts project the pods' tokens
/// with it).
pub const AUDIENCE: &str = "istio-ca";

/// How long istiod may take to be ready (informers synced, CA and certificates made).
const START: Duration = Duration::from_secs(90);

static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// `pilot-discovery`: `ZTUNNEL_TEST_PILOT_DISCOVERY`, else built on first use from
/// tests/istio into the target directory the test binary runs from.
pub fn binary() -> Result<&'static Path> {
    match BINARY.get_or_init(|| {
        crate::istio_xds::go_build(
            &crate::istio_xds::module_dir(),
            "ZTUNNEL_TEST_PILOT_DISCOVERY",
            "pilot-discovery",
            "istio.io/istio/pilot/cmd/pilot-discovery",
        )
        .map_err(|e| format!("{e:#}"))
    }) {
        Ok(p) => Ok(p.as_path()),
        Err(e) => {
            bail!("istiod (pilot-discovery, Istio's module in tests/istio) could not be built: {e}")
        }
    }
}

/// A running istiod; stopped on drop.
pub struct Istiod {
    child: Child,
    pub addr: SocketAddr,
}

impl Istiod {
    /// Starts `pilot-discovery discovery` in `netns` against `kube` (as the admin), in
    /// ambient mode, cluster `Kubernetes`, namespace istio-system; files go to
    /// `dir/istiod`. Returns once `/ready` answers 200.
    pub async fn start(netns: &Netns, kube: &KubeApiServer, dir: &Path) -> Result<Istiod> {
        let bin = binary()?.display().to_string();
        let dir = dir.join("istiod");
        std::fs::create_dir_all(&dir)?;
        let kubeconfig = dir.join("kubeconfig");
        kube.write_admin_kubeconfig(&kubeconfig)?;
        let p = |f: &str| dir.join(f).display().to_string();
        let workdir = dir.display().to_string();
        let args = [
            // Its relative paths (./etc/cacerts, ./var/lib/istio/inject, ...) are then the
            // test's: none exists, so a self-signed CA and no injector, as a fresh install.
            "-C",
            &workdir,
            &bin,
            "discovery",
            &format!("--kubeconfig={}", p("kubeconfig")),
            // No mesh file: the `istio` ConfigMap of istio-system, else Istio's defaults.
            &format!("--meshConfig={}", p("mesh")),
            &format!("--networksConfig={}", p("meshNetworks")),
            "--log_output_level=default:info",
        ];
        let env = [
            ("PILOT_ENABLE_AMBIENT", "true"),
            ("CLUSTER_ID", "Kubernetes"),
            ("POD_NAMESPACE", "istio-system"),
            ("POD_NAME", "istiod-test"),
            // Node agents allowed to ask for their pods' identities (Istio's chart sets
            // this for the ztunnel service account).
            ("CA_TRUSTED_NODE_ACCOUNTS", "istio-system/ztunnel"),
            ("HOME", &workdir),
        ];
        // Beside the topology's other logs (ZTUNNEL_TEST_KEEP_LOGS keeps it).
        let log = dir.parent().unwrap_or(&dir).join("istiod.log");
        let child = netns.spawn("env", &args, &env, &log)?;
        let istiod = Istiod {
            child,
            addr: ISTIOD.parse()?,
        };
        let deadline = Instant::now() + START;
        loop {
            if istiod.child.exited() {
                bail!(
                    "istiod exited before it was ready:\n{}",
                    istiod.log_tail(60)
                );
            }
            let last = match http_get(netns, READY_AT.parse()?, "/ready").await {
                Ok((200, _)) => return Ok(istiod),
                Ok((code, body)) => format!("{code} {body}"),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                bail!(
                    "istiod not ready after {START:?} (last: {last}):\n{}",
                    istiod.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn log_text(&self) -> String {
        self.child.log_text()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let v: Vec<&str> = text.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    /// A ztunnel's environment as Istio's ztunnel chart sets it, for this istiod: xDS
    /// and CA at istiod's address, checked as `istiod.istio-system.svc` against
    /// `root` (a file with the root of ConfigMap `istio-ca-root-cert`), the token in file
    /// `token`, cluster Kubernetes, namespace and service account of the ztunnel pods.
    pub fn ztunnel_env(&self, root: &Path, token: &Path) -> Vec<(String, String)> {
        let addr = format!("https://{}", self.addr);
        let root = root.display().to_string();
        [
            ("XDS_ADDRESS", addr.as_str()),
            ("CA_ADDRESS", addr.as_str()),
            ("ALT_XDS_HOSTNAME", ISTIOD_SAN),
            ("ALT_CA_HOSTNAME", ISTIOD_SAN),
            ("XDS_ROOT_CA", root.as_str()),
            ("CA_ROOT_CA", root.as_str()),
            ("ISTIO_TOKEN_PATH", &token.display().to_string()),
            ("CLUSTER_ID", "Kubernetes"),
            ("POD_NAMESPACE", ZTUNNEL_NS),
            ("SERVICE_ACCOUNT", ZTUNNEL_SA),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// The root istiod's CA writes into `namespace` (ConfigMap `istio-ca-root-cert`, key
/// `root-cert.pem`, what Istio's charts mount into the ztunnel pod), once it is there.
pub async fn root_cert(kube: &KubeApiServer, namespace: &str) -> Result<String> {
    let path = format!("/api/v1/namespaces/{namespace}/configmaps/istio-ca-root-cert");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = kube.get(&path).await?;
        if r.status == 200 {
            if let Some(pem) = r.json()?["data"]["root-cert.pem"].as_str() {
                return Ok(pem.to_string());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "no istio-ca-root-cert in {namespace}: {} {}",
                r.status,
                r.body
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A token of service account `namespace/sa` bound to pod `namespace/pod` (its uid read
/// from the API server) with audience `audience`, from the TokenRequest API: what the
/// kubelet projects into Istio's ztunnel pod as `istio-token`.
pub async fn pod_token(
    kube: &KubeApiServer,
    namespace: &str,
    sa: &str,
    pod: &str,
    audience: &str,
) -> Result<String> {
    let uid = kube_uid(kube, namespace, pod).await?;
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [audience], "expirationSeconds": 3600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid}}});
    let r = kube
        .request_as(
            None,
            "POST",
            &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token"),
            Some("application/json"),
            Some(req.to_string().into_bytes()),
        )
        .await?;
    if r.status != 201 && r.status != 200 {
        bail!("TokenRequest for {namespace}/{sa}: {} {}", r.status, r.body);
    }
    r.json()?["status"]["token"]
        .as_str()
        .map(str::to_string)
        .context("TokenRequest answer without a token")
}

/// The uid the API server gave pod `namespace/name` (what istio-cni enrolls it by).
pub async fn kube_uid(kube: &KubeApiServer, namespace: &str, name: &str) -> Result<String> {
    let r = kube
        .get(&format!("/api/v1/namespaces/{namespace}/pods/{name}"))
        .await?;
    if r.status != 200 {
        bail!("pod {namespace}/{name}: {} {}", r.status, r.body);
    }
    r.json()?["metadata"]["uid"]
        .as_str()
        .map(str::to_string)
        .context("pod without uid")
}

/// A Namespace with `labels`.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// A Node (no kubelet: nothing but the object, which istiod reads localities from).
pub fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

pub fn service_account(namespace: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}})
}

/// A Pod scheduled on `node` (its status is written apart: `set_pod_running`).
pub fn pod(
    namespace: &str,
    name: &str,
    node: &str,
    sa: &str,
    labels: Value,
    annotations: Value,
) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": {"nodeName": node, "serviceAccountName": sa,
                 "containers": [{"name": "app", "image": "app"}]}})
}
