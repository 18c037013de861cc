//! Per-identity certificates for the workloads on this node: fetched on enrollment,
//! refreshed at half their lifetime, and only ever issued for local identities.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::sign::CertifiedKey;

use super::ca::{Ca, CaError};
use super::cert::WorkloadCert;
use super::spiffe::Identity;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(
        "refusing a certificate for {0}: no workload with that identity is enrolled on this node"
    )]
    NotLocal(Identity),
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("certificate for {identity} is unusable: {reason}")]
    Unusable { identity: Identity, reason: String },
    #[error("the Istio CA gave no usable certificate for {identity}: {reason}")]
    Remote { identity: Identity, reason: String },
}

/// A certificate ready for rustls.
pub struct CertState {
    pub cert: WorkloadCert,
    pub certified_key: Arc<CertifiedKey>,
    /// `cert.roots` as trust anchors, parsed once.
    pub anchors: Arc<Vec<rustls_pki_types::TrustAnchor<'static>>>,
}

/// Istio's `CertState` for one local identity.
pub enum HeldCert {
    /// Not issued yet (the first request may be in flight).
    Initializing,
    Available(Arc<CertState>),
    /// The last attempt failed and there is no certificate to fall back on: why.
    Unavailable(String),
}

pub type SignFuture<'a> =
    Pin<Box<dyn Future<Output = Result<WorkloadCert, CertError>> + Send + 'a>>;

/// Where certificates come from: the built-in CA, or (later) the Istio CA.
pub trait CaClient: Send + Sync + 'static {
    fn sign<'a>(&'a self, id: &'a Identity) -> SignFuture<'a>;
}

/// The built-in CA with a fixed leaf lifetime.
pub struct LocalCa {
    pub ca: Ca,
    pub ttl: Duration,
}

impl CaClient for LocalCa {
    fn sign<'a>(&'a self, id: &'a Identity) -> SignFuture<'a> {
        Box::pin(async move { Ok(self.ca.issue(id, self.ttl)?) })
    }
}

struct Entry {
    refs: usize,
    current: Option<Arc<ArcSwap<CertState>>>,
    /// Why the last first-issue attempt failed, while there is no certificate yet
    /// (Istio's `CertState::Unavailable`, shown in config dumps).
    failed: Option<String>,
    rotation: Option<tokio::task::AbortHandle>,
}

pub struct CertManager {
    ca: Arc<dyn CaClient>,
    entries: Mutex<HashMap<Identity, Entry>>,
    /// Bumped to make every rotation task re-issue now (the mesh roots changed).
    reissue: tokio::sync::watch::Sender<u64>,
    metrics: std::sync::OnceLock<crate::metrics::control::CertMetrics>,
}

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CertManager")
    }
}

