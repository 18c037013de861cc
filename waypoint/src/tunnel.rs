//! One HBONE CONNECT stream into the waypoint: answered, sniffed, then served as HTTP
//! (see `http`) or relayed at L4 to an endpoint of the target over pooled HBONE, by the
//! target's L4 route if one applies (`route::l4`). On a TLS port the ClientHello is read
//! first, as Istio's waypoint reads it (`client_hello`), and passed on untouched.

pub(crate) mod client_hello;
mod direct;

use direct::{relay_plaintext, relay_tls};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Method, Request, Response, StatusCode};
use tracing::Instrument;
use ztunnel::access_log::{ConnectionLog, Side};
use ztunnel::hbone::{self, respond_status as respond, H2Stream, PoolKey};
use ztunnel::identity::Identity;
use ztunnel::metrics::{Peer, TcpLabels};
use ztunnel::state::{AppProtocol, MeshState, Protocol as MeshProtocol, Workload};

use crate::authz;
use crate::config::Config;
use crate::context::Waypoint;
use crate::detect;
use crate::extauthz;
use crate::http::{Backend, Origin, Tunnel};
use crate::network;
use crate::object::{ObjectName, ServiceKind, Target};
use crate::route::{L4Selected, RouteKind};

/// What a CONNECT target is relayed to at L4: the endpoints of the service with that VIP,
/// or the workload with that address; with an L4 route, those of the destination its
/// rule picks (by weight): the destination's port, else its Service's only port, else
/// the target's (Istio's `getWaypointDestinationCluster`), and its subset.
fn l4_backend(
    cfg: &Config,
    me: &Workload,
    root_namespace: &str,
    target: SocketAddr,
    l4_route: Option<L4Selected>,
) -> Option<Backend> {
    let state = &cfg.state;
    let from = Origin {
        me,
        target: Some(target),
        root_namespace,
    };
    if let Some(sel) = l4_route {
        let route = sel.route;
        let b = sel.rule.pick_backend(rand::random())?;
        let name = b.service(&route.namespace);
        // A VirtualService may name any Service, as in Istio; Gateway API routes need a
        // ReferenceGrant for another namespace's.
        if route.kind != RouteKind::Virtual
            && !crate::grant::permitted(&cfg.grants, route.kind.name(), &route.namespace, &name)
        {
            tracing::warn!(backend = %format!("{}/{}", name.namespace, name.name), kind = route.kind.name(),
                "route backend in another namespace without a ReferenceGrant");
            return None;
        }
        let svc = match crate::egress::backend_service(state, &route.namespace, &b.backend) {
            Ok(svc) => svc,
            Err(e) => {
                tracing::warn!(error = %e, "route backend service not found");
                return None;
            }
        };
        if let Some(ss) = b.subset.as_deref().filter(|ss| {
            crate::destination::rule_for(&cfg.destination_rules, from.client(), svc)
                .and_then(|r| r.subset(ss))
                .is_none()
        }) {
            tracing::warn!(backend = %svc.hostname, subset = ss, "no DestinationRule defines the route's subset");
            return None;
        }
        let only_port = (svc.ports.len() == 1)
            .then(|| svc.ports.keys().next().copied())
            .flatten();
        let port = b.backend.port.or(only_port).unwrap_or(target.port());
        return Some(Backend::service(cfg, &from, svc, port, b.subset.as_deref()));
    }
    if let Some(svc) = state.service_by_vip(network::get(), target.ip()) {
        return Some(Backend::service(cfg, &from, svc, target.port(), None));
    }
    // A workload outside the mesh (TCP) behind this waypoint is reached in plaintext.
    let wl = state.workload_by_ip(network::get(), target.ip())?;
    Some(Backend::workload(target, wl.clone()))
}

/// Whether this waypoint serves `target`: a service (by VIP) or workload whose
/// `waypoint` is this one. Anything else is refused: relaying it would let a client
/// reach a destination with this waypoint's identity instead of its own, skipping that
/// destination's own waypoint (or its absence), or make the waypoint dial itself.
fn serves(state: &MeshState, me: &Workload, target: SocketAddr) -> bool {
    if me.workload_ips.contains(&target.ip()) {
        return false;
    }
    // A service's waypoints: the primary and any of a weighted set (a canary serves too).
    match state.service_by_vip(network::get(), target.ip()) {
        Some(svc) => svc
            .waypoints()
            .any(|gw| state.is_waypoint(gw, &me.identity())),
        None => state
            .workload_by_ip(network::get(), target.ip())
            .and_then(|w| w.waypoint.as_ref())
            .is_some_and(|gw| state.is_waypoint(gw, &me.identity())),
    }
}

