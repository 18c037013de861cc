//! Talks HBONE to a ztunnel directly, as a (possibly hostile) peer would, using the
//! mesh CA from a test's state directory.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use rustls_pki_types::ServerName;
use ztunnel::identity::ca::Ca;
use ztunnel::identity::Identity;

use crate::netsim::Netns;

/// An h2 connection over mTLS to `dst` (a pod's :15008), presenting `identity`.
pub async fn connect(
    from: &Netns,
    ca: &Ca,
    identity: &Identity,
    expected_server: Identity,
    dst: SocketAddr,
) -> Result<h2::client::SendRequest<Bytes>> {
    let cert = ca.issue(identity, Duration::from_secs(600))?;
    let key = rustls::crypto::ring::sign::any_supported_type(&cert.key)?;
    let ck = rustls::sign::CertifiedKey::new(cert.chain.clone(), key);
    let cfg = ztunnel::tls::client_config(&ck, &[ca.root()], vec![expected_server])?;
    let tcp = from.connect(dst).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::IpAddress(dst.ip().into()), tcp)
        .await
        .context("TLS handshake")?;
    let (send, conn) = h2::client::handshake(tls).await.context("h2 handshake")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

/// Sends one request and returns the response status.
pub async fn status(send: &h2::client::SendRequest<Bytes>, req: http::Request<()>) -> Result<http::StatusCode> {
    let mut send = send.clone().ready().await?;
    let (resp, _stream) = send.send_request(req, false)?;
    let resp = tokio::time::timeout(Duration::from_secs(10), resp).await.context("no HBONE response")??;
    Ok(resp.status())
}

/// Opens a CONNECT stream to `authority`, sends `data`, ends the stream and reads until
/// the peer ends it: the status and what came back (nothing unless 200).
pub async fn roundtrip(send: &h2::client::SendRequest<Bytes>, authority: &str, data: &[u8]) -> Result<(http::StatusCode, Vec<u8>)> {
    let mut send = send.clone().ready().await?;
    let (resp, mut stream) = send.send_request(connect_req(authority), false)?;
    let resp = tokio::time::timeout(Duration::from_secs(10), resp).await.context("no HBONE response")??;
    let status = resp.status();
    if status != http::StatusCode::OK {
        return Ok((status, Vec::new()));
    }
    stream.send_data(Bytes::copy_from_slice(data), true)?;
    let mut body = resp.into_body();
    let mut back = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), body.data()).await.context("tunnel stalled")? {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        back.extend_from_slice(&chunk);
    }
    Ok((status, back))
}

pub fn connect_req(authority: &str) -> http::Request<()> {
    http::Request::builder().method(http::Method::CONNECT).uri(authority).body(()).unwrap_or_default()
}

pub fn load_ca(state: &Path) -> Result<Ca> {
    Ok(Ca::from_files(&state.join("ca-cert.pem"), &state.join("ca-key.pem"))?)
}