impl CertManager {
    pub fn new(ca: Arc<dyn CaClient>) -> Arc<CertManager> {
        Arc::new(CertManager {
            ca,
            entries: Mutex::new(HashMap::new()),
            reissue: tokio::sync::watch::Sender::new(0),
            metrics: std::sync::OnceLock::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Identity, Entry>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts/removes).
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `id` as belonging to a pod enrolled on this node (reference counted).
    pub fn allow(&self, id: &Identity) {
        self.lock()
            .entry(id.clone())
            .or_insert(Entry {
                refs: 0,
                current: None,
                failed: None,
                rotation: None,
            })
            .refs += 1;
    }

    /// Drops one reference; the last one forgets the certificate and stops its rotation.
    pub fn release(&self, id: &Identity) {
        let mut map = self.lock();
        if let Some(e) = map.get_mut(id) {
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 {
                if let Some(r) = e.rotation.take() {
                    r.abort();
                }
                map.remove(id);
            }
        }
    }

    /// The current certificate for a local identity, issuing it on first use.
    pub async fn fetch(self: &Arc<Self>, id: &Identity) -> Result<Arc<CertState>, CertError> {
        let existing = match self.lock().get(id) {
            None => return Err(CertError::NotLocal(id.clone())),
            Some(e) => e.current.clone(),
        };
        if let Some(cur) = existing {
            return Ok(cur.load_full());
        }
        let issued = self.issue(id).await;
        let mut map = self.lock();
        let Some(entry) = map.get_mut(id) else {
            return Err(CertError::NotLocal(id.clone()));
        };
        let state = match issued {
            Ok(s) => Arc::new(ArcSwap::from_pointee(s)),
            Err(e) => {
                if entry.current.is_none() {
                    entry.failed = Some(e.to_string());
                }
                return Err(e);
            }
        };
        if let Some(cur) = &entry.current {
            // Another task won the race; keep one certificate per identity.
            return Ok(cur.load_full());
        }
        entry.current = Some(state.clone());
        entry.failed = None;
        entry.rotation =
            Some(tokio::spawn(rotate(self.clone(), id.clone(), state.clone())).abort_handle());
        Ok(state.load_full())
    }

    /// Counts certificate requests in `m` from now on.
    pub fn set_metrics(&self, m: crate::metrics::control::CertMetrics) {
        let _ = self.metrics.set(m);
    }

    /// Re-issues every certificate now (e.g. the mesh root changed): the roots and
    /// chains in use get replaced without waiting for half-life.
    pub fn reissue_all(&self) {
        self.reissue.send_modify(|g| *g += 1);
    }

    /// Identities with a certificate, and the certificate (for config dumps).
    pub fn snapshot(&self) -> Vec<(Identity, Option<Arc<CertState>>)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|(id, e)| (id.clone(), e.current.as_ref().map(|c| c.load_full())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Every local identity in Istio's certificate states (for config dumps).
    pub fn states(&self) -> Vec<(Identity, HeldCert)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|(id, e)| {
                let held = match (&e.current, &e.failed) {
                    (Some(c), _) => HeldCert::Available(c.load_full()),
                    (None, Some(err)) => HeldCert::Unavailable(err.clone()),
                    (None, None) => HeldCert::Initializing,
                };
                (id.clone(), held)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The current certificate without issuing one (for TLS handshakes, which are synchronous).
    pub fn current(&self, id: &Identity) -> Option<Arc<CertState>> {
        self.lock()
            .get(id)
            .and_then(|e| e.current.as_ref().map(|c| c.load_full()))
    }

    async fn issue(&self, id: &Identity) -> Result<CertState, CertError> {
        let r = self.issue_once(id).await;
        if let Some(m) = self.metrics.get() {
            m.request(r.is_ok());
        }
        r
    }

    async fn issue_once(&self, id: &Identity) -> Result<CertState, CertError> {
        let cert = self.ca.sign(id).await?;
        let leaf_id = cert.chain.first().map(crate::tls::identity_from_cert);
        if !matches!(&leaf_id, Some(Ok(got)) if got == id) {
            return Err(CertError::Unusable {
                identity: id.clone(),
                reason: format!("the CA returned a leaf for {leaf_id:?}"),
            });
        }
        let key = rustls::crypto::ring::sign::any_supported_type(&cert.key).map_err(|e| {
            CertError::Unusable {
                identity: id.clone(),
                reason: e.to_string(),
            }
        })?;
        let certified_key = Arc::new(CertifiedKey::new(cert.chain.clone(), key));
        certified_key
            .keys_match()
            .map_err(|e| CertError::Unusable {
                identity: id.clone(),
                reason: format!("certificate and key disagree: {e}"),
            })?;
        let anchors = Arc::new(crate::tls::trust_anchors(&cert.roots));
        Ok(CertState {
            cert,
            certified_key,
            anchors,
        })
    }
}

/// The current certificate of one local identity, for TLS handshakes (rotation needs no
/// new TLS config: each handshake asks for the certificate in force).
#[derive(Clone)]
pub struct IdentityCert {
    pub certs: Arc<CertManager>,
    pub identity: Identity,
}

impl std::fmt::Debug for IdentityCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdentityCert({})", self.identity)
    }
}

impl crate::tls::CurrentCert for IdentityCert {
    fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.certs
            .current(&self.identity)
            .map(|c| c.certified_key.clone())
    }

    fn anchors(&self) -> Option<Arc<Vec<rustls_pki_types::TrustAnchor<'static>>>> {
        self.certs
            .current(&self.identity)
            .map(|c| c.anchors.clone())
    }
}

