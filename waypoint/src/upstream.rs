//! HTTP client connections to endpoints, each carried by one HBONE stream to the
//! endpoint's node. HTTP/1.1 connections are kept for reuse (one request at a time
//! each); one HTTP/2 connection per endpoint carries all of its requests.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tracing::Instrument;
use ztunnel::hbone::{self, H2Stream, HboneError, Pool, PoolKey};
use ztunnel::identity::Identity;
use ztunnel::netns::InPodNetns;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

/// An HTTP/1.1 connection idle longer than this is not reused (servers close idle
/// keep-alive connections after a while; reusing one then fails the request).
const H1_IDLE: Duration = Duration::from_secs(30);
/// At most this many idle HTTP/1.1 connections are kept per endpoint.
const H1_MAX_IDLE: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("HBONE to {endpoint} failed: {source}")]
    Connect { endpoint: SocketAddr, source: HboneError },
    #[error("HTTP handshake with {endpoint} failed: {source}")]
    Handshake { endpoint: SocketAddr, source: hyper::Error },
    #[error("request to {endpoint} failed: {source}")]
    Request { endpoint: SocketAddr, source: hyper::Error },
}

impl UpstreamError {
    /// The request never reached the endpoint's application (safe to retry anything).
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. } | UpstreamError::Handshake { .. })
    }
}

/// Where one attempt goes: the endpoint's address and the identities it may present.
pub struct Endpoint {
    pub addr: SocketAddr,
    pub identities: Vec<Identity>,
}

pub struct Upstreams {
    pool: Pool,
    netns: InPodNetns,
    identity: Identity,
    ip: IpAddr,
    h1: Mutex<HashMap<SocketAddr, Vec<(Instant, http1::SendRequest<Body>)>>>,
    h2: tokio::sync::Mutex<HashMap<SocketAddr, http2::SendRequest<Body>>>,
}

impl Upstreams {
    pub fn new(pool: Pool, netns: InPodNetns, identity: Identity, ip: IpAddr) -> Upstreams {
        Upstreams { pool, netns, identity, ip, h1: Mutex::default(), h2: tokio::sync::Mutex::default() }
    }

    /// Opens one HBONE stream to the endpoint (CONNECT endpoint ip:port).
    pub async fn tunnel(&self, ep: &Endpoint) -> Result<H2Stream, UpstreamError> {
        let key = PoolKey::new(self.identity.clone(), ep.identities.clone(), SocketAddr::new(ep.addr.ip(), ztunnel::ports::HBONE), self.ip);
        let req = Request::builder()
            .method(Method::CONNECT)
            .uri(ep.addr.to_string())
            .header("traceparent", hbone::traceparent())
            .body(())
            .map_err(|e| UpstreamError::Connect { endpoint: ep.addr, source: HboneError::Request(e) })?;
        let (send, recv, guard) = self
            .pool
            .connect(&key, &self.netns, req)
            .await
            .map_err(|source| UpstreamError::Connect { endpoint: ep.addr, source })?;
        Ok(H2Stream::new(send, recv, Some(guard)))
    }

    pub async fn send(&self, ep: &Endpoint, http2: bool, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        if http2 { self.send_h2(ep, req).await } else { self.send_h1(ep, req).await }
    }

    fn idle_h1(&self, addr: SocketAddr) -> Option<http1::SendRequest<Body>> {
        let mut all = self.h1.lock().unwrap_or_else(|p| p.into_inner());
        let list = all.get_mut(&addr)?;
        list.retain(|(since, s)| !s.is_closed() && since.elapsed() < H1_IDLE);
        let i = list.iter().position(|(_, s)| s.is_ready())?;
        Some(list.swap_remove(i).1)
    }

    async fn send_h1(&self, ep: &Endpoint, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        let mut sender = match self.idle_h1(ep.addr) {
            Some(s) => s,
            None => {
                let io = TokioIo::new(self.tunnel(ep).await?);
                let (sender, conn) = http1::handshake(io)
                    .await
                    .map_err(|source| UpstreamError::Handshake { endpoint: ep.addr, source })?;
                tokio::spawn(
                    async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(error = %e, "upstream HTTP/1.1 connection ended");
                        }
                    }
                    .in_current_span(),
                );
                sender
            }
        };
        let resp = sender
            .send_request(req)
            .await
            .map_err(|source| UpstreamError::Request { endpoint: ep.addr, source })?;
        // Back to the idle list: it turns ready again once this response body is read.
        let mut all = self.h1.lock().unwrap_or_else(|p| p.into_inner());
        let list = all.entry(ep.addr).or_default();
        if list.len() < H1_MAX_IDLE {
            list.push((Instant::now(), sender));
        }
        Ok(resp)
    }

    async fn send_h2(&self, ep: &Endpoint, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        let mut sender = {
            // Held across the dial so concurrent first requests share one connection.
            let mut conns = self.h2.lock().await;
            match conns.get(&ep.addr) {
                Some(s) if !s.is_closed() => s.clone(),
                _ => {
                    let io = TokioIo::new(self.tunnel(ep).await?);
                    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                        .initial_stream_window_size(hbone::STREAM_WINDOW)
                        .initial_connection_window_size(hbone::CONNECTION_WINDOW)
                        .handshake(io)
                        .await
                        .map_err(|source| UpstreamError::Handshake { endpoint: ep.addr, source })?;
                    tokio::spawn(
                        async move {
                            if let Err(e) = conn.await {
                                tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
                            }
                        }
                        .in_current_span(),
                    );
                    conns.insert(ep.addr, sender.clone());
                    sender
                }
            }
        };
        sender.ready().await.map_err(|source| UpstreamError::Request { endpoint: ep.addr, source })?;
        sender
            .send_request(req)
            .await
            .map_err(|source| UpstreamError::Request { endpoint: ep.addr, source })
    }
}