/// The target as routes and policies name it: the waypoint's Gateway and the service
/// with the target's VIP.
struct NamedTarget<'w> {
    wp: &'w Waypoint,
    service: Option<ObjectName>,
    service_kind: ServiceKind,
    port: u16,
}

impl NamedTarget<'_> {
    fn as_target(&self) -> Target<'_> {
        Target {
            gateway: &self.wp.gateway,
            service: self.service.as_ref(),
            service_kind: self.service_kind,
            root_namespace: &self.wp.root_namespace,
            port: self.port,
        }
    }
}

fn l7_target<'w>(wp: &'w Waypoint, state: &MeshState, target: SocketAddr) -> NamedTarget<'w> {
    let svc = state.service_by_vip(network::get(), target.ip());
    let service = svc.map(|s| ObjectName {
        namespace: s.namespace.clone(),
        name: s.name.clone(),
    });
    NamedTarget {
        wp,
        service,
        service_kind: svc.map(|s| ServiceKind::of(s)).unwrap_or_default(),
        port: target.port(),
    }
}

pub async fn handle(
    wp: Arc<Waypoint>,
    req: Request<h2::RecvStream>,
    mut tx: SendResponse<Bytes>,
    peer: SocketAddr,
    src_identity: Identity,
    trace: hbone::TraceParent,
) {
    let _active = wp.drain.track();
    let start = Instant::now();
    let target = match hbone::connect_target(&req) {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "bad HBONE request");
            return respond(tx, StatusCode::BAD_REQUEST);
        }
    };
    let cfg = wp.config.load();
    // Our own entry as the current config has it (its service memberships may change).
    let me = cfg.state.workload_by_uid(&wp.me.uid).unwrap_or(&wp.me);
    if !serves(&cfg.state, me, target) {
        tracing::warn!(dst.addr = %target, src.identity = %src_identity, response_flags = "NR",
            "CONNECT target is not a service or workload that uses this waypoint; refused");
        return respond(tx, StatusCode::SERVICE_UNAVAILABLE);
    }
    let tcp_routed = cfg
        .tcp_routes
        .iter()
        .any(|r| r.attaches_to(&l7_target(&wp, &cfg.state, target).as_target()));
    let protocol = port_protocol(&cfg.state, target);
    let handling = handling(tcp_routed, protocol);
    drop(cfg);
    // The tunnel must be open before its first bytes can tell HTTP from anything else.
    let ok = Response::builder()
        .status(StatusCode::OK)
        .body(())
        .unwrap_or_default();
    let mut down_send = match tx.send_response(ok, false) {
        Ok(s) => s,
        Err(e) => return tracing::debug!(error = %e, "client went away"),
    };
    let mut down_recv = req.into_body();
    let tunnel = Arc::new(Tunnel {
        src_identity,
        src_addr: peer,
        target,
        trace,
    });
    let sniffed = match handling {
        // A TLS port: the ClientHello first, as Envoy's tls_inspector reads it there.
        Handling::Opaque if protocol == AppProtocol::Tls => {
            let (hello, first) = match client_hello::read(&mut down_recv, client_hello::TIMEOUT)
                .await
            {
                Ok(x) => x,
                // A client that just opens and closes (a port check) is no news.
                Err(e @ client_hello::HelloError::Ended) => {
                    return tracing::debug!(src.identity = %tunnel.src_identity, dst.addr = %target, error = %e, "TLS port: no ClientHello")
                }
                Err(e) => {
                    tracing::warn!(src.identity = %tunnel.src_identity, dst.addr = %target, error = %e, "TLS port: no ClientHello; tunnel closed");
                    return down_send.send_reset(h2::Reason::CANCEL);
                }
            };
            let (span, sni) = match hello {
                client_hello::Hello::Tls { sni } => (
                    tracing::info_span!("tls", sni = sni.as_deref().unwrap_or("")),
                    sni,
                ),
                client_hello::Hello::NotTls => {
                    (tracing::info_span!("tls", sni = "", not_tls = true), None)
                }
            };
            return relay(wp, tunnel, down_send, down_recv, (first, sni), start)
                .instrument(span)
                .await;
        }
        Handling::Opaque => {
            return relay(
                wp,
                tunnel,
                down_send,
                down_recv,
                (Bytes::new(), None),
                start,
            )
            .await
        }
        Handling::Http => {
            detect::sniff(
                &mut down_recv,
                crate::http::HEADER_READ_TIMEOUT,
                detect::Expect::Http,
            )
            .await
        }
        Handling::Sniff => {
            detect::sniff(&mut down_recv, wp.detect_timeout, detect::Expect::Any).await
        }
    };
    let (proto, first) = match sniffed {
        Ok(x) => x,
        Err(e @ detect::SniffError::Silent(_)) => {
            tracing::debug!(src.identity = %tunnel.src_identity, dst.addr = %target, error = %e, "no HTTP request on an HTTP port; tunnel closed");
            return down_send.send_reset(h2::Reason::CANCEL);
        }
        Err(e) => return tracing::debug!(error = %e, "tunnel ended before its protocol was known"),
    };
    // On an HTTP port `sniff` never answers opaque: only a port of unknown protocol relays.
    if proto.is_http() {
        let mut io = H2Stream::new(down_send, down_recv, None);
        io.unread(first);
        return crate::http::serve(wp, tunnel, io, proto).await;
    }
    relay(wp, tunnel, down_send, down_recv, (first, None), start).await
}

