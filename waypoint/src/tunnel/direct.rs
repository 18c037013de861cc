//! The L4 relays that do not go over the waypoint's pooled HBONE: to an endpoint outside
//! the mesh (plain TCP from the waypoint's pod) and with TLS the waypoint originates
//! (DestinationRule `tls`).

use std::net::SocketAddr;
use std::time::Instant;

use bytes::Bytes;
use ztunnel::hbone::H2Stream;

use crate::context::Waypoint;
use crate::http::Tunnel;

/// The L4 relay to an endpoint outside the mesh: a TCP connection from the waypoint's
/// pod; the client's sniffed bytes go first.
pub(super) async fn relay_plaintext(
    wp: &Waypoint,
    tunnel: &Tunnel,
    mut down_send: h2::SendStream<Bytes>,
    down_recv: h2::RecvStream,
    first: Bytes,
    // The endpoint, and the DestinationRule's connection settings for it.
    (to, reuse): (SocketAddr, crate::destination::Reuse),
    start: Instant,
) {
    let timeout = reuse
        .connect_timeout
        .unwrap_or_else(|| wp.pool.connect_timeout());
    let mut tcp = match wp.netns.connect(to, None, timeout).await {
        Ok(t) => {
            if let Some(k) = &reuse.keepalive {
                crate::upstream::set_keepalive(&t, k);
            }
            t
        }
        Err(e) => {
            tracing::warn!(dst.addr = %to, error = %e, response_flags = "UF", "TCP connection to an endpoint outside the mesh failed");
            return down_send.send_reset(h2::Reason::REFUSED_STREAM);
        }
    };
    if !first.is_empty() {
        use tokio::io::AsyncWriteExt;
        if let Err(e) = tcp.write_all(&first).await {
            tracing::debug!(error = %e, "endpoint closed before the first bytes");
            return down_send.send_reset(h2::Reason::CONNECT_ERROR);
        }
    }
    let relay = ztunnel::relay::copy_tcp_h2(
        &mut tcp,
        down_send,
        down_recv,
        std::future::pending::<()>(),
        reuse.opaque_idle(wp.idle_timeout),
    );
    let (sent, received, err) = match within(reuse.max_age, relay).await {
        Some(Ok(t)) => (t.sent, t.received, None),
        Some(Err((e, t))) => (t.sent, t.received, Some(e.to_string())),
        None => (
            0,
            0,
            Some(ztunnel::relay::CopyError::MaxDuration.to_string()),
        ),
    };
    tracing::info!(src.identity = %tunnel.src_identity, dst.addr = %to, bytes_sent = sent + first.len() as u64, bytes_recv = received,
        duration_ms = start.elapsed().as_millis() as u64, error = err, "connection complete (plaintext endpoint)");
}

/// The L4 relay with TLS the waypoint originates (DestinationRule `tls`): the TLS runs
/// inside the HBONE tunnel (or over TCP outside the mesh); the client's sniffed bytes
/// go first, inside it.
pub(super) async fn relay_tls(
    wp: &Waypoint,
    tunnel: &Tunnel,
    down_send: h2::SendStream<Bytes>,
    down_recv: h2::RecvStream,
    first: Bytes,
    ep: crate::upstream::Endpoint,
    start: Instant,
) {
    use tokio::io::AsyncWriteExt;
    let mut down_send = down_send;
    let mut up = match wp.upstreams.connect_io(&ep).await {
        Ok(io) => io,
        Err(e) => {
            tracing::warn!(dst.addr = %ep.addr, error = %e, response_flags = "UF", "upstream connection failed");
            return down_send.send_reset(h2::Reason::REFUSED_STREAM);
        }
    };
    if !first.is_empty() {
        if let Err(e) = up.write_all(&first).await {
            tracing::debug!(error = %e, "endpoint closed before the first bytes");
            return down_send.send_reset(h2::Reason::CONNECT_ERROR);
        }
    }
    let (mut down, activity) = crate::idle::Counted::new(H2Stream::new(down_send, down_recv, None));
    let idle = ep.reuse.opaque_idle(wp.idle_timeout);
    let copy = async {
        tokio::select! {
            r = tokio::io::copy_bidirectional(&mut down, &mut up) => r,
            _ = activity.idle(idle) => Err(std::io::Error::other(ztunnel::relay::CopyError::Idle.to_string())),
        }
    };
    let r = within(ep.reuse.max_age, copy).await.unwrap_or_else(|| {
        Err(std::io::Error::other(
            ztunnel::relay::CopyError::MaxDuration.to_string(),
        ))
    });
    let (sent, received, err) = match r {
        Ok((s, r)) => (s, r, None),
        Err(e) => (0, 0, Some(e.to_string())),
    };
    tracing::info!(src.identity = %tunnel.src_identity, dst.addr = %ep.addr, tls = "originated", bytes_sent = sent + first.len() as u64,
        bytes_recv = received, duration_ms = start.elapsed().as_millis() as u64, error = err, "connection complete");
}

/// `f`, ended after `max` if it lasts that long (DestinationRule maxConnectionDuration).
async fn within<T>(
    max: Option<std::time::Duration>,
    f: impl std::future::Future<Output = T>,
) -> Option<T> {
    match max {
        Some(m) => tokio::time::timeout(m, f).await.ok(),
        None => Some(f.await),
    }
}
