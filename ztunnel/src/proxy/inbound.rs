//! Inbound HBONE (15008): mTLS, then one CONNECT stream per tunnelled connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::inputs::ProxyInputs;
use super::limits::track;
use super::pod::{InboundView, LocalPod};
use crate::access_log::{ConnectionLog, Side};
use crate::hbone::{self, respond_status as respond, HboneAddress};
use crate::identity::Identity;
use crate::listen::accept_until_drain;
use crate::metrics::{Peer, TcpLabels};
use crate::netns::reset;
use crate::ports;
use crate::rbac::Decision;
use crate::relay::{copy_tcp_h2, CopyError};
use crate::state::Protocol;

pub async fn serve(
    inputs: Arc<ProxyInputs>,
    pod: LocalPod,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
) {
    // Shared by the connections and their streams (see outbound::serve).
    let pod = Arc::new(pod);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    while let Some((stream, peer)) =
        accept_until_drain(&inputs.drain, &inputs.metrics, &listener, "inbound").await
    {
        // Before a task exists for it: a flood over the limit costs one reset each.
        let Some((stream, permit)) = inputs.hbone_server.admit(stream, peer) else {
            continue;
        };
        let span = tracing::info_span!("inbound", peer = %peer, pod = %pod.workload.name, src.identity = tracing::field::Empty);
        tokio::spawn(
            handle_connection(
                inputs.clone(),
                pod.clone(),
                stream,
                permit,
                peer,
                acceptor.clone(),
            )
            .instrument(span),
        );
    }
}

async fn handle_connection(
    inputs: Arc<ProxyInputs>,
    pod: Arc<LocalPod>,
    stream: TcpStream,
    permit: hbone::server::HandshakePermit,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    let _active = inputs.drain.track();
    let _socket = inputs.metrics.socket_open("destination");
    let _ = stream.set_nodelay(true);
    let local = match stream.local_addr() {
        Ok(l) => l,
        Err(_) => return,
    };
    let server = &inputs.hbone_server;
    // Taken before the handshake: a CRL reload during it is checked against this peer too.
    let changes = inputs.crls.as_ref().map(|c| c.changes());
    let Some((conn, src_identity, chain)) = server
        .handshake_with(&acceptor, stream, permit, changes.is_some())
        .await
    else {
        return;
    };
    // Shared by the connection's streams: each would otherwise hold its own copy (three strings).
    let src_identity = Arc::new(src_identity);
    // On the connection's span, not each stream's: formatted once per connection, where
    // every stream's span would keep its own copy of the text for the tunnel's life.
    tracing::Span::current().record("src.identity", tracing::field::display(&*src_identity));
    let origin = Arc::new(Origin {
        peer,
        local,
        identity: src_identity.clone(),
    });
    let roots = || {
        inputs
            .certs
            .current(&pod.identity)
            .map(|c| c.cert.roots.clone())
            .unwrap_or_default()
    };
    let revoked = crate::tls::client_revoked(
        inputs.crls.as_ref(),
        changes,
        roots,
        &chain,
        inputs.metrics.clone(),
    );
    server
        .serve_with(
            conn,
            &inputs.drain,
            &src_identity,
            revoked,
            |req, respond| {
                // The CONNECT's trace (a new one without): its id names this stream's lines, as
                // the client side's name the connection (Istio's).
                let trace = hbone::TraceParent::of_request(&req);
                let span = tracing::info_span!("stream", id = %trace.trace_id());
                // What the stream needs of the request head is read here, so the head (a few
                // hundred bytes) is not kept in the stream's task for its life.
                let (head, body) = req.into_parts();
                let head = Request::from_parts(head, ());
                let connect = Connect {
                    target: hbone::connect_authority(&head),
                    claimed_service: hbone::request::forwarded_host(&head),
                    origin_network: hbone::request::forwarded_network(&head),
                    headers: head.into_parts().0.headers,
                    body,
                };
                tokio::spawn(
                    handle_stream(
                        inputs.clone(),
                        pod.clone(),
                        Box::new((connect, respond)),
                        origin.clone(),
                    )
                    .instrument(span),
                );
            },
        )
        .await;
}

