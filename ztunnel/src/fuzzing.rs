//! Entry points for the cargo-fuzz targets in `fuzz/` (not an API: they may change with
//! the targets). Each takes the fuzzer's bytes, runs them through the same code the data
//! plane runs on input from the network, files, istiod or the CNI agent, and asserts
//! properties that must hold for any input. A panic here is a bug in the data plane.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::OnceLock;

use prost::Message;

use crate::config::LocalConfig;
use crate::state::{MeshState, SharedState, Workload};

#[cfg(any(test, feature = "fuzzing"))]
mod rbac_model;
#[cfg(any(test, feature = "fuzzing"))]
pub use rbac_model::rbac_model;

/// Runs every committed input of `target`, `fuzz_dir/corpus/<target>/` and
/// `fuzz_dir/regressions/<target>/`, through `f` (the unit tests' replay of what the
/// fuzzers start from and once crashed on); panics naming the file an input panicked on.
/// Returns how many inputs ran.
pub fn replay_committed(fuzz_dir: &Path, target: &str, f: fn(&[u8])) -> usize {
    let mut replayed = 0;
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz_dir.join(kind).join(target)) else {
            continue;
        };
        for entry in entries {
            let path = entry
                .unwrap_or_else(|e| panic!("list {}: {e}", fuzz_dir.display()))
                .path();
            let bytes =
                std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            if std::panic::catch_unwind(|| f(&bytes)).is_err() {
                panic!(
                    "{target} panics on {} (its message is above)",
                    path.display()
                );
            }
            replayed += 1;
        }
    }
    replayed
}

/// Input larger than this is cut: every parser here sees bounded messages in production
/// (HTTP/2 header lists, a 64 KiB ZDS packet, a 64 KiB DNS message).
const MAX_INPUT: usize = 64 * 1024;

fn bounded(data: &[u8]) -> &[u8] {
    &data[..data.len().min(MAX_INPUT)]
}

/// HBONE CONNECT requests: line 1 the method, line 2 the request target, then
/// `name: value` header lines (as h2 would hand them to us).
pub fn hbone_connect(data: &[u8]) {
    let mut lines = bounded(data).split(|b| *b == b'\n');
    let method = lines.next().unwrap_or_default();
    let target = lines.next().unwrap_or_default();
    let mut b = http::Request::builder().method(method).uri(target);
    for line in lines {
        if let Some(colon) = line.iter().position(|b| *b == b':') {
            b = b.header(&line[..colon], &line[colon + 1..]);
        }
    }
    let Ok(req) = b.body(()) else { return };
    check_baggage(req.headers());
    check_connect(&req);
    // h2 builds a CONNECT request's URI from :authority alone.
    if let Ok(uri) = http::Uri::try_from(target) {
        if let Ok(req) = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(uri)
            .body(())
        {
            check_connect(&req);
        }
    }
}

/// A peer's baggage (request or response): either refused whole, or fields within the
/// bounds that print back as a header parsing to the same.
fn check_baggage(headers: &http::HeaderMap) {
    use crate::baggage::{Baggage, MAX_VALUE_BYTES};
    let Ok(b) = Baggage::of(headers) else { return };
    let fields = [
        &b.cluster_id,
        &b.namespace,
        &b.workload_name,
        &b.service_name,
        &b.revision,
        &b.region,
        &b.zone,
    ];
    for v in fields.into_iter().flatten() {
        assert!(!v.is_empty() && v.len() <= MAX_VALUE_BYTES, "{v:?}");
        assert!(!v.contains(',') && !v.contains('='), "{v:?}");
    }
    let mut again = http::HeaderMap::new();
    let value = http::HeaderValue::try_from(b.header_value("deployment"))
        .expect("parsed baggage prints as a header value");
    again.insert(crate::baggage::HEADER, value);
    assert_eq!(Baggage::of(&again).as_ref(), Ok(&b));
}

