//! The gRPC connection to istiod (xDS and the Istio CA): TLS verified against the mesh
//! root file, ALPN h2, the projected service-account token as a bearer token (re-read
//! on every call: the kubelet rotates it) and the `clusterid` header.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, ServerName};
use tonic::transport::{Channel, Endpoint};

use crate::identity::istio_ca::IstioCa;
use crate::identity::manager::{CertManager, IdentityCert};
use crate::identity::Identity;
use crate::state::SharedState;
use crate::tls::CurrentCert;
use crate::xds::client::NodeInfo;
use crate::xds::XdsConfig;

/// How a proxy reaches istiod, as flags and Istio's environment variables (shared by
/// ztunnel and the waypoint).
#[derive(clap::Args, Debug, Clone)]
pub struct IstiodArgs {
    /// istiod's xDS address (https://host:port): workloads, services and policies come
    /// from istiod (delta ADS) instead of a local file.
    #[arg(long, env = "XDS_ADDRESS")]
    pub xds_address: Option<String>,
    /// Istio CA address (https://host:port): workload certificates come from istiod
    /// instead of the built-in CA.
    #[arg(long, env = "CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// Name istiod's certificate is checked against for xDS (default: the address's host).
    #[arg(long, env = "ALT_XDS_HOSTNAME")]
    pub alt_xds_hostname: Option<String>,
    /// Name istiod's certificate is checked against for the CA (default: the address's host).
    #[arg(long, env = "ALT_CA_HOSTNAME")]
    pub alt_ca_hostname: Option<String>,
    /// Root certificate that istiod's xDS endpoint is verified with.
    #[arg(long, env = "XDS_ROOT_CA", default_value = DEFAULT_ROOT_CERT)]
    pub xds_root_ca: PathBuf,
    /// Root certificate of the Istio CA: verifies istiod and is the mesh's trust root.
    /// Watched; a change re-issues every certificate.
    #[arg(long, env = "CA_ROOT_CA", default_value = DEFAULT_ROOT_CERT)]
    pub ca_root_ca: PathBuf,
    /// Projected service-account token (audience istio-ca), re-read for every call.
    #[arg(long, env = "ISTIO_TOKEN_PATH", default_value = DEFAULT_TOKEN)]
    pub token_path: PathBuf,
    #[arg(long, env = "ISTIO_META_CLUSTER_ID", default_value = DEFAULT_CLUSTER_ID)]
    pub cluster_id: String,
    /// This proxy's pod (istiod's node id and metadata; its own identity).
    #[arg(long, env = "POD_NAME", default_value = "ztunnel")]
    pub pod_name: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "istio-system")]
    pub pod_namespace: String,
    #[arg(long, env = "INSTANCE_IP", default_value = "")]
    pub instance_ip: String,
    #[arg(long, env = "SERVICE_ACCOUNT", default_value = "ztunnel")]
    pub service_account: String,
    #[arg(long, env = "TRUST_DOMAIN", default_value = crate::identity::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
}

impl IstiodArgs {
    /// This proxy's own identity (its pod's service account).
    pub fn own_identity(&self) -> Identity {
        Identity::new(&self.trust_domain, &self.pod_namespace, &self.service_account)
    }

    fn config(&self, address: &str, alt: &Option<String>, root: &std::path::Path) -> IstiodConfig {
        IstiodConfig {
            address: address.to_string(),
            alt_hostname: alt.clone(),
            root_cert: root.to_path_buf(),
            token: Some(self.token_path.clone()),
            cluster_id: self.cluster_id.clone(),
            client_cert: None,
        }
    }

