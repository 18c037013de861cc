//! Reaching istiod (xDS and the Istio CA): the flags and Istio environment variables
//! that say how, and the start of the CA client and the xDS client. The channel itself
//! (TLS, token, headers) is [`channel`].

pub mod channel;

pub use channel::{normalize_address, read_roots, IstiodConfig, IstiodError, RootCert, Token};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};

use crate::config::istio_env::{self, Env};
use crate::identity::istio_ca::IstioCa;
use crate::identity::manager::{CertManager, IdentityCert};
use crate::identity::Identity;
use crate::state::SharedState;
use crate::xds::client::NodeInfo;
use crate::xds::XdsConfig;

/// How a proxy reaches istiod, as flags and Istio's environment variables (shared by
/// ztunnel and the waypoint).
#[derive(clap::Args, Debug, Clone)]
pub struct IstiodArgs {
    /// istiod's xDS address (host:port or https://host:port): workloads, services and
    /// policies come from istiod (delta ADS) instead of a local file. Default in
    /// Kubernetes (KUBERNETES_SERVICE_HOST set) without a local config: istiod.istio-system.svc:15012.
    #[arg(long, env = "XDS_ADDRESS")]
    pub xds_address: Option<String>,
    /// Istio CA address (host:port or https://host:port): workload certificates come from
    /// istiod instead of the built-in CA. Default: the xDS address.
    #[arg(long, env = "CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// Name istiod's certificate is checked against for xDS (default: the address's host).
    #[arg(long, env = "ALT_XDS_HOSTNAME")]
    pub alt_xds_hostname: Option<String>,
    /// Name istiod's certificate is checked against for the CA (default: the address's host).
    #[arg(long, env = "ALT_CA_HOSTNAME")]
    pub alt_ca_hostname: Option<String>,
    /// Root certificate that istiod's xDS endpoint is verified with: a file, inline PEM,
    /// or SYSTEM (the system's trust store).
    #[arg(long, env = "XDS_ROOT_CA", default_value = DEFAULT_ROOT_CERT)]
    pub xds_root_ca: String,
    /// Root certificate of the Istio CA, a file or inline PEM: verifies istiod and is the
    /// mesh's trust root (so SYSTEM is refused). A file is watched; a change re-issues
    /// every certificate.
    #[arg(long, env = "CA_ROOT_CA", default_value = DEFAULT_ROOT_CERT)]
    pub ca_root_ca: String,
    /// Projected service-account token (audience istio-ca), re-read for every call.
    #[arg(long, env = "ISTIO_TOKEN_PATH", default_value = DEFAULT_TOKEN)]
    pub token_path: PathBuf,
    /// Istio's AUTH_TOKEN: a token file (re-read for every call) or, if no such file
    /// exists, the token itself; overrides --token-path.
    #[arg(long, env = "AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// This cluster's id: sent to istiod and the CA (`clusterid`); Istio's CLUSTER_ID also sets it.
    #[arg(long, env = "ISTIO_META_CLUSTER_ID", default_value = DEFAULT_CLUSTER_ID)]
    pub cluster_id: String,
    /// This proxy's pod (istiod's node id and metadata; its own identity).
    #[arg(long, env = "POD_NAME", default_value = "ztunnel")]
    pub pod_name: String,
    /// This proxy's namespace (its identity and istiod's node id).
    #[arg(long, env = "POD_NAMESPACE", default_value = "istio-system")]
    pub pod_namespace: String,
    /// This proxy's pod IP (istiod's node id and INSTANCE_IPS metadata).
    #[arg(long, env = "INSTANCE_IP", default_value = "")]
    pub instance_ip: String,
    /// This proxy's service account (its own identity).
    #[arg(long, env = "SERVICE_ACCOUNT", default_value = "ztunnel")]
    pub service_account: String,
    /// The mesh's trust domain (SPIFFE identities spiffe://<this>/ns/../sa/..).
    #[arg(long, env = "TRUST_DOMAIN", default_value = crate::identity::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// gRPC headers for xDS and the CA (Istio's XDS_HEADER_*, CA_HEADER_*), from
    /// [`IstiodArgs::apply_istio_env`].
    #[arg(skip)]
    pub xds_headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
    #[arg(skip)]
    pub ca_headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
    /// Extra xDS node metadata (Istio's ISTIO_META_*, ISTIO_METAJSON_*).
    #[arg(skip)]
    pub node_metadata: BTreeMap<String, serde_json::Value>,
}

