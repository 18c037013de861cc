//! Pooled HBONE client connections: streams with the same (source identity, expected
//! destination identities, destination, source IP) share one HTTP/2 connection up to a
//! stream limit. Concurrent first requests wait for one dial instead of racing N.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use tracing::Instrument;

use super::client::{revoked_server, CrlCheck, Handshaken};
use super::error::HboneError;
use super::tuning::{PING_INTERVAL, PING_TIMEOUT};
use crate::identity::{CertManager, Identity};
use crate::netns::InPodNetns;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub src_identity: Identity,
    /// Sorted, so the same set always maps to one key.
    pub dst_identities: Vec<Identity>,
    /// `<pod ip>:15008`
    pub dst: SocketAddr,
    pub src_ip: IpAddr,
}

impl PoolKey {
    pub fn new(
        src_identity: Identity,
        mut dst_identities: Vec<Identity>,
        dst: SocketAddr,
        src_ip: IpAddr,
    ) -> Self {
        dst_identities.sort();
        dst_identities.dedup();
        PoolKey {
            src_identity,
            dst_identities,
            dst,
            src_ip,
        }
    }
}

struct Conn {
    id: u64,
    send: SendRequest<Bytes>,
    streams: AtomicUsize,
    closed: AtomicBool,
    idle_since: Mutex<Instant>,
}

#[derive(Default)]
struct KeyState {
    conns: Vec<Arc<Conn>>,
    /// Held while dialing; the value is the outcome of the last failed dial, so callers
    /// that queued behind it fail at once instead of each redialing a dead peer in turn.
    dial: Arc<tokio::sync::Mutex<Option<(Instant, String)>>>,
}

struct Inner {
    keys: Mutex<HashMap<PoolKey, KeyState>>,
    certs: Arc<CertManager>,
    max_streams: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    next_id: AtomicU64,
    /// CRL_PATH's CRLs: a server they revoke is refused, and its connections are closed
    /// when a reload revokes it (counted in `metrics`).
    crls: Option<CrlCheck>,
}

type DialLock = Arc<tokio::sync::Mutex<Option<(Instant, String)>>>;

#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

