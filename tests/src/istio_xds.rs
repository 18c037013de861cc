//! Istio's own discovery server as the control plane of end-to-end tests.
//!
//! `fake_istiod` serves what we believe istiod sends; this serves what istiod does send:
//! the Go program in `tests/istio/` (`cmd/istio-xds`) runs istiod's xDS server with its
//! ambient index (Istio's `pilot/test/xds` fake discovery server, Istio taken as a Go
//! module dependency, pinned in `tests/istio/go.mod`) over a fake Kubernetes cluster
//! holding the Pods, Services, Namespaces, Gateways and AuthorizationPolicies a test
//! writes as YAML. Tests change those objects while the mesh runs ([`IstioXds::apply`],
//! [`IstioXds::delete`]) and istiod pushes the result to our ztunnels.
//!
//! The program is built once per test process with `go build` (Go's build cache makes
//! that quick after the first time; the first build downloads Istio's dependencies and
//! takes minutes), or taken ready-built from `ZTUNNEL_TEST_ISTIO_XDS` (scripts/test.sh
//! builds it beside the Rust build). Without Go, or without the module, tests fail
//! saying so: nothing passes by skipping.
//!
//! The same program serves Istio's CA ([`ISTIO_CA`], as istiod does beside its xDS):
//! Istio's `IstioCertificateService` with an IstioCA signing with the test's root, Istio's
//! Kubernetes JWT authenticator and its node authorizer (`CA_TRUSTED_NODE_ACCOUNTS`:
//! `istio-system/ztunnel`). The one stand-in is the API server's TokenReview, answered
//! from a table of tokens this harness writes ([`IstioXds::token`]): a token names a
//! service account and, bound to a pod, the pod, as a projected service-account token
//! does. Ztunnels authenticate as the pod `istio-system/ztunnel-node<n>`
//! ([`ztunnel_pod_yaml`] in the cluster; [`IstioXds::ztunnel_env`]).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::fake_istiod::ISTIOD_SAN;
use crate::netsim::{Netns, Pod};

/// Where tests run Istio's discovery server: node 1.
pub const ISTIO_XDS: &str = "10.0.0.1:15010";
/// Where the same program serves Istio's CA (istiod's port).
pub const ISTIO_CA: &str = "10.0.0.1:15012";
/// The node agents' service account, the one `CA_TRUSTED_NODE_ACCOUNTS` trusts (as in
/// Istio's charts).
pub const ZTUNNEL_SA: &str = "istio-system/ztunnel";

/// How long Istio's server may take to start (its informers sync, a first push).
const START: Duration = Duration::from_secs(60);

/// The built program, or why it could not be built.
static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
/// `istioctl`, built from the same module, or why it could not be.
static ISTIOCTL: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// The Go module's directory (`tests/istio`).
pub fn module_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("istio")
}

/// The `istio-xds` program, built on first use into the target directory the test
/// binary runs from (`target/<profile>/istio-xds`).
pub fn binary() -> Result<&'static Path> {
    match BINARY.get_or_init(|| {
        build("ZTUNNEL_TEST_ISTIO_XDS", "istio-xds", "./cmd/istio-xds")
            .map_err(|e| format!("{e:#}"))
    }) {
        Ok(p) => Ok(p.as_path()),
        Err(e) => {
            bail!("Istio's discovery server (tests/istio, a Go program) could not be built: {e}")
        }
    }
}

/// The Go toolchain: `GO`, else `go` on PATH, else Go's usual install place (CI's
/// shell may not have it on PATH).
pub fn go_command() -> String {
    if let Ok(go) = std::env::var("GO") {
        return go;
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("go").is_file()));
    if !on_path && Path::new("/usr/local/go/bin/go").is_file() {
        return "/usr/local/go/bin/go".into();
    }
    "go".into()
}

/// Istio's `istioctl` from the same module (the go.mod's `tool` line pins it with
/// Istio), built on first use like [`binary`], or taken from `ZTUNNEL_TEST_ISTIOCTL`.
pub fn istioctl_binary() -> Result<&'static Path> {
    match ISTIOCTL.get_or_init(|| {
        build(
            "ZTUNNEL_TEST_ISTIOCTL",
            "istioctl",
            "istio.io/istio/istioctl/cmd/istioctl",
        )
        .map_err(|e| format!("{e:#}"))
    }) {
        Ok(p) => Ok(p.as_path()),
        Err(e) => bail!("istioctl (Istio's module, tests/istio) could not be built: {e}"),
    }
}