impl IstiodArgs {
    /// This proxy's own identity (its pod's service account).
    pub fn own_identity(&self) -> Identity {
        Identity::new(
            &self.trust_domain,
            &self.pod_namespace,
            &self.service_account,
        )
    }

    /// Istio's defaults and environment-only settings, applied over the parsed flags:
    /// addresses without a scheme get `https://`; in Kubernetes (KUBERNETES_SERVICE_HOST)
    /// without a local config (`local_config`), xDS defaults to istiod's address; the CA
    /// defaults to the xDS address unless the built-in CA was chosen (`builtin_ca`), so
    /// a node never makes its own CA silently; CLUSTER_ID when ISTIO_META_CLUSTER_ID is
    /// unset; AUTH_TOKEN; XDS_HEADER_* / CA_HEADER_*; ISTIO_META_* / ISTIO_METAJSON_* for
    /// the node metadata. Returns warnings to log.
    pub fn apply_istio_env(
        &mut self,
        env: &Env,
        local_config: bool,
        builtin_ca: bool,
    ) -> Result<Vec<String>, IstiodError> {
        let mut warnings = Vec::new();
        let non_empty = |a: &Option<String>| {
            a.as_deref()
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(normalize_address)
        };
        self.xds_address = non_empty(&self.xds_address);
        if self.xds_address.is_none()
            && !local_config
            && env.get("KUBERNETES_SERVICE_HOST").is_some()
        {
            self.xds_address = Some(DEFAULT_ADDRESS.to_string());
        }
        self.ca_address = non_empty(&self.ca_address);
        if builtin_ca {
            if let Some(ca) = self.ca_address.take() {
                warnings.push(format!(
                    "FAKE_CA=true: the built-in CA signs certificates; CA_ADDRESS {ca} is not used"
                ));
            }
        } else if self.ca_address.is_none() {
            self.ca_address = self.xds_address.clone();
        }
        if env.get("ISTIO_META_CLUSTER_ID").is_none() && self.cluster_id == DEFAULT_CLUSTER_ID {
            if let Some(id) = env.non_empty("CLUSTER_ID") {
                self.cluster_id = id.to_string();
            }
        }
        if self.ca_address.is_some() && RootCert::from_setting(&self.ca_root_ca) == RootCert::System
        {
            return Err(IstiodError::SystemCaRoot);
        }
        self.xds_headers = istio_env::headers(env, "XDS_HEADER_")?;
        self.ca_headers = istio_env::headers(env, "CA_HEADER_")?;
        let (meta, meta_warnings) = istio_env::node_metadata(env);
        self.node_metadata = meta;
        warnings.extend(meta_warnings);
        Ok(warnings)
    }

    /// The bearer token source: AUTH_TOKEN (a file if one exists there or it looks like
    /// a path, else the token itself), else --token-path.
    fn token(&self) -> Token {
        match self.auth_token.as_deref().filter(|t| !t.is_empty()) {
            Some(t)
                if std::path::Path::new(t).exists()
                    || t.starts_with('/')
                    || t.starts_with("./") =>
            {
                Token::File(PathBuf::from(t))
            }
            Some(t) => Token::Static(t.trim().into()),
            None => Token::File(self.token_path.clone()),
        }
    }

    fn config(
        &self,
        address: &str,
        alt: &Option<String>,
        root: &str,
        headers: &[(AsciiMetadataKey, AsciiMetadataValue)],
    ) -> IstiodConfig {
        IstiodConfig {
            address: address.to_string(),
            alt_hostname: alt.clone(),
            root_cert: RootCert::from_setting(root),
            token: Some(self.token()),
            cluster_id: self.cluster_id.clone(),
            client_cert: None,
            headers: headers.to_vec(),
        }
    }

