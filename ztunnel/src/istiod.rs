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

use crate::tls::CurrentCert;

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
    /// `https://host:port`.
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
        let uri: Uri = self.address.parse().map_err(|_| bad("not a URI"))?;
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