/// Runs `istioctl args` (no cluster: `-f` dump files only); its standard output, or an
/// error with its standard error when it fails.
pub fn istioctl(args: &[&str]) -> Result<String> {
    let bin = istioctl_binary()?;
    let out = Command::new(bin)
        .args(args)
        // No cluster to find: a kubeconfig that does not exist, a home of its own.
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env("HOME", std::env::temp_dir())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "istioctl {args:?} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `package` of this Go module built to `<target>/<profile>/<name>`, unless `var` names
/// a ready-built one.
fn build(var: &str, name: &str, package: &str) -> Result<PathBuf> {
    go_build(&module_dir(), var, name, package)
}

/// `package` of the Go module in `module` built to `<target>/<profile>/<name>`, unless
/// `var` names a ready-built one (the harnesses of tests/istio and tests/kube).
pub(crate) fn go_build(module: &Path, var: &str, name: &str, package: &str) -> Result<PathBuf> {
    // Built already (scripts/test.sh builds it beside the Rust build, not in the middle
    // of timing-sensitive tests): used as is.
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{var} names {}, which is not a file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("the test binary's own path")?;
    let dir = exe.parent().context("test binary has no directory")?;
    let dir = if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().context("deps has no parent")?
    } else {
        dir
    };
    let out = dir.join(name);
    let go = go_command();
    let started = Instant::now();
    let res = Command::new(&go)
        .current_dir(module)
        // Not a VCS checkout of its own: no VCS stamping. The toolchain on the machine,
        // never one downloaded behind the test's back.
        .env("GOFLAGS", "-buildvcs=false")
        .env("GOTOOLCHAIN", "local")
        .args(["build", "-o"])
        .arg(&out)
        .arg(package)
        .output()
        .with_context(|| format!("running `{go} build` (is Go installed and on PATH? the e2e tests against Istio need Go 1.26)"))?;
    if !res.status.success() {
        bail!(
            "`go build {package}` in {} failed:\n{}",
            module.display(),
            String::from_utf8_lossy(&res.stderr)
        );
    }
    eprintln!("built {} in {:.1?}", out.display(), started.elapsed());
    Ok(out)
}

/// The mesh root (Istio's CA signs workload certificates with it) and the server
/// certificate for `istiod.istio-system.svc` it signs, written to files: (root, root
/// key, certificate, key).
fn server_pki(dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf, PathBuf)> {
    let root_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut root_params = CertificateParams::default();
    root_params.distinguished_name = DistinguishedName::new();
    root_params
        .distinguished_name
        .push(DnType::OrganizationName, "istio-xds test root");
    root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    root_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let root = root_params.self_signed(&root_key)?;
    let issuer = Issuer::from_params(&root_params, &root_key);
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut sp = CertificateParams::new(vec![ISTIOD_SAN.to_string()])?;
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = sp.signed_by(&key, &issuer)?;
    let paths = (
        dir.join("istio-xds-root.pem"),
        dir.join("istio-xds-root-key.pem"),
        dir.join("istio-xds-cert.pem"),
        dir.join("istio-xds-key.pem"),
    );
    std::fs::write(&paths.0, root.pem())?;
    std::fs::write(&paths.1, root_key.serialize_pem())?;
    std::fs::write(&paths.2, cert.pem())?;
    std::fs::write(&paths.3, key.serialize_pem())?;
    Ok(paths)
}

/// A running `istio-xds`; killed on drop.
pub struct IstioXds {
    child: Mutex<std::process::Child>,
    stdin: Mutex<std::process::ChildStdin>,
    pub addr: SocketAddr,
    /// Where Istio's CA is served.
    pub ca_addr: SocketAddr,
    /// The mesh root: its serving certificate chains to it (ztunnel's XDS_ROOT_CA and
    /// CA_ROOT_CA) and Istio's CA signs with it.
    pub root_path: PathBuf,
    /// The token table the fake cluster's TokenReviews answer from.
    tokens: PathBuf,
    /// Its output (Istio's log, and the answers to changes).
    pub log: PathBuf,
    dir: PathBuf,
    changes: AtomicUsize,
}

impl Drop for IstioXds {
    fn drop(&mut self) {
        crate::netsim::terminate(self.child.get_mut().unwrap_or_else(|e| e.into_inner()));
    }
}

impl IstioXds {
    /// Builds (once) and starts Istio's discovery server in `netns`, serving `addr` with
    /// the cluster holding `objects` (multi-document YAML); files go to `dir`. Returns
    /// once it listens.
    pub fn start(netns: &Netns, addr: SocketAddr, dir: &Path, objects: &str) -> Result<IstioXds> {
        IstioXds::start_with_mesh(netns, addr, dir, objects, None)
    }