    /// Certificates from the Istio CA when CA_ADDRESS is set (None: use another CA). A
    /// change of the mesh root file re-issues every certificate.
    pub fn istio_ca(&self, ttl: Duration) -> Result<Option<Arc<CertManager>>, IstiodError> {
        let Some(address) = &self.ca_address else {
            return Ok(None);
        };
        let cfg = self.config(
            address,
            &self.alt_ca_hostname,
            &self.ca_root_ca,
            &self.ca_headers,
        );
        // The CA's root is also the mesh's trust root: never the system store.
        if cfg.root_cert == RootCert::System {
            return Err(IstiodError::SystemCaRoot);
        }
        cfg.host_port()?;
        let root = cfg.root_cert.clone();
        let ca = IstioCa::new(cfg, ttl, Some(self.own_identity()))?;
        let certs = CertManager::new(Arc::new(ca));
        if let RootCert::File(path) = root {
            tokio::spawn(watch_roots(path, certs.clone()));
        }
        Ok(Some(certs))
    }

    /// Starts the xDS client (XDS_ADDRESS must be set) feeding `state`; `ready` runs once
    /// istiod's first full state is in. With the Istio CA, the stream is mTLS with this
    /// proxy's own certificate, which gets a moment to arrive first.
    pub async fn start_xds(
        &self,
        proxy_type: &str,
        node_name: &str,
        certs: &Arc<CertManager>,
        state: Arc<SharedState>,
        metrics: &crate::metrics::Metrics,
        ready: impl FnOnce() + Send + 'static,
    ) -> Result<(), IstiodError> {
        let Some(address) = &self.xds_address else {
            return Ok(());
        };
        let mut cfg = self.config(
            address,
            &self.alt_xds_hostname,
            &self.xds_root_ca,
            &self.xds_headers,
        );
        if self.ca_address.is_some() {
            let own = self.own_identity();
            certs.allow(&own);
            if tokio::time::timeout(OWN_CERT_WAIT, certs.fetch(&own))
                .await
                .map_or(true, |r| r.is_err())
            {
                tokio::spawn(fetch_own_certificate(certs.clone(), own.clone()));
            }
            cfg.client_cert = Some(Arc::new(IdentityCert {
                certs: certs.clone(),
                identity: own,
            }));
        }
        // Fail now on an address that can never work.
        cfg.host_port()?;
        let node = NodeInfo {
            pod_ip: self.instance_ip.clone(),
            pod_name: self.pod_name.clone(),
            pod_namespace: self.pod_namespace.clone(),
            node_name: node_name.to_string(),
            cluster_id: self.cluster_id.clone(),
            proxy_type: proxy_type.to_string(),
            metadata: self.node_metadata.clone(),
        };
        let store = Arc::new(crate::xds::Store::new(state));
        tokio::spawn(crate::xds::run(
            XdsConfig {
                istiod: cfg,
                node,
                metrics: Some(metrics.xds.clone()),
            },
            store,
            ready,
        ));
        Ok(())
    }
}

/// How long start-up waits for the proxy's own certificate before xDS connects with the
/// token alone.
const OWN_CERT_WAIT: Duration = Duration::from_secs(5);
/// How often the mesh root file is checked for changes.
const ROOT_POLL: Duration = Duration::from_secs(2);

