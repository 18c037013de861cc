//! One enrolled pod as its listeners see it (`LocalPod`), and its open connections:
//! inbound ones are re-checked against policy whenever the mesh state changes; both
//! are listed in the admin dump.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::identity::Identity;
use crate::netns::InPodNetns;
use crate::state::{MeshState, PodIps, Protocol, SharedState, Workload};

/// The local workload a listener serves.
#[derive(Clone)]
pub struct LocalPod {
    pub workload: Arc<Workload>,
    pub identity: Identity,
    /// The addresses this proxy serves (and capture steers) for the pod.
    pub ips: PodIps,
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
        state
            .workload_by_uid(&self.workload.uid)
            .unwrap_or(&self.workload)
    }
}

/// One open inbound connection as the admin dump shows it (Istio's `workloadState`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboundView {
    pub src: SocketAddr,
    /// The service the connection was meant for, when known.
    pub service: Option<String>,
    pub dst: SocketAddr,
    /// HBONE or TCP (plaintext).
    pub protocol: Protocol,
}

/// Open connections of one kind, by registration order; each stays listed while its
/// guard lives. Entries are boxed: a B-tree node has room for 11 of them and is often
/// half full, and every open connection pays for its entry's share of that room.
pub struct Registry<T> {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::BTreeMap<u64, Box<T>>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            next: Default::default(),
            open: Default::default(),
        }
    }
}

/// Keeps one connection listed; dropping it unlists it.
pub struct Listed<T> {
    registry: Arc<Registry<T>>,
    id: u64,
}

impl<T> Drop for Listed<T> {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

impl<T> Registry<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Box<T>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(self: &Arc<Self>, entry: T) -> Listed<T> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(id, Box::new(entry));
        Listed {
            registry: self.clone(),
            id,
        }
    }
}

/// What the policy re-check needs of an open inbound connection, with its admin view: the
/// rbac inputs are the view's source, its destination port on `app_ip`, and the peer's
/// identity (one entry per open connection: nothing kept twice).
pub struct OpenInbound {
    view: InboundView,
    src_identity: Option<Arc<Identity>>,
    /// The address the connection is delivered to (the pod's; the view's destination is
    /// the CONNECT's target, another address when this pod is its waypoint).
    app_ip: std::net::IpAddr,
    revocation: Arc<Revocation>,
}

impl OpenInbound {
    fn connection(&self) -> crate::rbac::Connection {
        crate::rbac::Connection {
            src_identity: self.src_identity.clone(),
            src_ip: self.view.src.ip(),
            dst: SocketAddr::new(self.app_ip, self.view.dst.port()),
        }
    }
}

/// Set when policy no longer allows an open connection; its relay waits for it. A flag
/// and one waker, not a `tokio::sync::Notify`: the relay's future keeps the wait for the
/// connection's life, and `Notify`'s waiter is 128 bytes of every inbound tunnel's task.
#[derive(Default)]
pub struct Revocation {
    revoked: std::sync::atomic::AtomicBool,
    waker: futures_util::task::AtomicWaker,
}

impl Revocation {
    fn revoke(&self) {
        self.revoked
            .store(true, std::sync::atomic::Ordering::Release);
        self.waker.wake();
    }

    /// Resolves once revoked, also when that happened before the first poll.
    pub fn revoked(&self) -> impl std::future::Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            let done = || self.revoked.load(std::sync::atomic::Ordering::Acquire);
            if done() {
                return std::task::Poll::Ready(());
            }
            self.waker.register(cx.waker());
            // Checked again: a revocation between the first check and the register woke no one.
            if done() {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
    }
}

/// Open inbound connections of one pod and what authorized them. When the mesh state
/// changes (a policy pushed by istiod), each is authorized again and closed if the new
/// policy denies it, as Istio's ztunnel does.
pub type InboundConns = Registry<OpenInbound>;

/// A registered inbound connection; dropping it unregisters.
pub struct InboundGuard {
    _listed: Listed<OpenInbound>,
    /// Set when policy no longer allows the connection.
    pub revocation: Arc<Revocation>,
}

