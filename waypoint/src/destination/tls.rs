//! TLS origination (DestinationRule `trafficPolicy.tls` mode SIMPLE or MUTUAL), as
//! Istio's waypoint builds the upstream TLS context: the TLS runs end to end from the
//! waypoint to the endpoint, inside the HBONE tunnel for a mesh endpoint, straight over
//! TCP for one outside the mesh.
//!
//! Envoy's semantics, which this follows:
//! - SNI: `sni`, else the request's host (`auto_sni`); opaque TCP without `sni` sends none.
//! - The server's certificate chain is checked against `caCertificates` (a PEM file), or
//!   the system's roots without it, and against `caCrl` when given; nothing is checked
//!   with `insecureSkipVerify`.
//! - Its name: one of `subjectAltNames` must be among the certificate's SANs (DNS, with
//!   wildcards, URI, IP or email); without them and without `sni`, the request's host
//!   (`auto_san_validation`); with `sni` and no `subjectAltNames`, only the chain.
//! - MUTUAL presents `clientCertificate` with `privateKey` (PEM files).
//! - ALPN `h2` when the upstream speaks HTTP/2, else none.
//!
//! The files are read when the rule loads (an unreadable or invalid one refuses it, the
//! field named), and again when one of them changes (checked at most once a second, when
//! a connection is made), so a rotated certificate is picked up as Istio's file SDS does.
//! `credentialName` needs Istio's SDS and is refused: mount the secret and name its files.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::{CertificateError, DigitallySignedStruct, Error as TlsError, SignatureScheme};
use serde::Deserialize;

/// How often the files are looked at for a change, at most.
const RECHECK: Duration = Duration::from_secs(1);

/// Istio's `ClientTLSSettings`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientTls {
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub client_certificate: Option<String>,
    #[serde(default)]
    pub private_key: Option<String>,
    #[serde(default)]
    pub ca_certificates: Option<String>,
    #[serde(default)]
    pub ca_crl: Option<String>,
    #[serde(default)]
    pub credential_name: Option<String>,
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    #[serde(default)]
    pub sni: Option<String>,
    #[serde(default)]
    pub insecure_skip_verify: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    Simple,
    Mutual,
}

/// What one rule's `tls` asks for: the files, names and the configs built from them.
pub struct Origination {
    /// Connections made with different originations never share a pooled connection.
    pub id: u64,
    pub mode: TlsMode,
    pub sni: Option<String>,
    pub subject_alt_names: Vec<String>,
    files: Files,
    loaded: Mutex<Loaded>,
}

impl fmt::Debug for Origination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Origination")
            .field("mode", &self.mode)
            .field("sni", &self.sni)
            .field("subject_alt_names", &self.subject_alt_names)
            .finish()
    }
}

impl PartialEq for Origination {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for Origination {}

#[derive(Clone, Debug, Default)]
struct Files {
    /// None: the system's roots.
    ca: Option<PathBuf>,
    insecure: bool,
    crl: Option<PathBuf>,
    client: Option<(PathBuf, PathBuf)>,
}

impl Files {
    fn paths(&self) -> Vec<&Path> {
        let mut v: Vec<&Path> = Vec::new();
        v.extend(self.ca.as_deref());
        v.extend(self.crl.as_deref());
        if let Some((c, k)) = &self.client {
            v.extend([c.as_path(), k.as_path()]);
        }
        v
    }