/// The proxy's own certificate (for mTLS to istiod), retried until the CA gives one.
async fn fetch_own_certificate(certs: Arc<CertManager>, identity: Identity) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match certs.fetch(&identity).await {
            Ok(c) => {
                return tracing::info!(identity = %identity, serial = %c.cert.serial, "own certificate issued by the Istio CA")
            }
            Err(e) => {
                tracing::warn!(identity = %identity, error = %e, retry_in = ?backoff, "cannot get our own certificate yet")
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// A changed mesh root (the istio-ca-root-cert ConfigMap) re-issues every certificate,
/// so chains and trust move to the new root without waiting for half-life.
async fn watch_roots(path: PathBuf, certs: Arc<CertManager>) {
    crate::config::watch_file(path.clone(), ROOT_POLL, || {
        tracing::info!(path = %path.display(), "mesh root certificate changed; re-issuing certificates");
        certs.reissue_all();
        std::future::ready(())
    })
    .await
}

/// Istio's defaults (ztunnel's environment variables of the same meaning in brackets).
pub const DEFAULT_ADDRESS: &str = "https://istiod.istio-system.svc:15012";
pub const DEFAULT_ROOT_CERT: &str = "/var/run/secrets/istio/root-cert.pem";
pub const DEFAULT_TOKEN: &str = "/var/run/secrets/tokens/istio-token";
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        istiod: IstiodArgs,
    }

    fn args(flags: &[&str]) -> IstiodArgs {
        Cli::try_parse_from(std::iter::once("x").chain(flags.iter().copied()))
            .unwrap()
            .istiod
    }

    #[test]
    fn address_without_scheme_is_https() {
        let cfg = args(&[]).config(
            "istiod.istio-system.svc:15012",
            &None,
            DEFAULT_ROOT_CERT,
            &[],
        );
        assert_eq!(
            cfg.host_port().unwrap(),
            ("istiod.istio-system.svc".to_string(), 15012)
        );
        let cfg = args(&[]).config("https://[fd00::1]:15012", &None, DEFAULT_ROOT_CERT, &[]);
        assert_eq!(cfg.host_port().unwrap(), ("fd00::1".to_string(), 15012));
        let err = args(&[])
            .config("http://istiod:15010", &None, DEFAULT_ROOT_CERT, &[])
            .host_port()
            .unwrap_err()
            .to_string();
        assert!(err.contains("TLS"), "{err}");
        assert_eq!(normalize_address("istiod:15012"), "https://istiod:15012");
    }

    #[test]
    fn istio_defaults_for_addresses() {
        let k8s = Env::from_pairs([("KUBERNETES_SERVICE_HOST", "10.96.0.1")]);
        // In Kubernetes without a local config: istiod, for xDS and the CA.
        let mut a = args(&[]);
        a.apply_istio_env(&k8s, false, false).unwrap();
        assert_eq!(a.xds_address.as_deref(), Some(DEFAULT_ADDRESS));
        assert_eq!(a.ca_address.as_deref(), Some(DEFAULT_ADDRESS));
        // XDS_ADDRESS without CA_ADDRESS: the CA is the xDS address, never a per-node CA.
        let mut a = args(&["--xds-address", "istiod-rev.istio-system.svc:15012"]);
        a.apply_istio_env(&Env::default(), false, false).unwrap();
        assert_eq!(
            a.xds_address.as_deref(),
            Some("https://istiod-rev.istio-system.svc:15012")
        );
        assert_eq!(
            a.ca_address.as_deref(),
            Some("https://istiod-rev.istio-system.svc:15012")
        );
        // An explicit CA address stays; an empty one is unset.
        let mut a = args(&["--xds-address", "x:1", "--ca-address", "ca.example:15012"]);
        a.apply_istio_env(&k8s, false, false).unwrap();
        assert_eq!(a.ca_address.as_deref(), Some("https://ca.example:15012"));
        let mut a = args(&["--xds-address", "", "--ca-address", ""]);
        a.apply_istio_env(&Env::default(), true, false).unwrap();
        assert_eq!((a.xds_address, a.ca_address), (None, None));
        // Standalone (local config, outside or inside Kubernetes): no istiod.
        let mut a = args(&[]);
        a.apply_istio_env(&k8s, true, false).unwrap();
        assert_eq!((a.xds_address, a.ca_address), (None, None));
        // FAKE_CA: the built-in CA, even with istiod.
        let mut a = args(&["--ca-address", "ca:1"]);
        let w = a.apply_istio_env(&k8s, false, true).unwrap();
        assert_eq!(a.ca_address, None);
        assert!(w.iter().any(|w| w.contains("FAKE_CA")), "{w:?}");
    }

    #[test]
    fn cluster_id_token_headers_and_metadata_from_env() {
        let env = Env::from_pairs([
            ("CLUSTER_ID", "c2"),
            ("XDS_HEADER_X-Tenant", "t1"),
            ("CA_HEADER_X-Ca", "c"),
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("ISTIO_METAJSON_LABELS", "{\"a\":\"b\"}"),
        ]);
        let mut a = args(&[
            "--xds-address",
            "istiod:15012",
            "--auth-token",
            "static-token",
        ]);
        a.apply_istio_env(&env, false, false).unwrap();
        assert_eq!(
            a.cluster_id, "c2",
            "CLUSTER_ID applies when ISTIO_META_CLUSTER_ID is unset"
        );
        assert_eq!(a.node_metadata["DNS_CAPTURE"], serde_json::json!("true"));
        assert_eq!(a.node_metadata["LABELS"], serde_json::json!({"a": "b"}));
        let cfg = a.config("istiod:15012", &None, DEFAULT_ROOT_CERT, &a.xds_headers);
        assert!(matches!(&cfg.token, Some(Token::Static(t)) if &**t == "static-token"));
        assert!(
            !format!("{cfg:?}").contains("static-token"),
            "the token never reaches Debug"
        );
        let req = cfg.request(());
        assert_eq!(req.metadata().get("x-tenant").unwrap(), "t1");
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer static-token"
        );
        assert_eq!(req.metadata().get("clusterid").unwrap(), "c2");
        assert!(req.metadata().get("x-ca").is_none());
        let ca = a
            .config("istiod:15012", &None, DEFAULT_ROOT_CERT, &a.ca_headers)
            .request(());
        assert_eq!(ca.metadata().get("x-ca").unwrap(), "c");
        // ISTIO_META_CLUSTER_ID wins over CLUSTER_ID.
        let mut a = args(&["--cluster-id", "meta"]);
        a.apply_istio_env(
            &Env::from_pairs([("CLUSTER_ID", "c2"), ("ISTIO_META_CLUSTER_ID", "meta")]),
            true,
            false,
        )
        .unwrap();
        assert_eq!(a.cluster_id, "meta");
        // AUTH_TOKEN naming a file reads the file; a token file header cannot be overridden.
        let dir = std::env::temp_dir().join(format!("istiod-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let mut a = args(&["--auth-token", file.to_str().unwrap()]);
        a.apply_istio_env(
            &Env::from_pairs([("XDS_HEADER_authorization", "Bearer forged")]),
            true,
            false,
        )
        .unwrap();
        let req = a
            .config("istiod:15012", &None, DEFAULT_ROOT_CERT, &a.xds_headers)
            .request(());
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer from-file"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn root_cert_settings() {
        assert_eq!(RootCert::from_setting("SYSTEM"), RootCert::System);
        assert_eq!(
            RootCert::from_setting("/etc/root.pem"),
            RootCert::File("/etc/root.pem".into())
        );
        let ca = rcgen::generate_simple_self_signed(vec!["istiod".to_string()]).unwrap();
        let pem = ca.cert.pem();
        let inline = RootCert::from_setting(&pem);
        assert!(matches!(inline, RootCert::Pem(_)));
        assert_eq!(inline.read().unwrap().len(), 1);
        assert!(matches!(
            RootCert::from_setting("-----BEGIN CERTIFICATE-----\nnope\n").read(),
            Err(IstiodError::NoInlineRootCert)
        ));
        // The CA's root is the mesh's trust root: SYSTEM is refused for it.
        let mut a = args(&["--ca-root-ca", "SYSTEM", "--xds-root-ca", "SYSTEM"]);
        let err = a
            .apply_istio_env(
                &Env::from_pairs([("KUBERNETES_SERVICE_HOST", "x")]),
                false,
                false,
            )
            .unwrap_err();
        assert!(matches!(err, IstiodError::SystemCaRoot), "{err}");
        // For xDS alone (built-in CA) it is fine.
        let mut a = args(&["--xds-root-ca", "SYSTEM", "--xds-address", "istiod:15012"]);
        a.apply_istio_env(&Env::default(), false, true).unwrap();
        assert_eq!(
            a.config("istiod:15012", &None, &a.xds_root_ca, &[])
                .root_cert,
            RootCert::System
        );
    }
}
