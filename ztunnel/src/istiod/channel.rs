//! The gRPC channel to istiod (xDS and the Istio CA alike): TLS verified against the
//! mesh root, ALPN h2, the bearer token re-read for every call, the `clusterid` header.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, ServerName};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::{Channel, Endpoint};

use crate::config::istio_env::EnvError;
use crate::tls::CurrentCert;

/// A root certificate setting: Istio's XDS_ROOT_CA / CA_ROOT_CA value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file, re-read on every connection (a rotated root applies).
    File(PathBuf),
    /// PEM given inline.
    Pem(Arc<str>),
    /// The system trust store (SYSTEM).
    System,
}

impl RootCert {
    /// Istio's forms: `SYSTEM`, inline PEM, or a path.
    pub fn from_setting(s: &str) -> RootCert {
        if s == "SYSTEM" {
            RootCert::System
        } else if s.trim_start().starts_with("-----BEGIN") {
            RootCert::Pem(s.into())
        } else {
            RootCert::File(PathBuf::from(s))
        }
    }

    pub fn read(&self) -> Result<Vec<CertificateDer<'static>>, IstiodError> {
        match self {
            RootCert::File(path) => read_roots(path),
            RootCert::Pem(pem) => {
                use rustls_pki_types::pem::PemObject;
                let roots: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
                    .filter_map(Result::ok)
                    .collect();
                if roots.is_empty() {
                    return Err(IstiodError::NoInlineRootCert);
                }
                Ok(roots)
            }
            RootCert::System => {
                let found = rustls_native_certs::load_native_certs();
                if found.certs.is_empty() {
                    return Err(IstiodError::NoSystemRoots(
                        found
                            .errors
                            .iter()
                            .map(|e| e.to_string())
                            .collect::<Vec<_>>()
                            .join("; "),
                    ));
                }
                Ok(found.certs)
            }
        }
    }
}

/// Where the bearer token comes from.
#[derive(Clone)]
pub enum Token {
    /// A file, re-read for every call (the kubelet rotates projected tokens).
    File(PathBuf),
    /// The token itself (Istio's AUTH_TOKEN holding a token rather than a path).
    Static(Arc<str>),
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::File(p) => f.debug_tuple("File").field(p).finish(),
            // Never in logs.
            Token::Static(_) => f.write_str("Static(<redacted>)"),
        }
    }
}

