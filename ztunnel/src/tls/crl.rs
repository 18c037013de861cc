//! Certificate revocation lists (Istio's `CRL_PATH`): one file, PEM (one or more
//! `X509 CRL` blocks) or DER (one CRL), as a plugged-in CA's `istio-ca-crl` ConfigMap
//! mounts it. The set in force is swapped whole; the file is polled, so a Kubernetes
//! volume update (an atomic swap of the `..data` symlink) is seen like an in-place
//! write. A new file that cannot be read or parsed keeps the last good set.
//!
//! Revocation policy, as Istio's ztunnel: every certificate of the chain is checked; a
//! certificate whose issuer has no CRL here is accepted (unknown status allowed); a CRL
//! past its nextUpdate still applies.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateRevocationListDer;
use serde::Serialize;
use tokio::sync::watch;

/// How often the file is checked for a change (a `stat`; it is read only when changed).
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum CrlError {
    #[error("cannot read the CRL file {path} (CRL_PATH): {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the CRL file {path} (CRL_PATH) is not valid: {reason}")]
    Parse { path: PathBuf, reason: String },
}

/// One CRL as `/config_dump` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CrlSummary {
    pub issuer: String,
    pub this_update: String,
    pub next_update: Option<String>,
    pub revoked: usize,
}

/// The CRLs of one version of the file.
#[derive(Debug, Default)]
pub struct CrlSet {
    lists: Vec<webpki::CertRevocationList<'static>>,
    summary: Vec<CrlSummary>,
}

impl CrlSet {
    /// PEM when the data starts with a PEM header (blocks other than CRLs are skipped),
    /// else one DER CRL. Empty data, or PEM without a CRL block, is an empty set (no
    /// revocations), as in Istio's ztunnel.
    pub fn parse(data: &[u8]) -> Result<CrlSet, String> {
        if data.iter().all(u8::is_ascii_whitespace) {
            return Ok(CrlSet::default());
        }
        let ders: Vec<CertificateRevocationListDer<'static>> =
            if data.trim_ascii_start().starts_with(b"-----BEGIN") {
                CertificateRevocationListDer::pem_slice_iter(data)
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("bad PEM: {e}"))?
            } else {
                vec![CertificateRevocationListDer::from(data.to_vec())]
            };
        let mut set = CrlSet::default();
        for (i, der) in ders.iter().enumerate() {
            let owned = webpki::OwnedCertRevocationList::from_der(der.as_ref())
                .map_err(|e| format!("CRL {} of {}: {e:?}", i + 1, ders.len()))?;
            set.summary.push(summary(der.as_ref()));
            set.lists.push(owned.into());
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.lists.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }

    pub fn summary(&self) -> &[CrlSummary] {
        &self.summary
    }

    /// Runs `f` with webpki's revocation options over these CRLs (Istio's policy, see
    /// the module doc); None when there are none.
    pub fn with_options<R>(&self, f: impl FnOnce(Option<webpki::RevocationOptions<'_>>) -> R) -> R {
        let refs: Vec<&webpki::CertRevocationList<'static>> = self.lists.iter().collect();
        let options = webpki::RevocationOptionsBuilder::new(&refs).ok().map(|b| {
            b.with_depth(webpki::RevocationCheckDepth::Chain)
                .with_status_policy(webpki::UnknownStatusPolicy::Allow)
                .with_expiration_policy(webpki::ExpirationPolicy::Ignore)
                .build()
        });
        f(options)
    }
}

/// Issuer, dates and entry count for the dump; webpki already validated the DER.
fn summary(der: &[u8]) -> CrlSummary {
    use x509_parser::prelude::FromDer;
    let rfc3339 = |t: x509_parser::time::ASN1Time| {
        t.to_datetime()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    match x509_parser::revocation_list::CertificateRevocationList::from_der(der) {
        Ok((_, crl)) => CrlSummary {
            issuer: crl.issuer().to_string(),
            this_update: rfc3339(crl.last_update()),
            next_update: crl.next_update().map(rfc3339),
            revoked: crl.iter_revoked_certificates().count(),
        },
        Err(_) => CrlSummary {
            issuer: "<unparsed>".into(),
            this_update: String::new(),
            next_update: None,
            revoked: 0,
        },
    }
}

/// What identifies one version of the file (the symlink target's, if it is a symlink).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(path: &Path) -> std::io::Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The file's state as the last poll left it.
#[derive(Debug, Default)]
struct FileState {
    /// The version last read (successfully or not); None: not there.
    stamp: Option<Stamp>,
    loaded_at: Option<SystemTime>,
    /// Why the version on disk is not the one in force.
    error: Option<String>,
}

/// The outcome of one poll.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    /// A new set is in force (this many CRLs).
    Reloaded(usize),
    /// The file changed but cannot be used; the last good set stays.
    Kept(String),
}

struct Inner {
    path: PathBuf,
    current: ArcSwap<CrlSet>,
    /// Bumped on every new set, so open connections re-check their peer.
    generation: watch::Sender<u64>,
    file: Mutex<FileState>,
}

/// The CRLs in force, shared by every verifier and open connection.
#[derive(Clone)]
pub struct Crls(Arc<Inner>);

impl std::fmt::Debug for Crls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Crls")
            .field("path", &self.0.path)
            .field("loaded", &self.current().len())
            .finish()
    }
}

