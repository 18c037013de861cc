//! Outbound (15001): connections captured from the pod's own processes.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::inputs::ProxyInputs;
use super::limits::track;
use super::pod::{is_self_call, LocalPod, OutboundView};
use crate::access_log::{ConnectionLog, Side};
use crate::dns::on_demand::OnDemandResolver;
use crate::hbone::{self, HboneAddress, PoolKey};
use crate::identity::Identity;
use crate::listen::accept_until_drain;
use crate::metrics::{Peer, TcpLabels};
use crate::netns::{captured_destination, reset};
use crate::ports;
use crate::relay::{copy_tcp, copy_tcp_h2, CopyError};
use crate::state::{LoadBalancerMode, MeshState, Protocol, Service, Workload};

pub async fn serve(inputs: Arc<ProxyInputs>, pod: LocalPod, listener: TcpListener) {
    // Shared by the connections: a clone per connection would copy its identity (three
    // strings) into every connection's task.
    let pod = Arc::new(pod);
    while let Some((stream, peer)) =
        accept_until_drain(&inputs.drain, &inputs.metrics, &listener, "outbound").await
    {
        let _ = stream.set_nodelay(true);
        // One trace per connection, as Istio's: its id names the connection's log lines
        // here and, through the CONNECT, at the other end.
        // (`handle` makes it and records the id: as its argument it would take room in
        // the connection's task for the connection's life.)
        let span = tracing::info_span!("outbound", id = tracing::field::Empty, src = %peer, pod = %pod.workload.name);
        tokio::spawn(handle(inputs.clone(), pod.clone(), stream, peer).instrument(span));
    }
}

/// Where a captured connection goes.
enum Route {
    /// A tunnel to `peer` (the destination workload, or the waypoint in front of it):
    /// CONNECT `target` on `hbone_addr`, the peer proving one of `expected`.
    Hbone {
        peer: Arc<Workload>,
        target: SocketAddr,
        hbone_addr: SocketAddr,
        expected: Vec<crate::identity::Identity>,
        service: Option<Arc<Service>>,
    },
    Passthrough(SocketAddr),
    NoHealthyEndpoint(String),
    /// `service`'s endpoint `peer` has a hostname and no IP: its name is resolved
    /// (`resolve`), then the connection goes to the address found on `port`.
    Resolve {
        peer: Arc<Workload>,
        port: u16,
        service: Arc<Service>,
    },
    /// Double HBONE, to an endpoint (or waypoint) of `service` in another network: an
    /// outer CONNECT `target` to that network's east-west `gateway` on `gateway_addr`
    /// (the gateway proving one of `gateway_ids`), and inside that stream a TLS session
    /// of its own to the proxy the gateway picks, which must prove one of `expected`,
    /// with the same CONNECT. `target` is the service's hostname and port: the gateway
    /// and the proxy behind it choose the endpoint, as Istio's east-west gateway does.
    DoubleHbone {
        gateway: Arc<Workload>,
        gateway_addr: SocketAddr,
        gateway_ids: Vec<Identity>,
        target: HboneAddress,
        expected: Vec<Identity>,
        service: Arc<Service>,
    },
}

fn hbone_at(
    state: &MeshState,
    wl: &Arc<Workload>,
    ip: IpAddr,
    port: u16,
    service: Option<&Arc<Service>>,
) -> Route {
    Route::Hbone {
        peer: wl.clone(),
        target: SocketAddr::new(ip, port),
        hbone_addr: SocketAddr::new(ip, ports::HBONE),
        expected: state.expected_identities(wl, service.map(|s| &**s)),
        service: service.cloned(),
    }
}

/// A hostname endpoint, resolved on demand (Istio's semantics: an address of the original
/// destination's family preferred): plaintext to it for a TCP workload, HBONE to it
/// for an HBONE one. A name that does not resolve fails the connection.
async fn resolve(
    resolver: &OnDemandResolver,
    state: &MeshState,
    src_wl: &Workload,
    dst: SocketAddr,
    peer: Arc<Workload>,
    port: u16,
    service: Arc<Service>,
) -> Route {
    match resolver.resolve(src_wl, &peer.hostname, dst.ip()).await {
        Ok(ip) => {
            tracing::debug!(hostname = %peer.hostname, resolved = %ip, workload = %peer.uid, "hostname endpoint resolved");
            match peer.protocol {
                Protocol::HBONE => hbone_at(state, &peer, ip, port, Some(&service)),
                Protocol::TCP => Route::Passthrough(SocketAddr::new(ip, port)),
            }
        }
        Err(e) => Route::NoHealthyEndpoint(format!(
            "{} (endpoint {}: {e})",
            service.namespaced_hostname(),
            peer.hostname
        )),
    }
}

/// To `peer`, `service`'s endpoint or waypoint in another network than `src_wl`'s,
/// through the east-west gateway `peer` names (Istio's double HBONE): the inner tunnel is
/// verified against `expected`. No gateway, a gateway we do not know (nothing to verify
/// it by) or nothing to verify the far side by: refused, never sent around.
fn via_gateway(
    state: &MeshState,
    src_wl: &Workload,
    peer: &Workload,
    service: &Arc<Service>,
    dst: SocketAddr,
    expected: Vec<Identity>,
) -> Route {
    let refuse = |why: String| {
        Route::NoHealthyEndpoint(format!("{} ({why})", service.namespaced_hostname()))
    };
    let Some(gw) = &peer.network_gateway else {
        return refuse(format!(
            "endpoint {} is in network {:?} and names no gateway to it",
            peer.uid, peer.network
        ));
    };
    let Some(up) = state.network_gateway(gw, src_wl, dst) else {
        return refuse(format!(
            "network gateway {} of network {:?} is not a known workload or service",
            gw.destination, peer.network
        ));
    };
    if expected.is_empty() {
        return refuse(format!(
            "no identity to verify its proxies in network {:?} by: the service names no subjectAltNames",
            peer.network
        ));
    }
    Route::DoubleHbone {
        gateway: up.workload,
        gateway_addr: up.addr,
        gateway_ids: up.identities,
        target: HboneAddress::Host(service.hostname.clone(), dst.port()),
        expected,
        service: service.clone(),
    }
}