/// Where a connection's streams come from, shared by them (inline, the two addresses
/// would take 64 bytes of every stream's task).
struct Origin {
    peer: SocketAddr,
    /// The address the client reached (this pod's).
    local: SocketAddr,
    identity: Arc<Identity>,
}

/// One CONNECT stream as the stream's task sees it.
struct Connect {
    target: Result<HboneAddress, hbone::BadConnect>,
    /// The service the client side named (`forwarded: ...;host=`).
    claimed_service: Option<String>,
    /// The client's network, when it says (`x-forwarded-network`, double HBONE).
    origin_network: Option<String>,
    /// The rest of the request's headers (its `baggage`), until the tunnel opens.
    headers: http::HeaderMap,
    body: h2::RecvStream,
}

/// One CONNECT stream, for its whole life. An async block, not an `async fn`: an async
/// fn's future keeps its arguments twice (as given and moved into the body), and the
/// request and its response handle boxed: they are needed only until the tunnel opens.
/// (Each 128 bytes the future sheds is a size class of tokio's task cell, per tunnel:
/// `stream_and_connection_tasks_stay_small`.)
#[allow(clippy::manual_async_fn)]
fn handle_stream(
    inputs: Arc<ProxyInputs>,
    pod: Arc<LocalPod>,
    request: Box<(Connect, SendResponse<Bytes>)>,
    origin: Arc<Origin>,
) -> impl std::future::Future<Output = ()> {
    async move {
        let Some(_active) = track(&inputs, &pod) else {
            return respond(request.1, StatusCode::SERVICE_UNAVAILABLE);
        };
        let start = Instant::now();
        // Boxed: the checks, the policy decision and the connect to the app need their locals
        // only until the tunnel opens; inline, every open tunnel's task would keep room for them.
        // Destructured from the temporary: a named `Tunnel` would keep its room beside its fields.
        let Some(Tunnel {
            mut upstream,
            send,
            recv,
            registration,
            conn,
            target,
            src_wl,
            src_baggage,
            service,
        }) = Box::pin(open_tunnel(
            &inputs,
            &pod,
            request,
            origin.peer,
            origin.local,
            &origin.identity,
        ))
        .await
        else {
            return;
        };
        let r = copy_tcp_h2(
            &mut upstream,
            send,
            recv,
            registration.revocation.revoked(),
            inputs.cfg.idle_timeout,
        )
        .await;
        let t = match &r {
            Ok(t) | Err((_, t)) => *t,
        };
        // From the app's side: t.received went to the app (the client sent it), t.sent came back.
        conn.closed(t.received, t.sent);
        let (t, err) = match r {
            Ok(t) => (t, None),
            Err((CopyError::Stream(e), t)) => {
                reset(upstream);
                (t, Some(format!("tunnel reset: {e}")))
            }
            Err((e @ (CopyError::Revoked | CopyError::Idle), t)) => {
                reset(upstream);
                (t, Some(e.to_string()))
            }
            Err((e, t)) => (t, Some(e.to_string())),
        };
        let state = inputs.state.load();
        ConnectionLog {
            direction: "inbound",
            protocol: "HBONE",
            src_addr: origin.peer,
            src: Side {
                workload: src_wl.as_deref(),
                identity: Some(&*origin.identity),
                baggage: src_baggage.as_deref(),
            },
            dst_addr: origin.local,
            dst_hbone_addr: Some(target),
            dst_service: service.as_deref(),
            dst: Side {
                workload: Some(pod.workload_in(&state)),
                identity: Some(&pod.identity),
                baggage: None,
            },
            bytes_sent: t.received,
            bytes_recv: t.sent,
            duration: start.elapsed(),
            error: err,
        }
        .write();
    }
}

