//! Inbound plaintext (15006): non-mesh clients reaching a mesh pod. Policy applies
//! with no identity, so a policy that needs a principal denies them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::inbound::write_proxy_header;
use super::inputs::ProxyInputs;
use super::limits::track;
use super::pod::{is_self_call, InboundView, LocalPod};
use crate::access_log::{ConnectionLog, Side};
use crate::listen::accept_until_drain;
use crate::metrics::{Peer, TcpLabels};
use crate::netns::{captured_destination, reset};
use crate::rbac::Decision;
use crate::relay::copy_tcp;
use crate::state::Protocol;

pub async fn serve(inputs: Arc<ProxyInputs>, pod: LocalPod, listener: TcpListener) {
    // Shared by the connections (see outbound::serve).
    let pod = Arc::new(pod);
    while let Some((stream, peer)) = accept_until_drain(
        &inputs.drain,
        &inputs.metrics,
        &listener,
        "inbound plaintext",
    )
    .await
    {
        let span = tracing::info_span!("inbound_plaintext", src = %peer, pod = %pod.workload.name);
        tokio::spawn(handle(inputs.clone(), pod.clone(), stream, peer).instrument(span));
    }
}

async fn handle(
    inputs: Arc<ProxyInputs>,
    pod: Arc<LocalPod>,
    mut stream: TcpStream,
    peer: SocketAddr,
) {
    let _socket = inputs.metrics.socket_open("destination");
    let Some(_active) = track(&inputs, &pod) else {
        return reset(stream);
    };
    let start = Instant::now();
    let Some(dst) = captured_destination(&stream) else {
        return reset(stream);
    };
    if is_self_call(&pod, dst) || !pod.ips.contains(dst.ip()) {
        tracing::warn!(dst = %dst, "refusing plaintext connection not addressed to this pod's application");
        return reset(stream);
    }
    // Our delivery below, from the client's address to `dst`, must not take the client's
    // port while this connection holds that tuple (see `netns::source_port`).
    let _tuple = pod.netns.accepted(peer, dst);
    let state = inputs.state.load_full();
    let workload = pod.workload_in(&state);
    let service = state.inbound_service(workload, None, dst.port()).cloned();
    // Boxed: the label set (~1 KB) is needed only until the connection's counters
    // are fetched; inline it would stay in the connection's future for its life.
    let labels = Box::new(TcpLabels::new(
        "destination",
        Peer {
            workload: state
                .workload_by_ip(&inputs.cfg.network, peer.ip())
                .map(|w| &**w),
            identity: None,
        },
        Peer {
            workload: Some(workload),
            identity: Some(&pod.identity),
        },
        service.as_deref(),
        false,
    ));
    // Authorized on the inputs the registration re-checks (no identity: plaintext).
    let view = InboundView {
        src: peer,
        service: service.as_ref().map(|s| s.hostname.clone()),
        dst,
        protocol: Protocol::TCP,
    };
    let (registration, conn) = pod.inbound.register(view, None, dst.ip());
    let decision = state.authorize(workload, &conn);
    // The registration keeps its own; this one would live in the task till the end.
    drop(conn);
    let tunnel = crate::state::ApplicationTunnel::effective(workload.application_tunnel);
    drop(state);
    if let Decision::Deny(reason) = decision {
        tracing::warn!(direction = "inbound", src.addr = %peer, dst.addr = %dst, dst.workload = %pod.workload.name,
            response_flags = "DENY", error = %reason, "connection denied");
        inputs.metrics.failed(&labels, "DENY");
        return reset(stream);
    }
    let mut upstream = match Box::pin(pod.netns.connect(
        dst,
        Some(peer),
        inputs.cfg.connect_timeout,
    ))
    .await
    {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(dst.addr = %dst, error = %e, response_flags = "CONNECT", "cannot reach the application");
            inputs.metrics.failed(&labels, "CONNECT");
            return reset(stream);
        }
    };
    // A port where the app reads a PROXY header (sandwich mode) gets ours first, without an
    // identity: relayed raw, the client's own bytes would be taken as a header, and a
    // forged TLV 0xD0 as a verified SPIFFE id.
    if tunnel.is_some_and(|t| t.port_for(dst.port()) == dst.port()) {
        if let Err(e) = Box::pin(write_proxy_header(&mut upstream, peer, dst, None)).await {
            tracing::warn!(dst.addr = %dst, error = %e, response_flags = "CONNECT", "cannot send the PROXY protocol header to the application");
            inputs.metrics.failed(&labels, "CONNECT");
            reset(upstream);
            return reset(stream);
        }
    }
    let conn = inputs.metrics.opened(&labels);
    drop(labels);
    let r = copy_tcp(
        conn,
        &mut stream,
        &mut upstream,
        registration.revocation.revoked(),
        inputs.cfg.idle_timeout,
    )
    .await;
    let (t, error) = match r {
        Ok(t) => (t, None),
        Err((e, t)) => (t, Some(e.to_string())),
    };
    let state = inputs.state.load();
    ConnectionLog {
        direction: "inbound",
        protocol: "TCP",
        src_addr: peer,
        src: Side {
            workload: state
                .workload_by_ip(&inputs.cfg.network, peer.ip())
                .map(|w| &**w),
            identity: None,
            baggage: None,
        },
        dst_addr: dst,
        dst_hbone_addr: None,
        dst_service: service.as_deref(),
        dst: Side {
            workload: Some(pod.workload_in(&state)),
            identity: Some(&pod.identity),
            baggage: None,
        },
        bytes_sent: t.sent,
        bytes_recv: t.received,
        duration: start.elapsed(),
        error,
    }
    .write();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_task_stays_small() {
        use crate::task_size::Returns;
        // What every plaintext inbound connection holds while open (904 bytes in the test
        // build; 1920 before the TCP relay became a state machine).
        let size = handle.returned_size();
        println!("inbound passthrough handle future: {size} bytes");
        assert!(
            size <= 968,
            "inbound passthrough future grew to {size} bytes: box the set-up step that grew it"
        );
    }
}