/// The SANs a service names (what its endpoints behind a gateway must prove).
fn service_sans(svc: &Service) -> Vec<Identity> {
    svc.subject_alt_names
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// Through the destination's waypoint: CONNECT to the original destination (VIP:port
/// for a service), the waypoint proving its own identity. Traffic from the waypoint
/// itself (a source with the waypoint's identity) goes direct (no loop). A waypoint we
/// cannot reach or tell apart fails the connection rather than skipping its policy. A
/// waypoint in another network is reached through its gateway, for service traffic
/// (the only kind that crosses networks).
fn via_waypoint(
    state: &MeshState,
    src_wl: &Workload,
    src: &Identity,
    gw: &crate::state::GatewayAddress,
    dst: SocketAddr,
    service: Option<&Arc<Service>>,
) -> Option<Route> {
    let Some(identity) = state.waypoint_identity(gw) else {
        let why = if state.waypoint_workload(gw, &src_wl.network).is_none() {
            "not a known workload"
        } else {
            "its workloads have different identities, so none can be told to be the waypoint"
        };
        return Some(Route::NoHealthyEndpoint(format!(
            "waypoint {} ({why})",
            gw.destination
        )));
    };
    if identity == *src {
        return None;
    }
    let Some(wp) = state.waypoint_workload(gw, &src_wl.network) else {
        return Some(Route::NoHealthyEndpoint(format!(
            "waypoint {} (no healthy workload)",
            gw.destination
        )));
    };
    if wp.network != src_wl.network {
        return Some(match service {
            Some(svc) => via_gateway(state, src_wl, &wp, svc, dst, vec![identity]),
            None => Route::NoHealthyEndpoint(format!(
                "waypoint {} (in network {:?}; only service traffic crosses networks)",
                gw.destination, wp.network
            )),
        });
    }
    // As Istio: a waypoint named by address is reached at (the family of) that address,
    // one named by hostname in the family the client used.
    let preferred = match &gw.destination {
        crate::state::GatewayDestination::Address(a) => a.address,
        crate::state::GatewayDestination::Hostname(_) => dst.ip(),
    };
    let Some(ip) = wp.address_for(preferred, None) else {
        return Some(Route::NoHealthyEndpoint(format!(
            "waypoint {} (workload {} has no IP address)",
            gw.destination, wp.uid
        )));
    };
    Some(Route::Hbone {
        expected: vec![identity],
        peer: wp,
        target: dst,
        hbone_addr: SocketAddr::new(ip, gw.hbone_mtls_port),
        service: service.cloned(),
    })
}

/// Through one of `svc`'s waypoints, picked by weight when it names a weighted set
/// (`pick_waypoint`); None: no waypoint, or the source is one of them (its own traffic
/// goes on direct, and a canary's is never sent to the primary). A weighted set with
/// nothing to pick (all weights 0, no primary) refuses rather than skip the waypoints.
fn service_waypoint(
    state: &MeshState,
    src_wl: &Workload,
    src: &Identity,
    svc: &Arc<Service>,
    dst: SocketAddr,
) -> Option<Route> {
    if svc
        .waypoints()
        .any(|gw| state.waypoint_identity(gw).as_ref() == Some(src))
    {
        return None;
    }
    match crate::state::pick_waypoint(svc) {
        Some(gw) => via_waypoint(state, src_wl, src, gw, dst, Some(svc)),
        None if !svc.weighted_waypoints.is_empty() => Some(Route::NoHealthyEndpoint(format!(
            "{} (its weighted waypoints all weigh 0)",
            svc.namespaced_hostname()
        ))),
        None => None,
    }
}

/// `src_wl` as the current state has it (its locality and network pick endpoints);
/// `src` the identity the pod was enrolled with (its certificate); `network` the
/// proxy's (NETWORK), where `dst` is looked up.
fn route(
    state: &MeshState,
    network: &str,
    src_wl: &Workload,
    src: &Identity,
    dst: SocketAddr,
) -> Route {
    if let Some(svc) = state.service_by_vip_for(network, dst.ip(), &src_wl.namespace) {
        if let Some(r) = service_waypoint(state, src_wl, src, svc, dst) {
            return r;
        }
        // PASSTHROUGH: the service names the traffic (waypoint, policy, metrics), the
        // original destination is where it goes.
        if svc.lb_mode() == LoadBalancerMode::Passthrough {
            return Route::Passthrough(dst);
        }
        let Some((wl, port)) = state.pick_endpoint(src_wl, svc, dst.port()) else {
            return Route::NoHealthyEndpoint(svc.namespaced_hostname().to_string());
        };
        // Another network's endpoint: its addresses (if any) mean nothing here.
        if wl.network != src_wl.network {
            return via_gateway(state, src_wl, &wl, svc, dst, service_sans(svc));
        }
        // The endpoint's address in the client's family when it has one (and the
        // service's families allow it).
        let ip = wl.address_for(dst.ip(), svc.ip_families);
        // Known by name only (a DNS-resolved ServiceEntry endpoint): resolved per connection.
        if ip.is_none() && !wl.hostname.is_empty() {
            return Route::Resolve {
                peer: wl,
                port,
                service: svc.clone(),
            };
        }
        return match (wl.protocol, ip) {
            (Protocol::HBONE, Some(ip)) => hbone_at(state, &wl, ip, port, Some(svc)),
            (Protocol::TCP, Some(ip)) => Route::Passthrough(SocketAddr::new(ip, port)),
            (_, None) => Route::NoHealthyEndpoint(format!(
                "{} (endpoint {} has no address of the service's IP families)",
                svc.namespaced_hostname(),
                wl.uid
            )),
        };
    }
    let Some(wl) = state.workload_by_ip(network, dst.ip()) else {
        return Route::Passthrough(dst);
    };
    // A workload's waypoint whatever the workload's protocol, as Istio's ztunnel: one
    // that is not captured (TCP) is still behind it.
    if let Some(r) = wl
        .waypoint
        .as_ref()
        .and_then(|gw| via_waypoint(state, src_wl, src, gw, dst, None))
    {
        return r;
    }
    match wl.protocol {
        // Dialed by address: that address.
        Protocol::HBONE => hbone_at(state, wl, dst.ip(), dst.port(), None),
        Protocol::TCP => Route::Passthrough(dst),
    }
}

/// Istio's HBONE CONNECT for `target` on behalf of the pod's client `peer`: the
/// original client and service in `forwarded`, the connection's `traceparent`, the
/// source's `baggage`; on the inner CONNECT of double HBONE, the source's network in
/// `x-forwarded-network` (`origin_network`), which tells the far side the client's
/// address is not one of its network's.
fn connect_request(
    target: &HboneAddress,
    peer: SocketAddr,
    service: Option<&Service>,
    src: &Workload,
    trace: &hbone::TraceParent,
    origin_network: Option<&str>,
) -> Result<http::Request<()>, http::Error> {
    let mut req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(target.to_string())
        .header(
            "forwarded",
            hbone::request::forwarded(peer, service.map(|s| s.hostname.as_str())),
        )
        .header("traceparent", trace.header());
    // Always, as Istio's (empty when config knows nothing of the source); a value that
    // cannot be a header (control characters in config) is left out rather than refusing
    // the connection.
    match http::HeaderValue::try_from(src.baggage_header()) {
        Ok(v) => req = req.header(crate::baggage::HEADER, v),
        Err(_) => {
            tracing::debug!(src = %src.uid, "the source's baggage is not a valid header value; not sent")
        }
    }
    if let Some(network) = origin_network {
        req = req.header(hbone::request::FORWARDED_NETWORK, network);
    }
    req.body(())
}

/// One captured connection, for its whole life. An async block, not an `async fn`: an
/// async fn's future keeps its arguments twice (as given and moved into the body), which
/// every open tunnel would pay for.
#[allow(clippy::manual_async_fn)]
fn handle(
    inputs: Arc<ProxyInputs>,
    pod: Arc<LocalPod>,
    mut stream: TcpStream,
    mut peer: SocketAddr,
) -> impl std::future::Future<Output = ()> {
    async move {
        let trace = hbone::TraceParent::new();
        tracing::Span::current().record("id", tracing::field::display(trace.trace_id()));
        // eBPF capture hands the app's connection over loopback; the client is still the pod
        // (same port), and that is what logs, the dump and the peer's `forwarded` name.
        if let Some(ip) = pod
            .ips
            .of_family(peer.ip())
            .filter(|_| peer.ip().is_loopback())
        {
            peer = SocketAddr::new(ip, peer.port());
        }
        let _socket = inputs.metrics.socket_open("source");
        let Some(_active) = track(&inputs, &pod) else {
            return reset(stream);
        };
        let start = Instant::now();
        let Some(dst) = captured_destination(&stream) else {
            return reset(stream);
        };
        if is_self_call(&pod, dst) {
            tracing::warn!(dst = %dst, "refusing a connection to the proxy's own port (loop)");
            return reset(stream);
        }
        // Decided in a boxed future of its own, so its locals (the state, the route, on-demand
        // DNS) take no room in the connection's; the result is matched as a temporary.
        let Tunnel {
            peer: workload,
            target,
            hbone_addr,
            service,
            dial,
        } = match Box::pin(plan(&inputs, &pod, dst)).await {
            Plan::Tunnel(t) => *t,
            // Boxed: its locals (the upstream socket, the TCP relay) would otherwise take room
            // in every connection's future, tunnels too.
            Plan::Passthrough(to) => {
                return Box::pin(passthrough(&inputs, &pod, stream, peer, dst, to, start)).await
            }
            Plan::Refuse => return reset(stream),
        };
        // The tunnel in place (not a function of its own: its future would keep its arguments
        // twice, which every open tunnel would pay for).
        let _listed = pod.outbound.register(OutboundView {
            src: peer,
            original_dst: dst,
            actual_dst: hbone_addr,
            protocol: Protocol::HBONE,
        });
        // The destination behind a gateway, kept for the log line: the identity it must
        // prove, then what it proved and its response baggage (a direct peer's identity is
        // made only then: held for the tunnel's life it would cost every connection its
        // three strings).
        let mut behind: Option<Box<Behind>> = dial.inner.as_ref().and_then(|i| {
            i.first().cloned().map(|identity| {
                Box::new(Behind {
                    identity,
                    baggage: None,
                })
            })
        });
        // Boxed: the label set (~1 KB) is needed only until the connection's counters
        // are fetched; inline it would stay in the connection's future for its life.
        let mut labels = Box::new(TcpLabels::new(
            "source",
            Peer {
                workload: Some(&pod.workload),
                identity: Some(&pod.identity),
            },
            Peer {
                workload: Some(&workload),
                identity: dial.inner.as_ref().unwrap_or(&dial.expected).first(),
            },
            service.as_deref(),
            true,
        ));
        // The tunnel leaves from the pod's address of the peer's family.
        let Some(src_ip) = pod.ips.of_family(hbone_addr.ip()) else {
            tracing::warn!(dst = %hbone_addr, pod.ips = %pod.ips, "the pod has no address of the destination's family; closing");
            inputs.metrics.failed(&labels, "CONNECT");
            return reset(stream);
        };
        let (result, t) = 'relay: {
            // Boxed: the requests, the pool key and the connects need room only until the
            // tunnel is open. Matched as a temporary, so the result takes no room in the relay's
            // state either.
            let (send, recv, hold, answered) = match Box::pin(open(
                &inputs,
                &pod,
                hbone_addr,
                src_ip,
                &target.address(hbone_addr),
                peer,
                service.as_deref(),
                dial,
                &trace,
            ))
            .await
            {
                Some(Ok(opened)) => opened,
                Some(Err(e)) => {
                    reset(stream);
                    let flag = match &e {
                        hbone::HboneError::Status { status, .. }
                            if *status == http::StatusCode::UNAUTHORIZED =>
                        {
                            "DENY"
                        }
                        hbone::HboneError::Tls { .. } | hbone::HboneError::TlsConfig(_) => {
                            "TLS_FAILURE"
                        }
                        _ => "CONNECT",
                    };
                    inputs.metrics.failed(&labels, flag);
                    break 'relay (Some(e.to_string()), Default::default());
                }
                None => return reset(stream),
            };
            // Behind a gateway (Istio's double HBONE), the destination is the one that
            // answered: labelled as its response baggage says, with the identity it proved.
            if let Some(a) = answered {
                if let Some(b) = &a.baggage {
                    labels.with_derived_destination(b, a.identity.as_ref());
                }
                if let Some(behind) = behind.as_mut() {
                    if let Some(id) = a.identity {
                        behind.identity = id;
                    }
                    behind.baggage = a.baggage;
                }
            }
            let conn = inputs.metrics.opened(&labels);
            drop(labels);
            let r = copy_tcp_h2(
                &mut stream,
                send,
                recv,
                std::future::pending(),
                inputs.cfg.idle_timeout,
            )
            .await;
            drop(hold);
            let t = match &r {
                Ok(t) | Err((_, t)) => *t,
            };
            conn.closed(t.sent, t.received);
            match r {
                Ok(t) => (None, t),
                Err((CopyError::Stream(e), t)) => {
                    reset(stream);
                    (Some(format!("tunnel reset: {e}")), t)
                }
                Err((e @ CopyError::Idle, t)) => {
                    reset(stream);
                    (Some(e.to_string()), t)
                }
                Err((e, t)) => (Some(e.to_string()), t),
            }
        };
        let direct_identity = behind.is_none().then(|| workload.identity());
        ConnectionLog {
            direction: "outbound",
            protocol: "HBONE",
            src_addr: peer,
            src: Side {
                workload: Some(&pod.workload),
                identity: Some(&pod.identity),
                baggage: None,
            },
            dst_addr: hbone_addr,
            dst_hbone_addr: Some(target.address(hbone_addr)),
            dst_service: service.as_deref(),
            dst: match behind.as_deref() {
                // Described by its response baggage (Istio): not the gateway.
                Some(Behind {
                    identity,
                    baggage: Some(b),
                }) => Side {
                    workload: None,
                    identity: Some(identity),
                    baggage: Some(b),
                },
                Some(Behind { identity, .. }) => Side {
                    workload: Some(&workload),
                    identity: Some(identity),
                    baggage: None,
                },
                None => Side {
                    workload: Some(&workload),
                    identity: direct_identity.as_ref(),
                    baggage: None,
                },
            },
            bytes_sent: t.sent,
            bytes_recv: t.received,
            duration: start.elapsed(),
            error: result,
        }
        .write();
    }
}

