//! Certificate revocation in tests: the serial a CRL must list to revoke a workload's
//! certificate, and a CRL file replaced as Kubernetes updates a ConfigMap volume.

use std::path::Path;

use anyhow::{Context, Result};

use crate::netsim::Netns;

/// The serial of `identity`'s certificate held by the ztunnel (or waypoint) whose admin
/// endpoint is `admin` in `ns` (from its `/config_dump`), as hex: what a CRL lists.
pub async fn cert_serial(
    ns: &Netns,
    admin: std::net::SocketAddr,
    identity: &str,
) -> Result<String> {
    let (status, body) = crate::fake_istiod::http_get(ns, admin, "/config_dump").await?;
    anyhow::ensure!(status == 200, "/config_dump answered {status}: {body}");
    let dump: serde_json::Value = serde_json::from_str(&body)?;
    let cert = dump["certificates"]
        .as_array()
        .context("no certificates in /config_dump")?
        .iter()
        .find(|c| c["identity"] == identity)
        .with_context(|| format!("no {identity} in {dump:#}"))?;
    let serial: u128 = cert["certChain"][0]["serialNumber"]
        .as_str()
        .context("serialNumber")?
        .parse()?;
    Ok(format!("{serial:032x}"))
}

/// Replaces the CRL file as a ConfigMap volume update does: a new file swapped in by rename.
pub fn write_crl(path: &Path, pem: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, pem)?;
    Ok(std::fs::rename(&tmp, path)?)
}