fn check_connect(req: &http::Request<()>) {
    let Ok(addr) = crate::hbone::connect_target(req) else {
        return;
    };
    assert_eq!(req.method(), http::Method::CONNECT);
    // What we tunnel to is exactly what the authority says, with nothing else in the URI.
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str())
        .unwrap_or_default();
    assert_eq!(
        authority.parse::<SocketAddr>().ok(),
        Some(addr),
        "authority {authority:?}"
    );
    assert!(
        !authority.contains('@'),
        "userinfo accepted in {authority:?}"
    );
    // The address prints back as an authority that parses to itself (IPv6 in brackets).
    assert_eq!(addr.to_string().parse::<SocketAddr>().ok(), Some(addr));
}

/// The local config file: parse, validate, build the state, and use it as connections do.
pub fn config_yaml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(bounded(data)) else {
        return;
    };
    let path = Path::new("fuzz.yaml");
    let Ok(cfg) = LocalConfig::parse(path, text) else {
        return;
    };
    let Ok(state) = cfg.into_state(path) else {
        return;
    };
    exercise_state(&state);
}

/// Runs the per-connection lookups over every workload and service of `state`.
fn exercise_state(state: &MeshState) {
    for w in state.workloads() {
        let _ = w.identity().to_string();
        let _ = state.expected_identities(w, None);
        for ip in &w.workload_ips {
            assert!(state.workload_by_ip(&w.network, *ip).is_some());
            let conn = crate::rbac::Connection {
                src_identity: Some(std::sync::Arc::new(w.identity())),
                src_ip: *ip,
                dst: SocketAddr::new(*ip, 80),
            };
            let _ = state.authorize(w, &conn);
        }
        if let Some(gw) = &w.waypoint {
            let _ = state.waypoint_workload(gw, &w.network);
        }
        if let Some(gw) = &w.network_gateway {
            let _ = state.network_gateway(
                gw,
                w,
                SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 80),
            );
        }
        let _ = state.is_network_gateway(w);
        for (svc, ports) in &w.services {
            let host = svc.0.split_once('/').map_or("", |(_, h)| h);
            for port in ports.keys() {
                let _ = state.hostname_target(w, host, *port);
            }
        }
        if let Some(t) = crate::state::ApplicationTunnel::effective(w.application_tunnel) {
            assert!(
                t.validate().is_ok(),
                "an invalid application tunnel got into the state: {t:?}"
            );
        }
        let _ = crate::admin::config_dump::workload(w);
    }
    for s in state.services() {
        for port in s.ports.keys() {
            for (_, target) in state.endpoints_for(s, *port) {
                assert_ne!(target, 0, "endpoint target port 0 for {}", s.hostname);
            }
        }
        for gw in s.waypoints() {
            let _ = state.waypoint_workload(gw, "");
        }
        let _ = crate::state::pick_waypoint(s);
        for vip in &s.vips {
            for w in state.workloads() {
                let _ = state.is_waypoint_of(&vip.network, vip.address, w);
            }
        }
    }
    let _ = crate::dns::resolver::MeshIndex::build(state, "cluster.local");
}

