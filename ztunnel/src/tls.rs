//! mTLS for HBONE: TLS 1.3 only, ALPN h2, no SNI, SPIFFE identities in URI SANs.
//!
//! Crypto provider: ring. It builds with only a C compiler (aws-lc-rs needs cmake and
//! a longer build), is smaller, and covers everything HBONE needs (ECDSA P-256, AES-GCM).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::identity::{Identity, IdentityError};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate cannot be parsed: {0}")]
    BadCertificate(String),
    #[error("certificate has no URI SAN; mesh certificates carry a spiffe:// identity")]
    NoIdentity,
    #[error("certificate identity is invalid: {0}")]
    BadIdentity(#[from] IdentityError),
    #[error("cannot build TLS config: {0}")]
    Config(#[from] rustls::Error),
}

pub const ALPN_H2: &[u8] = b"h2";

/// ring, restricted to the cipher suites HBONE allows.
pub fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![
        rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
    ];
    Arc::new(p)
}

/// The identity of a certificate: its first URI SAN, which must be a SPIFFE id.
pub fn identity_from_cert(der: &CertificateDer<'_>) -> Result<Identity, TlsError> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der.as_ref()).map_err(|e| TlsError::BadCertificate(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| TlsError::BadCertificate(e.to_string()))?
        .ok_or(TlsError::NoIdentity)?;
    let uri = san
        .value
        .general_names
        .iter()
        .find_map(|n| match n {
            GeneralName::URI(u) => Some(*u),
            _ => None,
        })
        .ok_or(TlsError::NoIdentity)?;
    // Identity parsing rejects NUL and other control bytes, so "a\0b" never equals "a".
    Ok(uri.parse()?)
}

/// Trust anchors parsed from root certificates (unparsable roots are skipped).
pub fn trust_anchors(roots: &[CertificateDer<'static>]) -> Vec<rustls_pki_types::TrustAnchor<'static>> {
    roots
        .iter()
        .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok().map(|a| a.to_owned()))
        .collect()
}

fn verify_chain(
    provider: &CryptoProvider,
    anchors: &[rustls_pki_types::TrustAnchor<'static>],
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
    usage: webpki::KeyUsage,
) -> Result<Identity, rustls::Error> {
    let cert = webpki::EndEntityCert::try_from(end_entity)
        .map_err(|e| rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(e)))))?;
    cert.verify_for_usage(
        provider.signature_verification_algorithms.all,
        anchors,
        intermediates,
        now,
        usage,
        None,
        None,
    )
    .map_err(|e| rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(e)))))?;
    identity_from_cert(end_entity)
        .map_err(|e| rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(e)))))
}

fn identity_error(msg: String) -> rustls::Error {
    // rustls prints custom errors Debug-escaped; log the reason readably too.
    tracing::warn!(reason = %msg, "peer certificate rejected");
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(
        std::io::Error::other(msg),
    ))))
}

/// The mesh roots and the provider's algorithms: what both verifiers check chains with.
#[derive(Debug)]
struct MeshRoots {
    provider: Arc<CryptoProvider>,
    anchors: Vec<rustls_pki_types::TrustAnchor<'static>>,
}

impl MeshRoots {
    fn new(provider: Arc<CryptoProvider>, roots: &[CertificateDer<'static>]) -> MeshRoots {
        MeshRoots { provider, anchors: trust_anchors(roots) }
    }

    fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
    ) -> Result<Identity, rustls::Error> {
        verify_chain(&self.provider, &self.anchors, end_entity, intermediates, now, usage)
    }

    /// Like `verify`, against other anchors (the current ones of a rotating root).
    fn verify_with(
        &self,
        anchors: &[rustls_pki_types::TrustAnchor<'static>],
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
    ) -> Result<Identity, rustls::Error> {
        verify_chain(&self.provider, anchors, end_entity, intermediates, now, usage)
    }

    fn tls12_refused() -> Result<HandshakeSignatureValid, rustls::Error> {
        // TLS 1.2 is disabled in every config we build.
        Err(rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls13RequiredForQuic))
    }

