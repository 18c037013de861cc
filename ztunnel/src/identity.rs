//! Workload identities and their certificates: the SPIFFE identity type, the built-in
//! CA, the Istio CA client and the per-identity certificate manager.

pub mod ca;
pub mod cert;
pub mod istio_ca;
pub mod manager;
pub mod spiffe;

pub use cert::WorkloadCert;
pub use manager::CertManager;
pub use spiffe::{Identity, IdentityError, DEFAULT_TRUST_DOMAIN};
