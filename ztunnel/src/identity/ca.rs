//! The built-in CA for standalone use: an ECDSA P-256 root kept in the state directory
//! (or loaded from files), issuing short-lived SPIFFE leaf certificates.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::cert::WorkloadCert;
use super::spiffe::Identity;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("cannot read CA file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write CA file {path}: {source}; check that the state directory is writable")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CA file {path} is not a valid PEM certificate or key: {source}")]
    Parse { path: PathBuf, source: rcgen::Error },
    #[error("certificate serial {0:?} is not hexadecimal")]
    BadSerial(String),
    #[error("cannot sign a certificate for {identity}: {source}")]
    Sign {
        identity: String,
        source: rcgen::Error,
    },
    #[error("--ca-cert and --ca-key must be given together")]
    HalfGiven,
    #[error("CA key {path} is readable or writable by others (mode {mode:03o}); run `chmod 600 {path}` (for a Kubernetes Secret volume, set defaultMode: 0400)")]
    KeyPermissions { path: PathBuf, mode: u32 },
}

pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    root_der: CertificateDer<'static>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

const ROOT_CERT_FILE: &str = "ca-cert.pem";
const ROOT_KEY_FILE: &str = "ca-key.pem";

impl Ca {
    /// Loads the root from `--ca-cert/--ca-key`, else from the state directory, else
    /// generates one there (mode 0600 key) so restarts and other nodes can share it.
    pub fn load_or_create(
        state_dir: &Path,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Ca, CaError> {
        match (cert, key) {
            (Some(c), Some(k)) => return Ca::from_files(c, k),
            (None, None) => {}
            _ => return Err(CaError::HalfGiven),
        }
        let cert_path = state_dir.join(ROOT_CERT_FILE);
        let key_path = state_dir.join(ROOT_KEY_FILE);
        if cert_path.exists() && key_path.exists() {
            return Ca::from_files(&cert_path, &key_path);
        }
        let write_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CaError::Write { path, source }
        };
        std::fs::create_dir_all(state_dir).map_err(write_err(state_dir))?;
        let (cert_pem, key_pem) = Ca::generate_root_pem()?;
        write_new(&key_path, &key_pem, 0o600).map_err(write_err(&key_path))?;
        write_new(&cert_path, &cert_pem, 0o644).map_err(write_err(&cert_path))?;
        tracing::info!(path = %cert_path.display(), "generated a new mesh root CA");
        Ca::from_pem(&cert_pem, &key_pem, &cert_path)
    }

