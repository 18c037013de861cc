//! Talks HBONE to a ztunnel directly, as a (possibly hostile) peer would, using the
//! mesh CA from a test's state directory; and stands in for Istio's east-west gateway
//! (`EastWestGateway`) between networks.

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
pub async fn status(
    send: &h2::client::SendRequest<Bytes>,
    req: http::Request<()>,
) -> Result<http::StatusCode> {
    let mut send = send.clone().ready().await?;
    let (resp, _stream) = send.send_request(req, false)?;
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .context("no HBONE response")??;
    Ok(resp.status())
}

/// Opens a CONNECT stream to `authority`, sends `data`, ends the stream and reads until
/// the peer ends it: the status and what came back (nothing unless 200).
pub async fn roundtrip(
    send: &h2::client::SendRequest<Bytes>,
    authority: &str,
    data: &[u8],
) -> Result<(http::StatusCode, Vec<u8>)> {
    let mut send = send.clone().ready().await?;
    let (resp, mut stream) = send.send_request(connect_req(authority), false)?;
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .context("no HBONE response")??;
    let status = resp.status();
    if status != http::StatusCode::OK {
        return Ok((status, Vec::new()));
    }
    stream.send_data(Bytes::copy_from_slice(data), true)?;
    let mut body = resp.into_body();
    let mut back = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .context("tunnel stalled")?
    {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        back.extend_from_slice(&chunk);
    }
    Ok((status, back))
}

pub fn connect_req(authority: &str) -> http::Request<()> {
    http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(authority)
        .body(())
        .unwrap_or_default()
}

pub fn load_ca(state: &Path) -> Result<Ca> {
    Ok(Ca::from_files(
        &state.join("ca-cert.pem"),
        &state.join("ca-key.pem"),
    )?)
}

/// What the east-west gateway stand-in saw of one CONNECT.
#[derive(Clone, Debug)]
pub struct Forwarded {
    /// The outer TLS peer (the client pod's identity, as its ztunnel speaks for it).
    pub client: Identity,
    pub authority: String,
    /// The outer request's `x-forwarded-network` (Istio sends it on the inner one only).
    pub forwarded_network: Option<String>,
    /// The endpoint's ztunnel it forwarded to, if any; else the status it answered.
    pub endpoint: Option<SocketAddr>,
    pub status: u16,
}

/// A stand-in for Istio's east-west gateway (an Envoy there) in double HBONE, on
/// ztunnel's HBONE server: terminates the outer CONNECT (mTLS as the gateway's identity,
/// the client's certificate checked against the mesh root), reads the service the
/// CONNECT names (`hostname:port`), picks a healthy HBONE endpoint of that service with an
/// address in its own network (from the same mesh config), answers 200 and forwards the
/// inner bytes, which it cannot read (TLS end to end), to that endpoint's ztunnel :15008.
/// A target that is not a service hostname, or a service with no endpoint here: 400/503.
pub struct EastWestGateway {
    pub seen: Arc<std::sync::Mutex<Vec<Forwarded>>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct FixedCert(Arc<rustls::sign::CertifiedKey>);

impl ztunnel::tls::CurrentCert for FixedCert {
    fn current(&self) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

impl EastWestGateway {
    /// Listens on `ns`:15008 as `identity`, forwarding to endpoints in `network` of
    /// `state`, connecting to them from `ns`.
    pub async fn start(
        ns: &Netns,
        ca: &Ca,
        identity: &Identity,
        state: ztunnel::state::MeshState,
        network: &str,
    ) -> Result<EastWestGateway> {
        let cert = ca.issue(identity, Duration::from_secs(3600))?;
        let key = rustls::crypto::ring::sign::any_supported_type(&cert.key)?;
        let tls = ztunnel::tls::server_config(
            FixedCert(Arc::new(rustls::sign::CertifiedKey::new(
                cert.chain.clone(),
                key,
            ))),
            &[ca.root()],
            "cluster.local",
        )?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let server = Arc::new(ztunnel::hbone::server::Server {
            handshakes: ztunnel::hbone::server::HandshakeLimiter::new(0, 0),
            max_streams: ztunnel::hbone::SERVER_MAX_STREAMS,
            max_header_bytes: ztunnel::hbone::MAX_HEADER_BYTES,
            idle_timeout: None,
            metrics: Arc::new(ztunnel::metrics::Metrics::default()),
        });
        let listener = ns.listen(15008)?;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let ctx = Arc::new(GatewayCtx {
            ns: ns.clone(),
            state,
            network: network.to_string(),
            seen: seen.clone(),
        });
        let task = tokio::spawn(async move {
            let drain = Arc::new(ztunnel::drain::Drain::default());
            while let Ok((tcp, peer)) = listener.accept().await {
                // As Envoy's: no Nagle delay on either leg.
                let _ = tcp.set_nodelay(true);
                let (server, acceptor, ctx, drain) =
                    (server.clone(), acceptor.clone(), ctx.clone(), drain.clone());
                tokio::spawn(async move {
                    let Some((tcp, permit)) = server.admit(tcp, peer) else {
                        return;
                    };
                    let Some((conn, client)) = server.handshake(&acceptor, tcp, permit).await
                    else {
                        return;
                    };
                    let on_stream = |req: http::Request<h2::RecvStream>, respond| {
                        tokio::spawn(forward(ctx.clone(), client.clone(), req, respond));
                    };
                    server.serve(conn, &drain, &client, on_stream).await;
                });
            }
        });
        Ok(EastWestGateway { seen, task })
    }

