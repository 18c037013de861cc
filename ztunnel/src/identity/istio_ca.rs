//! Certificates from the Istio CA on istiod (`IstioCertificateService/CreateCertificate`):
//! a CSR per identity with a fresh ECDSA P-256 key, the node proxy impersonating the
//! pod's identity (`ImpersonatedIdentity`), the bearer token and cluster id from
//! `istiod::IstiodConfig`. The trust roots are the mesh root file's.

use std::time::{Duration, SystemTime};

use prost_types::value::Kind;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tonic::transport::Channel;

use super::cert::WorkloadCert;
use super::manager::{CaClient, CertError, SignFuture};
use super::spiffe::Identity;
use crate::istiod::channel::{IstiodConfig, IstiodError};
use crate::xds::proto::istio::v1::auth::{
    istio_certificate_service_client::IstioCertificateServiceClient, IstioCertificateRequest,
};

/// How long one CreateCertificate may take (connect, TLS and answer included).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

pub struct IstioCa {
    istiod: IstiodConfig,
    channel: Channel,
    ttl: Duration,
    /// This proxy's own identity: asked for without impersonation.
    own: Option<Identity>,
}

impl IstioCa {
    pub fn new(
        istiod: IstiodConfig,
        ttl: Duration,
        own: Option<Identity>,
    ) -> Result<IstioCa, IstiodError> {
        let channel = istiod.channel()?;
        Ok(IstioCa {
            istiod,
            channel,
            ttl,
            own,
        })
    }

    async fn request(&self, id: &Identity) -> Result<WorkloadCert, CertError> {
        let remote = |reason: String| CertError::Remote {
            identity: id.clone(),
            reason,
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| remote(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(
            id.to_string()
                .try_into()
                .map_err(|e: rcgen::Error| remote(e.to_string()))?,
        )];
        let csr = params
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .map_err(|e| remote(e.to_string()))?;
        let metadata = (self.own.as_ref() != Some(id)).then(|| prost_types::Struct {
            fields: [(
                "ImpersonatedIdentity".to_string(),
                prost_types::Value {
                    kind: Some(Kind::StringValue(id.to_string())),
                },
            )]
            .into(),
        });
        let req = IstioCertificateRequest {
            csr,
            validity_duration: self.ttl.as_secs() as i64,
            metadata,
        };
        let mut client = IstioCertificateServiceClient::new(self.channel.clone());
        // A CA that accepts and never answers must not hold a pod's enrollment forever.
        let resp = tokio::time::timeout(
            REQUEST_TIMEOUT,
            client.create_certificate(self.istiod.request(req)),
        )
        .await
        .map_err(|_| remote(format!("no answer from the CA within {REQUEST_TIMEOUT:?}")))?
        .map_err(|s| remote(format!("{} ({:?})", s.message(), s.code())))?
        .into_inner();
        let mut chain: Vec<CertificateDer<'static>> = Vec::new();
        for pem in &resp.cert_chain {
            use rustls_pki_types::pem::PemObject;
            for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                chain.push(c.map_err(|e| {
                    remote(format!("unparsable certificate in the response: {e:?}"))
                })?);
            }
        }
        let leaf = chain
            .first()
            .ok_or_else(|| remote("the response holds no certificate".into()))?;
        // The leaf must be ours: our identity and our key (a CA answering for someone
        // else, or with another key, is refused rather than served).
        let got = crate::tls::identity_from_cert(leaf).map_err(|e| remote(format!("leaf: {e}")))?;
        if &got != id {
            return Err(remote(format!(
                "the CA returned a certificate for {got}, not the requested identity"
            )));
        }
        let (not_before, not_after, serial, spki) = leaf_facts(leaf).map_err(remote)?;
        if spki != key.public_key_raw() {
            return Err(remote(
                "the returned certificate is not for the key in our request".into(),
            ));
        }
        // Istio sends leaf, intermediates, root: the root is not presented.
        if chain.len() > 1 {
            chain.pop();
        }
        let roots = self
            .istiod
            .root_cert
            .read()
            .map_err(|e| remote(e.to_string()))?;
        Ok(WorkloadCert {
            identity: id.clone(),
            chain,
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            roots,
            not_before,
            not_after,
            serial,
        })
    }
}

/// Validity, serial (hex) and public key (raw bits) of a certificate.
fn leaf_facts(
    der: &CertificateDer<'_>,
) -> Result<(SystemTime, SystemTime, String, Vec<u8>), String> {
    use x509_parser::prelude::*;
    let (_, cert) =
        X509Certificate::from_der(der.as_ref()).map_err(|e| format!("leaf does not parse: {e}"))?;
    let t =
        |secs: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).unwrap_or(0));
    let v = cert.validity();
    let serial = cert.serial.to_str_radix(16);
    Ok((
        t(v.not_before.timestamp()),
        t(v.not_after.timestamp()),
        serial,
        cert.public_key().subject_public_key.data.to_vec(),
    ))
}

impl CaClient for IstioCa {
    fn sign<'a>(&'a self, id: &'a Identity) -> SignFuture<'a> {
        Box::pin(self.request(id))
    }
}