/// What to do with a captured connection.
enum Plan {
    /// Boxed: the connection's future keeps room for this result as long as for any of
    /// its locals (its slot may not overlap the tunnel's fields moved out of it).
    Tunnel(Box<Tunnel>),
    Passthrough(SocketAddr),
    /// Refused (logged): reset the connection.
    Refuse,
}

/// The route decision for a connection to `dst`, with the on-demand DNS it may need.
async fn plan(inputs: &ProxyInputs, pod: &LocalPod, dst: SocketAddr) -> Plan {
    let state = inputs.state.load_full();
    let src_wl = pod.workload_in(&state);
    let network = inputs.cfg.network.as_str();
    let decided = match route(&state, network, src_wl, &pod.identity, dst) {
        // Boxed: resolving is rare, and its future (DNS) is large.
        Route::Resolve {
            peer,
            port,
            service,
        } => {
            Box::pin(resolve(
                &inputs.on_demand_dns,
                &state,
                src_wl,
                dst,
                peer,
                port,
                service,
            ))
            .await
        }
        r => r,
    };
    match decided {
        Route::NoHealthyEndpoint(svc) => {
            tracing::warn!(dst = %dst, service = %svc, error = "no healthy endpoint", "connection failed");
            Plan::Refuse
        }
        // resolve() always decides; never connect on an unresolved name.
        Route::Resolve { .. } => Plan::Refuse,
        Route::Passthrough(to) => Plan::Passthrough(to),
        Route::Hbone {
            peer: workload,
            target,
            hbone_addr,
            expected,
            service,
        } => Plan::Tunnel(Box::new(Tunnel {
            peer: workload,
            target: KeptTarget::new(target.into(), hbone_addr),
            hbone_addr,
            service,
            dial: Box::new(Dial {
                expected,
                inner: None,
            }),
        })),
        Route::DoubleHbone {
            gateway,
            gateway_addr,
            gateway_ids,
            target,
            expected,
            service,
        } => Plan::Tunnel(Box::new(Tunnel {
            peer: gateway,
            target: KeptTarget::new(target, gateway_addr),
            hbone_addr: gateway_addr,
            service: Some(service),
            dial: Box::new(Dial {
                expected: gateway_ids,
                inner: Some(expected),
            }),
        })),
    }
}