    fn stamps(&self) -> Vec<Option<SystemTime>> {
        self.paths()
            .into_iter()
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect()
    }
}

/// The certificates and keys read from the files.
struct Material {
    /// None: no verification (insecureSkipVerify).
    verifier: Option<Arc<WebPkiServerVerifier>>,
    client: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
}

struct Loaded {
    checked: Instant,
    stamps: Vec<Option<SystemTime>>,
    material: Arc<Material>,
    /// Built on first use, by (ALPN h2, name checked).
    configs: [Option<Arc<rustls::ClientConfig>>; 4],
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ClientTls {
    /// What the settings ask for: None for DISABLE and ISTIO_MUTUAL (the mesh's own mTLS,
    /// which HBONE already is: Istio's waypoint adds nothing for it), or the field path of
    /// what cannot be honoured.
    pub fn origination(&self) -> Result<Option<Arc<Origination>>, String> {
        let mode = match self.mode.as_deref().unwrap_or("DISABLE") {
            "DISABLE" | "ISTIO_MUTUAL" => return Ok(None),
            "SIMPLE" => TlsMode::Simple,
            "MUTUAL" => TlsMode::Mutual,
            other => {
                return Err(format!(
                    "mode: {other:?} is not one of DISABLE, SIMPLE, MUTUAL, ISTIO_MUTUAL"
                ))
            }
        };
        if self.credential_name.is_some() {
            return Err("credentialName: the waypoint has no SDS to fetch a Secret from; mount the secret in the waypoint's pod \
                        and name its files in clientCertificate, privateKey and caCertificates"
                .into());
        }
        let path = |field: &str, v: &Option<String>| -> Result<Option<PathBuf>, String> {
            match v.as_deref() {
                None | Some("") => Ok(None),
                Some(p) if Path::new(p).is_absolute() => Ok(Some(PathBuf::from(p))),
                Some(p) => Err(format!("{field}: {p:?} is not an absolute file path")),
            }
        };
        let client = match (
            mode,
            path("clientCertificate", &self.client_certificate)?,
            path("privateKey", &self.private_key)?,
        ) {
            (TlsMode::Mutual, Some(c), Some(k)) => Some((c, k)),
            (TlsMode::Mutual, None, _) => {
                return Err(
                    "clientCertificate: required for MUTUAL (a PEM file in the waypoint's pod)"
                        .into(),
                )
            }
            (TlsMode::Mutual, _, None) => {
                return Err(
                    "privateKey: required for MUTUAL (a PEM file in the waypoint's pod)".into(),
                )
            }
            // SIMPLE presents no certificate (Istio ignores these fields then).
            (TlsMode::Simple, ..) => None,
        };
        let files = Files {
            ca: path("caCertificates", &self.ca_certificates)?,
            insecure: self.insecure_skip_verify == Some(true),
            crl: path("caCrl", &self.ca_crl)?,
            client,
        };
        if let Some(sni) = &self.sni {
            ServerName::try_from(sni.as_str())
                .map_err(|_| format!("sni: {sni:?} is not a DNS name or IP address"))?;
        }
        for (i, san) in self.subject_alt_names.iter().enumerate() {
            if san.is_empty() {
                return Err(format!("subjectAltNames[{i}]: must not be empty"));
            }
        }
        let material = Arc::new(files.load()?);
        let loaded = Loaded {
            checked: Instant::now(),
            stamps: files.stamps(),
            material,
            configs: Default::default(),
        };
        Ok(Some(Arc::new(Origination {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            mode,
            sni: self.sni.clone(),
            subject_alt_names: self.subject_alt_names.clone(),
            files,
            loaded: Mutex::new(loaded),
        })))
    }
}

impl Files {
    /// Reads and checks the files; errors name the field.
    fn load(&self) -> Result<Material, String> {
        let read = |field: &str, p: &Path| {
            std::fs::read(p).map_err(|e| format!("{field}: cannot read {}: {e}", p.display()))
        };
        let verifier = if self.insecure {
            None
        } else {
            let mut roots = rustls::RootCertStore::empty();
            match &self.ca {
                Some(p) => {
                    let pem = read("caCertificates", p)?;
                    for c in CertificateDer::pem_slice_iter(&pem) {
                        let c = c.map_err(|e| {
                            format!("caCertificates: {} is not PEM: {e}", p.display())
                        })?;
                        roots
                            .add(c)
                            .map_err(|e| format!("caCertificates: {}: {e}", p.display()))?;
                    }
                    if roots.is_empty() {
                        return Err(format!(
                            "caCertificates: {} holds no certificate",
                            p.display()
                        ));
                    }
                }
                None => {
                    let found = rustls_native_certs::load_native_certs();
                    roots.add_parsable_certificates(found.certs);
                    if roots.is_empty() {
                        return Err("caCertificates: not set and the system has no root certificates; name a PEM file".into());
                    }
                }
            }
            let mut crls = Vec::new();
            if let Some(p) = &self.crl {
                let data = read("caCrl", p)?;
                for c in CertificateRevocationListDer::pem_slice_iter(&data) {
                    crls.push(c.map_err(|e| format!("caCrl: {} is not PEM: {e}", p.display()))?);
                }
                if crls.is_empty() {
                    return Err(format!("caCrl: {} holds no X509 CRL block", p.display()));
                }
            }
            let v = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                // Envoy checks the whole chain and refuses a certificate no CRL covers; so
                // does webpki by default once CRLs are given.
                .with_crls(crls)
                .build()
                .map_err(|e| format!("caCertificates / caCrl: {e}"))?;
            Some(v)
        };
        let client = match &self.client {
            None => None,
            Some((cert, key)) => {
                let pem = read("clientCertificate", cert)?;
                let chain = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        format!("clientCertificate: {} is not PEM: {e}", cert.display())
                    })?;
                if chain.is_empty() {
                    return Err(format!(
                        "clientCertificate: {} holds no certificate",
                        cert.display()
                    ));
                }
                let k = read("privateKey", key)?;
                let k = PrivateKeyDer::from_pem_slice(&k).map_err(|e| {
                    format!("privateKey: {} holds no private key: {e}", key.display())
                })?;
                provider()
                    .key_provider
                    .load_private_key(k.clone_key())
                    .map_err(|e| format!("privateKey: {}: {e}", key.display()))?;
                Some((chain, Arc::new(k)))
            }
        };
        Ok(Material { verifier, client })
    }
}