/// The protocol the target's service port declares (Istio's, from the port's name or
/// `appProtocol`); a workload addressed directly has none.
fn port_protocol(state: &MeshState, target: SocketAddr) -> AppProtocol {
    state
        .service_by_vip(network::get(), target.ip())
        .map(|s| s.app_protocol(target.port()))
        .unwrap_or_default()
}

/// How a tunnel's bytes are taken, as Istio's waypoint builds its filter chains per port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handling {
    /// Relayed at L4 without looking for HTTP: a TCPRoute, or a TCP/TLS port.
    Opaque,
    /// HTTP only: a port that declares HTTP, HTTP2 or gRPC. A client that does not speak
    /// HTTP there is refused (400, or a reset), never relayed: else it could skip the L7
    /// policies and header handling by pausing or padding its request.
    Http,
    /// Unknown protocol: HTTP if the first bytes say so, else opaque.
    Sniff,
}

fn handling(tcp_routed: bool, port: AppProtocol) -> Handling {
    if tcp_routed {
        return Handling::Opaque;
    }
    match port {
        AppProtocol::Http11 | AppProtocol::Http2 | AppProtocol::Grpc => Handling::Http,
        AppProtocol::Tcp | AppProtocol::Tls => Handling::Opaque,
        AppProtocol::Unknown => Handling::Sniff,
    }
}

/// What the target's policies make of an opaque connection before a byte is relayed.
#[derive(Debug, PartialEq)]
struct L4Plan {
    /// A CUSTOM policy with a gRPC provider matches: the connection is checked first, as
    /// Envoy's network ext_authz filter (which runs before the RBAC filters) does.
    check: Option<(extauthz::provider::GrpcProvider, String)>,
    /// The DENY and ALLOW policies' verdict.
    verdict: Result<(), String>,
}

/// Whether opaque (non-HTTP) traffic may pass under the target's policies, judged by
/// their TCP form (`AuthorizationPolicy::for_tcp`): otherwise a client could dodge an
/// HTTP deny by making its request look like something else (a bare `\n` line end, a
/// pause before the request line). A CUSTOM policy that would check the connection has
/// it checked by its gRPC provider, or denies it when the provider cannot check TCP
/// (see `extauthz`): `Err` is that denial.
fn l4_plan(
    tunnel: &Tunnel,
    policies: &[&authz::AuthorizationPolicy],
    providers: &extauthz::Providers,
) -> Result<L4Plan, String> {
    let tcp: Vec<authz::AuthorizationPolicy> = policies.iter().map(|p| p.for_tcp()).collect();
    let headers = http::HeaderMap::new();
    let req = authz::Request {
        source_principal: Some(&tunnel.src_identity),
        source_ip: tunnel.src_addr.ip(),
        destination_port: tunnel.target.port(),
        host: "",
        method: "",
        path: "",
        headers: &headers,
        auth: None,
    };
    // CUSTOM first, as for HTTP.
    let check = match extauthz::decide_tcp(providers, &tcp, &req) {
        extauthz::Custom::Skip => None,
        extauthz::Custom::Deny { policy, reason } => {
            return Err(format!("denied by {policy}: {reason}"))
        }
        extauthz::Custom::Check {
            provider: extauthz::Provider::Grpc(g),
            policy,
        } => Some((g.clone(), policy)),
        // decide_tcp denies every other provider on TCP; should that change, still deny.
        extauthz::Custom::Check { policy, .. } => {
            return Err(format!(
                "denied by {policy}: its provider cannot check opaque TCP"
            ))
        }
    };
    let verdict = authz::evaluate(&tcp, &req);
    let verdict = if verdict.allowed {
        Ok(())
    } else {
        Err(verdict
            .denied_by
            .map(|p| format!("denied by {p}"))
            .unwrap_or_else(|| "no ALLOW policy matches TCP traffic".into()))
    };
    Ok(L4Plan { check, verdict })
}

