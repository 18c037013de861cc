//! The per-pod proxy: listeners inside each enrolled pod's netns, like Istio's in-pod mode.
//! 15001 outbound (captured), 15008 inbound HBONE, 15006 inbound plaintext, 15053 DNS.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use tokio::task::JoinSet;

use crate::capture::{self, CaptureError};
use crate::config::ProxyConfig;
use crate::hbone::Pool;
use crate::identity::manager::IdentityCert;
use crate::identity::{CertManager, Identity};
use crate::netns::{InPodNetns, NetnsError};
use crate::ports;
use crate::state::{MeshState, SharedState, Workload, WorkloadUid};

pub mod inbound;
pub mod inbound_passthrough;
pub mod outbound;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("workload {0} is not in the mesh config (waited {1:?} for it); add it to the config, or check that istiod knows the pod")]
    UnknownWorkload(WorkloadUid, std::time::Duration),
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
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsError),
}

/// How long a removed pod's listeners keep accepting connections captured just before.
const REMOVAL_GRACE: std::time::Duration = std::time::Duration::from_millis(200);
/// How long a removed pod's in-flight connections may take to finish.
const REMOVAL_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What every connection handler needs.
pub struct ProxyInputs {
    pub state: Arc<SharedState>,
    pub certs: Arc<CertManager>,
    pub pool: Pool,
    pub cfg: ProxyConfig,
    pub capture: capture::Backend,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub drain: Arc<crate::drain::Drain>,
    /// The HBONE server's limits (handshakes in flight are counted across all pods).
    pub hbone_server: Arc<crate::hbone::server::Server>,
    /// The DNS proxy, when on: each pod gets its listeners.
    pub dns: Option<Arc<crate::dns::DnsProxy>>,
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
    /// Its inbound connections, re-checked against policy whenever the state changes.
    pub inbound: Arc<InboundConns>,
}

impl LocalPod {
    /// The pod's workload as the current state has it (policies and labels may have
    /// changed since enrollment); the enrolled one if the state no longer lists it.
    pub fn workload_in<'a>(&'a self, state: &'a MeshState) -> &'a Arc<Workload> {
        state.workload_by_uid(&self.workload.uid).unwrap_or(&self.workload)
    }
}

/// Open inbound connections of one pod and what authorized them. When the mesh state
/// changes (a policy pushed by istiod), each is authorized again and closed if the new
/// policy denies it, as Istio's ztunnel does.
#[derive(Default)]
pub struct InboundConns {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, (crate::rbac::Connection, Arc<tokio::sync::Notify>)>>,
}

/// A registered connection; dropping it unregisters.
pub struct InboundGuard {
    conns: Arc<InboundConns>,
    id: u64,
    /// Notified when policy no longer allows the connection.
    pub revoked: Arc<tokio::sync::Notify>,
}

impl Drop for InboundGuard {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

impl InboundConns {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, (crate::rbac::Connection, Arc<tokio::sync::Notify>)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn register(self: &Arc<Self>, conn: crate::rbac::Connection) -> InboundGuard {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let revoked = Arc::new(tokio::sync::Notify::new());
        self.lock().insert(id, (conn, revoked.clone()));
        InboundGuard { conns: self.clone(), id, revoked }
    }

    /// Re-authorizes every open connection of `pod` under `state`; returns how many were revoked.
    fn recheck(&self, state: &MeshState, pod: &LocalPod) -> usize {
        let wl = pod.workload_in(state);
        let mut revoked = 0;
        for (conn, notify) in self.lock().values() {
            if let crate::rbac::Decision::Deny(reason) = state.authorize(wl, conn) {
                tracing::warn!(src.addr = %conn.src_ip, dst.addr = %conn.dst,
                    src.identity = conn.src_identity.as_ref().map(|i| i.to_string()),
                    error = %reason, "closing an open connection: policy now denies it");
                // A stored permit: the connection sees it even if not waiting yet.
                notify.notify_one();
                revoked += 1;
            }
        }
        revoked
    }
}

/// Re-checks the pod's open inbound connections on every state change.
async fn recheck_on_change(inputs: Arc<ProxyInputs>, pod: LocalPod) {
    let mut changes = inputs.state.changes();
    changes.mark_unchanged();
    while changes.changed().await.is_ok() {
        let state = inputs.state.load_full();
        let n = pod.inbound.recheck(&state, &pod);
        if n > 0 {
            tracing::info!(pod = %pod.workload.name, revoked = n, "policy change closed open connections");
        }
    }
}

/// An enrolled pod: its listeners run until this is dropped (or `remove` is called).
pub struct EnrolledPod {
    pub pod: LocalPod,
    tasks: JoinSet<()>,
    inputs: Arc<ProxyInputs>,
    /// Counts this proxy in `workload_manager_*` while it lives.
    _active: crate::metrics::meta::ActiveProxy,
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

/// How long an enrollment waits for its workload to show up in the mesh state (with
/// istiod, the CNI agent can announce a pod before istiod has pushed it).
pub const ENROLL_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// The pod's workload: by `uid`, else by `(namespace, name)` on this node, waiting up to
/// `wait` for it to appear.
pub async fn await_workload(
    inputs: &ProxyInputs,
    uid: &WorkloadUid,
    pod: Option<(&str, &str)>,
    wait: std::time::Duration,
) -> Result<Arc<Workload>, ProxyError> {
    let mut changes = inputs.state.changes();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(w) = inputs.state.load().workload_for_pod(uid, pod, &inputs.cfg.node_name) {
            return Ok(w.clone());
        }
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(Ok(())) => continue,
            _ => return Err(ProxyError::UnknownWorkload(uid.clone(), wait)),
        }
    }
}