    fn tls13(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// Client side: the server must chain to our roots and present one of the expected identities.
#[derive(Debug)]
struct ExpectedIdentityVerifier {
    roots: MeshRoots,
    expected: Vec<Identity>,
}

impl ServerCertVerifier for ExpectedIdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let id = self.roots.verify(end_entity, intermediates, now, webpki::KeyUsage::server_auth())?;
        if self.expected.contains(&id) {
            Ok(ServerCertVerified::assertion())
        } else {
            let expected: Vec<String> = self.expected.iter().map(|i| i.to_string()).collect();
            Err(identity_error(format!("server identity {id} is not one of the expected {expected:?}")))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        MeshRoots::tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.schemes()
    }
}

/// Server side: the client must present a certificate chaining to our roots, from our trust domain.
#[derive(Debug)]
struct TrustDomainVerifier {
    roots: MeshRoots,
    /// Supplies the anchors in force now (a rotated mesh root); `roots` otherwise.
    current: Arc<dyn CurrentCert>,
    trust_domain: String,
}

impl ClientCertVerifier for TrustDomainVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let id = match self.current.anchors() {
            Some(a) => self.roots.verify_with(&a, end_entity, intermediates, now, webpki::KeyUsage::client_auth())?,
            None => self.roots.verify(end_entity, intermediates, now, webpki::KeyUsage::client_auth())?,
        };
        if id.trust_domain == self.trust_domain {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(identity_error(format!(
                "client identity {id} is from trust domain {:?}, expected {:?}",
                id.trust_domain, self.trust_domain
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        MeshRoots::tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.schemes()
    }
}

/// TLS client config for one HBONE connection from `cert`'s identity to one of `expected`.
pub fn client_config(
    cert: &CertifiedKey,
    roots: &[CertificateDer<'static>],
    expected: Vec<Identity>,
) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let verifier = ExpectedIdentityVerifier { roots: MeshRoots::new(provider.clone(), roots), expected };
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(Arc::new(FixedClientCert(Arc::new(cert.clone()))));
    cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
    cfg.enable_sni = false;
    Ok(cfg)
}

#[derive(Debug)]
struct FixedClientCert(Arc<CertifiedKey>);

impl rustls::client::ResolvesClientCert for FixedClientCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Supplies the server certificate at handshake time, so rotation needs no new config.
pub trait CurrentCert: Send + Sync + std::fmt::Debug {
    fn current(&self) -> Option<Arc<CertifiedKey>>;

    /// The trust anchors that go with the current certificate (they move when the mesh
    /// root rotates); None keeps the ones the config was built with.
    fn anchors(&self) -> Option<Arc<Vec<rustls_pki_types::TrustAnchor<'static>>>> {
        None
    }
}

#[derive(Debug)]
struct Resolver<C: ?Sized>(Arc<C>);

impl<C: CurrentCert + ?Sized> ResolvesServerCert for Resolver<C> {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.current()
    }
}

/// TLS server config for a pod's HBONE listener.
pub fn server_config(
    cert: impl CurrentCert + 'static,
    roots: &[CertificateDer<'static>],
    trust_domain: &str,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let cert: Arc<dyn CurrentCert> = Arc::new(cert);
    let verifier = TrustDomainVerifier {
        roots: MeshRoots::new(provider.clone(), roots),
        current: cert.clone(),
        trust_domain: trust_domain.to_string(),
    };
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_cert_resolver(Arc::new(Resolver(cert)));
    cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
    // No resumption: a resumed session skips the client verifier, so a peer whose
    // certificate has since expired, or whose root was rotated out, would still get in.
    // No mesh client resumes anyway. (No ticketer either: the builder's default issues none.)
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.send_tls13_tickets = 0;
    Ok(cfg)
}

/// The verified peer identity of an accepted server-side connection.
pub fn peer_identity(conn: &rustls::ServerConnection) -> Result<Identity, TlsError> {
    let certs = conn.peer_certificates().ok_or(TlsError::NoIdentity)?;
    identity_from_cert(certs.first().ok_or(TlsError::NoIdentity)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ca::Ca;
    use std::time::Duration;

    #[derive(Debug)]
    struct Fixed(Arc<CertifiedKey>);

    impl CurrentCert for Fixed {
        fn current(&self) -> Option<Arc<CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    fn certified(ca: &Ca, id: &Identity) -> CertifiedKey {
        let c = ca.issue(id, Duration::from_secs(600)).unwrap();
        let key = rustls::crypto::ring::sign::any_supported_type(&c.key).unwrap();
        CertifiedKey::new(c.chain.clone(), key)
    }

    /// Handshakes in memory; returns the client's view of what kind it was.
    fn handshake(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>) -> rustls::HandshakeKind {
        let name = ServerName::try_from("10.0.0.1").unwrap();
        let mut c = rustls::ClientConnection::new(client.clone(), name).unwrap();
        let mut s = rustls::ServerConnection::new(server.clone()).unwrap();
        // Until both are done and the server's post-handshake messages (tickets) arrived.
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                s.read_tls(&mut rd).unwrap();
            }
            s.process_new_packets().unwrap();
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                c.read_tls(&mut rd).unwrap();
            }
            c.process_new_packets().unwrap();
        }
        assert!(!c.is_handshaking() && !s.is_handshaking());
        assert_eq!(c.handshake_kind(), s.handshake_kind());
        c.handshake_kind().unwrap()
    }

    /// A client that keeps sessions (rustls' default cache) connecting twice gets two
    /// full handshakes: the server neither keeps sessions nor issues tickets, so every
    /// connection has its client certificate verified.
    #[test]
    fn the_server_never_resumes_a_session() {
        let dir = std::env::temp_dir().join(format!("zt-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let (server_id, client_id) = (Identity::new("cluster.local", "default", "server"), Identity::new("cluster.local", "default", "client"));
        let server = server_config(Fixed(Arc::new(certified(&ca, &server_id))), &[ca.root()], "cluster.local").unwrap();
        assert!(!server.ticketer.enabled());
        let server = Arc::new(server);
        let client = Arc::new(client_config(&certified(&ca, &client_id), &[ca.root()], vec![server_id]).unwrap());
        assert_eq!(handshake(&client, &server), rustls::HandshakeKind::Full);
        assert_eq!(handshake(&client, &server), rustls::HandshakeKind::Full, "the second connection resumed");
    }
}
