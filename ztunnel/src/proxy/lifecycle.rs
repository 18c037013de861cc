//! A pod's life in the proxy: enrollment (its workload, certificate, listeners, then
//! capture) and removal (capture first, a grace for connections already steered, then
//! the listeners, then the rest of capture once its connections are done).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use tokio::task::JoinSet;

use super::inputs::ProxyInputs;
use super::pod::{recheck_on_change, LocalPod};
use crate::capture::CaptureError;
use crate::identity::manager::IdentityCert;
use crate::netns::{InPodNetns, NetnsError};
use crate::ports;
use crate::state::{PodIps, Workload, WorkloadUid};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("workload {0} is not in the mesh config (waited {1:?} for it); add it to the config, or check that istiod knows the pod")]
    UnknownWorkload(WorkloadUid, std::time::Duration),
    #[error("workload {uid} runs on node {node:?}, not on this node {ours:?}; a node proxy only serves its own node's pods")]
    WrongNode {
        uid: WorkloadUid,
        node: String,
        ours: String,
    },
    #[error("workload {0} has no IP address this proxy serves (IPv6 ones only with IPV6_ENABLED, Istio's default); give the pod an address, or set IPV6_ENABLED=true")]
    NoAddress(WorkloadUid),
    #[error("cannot bind listener {addr} in pod {pod}: {source}")]
    Bind {
        pod: String,
        addr: SocketAddr,
        source: NetnsError,
    },
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

/// An enrolled pod: its listeners run until this is dropped (or `remove` is called).
pub struct EnrolledPod {
    pub pod: LocalPod,
    tasks: JoinSet<()>,
    inputs: Arc<ProxyInputs>,
    /// Counts this proxy in `workload_manager_*` while it lives.
    _active: crate::metrics::meta::ActiveProxy,
    /// Lists it in the admin dump's `workloadState` while it lives.
    _listed: super::states::UpGuard,
}

