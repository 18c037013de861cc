//! mTLS for HBONE: TLS 1.3 only, ALPN h2, no SNI, SPIFFE identities in URI SANs.
//!
//! Crypto provider: ring. It covers everything HBONE needs (ECDSA P-256, X25519, AES-GCM)
//! and is smaller. aws-lc-rs (Istio's default) was measured in its place, same runs
//! (docs/benchmarks.md, "Changes tried"): 2–15% less CPU per GiB in bulk, but 4–15% more
//! per request at 1000 req/s and +2.3 MB RSS per ztunnel. It alone has ML-KEM, so
//! `COMPLIANCE_POLICY=pqc` refuses the start here (config/istio_env.rs).

use std::sync::Arc;

pub mod crl;
pub use crl::Crls;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme,
};
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
    let (_, cert) = X509Certificate::from_der(der.as_ref())
        .map_err(|e| TlsError::BadCertificate(e.to_string()))?;
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
pub fn trust_anchors(
    roots: &[CertificateDer<'static>],
) -> Vec<rustls_pki_types::TrustAnchor<'static>> {
    roots
        .iter()
        .filter_map(|r| {
            webpki::anchor_from_trusted_cert(r)
                .ok()
                .map(|a| a.to_owned())
        })
        .collect()
}

/// A webpki rejection as rustls reports it; a revoked certificate as rustls' own
/// `Revoked`, so the peer gets the `certificate_revoked` alert and callers can tell.
fn webpki_error(e: webpki::Error) -> rustls::Error {
    match e {
        webpki::Error::CertRevoked => {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)
        }
        e => rustls::Error::InvalidCertificate(rustls::CertificateError::Other(
            rustls::OtherError(Arc::new(e)),
        )),
    }
}

#[allow(clippy::too_many_arguments)]
fn verify_chain(
    provider: &CryptoProvider,
    anchors: &[rustls_pki_types::TrustAnchor<'static>],
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
    usage: webpki::KeyUsage,
    crls: Option<&crl::CrlSet>,
) -> Result<Identity, rustls::Error> {
    let cert = webpki::EndEntityCert::try_from(end_entity).map_err(webpki_error)?;
    let verify = |revocation: Option<webpki::RevocationOptions<'_>>| {
        cert.verify_for_usage(
            provider.signature_verification_algorithms.all,
            anchors,
            intermediates,
            now,
            usage,
            revocation,
            None,
        )
        .map(|_| ())
    };
    match crls {
        Some(set) => set.with_options(verify),
        None => verify(None),
    }
    .map_err(webpki_error)?;
    identity_from_cert(end_entity).map_err(|e| {
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
            Arc::new(e),
        )))
    })
}

fn identity_error(msg: String) -> rustls::Error {
    // rustls prints custom errors Debug-escaped; log the reason readably too.
    tracing::warn!(reason = %msg, "peer certificate rejected");
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
        Arc::new(std::io::Error::other(msg)),
    )))
}

/// The mesh roots and the provider's algorithms: what both verifiers check chains with.
#[derive(Debug)]
struct MeshRoots {
    provider: Arc<CryptoProvider>,
    anchors: Vec<rustls_pki_types::TrustAnchor<'static>>,
    /// With CRL_PATH: every chain is also checked against the CRLs in force.
    crls: Option<Crls>,
}

impl MeshRoots {
    fn new(
        provider: Arc<CryptoProvider>,
        roots: &[CertificateDer<'static>],
        crls: Option<&Crls>,
    ) -> MeshRoots {
        MeshRoots {
            provider,
            anchors: trust_anchors(roots),
            crls: crls.cloned(),
        }
    }

    fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
    ) -> Result<Identity, rustls::Error> {
        self.verify_with(&self.anchors, end_entity, intermediates, now, usage)
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
        let crls = self.crls.as_ref().map(Crls::current);
        verify_chain(
            &self.provider,
            anchors,
            end_entity,
            intermediates,
            now,
            usage,
            crls.as_deref(),
        )
    }