impl Crls {
    /// Reads `path` at start. A file that is not there yet is no CRL for now (Istio's
    /// chart mounts the ConfigMap as optional) and is picked up when it appears; one that
    /// cannot be read or parsed is an error naming the path.
    pub fn load(path: &Path) -> Result<Crls, CrlError> {
        let crls = Crls::with_set(path, CrlSet::default());
        let stamp = match Stamp::of(path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %path.display(), "CRL file (CRL_PATH) does not exist yet; no certificate is revoked until it appears");
                return Ok(crls);
            }
            Err(source) => {
                return Err(CrlError::Read {
                    path: path.into(),
                    source,
                })
            }
        };
        let set = read(path)?;
        tracing::info!(path = %path.display(), crls = set.len(), "loaded certificate revocation lists");
        crls.0.current.store(Arc::new(set));
        let mut f = crls.file();
        f.stamp = Some(stamp);
        f.loaded_at = Some(SystemTime::now());
        drop(f);
        Ok(crls)
    }

    /// A fixed set, never reloaded (tests, and the state before a file exists).
    pub fn with_set(path: &Path, set: CrlSet) -> Crls {
        Crls(Arc::new(Inner {
            path: path.into(),
            current: ArcSwap::from_pointee(set),
            generation: watch::channel(0).0,
            file: Mutex::default(),
        }))
    }

    fn file(&self) -> std::sync::MutexGuard<'_, FileState> {
        self.0.file.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn path(&self) -> &Path {
        &self.0.path
    }

    pub fn current(&self) -> Arc<CrlSet> {
        self.0.current.load_full()
    }

    /// Changes whenever a new set comes in force (subscribe before a handshake, so a
    /// reload during it is not missed).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.0.generation.subscribe()
    }

    /// Re-reads the file if it changed since the last poll. A file that went away or
    /// does not parse keeps the set in force, with a warning (once per version).
    pub fn poll(&self) -> Reload {
        let path = &self.0.path;
        let stamp = Stamp::of(path);
        let mut f = self.file();
        let now = stamp.as_ref().ok().copied();
        if now == f.stamp {
            return Reload::Unchanged;
        }
        f.stamp = now;
        let r = match stamp {
            Err(e) => Err(CrlError::Read {
                path: path.clone(),
                source: e,
            }),
            Ok(_) => read(path),
        };
        match r {
            Ok(set) => {
                let n = set.len();
                self.0.current.store(Arc::new(set));
                f.loaded_at = Some(SystemTime::now());
                f.error = None;
                drop(f);
                self.0.generation.send_modify(|g| *g += 1);
                tracing::info!(path = %path.display(), crls = n, "reloaded certificate revocation lists");
                Reload::Reloaded(n)
            }
            Err(e) => {
                let e = e.to_string();
                tracing::warn!(path = %path.display(), error = %e, "CRL file changed but cannot be used; the previous CRLs stay in force");
                f.error = Some(e.clone());
                Reload::Kept(e)
            }
        }
    }

    /// Polls the file every `every`, for as long as the process runs.
    pub async fn watch(self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // The read is small and rare (only on change), but it is file I/O.
            let crls = self.clone();
            if tokio::task::spawn_blocking(move || crls.poll())
                .await
                .is_err()
            {
                tracing::warn!("CRL poll task failed");
            }
        }
    }

    /// For `/config_dump`: the file, the CRLs in force and the last reload error.
    pub fn dump(&self) -> serde_json::Value {
        let f = self.file();
        let loaded_at = f.loaded_at.map(|t| {
            time::OffsetDateTime::from(t)
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
        });
        serde_json::json!({
            "path": self.0.path,
            "loadedAt": loaded_at,
            "error": f.error,
            "crls": self.current().summary(),
        })
    }
}