/// `l4_plan`, with its check made: `Err` says why the connection is denied.
async fn l4_allowed(
    wp: &Waypoint,
    cfg: &Config,
    tunnel: &Tunnel,
    policies: &[&authz::AuthorizationPolicy],
) -> Result<(), String> {
    let plan = l4_plan(tunnel, policies, &cfg.providers)?;
    if let Some((provider, policy)) = &plan.check {
        let msg = extauthz::check::tcp_check_message(
            tunnel.src_addr,
            &tunnel.src_identity,
            tunnel.target,
            &wp.identity,
        );
        match crate::http::ext_authz::check_connection(wp, cfg, provider, &msg).await {
            extauthz::Decision::Deny(d) => {
                return Err(match d.error {
                    Some(e) => format!("denied by {policy}: ext_authz check failed: {e}"),
                    None => format!("denied by {policy}: ext_authz denied the connection"),
                })
            }
            extauthz::Decision::Allow(a) => {
                if let Some(e) = a.failed_open {
                    tracing::warn!(policy = %policy, error = %e, "ext_authz check failed; the provider fails open");
                }
            }
        }
    }
    plan.verdict
}

async fn relay(
    wp: Arc<Waypoint>,
    tunnel: Arc<Tunnel>,
    mut down_send: h2::SendStream<Bytes>,
    down_recv: h2::RecvStream,
    // The bytes already read, and the SNI of a TLS port's ClientHello.
    (first, sni): (Bytes, Option<String>),
    start: Instant,
) {
    let cfg = wp.config.load_full();
    let target = tunnel.target;
    let named = l7_target(&wp, &cfg.state, target);
    let l7_target = named.as_target();
    // The target's L4 route: by its service port and hostname, never the bytes.
    let hostname = cfg
        .state
        .service_by_vip(network::get(), target.ip())
        .map(|s| s.hostname.clone());
    let l4_route = crate::route::select_l4(
        &cfg.l4_routes,
        &cfg.tcp_routes,
        &l7_target,
        hostname.as_deref(),
    );
    if let Some(sel) = &l4_route {
        tracing::debug!(route = %format!("{}/{}", sel.route.namespace, sel.route.name), kind = sel.route.kind.name(),
            rule = %format!("{}[{}]", if sel.tls { "tls" } else { "tcp" }, sel.index), "L4 route");
    }
    // HTTP routes on the target mean it speaks HTTP: bytes that don't look like HTTP
    // must not slip past the routes (and the trusted-header handling) as opaque TCP,
    // unless an L4 route says where they go.
    if l4_route.is_none() && cfg.routes.iter().any(|r| r.attaches_to(&l7_target)) {
        tracing::warn!(src.identity = %tunnel.src_identity, dst.addr = %target, response_flags = "NR",
            "non-HTTP traffic to a target with HTTPRoutes; refused");
        down_send.send_reset(h2::Reason::REFUSED_STREAM);
        return;
    }
    let policies: Vec<&authz::AuthorizationPolicy> = cfg
        .policies
        .iter()
        .filter(|p| p.applies_to(&l7_target))
        .collect();
    if !policies.is_empty() {
        if let Err(reason) = l4_allowed(&wp, &cfg, &tunnel, &policies).await {
            tracing::warn!(src.identity = %tunnel.src_identity, dst.addr = %target, response_flags = "DENY", reason, "opaque connection denied");
            down_send.send_reset(h2::Reason::REFUSED_STREAM);
            return;
        }
    }
    let Some(mut backend) = l4_backend(&cfg, wp.me_in(&cfg), &wp.root_namespace, target, l4_route)
    else {
        tracing::warn!(dst.addr = %target, response_flags = "UH", "no healthy mesh endpoint for the target");
        return down_send.send_reset(h2::Reason::REFUSED_STREAM);
    };
    // A DYNAMIC_DNS wildcard entry's TLS port, with the opt-in: the SNI's host (one the
    // wildcard covers), at the service port, as Envoy's SNI dynamic forward proxy.
    if wp.wildcard_tls {
        if let Err(why) =
            crate::egress::send_to_sni(&cfg.state, &mut backend, sni.as_deref(), target.port())
        {
            tracing::warn!(dst.addr = %target, response_flags = "NR", error = %why, "TLS to a DYNAMIC_DNS entry refused");
            return down_send.send_reset(h2::Reason::REFUSED_STREAM);
        }
    }
    if let Err(why) = backend.resolve(&wp.resolver, &wp.me).await {
        tracing::warn!(dst.addr = %target, response_flags = "UH", error = %why, "no endpoint for the target");
        return down_send.send_reset(h2::Reason::REFUSED_STREAM);
    }
    let traffic = backend.policy.clone();
    if let Some(t) = traffic.as_deref().filter(|t| t.refused.is_some()) {
        tracing::warn!(dst.addr = %target, destination_rule = %t.rule, reason = t.refused.as_deref().unwrap_or_default(), response_flags = "UF",
            "DestinationRule cannot be applied exactly; connection refused");
        return down_send.send_reset(h2::Reason::REFUSED_STREAM);
    }
    // The DestinationRule's load balancing; of the consistent hashes only the source IP's
    // has a key on TCP (the others pick at random, as Envoy's ring without a key).
    let pick = traffic.as_ref().and_then(|t| t.pick.clone());
    let hash = (pick == Some(crate::destination::Pick::HashSourceIp))
        .then(|| crate::lb::hash_of(tunnel.src_addr.ip()));
    let choice = crate::lb::Choice {
        pick,
        hash,
        ..crate::lb::Choice::default()
    };
    let Some(picked) = wp.balancer.pick_with(&backend.endpoints, &[], &choice) else {
        tracing::warn!(dst.addr = %target, response_flags = "UH", "no healthy mesh endpoint for the target");
        return down_send.send_reset(h2::Reason::REFUSED_STREAM);
    };
    let (upstream_target, endpoint, service) = (
        picked.addr,
        picked.workload.clone(),
        backend.service.clone(),
    );
    let ep_ip = upstream_target.ip();
    // DestinationRule tcp.maxConnections: connections in flight to the Service.
    let _connection_slot = match (
        traffic.as_ref().and_then(|t| t.max_connections),
        service.as_deref(),
    ) {
        (Some(max), Some(svc)) => match wp.circuits.take(
            &svc.namespaced_hostname().to_string(),
            crate::lb::Limit::Connections,
            max,
        ) {
            Some(slot) => Some(slot),
            None => {
                tracing::warn!(dst.addr = %target, response_flags = "UO", "circuit open: too many connections to the service");
                return down_send.send_reset(h2::Reason::REFUSED_STREAM);
            }
        },
        _ => None,
    };
    // The rule's connectTimeout and tcpKeepalive hold for opaque TCP too (Envoy's cluster).
    let reuse = traffic.as_ref().map(|t| t.reuse).unwrap_or_default();
    if traffic.as_ref().is_some_and(|t| t.tls.is_some()) {
        let mut ep = crate::upstream::Endpoint::of(
            &cfg.state,
            upstream_target,
            &endpoint,
            service.as_deref(),
        );
        ep.tls = backend.tls_target(None, ep_ip, false);
        ep.reuse = reuse;
        ep.trace = tunnel.trace.child();
        return relay_tls(&wp, &tunnel, down_send, down_recv, first, ep, start).await;
    }
    if endpoint.protocol != MeshProtocol::HBONE {
        // Outside the mesh: plain TCP from the waypoint's pod (Istio's waypoint does the same).
        return relay_plaintext(
            &wp,
            &tunnel,
            down_send,
            down_recv,
            first,
            (upstream_target, reuse),
            start,
        )
        .await;
    }
    let expected = cfg.state.expected_identities(&endpoint, service.as_deref());
    let key = PoolKey::new(
        wp.identity.clone(),
        expected,
        SocketAddr::new(ep_ip, ztunnel::ports::HBONE),
        wp.ip,
    );
    let up_req = Request::builder()
        .method(Method::CONNECT)
        .uri(upstream_target.to_string())
        .header(
            "forwarded",
            hbone::request::forwarded(
                tunnel.src_addr,
                service.as_deref().map(|s| s.hostname.as_str()),
            ),
        )
        // The tunnel's trace goes on, with this hop as the parent.
        .header("traceparent", tunnel.trace.child().header())
        .body(());
    let Ok(up_req) = up_req else {
        return down_send.send_reset(h2::Reason::INTERNAL_ERROR);
    };
    let src_wl = cfg
        .state
        .workload_by_ip(network::get(), tunnel.src_addr.ip())
        .filter(|w| w.identity() == tunnel.src_identity)
        .cloned();
    let dst_identity = endpoint.identity();
    // Boxed: the label set (~1 KB) is needed only until the connection's counters
    // are fetched; inline it would stay in the connection's future for its life.
    let labels = Box::new(TcpLabels::new(
        "waypoint",
        Peer {
            workload: src_wl.as_deref(),
            identity: Some(&tunnel.src_identity),
        },
        Peer {
            workload: Some(&endpoint),
            identity: Some(&dst_identity),
        },
        service.as_deref(),
        true,
    ));
    let connect = wp.pool.connect(&key, &wp.netns, up_req);
    let connected = match reuse.connect_timeout {
        Some(t) => tokio::time::timeout(t, connect).await.unwrap_or_else(|_| {
            Err(hbone::HboneError::Timeout {
                peer: upstream_target.to_string(),
                after: t,
            })
        }),
        None => connect.await,
    };
    let (mut up_send, up_recv, guard) = match connected {
        Ok(u) => u,
        Err(e) => {
            wp.metrics.failed(&labels, "CONNECT");
            tracing::warn!(dst.addr = %upstream_target, error = %e, response_flags = "UF", "upstream HBONE failed");
            // The tunnel is already open: a reset is how the client learns of the failure.
            return down_send.send_reset(h2::Reason::REFUSED_STREAM);
        }
    };
    // Telemetry metric overrides of the TCP metrics, when any are in force.
    let applied = cfg.telemetry.for_target(&l7_target);
    let conn = match applied.tcp.as_ref() {
        None => wp.metrics.opened(&labels),
        Some(o) => wp.metrics.opened_overridden(&labels, o),
    };
    drop(labels);
    let sniffed = first.len() as u64;
    if !first.is_empty() {
        if let Err(e) = up_send.send_data(first, false) {
            // Opened, so counted closed too (nothing reached the backend).
            conn.closed(0, 0);
            return tracing::debug!(error = %e, "upstream stream failed");
        }
    }
    // The bytes of a long connection are counted as it goes (Telemetry
    // reportingInterval, Istio's 5 s by default), not only when it ends.
    let every = applied
        .tcp_reporting
        .unwrap_or(crate::telemetry::TCP_REPORTING);
    // What has been counted so far (client to backend, back), so each report adds the
    // new bytes only.
    let counted = [AtomicU64::new(0), AtomicU64::new(0)];
    let report = |sent: u64, received: u64| {
        let up =
            (sent + sniffed).saturating_sub(counted[0].swap(sent + sniffed, Ordering::Relaxed));
        let down = received.saturating_sub(counted[1].swap(received, Ordering::Relaxed));
        conn.count(up, down);
    };
    let r = ztunnel::relay::copy_h2_h2(
        down_send,
        down_recv,
        up_send,
        up_recv,
        reuse.opaque_idle(wp.idle_timeout),
        Some((every, &report)),
        reuse.max_age,
    )
    .await;
    drop(guard);
    let (t, err) = match r {
        Ok(t) => (t, None),
        Err((e, t)) => (t, Some(e.to_string())),
    };
    // What the client sent (sniffed bytes included) went to the backend; the rest came back.
    let [up, down] = counted.map(AtomicU64::into_inner);
    conn.closed(
        (t.sent + sniffed).saturating_sub(up),
        t.received.saturating_sub(down),
    );
    ConnectionLog {
        direction: "waypoint",
        protocol: "TCP",
        src_addr: tunnel.src_addr,
        src: Side {
            workload: src_wl.as_deref(),
            identity: Some(&tunnel.src_identity),
            baggage: None,
        },
        dst_addr: key.dst,
        dst_hbone_addr: Some(upstream_target.into()),
        dst_service: service.as_deref(),
        dst: Side {
            workload: Some(&endpoint),
            identity: Some(&dst_identity),
            baggage: None,
        },
        bytes_sent: t.sent + sniffed,
        bytes_recv: t.received,
        duration: start.elapsed(),
        error: err,
    }
    .write();
}

#[cfg(test)]
mod tests;
