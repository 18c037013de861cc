//! The client side of one HBONE connection: mTLS to a server that must prove one of
//! the expected identities, then HTTP/2 with HBONE's tuning, over any byte stream: a TCP
//! connection the pool dialed, or (double HBONE) a CONNECT stream inside another HBONE
//! connection, through an east-west gateway that cannot read it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::{Connection, SendRequest};
use h2::{RecvStream, SendStream};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::client::TlsStream;
use tracing::Instrument;

use super::error::HboneError;
use super::tuning::{h2_sizes, tune_tls};
use crate::identity::manager::CertState;
use crate::identity::Identity;

/// CRL_PATH's CRLs and the metrics their rejections are counted in.
pub type CrlCheck = (crate::tls::Crls, Arc<crate::metrics::Metrics>);

/// A connection after its handshakes: the handle to open streams on, the connection to
/// drive, (with CRLs) the server's chain to watch for a later revocation, and the
/// identity the server's certificate proved (one of those expected).
pub struct Handshaken<IO> {
    pub send: SendRequest<Bytes>,
    pub connection: Connection<TlsStream<IO>, Bytes>,
    pub revoked: Option<(crate::tls::PeerChain, Arc<crate::metrics::Metrics>)>,
    pub server_identity: Option<Identity>,
}

/// mTLS as `cert`'s identity over `io` to a server proving one of `expected` (`peer`
/// names it in errors), then the HTTP/2 handshake. With `crls`, a server whose chain
/// they revoke is refused (and counted).
pub async fn handshake<IO>(
    io: IO,
    peer: &str,
    server_ip: IpAddr,
    cert: &CertState,
    expected: Vec<Identity>,
    crls: Option<&CrlCheck>,
) -> Result<Handshaken<IO>, HboneError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let cfg = crate::tls::client_config_with_crls(
        &cert.certified_key,
        &cert.cert.roots,
        expected,
        crls.map(|(c, _)| c),
    )?;
    // Taken before the handshake: a CRL reload during it is checked against this server too.
    let changes = crls.map(|(c, _)| c.changes());
    let mut tls = match tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::IpAddress(server_ip.into()), io)
        .await
    {
        Ok(t) => t,
        Err(source) => {
            if let Some((_, metrics)) = crls.filter(|_| crate::tls::is_revoked(&source)) {
                metrics.crl_rejected("source");
            }
            return Err(HboneError::Tls {
                peer: peer.to_string(),
                source,
            });
        }
    };
    let revoked = crls.zip(changes).map(|((c, metrics), changes)| {
        let chain = tls.get_ref().1.peer_certificates().unwrap_or_default();
        (
            crate::tls::PeerChain::new(
                c,
                changes,
                &cert.cert.roots,
                chain,
                crate::tls::PeerRole::Server,
            ),
            metrics.clone(),
        )
    });
    let server_identity = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|leaf| crate::tls::identity_from_cert(leaf).ok());
    tune_tls(tls.get_mut().1);
    let sizes = h2_sizes();
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(sizes.stream_window)
        .initial_connection_window_size(sizes.connection_window)
        .max_frame_size(sizes.max_frame)
        .handshake::<_, Bytes>(tls)
        .await
        .map_err(|source| HboneError::H2 {
            peer: peer.to_string(),
            source,
        })?;
    Ok(Handshaken {
        send,
        connection,
        revoked,
        server_identity,
    })
}

/// Resolves once a CRL reload revokes the server's chain (never without CRLs).
pub async fn revoked_server(
    watch: Option<(crate::tls::PeerChain, Arc<crate::metrics::Metrics>)>,
) -> Arc<crate::metrics::Metrics> {
    match watch {
        Some((chain, metrics)) => {
            chain.revoked().await;
            metrics
        }
        None => std::future::pending().await,
    }
}

/// How long a finished single-use connection may take to flush its last frames and
/// close once its stream is done (the peer's ack of END_STREAM, GOAWAY).
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Keeps a single-use connection ([`connect_once`]) while its stream is in use; on drop
/// the connection closes once its last frames are out, within [`CLOSE_GRACE`].
pub struct OnceGuard {
    _done: tokio::sync::oneshot::Sender<()>,
}

/// Who answered a CONNECT through a gateway: the identity its certificate proved, and
/// what its 200 said of the destination workload (Istio's response baggage; None when
/// the baggage was malformed, all fields absent when there was none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    pub identity: Option<Identity>,
    pub baggage: Option<crate::baggage::Baggage>,
}

/// A connection of its own over `io` carrying one CONNECT `request` (double HBONE's
/// inner tunnel: a pooled one would always reach the same proxy behind the gateway).
/// Answered 200: the stream, the guard that keeps the connection, and who answered.
pub async fn connect_once<IO>(
    io: IO,
    peer: &str,
    server_ip: IpAddr,
    cert: &CertState,
    expected: Vec<Identity>,
    crls: Option<&CrlCheck>,
    request: http::Request<()>,
) -> Result<(SendStream<Bytes>, RecvStream, OnceGuard, Answered), HboneError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Handshaken {
        send,
        connection,
        revoked,
        server_identity,
    } = handshake(io, peer, server_ip, cert, expected, crls).await?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = peer.to_string();
    tokio::spawn(
        async move {
            let closing = async {
                // Dropped guard (or sender gone): the stream is finished with.
                let _ = done_rx.await;
                tokio::time::sleep(CLOSE_GRACE).await;
            };
            tokio::select! {
                r = connection => match r {
                    Ok(()) => tracing::debug!("inner HBONE connection closed"),
                    Err(e) => tracing::debug!(error = %e, "inner HBONE connection ended"),
                },
                _ = closing => tracing::debug!("inner HBONE connection did not close within its grace period"),
                m = revoked_server(revoked) => {
                    m.crl_rejected("source");
                    tracing::warn!(dst = %server, "closing an inner HBONE connection: the server's certificate is revoked");
                }
            }
        }
        .instrument(tracing::debug_span!("hbone_inner_conn", dst = %peer)),
    );
    let authority = request.uri().to_string();
    let h2err = |source| HboneError::H2 {
        peer: peer.to_string(),
        source,
    };
    let mut send = send.ready().await.map_err(h2err)?;
    let (response, stream) = send.send_request(request, false).map_err(h2err)?;
    let response = response.await.map_err(h2err)?;
    if response.status() != http::StatusCode::OK {
        return Err(HboneError::Status {
            authority,
            status: response.status(),
        });
    }
    // Istio's ztunnel reads the baggage of the inner 200 whatever its own
    // ENABLE_RESPONSE_BAGGAGE (that one decides what it sends); malformed is ignored.
    let baggage = crate::baggage::Baggage::of(response.headers())
        .inspect_err(|e| tracing::debug!(error = %e, "ignoring the response's baggage"))
        .ok();
    let answered = Answered {
        identity: server_identity,
        baggage,
    };
    Ok((
        stream,
        response.into_body(),
        OnceGuard { _done: done_tx },
        answered,
    ))
}