/// Refreshes a certificate at half-life; on failure retries with backoff and keeps the
/// still-valid certificate in place.
async fn rotate(mgr: Arc<CertManager>, id: Identity, slot: Arc<ArcSwap<CertState>>) {
    let mut backoff = Duration::from_millis(500);
    let mut reissue = mgr.reissue.subscribe();
    reissue.mark_unchanged();
    // The first certificate was issued just before this task started.
    let mut received = SystemTime::now();
    loop {
        let at = slot.load().cert.refresh_at(received);
        let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = reissue.changed() => tracing::info!(identity = %id, "re-issuing the certificate (mesh roots changed)"),
        }
        match mgr.issue(&id).await {
            Ok(next) => {
                tracing::info!(identity = %id, serial = %next.cert.serial, "certificate rotated");
                slot.store(Arc::new(next));
                received = SystemTime::now();
                backoff = Duration::from_millis(500);
            }
            Err(e) => {
                tracing::warn!(identity = %id, error = %e, retry_in = ?backoff, "certificate refresh failed; keeping the current one");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::cert::MIN_REFRESH;
    use rustls_pki_types::PrivateKeyDer;

    fn manager(ttl: Duration) -> Arc<CertManager> {
        let dir =
            std::env::temp_dir().join(format!("zt-mgr-{}-{}", std::process::id(), ttl.as_millis()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        CertManager::new(Arc::new(LocalCa { ca, ttl }))
    }

    #[tokio::test]
    async fn only_local_identities_get_certificates() {
        let mgr = manager(Duration::from_secs(3600));
        let id = Identity::new("cluster.local", "default", "a");
        assert!(matches!(mgr.fetch(&id).await, Err(CertError::NotLocal(_))));
        mgr.allow(&id);
        let c = mgr.fetch(&id).await.unwrap();
        assert_eq!(c.cert.identity, id);
        // Same certificate on the next fetch; gone after the last release.
        assert_eq!(mgr.fetch(&id).await.unwrap().cert.serial, c.cert.serial);
        mgr.release(&id);
        assert!(matches!(mgr.fetch(&id).await, Err(CertError::NotLocal(_))));
    }

    /// Fails its first `fails` requests, then signs with the built-in CA.
    struct Flaky {
        fails: std::sync::atomic::AtomicUsize,
        ca: LocalCa,
    }

    impl CaClient for Flaky {
        fn sign<'a>(&'a self, id: &'a Identity) -> SignFuture<'a> {
            use std::sync::atomic::Ordering;
            if self
                .fails
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                let reason = "istiod unreachable".to_string();
                return Box::pin(async move {
                    Err(CertError::Remote {
                        identity: id.clone(),
                        reason,
                    })
                });
            }
            self.ca.sign(id)
        }
    }

    #[tokio::test]
    async fn a_failed_first_fetch_is_unavailable_until_one_succeeds() {
        let dir = std::env::temp_dir().join(format!("zt-mgr-flaky-{}", std::process::id()));
        let ca = Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let flaky = Flaky {
            fails: 1.into(),
            ca: LocalCa {
                ca,
                ttl: Duration::from_secs(3600),
            },
        };
        let mgr = CertManager::new(Arc::new(flaky));
        let id = Identity::new("cluster.local", "default", "a");
        mgr.allow(&id);
        assert!(matches!(mgr.states()[0].1, HeldCert::Initializing));
        assert!(mgr.fetch(&id).await.is_err());
        match &mgr.states()[0].1 {
            HeldCert::Unavailable(e) => assert!(e.contains("istiod unreachable"), "{e}"),
            _ => panic!("want Unavailable"),
        }
        mgr.fetch(&id).await.unwrap();
        assert!(matches!(mgr.states()[0].1, HeldCert::Available(_)));
    }

    #[tokio::test]
    async fn rotates_at_half_life() {
        // Leaves are backdated 60 s; half-life counts from receipt: 1 s after issue.
        let mgr = manager(Duration::from_secs(2));
        let id = Identity::new("cluster.local", "default", "a");
        mgr.allow(&id);
        let first = mgr.fetch(&id).await.unwrap();
        let start = std::time::Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = mgr.current(&id).unwrap();
            if now.cert.serial != first.cert.serial {
                assert!(now.cert.not_after > first.cert.not_after);
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "certificate was not rotated at half-life"
            );
        }
    }

    #[tokio::test]
    async fn backdated_short_lived_certificates_are_not_requested_in_a_loop() {
        // 3 s leaves backdated 60 s: counted from not_before they are past half-life on
        // arrival. Refreshed every 1.5 s, that is 2 or 3 requests in 3.5 s, not hundreds.
        let mgr = manager(Duration::from_secs(3));
        let id = Identity::new("cluster.local", "default", "a");
        mgr.allow(&id);
        let first = mgr.fetch(&id).await.unwrap();
        let mut serials = std::collections::HashSet::from([first.cert.serial.clone()]);
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(3500) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            serials.insert(mgr.current(&id).unwrap().cert.serial.clone());
        }
        assert!(
            (2..=4).contains(&serials.len()),
            "{} certificates in 3.5 s",
            serials.len()
        );
    }

    #[test]
    fn refresh_time() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let cert = |nb: u64, na: u64| WorkloadCert {
            identity: Identity::new("cluster.local", "default", "a"),
            chain: vec![],
            key: PrivateKeyDer::Pkcs8(Vec::new().into()),
            roots: vec![],
            not_before: t - Duration::from_secs(nb),
            not_after: t + Duration::from_secs(na),
            serial: String::new(),
        };
        // Not backdated: half its life.
        assert_eq!(cert(0, 3600).refresh_at(t), t + Duration::from_secs(1800));
        // Backdated: half of what is left on arrival.
        assert_eq!(cert(60, 10).refresh_at(t), t + Duration::from_secs(5));
        // Already expired, or valid from the future: not before the floor.
        assert_eq!(cert(60, 0).refresh_at(t), t + MIN_REFRESH);
        assert_eq!(
            cert(60, 10).refresh_at(t - Duration::from_secs(100)),
            t - Duration::from_secs(60) + Duration::from_secs(35)
        );
    }
}