    fn tls12_refused() -> Result<HandshakeSignatureValid, rustls::Error> {
        // TLS 1.2 is disabled in every config we build.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
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
        let id = self.roots.verify(
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
        )?;
        if self.expected.contains(&id) {
            Ok(ServerCertVerified::assertion())
        } else {
            let expected: Vec<String> = self.expected.iter().map(|i| i.to_string()).collect();
            Err(identity_error(format!(
                "server identity {id} is not one of the expected {expected:?}"
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
            Some(a) => self.roots.verify_with(
                &a,
                end_entity,
                intermediates,
                now,
                webpki::KeyUsage::client_auth(),
            )?,
            None => self.roots.verify(
                end_entity,
                intermediates,
                now,
                webpki::KeyUsage::client_auth(),
            )?,
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
    client_config_with_crls(cert, roots, expected, None)
}

/// [`client_config`]; with `crls`, a server whose chain they revoke is refused.
pub fn client_config_with_crls(
    cert: &CertifiedKey,
    roots: &[CertificateDer<'static>],
    expected: Vec<Identity>,
    crls: Option<&Crls>,
) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let verifier = ExpectedIdentityVerifier {
        roots: MeshRoots::new(provider.clone(), roots, crls),
        expected,
    };
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(Arc::new(FixedClientCert(Arc::new(cert.clone()))));
    cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
    cfg.enable_sni = false;
    // Servers send no tickets (see `server_config`), so there is nothing to resume; the
    // default in-memory session cache would still cost each pooled connection ~14 KB.
    cfg.resumption = rustls::client::Resumption::disabled();
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
    server_config_with_crls(cert, roots, trust_domain, None)
}

/// [`server_config`]; with `crls`, a client whose chain they revoke is refused.
pub fn server_config_with_crls(
    cert: impl CurrentCert + 'static,
    roots: &[CertificateDer<'static>],
    trust_domain: &str,
    crls: Option<&Crls>,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let cert: Arc<dyn CurrentCert> = Arc::new(cert);
    let verifier = TrustDomainVerifier {
        roots: MeshRoots::new(provider.clone(), roots, crls),
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

/// Whether a TLS handshake failed because we found the peer's chain revoked by a CRL.
pub fn is_revoked(e: &std::io::Error) -> bool {
    matches!(
        e.get_ref().and_then(|s| s.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::InvalidCertificate(
            rustls::CertificateError::Revoked
        ))
    )
}

/// Whose chain a [`PeerChain`] is: an inbound client's or an outbound server's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRole {
    Client,
    Server,
}

/// An accepted peer's chain, kept so a CRL reload that revokes it closes the connection
/// (Istio's ztunnel does the same on both sides).
pub struct PeerChain {
    crls: Crls,
    changes: tokio::sync::watch::Receiver<u64>,
    roots: MeshRoots,
    chain: Vec<CertificateDer<'static>>,
    usage: webpki::KeyUsage,
    /// Checks run at this time, so a certificate that expires later is never taken for
    /// revoked (only revocation closes the connection).
    established: UnixTime,
}

impl PeerChain {
    /// `changes` must have been taken before the handshake (see [`Crls::changes`]), so a
    /// reload during it is checked too.
    pub fn new(
        crls: &Crls,
        changes: tokio::sync::watch::Receiver<u64>,
        roots: &[CertificateDer<'static>],
        presented: &[CertificateDer<'_>],
        role: PeerRole,
    ) -> PeerChain {
        let usage = match role {
            PeerRole::Client => webpki::KeyUsage::client_auth(),
            PeerRole::Server => webpki::KeyUsage::server_auth(),
        };
        PeerChain {
            crls: crls.clone(),
            changes,
            roots: MeshRoots::new(provider(), roots, Some(crls)),
            chain: presented.iter().map(|c| c.clone().into_owned()).collect(),
            usage,
            established: UnixTime::now(),
        }
    }

    /// Whether the CRLs in force revoke a certificate of the chain.
    pub fn is_revoked(&self) -> bool {
        let Some((leaf, intermediates)) = self.chain.split_first() else {
            return false;
        };
        matches!(
            self.roots
                .verify(leaf, intermediates, self.established, self.usage),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked
            ))
        )
    }

    /// Resolves once a CRL reload revokes the chain; never if none does.
    pub async fn revoked(mut self) {
        loop {
            if self.changes.changed().await.is_err() {
                return std::future::pending().await;
            }
            self.changes.borrow_and_update();
            if self.is_revoked() {
                tracing::warn!(path = %self.crls.path().display(), "peer certificate revoked by a CRL reload; closing the connection");
                return;
            }
        }
    }
}

/// Resolves once a CRL reload revokes an accepted client's `chain` (never without CRLs),
/// counted in `istio_crl_policy_rejections_total{reporter="destination"}`: ztunnel's
/// inbound side and the waypoint then close the client's connection. `changes` as for
/// [`PeerChain::new`]; `roots` gives the ones in force now (they rotate with the mesh
/// root), asked only with CRLs: without, a connection pays nothing for this.
pub fn client_revoked<F: FnOnce() -> Vec<CertificateDer<'static>>>(
    crls: Option<&Crls>,
    changes: Option<tokio::sync::watch::Receiver<u64>>,
    roots: F,
    chain: &[CertificateDer<'static>],
    metrics: Arc<crate::metrics::Metrics>,
) -> impl std::future::Future<Output = ()> + use<F> {
    let watch = crls
        .zip(changes)
        .map(|(crls, changes)| PeerChain::new(crls, changes, &roots(), chain, PeerRole::Client));
    async move {
        match watch {
            Some(w) => {
                w.revoked().await;
                metrics.crl_rejected("destination");
            }
            None => std::future::pending().await,
        }
    }
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
        let (server_id, client_id) = (
            Identity::new("cluster.local", "default", "server"),
            Identity::new("cluster.local", "default", "client"),
        );
        let server = server_config(
            Fixed(Arc::new(certified(&ca, &server_id))),
            &[ca.root()],
            "cluster.local",
        )
        .unwrap();
        assert!(!server.ticketer.enabled());
        let server = Arc::new(server);
        let client = Arc::new(
            client_config(&certified(&ca, &client_id), &[ca.root()], vec![server_id]).unwrap(),
        );
        assert_eq!(handshake(&client, &server), rustls::HandshakeKind::Full);
        assert_eq!(
            handshake(&client, &server),
            rustls::HandshakeKind::Full,
            "the second connection resumed"
        );
    }

    /// Handshakes in memory; the first error either side hits, named by side.
    fn try_handshake(
        client: &Arc<ClientConfig>,
        server: &Arc<ServerConfig>,
    ) -> Result<(Vec<CertificateDer<'static>>, Vec<CertificateDer<'static>>), String> {
        let mut c = rustls::ClientConnection::new(
            client.clone(),
            ServerName::try_from("10.0.0.1").unwrap(),
        )
        .unwrap();
        let mut s = rustls::ServerConnection::new(server.clone()).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                s.read_tls(&mut rd).unwrap();
            }
            s.process_new_packets()
                .map_err(|e| format!("server: {e:?}"))?;
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                c.read_tls(&mut rd).unwrap();
            }
            c.process_new_packets()
                .map_err(|e| format!("client: {e:?}"))?;
        }
        let owned = |v: Option<&[CertificateDer<'_>]>| {
            v.unwrap_or_default()
                .iter()
                .map(|c| c.clone().into_owned())
                .collect()
        };
        Ok((owned(s.peer_certificates()), owned(c.peer_certificates())))
    }

    struct CrlMesh {
        dir: std::path::PathBuf,
        ca: Ca,
        server_id: Identity,
        server: CertifiedKey,
        server_serial: String,
        client: CertifiedKey,
        client_serial: String,
    }

    impl Drop for CrlMesh {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn crl_mesh(tag: &str) -> CrlMesh {
        let dir = std::env::temp_dir().join(format!("zt-tls-crl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Ca::load_or_create(&dir, None, None).unwrap();
        let server_id = Identity::new("cluster.local", "default", "server");
        let issue = |id: &Identity| {
            let c = ca.issue(id, Duration::from_secs(600)).unwrap();
            let key = rustls::crypto::ring::sign::any_supported_type(&c.key).unwrap();
            (CertifiedKey::new(c.chain.clone(), key), c.serial)
        };
        let (server, server_serial) = issue(&server_id);
        let (client, client_serial) = issue(&Identity::new("cluster.local", "default", "client"));
        CrlMesh {
            dir,
            ca,
            server_id,
            server,
            server_serial,
            client,
            client_serial,
        }
    }

    impl CrlMesh {
        fn crls(&self, serials: &[&str]) -> Crls {
            let pem = self
                .ca
                .revocation_list(serials, 1, Duration::from_secs(3600))
                .unwrap();
            Crls::with_set(
                &self.dir.join("crl.pem"),
                crl::CrlSet::parse(pem.as_bytes()).unwrap(),
            )
        }

        fn configs(&self, crls: Option<&Crls>) -> (Arc<ClientConfig>, Arc<ServerConfig>) {
            let roots = [self.ca.root()];
            let server = server_config_with_crls(
                Fixed(Arc::new(self.server.clone())),
                &roots,
                "cluster.local",
                crls,
            )
            .unwrap();
            let client =
                client_config_with_crls(&self.client, &roots, vec![self.server_id.clone()], crls)
                    .unwrap();
            (Arc::new(client), Arc::new(server))
        }
    }

    #[test]
    fn crl_revoked_peers_are_refused_on_both_sides_and_others_pass() {
        let m = crl_mesh("refuse");
        // CRLs that revoke someone else (and a CRL-less setup) let both through.
        for crls in [None, Some(m.crls(&["0badc0de"]))] {
            let (c, s) = m.configs(crls.as_ref());
            try_handshake(&c, &s).unwrap();
        }
        // The server's certificate revoked: the client refuses it with rustls' Revoked.
        let (c, s) = m.configs(Some(&m.crls(&[&m.server_serial])));
        let e = try_handshake(&c, &s).unwrap_err();
        assert!(e.starts_with("client:") && e.contains("Revoked"), "{e}");
        // The client's revoked: the server refuses it.
        let (c, s) = m.configs(Some(&m.crls(&[&m.client_serial])));
        let e = try_handshake(&c, &s).unwrap_err();
        assert!(e.starts_with("server:") && e.contains("Revoked"), "{e}");
        // A CRL from an issuer that is not in the chain is no verdict (Istio: unknown
        // status allowed), even if it lists the serials.
        let foreign = foreign_crl("O=someone else", &[&m.client_serial, &m.server_serial]);
        let (c, s) = m.configs(Some(&Crls::with_set(&m.dir.join("x"), foreign)));
        try_handshake(&c, &s).unwrap();
        // One that claims to be from our CA (same name) but is not signed by its key makes
        // the chain fail (webpki, as in Istio's ztunnel): fail closed, never ignored.
        // (Another built-in CA: a root of the same name, with another key.)
        let other = crl_mesh("refuse-other");
        let forged = other
            .ca
            .revocation_list(&["0badc0de"], 1, Duration::from_secs(60))
            .unwrap();
        let forged = crl::CrlSet::parse(forged.as_bytes()).unwrap();
        let (c, s) = m.configs(Some(&Crls::with_set(&m.dir.join("x"), forged)));
        assert!(try_handshake(&c, &s)
            .unwrap_err()
            .contains("InvalidCrlSignature"));
    }

    /// A CRL from a CA of another key, named `org`.
    fn foreign_crl(org: &str, serials: &[&str]) -> crl::CrlSet {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p.distinguished_name.push(
            rcgen::DnType::OrganizationName,
            org.trim_start_matches("O="),
        );
        let issuer = rcgen::Issuer::from_params(&p, &key);
        let now = time::OffsetDateTime::now_utc();
        let hex = |h: &str| {
            (0..h.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
                .collect::<Vec<u8>>()
        };
        let crl = rcgen::CertificateRevocationListParams {
            this_update: now,
            next_update: now + time::Duration::hours(1),
            crl_number: rcgen::SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|s| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from_slice(&hex(s)),
                    revocation_time: now,
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        }
        .signed_by(&issuer)
        .unwrap();
        crl::CrlSet::parse(crl.pem().unwrap().as_bytes()).unwrap()
    }

    #[test]
    fn crl_past_next_update_still_revokes() {
        // Istio's policy: CRL expiry is not enforced, the revocations in it still count.
        let m = crl_mesh("expired");
        let pem =
            m.ca.revocation_list(&[&m.server_serial], 1, Duration::ZERO)
                .unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let crls = Crls::with_set(
            &m.dir.join("crl.pem"),
            crl::CrlSet::parse(pem.as_bytes()).unwrap(),
        );
        let (c, s) = m.configs(Some(&crls));
        assert!(try_handshake(&c, &s).unwrap_err().contains("Revoked"));
    }

    #[tokio::test]
    async fn a_crl_reload_revoking_an_open_peer_resolves_its_watch() {
        let m = crl_mesh("reload");
        let path = m.dir.join("crl.pem");
        std::fs::write(
            &path,
            m.ca.revocation_list(&["0badc0de"], 1, Duration::from_secs(60))
                .unwrap(),
        )
        .unwrap();
        let crls = Crls::load(&path).unwrap();
        let changes = (crls.changes(), crls.changes());
        let (c, s) = m.configs(Some(&crls));
        let (client_chain, server_chain) = try_handshake(&c, &s).unwrap();
        let client = PeerChain::new(
            &crls,
            changes.0,
            &[m.ca.root()],
            &client_chain,
            PeerRole::Client,
        );
        let server = PeerChain::new(
            &crls,
            changes.1,
            &[m.ca.root()],
            &server_chain,
            PeerRole::Server,
        );
        assert!(!client.is_revoked() && !server.is_revoked());
        // Polled by hand, not spawned: once a reload has changed the generation, one poll
        // runs a watch through its check of the new set (it waits on nothing else), so
        // "not resolved" after that poll is a verdict, not a matter of timing.
        let (mut client, mut server) = (
            std::pin::pin!(client.revoked()),
            std::pin::pin!(server.revoked()),
        );
        fn resolved(f: std::pin::Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
            std::future::Future::poll(
                f,
                &mut std::task::Context::from_waker(std::task::Waker::noop()),
            )
            .is_ready()
        }
        assert!(
            !resolved(client.as_mut()) && !resolved(server.as_mut()),
            "resolved with no reload"
        );

        // A reload that revokes someone else closes nothing.
        std::fs::write(
            &path,
            m.ca.revocation_list(&["0badc0de", "0badc0df"], 2, Duration::from_secs(60))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(crls.poll(), crl::Reload::Reloaded(1));
        assert!(
            !resolved(client.as_mut()),
            "a reload revoking someone else closed the client"
        );
        assert!(
            !resolved(server.as_mut()),
            "a reload revoking someone else closed the server"
        );

        // One that revokes the client: only the connection holding its chain resolves.
        std::fs::write(
            &path,
            m.ca.revocation_list(&[&m.client_serial], 3, Duration::from_secs(60))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(crls.poll(), crl::Reload::Reloaded(1));
        assert!(resolved(client.as_mut()), "revoked client not signalled");
        assert!(
            !resolved(server.as_mut()),
            "revoking the client closed the server"
        );
    }
}