    pub fn seen(&self) -> Vec<Forwarded> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for EastWestGateway {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct GatewayCtx {
    ns: Netns,
    state: ztunnel::state::MeshState,
    network: String,
    seen: Arc<std::sync::Mutex<Vec<Forwarded>>>,
}

/// One outer CONNECT: to an endpoint of the service it names, in the gateway's network.
async fn forward(
    ctx: Arc<GatewayCtx>,
    client: Identity,
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    let authority = req.uri().to_string();
    let forwarded_network = req
        .headers()
        .get("x-forwarded-network")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let record = |endpoint: Option<SocketAddr>, status: u16| {
        let f = Forwarded {
            client: client.clone(),
            authority: authority.clone(),
            forwarded_network: forwarded_network.clone(),
            endpoint,
            status,
        };
        if let Ok(mut s) = ctx.seen.lock() {
            s.push(f);
        }
    };
    let endpoint = match ztunnel::hbone::connect_authority(&req) {
        Ok(ztunnel::hbone::HboneAddress::Host(host, port)) => {
            let svc = ctx
                .state
                .services()
                .find(|s| s.hostname.eq_ignore_ascii_case(&host));
            let eps: Vec<_> = svc
                .map(|s| ctx.state.usable_hbone_endpoints(s, port, &ctx.network))
                .unwrap_or_default()
                .into_iter()
                .filter(|(w, _)| w.network == ctx.network && !w.workload_ips.is_empty())
                .collect();
            match ztunnel::state::pick_weighted(&eps) {
                Some((w, _)) => SocketAddr::new(w.workload_ips[0], 15008),
                None => {
                    record(None, 503);
                    return ztunnel::hbone::respond_status(
                        respond,
                        http::StatusCode::SERVICE_UNAVAILABLE,
                    );
                }
            }
        }
        _ => {
            record(None, 400);
            return ztunnel::hbone::respond_status(respond, http::StatusCode::BAD_REQUEST);
        }
    };
    let mut upstream = match ctx.ns.connect(endpoint).await {
        Ok(s) => {
            let _ = s.set_nodelay(true);
            s
        }
        Err(_) => {
            record(Some(endpoint), 503);
            return ztunnel::hbone::respond_status(respond, http::StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    let Ok(send) = respond.send_response(http::Response::new(()), false) else {
        return;
    };
    record(Some(endpoint), 200);
    let _ = ztunnel::relay::copy_tcp_h2(
        &mut upstream,
        send,
        req.into_body(),
        std::future::pending(),
        None,
    )
    .await;
}