/// How one connection is made: the origination, the name sent as SNI, whether the
/// certificate must be valid for that name, and the ALPN.
#[derive(Clone, Debug)]
pub struct TlsTarget {
    pub origination: Arc<Origination>,
    pub server_name: ServerName<'static>,
    /// SNI sent (false for a connection with no name to send: opaque TCP without `sni`).
    pub send_sni: bool,
    pub check_name: bool,
    pub h2: bool,
}

impl PartialEq for TlsTarget {
    fn eq(&self, o: &Self) -> bool {
        self.origination.id == o.origination.id
            && self.server_name == o.server_name
            && self.send_sni == o.send_sni
            && self.check_name == o.check_name
            && self.h2 == o.h2
    }
}

impl Eq for TlsTarget {}

impl std::hash::Hash for TlsTarget {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.origination.id.hash(h);
        self.server_name.to_str().hash(h);
        (self.send_sni, self.check_name, self.h2).hash(h);
    }
}

impl Origination {
    /// A connection for a request to `host` (None: opaque TCP), in HTTP/2 or not.
    /// `endpoint` names the connection when nothing else does (no SNI is sent then).
    pub fn target(
        self: &Arc<Self>,
        host: Option<&str>,
        endpoint: std::net::IpAddr,
        h2: bool,
    ) -> TlsTarget {
        let host = host.map(host_name);
        let named = |n: &str| ServerName::try_from(n.to_string()).ok();
        let (server_name, send_sni, check_name) = match (&self.sni, host.as_deref().and_then(named))
        {
            (Some(sni), _) => (
                named(sni).unwrap_or(ServerName::IpAddress(endpoint.into())),
                true,
                false,
            ),
            // Envoy's auto_sni and auto_san_validation.
            (None, Some(h)) => (h, true, self.subject_alt_names.is_empty()),
            (None, None) => (ServerName::IpAddress(endpoint.into()), false, false),
        };
        TlsTarget {
            origination: self.clone(),
            server_name,
            send_sni,
            check_name,
            h2,
        }
    }

