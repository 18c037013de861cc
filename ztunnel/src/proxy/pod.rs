//! One enrolled pod as its listeners see it (`LocalPod`), and its open connections:
//! inbound ones are re-checked against policy whenever the mesh state changes; both
//! are listed in the admin dump.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use crate::identity::Identity;
use crate::netns::InPodNetns;
use crate::state::{MeshState, SharedState, Workload};

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
    /// Its open outbound connections.
    pub outbound: Arc<OutboundConns>,
}

impl LocalPod {
    /// The pod's workload as the current state has it (policies and labels may have
    /// changed since enrollment); the enrolled one if the state no longer lists it.
    pub fn workload_in<'a>(&'a self, state: &'a MeshState) -> &'a Arc<Workload> {
        state.workload_by_uid(&self.workload.uid).unwrap_or(&self.workload)
    }
}

/// One open inbound connection as the admin dump shows it (Istio's `workloadState`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboundView {
    pub src: SocketAddr,
    /// The service the connection was meant for, when known.
    pub service: Option<String>,
    pub dst: SocketAddr,
    /// `HBONE` or `TCP` (plaintext).
    pub protocol: &'static str,
}

struct OpenInbound {
    conn: crate::rbac::Connection,
    view: InboundView,
    revoked: Arc<tokio::sync::Notify>,
}

/// Open inbound connections of one pod and what authorized them. When the mesh state
/// changes (a policy pushed by istiod), each is authorized again and closed if the new
/// policy denies it, as Istio's ztunnel does.
#[derive(Default)]
pub struct InboundConns {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, OpenInbound>>,
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
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, OpenInbound>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn register(self: &Arc<Self>, conn: crate::rbac::Connection, view: InboundView) -> InboundGuard {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let revoked = Arc::new(tokio::sync::Notify::new());
        self.lock().insert(id, OpenInbound { conn, view, revoked: revoked.clone() });
        InboundGuard { conns: self.clone(), id, revoked }
    }

    /// The open connections, oldest first.
    pub fn snapshot(&self) -> Vec<InboundView> {
        let open = self.lock();
        let mut ids: Vec<&u64> = open.keys().collect();
        ids.sort_unstable();
        ids.into_iter().map(|id| open[id].view.clone()).collect()
    }

    /// Re-authorizes every open connection of `pod` under `state`; returns how many were revoked.
    fn recheck(&self, state: &MeshState, pod: &LocalPod) -> usize {
        let wl = pod.workload_in(state);
        let mut revoked = 0;
        for open in self.lock().values() {
            let conn = &open.conn;
            if let crate::rbac::Decision::Deny(reason) = state.authorize(wl, conn) {
                tracing::warn!(src.addr = %conn.src_ip, dst.addr = %conn.dst,
                    src.identity = conn.src_identity.as_ref().map(|i| i.to_string()),
                    error = %reason, "closing an open connection: policy now denies it");
                // A stored permit: the connection sees it even if not waiting yet.
                open.revoked.notify_one();
                revoked += 1;
            }
        }
        revoked
    }
}

/// One open outbound connection as the admin dump shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboundView {
    pub src: SocketAddr,
    /// Where the app connected to (a service VIP, a pod, an outside address).
    pub original_dst: SocketAddr,
    /// Where the proxy connected to (an HBONE peer's 15008, or the destination itself).
    pub actual_dst: SocketAddr,
    /// `HBONE` or `TCP`.
    pub protocol: &'static str,
}

/// Open outbound connections of one pod (for the admin dump only).
#[derive(Default)]
pub struct OutboundConns {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::BTreeMap<u64, OutboundView>>,
}

/// Keeps one outbound connection listed; dropping it unlists.
pub struct OutboundGuard {
    conns: Arc<OutboundConns>,
    id: u64,
}

impl Drop for OutboundGuard {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

impl OutboundConns {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, OutboundView>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn register(self: &Arc<Self>, view: OutboundView) -> OutboundGuard {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(id, view);
        OutboundGuard { conns: self.clone(), id }
    }

    /// The open connections, oldest first.
    pub fn snapshot(&self) -> Vec<OutboundView> {
        self.lock().values().cloned().collect()
    }
}

/// Re-checks the pod's open inbound connections on every state change.
pub(crate) async fn recheck_on_change(state: Arc<SharedState>, pod: LocalPod) {
    let mut changes = state.changes();
    changes.mark_unchanged();
    while changes.changed().await.is_ok() {
        let state = state.load_full();
        let n = pod.inbound.recheck(&state, &pod);
        if n > 0 {
            tracing::info!(pod = %pod.workload.name, revoked = n, "policy change closed open connections");
        }
    }
}

/// Whether an original destination points back at this pod's proxy listeners.
pub(crate) fn is_self_call(pod: &LocalPod, dst: SocketAddr) -> bool {
    crate::ports::is_proxy_port(dst.port()) && (dst.ip() == pod.ip || dst.ip().is_loopback() || dst.ip().is_unspecified())
}
