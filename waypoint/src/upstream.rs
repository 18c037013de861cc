//! HTTP client connections to endpoints, each carried by one HBONE stream to the
//! endpoint's node, or, for an endpoint outside the mesh (protocol TCP: a ServiceEntry's
//! or a pod not enrolled), a plain TCP connection from the waypoint's pod, as Istio's
//! waypoint sends to such endpoints. HTTP/1.1 connections are kept for reuse (one request
//! at a time each); one HTTP/2 connection per endpoint carries all of its requests.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tracing::Instrument;
use ztunnel::hbone::{self, H2Stream, HboneError, Pool, PoolKey};

use crate::destination::Reuse;
use ztunnel::identity::Identity;
use ztunnel::netns::InPodNetns;
use ztunnel::state::{MeshState, Protocol as MeshProtocol, Service, Workload};

use crate::destination::TlsTarget;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

/// An HTTP/1.1 connection idle longer than this is not reused (servers close idle
/// keep-alive connections after a while; reusing one then fails the request).
const H1_IDLE: Duration = Duration::from_secs(30);
/// At most this many HTTP/1.1 connections are kept per endpoint.
const H1_MAX_IDLE: usize = 64;
/// An HTTP/2 connection unused this long is closed.
const H2_IDLE: Duration = Duration::from_secs(300);
/// Attempts on reused HTTP/1.1 connections that closed before taking the request.
const H1_STALE_RETRIES: usize = 3;
/// Connection keys kept per endpoint address, each with its connections. Without a
/// DestinationRule `sni`, originated TLS is named after the request's host (Envoy's
/// auto_sni), so a client cycling Host values would otherwise grow the maps and the
/// upstream connections without bound; past this, the least recently used key goes.
const MAX_KEYS_PER_ENDPOINT: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("HBONE to {endpoint} failed: {source}")]
    Connect {
        endpoint: SocketAddr,
        source: HboneError,
    },
    #[error("TCP connection to {endpoint} (outside the mesh) failed: {source}")]
    Tcp {
        endpoint: SocketAddr,
        source: ztunnel::netns::NetnsError,
    },
    #[error("TLS to {endpoint} (DestinationRule tls origination) failed: {reason}")]
    Tls {
        endpoint: SocketAddr,
        reason: String,
    },
    #[error("HTTP handshake with {endpoint} failed: {source}")]
    Handshake {
        endpoint: SocketAddr,
        source: hyper::Error,
    },
    #[error("request to {endpoint} failed: {source}")]
    Request {
        endpoint: SocketAddr,
        source: hyper::Error,
    },
}

impl UpstreamError {
    /// The server refused the request's stream unprocessed (HTTP/2 REFUSED_STREAM):
    /// Envoy's `refused-stream` retry condition.
    pub fn is_refused_stream(&self) -> bool {
        let UpstreamError::Request { source, .. } = self else {
            return false;
        };
        let mut e: Option<&(dyn std::error::Error + 'static)> = Some(source);
        while let Some(err) = e {
            if err.downcast_ref::<h2::Error>().and_then(h2::Error::reason)
                == Some(h2::Reason::REFUSED_STREAM)
            {
                return true;
            }
            e = err.source();
        }
        false
    }

    /// The request never reached the endpoint's application (safe to retry anything).
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect { .. }
                | UpstreamError::Tcp { .. }
                | UpstreamError::Tls { .. }
                | UpstreamError::Handshake { .. }
        )
    }
}

/// Where one attempt goes: the endpoint's address and the identities it may present
/// (over HBONE), or plain TCP for an endpoint outside the mesh; and the TLS the waypoint
/// originates inside that, when a DestinationRule asks for it.
pub struct Endpoint {
    pub addr: SocketAddr,
    pub identities: Vec<Identity>,
    pub plaintext: bool,
    pub tls: Option<TlsTarget>,
    /// The `traceparent` of a CONNECT this attempt opens (the request's trace when it has
    /// one, else its tunnel's), so the endpoint's ztunnel joins it.
    pub trace: hbone::TraceParent,
    /// How its HTTP connections are reused (a DestinationRule's connectionPool.http).
    pub reuse: Reuse,
}

