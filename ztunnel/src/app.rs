//! What both binaries (ztunnel and the waypoint) share at start-up: where workload
//! certificates come from, logging, the metrics and readiness endpoints, and the flag
//! reference. One place, so the two cannot drift apart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub mod flags;
pub mod log;

pub use log::{init_logging, ReloadableLog};

use crate::identity::ca::{Ca, CaError};
use crate::identity::manager::LocalCa;
use crate::identity::CertManager;
use crate::istiod::{IstiodArgs, IstiodError};
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("Istio CA: {0}")]
    IstioCa(#[from] IstiodError),
    #[error("built-in CA: {0}")]
    LocalCa(#[from] CaError),
    #[error("no CA_ADDRESS and no mesh CA in {dir}: give the Istio CA's address, or the mesh root (ca-cert.pem, ca-key.pem) the node proxies use: {source}")]
    NoSharedCa { dir: PathBuf, source: CaError },
    #[error("cannot listen on {addr}: {source}; is another process using the port?")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The built-in CA a binary falls back to without the Istio CA.
pub enum BuiltinCa<'a> {
    /// ztunnel: the root in `state_dir` (made on first start) or the given files.
    LoadOrCreate {
        state_dir: &'a Path,
        cert: Option<&'a Path>,
        key: Option<&'a Path>,
    },
    /// The waypoint: the mesh root the node proxies share, in `state_dir`; never made
    /// here (a root of its own would split the mesh's trust).
    Shared { state_dir: &'a Path },
}

/// Workload certificates from the Istio CA when `CA_ADDRESS` is set, else from `builtin`.
pub fn cert_manager(
    istiod: &IstiodArgs,
    ttl: Duration,
    builtin: BuiltinCa<'_>,
) -> Result<Arc<CertManager>, AppError> {
    if let Some(certs) = istiod.istio_ca(ttl)? {
        tracing::info!(
            ca = istiod.ca_address.as_deref().unwrap_or_default(),
            "workload certificates from the Istio CA"
        );
        return Ok(certs);
    }
    let ca = match builtin {
        BuiltinCa::LoadOrCreate {
            state_dir,
            cert,
            key,
        } => {
            tracing::info!(state_dir = %state_dir.display(), shared_root = cert.is_some(), "workload certificates from the built-in CA");
            Ca::load_or_create(state_dir, cert, key)?
        }
        BuiltinCa::Shared { state_dir } => {
            tracing::info!(state_dir = %state_dir.display(), "workload certificates from the mesh's shared built-in CA");
            Ca::from_files(
                &state_dir.join("ca-cert.pem"),
                &state_dir.join("ca-key.pem"),
            )
            .map_err(|source| AppError::NoSharedCa {
                dir: state_dir.to_path_buf(),
                source,
            })?
        }
    };
    Ok(CertManager::new(Arc::new(LocalCa { ca, ttl })))
}

/// Serves Prometheus metrics and readiness (`/healthz/ready`) on each of `addrs`, bound
/// before this returns so a port conflict fails the start.
/// Istio's wildcard with IPv6 on (IPV6_ENABLED): `0.0.0.0:port` is taken as `[::]:port`,
/// one socket for both families ([`crate::http_endpoint::bind`] makes it dual-stack), so
/// an IPv6 pod's probes and scrapes reach it. Unchanged when `ipv6` is off, or IPv6 is
/// off in this network namespace (binding `[::]` would fail).
pub fn both_families(addr: SocketAddr, ipv6: bool) -> SocketAddr {
    let v6_on = || {
        std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
            .is_ok_and(|v| v.trim() == "0")
    };
    if ipv6 && addr.ip() == std::net::Ipv4Addr::UNSPECIFIED && v6_on() {
        SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), addr.port())
    } else {
        addr
    }
}

pub async fn serve_observability(
    addrs: &[SocketAddr],
    metrics: &Arc<Metrics>,
) -> Result<(), AppError> {
    for &addr in addrs {
        let l = crate::http_endpoint::bind(addr)
            .await
            .map_err(|source| AppError::Listen { addr, source })?;
        tokio::spawn(crate::metrics_endpoint::serve(l, metrics.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wildcard_takes_both_families_with_ipv6_on() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(both_families(a("0.0.0.0:15020"), false), a("0.0.0.0:15020"));
        assert_eq!(
            both_families(a("10.0.0.1:15020"), true),
            a("10.0.0.1:15020"),
            "a given address stays"
        );
        assert_eq!(both_families(a("[::1]:15020"), true), a("[::1]:15020"));
        let v6_on = std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
            .is_ok_and(|v| v.trim() == "0");
        let want = if v6_on {
            a("[::]:15020")
        } else {
            a("0.0.0.0:15020")
        };
        assert_eq!(both_families(a("0.0.0.0:15020"), true), want);
    }
}
