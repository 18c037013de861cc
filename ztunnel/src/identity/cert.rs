//! A workload's leaf certificate and key, and when to renew it.

use std::time::{Duration, SystemTime};

use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::spiffe::Identity;

/// A leaf certificate and key for one identity.
pub struct WorkloadCert {
    pub identity: Identity,
    /// Leaf first, then intermediates (the root is not sent).
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub roots: Vec<CertificateDer<'static>>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial: String,
}

impl WorkloadCert {
    /// When to renew a certificate that arrived at `received`: half-way through the part
    /// of its lifetime left then. CAs backdate `not_before` against clock skew (ours and
    /// the test CA by 60 s); counted from there, a short-lived leaf (`WORKLOAD_CERT_TTL`
    /// under the backdating) is past half-life on arrival and would be requested again
    /// at once, in a loop against the CA. Never sooner than [`MIN_REFRESH`] after receipt,
    /// so a CA answering with already-expired leaves is not hammered either.
    pub fn refresh_at(&self, received: SystemTime) -> SystemTime {
        let from = self.not_before.max(received);
        let left = self.not_after.duration_since(from).unwrap_or_default();
        received + (from.duration_since(received).unwrap_or_default() + left / 2).max(MIN_REFRESH)
    }
}

/// The shortest time between receiving a certificate and asking for the next one.
pub const MIN_REFRESH: Duration = Duration::from_secs(1);
