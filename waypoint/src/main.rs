//! waypoint: the per-namespace / per-service-account proxy. It terminates HBONE (mTLS
//! with its own SPIFFE identity, HTTP/2 CONNECT), picks an endpoint of the CONNECT
//! target (a service VIP:port or a workload ip:port) and forwards over pooled HBONE to
//! that endpoint's node, as the mesh's other hop. This is the L4 stage: L7 routing and
//! authorization come next (see README, Status).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use h2::server::SendResponse;
use http::{Method, Request, Response, StatusCode};
use tracing::Instrument;
use ztunnel::hbone::{self, respond_status as respond, Pool, PoolKey};
use ztunnel::identity::ca::Ca;
use ztunnel::identity::manager::LocalCa;
use ztunnel::identity::{CertManager, Identity};
use ztunnel::netns::InPodNetns;
use ztunnel::state::{HealthStatus, MeshState, Protocol, Workload, WorkloadUid};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Parser, Debug)]
#[command(name = "waypoint", about = "Waypoint proxy: HBONE in, HBONE out")]
struct Args {
    /// Mesh config (the same local config YAML as ztunnel's).
    #[arg(long, env = "LOCAL_XDS_PATH")]
    local_xds_path: PathBuf,
    /// This waypoint's own workload uid in the config (its identity and address).
    #[arg(long, env = "WAYPOINT_WORKLOAD_UID")]
    workload_uid: String,
    /// Directory holding the mesh CA (`ca-cert.pem`, `ca-key.pem`), as ztunnel's --state-dir.
    #[arg(long, env = "ZTUNNEL_STATE_DIR", default_value = "/var/lib/ztunnel")]
    state_dir: PathBuf,
    #[arg(long, default_value = "0.0.0.0:15008")]
    listen: SocketAddr,
    #[arg(long, env = "WORKLOAD_CERT_TTL_SECONDS", default_value_t = 24 * 3600)]
    cert_ttl_seconds: u64,
    #[arg(long, env = "CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    connect_timeout_ms: u64,
    #[arg(long, env = "POOL_MAX_STREAMS_PER_CONNECTION", default_value_t = 100)]
    pool_max_streams: usize,
    #[arg(long, env = "POOL_UNUSED_RELEASE_TIMEOUT_SECONDS", default_value_t = 300)]
    pool_idle_timeout_seconds: u64,
}

/// Everything a stream handler needs.
struct Waypoint {
    state: MeshState,
    me: Arc<Workload>,
    identity: Identity,
    ip: IpAddr,
    pool: Pool,
    netns: InPodNetns,
}

#[derive(Debug)]
struct OwnCert {
    certs: Arc<CertManager>,
    identity: Identity,
}

impl ztunnel::tls::CurrentCert for OwnCert {
    fn current(&self) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.certs.current(&self.identity).map(|c| c.certified_key.clone())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).init();
    let args = Args::parse();
    ztunnel::netns::init().context("cannot open this process's network namespace")?;
    let cfg = ztunnel::config::LocalConfig::load(&args.local_xds_path)?;
    let state = cfg.into_state(&args.local_xds_path)?;
    let me = state
        .workload_by_uid(&WorkloadUid(args.workload_uid.clone()))
        .cloned()
        .with_context(|| format!("--workload-uid {}: no such workload in {}", args.workload_uid, args.local_xds_path.display()))?;
    let ip = me
        .workload_ips
        .iter()
        .copied()
        .find(IpAddr::is_ipv4)
        .with_context(|| format!("workload {} has no IPv4 address", me.uid))?;
    let identity = me.identity();
    // The waypoint signs with the mesh CA it shares with the node proxies; it never
    // creates one (that would split the mesh's trust).
    let ca = Ca::from_files(&args.state_dir.join("ca-cert.pem"), &args.state_dir.join("ca-key.pem"))
        .with_context(|| format!("cannot load the mesh CA from {}", args.state_dir.display()))?;
    let certs = CertManager::new(Arc::new(LocalCa { ca, ttl: Duration::from_secs(args.cert_ttl_seconds) }));
    certs.allow(&identity);
    let cert = certs.fetch(&identity).await?;
    let tls = Arc::new(ztunnel::tls::server_config(
        OwnCert { certs: certs.clone(), identity: identity.clone() },
        &cert.cert.roots,
        &identity.trust_domain,
    )?);
    let connect_timeout = Duration::from_millis(args.connect_timeout_ms);
    let pool = Pool::new(certs.clone(), args.pool_max_streams, Duration::from_secs(args.pool_idle_timeout_seconds), connect_timeout);
    let netns = InPodNetns::open(std::path::Path::new("/proc/self/ns/net"))?;
    let wp = Arc::new(Waypoint { state, me, identity: identity.clone(), ip, pool, netns });
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("cannot listen on {}", args.listen))?;
    tracing::info!(identity = %identity, listen = %args.listen, "waypoint ready");
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let span = tracing::info_span!("waypoint", peer = %peer);
                    tokio::spawn(connection(wp.clone(), acceptor.clone(), stream, peer).instrument(span));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    // Draining (GOAWAY, a deadline) is not built yet: in-flight tunnels end with us.
    tracing::info!("waypoint stopping");
    Ok(())
}