/// What an opened inbound tunnel carries into its relay and its log line.
struct Tunnel {
    upstream: TcpStream,
    send: h2::SendStream<Bytes>,
    recv: h2::RecvStream,
    registration: super::pod::InboundGuard,
    conn: crate::metrics::OpenConnection,
    /// For the log line. Inline: the stream's future has room for it within its task
    /// cell's size class, and a box would cost an allocation per stream.
    target: HboneAddress,
    src_wl: Option<Arc<crate::state::Workload>>,
    /// A source config does not describe, as its request baggage does (Istio's derived
    /// source, with ENABLE_RESPONSE_BAGGAGE).
    src_baggage: Option<Box<crate::baggage::Baggage>>,
    service: Option<Arc<crate::state::Service>>,
}

/// Checks a CONNECT stream, authorizes it and connects to the app, answering 200; when
/// the tunnel does not open it has answered the peer itself (400, 401, 503) and yields None.
async fn open_tunnel(
    inputs: &ProxyInputs,
    pod: &LocalPod,
    request: Box<(Connect, SendResponse<Bytes>)>,
    peer: SocketAddr,
    local: SocketAddr,
    src_identity: &Arc<Identity>,
) -> Option<Tunnel> {
    let (
        Connect {
            target,
            claimed_service,
            origin_network,
            headers,
            body: recv,
        },
        tx,
    ) = *request;
    let hbone_target = match target {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "bad HBONE request");
            inputs.metrics.hbone_rejected("bad_request");
            respond(tx, StatusCode::BAD_REQUEST);
            return None;
        }
    };
    let state = inputs.state.load_full();
    let network = inputs.cfg.network.as_str();
    // A CONNECT naming a service (double HBONE: the gateway chose this pod among the
    // service's endpoints) reaches this pod on the port the service maps it to; only a
    // service this pod is an endpoint of.
    let (target, named_service) = match &hbone_target {
        HboneAddress::Addr(a) => (*a, None),
        HboneAddress::Host(host, port) => {
            match state.hostname_target(pod.workload_in(&state), host, *port) {
                Some((svc, target_port)) => {
                    (SocketAddr::new(local.ip(), target_port), Some(svc.clone()))
                }
                None => {
                    tracing::warn!(target = %hbone_target, "CONNECT names no service of this pod on that port");
                    inputs.metrics.hbone_rejected("bad_request");
                    respond(tx, StatusCode::BAD_REQUEST);
                    return None;
                }
            }
        }
    };
    // The tunnel may only reach the pod it arrived at (the L3 destination), never a proxy
    // port. Its target is this pod, or (Istio's sandwich: a waypoint behind ztunnel) a
    // destination whose waypoint this pod is, verified as outbound verifies waypoints;
    // either way the bytes go to this pod's app, on the target's port.
    let to_waypoint = target.ip() != local.ip();
    if !pod.ips.contains(local.ip())
        || ports::is_proxy_port(target.port())
        || (to_waypoint && !state.is_waypoint_of(network, target.ip(), pod.workload_in(&state)))
    {
        tracing::warn!(target = %hbone_target, l3_dst = %local.ip(), "CONNECT target is neither this pod nor a destination it is the waypoint of");
        inputs.metrics.hbone_rejected("bad_request");
        respond(tx, StatusCode::BAD_REQUEST);
        return None;
    }
    // From another network (its client's network named, not ours): through that
    // network's east-west gateway, so the source address is the gateway's, and the
    // client is known by its identity (the inner TLS, end to end) alone.
    let from_gateway = origin_network
        .as_deref()
        .is_some_and(|n| !n.eq_ignore_ascii_case(network));
    // Delivered to the address the tunnel arrived at (as Istio), so the client's address
    // is always of the app address's family.
    let app_addr = SocketAddr::new(local.ip(), target.port());
    // The app sees the peer's address as the source (and ipBlocks policies match on it):
    // an address the mesh knows as another workload's must come with that workload's
    // identity, else one identity could act as another workload's IP.
    // A gateway forwards for others: its address comes with their identities.
    let forwarder = |w: &crate::state::Workload| from_gateway && state.is_network_gateway(w);
    if let Some(owner) = state
        .workload_by_ip(network, peer.ip())
        .filter(|w| w.identity() != **src_identity && !forwarder(w))
    {
        tracing::warn!(src.addr = %peer, src.identity = %src_identity, ip_owner = %owner.identity(),
            "HBONE peer's source address belongs to another workload's identity");
        inputs.metrics.hbone_rejected("source_mismatch");
        respond(tx, StatusCode::UNAUTHORIZED);
        return None;
    }
    let workload = pod.workload_in(&state);
    // Describe the source from config only if config agrees with its verified identity
    // (through a gateway the address is the gateway's: the source is not looked up).
    let src_wl = state
        .workload_by_ip(network, peer.ip())
        .filter(|w| !from_gateway && w.identity() == **src_identity)
        .cloned();
    let service = named_service.or_else(|| {
        state
            .inbound_service(workload, claimed_service.as_deref(), target.port())
            .cloned()
    });
    let mut labels = TcpLabels::new(
        "destination",
        Peer {
            workload: src_wl.as_deref(),
            identity: Some(&**src_identity),
        },
        Peer {
            workload: Some(workload),
            identity: Some(&pod.identity),
        },
        service.as_deref(),
        true,
    );
    // A source config does not describe (behind a gateway, or an address it does not
    // know) is labelled by what its request baggage says, as Istio's ztunnel does with
    // ENABLE_RESPONSE_BAGGAGE; its principal stays the verified identity. Malformed
    // baggage is ignored (`unknown`), never the tunnel.
    let src_baggage = match (&src_wl, inputs.cfg.response_baggage) {
        (None, true) => crate::baggage::Baggage::of(&headers)
            .inspect_err(|e| tracing::debug!(error = %e, "ignoring the request's baggage"))
            .ok()
            .map(Box::new),
        _ => None,
    };
    drop(headers);
    if let Some(b) = &src_baggage {
        labels.with_derived_source(b);
    }
    // Registered before the decision, so a policy change in between is not missed.
    // Authorized on the inputs the registration re-checks: the peer's identity and address,
    // and the app address (the pod's, on the target's port).
    let view = InboundView {
        src: peer,
        service: service.as_ref().map(|s| s.hostname.clone()),
        dst: target,
        protocol: Protocol::HBONE,
    };
    let (registration, conn) =
        pod.inbound
            .register(view, Some(src_identity.clone()), app_addr.ip());
    let decision = state.authorize(workload, &conn);
    let app_tunnel = crate::state::ApplicationTunnel::effective(workload.application_tunnel);
    // The 200, made while the state is at hand: with Istio's response baggage about this
    // pod's workload, which the client's proxy labels the destination by when it cannot
    // look this pod up itself (behind an east-west gateway).
    let opened = opened_response(workload, inputs.cfg.response_baggage);
    drop(state);
    if let Decision::Deny(reason) = decision {
        tracing::warn!(direction = "inbound", src.addr = %peer, src.identity = %src_identity, dst.addr = %target,
            dst.workload = %pod.workload.name, dst.identity = %pod.identity, response_flags = "DENY",
            error = %reason, "connection denied");
        inputs.metrics.failed(&labels, "DENY");
        respond(tx, StatusCode::UNAUTHORIZED);
        return None;
    }
    // Sandwich mode: the app (typically a waypoint or a proxy in front of it) listens on
    // its tunnel port and learns the client and the target from a PROXY header instead of
    // from TLS; with LOCALHOST_APP_TUNNEL (Istio's default) on loopback.
    let (deliver_to, from) = delivery(app_addr, app_tunnel, inputs.cfg.localhost_app_tunnel, peer);
    if deliver_to.ip().is_loopback() && deliver_to.port() == ports::DNS {
        tracing::warn!(dst.addr = %deliver_to, "the application tunnel port is the DNS proxy's; refused");
        inputs.metrics.failed(&labels, "CONNECT");
        respond(tx, StatusCode::SERVICE_UNAVAILABLE);
        return None;
    }
    let mut upstream = match pod
        .netns
        .connect(deliver_to, from, inputs.cfg.connect_timeout)
        .await
    {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(dst.addr = %deliver_to, error = %e, response_flags = "CONNECT", "cannot reach the application");
            inputs.metrics.failed(&labels, "CONNECT");
            respond(tx, StatusCode::SERVICE_UNAVAILABLE);
            return None;
        }
    };
    if app_tunnel.is_some() {
        // The destination as the client named it: for a service hostname (PROXY has no
        // room for a name) its VIP in our network, IPv4 first, as Istio's ztunnel does.
        let named = match &hbone_target {
            HboneAddress::Host(_, port) => service.as_ref().and_then(|s| {
                let ours = s.vips.iter().filter(|v| v.network == network);
                ours.max_by_key(|v| v.address.is_ipv4())
                    .map(|v| SocketAddr::new(v.address, *port))
            }),
            HboneAddress::Addr(a) => Some(*a),
        };
        let Some(named) = named else {
            tracing::warn!(target = %hbone_target, response_flags = "CONNECT", "the service has no VIP in this network to name in the PROXY header");
            inputs.metrics.failed(&labels, "CONNECT");
            reset(upstream);
            respond(tx, StatusCode::SERVICE_UNAVAILABLE);
            return None;
        };
        if let Err(e) = write_proxy_header(&mut upstream, peer, named, Some(&**src_identity)).await
        {
            tracing::warn!(dst.addr = %deliver_to, error = %e, response_flags = "CONNECT", "cannot send the PROXY protocol header to the application");
            inputs.metrics.failed(&labels, "CONNECT");
            reset(upstream);
            respond(tx, StatusCode::SERVICE_UNAVAILABLE);
            return None;
        }
    }
    let mut tx = tx;
    let send = match tx.send_response(opened, false) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "client went away before the tunnel opened");
            return None;
        }
    };
    let conn = inputs.metrics.opened(&labels);
    Some(Tunnel {
        upstream,
        send,
        recv,
        registration,
        conn,
        target: hbone_target,
        src_wl,
        src_baggage,
        service,
    })
}