/// A connection to a destination outside the mesh (or one without HBONE): plain TCP from
/// the pod's network namespace.
async fn passthrough(
    inputs: &ProxyInputs,
    pod: &LocalPod,
    mut stream: TcpStream,
    peer: SocketAddr,
    dst: SocketAddr,
    to: SocketAddr,
    start: Instant,
) {
    let state = inputs.state.load_full();
    let network = inputs.cfg.network.as_str();
    let _listed = pod.outbound.register(OutboundView {
        src: peer,
        original_dst: dst,
        actual_dst: to,
        protocol: Protocol::TCP,
    });
    // Boxed: the label set (~1 KB) is needed only until the connection's counters
    // are fetched; inline it would stay in the connection's future for its life.
    let labels = Box::new(TcpLabels::new(
        "source",
        Peer {
            workload: Some(&pod.workload),
            identity: None,
        },
        Peer {
            workload: state.workload_by_ip(network, to.ip()).map(|w| &**w),
            identity: None,
        },
        state
            .service_by_vip_for(network, dst.ip(), &pod.workload.namespace)
            .map(|s| &**s),
        false,
    ));
    let upstream = Box::pin(pod.netns.connect(to, None, inputs.cfg.connect_timeout)).await;
    let mut upstream = match upstream {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(dst = %to, error = %e, "passthrough connect failed");
            inputs.metrics.failed(&labels, "CONNECT");
            return reset(stream);
        }
    };
    let conn = inputs.metrics.opened(&labels);
    drop(labels);
    let r = copy_tcp(
        conn,
        &mut stream,
        &mut upstream,
        std::future::pending(),
        inputs.cfg.idle_timeout,
    )
    .await;
    let (t, error) = match r {
        Ok(t) => (t, None),
        Err((e, t)) => (t, Some(e.to_string())),
    };
    ConnectionLog {
        direction: "outbound",
        protocol: "TCP",
        src_addr: peer,
        src: Side {
            workload: Some(&pod.workload),
            identity: None,
            baggage: None,
        },
        dst_addr: to,
        dst_hbone_addr: None,
        dst_service: state
            .service_by_vip_for(network, dst.ip(), &pod.workload.namespace)
            .map(|s| &**s),
        dst: Side {
            workload: state.workload_by_ip(network, to.ip()).map(|w| &**w),
            identity: None,
            baggage: None,
        },
        bytes_sent: t.sent,
        bytes_recv: t.received,
        duration: start.elapsed(),
        error,
    }
    .write();
}

/// An HBONE tunnel to open: CONNECT `target` to `peer` on `hbone_addr`, which proves one
/// of `expected`. With `inner` (double HBONE, `peer` an east-west gateway), the same
/// CONNECT again inside that stream, to a proxy proving one of `inner`.
struct Tunnel {
    peer: Arc<Workload>,
    target: KeptTarget,
    hbone_addr: SocketAddr,
    service: Option<Arc<Service>>,
    /// Boxed: needed until the connect only, and a moved-out local still takes its room
    /// in the connection's future.
    dial: Box<Dial>,
}

/// The CONNECT target as a tunnel keeps it (after the CONNECT, for the log line): for a
/// tunnel straight to a workload only the port (the address is `hbone_addr`'s), anything
/// else boxed; inline, a target would take 40 bytes of every tunnel's task, past its
/// task cell's size class, and boxed always, an allocation per tunnel.
enum KeptTarget {
    Port(u16),
    Other(Box<HboneAddress>),
}

impl KeptTarget {
    fn new(target: HboneAddress, hbone_addr: SocketAddr) -> Self {
        match target {
            HboneAddress::Addr(a) if a.ip() == hbone_addr.ip() => KeptTarget::Port(a.port()),
            t => KeptTarget::Other(Box::new(t)),
        }
    }

    fn address(&self, hbone_addr: SocketAddr) -> HboneAddress {
        match self {
            KeptTarget::Port(port) => HboneAddress::Addr(SocketAddr::new(hbone_addr.ip(), *port)),
            KeptTarget::Other(t) => (**t).clone(),
        }
    }
}

/// The identities the tunnel's peer must prove (`inner`: behind a gateway, double HBONE).
struct Dial {
    expected: Vec<Identity>,
    inner: Option<Vec<Identity>>,
}

/// An open tunnel: its stream, what keeps its connection, and (double HBONE) who answered.
type Opened = (
    h2::SendStream<bytes::Bytes>,
    h2::RecvStream,
    TunnelHold,
    Option<Box<hbone::client::Answered>>,
);

/// The destination behind an east-west gateway (double HBONE), for the log line.
struct Behind {
    /// The identity it must prove; once it answered, the one it proved.
    identity: Identity,
    /// What its 200 said of it (Istio's response baggage), when it said anything usable.
    baggage: Option<crate::baggage::Baggage>,
}

/// What keeps a tunnel's connection while its stream is in use (held, never read).
enum TunnelHold {
    Pooled { _slot: hbone::StreamGuard },
    Inner { _conn: hbone::client::OnceGuard },
}