impl EnrolledPod {
    /// Stops the listeners and removes capture from the pod.
    pub async fn remove(mut self) -> Result<(), ProxyError> {
        // Steering goes first: no new connection reaches listeners about to close. Those
        // steered just before (handshake under way, or queued for accept) are still
        // accepted and served during a short grace instead of dying with the listener.
        let stopped = self
            .inputs
            .capture
            .stop_steering(&self.pod.netns, self.pod.ips)
            .await;
        tokio::time::sleep(REMOVAL_GRACE).await;
        self.tasks.shutdown().await;
        // Deliveries in flight need the local reply route until they end.
        if !self.pod.active.wait_idle(REMOVAL_DRAIN).await {
            tracing::warn!(uid = %self.pod.workload.uid, active = self.pod.active.active(), "pod removed with connections still open; they will break");
        }
        let finished = self
            .inputs
            .capture
            .finish_removal(&self.pod.netns, self.pod.ips)
            .await;
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
        if let Some(w) = inputs
            .state
            .load()
            .workload_for_pod(uid, pod, &inputs.cfg.node_name)
        {
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
    let _pending = inputs.workload_states.pending(uid, Default::default());
    let wl = await_workload(&inputs, uid, None, wait).await?;
    enroll_workload(inputs, wl, netns).await
}

/// Enrolls the pod of a known workload: certificate, listeners, then capture.
pub async fn enroll_workload(
    inputs: Arc<ProxyInputs>,
    wl: Arc<Workload>,
    netns: InPodNetns,
) -> Result<EnrolledPod, ProxyError> {
    let uid = &wl.uid.clone();
    if wl.node != inputs.cfg.node_name {
        return Err(ProxyError::WrongNode {
            uid: uid.clone(),
            node: wl.node.clone(),
            ours: inputs.cfg.node_name.clone(),
        });
    }
    // As Istio: IPv6 may be on in general but off in the pod (its loopback has none,
    // so no [::1] listener); then its IPv6 is not served, which fails closed.
    let ipv6 = inputs.cfg.ipv6_enabled
        && {
            let on = netns.run(crate::netns::ipv6_on_loopback).unwrap_or(false);
            if !on && wl.workload_ips.iter().any(|ip| ip.is_ipv6()) {
                tracing::warn!(uid = %uid, netns = netns.name(), "IPv6 is off on the pod's loopback: its IPv6 address is not served (its IPv6 traffic is refused)");
            }
            on
        };
    let ips =
        PodIps::of(&wl.workload_ips, ipv6).ok_or_else(|| ProxyError::NoAddress(uid.clone()))?;
    let identity = wl.identity();
    inputs.certs.allow(&identity);
    let pod = LocalPod {
        workload: wl,
        identity: identity.clone(),
        ips,
        netns: netns.clone(),
        active: Default::default(),
        inbound: Default::default(),
        outbound: Default::default(),
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
        pod.netns
            .listen(addr, false)
            .map_err(|source| ProxyError::Bind {
                pod: pod.netns.name().to_string(),
                addr,
                source,
            })
    };
    // One listener per family (an IPv6 one takes IPv6 only), IPv4 always: loopback has it
    // even in an IPv6-only pod, and v4-mapped connects from dual-stack sockets land there.
    // IPv6 ones for a pod with an IPv6 address this proxy serves.
    let families: Vec<IpAddr> = std::iter::once(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        .chain(pod.ips.v6.map(|_| IpAddr::V6(Ipv6Addr::UNSPECIFIED)))
        .collect();
    let loopback = |any: &IpAddr| {
        if any.is_ipv4() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            IpAddr::V6(Ipv6Addr::LOCALHOST)
        }
    };
    // Outbound is only reached through REDIRECT or eBPF's connect hooks, which target loopback.
    let outbound = families
        .iter()
        .map(|any| bind(SocketAddr::new(loopback(any), ports::OUTBOUND)))
        .collect::<Result<Vec<_>, _>>()?;
    // Inbound listeners are transparent so that TPROXY rules (istio-cni's in-pod capture,
    // with `--capture none`) can deliver to them; REDIRECT and sk_lookup don't mind.
    let bind_transparent = |addr: SocketAddr| {
        pod.netns
            .listen(addr, true)
            .map_err(|source| ProxyError::Bind {
                pod: pod.netns.name().to_string(),
                addr,
                source,
            })
    };
    let hbone = families
        .iter()
        .map(|any| bind_transparent(SocketAddr::new(*any, ports::HBONE)))
        .collect::<Result<Vec<_>, _>>()?;
    let plaintext = families
        .iter()
        .map(|any| bind_transparent(SocketAddr::new(*any, ports::INBOUND_PLAINTEXT)))
        .collect::<Result<Vec<_>, _>>()?;
    let dns = match &inputs.dns {
        Some(d) => Some((
            d.clone(),
            crate::dns::server::bind(&pod.netns, pod.ips.v6.is_some())?,
        )),
        None => None,
    };
    let tls = Arc::new(crate::tls::server_config_with_crls(
        IdentityCert {
            certs: inputs.certs.clone(),
            identity: pod.identity.clone(),
        },
        &inputs
            .certs
            .current(&pod.identity)
            .map(|c| c.cert.roots.clone())
            .unwrap_or_default(),
        &pod.identity.trust_domain,
        inputs.crls.as_ref(),
    )?);
    // When a listener of a SO_REUSEPORT group closes (an old proxy handing over), move
    // its queued connections to the remaining listener instead of resetting them.
    let migrate = match pod
        .netns
        .run(|| std::fs::write("/proc/sys/net/ipv4/tcp_migrate_req", "1"))
    {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = migrate {
        tracing::warn!(error = %e, "cannot enable tcp_migrate_req; connections queued during a proxy hand-off may be reset");
    }
    // Listeners exist (and queue connections) before capture steers anything to them.
    // On failure capture is left as it is (fail closed): the pod may have been captured
    // before this proxy started, and a retried Add or a Del settles it.
    // Each pod address with the 15006 listener of its family.
    let steered: Vec<(IpAddr, &tokio::net::TcpListener)> = pod
        .ips
        .iter()
        .filter_map(|ip| {
            Some((
                ip,
                families
                    .iter()
                    .zip(&plaintext)
                    .find(|(any, _)| any.is_ipv6() == ip.is_ipv6())?
                    .1,
            ))
        })
        .collect();
    inputs.capture.install(&pod.netns, &steered).await?;
    let mut tasks = JoinSet::new();
    for l in outbound {
        tasks.spawn(super::outbound::serve(inputs.clone(), pod.clone(), l));
    }
    for l in hbone {
        tasks.spawn(super::inbound::serve(
            inputs.clone(),
            pod.clone(),
            l,
            tls.clone(),
        ));
    }
    for l in plaintext {
        tasks.spawn(super::inbound_passthrough::serve(
            inputs.clone(),
            pod.clone(),
            l,
        ));
    }
    tasks.spawn(recheck_on_change(inputs.state.clone(), pod.clone()));
    if let Some((dns, listeners)) = dns {
        tasks.spawn(crate::dns::server::serve(
            dns,
            pod.clone(),
            listeners,
            inputs.drain.clone(),
        ));
    }
    tracing::info!(uid = %pod.workload.uid, identity = %pod.identity, ip = %pod.ips, netns = pod.netns.name(), "pod enrolled");
    if pod.workload.network != inputs.cfg.network {
        tracing::warn!(uid = %pod.workload.uid, workload.network = %pod.workload.network, node.network = %inputs.cfg.network,
            "the pod's workload is in another network than this node (NETWORK): addresses are looked up in the node's; set NETWORK to the network of the node's pods");
    }
    let _active = inputs.metrics.workload_manager.started();
    let _listed = inputs.workload_states.up(&pod);
    Ok(EnrolledPod {
        pod,
        tasks,
        inputs,
        _active,
        _listed,
    })
}