    /// The client config for a connection like `t`, rebuilt when a file changed.
    pub fn client_config(&self, t: &TlsTarget) -> Result<Arc<rustls::ClientConfig>, String> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if loaded.checked.elapsed() >= RECHECK {
            loaded.checked = Instant::now();
            let stamps = self.files.stamps();
            if stamps != loaded.stamps {
                match self.files.load() {
                    Ok(m) => {
                        tracing::info!(files = ?self.files.paths(), "TLS origination files changed; reloaded");
                        loaded.material = Arc::new(m);
                        loaded.configs = Default::default();
                    }
                    // The last good files stay in use, as a bad config file keeps the last config.
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS origination files changed but cannot be used; keeping the last good ones")
                    }
                }
                loaded.stamps = stamps;
            }
        }
        let i = usize::from(t.h2) * 2 + usize::from(t.check_name);
        if let Some(c) = &loaded.configs[i] {
            return Ok(c.clone());
        }
        let m = loaded.material.clone();
        let verifier = Arc::new(Verifier {
            inner: m.verifier.clone(),
            sans: self.subject_alt_names.clone(),
            check_name: t.check_name,
        });
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut cfg = match &m.client {
            Some((chain, key)) => builder
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(|e| format!("clientCertificate / privateKey: {e}"))?,
            None => builder.with_no_client_auth(),
        };
        if t.h2 {
            cfg.alpn_protocols = vec![b"h2".to_vec()];
        }
        cfg.enable_sni = t.send_sni;
        let cfg = Arc::new(cfg);
        loaded.configs[i] = Some(cfg.clone());
        Ok(cfg)
    }
}

/// A Host or :authority value without its port (and an IPv6 literal's brackets).
fn host_name(authority: &str) -> String {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or(v6, |(h, _)| h),
        None => authority
            .rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            .map_or(authority, |(h, _)| h),
    };
    host.to_ascii_lowercase()
}