/// Connects the tunnel: a pooled stream to the peer `key` names, and with `inner` (double
/// HBONE) the inner connection inside it, saying who answered it. None when the CONNECT
/// request cannot be built (logged). (A direct peer's response baggage is not read, as
/// Istio's ztunnel does not: config describes that peer.)
// The tunnel's parts, each borrowed from `handle` (a struct of them would be built there
// and kept in its state for the connection's life).
#[allow(clippy::too_many_arguments)]
async fn open(
    inputs: &ProxyInputs,
    pod: &LocalPod,
    hbone_addr: SocketAddr,
    src_ip: IpAddr,
    target: &HboneAddress,
    peer: SocketAddr,
    service: Option<&Service>,
    dial: Box<Dial>,
    trace: &hbone::TraceParent,
) -> Option<Result<Opened, hbone::HboneError>> {
    let Dial { expected, inner } = *dial;
    let key = PoolKey::new(pod.identity.clone(), expected, hbone_addr, src_ip);
    let request = |origin_network| {
        connect_request(target, peer, service, &pod.workload, trace, origin_network)
    };
    let (req, inner_req) = match (
        request(None),
        inner
            .as_ref()
            .map(|_| request(Some(&inputs.cfg.network)))
            .transpose(),
    ) {
        (Ok(r), Ok(i)) => (r, i),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "cannot build CONNECT request");
            return None;
        }
    };
    let outer = inputs.pool.connect(&key, &pod.netns, req).await;
    Some(match (outer, inner.zip(inner_req)) {
        (Ok((send, recv, guard)), None) => {
            Ok((send, recv, TunnelHold::Pooled { _slot: guard }, None))
        }
        (Ok((send, recv, guard)), Some((inner, req))) => {
            let outer = hbone::H2Stream::new(send, recv, Some(guard));
            inputs
                .pool
                .connect_through(outer, &pod.identity, inner, key.dst, req)
                .await
                .map(|(s, r, g, a)| (s, r, TunnelHold::Inner { _conn: g }, Some(Box::new(a))))
        }
        (Err(e), _) => Err(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_task_stays_small() {
        use crate::task_size::Returns;
        // What every outbound connection holds while open (864 bytes in the test build:
        // at most 880 keeps its task cell at 1024 bytes, each 128 bytes shed is a size class
        // of tokio's task cell; 976 before the route decision's result and the identities
        // to dial were boxed, 1408 before it became an async block, its route decision and
        // passthrough path boxed fns and the opened tunnel a temporary; 1280 before double HBONE; 2256 before the TCP relay
        // was boxed and the HBONE relay hand-written).
        let size = handle.returned_size();
        // The passthrough path, boxed by `handle`, holds the TCP relay for the connection's
        // life (928 bytes in the test build; 1944 before the relay became a state machine).
        let passthrough = Returns::<(
            &ProxyInputs,
            &LocalPod,
            TcpStream,
            SocketAddr,
            SocketAddr,
            SocketAddr,
            Instant,
        )>::returned_size(&passthrough);
        println!(
            "outbound handle future: {size} bytes, its boxed passthrough: {passthrough} bytes"
        );
        assert!(
            size <= 880,
            "outbound connection future grew to {size} bytes: box the set-up step that grew it"
        );
        assert!(
            passthrough <= 992,
            "outbound passthrough future grew to {passthrough} bytes"
        );
    }

    #[test]
    fn a_kept_target_gives_back_the_connect_target() {
        let hbone: SocketAddr = "10.0.0.2:15008".parse().unwrap();
        // Straight to the workload: only the port is kept.
        let direct = KeptTarget::new(HboneAddress::Addr("10.0.0.2:8080".parse().unwrap()), hbone);
        assert!(matches!(direct, KeptTarget::Port(8080)));
        assert_eq!(
            direct.address(hbone),
            HboneAddress::Addr("10.0.0.2:8080".parse().unwrap())
        );
        // Through a waypoint (a service VIP) or a gateway (a hostname): kept whole.
        for t in [
            HboneAddress::Addr("10.96.0.1:80".parse().unwrap()),
            HboneAddress::Host("echo.default.svc.cluster.local".into(), 80),
        ] {
            let kept = KeptTarget::new(t.clone(), hbone);
            assert!(matches!(kept, KeptTarget::Other(_)));
            assert_eq!(kept.address(hbone), t);
        }
    }

    const WP: &str = "default/waypoint.default.svc.cluster.local";

    fn state(waypoint_ips: &str, extra: &str) -> MeshState {
        let workloads: Vec<Workload> = serde_yaml::from_str(&format!(
            "- {{uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE}}
- {{uid: echo, name: echo, namespace: default, serviceAccount: echo, workloadIps: [10.0.0.2], protocol: HBONE,
   services: {{default/echo.default.svc.cluster.local: {{80: 8080}}}}}}
- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: {waypoint_ips}, protocol: HBONE,
   services: {{{WP}: {{15008: 15008}}}}}}
{extra}"
        ))
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(&format!(
            "- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [/10.96.0.10, \"/fd00:96::10\"], ports: {{80: 8080}},
   waypoint: {{destination: {WP}}}}}
- {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {{15008: 15008}}}}"
        ))
        .unwrap();
        MeshState::build(workloads, services, Vec::new()).unwrap()
    }

    fn route_from(st: &MeshState, uid: &str, dst: &str) -> Route {
        let src = st
            .workload_by_uid(&crate::state::WorkloadUid(uid.into()))
            .unwrap()
            .clone();
        route(
            st,
            &src.network,
            &src,
            &src.identity(),
            dst.parse().unwrap(),
        )
    }

    fn peer(r: &Route) -> String {
        match r {
            Route::Hbone { peer, target, .. } => format!("hbone {} {target}", peer.uid),
            Route::Passthrough(to) => format!("passthrough {to}"),
            Route::NoHealthyEndpoint(why) => format!("refused: {why}"),
            Route::Resolve { peer, port, .. } => {
                format!("resolve {}:{port} ({})", peer.hostname, peer.uid)
            }
            Route::DoubleHbone {
                gateway, target, ..
            } => format!("gateway {} {target}", gateway.uid),
        }
    }

    #[test]
    fn service_traffic_goes_through_its_waypoint() {
        let st = state("[10.0.0.9]", "");
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.10:80")),
            "hbone wp 10.96.0.10:80"
        );
        // The waypoint's own traffic goes to the service's endpoints.
        assert_eq!(
            peer(&route_from(&st, "wp", "10.96.0.10:80")),
            "hbone echo 10.0.0.2:8080"
        );
    }

    #[test]
    fn an_ipv6_only_waypoint_is_reached_over_ipv6_and_one_without_addresses_fails_closed() {
        // As Istio: the waypoint's only address, whatever the client's family (a client
        // without IPv6 then fails to connect: closed, never around the waypoint).
        let st = state("[\"fd00::9\"]", "");
        assert_eq!(tunnel(&route_from(&st, "client", "10.96.0.10:80")), "hbone wp 10.96.0.10:80 via [fd00::9]:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint");
        let st = state("[]", "");
        let r = peer(&route_from(&st, "client", "10.96.0.10:80"));
        assert!(
            r.starts_with("refused:"),
            "traffic went around the waypoint: {r}"
        );
    }

    #[test]
    fn a_dual_stack_waypoint_is_reached_in_the_clients_family() {
        let st = state("[10.0.0.9, \"fd00::9\"]", "");
        assert_eq!(tunnel(&route_from(&st, "client", "10.96.0.10:80")), "hbone wp 10.96.0.10:80 via 10.0.0.9:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint");
        assert_eq!(tunnel(&route_from(&st, "client", "[fd00:96::10]:80")), "hbone wp [fd00:96::10]:80 via [fd00::9]:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint");
    }

    /// Dual-stack pods: a service's endpoint in the family of the VIP the client dialed,
    /// within the service's IP families; a pod dialed by address at that address.
    #[test]
    fn dual_stack_endpoints_keep_the_clients_family() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1, \"fd00::1\"], protocol: HBONE}
