//! The per-pod proxy: listeners inside each enrolled pod's netns, like Istio's in-pod mode.
//! 15001 outbound (captured), 15008 inbound HBONE, 15006 inbound plaintext.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::task::JoinSet;

use crate::capture::{self, CaptureError};
use crate::config::ProxyConfig;
use crate::hbone::Pool;
use crate::identity::{CertManager, Identity};
use crate::netns::{InPodNetns, NetnsError};
use crate::ports;
use crate::state::{MeshState, Workload, WorkloadUid};

pub mod inbound;
pub mod inbound_passthrough;
pub mod outbound;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("workload {0} is not in the mesh config; add it to the config before enrolling the pod")]
    UnknownWorkload(WorkloadUid),
    #[error("workload {uid} runs on node {node:?}, not on this node {ours:?}; a node proxy only serves its own node's pods")]
    WrongNode { uid: WorkloadUid, node: String, ours: String },
    #[error("workload {0} has no IPv4 address")]
    NoAddress(WorkloadUid),
    #[error("cannot bind listener {addr} in pod {pod}: {source}")]
    Bind { pod: String, addr: SocketAddr, source: NetnsError },
    #[error(transparent)]
    Cert(#[from] crate::identity::manager::CertError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
}

/// How long a removed pod's listeners keep accepting connections captured just before.
const REMOVAL_GRACE: std::time::Duration = std::time::Duration::from_millis(200);
/// How long a removed pod's in-flight connections may take to finish.
const REMOVAL_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What every connection handler needs.
pub struct ProxyInputs {
    pub state: Arc<ArcSwap<MeshState>>,
    pub certs: Arc<CertManager>,
    pub pool: Pool,
    pub cfg: ProxyConfig,
    pub capture: capture::Backend,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub drain: Arc<crate::drain::Drain>,
}

/// The local workload a listener serves.
#[derive(Clone)]
pub struct LocalPod {
    pub workload: Arc<Workload>,
    pub identity: Identity,
    pub ip: IpAddr,
    pub ipv4: Ipv4Addr,
    pub netns: InPodNetns,
    /// This pod's in-flight connections, which its removal lets finish.
    pub active: Arc<crate::drain::Drain>,
}

/// An enrolled pod: its listeners run until this is dropped (or `remove` is called).
pub struct EnrolledPod {
    pub pod: LocalPod,
    tasks: JoinSet<()>,
    inputs: Arc<ProxyInputs>,
}

impl EnrolledPod {
    /// Stops the listeners and removes capture from the pod.
    pub async fn remove(mut self) -> Result<(), ProxyError> {
        // Steering goes first: no new connection reaches listeners about to close. Those
        // steered just before (handshake under way, or queued for accept) are still
        // accepted and served during a short grace instead of dying with the listener.
        let stopped = self.inputs.capture.stop_steering(&self.pod.netns, self.pod.ipv4).await;
        tokio::time::sleep(REMOVAL_GRACE).await;
        self.tasks.shutdown().await;
        // Deliveries in flight need the local reply route until they end.
        if !self.pod.active.wait_idle(REMOVAL_DRAIN).await {
            tracing::warn!(uid = %self.pod.workload.uid, active = self.pod.active.active(), "pod removed with connections still open; they will break");
        }
        let finished = self.inputs.capture.finish_removal(&self.pod.netns).await;
        self.inputs.certs.release(&self.pod.identity);
        stopped?;
        Ok(finished?)
    }
}

pub async fn enroll(inputs: Arc<ProxyInputs>, uid: &WorkloadUid, netns: InPodNetns) -> Result<EnrolledPod, ProxyError> {
    let wl = inputs
        .state
        .load()
        .workload_by_uid(uid)
        .cloned()
        .ok_or_else(|| ProxyError::UnknownWorkload(uid.clone()))?;
    if wl.node != inputs.cfg.node_name {
        return Err(ProxyError::WrongNode { uid: uid.clone(), node: wl.node.clone(), ours: inputs.cfg.node_name.clone() });
    }
    let ipv4 = wl
        .workload_ips
        .iter()
        .find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .ok_or_else(|| ProxyError::NoAddress(uid.clone()))?;
    let ip = IpAddr::V4(ipv4);
    let identity = wl.identity();
    inputs.certs.allow(&identity);
    let pod = LocalPod { workload: wl, identity: identity.clone(), ip, ipv4, netns: netns.clone(), active: Default::default() };
    let r = start(inputs.clone(), pod).await;
    if r.is_err() {
        inputs.certs.release(&identity);
    }
    r
}