    /// Certificates from the Istio CA when CA_ADDRESS is set (None: use another CA). A
    /// change of the mesh root file re-issues every certificate.
    pub fn istio_ca(&self, ttl: Duration) -> Result<Option<Arc<CertManager>>, IstiodError> {
        let Some(address) = &self.ca_address else { return Ok(None) };
        let ca = IstioCa::new(self.config(address, &self.alt_ca_hostname, &self.ca_root_ca), ttl, Some(self.own_identity()))?;
        let certs = CertManager::new(Arc::new(ca));
        tokio::spawn(watch_roots(self.ca_root_ca.clone(), certs.clone()));
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
        let Some(address) = &self.xds_address else { return Ok(()) };
        let mut cfg = self.config(address, &self.alt_xds_hostname, &self.xds_root_ca);
        if self.ca_address.is_some() {
            let own = self.own_identity();
            certs.allow(&own);
            if tokio::time::timeout(OWN_CERT_WAIT, certs.fetch(&own)).await.map_or(true, |r| r.is_err()) {
                tokio::spawn(fetch_own_certificate(certs.clone(), own.clone()));
            }
            cfg.client_cert = Some(Arc::new(IdentityCert { certs: certs.clone(), identity: own }));
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
        };
        let store = Arc::new(crate::xds::Store::new(state));
        tokio::spawn(crate::xds::run(XdsConfig { istiod: cfg, node, metrics: Some(metrics.xds.clone()) }, store, ready));
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
            Ok(c) => return tracing::info!(identity = %identity, serial = %c.cert.serial, "own certificate issued by the Istio CA"),
            Err(e) => tracing::warn!(identity = %identity, error = %e, retry_in = ?backoff, "cannot get our own certificate yet"),
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

#[derive(Debug, thiserror::Error)]
pub enum IstiodError {
    #[error("invalid istiod address {address:?}: {reason} (expected https://host:port)")]
    Address { address: String, reason: String },
    #[error("cannot read the istiod root certificate {path}: {source}; mount the istio-ca-root-cert ConfigMap there or set it with the root certificate option")]
    RootCert { path: PathBuf, source: std::io::Error },
    #[error("the istiod root certificate file {0} holds no PEM certificate")]
    NoRootCert(PathBuf),
    #[error("cannot resolve istiod host {host}: {source}")]
    Resolve { host: String, source: std::io::Error },
    #[error("cannot connect to istiod at {addr}: {source}")]
    Connect { addr: SocketAddr, source: std::io::Error },
    #[error("TLS to istiod ({server_name}) failed: {source}")]
    Tls { server_name: String, source: std::io::Error },
    #[error("cannot build the TLS config for istiod: {0}")]
    TlsConfig(#[from] rustls::Error),
}

/// How to reach istiod.
#[derive(Clone)]
pub struct IstiodConfig {
    /// `host:port` (Istio's form) or `https://host:port`.
    pub address: String,
    /// The name istiod's certificate is checked against (Istio's ALT_XDS_HOSTNAME /
    /// ALT_CA_HOSTNAME); default: the address's host.
    pub alt_hostname: Option<String>,
    pub root_cert: PathBuf,
    /// Projected service-account token (audience istio-ca); None: no bearer token.
    pub token: Option<PathBuf>,
    pub cluster_id: String,
    /// Presented as the client certificate when it has one (mTLS); the token alone
    /// authenticates otherwise.
    pub client_cert: Option<Arc<dyn CurrentCert>>,
}

impl std::fmt::Debug for IstiodConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IstiodConfig")
            .field("address", &self.address)
            .field("alt_hostname", &self.alt_hostname)
            .field("root_cert", &self.root_cert)
            .field("token", &self.token)
            .field("cluster_id", &self.cluster_id)
            .finish()
    }
}

/// The roots in a PEM file (re-read on every connection, so a rotated root applies).
pub fn read_roots(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, IstiodError> {
    use rustls_pki_types::pem::PemObject;
    let pem = std::fs::read(path).map_err(|source| IstiodError::RootCert { path: path.to_path_buf(), source })?;
    let roots: Vec<_> = CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok).collect();
    if roots.is_empty() {
        return Err(IstiodError::NoRootCert(path.to_path_buf()));
    }
    Ok(roots)
}

#[derive(Debug)]
struct ClientCert(Arc<dyn CurrentCert>);

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[rustls::SignatureScheme]) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.current()
    }

    fn has_certs(&self) -> bool {
        self.0.current().is_some()
    }
}

