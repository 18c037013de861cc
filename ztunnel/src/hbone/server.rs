//! HBONE's server side (port 15008), shared by ztunnel's inbound and the waypoint: what a
//! peer may hold before it is authenticated (handshakes in flight, their deadline) and
//! after (an HTTP/2 connection with no stream is closed once idle).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::RecvStream;
use http::Request;
use rustls_pki_types::CertificateDer;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::hbone::batch::{BatchedTcp, Flusher};
use crate::hbone::guard::FrameGuard;
use crate::identity::Identity;
use crate::metrics::Metrics;

/// TLS and HTTP/2 handshakes together must finish within this, from the start of the TLS
/// handshake; a peer that stalls is closed then. Mesh peers need a few round trips.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in flight at once, all listeners of the process together.
pub const MAX_HANDSHAKES: usize = 1024;
/// Handshakes in flight at once from one source (an IPv4 address or an IPv6 /64), so one
/// source cannot take the whole budget from the others.
pub const MAX_HANDSHAKES_PER_IP: usize = 64;
/// An authenticated connection with no stream open this long gets GOAWAY and is closed.
/// Twice Istio's client pool release (POOL_UNUSED_RELEASE_TIMEOUT, 5 min), so mesh
/// clients normally close their unused connections first.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// After the idle GOAWAY, how long the peer has to let the connection close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// After the GOAWAY for a revoked peer, how long it may take to go out before the socket closes.
const REVOKED_FLUSH: Duration = Duration::from_millis(100);

/// HTTP/2 over TLS over the batched socket.
type H2Connection =
    h2::server::Connection<FrameGuard<tokio_rustls::server::TlsStream<BatchedTcp>>, Bytes>;

/// The connection a peer gets once both handshakes are done, and what writes out its batches.
pub struct Connection {
    h2: H2Connection,
    flusher: Flusher,
}

/// Bounds handshakes in flight, in total and per source.
#[derive(Debug)]
pub struct HandshakeLimiter {
    max: usize,
    max_per_source: usize,
    in_flight: Mutex<InFlight>,
}

#[derive(Debug, Default)]
struct InFlight {
    total: usize,
    /// Only sources with a handshake in flight: at most `total` entries.
    by_source: HashMap<IpAddr, usize>,
}

/// One handshake in flight; dropping it frees its place.
#[derive(Debug)]
pub struct HandshakePermit {
    limiter: Arc<HandshakeLimiter>,
    source: IpAddr,
}

/// Why a handshake was not let in.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitExceeded {
    #[error("{0} HBONE handshakes in flight already")]
    Total(usize),
    #[error("{0} HBONE handshakes in flight from this source already")]
    PerSource(usize),
}

/// The key a peer address counts under: IPv4 (IPv4-mapped IPv6 too) as is, IPv6 by /64,
/// the smallest block one host is usually given.
fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