/// Holds a stream's slot on its pooled connection; released on drop.
pub struct StreamGuard {
    conn: Arc<Conn>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.conn.streams.fetch_sub(1, Ordering::AcqRel) == 1 {
            *lock(&self.conn.idle_since) = Instant::now();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub fn new(
        certs: Arc<CertManager>,
        max_streams: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Pool {
        Pool::with_crls(certs, max_streams, idle_timeout, connect_timeout, None)
    }

    /// [`Pool::new`], checking servers against `crls` (rejections counted in the metrics).
    pub fn with_crls(
        certs: Arc<CertManager>,
        max_streams: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
        crls: Option<(crate::tls::Crls, Arc<crate::metrics::Metrics>)>,
    ) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                keys: Mutex::new(HashMap::new()),
                certs,
                max_streams: max_streams.max(1),
                idle_timeout,
                connect_timeout,
                next_id: AtomicU64::new(1),
                crls,
            }),
        }
    }

    fn try_checkout(&self, key: &PoolKey) -> Result<StreamGuard, DialLock> {
        let mut keys = lock(&self.inner.keys);
        let st = keys.entry(key.clone()).or_default();
        st.conns.retain(|c| !c.closed.load(Ordering::Acquire));
        for c in &st.conns {
            let mut cur = c.streams.load(Ordering::Acquire);
            while cur < self.inner.max_streams {
                match c
                    .streams
                    .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return Ok(StreamGuard { conn: c.clone() }),
                    Err(now) => cur = now,
                }
            }
        }
        Err(st.dial.clone())
    }

    /// The one deadline of a connect: TCP, TLS, the HTTP/2 handshake and the CONNECT answer.
    pub fn connect_timeout(&self) -> Duration {
        self.inner.connect_timeout
    }

    fn timed_out(&self, key: &PoolKey) -> HboneError {
        HboneError::Timeout {
            peer: key.dst.to_string(),
            after: self.inner.connect_timeout,
        }
    }

    async fn checkout(
        &self,
        key: &PoolKey,
        netns: &InPodNetns,
        deadline: tokio::time::Instant,
    ) -> Result<StreamGuard, HboneError> {
        let dial_lock = match self.try_checkout(key) {
            Ok(g) => return Ok(g),
            Err(l) => l,
        };
        let queued_at = Instant::now();
        let mut last_failure = dial_lock.lock().await;
        if let Ok(g) = self.try_checkout(key) {
            return Ok(g);
        }
        if let Some((at, err)) = last_failure.as_ref() {
            if *at >= queued_at {
                return Err(HboneError::DialFailed {
                    peer: key.dst.to_string(),
                    reason: err.clone(),
                });
            }
        }
        // The dial has its own deadline (the caller's) so that, when it expires, the failure
        // is recorded for the requests queued behind this one and they leave at once.
        let dialed = tokio::time::timeout_at(deadline, self.dial(key, netns))
            .await
            .unwrap_or_else(|_| Err(self.timed_out(key)));
        let conn = match dialed {
            Ok(c) => {
                *last_failure = None;
                c
            }
            Err(e) => {
                *last_failure = Some((Instant::now(), e.to_string()));
                return Err(e);
            }
        };
        let guard = StreamGuard { conn: conn.clone() };
        lock(&self.inner.keys)
            .entry(key.clone())
            .or_default()
            .conns
            .push(conn);
        Ok(guard)
    }

    async fn dial(&self, key: &PoolKey, netns: &InPodNetns) -> Result<Arc<Conn>, HboneError> {
        let peer = key.dst.to_string();
        let cert = self.inner.certs.fetch(&key.src_identity).await?;
        let tcp = netns
            .connect(key.dst, None, self.inner.connect_timeout)
            .await
            .map_err(|source| HboneError::Connect {
                peer: peer.clone(),
                source,
            })?;
        let (tcp, flusher) = super::batch::BatchedTcp::new(tcp);
        let Handshaken {
            send,
            mut connection,
            revoked,
            ..
        } = super::client::handshake(
            tcp,
            &peer,
            key.dst.ip(),
            &cert,
            key.dst_identities.clone(),
            self.inner.crls.as_ref(),
        )
        .await?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            id,
            send,
            streams: AtomicUsize::new(1),
            closed: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
        });
        tracing::debug!(conn = id, dst = %key.dst, src_identity = %key.src_identity, "opened pooled HBONE connection");
        let ping = connection.ping_pong();
        let weak = Arc::downgrade(&conn);
        let pool = self.clone();
        let key = key.clone();
        tokio::spawn(
            super::batch::flushing(async move {
                tokio::select! {
                    r = connection => if let Err(e) = r { tracing::debug!(error = %e, "HBONE connection ended") },
                    _ = keepalive(ping) => tracing::debug!("HBONE connection failed its keepalive ping"),
                    _ = pool.reap_when_idle(&key, weak.clone()) => {}
                    // Dropping the connection resets the streams on it.
                    m = revoked_server(revoked) => {
                        m.crl_rejected("source");
                        tracing::warn!(dst = %key.dst, "closing a pooled HBONE connection: the server's certificate is revoked");
                    }
                }
                if let Some(c) = weak.upgrade() {
                    c.closed.store(true, Ordering::Release);
                }
                pool.forget(&key, id);
            }, flusher)
            .instrument(tracing::debug_span!("hbone_pool_conn", conn = id)),
        );
        Ok(conn)
    }

    /// Resolves once the connection has had no streams for the idle timeout. The driver
    /// then drops the connection, closing its socket (no stream is open, so nothing is cut).
    async fn reap_when_idle(&self, key: &PoolKey, conn: std::sync::Weak<Conn>) {
        let tick = (self.inner.idle_timeout / 4).max(Duration::from_millis(50));
        loop {
            tokio::time::sleep(tick).await;
            let Some(c) = conn.upgrade() else { return };
            let idle = c.streams.load(Ordering::Acquire) == 0
                && lock(&c.idle_since).elapsed() >= self.inner.idle_timeout;
            if idle {
                c.closed.store(true, Ordering::Release);
                tracing::debug!(conn = c.id, dst = %key.dst, "closing idle pooled HBONE connection");
                return;
            }
        }
    }

    fn forget(&self, key: &PoolKey, id: u64) {
        let mut keys = lock(&self.inner.keys);
        if let Some(st) = keys.get_mut(key) {
            st.conns.retain(|c| c.id != id);
            if st.conns.is_empty() && Arc::strong_count(&st.dial) == 1 {
                keys.remove(key);
            }
        }
    }

    /// Double HBONE's inner tunnel: inside `outer` (a CONNECT stream to an east-west
    /// gateway at `gateway`, as an `H2Stream`), a TLS session and HTTP/2 connection of its own as `src` to
    /// the proxy the gateway forwards to, which must prove one of `expected`, carrying
    /// `request`. Not pooled (each connection may reach another proxy behind the
    /// gateway); within the connect timeout, as the outer CONNECT was. Also says who
    /// answered (identity, response baggage).
    pub async fn connect_through(
        &self,
        outer: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        src: &Identity,
        expected: Vec<Identity>,
        gateway: SocketAddr,
        request: http::Request<()>,
    ) -> Result<
        (
            SendStream<Bytes>,
            RecvStream,
            super::client::OnceGuard,
            super::client::Answered,
        ),
        HboneError,
    > {
        let peer = format!("{} through gateway {gateway}", request.uri());
        let after = self.inner.connect_timeout;
        let connect = async {
            let cert = self.inner.certs.fetch(src).await?;
            super::client::connect_once(
                outer,
                &peer,
                gateway.ip(),
                &cert,
                expected,
                self.inner.crls.as_ref(),
                request,
            )
            .await
        };
        tokio::time::timeout(after, connect)
            .await
            .unwrap_or_else(|_| {
                Err(HboneError::Timeout {
                    peer: peer.clone(),
                    after,
                })
            })
    }

    /// Opens one CONNECT stream; the tunnel is established once the peer answers 200.
    /// A stream refused because the peer is going away (GOAWAY, REFUSED_STREAM) never
    /// reached it, so it is retried once on a fresh connection; that keeps a proxy
    /// hand-off invisible to clients.
    ///
    /// All of it, queueing behind another request's dial included, has one deadline: the
    /// connect timeout. A peer that accepts and never speaks fails the request (and every
    /// request waiting for the same connection) instead of holding it forever.
    pub async fn connect(
        &self,
        key: &PoolKey,
        netns: &InPodNetns,
        request: http::Request<()>,
    ) -> Result<(SendStream<Bytes>, RecvStream, StreamGuard), HboneError> {
        let deadline = tokio::time::Instant::now() + self.inner.connect_timeout;
        tokio::time::timeout_at(deadline, self.connect_by(key, netns, request, deadline))
            .await
            .unwrap_or_else(|_| Err(self.timed_out(key)))
    }

    async fn connect_by(
        &self,
        key: &PoolKey,
        netns: &InPodNetns,
        request: http::Request<()>,
        deadline: tokio::time::Instant,
    ) -> Result<(SendStream<Bytes>, RecvStream, StreamGuard), HboneError> {
        let guard = self.checkout(key, netns, deadline).await?;
        match self.open_stream(key, &guard, copy_request(&request)).await {
            Err(StreamError::Unprocessed(e)) => {
                tracing::debug!(error = %e, dst = %key.dst, "stream refused by a closing connection; retrying on a new one");
                guard.conn.closed.store(true, Ordering::Release);
                drop(guard);
                let guard = self.checkout(key, netns, deadline).await?;
                match self.open_stream(key, &guard, request).await {
                    Ok((s, r)) => Ok((s, r, guard)),
                    Err(StreamError::Unprocessed(e) | StreamError::Failed(e)) => Err(e),
                }
            }
            Err(StreamError::Failed(e)) => Err(e),
            Ok((s, r)) => Ok((s, r, guard)),
        }
    }

    async fn open_stream(
        &self,
        key: &PoolKey,
        guard: &StreamGuard,
        request: http::Request<()>,
    ) -> Result<(SendStream<Bytes>, RecvStream), StreamError> {
        let h2err = |source: h2::Error| {
            let unprocessed =
                source.is_go_away() || source.reason() == Some(h2::Reason::REFUSED_STREAM);
            let e = HboneError::H2 {
                peer: key.dst.to_string(),
                source,
            };
            if unprocessed {
                StreamError::Unprocessed(e)
            } else {
                StreamError::Failed(e)
            }
        };
        let authority = request.uri().to_string();
        let mut send = guard.conn.send.clone().ready().await.map_err(h2err)?;
        let (response, stream) = send.send_request(request, false).map_err(h2err)?;
        let response = response.await.map_err(h2err)?;
        if response.status() != http::StatusCode::OK {
            return Err(StreamError::Failed(HboneError::Status {
                authority,
                status: response.status(),
            }));
        }
        Ok((stream, response.into_body()))
    }
}

enum StreamError {
    /// The peer did not process the stream; safe to retry.
    Unprocessed(HboneError),
    Failed(HboneError),
}

fn copy_request(r: &http::Request<()>) -> http::Request<()> {
    let mut c = http::Request::new(());
    *c.method_mut() = r.method().clone();
    *c.uri_mut() = r.uri().clone();
    *c.headers_mut() = r.headers().clone();
    c
}

async fn keepalive(mut ping: Option<h2::PingPong>) {
    let Some(ping) = ping.as_mut() else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(PING_INTERVAL).await;
        match tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
    }
}