async fn connection(wp: Arc<Waypoint>, acceptor: tokio_rustls::TlsAcceptor, stream: tokio::net::TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return tracing::warn!(error = %e, "HBONE TLS handshake failed"),
        Err(_) => return tracing::warn!("HBONE TLS handshake timed out"),
    };
    let src_identity = match ztunnel::tls::peer_identity(tls.get_ref().1) {
        Ok(id) => id,
        Err(e) => return tracing::warn!(error = %e, "HBONE peer has no usable identity"),
    };
    let h2 = hbone::server_builder().handshake::<_, Bytes>(tls).await;
    let mut conn = match h2 {
        Ok(c) => c,
        Err(e) => return tracing::warn!(error = %e, "HBONE HTTP/2 handshake failed"),
    };
    while let Some(next) = conn.accept().await {
        match next {
            Ok((req, respond)) => {
                let span = tracing::info_span!("stream", src.identity = %src_identity);
                tokio::spawn(stream_handler(wp.clone(), req, respond, peer, src_identity.clone()).instrument(span));
            }
            Err(e) => {
                tracing::debug!(error = %e, "HBONE connection ended");
                break;
            }
        }
    }
}


/// The endpoint behind a CONNECT target: a healthy endpoint of the service with that
/// VIP (random, weighted by capacity), or the workload with that address.
fn pick_endpoint(state: &MeshState, target: SocketAddr) -> Option<(Arc<Workload>, u16, Option<Arc<ztunnel::state::Service>>)> {
    if let Some(svc) = state.service_by_vip(target.ip()) {
        let eps: Vec<_> = state
            .endpoints_for(svc, target.port())
            .into_iter()
            .filter(|(w, _)| w.status == HealthStatus::Healthy && w.protocol == Protocol::HBONE)
            .collect();
        return ztunnel::state::pick_weighted(&eps).map(|(w, p)| (w, p, Some(svc.clone())));
    }
    let wl = state.workload_by_ip(target.ip())?;
    (wl.protocol == Protocol::HBONE).then(|| (wl.clone(), target.port(), None))
}

async fn stream_handler(
    wp: Arc<Waypoint>,
    req: Request<h2::RecvStream>,
    tx: SendResponse<Bytes>,
    peer: SocketAddr,
    src_identity: Identity,
) {
    let start = Instant::now();
    if req.method() != Method::CONNECT {
        tracing::warn!(method = %req.method(), "HBONE request is not CONNECT");
        return respond(tx, StatusCode::BAD_REQUEST);
    }
    let Some(target) = req.uri().authority().and_then(|a| a.as_str().parse::<SocketAddr>().ok()) else {
        tracing::warn!(uri = %req.uri(), "CONNECT authority is not ip:port");
        return respond(tx, StatusCode::BAD_REQUEST);
    };
    let Some((endpoint, port, service)) = pick_endpoint(&wp.state, target) else {
        tracing::warn!(dst.addr = %target, response_flags = "NR", "no healthy mesh endpoint for the target");
        return respond(tx, StatusCode::SERVICE_UNAVAILABLE);
    };
    let Some(ep_ip) = endpoint.workload_ips.iter().copied().find(IpAddr::is_ipv4) else {
        return respond(tx, StatusCode::SERVICE_UNAVAILABLE);
    };
    let upstream_target = SocketAddr::new(ep_ip, port);
    let expected = wp.state.expected_identities(&endpoint, service.as_deref());
    let key = PoolKey::new(wp.identity.clone(), expected, SocketAddr::new(ep_ip, ztunnel::ports::HBONE), wp.ip);
    // The original client stays visible to the destination.
    let forwarded = req
        .headers()
        .get("forwarded")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("for=\"{peer}\""));
    let up_req = Request::builder()
        .method(Method::CONNECT)
        .uri(upstream_target.to_string())
        .header("forwarded", forwarded)
        .header("traceparent", hbone::traceparent())
        .body(());
    let up_req = match up_req {
        Ok(r) => r,
        Err(_) => return respond(tx, StatusCode::INTERNAL_SERVER_ERROR),
    };
    let (up_send, up_recv, guard) = match wp.pool.connect(&key, &wp.netns, up_req).await {
        Ok(u) => u,
        Err(e) => {
            let status = match &e {
                hbone::HboneError::Status { status, .. } if *status == StatusCode::UNAUTHORIZED => StatusCode::UNAUTHORIZED,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            tracing::warn!(dst.addr = %upstream_target, error = %e, status = status.as_u16(), "upstream HBONE failed");
            return respond(tx, status);
        }
    };
    let mut tx = tx;
    let down_send = match tx.send_response(Response::builder().status(StatusCode::OK).body(()).unwrap_or_default(), false) {
        Ok(s) => s,
        Err(e) => return tracing::debug!(error = %e, "client went away"),
    };
    let r = hbone::copy_h2_h2(down_send, req.into_body(), up_send, up_recv).await;
    drop(guard);
    let (t, err) = match r {
        Ok(t) => (t, None),
        Err((e, t)) => (t, Some(e.to_string())),
    };
    tracing::info!(
        direction = "waypoint", src.identity = %src_identity, src.addr = %peer, dst.addr = %target,
        dst.service = service.as_ref().map(|s| s.hostname.clone()), dst.workload = %endpoint.name,
        dst.hbone_addr = %key.dst, waypoint = %wp.me.name,
        bytes_sent = t.sent, bytes_recv = t.received, duration_ms = start.elapsed().as_millis() as u64,
        error = err, "connection complete"
    );
}