- {uid: echo, name: echo, namespace: default, serviceAccount: echo, workloadIps: [10.0.0.2, \"fd00::2\"], protocol: HBONE,
   services: {default/dual.default.svc.cluster.local: {80: 8080}, default/v4.default.svc.cluster.local: {80: 8080},
              default/v6.default.svc.cluster.local: {80: 8080}}}
- {uid: v6only, name: v6only, namespace: default, workloadIps: [\"fd00::3\"], protocol: TCP,
   services: {default/single.default.svc.cluster.local: {80: 9090}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: dual, namespace: default, hostname: dual.default.svc.cluster.local, vips: [/10.96.0.10, \"/fd00:96::10\"], ports: {80: 8080}}
- {name: v4, namespace: default, hostname: v4.default.svc.cluster.local, vips: [/10.96.0.11, \"/fd00:96::11\"], ports: {80: 8080}, ipFamilies: IPv4}
- {name: v6, namespace: default, hostname: v6.default.svc.cluster.local, vips: [/10.96.0.12], ports: {80: 8080}, ipFamilies: IPv6}
- {name: single, namespace: default, hostname: single.default.svc.cluster.local, vips: [/10.96.0.13], ports: {80: 9090}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        let to = |dst: &str| peer(&route_from(&st, "client", dst));
        assert_eq!(to("10.96.0.10:80"), "hbone echo 10.0.0.2:8080");
        assert_eq!(to("[fd00:96::10]:80"), "hbone echo [fd00::2]:8080");
        assert_eq!(to("10.0.0.2:8080"), "hbone echo 10.0.0.2:8080");
        assert_eq!(to("[fd00::2]:8080"), "hbone echo [fd00::2]:8080");
        // A single-family service uses only its family, whichever VIP was dialed.
        assert_eq!(to("[fd00:96::11]:80"), "hbone echo 10.0.0.2:8080");
        assert_eq!(to("10.96.0.12:80"), "hbone echo [fd00::2]:8080");
        // A single-stack endpoint gets its only address, whatever the client's family.
        assert_eq!(to("10.96.0.13:80"), "passthrough [fd00::3]:9090");
    }

    #[test]
    fn joining_the_waypoint_service_does_not_skip_the_waypoint() {
        // A pod whose labels put it in the waypoint Service's selector is not the waypoint:
        // its identity is not the waypoint's.
        let intruder = format!(
            "- {{uid: intruder, name: intruder, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {{{WP}: {{15008: 15008}}}}}}"
        );
        let st = state("[10.0.0.9]", &intruder);
        let r = peer(&route_from(&st, "intruder", "10.96.0.10:80"));
        assert!(
            !r.starts_with("hbone echo"),
            "the intruder went straight to the destination: {r}"
        );
        // A pod with the waypoint's identity is the waypoint (same principal), member or not.
        let twin = "- {uid: twin, name: twin, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.4], protocol: HBONE}";
        let st = state("[10.0.0.9]", twin);
        assert_eq!(
            peer(&route_from(&st, "twin", "10.96.0.10:80")),
            "hbone echo 10.0.0.2:8080"
        );
    }

    /// A mesh for the route decision: `client` (the source), mesh workloads `echo` (a
    /// service endpoint) and `db` (behind its own waypoint), a plaintext workload `legacy`,
    /// the waypoint `wp`, and services over each.
    fn mesh() -> MeshState {
        let workloads: Vec<Workload> = serde_yaml::from_str(&format!(
            "- {{uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE}}
- {{uid: echo, name: echo, namespace: default, serviceAccount: echo, workloadIps: [10.0.0.2], protocol: HBONE,
   services: {{default/echo.default.svc.cluster.local: {{80: 8080}}}}}}
- {{uid: sick, name: sick, namespace: default, serviceAccount: sick, workloadIps: [10.0.0.3], protocol: HBONE, status: Unhealthy,
   services: {{default/sick.default.svc.cluster.local: {{80: 8080}}}}}}
- {{uid: db, name: db, namespace: default, serviceAccount: db, workloadIps: [10.0.0.4], protocol: HBONE, waypoint: {{destination: {WP}}}}}
- {{uid: legacy, name: legacy, namespace: default, serviceAccount: legacy, workloadIps: [10.0.0.5],
   services: {{default/legacy.default.svc.cluster.local: {{80: 9090}}}}}}
- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE,
   services: {{{WP}: {{15008: 15008}}}}}}"
        ))
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str("- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [/10.96.0.10], ports: {80: 8080},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/echo-canary]}
- {name: sick, namespace: default, hostname: sick.default.svc.cluster.local, vips: [/10.96.0.11], ports: {80: 8080}}
- {name: empty, namespace: default, hostname: empty.default.svc.cluster.local, vips: [/10.96.0.12], ports: {80: 8080}}
- {name: legacy, namespace: default, hostname: legacy.default.svc.cluster.local, vips: [/10.96.0.13], ports: {80: 9090}}
- {name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {15008: 15008}}")
        .unwrap();
        MeshState::build(workloads, services, Vec::new()).unwrap()
    }

    /// The whole tunnel a route asks for: peer, CONNECT target, where it dials, whom it expects.
    fn tunnel(r: &Route) -> String {
        match r {
            Route::Hbone {
                peer,
                target,
                hbone_addr,
                expected,
                ..
            } => {
                let ids: Vec<String> = expected.iter().map(|i| i.to_string()).collect();
                format!(
                    "hbone {} {target} via {hbone_addr} expecting {}",
                    peer.uid,
                    ids.join(",")
                )
            }
            Route::DoubleHbone {
                gateway,
                gateway_addr,
                gateway_ids,
                target,
                expected,
                ..
            } => {
                let ids = |v: &[Identity]| {
                    v.iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                };
                format!(
                    "gateway {} {target} via {gateway_addr} expecting {}, then {}",
                    gateway.uid,
                    ids(gateway_ids),
                    ids(expected)
                )
            }
            other => peer(other),
        }
    }

    #[test]
    fn a_mesh_workload_is_reached_directly_over_hbone() {
        let st = mesh();
        assert_eq!(
            tunnel(&route_from(&st, "client", "10.0.0.2:8080")),
            "hbone echo 10.0.0.2:8080 via 10.0.0.2:15008 expecting spiffe://cluster.local/ns/default/sa/echo"
        );
    }

    #[test]
    fn a_service_vip_goes_to_a_healthy_endpoint_on_its_target_port() {
        let st = mesh();
        // The service's SANs are accepted as well as the endpoint's own identity.
        assert_eq!(
            tunnel(&route_from(&st, "client", "10.96.0.10:80")),
            "hbone echo 10.0.0.2:8080 via 10.0.0.2:15008 expecting spiffe://cluster.local/ns/default/sa/echo,spiffe://cluster.local/ns/default/sa/echo-canary"
        );
        // A port the service does not have has no endpoint.
        assert!(peer(&route_from(&st, "client", "10.96.0.10:81")).starts_with("refused:"));
    }

    #[test]
    fn a_service_without_a_healthy_endpoint_is_refused() {
        let st = mesh();
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.11:80")),
            "refused: default/sick.default.svc.cluster.local"
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.12:80")),
            "refused: default/empty.default.svc.cluster.local"
        );
    }

    #[test]
    fn destinations_outside_the_mesh_pass_through() {
        let st = mesh();
        // Unknown to the mesh, a plaintext workload, and a service of plaintext endpoints
        // (to the endpoint picked, on its target port).
        assert_eq!(
            peer(&route_from(&st, "client", "192.0.2.1:443")),
            "passthrough 192.0.2.1:443"
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.0.0.5:9090")),
            "passthrough 10.0.0.5:9090"
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.13:80")),
            "passthrough 10.0.0.5:9090"
        );
    }

    #[test]
    fn a_workload_behind_a_waypoint_is_reached_through_it() {
        let st = mesh();
        // CONNECT to the original destination on the waypoint's HBONE port, expecting only
        // the waypoint's identity.
        assert_eq!(
            tunnel(&route_from(&st, "client", "10.0.0.4:5432")),
            "hbone wp 10.0.0.4:5432 via 10.0.0.9:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint"
        );
        // The waypoint's own traffic goes on directly.
        assert_eq!(
            tunnel(&route_from(&st, "wp", "10.0.0.4:5432")),
            "hbone db 10.0.0.4:5432 via 10.0.0.4:15008 expecting spiffe://cluster.local/ns/default/sa/db"
        );
    }

    #[test]
    fn a_weighted_set_of_waypoints_shares_the_traffic_and_their_own_goes_direct() {
        let workloads: Vec<Workload> = serde_yaml::from_str(&format!(
            "- {{uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE}}
- {{uid: echo, name: echo, namespace: default, serviceAccount: echo, workloadIps: [10.0.0.2], protocol: HBONE,
   services: {{default/echo.default.svc.cluster.local: {{80: 8080}}, default/off.default.svc.cluster.local: {{80: 8080}}}}}}
- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE,
   services: {{{WP}: {{15008: 15008}}}}}}
- {{uid: wp2, name: wp2, namespace: default, serviceAccount: waypoint-canary, workloadIps: [10.0.0.8], protocol: HBONE}}"
        ))
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(&format!(
            "- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [/10.96.0.10], ports: {{80: 8080}},
   waypoint: {{destination: {WP}}}, weightedWaypoints: [{{destination: {{destination: {WP}}}, weight: 3}}, {{destination: {{destination: /10.0.0.8}}, weight: 1}}]}}
- {{name: off, namespace: default, hostname: off.default.svc.cluster.local, vips: [/10.96.0.11], ports: {{80: 8080}},
   weightedWaypoints: [{{destination: {{destination: /10.0.0.8}}, weight: 0}}]}}
- {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {{15008: 15008}}}}"
        ))
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        let mut seen = std::collections::BTreeMap::new();
        for _ in 0..400 {
            *seen
                .entry(tunnel(&route_from(&st, "client", "10.96.0.10:80")))
                .or_insert(0) += 1;
        }
        let primary = "hbone wp 10.96.0.10:80 via 10.0.0.9:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint";
        let canary = "hbone wp2 10.96.0.10:80 via 10.0.0.8:15008 expecting spiffe://cluster.local/ns/default/sa/waypoint-canary";
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(
            (50..=150).contains(&seen[canary]) && seen[primary] + seen[canary] == 400,
            "about 1 in 4 to the canary: {seen:?}"
        );
        // Either waypoint's own traffic goes to the endpoint, never to the other waypoint.
        assert_eq!(
            peer(&route_from(&st, "wp", "10.96.0.10:80")),
            "hbone echo 10.0.0.2:8080"
        );
        assert_eq!(
            peer(&route_from(&st, "wp2", "10.96.0.10:80")),
            "hbone echo 10.0.0.2:8080"
        );
        // A set of waypoints none of which may take traffic, and no primary: refused.
        let r = peer(&route_from(&st, "client", "10.96.0.11:80"));
        assert!(r.starts_with("refused: default/off.default.svc.cluster.local (its weighted waypoints all weigh 0)"), "{r}");
    }

    #[test]
    fn host_network_workloads_share_the_node_ip_without_owning_it() {
        // Two host-network pods on one node: the same IP, no conflict (strict build).
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: pod1, name: pod1, namespace: default, workloadIps: [10.0.0.50], networkMode: HostNetwork,
   services: {default/hn.default.svc.cluster.local: {80: 8080}}}