fn read(path: &Path) -> Result<CrlSet, CrlError> {
    let data = std::fs::read(path).map_err(|source| CrlError::Read {
        path: path.into(),
        source,
    })?;
    CrlSet::parse(&data).map_err(|reason| CrlError::Parse {
        path: path.into(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ca::Ca;

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("zt-crl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn ca(d: &Dir) -> Ca {
        Ca::load_or_create(&d.0.join("ca"), None, None).unwrap()
    }

    fn der_of(pem: &str) -> Vec<u8> {
        CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    #[test]
    fn parses_pem_with_several_crls_der_and_empty_files() {
        let d = dir("parse");
        let ca = ca(&d);
        let one = ca
            .revocation_list(&["0102"], 1, Duration::from_secs(3600))
            .unwrap();
        let two = ca
            .revocation_list(&["03", "04"], 2, Duration::from_secs(3600))
            .unwrap();
        // Other PEM blocks (a certificate bundled in) are skipped, as Istio's ztunnel does.
        let cert = "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n";
        let set = CrlSet::parse(format!("\n{one}{cert}{two}").as_bytes()).unwrap();
        assert_eq!(set.len(), 2);
        assert_eq!(
            set.summary().iter().map(|s| s.revoked).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(
            set.summary()[0]
                .issuer
                .contains("ztunnel-rs standalone mesh"),
            "{:?}",
            set.summary()
        );
        assert!(set.summary()[0].next_update.is_some());
        assert_eq!(CrlSet::parse(&der_of(&one)).unwrap().len(), 1, "DER");
        assert!(CrlSet::parse(b"").unwrap().is_empty());
        assert!(CrlSet::parse(b" \n").unwrap().is_empty());
        assert!(
            CrlSet::parse(cert.as_bytes()).unwrap().is_empty(),
            "PEM without a CRL block"
        );
        assert!(CrlSet::parse(b"not a CRL").is_err());
        assert!(
            CrlSet::parse(b"-----BEGIN X509 CRL-----\nMAA=\n-----END X509 CRL-----\n").is_err()
        );
        assert!(CrlSet::parse(b"-----BEGIN X509 CRL-----\nnot base64").is_err());
    }

    #[test]
    fn start_refuses_a_bad_file_naming_it_and_accepts_a_missing_one() {
        let d = dir("start");
        let bad = d.0.join("bad.pem");
        std::fs::write(&bad, "garbage").unwrap();
        let e = Crls::load(&bad).unwrap_err().to_string();
        assert!(
            e.contains(&bad.display().to_string()) && e.contains("CRL_PATH"),
            "{e}"
        );
        let unreadable = d.0.join("dir-not-file");
        std::fs::create_dir(&unreadable).unwrap();
        assert!(matches!(
            Crls::load(&unreadable),
            Err(CrlError::Read { .. })
        ));
        // Istio's chart mounts the CRL ConfigMap as optional: not there yet is no CRL yet.
        let missing = Crls::load(&d.0.join("missing.pem")).unwrap();
        assert!(missing.current().is_empty());
        let ca = ca(&d);
        std::fs::write(
            d.0.join("missing.pem"),
            ca.revocation_list(&["01"], 1, Duration::from_secs(60))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            missing.poll(),
            Reload::Reloaded(1),
            "picked up once it appears"
        );
    }

    #[test]
    fn reload_keeps_the_last_good_crls_and_follows_symlink_swaps() {
        let d = dir("reload");
        let ca = ca(&d);
        // A Kubernetes ConfigMap volume: file -> ..data/file, ..data -> a timestamped dir.
        let version = |n: u64, serials: &[&str]| {
            let v = d.0.join(format!("..v{n}"));
            std::fs::create_dir(&v).unwrap();
            std::fs::write(
                v.join("ca-crl.pem"),
                ca.revocation_list(serials, n, Duration::from_secs(60))
                    .unwrap(),
            )
            .unwrap();
            let tmp = d.0.join("..data_tmp");
            std::os::unix::fs::symlink(format!("..v{n}"), &tmp).unwrap();
            std::fs::rename(&tmp, d.0.join("..data")).unwrap();
        };
        version(1, &["01"]);
        let path = d.0.join("ca-crl.pem");
        std::os::unix::fs::symlink("..data/ca-crl.pem", &path).unwrap();
        let crls = Crls::load(&path).unwrap();
        let mut changes = crls.changes();
        assert_eq!(crls.current().summary()[0].revoked, 1);
        assert_eq!(crls.poll(), Reload::Unchanged);
        assert!(!changes.has_changed().unwrap());

        version(2, &["01", "02"]);
        assert_eq!(crls.poll(), Reload::Reloaded(1));
        assert_eq!(crls.current().summary()[0].revoked, 2);
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();

        // A broken version keeps the last good set, reports it, and bumps nothing.
        let v3 = d.0.join("..v3");
        std::fs::create_dir(&v3).unwrap();
        std::fs::write(v3.join("ca-crl.pem"), "-----BEGIN X509 CRL-----\ntruncated").unwrap();
        std::os::unix::fs::symlink("..v3", d.0.join("..data_tmp")).unwrap();
        std::fs::rename(d.0.join("..data_tmp"), d.0.join("..data")).unwrap();
        assert!(matches!(crls.poll(), Reload::Kept(_)));
        assert_eq!(crls.current().summary()[0].revoked, 2);
        assert!(!changes.has_changed().unwrap());
        assert!(
            crls.dump()["error"].as_str().unwrap().contains("not valid"),
            "{}",
            crls.dump()
        );
        assert_eq!(
            crls.poll(),
            Reload::Unchanged,
            "a broken version is reported once"
        );

        // So does the file going away; a good version afterwards is taken again.
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(crls.poll(), Reload::Kept(_)));
        assert_eq!(crls.current().len(), 1);
        version(4, &[]);
        std::os::unix::fs::symlink("..data/ca-crl.pem", &path).unwrap();
        assert_eq!(crls.poll(), Reload::Reloaded(1));
        assert_eq!(crls.current().summary()[0].revoked, 0);
        assert!(crls.dump()["error"].is_null());
    }
}