    /// As `start`, with `mesh` (MeshConfig YAML, as istiod's mesh ConfigMap) applied over
    /// Istio's defaults.
    pub fn start_with_mesh(
        netns: &Netns,
        addr: SocketAddr,
        dir: &Path,
        objects: &str,
        mesh: Option<&str>,
    ) -> Result<IstioXds> {
        let bin = binary()?;
        let mesh_args: Vec<String> = match mesh {
            Some(m) => {
                let p = dir.join("istio-mesh.yaml");
                std::fs::write(&p, m)?;
                vec!["--mesh".into(), p.display().to_string()]
            }
            None => Vec::new(),
        };
        let (root_path, root_key, cert, key) = server_pki(dir)?;
        let tokens = dir.join("istio-tokens.txt");
        std::fs::write(&tokens, "")?;
        let ca_addr: SocketAddr = ISTIO_CA.parse()?;
        let objects_path = dir.join("istio-objects.yaml");
        std::fs::write(&objects_path, objects)?;
        let log = dir.join("istio-xds.log");
        let f = std::fs::File::create(&log)?;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &netns.name])
            .arg(bin)
            .arg("--objects")
            .arg(&objects_path)
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--cert")
            .arg(&cert)
            .arg("--key")
            .arg(&key)
            .args(&mesh_args)
            .arg("--ca-listen")
            .arg(ca_addr.to_string())
            .arg("--ca-cert")
            .arg(&root_path)
            .arg("--ca-key")
            .arg(&root_key)
            .arg("--tokens")
            .arg(&tokens)
            // Istio derives its ambient flags from this when its packages load.
            .env("PILOT_ENABLE_AMBIENT", "true")
            // Node agents allowed to ask for their pods' identities (Istio's chart sets
            // this for the ztunnel service account).
            .env("CA_TRUSTED_NODE_ACCOUNTS", ZTUNNEL_SA)
            .stdin(Stdio::piped())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdin = child.stdin.take().context("istio-xds stdin")?;
        let x = IstioXds {
            child: Mutex::new(child),
            stdin: Mutex::new(stdin),
            addr,
            ca_addr,
            root_path,
            tokens,
            log,
            dir: dir.to_path_buf(),
            changes: AtomicUsize::new(0),
        };
        x.wait_log_line(&format!("listening on {addr}"), START)?;
        x.wait_log_line(&format!("CA listening on {ca_addr}"), START)?;
        Ok(x)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for `needle` in the log; fails early, with the log, if the process exits.
    fn wait_log_line(&self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.log_text();
            if text.contains(needle) {
                return Ok(());
            }
            if let Ok(Some(st)) = self
                .child
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .try_wait()
            {
                bail!("istio-xds exited ({st}) before {needle:?}; its log:\n{text}");
            }
            if Instant::now() > deadline {
                bail!("timed out waiting for {needle:?} from istio-xds; its log:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn change(&self, verb: &str, yaml: &str) -> Result<()> {
        let n = self.changes.fetch_add(1, Ordering::SeqCst);
        let path = self.dir.join(format!("istio-change-{n}.yaml"));
        std::fs::write(&path, yaml)?;
        let path = path.display().to_string();
        writeln!(
            self.stdin.lock().unwrap_or_else(|e| e.into_inner()),
            "{verb} {path}"
        )
        .context("writing to istio-xds")?;
        let done = if verb == "apply" {
            "applied"
        } else {
            "deleted"
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = self.log_text();
            if text.contains(&format!("{done} {path}\n")) {
                return Ok(());
            }
            if let Some(line) = text
                .lines()
                .find(|l| l.starts_with(&format!("error {path}:")))
            {
                bail!("istio-xds refused the change: {line}");
            }
            if Instant::now() > deadline {
                bail!("istio-xds did not answer `{verb} {path}`; its log:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Creates or updates the objects in `yaml` (multi-document) in the cluster, with
    /// their status; istiod pushes what changes.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        self.change("apply", yaml)
    }

    /// Deletes the objects named in `yaml`.
    pub fn delete(&self, yaml: &str) -> Result<()> {
        self.change("delete", yaml)
    }

    /// A bearer token for service account `sa` of namespace `ns`, bound to pod `pod`
    /// if given (the pod's name and uid then come with the review, as for a projected
    /// token), written to a file of the test directory; returns the file.
    pub fn token(&self, ns: &str, sa: &str, pod: Option<&str>) -> Result<PathBuf> {
        let name = format!("{ns}-{sa}-{}", pod.unwrap_or("unbound"));
        let token = format!("istio-token-{name}");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.tokens)
            .context("the token table")?;
        writeln!(f, "{token} {ns}/{sa} {}", pod.unwrap_or(""))?;
        let path = self.dir.join(format!("token-{name}"));
        std::fs::write(&path, token)?;
        Ok(path)
    }

    /// Environment for a proxy taking certificates from Istio's CA with the token in
    /// file `token`: the CA's address, its root (the mesh root), cluster id Kubernetes.
    pub fn ca_env(&self, token: &Path) -> Vec<(String, String)> {
        let root = self.root_path.display().to_string();
        vec![
            ("CA_ADDRESS".into(), format!("https://{}", self.ca_addr)),
            ("ALT_CA_HOSTNAME".into(), ISTIOD_SAN.into()),
            ("CA_ROOT_CA".into(), root),
            ("ISTIO_TOKEN_PATH".into(), token.display().to_string()),
            ("ISTIO_META_CLUSTER_ID".into(), "Kubernetes".into()),
        ]
    }

    /// Environment for a ztunnel: xDS from this server (verified against its root as
    /// `istiod.istio-system.svc`) and certificates from its CA, `token` as the
    /// service-account token, cluster id Kubernetes.
    pub fn env(&self, token: &Path) -> Vec<(String, String)> {
        let mut env = self.ca_env(token);
        env.push(("XDS_ADDRESS".into(), format!("https://{}", self.addr)));
        env.push(("ALT_XDS_HOSTNAME".into(), ISTIOD_SAN.into()));
        env.push(("XDS_ROOT_CA".into(), self.root_path.display().to_string()));
        env
    }

    /// Node `n`'s ztunnel as Istio deploys it: pod `ztunnel-node<n>` of istio-system
    /// ([`ztunnel_pod_yaml`]), service account ztunnel, with a token bound to that pod.
    pub fn ztunnel_env(&self, n: usize) -> Result<Vec<(String, String)>> {
        let (ns, sa) = ZTUNNEL_SA.split_once('/').context("ZTUNNEL_SA")?;
        let pod = format!("ztunnel-node{n}");
        let token = self.token(ns, sa, Some(&pod))?;
        let mut env = self.env(&token);
        env.push(("POD_NAME".into(), pod));
        env.push(("POD_NAMESPACE".into(), ns.into()));
        env.push(("SERVICE_ACCOUNT".into(), sa.into()));
        Ok(env)
    }
}

/// Namespace istio-system (not in ambient).
pub fn istio_system_yaml() -> String {
    "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: istio-system\n".into()
}

/// Node `n`'s ztunnel pod (istio-system/ztunnel-node<n>, service account ztunnel, uid
/// `ztunnel-node<n>-uid`), as the node authorizer looks it up. It has no IP in the
/// cluster (ours run in the node's netns, not as host-network pods istiod would list).
pub fn ztunnel_pod_yaml(n: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: ztunnel-node{n}\n  namespace: istio-system\n  uid: ztunnel-node{n}-uid\n  labels: {{app: ztunnel}}\n\
         spec:\n  nodeName: node{n}\n  serviceAccountName: ztunnel\n  containers: [{{name: istio-proxy, image: ztunnel}}]\n\
         status:\n  phase: Running\n"
    )
}

/// istiod's uid for pod `name` of namespace `ns` in cluster Kubernetes.
pub fn pod_uid(ns: &str, name: &str) -> String {
    format!("Kubernetes//Pod/{ns}/{name}")
}

/// A Namespace enrolled in ambient (`istio.io/dataplane-mode: ambient`).
pub fn ambient_namespace_yaml(name: &str) -> String {
    format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels:\n    istio.io/dataplane-mode: ambient\n")
}

/// A Node object (istiod reads a pod's locality from its node).
pub fn node_yaml(name: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n")
}

/// A running, ready Pod for the simulated `pod` (its addresses, its node), with
/// service account `sa`, `labels` and `annotations`.
pub fn pod_yaml(
    pod: &Pod,
    ns: &str,
    sa: &str,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> String {
    let map = |kv: &[(&str, &str)]| -> String {
        if kv.is_empty() {
            return " {}".into();
        }
        kv.iter()
            .map(|(k, v)| format!("\n    {k}: {v:?}"))
            .collect()
    };
    let ip = |a: &IpAddr| format!("{{ip: \"{a}\"}}");
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:{labels}\n  annotations:{annotations}\n\
         spec:\n  nodeName: node{node}\n  serviceAccountName: {sa}\n  containers: [{{name: app, image: app}}]\n\
         status:\n  phase: Running\n  podIP: \"{ip0}\"\n  podIPs: [{ips}]\n  conditions: [{{type: Ready, status: \"True\"}}]\n",
        name = pod.name,
        labels = map(labels),
        annotations = map(annotations),
        node = pod.node,
        ip0 = pod.ip,
        ips = pod.ips.iter().map(ip).collect::<Vec<_>>().join(", "),
    )
}

/// Joins YAML documents into one multi-document text.
pub fn docs(parts: &[String]) -> String {
    parts
        .iter()
        .map(|p| p.trim_end())
        .collect::<Vec<_>>()
        .join("\n---\n")
        + "\n"
}