- {uid: pod2, name: pod2, namespace: default, workloadIps: [10.0.0.50], networkMode: HostNetwork}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: hn, namespace: default, hostname: hn.default.svc.cluster.local, vips: [/10.96.0.50], ports: {80: 8080}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        assert!(
            st.workload_by_ip("", "10.0.0.50".parse().unwrap())
                .is_none(),
            "the node's IP is no workload's"
        );
        // The service still reaches its host-network endpoint; the node IP itself passes through.
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.50:80")),
            "passthrough 10.0.0.50:8080"
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.0.0.50:9000")),
            "passthrough 10.0.0.50:9000"
        );
    }

    /// A NAMESPACE-visible service is routed only for clients of its namespace; for
    /// others its VIP is no service's (a range holding it may be), as Istio's ztunnel.
    #[test]
    fn namespace_visible_services_route_only_in_their_namespace() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: other, name: other, namespace: other, workloadIps: [10.0.0.2], protocol: HBONE}
- {uid: srv, name: srv, namespace: default, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {default/private.example.com: {80: 8080}, other/range.other.svc.cluster.local: {80: 9090}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: private, namespace: default, hostname: private.example.com, vips: [/10.96.0.80], ports: {80: 8080}, visibility: Namespace}
- {name: range, namespace: other, hostname: range.other.svc.cluster.local, cidrVips: [10.96.0.0/24], ports: {80: 9090}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.80:80")),
            "hbone srv 10.0.0.3:8080"
        );
        // From namespace other the VIP falls to the range that holds it.
        assert_eq!(
            peer(&route_from(&st, "other", "10.96.0.80:80")),
            "hbone srv 10.0.0.3:9090"
        );
        let ip = "10.96.0.80".parse().unwrap();
        assert_eq!(
            st.service_by_vip_for("", ip, "default")
                .map(|s| s.name.as_str()),
            Some("private")
        );
        assert_eq!(
            st.service_by_vip_for("", ip, "other")
                .map(|s| s.name.as_str()),
            Some("range")
        );
    }

    #[test]
    fn cidr_vips_passthrough_and_allow_all_services() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: sick, name: sick, namespace: default, workloadIps: [10.0.0.3], status: Unhealthy,
   services: {default/any.default.svc.cluster.local: {80: 8080}, default/range.default.svc.cluster.local: {80: 8080}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: range, namespace: default, hostname: range.default.svc.cluster.local, cidrVips: [10.200.0.0/16], ports: {80: 8080}}
- {name: narrow, namespace: default, hostname: narrow.default.svc.cluster.local, cidrVips: [10.200.7.0/24], ports: {80: 8080},
   loadBalancer: {mode: Passthrough}}
- {name: egress, namespace: default, hostname: egress.example.com, vips: [/10.96.0.70], loadBalancer: {mode: Passthrough}}
- {name: any, namespace: default, hostname: any.default.svc.cluster.local, vips: [/10.96.0.71], ports: {80: 8080},
   loadBalancer: {healthPolicy: AllowAll}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        // A CIDR VIP is the service's for every address in it; the longest range wins.
        assert_eq!(
            st.service_by_vip("", "10.200.3.4".parse().unwrap())
                .map(|s| s.name.as_str()),
            Some("range")
        );
        assert_eq!(
            st.service_by_vip("", "10.200.7.9".parse().unwrap())
                .map(|s| s.name.as_str()),
            Some("narrow")
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.200.3.4:80")),
            "refused: default/range.default.svc.cluster.local"
        );
        // PASSTHROUGH goes to the original destination, in a range or at a VIP.
        assert_eq!(
            peer(&route_from(&st, "client", "10.200.7.9:443")),
            "passthrough 10.200.7.9:443"
        );
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.70:443")),
            "passthrough 10.96.0.70:443"
        );
        // ALLOW_ALL uses an unhealthy endpoint; the default (ONLY_HEALTHY) does not.
        assert_eq!(
            peer(&route_from(&st, "client", "10.96.0.71:80")),
            "passthrough 10.0.0.3:8080"
        );
    }

    #[test]
    fn hostname_endpoints_are_resolved_and_addressless_ones_skipped() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: se-ext, name: ext, namespace: default, hostname: db.external.example,
   services: {default/db.external.example: {80: 8080}}}
- {uid: se-sick, name: sick, namespace: default, hostname: sick.external.example, status: Unhealthy,
   services: {default/db.external.example: {80: 8080}}}
- {uid: nowhere, name: nowhere, namespace: default, services: {default/db.external.example: {80: 8080}}}
- {uid: both, name: both, namespace: default, workloadIps: [10.0.0.7], hostname: both.example,
   services: {default/both.example: {80: 8080}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: db, namespace: default, hostname: db.external.example, vips: [/240.240.0.5], ports: {80: 8080}}
- {name: both, namespace: default, hostname: both.example, vips: [/240.240.0.6], ports: {80: 8080}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        // Only the healthy hostname endpoint: the unhealthy one and the one with neither IP
        // nor hostname are never picked.
        for _ in 0..20 {
            assert_eq!(
                peer(&route_from(&st, "client", "240.240.0.5:80")),
                "resolve db.external.example:8080 (se-ext)"
            );
        }
        // An IP wins over a hostname (no lookup).
        assert_eq!(
            peer(&route_from(&st, "client", "240.240.0.6:80")),
            "passthrough 10.0.0.7:8080"
        );
    }

    #[tokio::test]
    async fn a_resolved_hostname_endpoint_is_reached_by_its_protocol() {
        // An IP literal as hostname resolves without a lookup, so this needs no upstream.
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: plain, name: plain, namespace: default, hostname: 192.0.2.5, services: {default/plain.example: {80: 8080}}}
- {uid: mesh, name: mesh, namespace: default, serviceAccount: remote, hostname: 192.0.2.6, protocol: HBONE,
   services: {default/mesh.example: {80: 8080}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: plain, namespace: default, hostname: plain.example, vips: [/240.240.0.7], ports: {80: 8080}}
- {name: mesh, namespace: default, hostname: mesh.example, vips: [/240.240.0.8], ports: {80: 8080},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/other]}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = crate::metrics::on_demand_dns::OnDemandDnsMetrics::register(&mut registry);
        let resolver = OnDemandResolver::new(Default::default(), metrics);
        let src = st
            .workload_by_uid(&crate::state::WorkloadUid("client".into()))
            .unwrap()
            .clone();
        let decide = |dst: &str| {
            let dst: SocketAddr = dst.parse().unwrap();
            match route(&st, &src.network, &src, &src.identity(), dst) {
                Route::Resolve {
                    peer,
                    port,
                    service,
                } => resolve(&resolver, &st, &src, dst, peer, port, service),
                other => panic!("not a hostname endpoint: {}", tunnel(&other)),
            }
        };
        assert_eq!(
            peer(&decide("240.240.0.7:80").await),
            "passthrough 192.0.2.5:8080"
        );
        assert_eq!(
            tunnel(&decide("240.240.0.8:80").await),
            "hbone mesh 192.0.2.6:8080 via 192.0.2.6:15008 expecting spiffe://cluster.local/ns/default/sa/remote,spiffe://cluster.local/ns/default/sa/other"
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("hostname=\"192.0.2.5\"} 1"), "{text}");
    }

    #[tokio::test]
    async fn a_hostname_that_does_not_resolve_fails_the_connection() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE}