/// `https://` added to an address without a scheme (Istio's form `host:port`).
pub fn normalize_address(address: &str) -> String {
    if address.contains("://") {
        address.to_string()
    } else {
        format!("https://{address}")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IstiodError {
    #[error(
        "invalid istiod address {address:?}: {reason} (expected host:port or https://host:port)"
    )]
    Address { address: String, reason: String },
    #[error("{0}")]
    Env(#[from] EnvError),
    #[error("CA_ROOT_CA=SYSTEM is not supported: the CA's root is also the mesh's trust root, and the system store would let any public CA vouch for mesh peers; give the mesh root as a file or inline PEM")]
    SystemCaRoot,
    #[error("the inline root certificate (XDS_ROOT_CA / CA_ROOT_CA) holds no PEM certificate")]
    NoInlineRootCert,
    #[error("XDS_ROOT_CA=SYSTEM: no certificate in the system trust store ({0})")]
    NoSystemRoots(String),
    #[error("cannot read the istiod root certificate {path}: {source}; mount the istio-ca-root-cert ConfigMap there or set it with the root certificate option")]
    RootCert {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the istiod root certificate file {0} holds no PEM certificate")]
    NoRootCert(PathBuf),
    #[error("cannot resolve istiod host {host}: {source}")]
    Resolve {
        host: String,
        source: std::io::Error,
    },
    #[error("cannot connect to istiod at {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS to istiod ({server_name}) failed: {source}")]
    Tls {
        server_name: String,
        source: std::io::Error,
    },
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
    pub root_cert: RootCert,
    /// Projected service-account token (audience istio-ca); None: no bearer token.
    pub token: Option<Token>,
    pub cluster_id: String,
    /// Extra gRPC headers on every call (Istio's XDS_HEADER_* / CA_HEADER_*).
    pub headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
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
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// The roots in a PEM file (re-read on every connection, so a rotated root applies).
pub fn read_roots(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, IstiodError> {
    use rustls_pki_types::pem::PemObject;
    let pem = std::fs::read(path).map_err(|source| IstiodError::RootCert {
        path: path.to_path_buf(),
        source,
    })?;
    let roots: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    if roots.is_empty() {
        return Err(IstiodError::NoRootCert(path.to_path_buf()));
    }
    Ok(roots)
}

#[derive(Debug)]
struct ClientCert(Arc<dyn CurrentCert>);

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _hints: &[&[u8]],
        _schemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.current()
    }

    fn has_certs(&self) -> bool {
        self.0.current().is_some()
    }
}

impl IstiodConfig {
    pub fn host_port(&self) -> Result<(String, u16), IstiodError> {
        let bad = |reason: &str| IstiodError::Address {
            address: self.address.clone(),
            reason: reason.into(),
        };
        let uri: Uri = normalize_address(&self.address)
            .parse()
            .map_err(|_| bad("not a URI"))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("istiod is reached over TLS: use https:// or no scheme"));
        }
        let host = uri
            .host()
            .ok_or_else(|| bad("no host"))?
            .trim_matches(|c| c == '[' || c == ']')
            .to_string();
        Ok((host, uri.port_u16().unwrap_or(443)))
    }

    fn tls(&self) -> Result<rustls::ClientConfig, IstiodError> {
        let mut store = rustls::RootCertStore::empty();
        for r in self.root_cert.read()? {
            // A root that doesn't parse is skipped; an empty store fails every handshake.
            let _ = store.add(r);
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
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
            .map_err(|e| IstiodError::Address {
                address: self.address.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(Duration::from_secs(10))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        let connector = tower::service_fn(move |_uri: Uri| {
            let (cfg, host, server_name) = (cfg.clone(), host.clone(), server_name.clone());
            async move {
                let tls = cfg.tls()?;
                let addr = tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(|source| IstiodError::Resolve {
                        host: host.clone(),
                        source,
                    })?
                    .next()
                    .ok_or_else(|| IstiodError::Resolve {
                        host: host.clone(),
                        source: std::io::ErrorKind::NotFound.into(),
                    })?;
                let tcp = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|source| IstiodError::Connect { addr, source })?;
                let _ = tcp.set_nodelay(true);
                let name =
                    ServerName::try_from(server_name.clone()).map_err(|e| IstiodError::Tls {
                        server_name: server_name.clone(),
                        source: std::io::Error::other(e),
                    })?;
                let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
                    .connect(name, tcp)
                    .await
                    .map_err(|source| IstiodError::Tls {
                        server_name: server_name.clone(),
                        source,
                    })?;
                Ok::<_, IstiodError>(TokioIo::new(stream))
            }
        });
        Ok(endpoint.connect_with_connector_lazy(connector))
    }

    /// A request carrying the configured headers, the bearer token (read now) and the
    /// cluster id (the last two win over a configured header of the same name).
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        for (k, v) in &self.headers {
            req.metadata_mut().insert(k.clone(), v.clone());
        }
        if let Some(Token::Static(token)) = &self.token {
            match format!("Bearer {token}").parse() {
                Ok(v) => {
                    req.metadata_mut().insert("authorization", v);
                }
                Err(_) => tracing::warn!("AUTH_TOKEN is not a valid header value; sent without it"),
            }
        }
        if let Some(Token::File(path)) = &self.token {
            match std::fs::read_to_string(path) {
                Ok(token) => match format!("Bearer {}", token.trim()).parse() {
                    Ok(v) => {
                        req.metadata_mut().insert("authorization", v);
                    }
                    Err(_) => {
                        tracing::warn!(path = %path.display(), "service-account token is not a valid header value; sent without it")
                    }
                },
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot read the service-account token; calling istiod without it")
                }
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
            root_cert: RootCert::File(PathBuf::new()),
            token: None,
            cluster_id: "Kubernetes".into(),
            client_cert: None,
            headers: vec![],
        }
    }

    #[test]
    fn istio_form_without_a_scheme_and_https_both_work() {
        assert_eq!(
            cfg("istiod.istio-system.svc:15012").host_port().unwrap(),
            ("istiod.istio-system.svc".into(), 15012)
        );
        assert_eq!(
            cfg("https://istiod-1-24.istio-system.svc:15012")
                .host_port()
                .unwrap(),
            ("istiod-1-24.istio-system.svc".into(), 15012)
        );
        assert_eq!(
            cfg("[fd00::1]:15012").host_port().unwrap(),
            ("fd00::1".into(), 15012)
        );
        assert!(cfg("http://istiod:15012")
            .host_port()
            .unwrap_err()
            .to_string()
            .contains("https"));
    }
}