/// The chain as webpki checks it, the name as Envoy's SAN matchers do.
#[derive(Debug)]
struct Verifier {
    inner: Option<Arc<WebPkiServerVerifier>>,
    sans: Vec<String>,
    check_name: bool,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        let Some(inner) = &self.inner else {
            return Ok(ServerCertVerified::assertion());
        };
        // webpki checks the chain before the name: a name error means the chain is good.
        let name_ok =
            match inner.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
                Ok(_) => true,
                Err(TlsError::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => false,
                Err(e) => return Err(e),
            };
        if !self.sans.is_empty() {
            let names = cert_sans(end_entity)
                .map_err(|_| TlsError::InvalidCertificate(CertificateError::BadEncoding))?;
            if !self
                .sans
                .iter()
                .any(|want| names.iter().any(|have| have.matches(want)))
            {
                return Err(TlsError::InvalidCertificate(
                    CertificateError::NotValidForName,
                ));
            }
        } else if self.check_name && !name_ok {
            return Err(TlsError::InvalidCertificate(
                CertificateError::NotValidForName,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// One SAN of a certificate.
#[derive(Debug, PartialEq, Eq)]
enum San {
    Dns(String),
    Other(String),
}

impl San {
    /// Envoy's exact SAN matcher: DNS names case-insensitively, a `*.` wildcard SAN
    /// standing for one label; other kinds (URI, IP, email) as written.
    fn matches(&self, want: &str) -> bool {
        match self {
            San::Dns(have) => {
                let want = want.to_ascii_lowercase();
                if *have == want {
                    return true;
                }
                match (have.strip_prefix("*."), want.split_once('.')) {
                    (Some(suffix), Some((label, rest))) => !label.is_empty() && rest == suffix,
                    _ => false,
                }
            }
            San::Other(have) => have == want,
        }
    }
}

fn cert_sans(der: &CertificateDer<'_>) -> Result<Vec<San>, ()> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der.as_ref()).map_err(|_| ())?;
    let Ok(Some(ext)) = cert.subject_alternative_name() else {
        return Ok(Vec::new());
    };
    Ok(ext
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(San::Dns(d.to_ascii_lowercase())),
            GeneralName::URI(u) => Some(San::Other(u.to_string())),
            GeneralName::RFC822Name(e) => Some(San::Other(e.to_string())),
            GeneralName::IPAddress(b) => match b.len() {
                4 => <[u8; 4]>::try_from(*b)
                    .ok()
                    .map(|a| San::Other(std::net::IpAddr::from(a).to_string())),
                16 => <[u8; 16]>::try_from(*b)
                    .ok()
                    .map(|a| San::Other(std::net::IpAddr::from(a).to_string())),
                _ => None,
            },
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA, a server certificate for `names` and a client certificate, as PEM files in a
    /// directory of their own.
    struct Pki {
        dir: PathBuf,
        server: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
        ca: CertificateDer<'static>,
    }

    impl Drop for Pki {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn pki(tag: &str, names: &[&str]) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let dir = std::env::temp_dir().join(format!("wp-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key).unwrap();
        let leaf = |names: Vec<String>| {
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(names)
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
            (cert, key)
        };
        let (server, server_key) = leaf(names.iter().map(|n| n.to_string()).collect());
        let (client, client_key) = leaf(vec!["client.example.com".into()]);
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(dir.join("client.pem"), client.pem()).unwrap();
        std::fs::write(dir.join("client-key.pem"), client_key.serialize_pem()).unwrap();
        let server = (
            vec![server.der().clone()],
            PrivateKeyDer::Pkcs8(server_key.serialize_der().into()),
        );
        Pki {
            dir,
            server,
            ca: ca_cert.der().clone(),
        }
    }

    fn origination(p: &Pki, yaml: &str) -> Arc<Origination> {
        let yaml = yaml.replace("$DIR", &p.dir.display().to_string());
        let t: ClientTls = serde_yaml::from_str(&yaml).unwrap();
        t.origination().unwrap().expect("originates TLS")
    }

    /// One handshake against the PKI's server (asking for a client certificate when
    /// `mutual`); Ok with the SNI the server saw and whether a client certificate came.
    async fn handshake(
        p: &Pki,
        t: &TlsTarget,
        mutual: bool,
    ) -> Result<(Option<String>, bool), String> {
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if mutual {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(p.ca.clone()).unwrap();
            builder.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .unwrap(),
            )
        } else {
            builder.with_no_client_auth()
        };
        let server = Arc::new(
            builder
                .with_single_cert(p.server.0.clone(), p.server.1.clone_key())
                .unwrap(),
        );
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accept = tokio::spawn(async move {
            let s = tokio_rustls::TlsAcceptor::from(server)
                .accept(b)
                .await
                .map_err(|e| e.to_string())?;
            let (_, conn) = s.get_ref();
            Ok::<_, String>((
                conn.server_name().map(str::to_string),
                conn.peer_certificates().is_some(),
            ))
        });
        let cfg = t.origination.client_config(t)?;
        let client = tokio_rustls::TlsConnector::from(cfg)
            .connect(t.server_name.clone(), a)
            .await;
        let server = accept.await.unwrap();
        client.map_err(|e| e.to_string())?;
        server
    }

    #[tokio::test]
    async fn the_certificate_is_checked_as_envoy_checks_it() {
        let p = pki("names", &["api.example.com", "*.wild.example.com"]);
        let ip: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        // SIMPLE without sni: the request's host is the SNI and the name checked.
        let o = origination(&p, "{mode: SIMPLE, caCertificates: $DIR/ca.pem}");
        assert_eq!(
            handshake(&p, &o.target(Some("api.example.com:443"), ip, false), false).await,
            Ok((Some("api.example.com".into()), false))
        );
        assert_eq!(
            handshake(&p, &o.target(Some("x.wild.example.com"), ip, false), false)
                .await
                .map(|r| r.0),
            Ok(Some("x.wild.example.com".into()))
        );
        let e = handshake(&p, &o.target(Some("other.example.com"), ip, false), false)
            .await
            .expect_err("another name");
        assert!(e.contains("NotValidForName"), "{e}");
        // subjectAltNames: one of them must be the certificate's, whatever the host.
        let o = origination(&p, "{mode: SIMPLE, caCertificates: $DIR/ca.pem, subjectAltNames: [nope.example.com, a.wild.example.com]}");
        assert!(
            handshake(&p, &o.target(Some("other.example.com"), ip, false), false)
                .await
                .is_ok()
        );
        let o = origination(
            &p,
            "{mode: SIMPLE, caCertificates: $DIR/ca.pem, subjectAltNames: [nope.example.com]}",
        );
        assert!(
            handshake(&p, &o.target(Some("api.example.com"), ip, false), false)
                .await
                .is_err()
        );
        // sni without subjectAltNames: that SNI, the chain only (Envoy's).
        let o = origination(
            &p,
            "{mode: SIMPLE, caCertificates: $DIR/ca.pem, sni: unrelated.example.org}",
        );
        assert_eq!(
            handshake(&p, &o.target(Some("api.example.com"), ip, false), false).await,
            Ok((Some("unrelated.example.org".into()), false))
        );
        // Opaque TCP without sni: no SNI, the chain only.
        let o = origination(&p, "{mode: SIMPLE, caCertificates: $DIR/ca.pem}");
        assert_eq!(
            handshake(&p, &o.target(None, ip, false), false).await,
            Ok((None, false))
        );
        // Another CA's roots (here: the system's) refuse the chain; insecureSkipVerify takes anything.
        let o = origination(&p, "{mode: SIMPLE}");
        assert!(
            handshake(&p, &o.target(Some("api.example.com"), ip, false), false)
                .await
                .is_err()
        );
        let o = origination(&p, "{mode: SIMPLE, insecureSkipVerify: true}");
        assert!(handshake(&p, &o.target(Some("whatever"), ip, false), false)
            .await
            .is_ok());
        // MUTUAL presents the client certificate.
        let o = origination(&p, "{mode: MUTUAL, caCertificates: $DIR/ca.pem, clientCertificate: $DIR/client.pem, privateKey: $DIR/client-key.pem}");
        assert_eq!(
            handshake(&p, &o.target(Some("api.example.com"), ip, false), true).await,
            Ok((Some("api.example.com".into()), true))
        );
        let o = origination(&p, "{mode: SIMPLE, caCertificates: $DIR/ca.pem}");
        assert!(
            handshake(&p, &o.target(Some("api.example.com"), ip, false), true)
                .await
                .is_err(),
            "SIMPLE has no certificate to present"
        );
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_broken_one_keeps_the_last_good() {
        let p = pki("reload", &["api.example.com"]);
        let o = origination(&p, "{mode: SIMPLE, caCertificates: $DIR/ca.pem}");
        let t = o.target(Some("api.example.com"), "10.0.0.1".parse().unwrap(), true);
        let first = o.client_config(&t).unwrap();
        assert_eq!(first.alpn_protocols, vec![b"h2".to_vec()]);
        assert!(
            Arc::ptr_eq(&first, &o.client_config(&t).unwrap()),
            "built once"
        );
        // A broken file a second later: the last good config stays.
        std::fs::write(p.dir.join("ca.pem"), "not pem").unwrap();
        o.loaded.lock().unwrap().checked -= RECHECK;
        assert!(Arc::ptr_eq(&first, &o.client_config(&t).unwrap()));
        // A good one again: rebuilt.
        let again = pki("reload2", &["api.example.com"]);
        std::fs::copy(again.dir.join("ca.pem"), p.dir.join("ca.pem")).unwrap();
        let mut l = o.loaded.lock().unwrap();
        l.checked -= RECHECK;
        l.stamps.clear();
        drop(l);
        assert!(!Arc::ptr_eq(&first, &o.client_config(&t).unwrap()));
    }

    #[test]
    fn san_matching_is_envoys() {
        let dns = San::Dns("*.example.com".into());
        assert!(dns.matches("api.example.com") && dns.matches("API.example.com"));
        assert!(
            !dns.matches("example.com")
                && !dns.matches("a.b.example.com")
                && !dns.matches(".example.com")
        );
        assert!(San::Dns("api.example.com".into()).matches("api.example.com"));
        assert!(San::Other("spiffe://td/ns/a/sa/b".into()).matches("spiffe://td/ns/a/sa/b"));
        assert!(!San::Other("10.0.0.1".into()).matches("10.0.0.2"));
    }
}