    pub fn from_files(cert: &Path, key: &Path) -> Result<Ca, CaError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| CaError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        check_key_mode(key)?;
        let key_pem = read(key)?;
        let cert_pem = read(cert)?;
        KeyPair::from_pem(&key_pem).map_err(|source| CaError::Parse {
            path: key.to_path_buf(),
            source,
        })?;
        Ca::from_pem(&cert_pem, &key_pem, cert)
    }

    /// A fresh root, as PEM (certificate, PKCS#8 key).
    pub fn generate_root_pem() -> Result<(String, String), CaError> {
        let sign_err = |source| CaError::Sign {
            identity: "root".into(),
            source,
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "ztunnel-rs standalone mesh");
        params.distinguished_name = dn;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(3650);
        let cert = params.self_signed(&key).map_err(sign_err)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    fn from_pem(cert_pem: &str, key_pem: &str, cert_path: &Path) -> Result<Ca, CaError> {
        let parse_err = |source| CaError::Parse {
            path: cert_path.to_path_buf(),
            source,
        };
        let key = KeyPair::from_pem(key_pem).map_err(parse_err)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(parse_err)?;
        let root_der = pem_to_der(cert_pem).ok_or(CaError::Parse {
            path: cert_path.to_path_buf(),
            source: rcgen::Error::CouldNotParseCertificate,
        })?;
        Ok(Ca { issuer, root_der })
    }

    pub fn root(&self) -> CertificateDer<'static> {
        self.root_der.clone()
    }

    /// Issues a leaf for `identity`: URI SAN only, no CN, EKU serverAuth + clientAuth.
    pub fn issue(&self, identity: &Identity, ttl: Duration) -> Result<WorkloadCert, CaError> {
        let sign_err = |source| CaError::Sign {
            identity: identity.to_string(),
            source,
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let uri = identity.to_string().try_into().map_err(sign_err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let serial: [u8; 16] = rand::random();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let now = SystemTime::now();
        // Backdate a little for clock skew between nodes.
        let not_before = now - Duration::from_secs(60);
        let not_after = now + ttl;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer).map_err(sign_err)?;
        Ok(WorkloadCert {
            identity: identity.clone(),
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            roots: vec![self.root_der.clone()],
            not_before,
            not_after,
            serial: serial.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// A CRL (PEM) signed by this root revoking the certificates with these serials (hex,
    /// as [`WorkloadCert::serial`]); `number` is its CRL number. For operators feeding
    /// `CRL_PATH`, and for tests.
    pub fn revocation_list(
        &self,
        serials: &[&str],
        number: u64,
        next_update: Duration,
    ) -> Result<String, CaError> {
        let sign_err = |source| CaError::Sign {
            identity: "a CRL".into(),
            source,
        };
        let now = time::OffsetDateTime::now_utc();
        let revoked_certs = serials
            .iter()
            .map(|hex| {
                let bytes = (0..hex.len())
                    .step_by(2)
                    .map(|i| {
                        hex.get(i..i + 2)
                            .and_then(|b| u8::from_str_radix(b, 16).ok())
                    })
                    .collect::<Option<Vec<u8>>>()
                    .filter(|b| !b.is_empty() && hex.len() % 2 == 0)
                    .ok_or_else(|| CaError::BadSerial(hex.to_string()))?;
                Ok(rcgen::RevokedCertParams {
                    serial_number: SerialNumber::from_slice(&bytes),
                    revocation_time: now,
                    reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
            })
            .collect::<Result<Vec<_>, CaError>>()?;
        let params = rcgen::CertificateRevocationListParams {
            this_update: now - time::Duration::minutes(1),
            next_update: now + next_update,
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs,
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params
            .signed_by(&self.issuer)
            .map_err(sign_err)?
            .pem()
            .map_err(sign_err)
    }
}

/// Writes `path` afresh with `mode`: into a new file beside it (O_EXCL, O_NOFOLLOW: no
/// symlink planted there is followed, no old file keeps a wider mode), then renamed over
/// `path` (which replaces a symlink at `path` rather than writing through it).
fn write_new(path: &Path, contents: &str, mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The umask may have narrowed the mode; never widened it, but make it exact.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A CA key anyone else on the node can read is a compromised mesh: refuse to use it.
fn check_key_mode(key: &Path) -> Result<(), CaError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(key).map_err(|source| CaError::Read {
        path: key.to_path_buf(),
        source,
    })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(CaError::KeyPermissions {
            path: key.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

pub fn pem_to_der(pem: &str) -> Option<CertificateDer<'static>> {
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_persists_across_restarts() {
        let dir = std::env::temp_dir().join(format!("zt-ca-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = Ca::load_or_create(&dir, None, None).unwrap();
        let b = Ca::load_or_create(&dir, None, None).unwrap();
        assert_eq!(a.root(), b.root());
        let id = Identity::new("cluster.local", "default", "client");
        let leaf = b.issue(&id, Duration::from_secs(3600)).unwrap();
        assert_eq!(crate::tls::identity_from_cert(&leaf.chain[0]).unwrap(), id);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_key_is_written_0600_without_following_symlinks_and_checked_on_load() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("zt-ca-mode-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A key file left with a wide mode, and a symlink planted where the cert goes.
        let victim = dir.join("victim");
        std::fs::write(&victim, "do not overwrite").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(ROOT_CERT_FILE)).unwrap();
        let key = dir.join(ROOT_KEY_FILE);
        std::fs::write(&key, "stale").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        // The cert is a dangling-or-not symlink and the key exists: `exists()` follows the
        // link, so both exist and the load is tried; the wide key mode refuses it.
        let e = Ca::load_or_create(&dir, None, None).unwrap_err();
        assert!(
            matches!(e, CaError::KeyPermissions { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        // A fresh state directory with the planted links: written, not followed.
        std::fs::remove_file(&key).unwrap();
        std::os::unix::fs::symlink(&victim, &key).unwrap();
        std::fs::remove_file(dir.join(ROOT_CERT_FILE)).unwrap();
        let ca = Ca::load_or_create(&dir, None, None).unwrap();
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "do not overwrite"
        );
        let meta = std::fs::symlink_metadata(&key).unwrap();
        assert!(meta.file_type().is_file(), "the key replaced the symlink");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        // And it loads again (mode 0600 passes the check).
        let again = Ca::load_or_create(&dir, None, None).unwrap();
        assert_eq!(ca.root(), again.root());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn half_given_files_are_rejected() {
        let e =
            Ca::load_or_create(Path::new("/nonexistent"), Some(Path::new("/x")), None).unwrap_err();
        assert!(matches!(e, CaError::HalfGiven));
    }
}