/// xDS responses: byte 0 picks the type (even: Address, odd: Authorization); then
/// resources, each a 2-byte big-endian length and that many bytes of protobuf.
pub fn xds_resources(data: &[u8]) {
    let data = bounded(data);
    let Some((&kind, mut rest)) = data.split_first() else {
        return;
    };
    let type_url = if kind & 1 == 0 {
        crate::xds::ADDRESS_TYPE
    } else {
        crate::xds::AUTHORIZATION_TYPE
    };
    let mut bodies = Vec::new();
    while let Some(len) = rest
        .get(..2)
        .map(|l| usize::from(u16::from_be_bytes([l[0], l[1]])))
    {
        let body = &rest[2..(2 + len).min(rest.len())];
        bodies.push(body);
        rest = &rest[2 + body.len()..];
    }
    // Each resource converts on its own, as the store does it, and a converted one must
    // survive the state build.
    for b in &bodies {
        match crate::xds::convert::decode_address(b) {
            Ok(crate::xds::convert::Address::Workload(w)) => {
                if let Some(t) = w.application_tunnel {
                    assert!(t.validate().is_ok());
                }
            }
            Ok(crate::xds::convert::Address::Service(_)) | Err(_) => {}
        }
        let _ = crate::xds::convert::decode_authorization(b);
        // An authorization either converts or becomes a deny-all: never nothing.
        match crate::xds::convert::authorization_or_deny_all("ns/name", b) {
            (p, None) => assert!(p.unenforceable.is_none()),
            (p, Some(_)) => assert!(
                p.action == crate::rbac::PolicyAction::Deny
                    && p.unenforceable.is_some()
                    && p.rules.iter().any(Vec::is_empty)
            ),
        }
    }
    let names: Vec<String> = (0..bodies.len()).map(|i| format!("r{}", i % 4)).collect();
    let incoming: Vec<crate::xds::store::Incoming<'_>> = bodies
        .iter()
        .zip(&names)
        .map(|(b, n)| crate::xds::store::Incoming {
            name: n,
            version: "1",
            bytes: b,
        })
        .collect();
    let shared = std::sync::Arc::new(SharedState::default());
    let store = crate::xds::Store::new(shared.clone());
    let errors = store.apply(type_url, &incoming, &[]);
    assert!(errors.len() <= incoming.len());
    exercise_state(&shared.load());
    // A removal of everything leaves an empty state.
    store.apply(type_url, &[], &names);
    assert_eq!(
        shared.load().workloads().count() + shared.load().policies().count(),
        0
    );
}

fn zds_workload() -> &'static Workload {
    static W: OnceLock<Workload> = OnceLock::new();
    W.get_or_init(|| {
        let cfg = "workloads:\n- {uid: u, name: pod, namespace: ns, serviceAccount: sa, workloadIps: [10.0.0.1]}\n";
        let mut cfg = LocalConfig::parse(Path::new("zds.yaml"), cfg).unwrap_or_default();
        cfg.workloads.pop().unwrap_or_else(|| unreachable!("the fixed config has one workload"))
    })
}

/// ZDS packets (one protobuf message each, at most 64 KiB): decoded as each message
/// type, re-encoded and decoded again to the same value; an Add's pod info is checked
/// against the mesh's workload.
pub fn zds_message(data: &[u8]) {
    let data = bounded(data);
    if let Ok(req) = crate::zds::WorkloadRequest::decode(data) {
        assert_eq!(
            crate::zds::WorkloadRequest::decode(req.encode_to_vec().as_slice())
                .ok()
                .as_ref(),
            Some(&req)
        );
        if let Some(crate::zds::Payload::Add(add)) = &req.payload {
            let uid = crate::state::WorkloadUid(add.uid.clone());
            if let Some(info) = &add.workload_info {
                let w = zds_workload();
                let same = info.name == w.name
                    && info.namespace == w.namespace
                    && info.service_account == w.service_account;
                assert_eq!(crate::zds::check_workload_info(&uid, info, w).is_ok(), same);
            }
        }
    }
    if let Ok(hello) = crate::zds::ZdsHello::decode(data) {
        assert_eq!(
            crate::zds::ZdsHello::decode(hello.encode_to_vec().as_slice()).ok(),
            Some(hello)
        );
    }
    if let Ok(resp) = crate::zds::WorkloadResponse::decode(data) {
        assert_eq!(
            crate::zds::WorkloadResponse::decode(resp.encode_to_vec().as_slice()).ok(),
            Some(resp)
        );
    }
}

const DNS_STATE: &str = r#"
workloads:
- {uid: c, name: client, namespace: default, workloadIps: [10.10.1.11], protocol: HBONE, node: n1}
- {uid: h1, name: h1, namespace: default, workloadIps: [10.10.1.21, "fd00::21"], services: {default/headless.default.svc.cluster.local: {}}}
services:
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10", "/fd00::10"]}
- {name: echo, namespace: other, hostname: echo.other.svc.cluster.local, vips: ["/10.96.0.11"]}
- {name: headless, namespace: default, hostname: headless.default.svc.cluster.local}
- {name: wild, namespace: default, hostname: "*.wild.example.com", vips: ["/10.96.0.12"]}
- {name: ext, namespace: default, hostname: api.example.com, vips: ["/10.96.0.13"]}
"#;