impl HandshakeLimiter {
    /// `max` in total and `max_per_source` per source (0: no limit).
    pub fn new(max: usize, max_per_source: usize) -> Arc<HandshakeLimiter> {
        Arc::new(HandshakeLimiter {
            max,
            max_per_source,
            in_flight: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn try_acquire(self: &Arc<Self>, peer: IpAddr) -> Result<HandshakePermit, LimitExceeded> {
        let source = source_key(peer);
        let mut f = self.lock();
        if self.max > 0 && f.total >= self.max {
            return Err(LimitExceeded::Total(f.total));
        }
        let n = f.by_source.get(&source).copied().unwrap_or(0);
        if self.max_per_source > 0 && n >= self.max_per_source {
            return Err(LimitExceeded::PerSource(n));
        }
        f.by_source.insert(source, n + 1);
        f.total += 1;
        Ok(HandshakePermit {
            limiter: self.clone(),
            source,
        })
    }

    /// Handshakes in flight (total, sources).
    pub fn in_flight(&self) -> (usize, usize) {
        let f = self.lock();
        (f.total, f.by_source.len())
    }
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut f = self.limiter.lock();
        f.total = f.total.saturating_sub(1);
        if let std::collections::hash_map::Entry::Occupied(mut e) = f.by_source.entry(self.source) {
            if *e.get() <= 1 {
                e.remove();
            } else {
                *e.get_mut() -= 1;
            }
        }
    }
}

/// An HBONE server's limits and the metrics its refusals are counted in.
pub struct Server {
    pub handshakes: Arc<HandshakeLimiter>,
    /// Concurrent streams per connection.
    pub max_streams: u32,
    pub max_header_bytes: u32,
    /// None or zero: an idle connection is never closed.
    pub idle_timeout: Option<Duration>,
    pub metrics: Arc<Metrics>,
}

impl Server {
    /// A place for the handshake of a just-accepted connection, or None: then the
    /// connection was reset (no TIME_WAIT left behind by a flood) and counted
    /// (`handshake_limit`).
    pub fn admit(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> Option<(TcpStream, HandshakePermit)> {
        match self.handshakes.try_acquire(peer.ip()) {
            Ok(p) => Some((stream, p)),
            Err(e) => {
                // Debug, not warn: a flood must not turn into a flood of log lines; the
                // metric counts every one.
                tracing::debug!(peer = %peer, error = %e, "HBONE connection refused before its handshake");
                self.metrics.hbone_rejected("handshake_limit");
                crate::netns::reset(stream);
                None
            }
        }
    }

    /// mTLS, then HTTP/2, both within [`HANDSHAKE_TIMEOUT`]; the permit is held until
    /// they are done. Failures are logged and counted (`tls_handshake`, `h2_protocol`).
    pub async fn handshake(
        &self,
        acceptor: &tokio_rustls::TlsAcceptor,
        stream: TcpStream,
        permit: HandshakePermit,
    ) -> Option<(Connection, Identity)> {
        self.handshake_with(acceptor, stream, permit, false)
            .await
            .map(|(c, id, _)| (c, id))
    }

    /// [`Server::handshake`], also returning the peer's certificate chain (leaf first)
    /// when `keep_chain` (for a CRL re-check later; empty otherwise). A peer refused
    /// because a CRL revokes it is also counted in `istio_crl_policy_rejections`.
    pub async fn handshake_with(
        &self,
        acceptor: &tokio_rustls::TlsAcceptor,
        stream: TcpStream,
        permit: HandshakePermit,
        keep_chain: bool,
    ) -> Option<(Connection, Identity, Vec<CertificateDer<'static>>)> {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let (stream, flusher) = BatchedTcp::new(stream);
        let mut tls = match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, response_flags = "TLS_FAILURE", "HBONE TLS handshake failed");
                self.metrics.hbone_rejected("tls_handshake");
                if crate::tls::is_revoked(&e) {
                    self.metrics.crl_rejected("destination");
                }
                return None;
            }
            Err(_) => {
                tracing::warn!(response_flags = "TLS_FAILURE", timeout = ?HANDSHAKE_TIMEOUT, "HBONE TLS handshake timed out");
                self.metrics.hbone_rejected("tls_handshake");
                return None;
            }
        };
        let src_identity = match crate::tls::peer_identity(tls.get_ref().1) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(error = %e, "HBONE peer has no usable identity");
                self.metrics.hbone_rejected("tls_handshake");
                return None;
            }
        };
        let chain = match keep_chain {
            true => tls
                .get_ref()
                .1
                .peer_certificates()
                .unwrap_or_default()
                .iter()
                .map(|c| c.clone().into_owned())
                .collect(),
            false => Vec::new(),
        };
        super::tuning::tune_tls(tls.get_mut().1);
        let guarded = FrameGuard::new(tls);
        let h2 = super::tuning::server_builder(self.max_streams, self.max_header_bytes)
            .handshake::<_, Bytes>(guarded);
        let conn = match tokio::time::timeout_at(deadline, h2).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "HBONE HTTP/2 handshake failed");
                self.metrics.hbone_rejected("h2_protocol");
                return None;
            }
            Err(_) => {
                tracing::warn!(timeout = ?HANDSHAKE_TIMEOUT, "HBONE HTTP/2 handshake timed out");
                self.metrics.hbone_rejected("h2_protocol");
                return None;
            }
        };
        drop(permit);
        Some((Connection { h2: conn, flusher }, src_identity, chain))
    }

    /// Accepts streams and hands each to `on_stream` until the connection ends. On
    /// `drain` it sends GOAWAY and lets open streams finish; with no stream open for the
    /// idle timeout it sends GOAWAY and closes. Protocol abuse is logged and counted.
    // Not `async fn`s, here and in `serve_with`: those would keep the connection, their
    // argument, beside the future it moves into (twice its HTTP/2 and TLS state).
    pub fn serve<'a, F>(
        &'a self,
        conn: Connection,
        drain: &'a crate::drain::Drain,
        src_identity: &'a Identity,
        on_stream: F,
    ) -> impl Future<Output = ()> + 'a
    where
        F: FnMut(Request<RecvStream>, SendResponse<Bytes>) + 'a,
    {
        self.serve_with(conn, drain, src_identity, std::future::pending(), on_stream)
    }

    /// [`Server::serve`], and when `revoked` resolves (a CRL reload revoked the peer's
    /// certificate) the connection is closed at once: GOAWAY, then the socket, so its
    /// streams are reset rather than left to finish.
    pub fn serve_with<'a, F>(
        &'a self,
        conn: Connection,
        drain: &'a crate::drain::Drain,
        src_identity: &'a Identity,
        revoked: impl Future<Output = ()> + 'a,
        on_stream: F,
    ) -> impl Future<Output = ()> + 'a
    where
        F: FnMut(Request<RecvStream>, SendResponse<Bytes>) + 'a,
    {
        let Connection { h2, flusher } = conn;
        super::batch::flushing(
            self.serve_h2(h2, drain, src_identity, revoked, on_stream),
            flusher,
        )
    }

    async fn serve_h2<F>(
        &self,
        mut conn: H2Connection,
        drain: &crate::drain::Drain,
        src_identity: &Identity,
        revoked: impl Future<Output = ()>,
        mut on_stream: F,
    ) where
        F: FnMut(Request<RecvStream>, SendResponse<Bytes>),
    {
        let mut revoked = std::pin::pin!(revoked);
        let idle = self.idle_timeout.filter(|t| !t.is_zero());
        // Checked a few times per timeout, so a connection closes within 1.25 of it.
        let tick = idle.map(|t| (t / 4).max(Duration::from_millis(50)));
        let mut ticks = tick.map(|t| tokio::time::interval_at(Instant::now() + t, t));
        let mut idle_since = Instant::now();
        let mut accepted = false;
        let mut goaway_sent = false;
        let mut close_by: Option<Instant> = None;
        loop {
            let next = tokio::select! {
                // A revoked peer first: a busy connection must not delay its closing.
                // Then streams: one that arrived with the idle check is not cut off.
                biased;
                _ = &mut revoked => {
                    tracing::warn!(src.identity = %src_identity, "closing an HBONE connection: the peer's certificate is revoked");
                    conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                    // A moment to write the GOAWAY; dropping the connection then resets its streams.
                    let _ = tokio::time::timeout(REVOKED_FLUSH, futures_util::future::poll_fn(|cx| conn.poll_closed(cx))).await;
                    break;
                }
                next = conn.accept() => next,
                _ = drain.signaled(), if !goaway_sent => {
                    // GOAWAY: the client opens no new streams here; open ones run to completion.
                    conn.graceful_shutdown();
                    goaway_sent = true;
                    continue;
                }
                _ = next_tick(&mut ticks), if !goaway_sent => {
                    // h2 counts a stream until both sides are done with it (our handler
                    // included); one opened and finished between two checks counts too.
                    if accepted || conn.has_streams() {
                        idle_since = Instant::now();
                        accepted = false;
                    } else if let Some(t) = idle.filter(|t| idle_since.elapsed() >= *t) {
                        tracing::debug!(src.identity = %src_identity, idle = ?t, "closing an HBONE connection with no stream");
                        // GOAWAY naming the last stream seen, then close: with none
                        // open nothing is cut, and a client request racing it is
                        // known unprocessed (safe to retry).
                        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                        goaway_sent = true;
                        close_by = Some(Instant::now() + CLOSE_GRACE);
                    }
                    continue;
                }
                // A peer that does not read must not keep the connection past GOAWAY.
                _ = sleep_until(close_by) => break,
            };
            let Some(next) = next else { break };
            match next {
                Ok((req, respond)) => {
                    accepted = true;
                    on_stream(req, respond);
                }
                Err(e) => {
                    match super::request::protocol_abuse(&e) {
                        Some(reason) => {
                            tracing::warn!(src.identity = %src_identity, error = %e, reason, "HBONE connection closed for abuse");
                            self.metrics.hbone_rejected(reason);
                        }
                        None => tracing::debug!(error = %e, "HBONE connection ended"),
                    }
                    break;
                }
            }
        }
    }
}