impl IstiodConfig {
    fn host_port(&self) -> Result<(String, u16), IstiodError> {
        let bad = |reason: &str| IstiodError::Address { address: self.address.clone(), reason: reason.into() };
        // Istio's form is `host:port` without a scheme (TLS implied); ours also takes https://.
        let address = if self.address.contains("://") { self.address.clone() } else { format!("https://{}", self.address) };
        let uri: Uri = address.parse().map_err(|_| bad("not a URI"))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("istiod is reached over TLS: use https://"));
        }
        let host = uri.host().ok_or_else(|| bad("no host"))?.trim_matches(|c| c == '[' || c == ']').to_string();
        Ok((host, uri.port_u16().unwrap_or(443)))
    }

    fn tls(&self) -> Result<rustls::ClientConfig, IstiodError> {
        let mut store = rustls::RootCertStore::empty();
        for r in read_roots(&self.root_cert)? {
            // A root that doesn't parse is skipped; an empty store fails every handshake.
            let _ = store.add(r);
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(store);
        let mut cfg = match &self.client_cert {
            Some(c) => builder.with_client_cert_resolver(Arc::new(ClientCert(c.clone()))),
            None => builder.with_no_client_auth(),
        };
        // gRPC servers (istiod's grpc-go) insist on ALPN h2.
        cfg.alpn_protocols = vec![crate::tls::ALPN_H2.to_vec()];
        Ok(cfg)
    }

    /// A channel that (re)connects on demand: TCP, then TLS with the root file as it is
    /// at that moment.
    pub fn channel(&self) -> Result<Channel, IstiodError> {
        let (host, port) = self.host_port()?;
        let server_name = self.alt_hostname.clone().unwrap_or_else(|| host.clone());
        let cfg = self.clone();
        // tonic sees plain http:// and leaves TLS to the connector.
        let endpoint = Endpoint::from_shared(format!("http://{host}:{port}"))
            .map_err(|e| IstiodError::Address { address: self.address.clone(), reason: e.to_string() })?
            .connect_timeout(Duration::from_secs(10))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        let connector = tower::service_fn(move |_uri: Uri| {
            let (cfg, host, server_name) = (cfg.clone(), host.clone(), server_name.clone());
            async move {
                let tls = cfg.tls()?;
                let addr = tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(|source| IstiodError::Resolve { host: host.clone(), source })?
                    .next()
                    .ok_or_else(|| IstiodError::Resolve { host: host.clone(), source: std::io::ErrorKind::NotFound.into() })?;
                let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|source| IstiodError::Connect { addr, source })?;
                let _ = tcp.set_nodelay(true);
                let name = ServerName::try_from(server_name.clone()).map_err(|e| IstiodError::Tls {
                    server_name: server_name.clone(),
                    source: std::io::Error::other(e),
                })?;
                let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
                    .connect(name, tcp)
                    .await
                    .map_err(|source| IstiodError::Tls { server_name: server_name.clone(), source })?;
                Ok::<_, IstiodError>(TokioIo::new(stream))
            }
        });
        Ok(endpoint.connect_with_connector_lazy(connector))
    }

    /// A request carrying the bearer token (read now) and the cluster id.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        if let Some(path) = &self.token {
            match std::fs::read_to_string(path) {
                Ok(token) => match format!("Bearer {}", token.trim()).parse() {
                    Ok(v) => {
                        req.metadata_mut().insert("authorization", v);
                    }
                    Err(_) => tracing::warn!(path = %path.display(), "service-account token is not a valid header value; sent without it"),
                },
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot read the service-account token; calling istiod without it"),
            }
        }
        if let Ok(v) = self.cluster_id.parse() {
            req.metadata_mut().insert("clusterid", v);
        }
        req
    }
}

#[cfg(test)]
mod address_tests {
    use super::*;

    fn cfg(address: &str) -> IstiodConfig {
        IstiodConfig {
            address: address.into(),
            alt_hostname: None,
            root_cert: PathBuf::new(),
            token: None,
            cluster_id: "Kubernetes".into(),
            client_cert: None,
        }
    }

    #[test]
    fn istio_form_without_a_scheme_and_https_both_work() {
        assert_eq!(cfg("istiod.istio-system.svc:15012").host_port().unwrap(), ("istiod.istio-system.svc".into(), 15012));
        assert_eq!(cfg("https://istiod-1-24.istio-system.svc:15012").host_port().unwrap(), ("istiod-1-24.istio-system.svc".into(), 15012));
        assert_eq!(cfg("[fd00::1]:15012").host_port().unwrap(), ("fd00::1".into(), 15012));
        assert!(cfg("http://istiod:15012").host_port().unwrap_err().to_string().contains("https"));
    }
}