async fn start(inputs: Arc<ProxyInputs>, pod: LocalPod) -> Result<EnrolledPod, ProxyError> {
    inputs.certs.fetch(&pod.identity).await?;
    let bind = |addr: SocketAddr| {
        pod.netns.listen(addr, false).map_err(|source| ProxyError::Bind { pod: pod.netns.name().to_string(), addr, source })
    };
    let any = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    // Outbound is only reached through REDIRECT, which targets loopback.
    let outbound = bind(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), ports::OUTBOUND))?;
    let hbone = bind(SocketAddr::new(any, ports::HBONE))?;
    let plaintext = bind(SocketAddr::new(any, ports::INBOUND_PLAINTEXT))?;
    let tls = Arc::new(crate::tls::server_config(
        PodCert { certs: inputs.certs.clone(), identity: pod.identity.clone() },
        &inputs.certs.current(&pod.identity).map(|c| c.cert.roots.clone()).unwrap_or_default(),
        &pod.identity.trust_domain,
    )?);
    // When a listener of a SO_REUSEPORT group closes (an old proxy handing over), move
    // its queued connections to the remaining listener instead of resetting them.
    let migrate = match pod.netns.run(|| std::fs::write("/proc/sys/net/ipv4/tcp_migrate_req", "1")) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = migrate {
        tracing::warn!(error = %e, "cannot enable tcp_migrate_req; connections queued during a proxy hand-off may be reset");
    }
    // Listeners exist (and queue connections) before capture steers anything to them.
    // On failure capture is left as it is (fail closed): the pod may have been captured
    // before this proxy started, and a retried Add or a Del settles it.
    inputs.capture.install(&pod.netns, pod.ipv4, &plaintext).await?;
    let mut tasks = JoinSet::new();
    tasks.spawn(outbound::serve(inputs.clone(), pod.clone(), outbound));
    tasks.spawn(inbound::serve(inputs.clone(), pod.clone(), hbone, tls));
    tasks.spawn(inbound_passthrough::serve(inputs.clone(), pod.clone(), plaintext));
    tracing::info!(uid = %pod.workload.uid, identity = %pod.identity, ip = %pod.ip, netns = pod.netns.name(), "pod enrolled");
    Ok(EnrolledPod { pod, tasks, inputs })
}

#[derive(Debug)]
struct PodCert {
    certs: Arc<CertManager>,
    identity: Identity,
}

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CertManager")
    }
}

impl crate::tls::CurrentCert for PodCert {
    fn current(&self) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.certs.current(&self.identity).map(|c| c.certified_key.clone())
    }
}

/// Whether an original destination points back at this pod's proxy listeners.
pub(crate) fn is_self_call(pod: &LocalPod, dst: SocketAddr) -> bool {
    ports::is_proxy_port(dst.port()) && (dst.ip() == pod.ip || dst.ip().is_loopback() || dst.ip().is_unspecified())
}

/// Relays between a client connection `a` and its upstream `b`, counting the connection
/// in `metrics`; returns (bytes from the client, bytes to it). An error resets both sides.
pub(crate) async fn copy_tcp(
    metrics: &crate::metrics::Metrics,
    labels: &crate::metrics::TcpLabels,
    a: &mut tokio::net::TcpStream,
    b: &mut tokio::net::TcpStream,
) -> std::io::Result<(u64, u64)> {
    metrics.opened(labels);
    let r = tokio::io::copy_bidirectional(a, b).await;
    let (from_client, to_client) = r.as_ref().map(|t| *t).unwrap_or_default();
    metrics.closed(labels, from_client, to_client);
    if r.is_err() {
        crate::netns::set_reset_on_close(a);
        crate::netns::set_reset_on_close(b);
    }
    r
}

/// Counts a connection both for the process's drain and for its pod's removal.
pub(crate) fn track(inputs: &ProxyInputs, pod: &LocalPod) -> (crate::drain::ActiveGuard, crate::drain::ActiveGuard) {
    (inputs.drain.track(), pod.active.track())
}

/// Accept errors (e.g. EMFILE) must not spin a runtime thread or end the listener.
pub async fn accept_backoff(listener: &str, e: std::io::Error) {
    tracing::warn!(listener, error = %e, "accept failed; retrying");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// The original destination of a captured connection; logs and yields None if unreadable.
/// REDIRECT (nftables) and the eBPF outbound hook answer SO_ORIGINAL_DST; a connection
/// steered by sk_lookup keeps its original local address, so there getsockname() is the
/// destination. A local address on a proxy port means nothing redirected it.
pub(crate) fn captured_destination(stream: &tokio::net::TcpStream) -> Option<SocketAddr> {
    let e = match crate::netns::original_dst(stream) {
        Ok(d) => return Some(d),
        Err(e) => e,
    };
    match stream.local_addr() {
        Ok(local) if !ports::is_proxy_port(local.port()) => Some(local),
        _ => {
            tracing::warn!(error = %e, "cannot read the original destination; closing");
            None
        }
    }
}

/// Accepts until draining starts; then the listener is dropped, so new connections to
/// this pod are refused while in-flight ones finish.
pub(crate) async fn accept_until_drain(
    inputs: &ProxyInputs,
    listener: &tokio::net::TcpListener,
    name: &str,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            _ = inputs.drain.signaled() => return None,
            r = listener.accept() => match r {
                Ok(c) => return Some(c),
                Err(e) => accept_backoff(name, e).await,
            },
        }
    }
}