async fn next_tick(ticks: &mut Option<tokio::time::Interval>) {
    match ticks {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn limits_in_total_and_per_source_and_frees_on_drop() {
        let l = HandshakeLimiter::new(5, 2);
        let a1 = l.try_acquire(ip("10.0.0.1")).unwrap();
        let a2 = l.try_acquire(ip("10.0.0.1")).unwrap();
        assert_eq!(
            l.try_acquire(ip("10.0.0.1")).unwrap_err(),
            LimitExceeded::PerSource(2)
        );
        // Another source is not held back by the first one's flood.
        let b: Vec<_> = (0..2)
            .map(|_| l.try_acquire(ip("10.0.0.2")).unwrap())
            .collect();
        let c = l.try_acquire(ip("10.0.0.3")).unwrap();
        assert_eq!(
            l.try_acquire(ip("10.0.0.4")).unwrap_err(),
            LimitExceeded::Total(5)
        );
        assert_eq!(l.in_flight(), (5, 3));
        drop(a1);
        let a3 = l.try_acquire(ip("10.0.0.1")).unwrap();
        drop((a2, a3, b, c));
        // Nothing stays behind for sources with nothing in flight.
        assert_eq!(l.in_flight(), (0, 0));
    }

    #[test]
    fn ipv6_counts_by_64_and_mapped_ipv4_as_ipv4() {
        let l = HandshakeLimiter::new(0, 1);
        let _a = l.try_acquire(ip("2001:db8:1:2::1")).unwrap();
        assert!(
            l.try_acquire(ip("2001:db8:1:2:ffff::9")).is_err(),
            "same /64"
        );
        let _b = l.try_acquire(ip("2001:db8:1:3::1")).unwrap();
        let _c = l.try_acquire(ip("10.1.1.1")).unwrap();
        assert!(
            l.try_acquire(ip("::ffff:10.1.1.1")).is_err(),
            "IPv4-mapped is the same source"
        );
    }

    #[test]
    fn zero_means_no_limit() {
        let l = HandshakeLimiter::new(0, 0);
        let held: Vec<_> = (0..10_000)
            .map(|_| l.try_acquire(ip("10.0.0.1")).unwrap())
            .collect();
        assert_eq!(l.in_flight(), (10_000, 1));
        drop(held);
        assert_eq!(l.in_flight(), (0, 0));
    }
}