impl Endpoint {
    /// The endpoint `addr` of workload `wl`, reached as `svc`'s (its SANs count too).
    pub fn of(
        state: &MeshState,
        addr: SocketAddr,
        wl: &Workload,
        svc: Option<&Service>,
    ) -> Endpoint {
        if wl.protocol == MeshProtocol::HBONE {
            Endpoint {
                addr,
                identities: state.expected_identities(wl, svc),
                plaintext: false,
                tls: None,
                trace: hbone::TraceParent::new(),
                reuse: Reuse::default(),
            }
        } else {
            Endpoint {
                addr,
                identities: Vec::new(),
                plaintext: true,
                tls: None,
                trace: hbone::TraceParent::new(),
                reuse: Reuse::default(),
            }
        }
    }
}

/// Connections are shared only between requests that expect the same peer identities
/// and the same TLS inside.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ConnKey {
    addr: SocketAddr,
    identities: Vec<Identity>,
    plaintext: bool,
    tls: Option<TlsTarget>,
    reuse: Reuse,
}

impl ConnKey {
    fn of(ep: &Endpoint) -> ConnKey {
        let mut identities = ep.identities.clone();
        identities.sort();
        ConnKey {
            addr: ep.addr,
            identities,
            plaintext: ep.plaintext,
            tls: ep.tls.clone(),
            reuse: ep.reuse,
        }
    }
}

/// The byte stream under one upstream connection.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

struct H1Conn {
    /// When it was last seen busy or handed out.
    since: Instant,
    /// When it was made (DestinationRule maxConnectionDuration).
    born: Instant,
    sender: http1::SendRequest<Body>,
    /// Requests it has carried.
    served: u32,
}

/// One endpoint's HTTP/2 connection. Its own lock is held while dialling, so concurrent
/// first requests to that endpoint share one connection and no other endpoint waits.
#[derive(Default)]
struct H2Slot {
    conn: tokio::sync::Mutex<Option<http2::SendRequest<Body>>>,
    /// When the current connection was made (DestinationRule maxConnectionDuration).
    born: Mutex<Option<Instant>>,
    last_used: Mutex<Option<Instant>>,
    /// Requests the current connection has carried.
    served: Mutex<u32>,
}

pub struct Upstreams {
    pool: Pool,
    netns: InPodNetns,
    identity: Identity,
    ip: IpAddr,
    h1: Arc<Mutex<HashMap<ConnKey, Vec<H1Conn>>>>,
    h2: Mutex<HashMap<ConnKey, Arc<H2Slot>>>,
    /// Keys whose kept HTTP/1.1 connections a reaper task watches (`close_when_idle`):
    /// one task per key, not one per request.
    reaping: Arc<Mutex<HashSet<ConnKey>>>,
}