impl Registry<OpenInbound> {
    /// Lists an inbound connection from `view.src` (proving `src_identity`, if any) to
    /// the view's destination port on `app_ip`; returns its guard and the rbac inputs
    /// that re-checks authorize, which are the ones to authorize it on now.
    pub fn register(
        self: &Arc<Self>,
        view: InboundView,
        src_identity: Option<Arc<Identity>>,
        app_ip: std::net::IpAddr,
    ) -> (InboundGuard, crate::rbac::Connection) {
        let revocation = Arc::new(Revocation::default());
        let open = OpenInbound {
            view,
            src_identity,
            app_ip,
            revocation: revocation.clone(),
        };
        let conn = open.connection();
        let _listed = self.insert(open);
        (
            InboundGuard {
                _listed,
                revocation,
            },
            conn,
        )
    }

    /// The open connections, oldest first.
    pub fn snapshot(&self) -> Vec<InboundView> {
        self.lock().values().map(|o| o.view.clone()).collect()
    }

    /// Re-authorizes every open connection of `pod` under `state`; returns how many were revoked.
    fn recheck(&self, state: &MeshState, pod: &LocalPod) -> usize {
        let wl = pod.workload_in(state);
        let mut revoked = 0;
        for open in self.lock().values() {
            let conn = &open.connection();
            if let crate::rbac::Decision::Deny(reason) = state.authorize(wl, conn) {
                tracing::warn!(src.addr = %conn.src_ip, dst.addr = %conn.dst,
                    src.identity = conn.src_identity.as_ref().map(|i| i.to_string()),
                    error = %reason, "closing an open connection: policy now denies it");
                // A stored flag: the connection sees it even if not waiting yet.
                open.revocation.revoke();
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
    pub protocol: Protocol,
}

/// Open outbound connections of one pod (for the admin dump only).
pub type OutboundConns = Registry<OutboundView>;

impl Registry<OutboundView> {
    pub fn register(self: &Arc<Self>, view: OutboundView) -> Listed<OutboundView> {
        self.insert(view)
    }

    /// The open connections, oldest first.
    pub fn snapshot(&self) -> Vec<OutboundView> {
        self.lock().values().map(|v| (**v).clone()).collect()
    }
}

/// Re-checks the pod's open inbound connections on every state change that changes the
/// policies in its scope. A decision depends on those alone (`MeshState::authorize`), and
/// an update keeps the very same policy objects it does not replace, so most pushes
/// (addresses, other namespaces' policies) cost a scope lookup per pod, not a check per
/// connection.
pub(crate) async fn recheck_on_change(state: Arc<SharedState>, pod: LocalPod) {
    let mut changes = state.changes();
    changes.mark_unchanged();
    let in_scope = |st: &MeshState| st.policies_for(pod.workload_in(st));
    let mut in_force = in_scope(&state.load());
    while changes.changed().await.is_ok() {
        let state = state.load_full();
        let now = in_scope(&state);
        if now.len() == in_force.len() && now.iter().zip(&in_force).all(|(a, b)| Arc::ptr_eq(a, b))
        {
            continue;
        }
        in_force = now;
        let n = pod.inbound.recheck(&state, &pod);
        if n > 0 {
            tracing::info!(pod = %pod.workload.name, revoked = n, "policy change closed open connections");
        }
    }
}

/// Whether an original destination points back at this pod's proxy listeners.
pub(crate) fn is_self_call(pod: &LocalPod, dst: SocketAddr) -> bool {
    crate::ports::is_proxy_port(dst.port())
        && (pod.ips.contains(dst.ip()) || dst.ip().is_loopback() || dst.ip().is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_revocation_is_seen_before_and_while_waiting() {
        // Before the wait starts: stored, so the relay that polls later still ends.
        let early = Revocation::default();
        early.revoke();
        tokio::time::timeout(std::time::Duration::from_secs(5), early.revoked())
            .await
            .expect("stored revocation");

        // While waiting: the waker is woken.
        let late = Arc::new(Revocation::default());
        let waiter = tokio::spawn({
            let late = late.clone();
            async move { late.revoked().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        late.revoke();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .expect("task");
    }
}