fn dns_fixture() -> &'static (crate::dns::resolver::MeshIndex, Workload) {
    static F: OnceLock<(crate::dns::resolver::MeshIndex, Workload)> = OnceLock::new();
    F.get_or_init(|| {
        let path = Path::new("dns.yaml");
        let cfg = LocalConfig::parse(path, DNS_STATE).unwrap_or_default();
        let client = cfg
            .workloads
            .first()
            .cloned()
            .unwrap_or_else(|| unreachable!("the fixed config has a client"));
        let state = cfg.into_state(path).unwrap_or_default();
        (
            crate::dns::resolver::MeshIndex::build(&state, "cluster.local"),
            client,
        )
    })
}

/// A DNS message from a pod, over UDP and TCP, against a small fixed mesh state.
pub fn dns_message(data: &[u8]) {
    let data = bounded(data);
    let (index, client) = dns_fixture();
    for transport in [crate::dns::Transport::Udp, crate::dns::Transport::Tcp] {
        match crate::dns::answer_locally(index, client, data, transport) {
            crate::dns::Local::Drop(_) => {}
            crate::dns::Local::Reject(resp, _) => {
                assert!(resp.len() >= 12);
                assert_eq!(resp[..2], data[..2], "the id is echoed");
                assert!(resp[2] & 0x80 != 0, "a response");
            }
            crate::dns::Local::Mesh { response, .. } => {
                let max = match transport {
                    crate::dns::Transport::Udp => 4096,
                    crate::dns::Transport::Tcp => 65535,
                };
                assert!(response.len() <= max);
                assert!(response.len() >= 12, "an encodable mesh answer");
                assert_eq!(response[..2], data[..2], "the id is echoed");
            }
            crate::dns::Local::Forward { request, limit, .. } => {
                assert_eq!(request.queries.len(), 1);
                assert!((512..=65535).contains(&limit));
            }
        }
    }
}

/// PROXY protocol v2 headers: strict parsing, and what parses re-encodes to the same bytes.
pub fn proxy_protocol(data: &[u8]) {
    use crate::proxy_protocol::{
        encode, parse, Addresses, Command, ProxyProtocolError, Transport, FIXED_LEN,
    };
    match parse(data) {
        Ok((h, n)) => {
            assert!(n >= FIXED_LEN && n <= data.len());
            assert_eq!(
                n,
                FIXED_LEN + usize::from(u16::from_be_bytes([data[14], data[15]]))
            );
            if let (Command::Proxy, Transport::Stream, Addresses::Ip { src, dst }) =
                (h.command, h.transport, &h.addresses)
            {
                let tlvs: Vec<(u8, &[u8])> = h
                    .tlvs
                    .iter()
                    .map(|t| (t.kind, t.value.as_slice()))
                    .collect();
                let again = encode(*src, *dst, &tlvs)
                    .unwrap_or_else(|e| panic!("a parsed header does not re-encode: {e}"));
                assert_eq!(again, data[..n], "re-encoding differs");
                let same_family = matches!(
                    (src.ip(), dst.ip()),
                    (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
                );
                assert!(same_family);
            }
        }
        Err(ProxyProtocolError::Incomplete { needed, have }) => {
            assert!(needed > have && have == data.len());
            // Nothing but a prefix of the signature or a header cut short gets here.
            assert!(needed <= FIXED_LEN + 65535);
        }
        Err(_) => {}
    }
}

/// Seed corpora for `fuzz/corpus/<target>/`: `ZTUNNEL_FUZZ_SEEDS=fuzz/corpus cargo test
/// -p ztunnel --lib fuzzing::write_seeds -- --ignored`.
#[cfg(test)]
mod seeds;