/// Enrolls the pod of workload `uid`, waiting up to `wait` for it to appear.
pub async fn enroll(
    inputs: Arc<ProxyInputs>,
    uid: &WorkloadUid,
    netns: InPodNetns,
    wait: std::time::Duration,
) -> Result<EnrolledPod, ProxyError> {
    let wl = await_workload(&inputs, uid, None, wait).await?;
    enroll_workload(inputs, wl, netns).await
}

/// Enrolls the pod of a known workload: certificate, listeners, then capture.
pub async fn enroll_workload(inputs: Arc<ProxyInputs>, wl: Arc<Workload>, netns: InPodNetns) -> Result<EnrolledPod, ProxyError> {
    let uid = &wl.uid.clone();
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
    let pod = LocalPod {
        workload: wl,
        identity: identity.clone(),
        ip,
        ipv4,
        netns: netns.clone(),
        active: Default::default(),
        inbound: Default::default(),
    };
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
    // Inbound listeners are transparent so that TPROXY rules (istio-cni's in-pod capture,
    // with `--capture none`) can deliver to them; REDIRECT and sk_lookup don't mind.
    let bind_transparent = |addr: SocketAddr| {
        pod.netns.listen(addr, true).map_err(|source| ProxyError::Bind { pod: pod.netns.name().to_string(), addr, source })
    };
    let hbone = bind_transparent(SocketAddr::new(any, ports::HBONE))?;
    let plaintext = bind_transparent(SocketAddr::new(any, ports::INBOUND_PLAINTEXT))?;
    let dns = match &inputs.dns {
        Some(d) => Some((d.clone(), crate::dns::server::bind(&pod.netns)?)),
        None => None,
    };
    let tls = Arc::new(crate::tls::server_config(
        IdentityCert { certs: inputs.certs.clone(), identity: pod.identity.clone() },
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
    tasks.spawn(recheck_on_change(inputs.clone(), pod.clone()));
    if let Some((dns, listeners)) = dns {
        tasks.spawn(crate::dns::server::serve(dns, pod.clone(), listeners, inputs.drain.clone()));
    }
    tracing::info!(uid = %pod.workload.uid, identity = %pod.identity, ip = %pod.ip, netns = pod.netns.name(), "pod enrolled");
    let _active = inputs.metrics.workload_manager.started();
    Ok(EnrolledPod { pod, tasks, inputs, _active })
}

/// Whether an original destination points back at this pod's proxy listeners.
pub(crate) fn is_self_call(pod: &LocalPod, dst: SocketAddr) -> bool {
    ports::is_proxy_port(dst.port()) && (dst.ip() == pod.ip || dst.ip().is_loopback() || dst.ip().is_unspecified())
}

/// Relays between a client connection `a` and its upstream `b`, counting the connection
/// in `metrics`; returns (bytes from the client, bytes to it). It ends early, with both
/// sides reset, when `revoked` completes (a policy change that denies the connection) or
/// when no byte moved either way for `idle`. An error resets both sides.
pub(crate) async fn copy_tcp(
    metrics: &crate::metrics::Metrics,
    labels: &crate::metrics::TcpLabels,
    a: &mut tokio::net::TcpStream,
    b: &mut tokio::net::TcpStream,
    revoked: impl std::future::Future<Output = ()>,
    idle: Option<std::time::Duration>,
) -> std::io::Result<(u64, u64)> {
    use std::sync::atomic::AtomicU64;
    metrics.opened(labels);
    let (from_client, to_client) = (AtomicU64::new(0), AtomicU64::new(0));
    let r = {
        let (mut ar, mut aw) = a.split();
        let (mut br, mut bw) = b.split();
        let up = copy_half(&mut ar, &mut bw, &from_client);
        let down = copy_half(&mut br, &mut aw, &to_client);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
            _ = revoked => Err(std::io::Error::other(crate::hbone::CopyError::Revoked.to_string())),
            _ = crate::hbone::idle_watchdog([&from_client, &to_client], idle) => Err(std::io::Error::other(crate::hbone::CopyError::Idle.to_string())),
        }
    };
    let (from_client, to_client) = (from_client.into_inner(), to_client.into_inner());
    metrics.closed(labels, from_client, to_client);
    let r = r.map(|()| (from_client, to_client));
    if r.is_err() {
        crate::netns::set_reset_on_close(a);
        crate::netns::set_reset_on_close(b);
    }
    r
}

/// One direction of a TCP relay: copies until EOF, then half-closes the other side.
async fn copy_half(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    count: &std::sync::atomic::AtomicU64,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        to.write_all(&buf[..n]).await?;
        count.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Counts a connection both for the process's drain and for its pod's removal; None
/// (counted as refused) when the pod already has `max_connections_per_pod` open.
pub(crate) fn track(inputs: &ProxyInputs, pod: &LocalPod) -> Option<(crate::drain::ActiveGuard, crate::drain::ActiveGuard)> {
    let max = inputs.cfg.max_connections_per_pod;
    if max > 0 && pod.active.active() >= max {
        inputs.metrics.connection_refused("pod_limit");
        tracing::warn!(pod = %pod.workload.name, max, "pod connection limit reached; refusing");
        return None;
    }
    Some((inputs.drain.track(), pod.active.track()))
}

/// Accept errors (e.g. EMFILE) must not spin a runtime thread or end the listener.
pub async fn accept_backoff(listener: &str, e: std::io::Error) {
    tracing::warn!(listener, error = %e, "accept failed; retrying");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// One file descriptor held in reserve. When the process runs out of descriptors, a
/// connection waiting in a listener's queue cannot be accepted, so its client would hang
/// until it times out; releasing the reserve lets us accept it and reset it at once (the
/// client is refused, not left waiting), then the reserve is taken again.
static SPARE_FD: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

/// Opens the reserve descriptor; call once at start.
pub fn reserve_spare_fd() {
    let mut spare = SPARE_FD.lock().unwrap_or_else(|p| p.into_inner());
    if spare.is_none() {
        *spare = std::fs::File::open("/dev/null").ok();
    }
}

fn out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// Out of descriptors: refuse (reset) the connections waiting in `listener`'s queue,
/// using the reserve descriptor, count them, and back off briefly.
async fn refuse_queued(inputs: &ProxyInputs, listener: &tokio::net::TcpListener, name: &str) {
    use std::os::fd::AsRawFd;
    let mut refused = 0u64;
    {
        let mut spare = SPARE_FD.lock().unwrap_or_else(|p| p.into_inner());
        if spare.take().is_some() {
            // The freed descriptor takes one queued connection at a time: accept, reset
            // (SO_LINGER 0), close, next. Done synchronously so nothing else takes the slot.
            loop {
                // SAFETY: plain syscalls on a listening socket we own; a returned fd is
                // closed below.
                let fd = unsafe {
                    libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
                };
                if fd < 0 {
                    break;
                }
                let linger = libc::linger { l_onoff: 1, l_linger: 0 };
                // SAFETY: fd is the socket accept4 just returned; closed right after.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&linger as *const libc::linger).cast(),
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    );
                    libc::close(fd);
                }
                refused += 1;
            }
            *spare = std::fs::File::open("/dev/null").ok();
        } else {
            // Taken by someone else while we were short; get it back when one frees up.
            *spare = std::fs::File::open("/dev/null").ok();
        }
    }
    for _ in 0..refused {
        inputs.metrics.connection_refused("fd_exhaustion");
    }
    // Out of descriptors, accept fails at once whether or not anything waits: warn once a
    // second, not on every retry.
    static LAST_WARN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    if LAST_WARN.swap(now, std::sync::atomic::Ordering::Relaxed) != now {
        tracing::warn!(listener = name, refused, "out of file descriptors: refusing new connections until some close");
    }
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
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
                Err(e) if out_of_fds(&e) => refuse_queued(inputs, listener, name).await,
                Err(e) => {
                    inputs.metrics.connection_refused("accept_error");
                    accept_backoff(name, e).await
                }
            },
        }
    }
}