/// The 200 that opens a tunnel to `workload` (this pod), as Istio's `build_response`:
/// with `baggage` (ENABLE_RESPONSE_BAGGAGE) a `baggage` header describing the workload.
/// Refusals (400, 401, 503) never carry one, as in Istio. A value that cannot be a
/// header (control characters in config) is left out rather than failing the tunnel.
fn opened_response(workload: &crate::state::Workload, baggage: bool) -> Response<()> {
    let mut r = Response::new(());
    if baggage {
        match http::HeaderValue::try_from(workload.baggage_header()) {
            Ok(v) => {
                r.headers_mut().insert(crate::baggage::HEADER, v);
            }
            Err(_) => {
                tracing::debug!(workload = %workload.uid, "the workload's baggage is not a valid header value; not sent")
            }
        }
    }
    r
}

/// Where an inbound connection for the app at `app` is delivered, and from which source
/// (None: the proxy's own address). Without an application tunnel: `app`, from the
/// client's address. With a PROXY tunnel: its port, from the client's address, or with
/// `localhost` (Istio's LOCALHOST_APP_TUNNEL) on loopback from loopback, so the app's
/// tunnel port can listen on loopback only and nothing reaches it around ztunnel; the
/// client is in the PROXY header either way.
fn delivery(
    app: SocketAddr,
    tunnel: Option<crate::state::ApplicationTunnel>,
    localhost: bool,
    client: SocketAddr,
) -> (SocketAddr, Option<SocketAddr>) {
    match tunnel {
        None => (app, Some(client)),
        Some(t) if localhost => {
            let lo: std::net::IpAddr = if app.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            };
            (SocketAddr::new(lo, t.port_for(app.port())), None)
        }
        Some(t) => (
            SocketAddr::new(app.ip(), t.port_for(app.port())),
            Some(client),
        ),
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum AppTunnelError {
    #[error(transparent)]
    Encode(#[from] crate::proxy_protocol::ProxyProtocolError),
    #[error("write failed: {0}")]
    Write(#[from] std::io::Error),
}

/// Istio's PROXY v2 header for an app tunnel: the client as source, the target as
/// destination, the peer's verified SPIFFE id in TLV 0xD0 (none for a plaintext client:
/// the app then sees a header without an identity, never one the client wrote).
pub(super) async fn write_proxy_header(
    upstream: &mut TcpStream,
    src: SocketAddr,
    dst: SocketAddr,
    id: Option<&Identity>,
) -> Result<(), AppTunnelError> {
    use tokio::io::AsyncWriteExt;
    let (src, dst) = crate::proxy_protocol::same_family(src, dst);
    let id = id.map(|i| i.to_string());
    let tlvs: Vec<(u8, &[u8])> = id
        .iter()
        .map(|i| (crate::proxy_protocol::TLV_PEER_IDENTITY, i.as_bytes()))
        .collect();
    let header = crate::proxy_protocol::encode(src, dst, &tlvs)?;
    upstream.write_all(&header).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_connection_tasks_stay_small() {
        use crate::task_size::Returns;
        // What every inbound tunnel (stream) and every HBONE connection holds while open
        // (736 and 7248 bytes in the test build: at most 752 keeps the stream's task cell at
        // 896 bytes, with the CONNECT target for the log line inline, not boxed; 880 before
        // its revocation became a flag and a waker instead of a
        // `Notify` waiter and its origin (addresses, identity) one `Arc` shared by the
        // connection's streams; 1312 before it became an async block with its
        // request boxed and its tunnel destructured from a temporary,
        // 1512 before its set-up moved into the boxed `open_tunnel`; the connection's
        // includes its HTTP/2 state, shared by up to 200 streams).
        let (stream, conn) = (
            handle_stream.returned_size(),
            handle_connection.returned_size(),
        );
        println!("inbound handle_stream future: {stream} bytes, handle_connection: {conn} bytes");
        assert!(
            stream <= 752,
            "inbound stream future grew to {stream} bytes: box the set-up step that grew it"
        );
        assert!(
            conn <= 8000,
            "inbound connection future grew to {conn} bytes"
        );
    }
    use crate::state::{ApplicationTunnel, ApplicationTunnelProtocol};

    #[test]
    fn the_200_carries_the_workloads_baggage_unless_turned_off() {
        let mut w = crate::state::Workload::new("u", "echo-1", "default");
        w.cluster_id = "Kubernetes".into();
        w.workload_name = "echo".into();
        w.workload_type = "deployment".into();
        w.canonical_name = "echo".into();
        w.canonical_revision = "v1".into();
        let r = opened_response(&w, true);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(
            r.headers().get("baggage").and_then(|v| v.to_str().ok()),
            Some("k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=echo,service.name=echo,service.version=v1")
        );
        assert_eq!(
            crate::baggage::Baggage::of(r.headers()),
            Ok(w.baggage()),
            "the client side reads back the workload"
        );
        // ENABLE_RESPONSE_BAGGAGE=false: a bare 200, as Istio's.
        assert!(opened_response(&w, false).headers().is_empty());
        // A value config should never hold does not fail the tunnel: no header.
        w.namespace = "bad\nns".into();
        assert!(opened_response(&w, true).headers().get("baggage").is_none());
    }

    #[test]
    fn deliveries_with_and_without_an_application_tunnel() {
        let (app, client): (SocketAddr, SocketAddr) = (
            "10.0.0.2:8080".parse().unwrap(),
            "10.0.0.1:40000".parse().unwrap(),
        );
        let proxy = |port| {
            Some(ApplicationTunnel {
                protocol: ApplicationTunnelProtocol::PROXY,
                port,
            })
        };
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        // No tunnel: the target port, from the client (LOCALHOST_APP_TUNNEL is for tunnels only).
        assert_eq!(delivery(app, None, true, client), (app, Some(client)));
        // PROXY: the tunnel port (or the target's), on loopback from loopback by default ...
        assert_eq!(
            delivery(app, proxy(Some(15088)), true, client),
            (at("127.0.0.1:15088"), None)
        );
        assert_eq!(
            delivery(app, proxy(None), true, client),
            (at("127.0.0.1:8080"), None)
        );
        // ... or on the pod's address from the client's with LOCALHOST_APP_TUNNEL=false.
        assert_eq!(
            delivery(app, proxy(Some(15088)), false, client),
            (at("10.0.0.2:15088"), Some(client))
        );
    }
}