/// Forgets kept HTTP/1.1 connections that closed or sat idle `idle` (dropping one closes
/// it); a busy one counts as just used.
/// One as old as `max_age` is forgotten too (it closes once its request is done).
fn prune_h1(list: &mut Vec<H1Conn>, idle: Duration, max_age: Option<Duration>) {
    let now = Instant::now();
    list.retain_mut(|c| {
        if !c.sender.is_ready() && !c.sender.is_closed() {
            c.since = now;
        }
        let old = max_age.is_some_and(|m| now.duration_since(c.born) >= m);
        !c.sender.is_closed() && now.duration_since(c.since) < idle && !old
    });
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes room for `key` in `map`: when it is new and its endpoint (`same_endpoint`)
/// already has [`MAX_KEYS_PER_ENDPOINT`] keys, the one used longest ago (`last_used`;
/// never used first) is dropped. Requests in flight on its connections keep them.
fn make_room<K: Eq + std::hash::Hash + Clone, V>(
    map: &mut HashMap<K, V>,
    key: &K,
    same_endpoint: impl Fn(&K) -> bool,
    last_used: impl Fn(&V) -> Option<Instant>,
) {
    if map.contains_key(key) {
        return;
    }
    let same: Vec<(&K, Option<Instant>)> = map
        .iter()
        .filter(|(k, _)| same_endpoint(k))
        .map(|(k, v)| (k, last_used(v)))
        .collect();
    if same.len() < MAX_KEYS_PER_ENDPOINT {
        return;
    }
    if let Some(oldest) = same
        .into_iter()
        .min_by_key(|(_, t)| *t)
        .map(|(k, _)| k.clone())
    {
        map.remove(&oldest);
    }
}

impl Upstreams {
    pub fn new(pool: Pool, netns: InPodNetns, identity: Identity, ip: IpAddr) -> Upstreams {
        Upstreams {
            pool,
            netns,
            identity,
            ip,
            h1: Arc::default(),
            h2: Mutex::default(),
            reaping: Arc::default(),
        }
    }

    /// Opens one HBONE stream to the endpoint (CONNECT endpoint ip:port).
    pub async fn tunnel(&self, ep: &Endpoint) -> Result<H2Stream, UpstreamError> {
        let key = PoolKey::new(
            self.identity.clone(),
            ep.identities.clone(),
            SocketAddr::new(ep.addr.ip(), ztunnel::ports::HBONE),
            self.ip,
        );
        let req = Request::builder()
            .method(Method::CONNECT)
            .uri(ep.addr.to_string())
            .header("traceparent", ep.trace.header())
            .body(())
            .map_err(|e| UpstreamError::Connect {
                endpoint: ep.addr,
                source: HboneError::Request(e),
            })?;
        let (send, recv, guard) =
            self.pool
                .connect(&key, &self.netns, req)
                .await
                .map_err(|source| UpstreamError::Connect {
                    endpoint: ep.addr,
                    source,
                })?;
        Ok(H2Stream::new(send, recv, Some(guard)))
    }

    /// HBONE to the endpoint's node, or TCP straight to an endpoint outside the mesh;
    /// with the DestinationRule's TLS inside when it originates TLS.
    pub async fn connect_io(&self, ep: &Endpoint) -> Result<Box<dyn Io>, UpstreamError> {
        let io: Box<dyn Io> = if ep.plaintext {
            let tcp = self
                .netns
                .connect(ep.addr, None, self.connect_timeout(ep))
                .await
                .map_err(|source| UpstreamError::Tcp {
                    endpoint: ep.addr,
                    source,
                })?;
            if let Some(k) = &ep.reuse.keepalive {
                set_keepalive(&tcp, k);
            }
            Box::new(tcp)
        } else {
            Box::new(self.tunnel(ep).await?)
        };
        let Some(t) = &ep.tls else { return Ok(io) };
        let tls_err = |reason: String| UpstreamError::Tls {
            endpoint: ep.addr,
            reason,
        };
        let cfg = t.origination.client_config(t).map_err(tls_err)?;
        let stream = tokio_rustls::TlsConnector::from(cfg)
            .connect(t.server_name.clone(), io)
            .await
            .map_err(|e| tls_err(e.to_string()))?;
        Ok(Box::new(stream))
    }

    pub async fn send(
        &self,
        ep: &Endpoint,
        http2: bool,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match (http2, req.headers().contains_key(http::header::UPGRADE)) {
            (true, _) => self.send_h2(ep, req).await,
            // Only WebSocket upgrades keep the header (the plan strips the rest).
            (false, true) => self.send_h1_upgrade(ep, req).await,
            (false, false) => self.send_h1(ep, req).await,
        }
    }

    /// An HTTP/1.1 upgrade takes its connection for good: a new one, never pooled.
    async fn send_h1_upgrade(
        &self,
        ep: &Endpoint,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut sender = self.dial_h1(ep, true).await?;
        sender
            .send_request(req)
            .await
            .map_err(|source| UpstreamError::Request {
                endpoint: ep.addr,
                source,
            })
    }

    fn idle_h1(&self, key: &ConnKey) -> Option<(http1::SendRequest<Body>, u32, Instant)> {
        let mut all = lock(&self.h1);
        let list = all.get_mut(key)?;
        prune_h1(list, key.reuse.idle.unwrap_or(H1_IDLE), key.reuse.max_age);
        let i = list.iter().position(|c| c.sender.is_ready())?;
        let c = list.swap_remove(i);
        Some((c.sender, c.served, c.born))
    }

    /// With a DestinationRule idleTimeout (or maxConnectionDuration), a kept connection
    /// is closed once it has been idle (or open) that long, whether or not another
    /// request comes: one reaper task per key wakes at the next deadline of its kept
    /// connections and ends when none is left (called after a connection is kept).
    fn close_when_idle(&self, key: ConnKey, born: Instant) {
        let (idle, max_age) = (key.reuse.idle, key.reuse.max_age);
        let deadline = move |since: Instant, born: Instant| {
            let idle_left = idle.map(|i| i.saturating_sub(since.elapsed()));
            let age_left = max_age.map(|m| m.saturating_sub(born.elapsed()));
            [idle_left, age_left].into_iter().flatten().min()
        };
        let Some(mut after) = deadline(Instant::now(), born) else {
            return;
        };
        if !lock(&self.reaping).insert(key.clone()) {
            return;
        }
        let (h1, reaping) = (Arc::downgrade(&self.h1), self.reaping.clone());
        tokio::spawn(async move {
            loop {
                // A bit past the deadline, so the connection is idle (or old) enough by then.
                tokio::time::sleep(after + Duration::from_millis(10)).await;
                let Some(h1) = h1.upgrade() else { return };
                let mut all = lock(&h1);
                let next = all.get_mut(&key).and_then(|list| {
                    prune_h1(list, idle.unwrap_or(H1_IDLE), max_age);
                    list.iter().filter_map(|c| deadline(c.since, c.born)).min()
                });
                match next {
                    Some(n) => after = n,
                    None => {
                        // Decided under the connections' lock: a connection kept after
                        // this finds the key free and starts a reaper of its own.
                        lock(&reaping).remove(&key);
                        return;
                    }
                }
            }
        });
    }

    /// The DestinationRule's `tcp.connectTimeout`, else the waypoint's.
    fn connect_timeout(&self, ep: &Endpoint) -> Duration {
        ep.reuse
            .connect_timeout
            .unwrap_or_else(|| self.pool.connect_timeout())
    }

    /// Fails with the HBONE connect timeout: whatever part of a dial stalls, the request
    /// (and any waiting for the same connection) ends within it.
    fn dial_timeout(&self, ep: &Endpoint) -> UpstreamError {
        let after = self.connect_timeout(ep);
        UpstreamError::Connect {
            endpoint: ep.addr,
            source: HboneError::Timeout {
                peer: ep.addr.to_string(),
                after,
            },
        }
    }

    /// `upgrades`: the connection may switch protocols (hands its IO to the response's
    /// `OnUpgrade` on a 101).
    async fn dial_h1(
        &self,
        ep: &Endpoint,
        upgrades: bool,
    ) -> Result<http1::SendRequest<Body>, UpstreamError> {
        let dial = async {
            let io = TokioIo::new(self.connect_io(ep).await?);
            http1::handshake(io)
                .await
                .map_err(|source| UpstreamError::Handshake {
                    endpoint: ep.addr,
                    source,
                })
        };
        let (sender, conn) = tokio::time::timeout(self.connect_timeout(ep), dial)
            .await
            .map_err(|_| self.dial_timeout(ep))??;
        tokio::spawn(
            async move {
                let r = if upgrades {
                    conn.with_upgrades().await
                } else {
                    conn.await
                };
                if let Err(e) = r {
                    tracing::debug!(error = %e, "upstream HTTP/1.1 connection ended");
                }
            }
            .in_current_span(),
        );
        Ok(sender)
    }

    async fn send_h1(
        &self,
        ep: &Endpoint,
        mut req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let key = ConnKey::of(ep);
        let mut stale = 0;
        loop {
            let (mut sender, served, born, reused) = match self.idle_h1(&key) {
                Some((s, n, born)) if stale < H1_STALE_RETRIES => (s, n, born, true),
                _ => (self.dial_h1(ep, false).await?, 0, Instant::now(), false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    // Kept for reuse: it turns ready again once this response body is read;
                    // not past the DestinationRule's maxRequestsPerConnection (dropped, it
                    // closes once this response is done).
                    let served = served.saturating_add(1);
                    if key.reuse.max_requests.is_some_and(|m| served >= m) {
                        return Ok(resp);
                    }
                    let mut all = lock(&self.h1);
                    make_room(
                        &mut all,
                        &key,
                        |k| k.addr == key.addr,
                        |l| l.iter().map(|c| c.since).max(),
                    );
                    let list = all.entry(key.clone()).or_default();
                    if list.len() < H1_MAX_IDLE {
                        list.push(H1Conn {
                            since: Instant::now(),
                            born,
                            sender,
                            served,
                        });
                    }
                    drop(all);
                    self.close_when_idle(key, born);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // A kept connection the server had closed: the request was never
                    // sent, so it may go on another connection whatever its method.
                    Some(r) if reused => {
                        tracing::debug!(error = %e.error(), "kept HTTP/1.1 connection was closed; sending on another");
                        req = r;
                        stale += 1;
                    }
                    _ => {
                        return Err(UpstreamError::Request {
                            endpoint: ep.addr,
                            source: e.into_error(),
                        })
                    }
                },
            }
        }
    }

    fn h2_slot(&self, key: &ConnKey) -> Arc<H2Slot> {
        let mut all = lock(&self.h2);
        if let Some(slot) = all.get(key) {
            return slot.clone();
        }
        // A new endpoint: forget connections that closed or sat unused (endpoints go away).
        all.retain(|_, slot| {
            let idle = lock(&slot.last_used).is_some_and(|t| t.elapsed() > H2_IDLE);
            let closed = slot
                .conn
                .try_lock()
                .map(|c| c.as_ref().is_some_and(|s| s.is_closed()))
                .unwrap_or(false);
            !(idle || closed)
        });
        make_room(
            &mut all,
            key,
            |k| k.addr == key.addr,
            |slot| *lock(&slot.last_used),
        );
        all.entry(key.clone()).or_default().clone()
    }

    async fn send_h2(
        &self,
        ep: &Endpoint,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let key = ConnKey::of(ep);
        let slot = self.h2_slot(&key);
        // DestinationRule idleTimeout: a connection unused that long is not reused (and
        // is closed when replaced); maxRequestsPerConnection: nor one that carried that
        // many requests (its streams in flight finish on it).
        let was_used = lock(&slot.last_used).replace(Instant::now());
        let expired = key
            .reuse
            .idle
            .zip(was_used)
            .is_some_and(|(idle, t)| t.elapsed() >= idle);
        let checkout =
            async {
                let mut conn = slot.conn.lock().await;
                // maxConnectionDuration, decided under the lock against the connection
                // held now, so requests queued behind a re-dial take the new one.
                let old = key
                    .reuse
                    .max_age
                    .zip(*lock(&slot.born))
                    .is_some_and(|(max, t)| t.elapsed() >= max);
                let spent = {
                    let mut served = lock(&slot.served);
                    *served += 1;
                    key.reuse.max_requests.is_some_and(|m| *served > m)
                };
                match conn.as_ref() {
                    Some(s) if !s.is_closed() && !expired && !spent && !old => Ok(s.clone()),
                    _ => {
                        *lock(&slot.served) = 1;
                        let io = TokioIo::new(self.connect_io(ep).await?);
                        let mut builder = http2::Builder::new(TokioExecutor::new());
                        builder
                            .initial_stream_window_size(hbone::h2_sizes().stream_window)
                            .initial_connection_window_size(hbone::h2_sizes().connection_window);
                        // DestinationRule http2KeepAlive: PINGs whether or not streams are open.
                        if let Some((interval, timeout)) = key.reuse.h2_ping {
                            builder
                                .timer(TokioTimer::new())
                                .keep_alive_interval(interval)
                                .keep_alive_timeout(timeout)
                                .keep_alive_while_idle(true);
                        }
                        let (sender, c) = builder.handshake(io).await.map_err(|source| {
                            UpstreamError::Handshake {
                                endpoint: ep.addr,
                                source,
                            }
                        })?;
                        tokio::spawn(
                            async move {
                                if let Err(e) = c.await {
                                    tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
                                }
                            }
                            .in_current_span(),
                        );
                        *conn = Some(sender.clone());
                        let born = Instant::now();
                        *lock(&slot.born) = Some(born);
                        if let Some(max) = key.reuse.max_age {
                            close_when_old(&slot, born, max);
                        }
                        Ok::<_, UpstreamError>(sender)
                    }
                }
            };
        let mut sender = tokio::time::timeout(self.connect_timeout(ep), checkout)
            .await
            .map_err(|_| self.dial_timeout(ep))??;
        sender
            .ready()
            .await
            .map_err(|source| UpstreamError::Request {
                endpoint: ep.addr,
                source,
            })?;
        sender
            .send_request(req)
            .await
            .map_err(|source| UpstreamError::Request {
                endpoint: ep.addr,
                source,
            })
    }
}

/// DestinationRule maxConnectionDuration on an HTTP/2 connection: once it is that old,
/// the slot lets it go (if it still holds it: the one made at `born`), so it takes no new
/// stream and closes when its streams are done (hyper sends GOAWAY once every sender is
/// gone).
fn close_when_old(slot: &Arc<H2Slot>, born: Instant, max: Duration) {
    let slot = Arc::downgrade(slot);
    tokio::spawn(async move {
        tokio::time::sleep(max).await;
        let Some(slot) = slot.upgrade() else { return };
        let mut conn = slot.conn.lock().await;
        if *lock(&slot.born) == Some(born) {
            *conn = None;
        }
    });
}

/// TCP keep-alive as Envoy sets it from the rule: SO_KEEPALIVE, the kernel's values for
/// what it leaves out. Best effort: a socket that refuses it still carries the request.
pub fn set_keepalive(tcp: &tokio::net::TcpStream, k: &crate::destination::connection::Keepalive) {
    let mut ka = socket2::TcpKeepalive::new();
    if let Some(t) = k.time {
        ka = ka.with_time(t);
    }
    if let Some(i) = k.interval {
        ka = ka.with_interval(i);
    }
    if let Some(n) = k.probes {
        ka = ka.with_retries(n);
    }
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&ka) {
        tracing::debug!(error = %e, "TCP keep-alive not set");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client cycling Host values (each a TLS server name of its own) keeps at most
    /// MAX_KEYS_PER_ENDPOINT keys per endpoint; the least recently used goes first, and
    /// other endpoints' keys are untouched.
    #[test]
    fn keys_per_endpoint_are_bounded() {
        let ep = |p: u16| SocketAddr::from(([10, 0, 0, 1], p));
        let mut map: HashMap<(SocketAddr, String), Option<Instant>> = HashMap::new();
        let t0 = Instant::now();
        map.insert((ep(2), "other".into()), None);
        for i in 0..1000u64 {
            let key = (ep(1), format!("host-{i}.example"));
            make_room(&mut map, &key, |k| k.0 == key.0, |v| *v);
            map.insert(key, Some(t0 + Duration::from_millis(i)));
        }
        assert_eq!(
            map.keys().filter(|k| k.0 == ep(1)).count(),
            MAX_KEYS_PER_ENDPOINT
        );
        assert!(
            map.contains_key(&(ep(1), "host-999.example".into()))
                && !map.contains_key(&(ep(1), "host-0.example".into()))
        );
        assert!(map.contains_key(&(ep(2), "other".into())));
        // A key already there takes no room.
        let again = (ep(1), "host-999.example".to_string());
        make_room(&mut map, &again, |k| k.0 == again.0, |v| *v);
        assert_eq!(
            map.keys().filter(|k| k.0 == ep(1)).count(),
            MAX_KEYS_PER_ENDPOINT
        );
    }
}