- {uid: ext, name: ext, namespace: default, hostname: db.external.example, services: {default/db.external.example: {80: 8080}}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: db, namespace: default, hostname: db.external.example, vips: [/240.240.0.5], ports: {80: 8080}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        // No upstream resolver at all.
        let resolver = OnDemandResolver::new(Default::default(), Default::default());
        let src = st
            .workload_by_uid(&crate::state::WorkloadUid("client".into()))
            .unwrap()
            .clone();
        let dst: SocketAddr = "240.240.0.5:80".parse().unwrap();
        let Route::Resolve {
            peer: p,
            port,
            service,
        } = route(&st, &src.network, &src, &src.identity(), dst)
        else {
            panic!("not resolved")
        };
        let r = peer(&resolve(&resolver, &st, &src, dst, p, port, service).await);
        assert!(r.starts_with("refused: default/db.external.example (endpoint db.external.example: lookup failed: no upstream DNS server"), "{r}");
    }

    #[test]
    fn another_networks_endpoints_are_reached_through_its_gateway_or_refused() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE, network: net-a}
- {uid: gw, name: eastwest, namespace: istio-system, serviceAccount: eastwest, workloadIps: [172.18.0.9], network: net-b}
- {uid: remote, name: echo, namespace: default, serviceAccount: echo, protocol: HBONE, network: net-b,
   networkGateway: {destination: net-b/172.18.0.9}, services: {default/echo.default.svc.cluster.local: {80: 8080}, default/nosan.default.svc.cluster.local: {80: 8080}}}
- {uid: stray, name: stray, namespace: default, workloadIps: [10.1.0.5], protocol: HBONE, network: net-b,
   services: {default/nogw.default.svc.cluster.local: {80: 8080}}}
- {uid: lost, name: lost, namespace: default, protocol: HBONE, network: net-b, networkGateway: {destination: net-b/172.18.0.77},
   services: {default/lost.default.svc.cluster.local: {80: 8080}}}
- {uid: wp, name: waypoint, namespace: default, serviceAccount: waypoint, workloadIps: [10.1.0.9], protocol: HBONE, network: net-b,
   networkGateway: {destination: net-b/172.18.0.9}}",
        )
        .unwrap();
        let services: Vec<Service> = serde_yaml::from_str(
            "- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [net-a/10.96.0.10], ports: {80: 8080},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/echo]}
- {name: nogw, namespace: default, hostname: nogw.default.svc.cluster.local, vips: [net-a/10.96.0.11], ports: {80: 8080},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/default]}
- {name: lost, namespace: default, hostname: lost.default.svc.cluster.local, vips: [net-a/10.96.0.12], ports: {80: 8080},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/default]}
- {name: nosan, namespace: default, hostname: nosan.default.svc.cluster.local, vips: [net-a/10.96.0.13], ports: {80: 8080}}
- {name: waypointed, namespace: default, hostname: waypointed.default.svc.cluster.local, vips: [net-a/10.96.0.14], ports: {80: 8080},
   waypoint: {destination: net-b/10.1.0.9}}",
        )
        .unwrap();
        let st = MeshState::build(workloads, services, Vec::new()).unwrap();
        // Outer CONNECT to the gateway (its identity), the same CONNECT inside it to the
        // service's hostname and port (the service's SANs).
        assert_eq!(
            tunnel(&route_from(&st, "client", "10.96.0.10:80")),
            "gateway gw echo.default.svc.cluster.local:80 via 172.18.0.9:15008 expecting spiffe://cluster.local/ns/istio-system/sa/eastwest, then spiffe://cluster.local/ns/default/sa/echo"
        );
        // Another network's endpoint with an address but no gateway: refused, never dialed.
        let r = peer(&route_from(&st, "client", "10.96.0.11:80"));
        assert!(r.starts_with("refused: default/nogw.default.svc.cluster.local (endpoint stray is in network \"net-b\" and names no gateway to it)"), "{r}");
        let r = peer(&route_from(&st, "client", "10.96.0.12:80"));
        assert!(r.contains("network gateway net-b/172.18.0.77 of network \"net-b\" is not a known workload or service"), "{r}");
        let r = peer(&route_from(&st, "client", "10.96.0.13:80"));
        assert!(r.contains("the service names no subjectAltNames"), "{r}");
        // A waypoint in the other network: through the gateway too, the waypoint verified inside.
        assert_eq!(
            tunnel(&route_from(&st, "client", "10.96.0.14:80")),
            "gateway gw waypointed.default.svc.cluster.local:80 via 172.18.0.9:15008 expecting spiffe://cluster.local/ns/istio-system/sa/eastwest, then spiffe://cluster.local/ns/default/sa/waypoint"
        );
        // Another network's pod address means nothing here: passed through as unknown.
        assert_eq!(
            peer(&route_from(&st, "client", "10.1.0.5:80")),
            "passthrough 10.1.0.5:80"
        );
    }

    #[test]
    fn strict_and_failover_pick_by_locality() {
        let workloads: Vec<Workload> = serde_yaml::from_str(
            "- {uid: client, name: client, namespace: default, workloadIps: [10.0.0.1], protocol: HBONE, node: n1,
   locality: {region: r1, zone: a}}
- {uid: near, name: near, namespace: default, workloadIps: [10.0.0.2], node: n1, locality: {region: r1, zone: a},
   services: {default/s.default.svc.cluster.local: {80: 8080}}}
- {uid: far, name: far, namespace: default, workloadIps: [10.0.0.3], node: n2, locality: {region: r1, zone: b},
   services: {default/s.default.svc.cluster.local: {80: 8080}}}",
        )
        .unwrap();
        let svc = |mode: &str, prefs: &str| -> Vec<Service> {
            serde_yaml::from_str(&format!(
                "- {{name: s, namespace: default, hostname: s.default.svc.cluster.local, vips: [/10.96.0.80], ports: {{80: 8080}},
   loadBalancer: {{mode: {mode}, routingPreferences: [{prefs}]}}}}"
            ))
            .unwrap()
        };
        let pick = |wls: &[Workload], mode: &str, prefs: &str| {
            let st = MeshState::build(wls.to_vec(), svc(mode, prefs), Vec::new()).unwrap();
            (0..20)
                .map(|_| peer(&route_from(&st, "client", "10.96.0.80:80")))
                .collect::<std::collections::BTreeSet<_>>()
        };
        let one = |s: &str| std::collections::BTreeSet::from([s.to_string()]);
        // Same zone first; both without preferences (STANDARD picks among all).
        assert_eq!(
            pick(&workloads, "Failover", "Region, Zone"),
            one("passthrough 10.0.0.2:8080")
        );
        assert_eq!(
            pick(&workloads, "Strict", "Node"),
            one("passthrough 10.0.0.2:8080")
        );
        assert_eq!(pick(&workloads, "Standard", "Zone").len(), 2);
        // The near endpoint gone: FAILOVER moves on, STRICT refuses.
        let without_near: Vec<Workload> = workloads
            .iter()
            .filter(|w| w.uid.0 != "near")
            .cloned()
            .collect();
        assert_eq!(
            pick(&without_near, "Failover", "Region, Zone"),
            one("passthrough 10.0.0.3:8080")
        );
        assert_eq!(
            pick(&without_near, "Strict", "Region, Zone"),
            one("refused: default/s.default.svc.cluster.local")
        );
    }
}
