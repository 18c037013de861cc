//! The waypoint's HBONE listener: accepted connections get ztunnel's HBONE server limits
//! and handshake, and each CONNECT stream becomes a tunnel (see `tunnel`).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;
use ztunnel::hbone::server::{HandshakePermit, Server};

use crate::context::Waypoint;
use crate::tunnel;

/// Accepts connections until `stop` completes (then the listener closes), each served on
/// its own task.
pub async fn serve(
    listener: TcpListener,
    wp: Arc<Waypoint>,
    server: Arc<Server>,
    acceptor: TlsAcceptor,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    // A `[::]` listener (an IPv6 or dual-stack pod) sees IPv4 clients
                    // v4-mapped: they are IPv4 to policies, logs and the mesh state.
                    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
                    let Some((stream, permit)) = server.admit(stream, peer) else { continue };
                    let span = tracing::info_span!("waypoint", peer = %peer);
                    tokio::spawn(connection(wp.clone(), server.clone(), acceptor.clone(), stream, permit, peer).instrument(span));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn connection(
    wp: Arc<Waypoint>,
    server: Arc<Server>,
    acceptor: TlsAcceptor,
    stream: TcpStream,
    permit: HandshakePermit,
    peer: SocketAddr,
) {
    let _ = stream.set_nodelay(true);
    // Taken before the handshake: a CRL reload during it is checked against this peer too.
    let changes = wp.crls.as_ref().map(|c| c.changes());
    let Some((conn, src_identity, chain)) = server
        .handshake_with(&acceptor, stream, permit, changes.is_some())
        .await
    else {
        return;
    };
    let roots = || {
        wp.certs
            .current(&wp.identity)
            .map(|c| c.cert.roots.clone())
            .unwrap_or_default()
    };
    let revoked =
        ztunnel::tls::client_revoked(wp.crls.as_ref(), changes, roots, &chain, wp.metrics.clone());
    server
        .serve_with(conn, &wp.drain, &src_identity, revoked, |req, respond| {
            // The CONNECT's trace, as ztunnel's inbound side joins it (Istio's): its id
            // names the tunnel's lines.
            let trace = ztunnel::hbone::TraceParent::of_request(&req);
            let span =
                tracing::info_span!("stream", id = %trace.trace_id(), src.identity = %src_identity);
            tokio::spawn(
                tunnel::handle(wp.clone(), req, respond, peer, src_identity.clone(), trace)
                    .instrument(span),
            );
        })
        .await;
}
