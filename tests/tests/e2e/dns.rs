//! The DNS proxy end to end: node 1 runs the enrolled client pod n1p1 (namespace
//! `default`), node 2 a pod outside the mesh, n2p1 (10.10.2.11), that plays the upstream
//! DNS server: the pod's resolver and ztunnel's `--dns-upstream`. The client asks that
//! server over UDP and TCP on port 53, as any resolver would; capture sends the questions
//! to the DNS proxy in the pod, which answers mesh names itself and forwards the rest
//! from node 1 (so the fake server sees node 1's address, never the pod's, for them).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, SOA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use mesh_tests::netsim::*;

const UPSTREAM_IP: [u8; 4] = [10, 10, 2, 11];
/// n2p1's IPv6 address in a dual-stack topology.
const UPSTREAM_IP6: &str = "fd00:10:2::11";
const VIP: &str = "10.96.0.10";
const EXTERNAL_IP: &str = "203.0.113.7";
const EXTERNAL_IP6: &str = "2001:db8::7";
const CLIENT_TIMEOUT: Duration = Duration::from_secs(8);

fn upstream() -> SocketAddr {
    SocketAddr::from((UPSTREAM_IP, 53))
}

/// A query the fake upstream saw: (source IP, "udp"/"tcp", name, type).
type Seen = (IpAddr, &'static str, String, RecordType);

/// The fake upstream resolver: UDP and TCP on port 53 in a pod netns, on threads of its own.
/// external.example has an address, big.example 100 of them (truncated over UDP),
/// db.external.example (through a CNAME) and direct.external.example the fake's own,
/// silent.example never gets an answer, anything else is NXDOMAIN.
struct FakeUpstream {
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl FakeUpstream {
    /// Listens on `[::]:53`, both families (IPv4 clients recorded as IPv4).
    fn start(ns: &Netns) -> Result<FakeUpstream> {
        let udp = ns.run(|| UdpSocket::bind("[::]:53"))??;
        udp.set_read_timeout(Some(Duration::from_millis(100)))?;
        let tcp = ns.run(|| std::net::TcpListener::bind("[::]:53"))??;
        tcp.set_nonblocking(true)?;
        let (seen, stop) = (
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(AtomicBool::new(false)),
        );
        let (s, st) = (seen.clone(), stop.clone());
        let udp_thread = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !st.load(Ordering::Relaxed) {
                let Ok((n, peer)) = udp.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(resp) = fake_answer(&buf[..n], "udp", peer.ip().to_canonical(), &s) {
                    let _ = udp.send_to(&resp, peer);
                }
            }
        });
        let (s, st) = (seen.clone(), stop.clone());
        let tcp_thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let Ok((mut c, peer)) = tcp.accept() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let _ = c.set_nonblocking(false);
                let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                while let Ok(q) = read_framed(&mut c) {
                    let Some(resp) = fake_answer(&q, "tcp", peer.ip().to_canonical(), &s) else {
                        break;
                    };
                    if c.write_all(&framed(&resp)).is_err() {
                        break;
                    }
                }
            }
        });
        Ok(FakeUpstream {
            seen,
            stop,
            threads: vec![udp_thread, tcp_thread],
        })
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn asked(&self, name: &str) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|(_, _, n, _)| n == name)
            .collect()
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn fake_answer(
    wire: &[u8],
    transport: &'static str,
    from: IpAddr,
    seen: &Mutex<Vec<Seen>>,
) -> Option<Vec<u8>> {
    let req = Message::from_vec(wire).ok()?;
    let q = req.queries.first()?.clone();
    let name = q.name().to_ascii().to_ascii_lowercase();
    seen.lock()
        .unwrap()
        .push((from, transport, name.clone(), q.query_type()));
    let mut r = Message::response(req.metadata.id, OpCode::Query);
    r.metadata.recursion_desired = req.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    r.queries = req.queries.clone();
    r.edns = req.edns.as_ref().map(|_| Edns::new());
    let owner = q.name().clone();
    match (name.as_str(), q.query_type()) {
        ("silent.example.", _) => return None,
        ("external.example.", RecordType::A) => {
            r.answers.push(Record::from_rdata(
                owner,
                60,
                RData::A(EXTERNAL_IP.parse::<std::net::Ipv4Addr>().ok()?.into()),
            ));
        }
        ("external.example.", RecordType::AAAA) => {
            r.answers.push(Record::from_rdata(
                owner,
                60,
                RData::AAAA(EXTERNAL_IP6.parse::<std::net::Ipv6Addr>().ok()?.into()),
            ));
        }
        // In a dual-stack topology this pod has an IPv6 address too.
        ("db.external.example.", RecordType::AAAA) => {
            let target = Name::from_ascii("server.external.example.").ok()?;
            r.answers.push(Record::from_rdata(
                owner,
                60,
                RData::CNAME(hickory_proto::rr::rdata::CNAME(target.clone())),
            ));
            r.answers.push(Record::from_rdata(
                target,
                60,
                RData::AAAA(AAAA::from(UPSTREAM_IP6.parse::<std::net::Ipv6Addr>().ok()?)),
            ));
        }
        // ServiceEntry hosts: this pod itself (outside the mesh), one through a CNAME.
        ("db.external.example.", RecordType::A) => {
            let target = Name::from_ascii("server.external.example.").ok()?;
            r.answers.push(Record::from_rdata(
                owner,
                60,
                RData::CNAME(hickory_proto::rr::rdata::CNAME(target.clone())),
            ));
            r.answers.push(Record::from_rdata(
                target,
                60,
                RData::A(A::from(std::net::Ipv4Addr::from(UPSTREAM_IP))),
            ));
        }
        ("direct.external.example.", RecordType::A) => {
            r.answers.push(Record::from_rdata(
                owner,
                60,
                RData::A(A::from(std::net::Ipv4Addr::from(UPSTREAM_IP))),
            ));
        }
        ("big.example.", RecordType::A) => {
            for i in 0..100u8 {
                r.answers.push(Record::from_rdata(
                    owner.clone(),
                    60,
                    RData::A(A::new(198, 18, 0, i)),
                ));
            }
        }
        _ => {
            r.metadata.response_code = ResponseCode::NXDomain;
            let zone = Name::from_ascii("example.").ok()?;
            let soa = SOA::new(zone.clone(), zone.clone(), 1, 60, 60, 60, 30);
            r.authorities
                .push(Record::from_rdata(zone, 60, RData::SOA(soa)));
        }
    }
    let out = r.to_vec().ok()?;
    let limit = req
        .edns
        .as_ref()
        .map_or(512, |e| usize::from(e.max_payload()).max(512));
    if transport == "udp" && out.len() > limit {
        return r.truncate().to_vec().ok();
    }
    Some(out)
}

fn framed(msg: &[u8]) -> Vec<u8> {
    let mut out = (msg.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(msg);
    out
}

fn read_framed(s: &mut std::net::TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn query(name: &str, t: RecordType) -> Message {
    let mut m = Message::new(rand::random(), MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.queries.push(Query::query(
        Name::from_ascii(name).expect("test names are valid"),
        t,
    ));
    m
}

/// How the client's UDP socket is set up.
#[derive(Clone, Copy, Debug)]
enum Sock {
    /// sendto() on a socket bound to 0.0.0.0.
    Unconnected,
    /// connect() then send().
    Connected,
    /// sendto() on a socket bound to the pod's own address.
    BoundToPodIp,
}

/// Sends `wire` over UDP from inside `pod` and returns the answer and the address it came from.
/// An IPv6 `server` (a v4-mapped one too) is asked from an IPv6 socket.
fn udp_exchange(
    pod: &Pod,
    server: SocketAddr,
    wire: Vec<u8>,
    sock: Sock,
) -> Result<(Vec<u8>, SocketAddr)> {
    let local = match sock {
        Sock::BoundToPodIp => SocketAddr::new(
            pod.ip_like(server.ip())
                .context("the pod has no address of the server's family")?,
            0,
        ),
        _ if server.is_ipv6() => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
        _ => SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    let connected = matches!(sock, Sock::Connected);
    pod.netns.run(move || -> Result<(Vec<u8>, SocketAddr)> {
        let s = UdpSocket::bind(local)?;
        s.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        if connected {
            s.connect(server)?;
            s.send(&wire)?;
        } else {
            s.send_to(&wire, server)?;
        }
        let mut buf = [0u8; 4096];
        let (n, from) = s
            .recv_from(&mut buf)
            .with_context(|| format!("no answer from {server}"))?;
        Ok((buf[..n].to_vec(), from))
    })?
}

/// Asks `name` over UDP from `pod`; checks that the answer matches the question and comes
/// from the server asked.
fn ask_udp(
    pod: &Pod,
    server: SocketAddr,
    name: &str,
    t: RecordType,
    sock: Sock,
) -> Result<Message> {
    let q = query(name, t);
    let (wire, from) = udp_exchange(pod, server, q.to_vec()?, sock)?;
    if from != server {
        bail!("answer for {name} came from {from}, not from {server}");
    }
    let r = Message::from_vec(&wire)?;
    if r.metadata.id != q.metadata.id || r.queries != q.queries {
        bail!("answer does not match the question {name}: {r:?}");
    }
    Ok(r)
}

fn ask_tcp(pod: &Pod, server: SocketAddr, name: &str, t: RecordType) -> Result<Message> {
    let q = query(name, t);
    let wire = q.to_vec()?;
    let resp = pod.netns.run(move || -> Result<Vec<u8>> {
        let mut s = std::net::TcpStream::connect_timeout(&server, CLIENT_TIMEOUT)?;
        s.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        s.write_all(&framed(&wire))?;
        Ok(read_framed(&mut s)?)
    })??;
    let r = Message::from_vec(&resp)?;
    if r.metadata.id != q.metadata.id {
        bail!("TCP answer for {name} has another id");
    }
    Ok(r)
}

fn addresses(m: &Message) -> Vec<String> {
    let mut v: Vec<String> = m
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0.to_string()),
            RData::AAAA(a) => Some(a.0.to_string()),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

/// The mesh: n1p1 enrolled in `default` (canonical service `sleep`), service echo with
/// VIP 10.96.0.10; n2p1 is not in the mesh. `env` is added to both ztunnels'.
fn dns_mesh(tag: &str, env: &[(&str, &str)]) -> Result<(Mesh, FakeUpstream)> {
    dns_mesh_with(tag, env, "", "")
}

/// `dns_mesh` with more workloads and services (YAML list items).
fn dns_mesh_with(
    tag: &str,
    env: &[(&str, &str)],
    workloads: &str,
    services: &str,
) -> Result<(Mesh, FakeUpstream)> {
    dns_mesh_in(
        Topology::build(&prefix(tag), &[1, 1])?,
        &format!("[\"/{VIP}\"]"),
        env,
        workloads,
        services,
    )
}

/// `dns_mesh_with` on `topo`, echo with the VIPs `echo_vips` (a YAML list).
fn dns_mesh_in(
    topo: Topology,
    echo_vips: &str,
    env: &[(&str, &str)],
    workloads: &str,
    services: &str,
) -> Result<(Mesh, FakeUpstream)> {
    let cfg = format!(
        "workloads:\n{}{workloads}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: {echo_vips}, ports: {{80: 8080}}}}\n{services}",
        workload(&topo, "n1p1", "sleep", ", canonicalName: sleep, canonicalRevision: v1"),
    );
    let fake = FakeUpstream::start(&topo.pod("n2p1").netns)?;
    // A first upstream that refuses (nothing on 5353) proves failover to the next.
    let upstreams = "10.10.2.11:5353,10.10.2.11";
    let mut full_env = vec![
        ("ZTUNNEL_DNS_UPSTREAM", upstreams),
        ("RUST_LOG", "info,ztunnel::dns=debug"),
    ];
    full_env.extend_from_slice(env);
    let mesh = Mesh::start(topo, &cfg, &["n1p1"], &HashMap::new(), &full_env)?;
    Ok((mesh, fake))
}

/// The value of the series of `name` whose labels include every one of `labels`.
fn metric(scrape: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let prefix = format!("{name}{{");
    let line = scrape
        .lines()
        .find(|l| l.starts_with(&prefix) && labels.iter().all(|want| l.contains(want)))?;
    line.rsplit(' ').next()?.parse().ok()
}

fn scrape_metrics(node: &Netns) -> Result<String> {
    node.run(|| -> Result<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", 15020))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })?
}

#[test]
fn pod_dns_is_answered_from_the_mesh_or_forwarded() -> Result<()> {
    let (mesh, fake) = dns_mesh("dd", &[])?;
    let client = mesh.topo.pod("n1p1");
    let server = upstream();

    // Mesh names, as written by the pod: full, and short with search expansion from its
    // namespace; unconnected and connected UDP sockets (sendmsg / connect capture).
    for (name, sock) in [
        ("echo.default.svc.cluster.local.", Sock::Unconnected),
        ("echo.", Sock::Connected),
        ("echo.default.", Sock::BoundToPodIp),
        ("echo.default.svc.", Sock::Connected),
    ] {
        let r = ask_udp(client, server, name, RecordType::A, sock).with_context(|| mesh.logs())?;
        assert_eq!(addresses(&r), vec![VIP], "{name}: {r:?}");
        assert!(r.metadata.authoritative, "{name}");
        assert_eq!(r.answers[0].ttl, 30, "Istio's TTL for mesh answers");
    }
    // A resolver that appended a search domain to a complete name gets a CNAME at once.
    let r = ask_udp(
        client,
        server,
        "echo.default.default.svc.cluster.local.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert!(
        matches!(&r.answers[0].data, RData::CNAME(c) if c.0.to_ascii() == "echo.default."),
        "{r:?}"
    );
    assert_eq!(addresses(&r), vec![VIP]);
    // AAAA for an IPv4-only service: the name exists, no records.
    let r = ask_udp(client, server, "echo.", RecordType::AAAA, Sock::Unconnected)?;
    assert_eq!(
        (r.metadata.response_code, r.answers.len()),
        (ResponseCode::NoError, 0)
    );
    assert!(
        fake.seen().iter().all(|(_, _, n, _)| !n.contains("echo")),
        "mesh names must not reach upstream: {:?}",
        fake.seen()
    );

    // Other names are forwarded from the node, not from the pod, then cached.
    let r = ask_udp(
        client,
        server,
        "external.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(addresses(&r), vec![EXTERNAL_IP]);
    assert!(!r.metadata.authoritative);
    let r = ask_udp(
        client,
        server,
        "external.example.",
        RecordType::A,
        Sock::Connected,
    )?;
    assert_eq!(addresses(&r), vec![EXTERNAL_IP]);
    let asked = fake.asked("external.example.");
    assert_eq!(
        asked.len(),
        1,
        "the second answer comes from the cache: {asked:?}"
    );
    assert_eq!(
        asked[0].0,
        IpAddr::from([10, 0, 0, 1]),
        "forwarded from node 1's ztunnel"
    );
    let r = ask_udp(
        client,
        server,
        "missing.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);

    // TCP, and a large answer: truncated over UDP (no EDNS from this client), whole over
    // TCP (the proxy itself fell back to TCP upstream).
    let r = ask_tcp(
        client,
        server,
        "echo.default.svc.cluster.local.",
        RecordType::A,
    )?;
    assert_eq!(addresses(&r), vec![VIP]);
    let r = ask_udp(
        client,
        server,
        "big.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert!(r.metadata.truncation && r.answers.is_empty(), "{r:?}");
    let r = ask_tcp(client, server, "big.example.", RecordType::A)?;
    assert_eq!(r.answers.len(), 100);
    let big: Vec<&'static str> = fake.asked("big.example.").iter().map(|s| s.1).collect();
    assert_eq!(
        big,
        vec!["udp", "tcp"],
        "one UDP try, one TCP retry upstream, then the cache"
    );

    // An upstream that never answers: SERVFAIL within the proxy's timeout.
    let started = std::time::Instant::now();
    let r = ask_udp(
        client,
        server,
        "silent.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );

    // Garbage gets FORMERR (or nothing) and the proxy carries on.
    let (wire, from) = udp_exchange(
        client,
        server,
        vec![
            0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0xc0, 12,
        ],
        Sock::Unconnected,
    )?;
    assert_eq!(
        (from, &wire[..2], wire[3] & 0x0f),
        (server, &[0x12u8, 0x34][..], 1),
        "FORMERR from the server asked"
    );
    assert_eq!(
        addresses(&ask_udp(
            client,
            server,
            "echo.",
            RecordType::A,
            Sock::Unconnected
        )?),
        vec![VIP]
    );

    // Metrics: Istio's names, the pod's canonical service, exact counts.
    let m = scrape_metrics(mesh.topo.node(1))?;
    let sleep = [
        "source_canonical_service=\"sleep\"",
        "source_canonical_revision=\"v1\"",
    ];
    let udp_a = [
        &sleep[..],
        &["request_query_type=\"a\"", "request_protocol=\"udp\""],
    ]
    .concat();
    // 4 + 1 mesh names, 2 external, missing, big, silent, the one after the garbage.
    assert_eq!(
        metric(&m, "istio_dns_requests_total", &udp_a),
        Some(11.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_dns_requests_total",
            &[&sleep[..], &["request_query_type=\"aaaa\""]].concat()
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_dns_requests_total",
            &[&sleep[..], &["request_protocol=\"tcp\""]].concat()
        ),
        Some(2.0),
        "{m}"
    );
    // external (once: then cached), missing, big, silent.
    assert_eq!(
        metric(&m, "istio_dns_upstream_requests_total", &udp_a),
        Some(4.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "istio_dns_upstream_failures_total", &udp_a),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_dns_upstream_request_duration_seconds_count",
            &udp_a
        ),
        Some(4.0),
        "{m}"
    );
    Ok(())
}

#[test]
fn glibc_resolver_in_the_pod_uses_search_domains() -> Result<()> {
    let (mesh, fake) = dns_mesh("dg", &[])?;
    let client = mesh.topo.pod("n1p1");
    let _conf = PodResolvConf::write(
        &client.netns,
        "nameserver 10.10.2.11\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:3 attempts:2\n",
    )?;
    let getent = |name: &str| client.netns.exec("getent", &["ahostsv4", name]);
    for name in ["echo", "echo.default", "echo.default.svc.cluster.local"] {
        let out = getent(name).with_context(|| mesh.logs())?;
        assert!(out.starts_with(&format!("{VIP} ")), "getent {name}: {out}");
    }
    let out = getent("external.example")?;
    assert!(out.starts_with(&format!("{EXTERNAL_IP} ")), "{out}");
    // glibc tried the search domains first (ndots:5); each came from node 1, none from the pod.
    let tried: Vec<String> = fake
        .seen()
        .into_iter()
        .map(|(ip, _, n, _)| format!("{n} from {ip}"))
        .collect();
    assert!(
        tried.contains(&"external.example.default.svc.cluster.local. from 10.0.0.1".to_string()),
        "{tried:?}"
    );
    assert!(
        tried.contains(&"external.example. from 10.0.0.1".to_string()),
        "{tried:?}"
    );
    assert!(
        !tried
            .iter()
            .any(|t| t.contains("echo") || t.ends_with("10.10.1.11")),
        "{tried:?}"
    );
    Ok(())
}

#[test]
fn dns_capture_off_leaves_port_53_alone() -> Result<()> {
    let (mesh, fake) = dns_mesh("dq", &[("ZTUNNEL_DNS_CAPTURE", "false")])?;
    let client = mesh.topo.pod("n1p1");
    let server = upstream();
    // Straight to the server: it does not know mesh names, and sees the pod itself.
    let r = ask_udp(
        client,
        server,
        "echo.default.svc.cluster.local.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    let r = ask_tcp(client, server, "external.example.", RecordType::A)?;
    assert_eq!(addresses(&r), vec![EXTERNAL_IP]);
    let seen = fake.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen.iter().all(|s| s.0 == IpAddr::from([10, 10, 1, 11])),
        "{seen:?}"
    );
    // The proxy still listens in the pod, for a capture someone else sets up (istio-cni
    // redirects port 53 to 127.0.0.1:15053 when its DNS capture is on).
    let proxy = SocketAddr::from(([127, 0, 0, 1], 15053));
    let r = ask_udp(client, proxy, "echo.", RecordType::A, Sock::Unconnected)?;
    assert_eq!(addresses(&r), vec![VIP]);
    let r = ask_tcp(client, proxy, "echo.default.", RecordType::A)?;
    assert_eq!(addresses(&r), vec![VIP]);
    Ok(())
}

/// DNS-resolved ServiceEntries: workloads known only by hostname. n2p1 (outside the mesh,
/// also the upstream resolver) serves on 8080 and is `db.external.example` (through a
/// CNAME) and `direct.external.example` upstream. The client reaches it by the
/// ServiceEntry's VIP (the endpoint's name resolved on demand from node 1, cached), by
/// name through the DNS proxy (the VIP, then the same), and by the name of a service
/// without a VIP (forwarded upstream, then plain passthrough); a name that does not
/// resolve fails the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_entry_hostname_endpoints_are_resolved_on_demand() -> Result<()> {
    const SE_VIP: &str = "10.96.0.50";
    const GONE_VIP: &str = "10.96.0.51";
    let workloads = "- {uid: Kubernetes/networking.istio.io/ServiceEntry/default/db/db.external.example, name: db, namespace: default,
   hostname: db.external.example, protocol: TCP,
   services: {default/db.external.example: {80: 8080}, default/direct.external.example: {80: 8080}}}
- {uid: Kubernetes/networking.istio.io/ServiceEntry/default/gone/gone.external.example, name: gone, namespace: default,
   hostname: gone.external.example, services: {default/gone.external.example: {80: 8080}}}
";
    let services = format!(
        "- {{name: db, namespace: default, hostname: db.external.example, vips: [\"/{SE_VIP}\"], ports: {{80: 8080}}}}
- {{name: direct, namespace: default, hostname: direct.external.example, ports: {{80: 8080}}}}
- {{name: gone, namespace: default, hostname: gone.external.example, vips: [\"/{GONE_VIP}\"], ports: {{80: 8080}}}}
"
    );
    let (mesh, fake) = dns_mesh_with("dh", &[], workloads, &services)?;
    let (client, ext) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&ext.netns, 8080, None)?;
    let roundtrip = |to: SocketAddr, data: &'static [u8]| async move {
        let mut s = client.netns.connect(to).await?;
        echo_roundtrip(&mut s, data).await
    };
    let se_vip = SocketAddr::new(SE_VIP.parse()?, 80);

    // By the VIP: the endpoint's hostname resolved from node 1, then plaintext to it.
    assert_eq!(
        roundtrip(se_vip, b"by vip")
            .await
            .with_context(|| mesh.logs())?,
        b"by vip"
    );
    // Asked once for each family (A and AAAA, as Istio's ztunnel with IPv6 on).
    let asked = fake.asked("db.external.example.");
    assert_eq!(
        asked
            .iter()
            .map(|s| s.3)
            .collect::<std::collections::BTreeSet<_>>(),
        [RecordType::A, RecordType::AAAA].into(),
        "{asked:?}"
    );
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(
        asked.iter().all(|s| s.0 == IpAddr::from([10, 0, 0, 1])),
        "resolved by node 1's ztunnel, not by the pod: {asked:?}"
    );
    assert_eq!(roundtrip(se_vip, b"again").await?, b"again");
    assert_eq!(
        fake.asked("db.external.example.").len(),
        2,
        "the second connection used the cached answers"
    );
    mesh.wait_logs(&["dst.service=db.external.example"])?;
    assert!(
        echo.peers()
            .iter()
            .all(|p| p.ip() == IpAddr::from([10, 10, 1, 11])),
        "the pod's own address: {:?}",
        echo.peers()
    );

    // By name through the DNS proxy: the ServiceEntry's VIP (a mesh answer), then the same.
    let r = ask_udp(
        client,
        upstream(),
        "db.external.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(addresses(&r), vec![SE_VIP]);
    assert!(r.metadata.authoritative, "answered from the mesh");
    let to = SocketAddr::new(addresses(&r)[0].parse()?, 80);
    assert_eq!(roundtrip(to, b"by name").await?, b"by name");
    assert_eq!(
        fake.asked("db.external.example.").len(),
        2,
        "neither the DNS proxy nor the connection asked again"
    );

    // A service without a VIP: its name is the upstream resolver's; the address it gives
    // is outside the mesh and passed through.
    let r = ask_udp(
        client,
        upstream(),
        "direct.external.example.",
        RecordType::A,
        Sock::Unconnected,
    )?;
    assert_eq!(addresses(&r), vec![ext.ip.to_string()]);
    assert!(!r.metadata.authoritative, "forwarded");
    let to = SocketAddr::new(addresses(&r)[0].parse()?, 8080);
    assert_eq!(roundtrip(to, b"direct").await?, b"direct");

    // An endpoint whose name does not resolve: the connection fails, saying why.
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        roundtrip(SocketAddr::new(GONE_VIP.parse()?, 80), b"gone?"),
    )
    .await?;
    assert!(
        r.map(|v| v.is_empty()).unwrap_or(true),
        "a connection to an unresolvable endpoint was served"
    );
    mesh.wait_logs(&["endpoint gone.external.example: no address for gone.external.example (upstream answered Non-Existent Domain"])?;

    // Istio's metric: the three connections by the VIP, one to the unresolvable name.
    let m = scrape_metrics(mesh.topo.node(1))?;
    let src = [
        "source_workload=\"n1p1\"",
        "source_canonical_service=\"sleep\"",
        "source_principal=\"spiffe://cluster.local/ns/default/sa/sleep\"",
    ];
    assert_eq!(
        metric(
            &m,
            "istio_on_demand_dns_total",
            &[&src[..], &["hostname=\"db.external.example\""]].concat()
        ),
        Some(3.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_on_demand_dns_total",
            &[&src[..], &["hostname=\"gone.external.example\""]].concat()
        ),
        Some(1.0),
        "{m}"
    );
    Ok(())
}

/// IPv6, on a dual-stack topology: the pod asks its IPv6 nameserver (and an IPv4 one from
/// an IPv6 socket, v4-mapped) over UDP and TCP; capture sends it to the DNS proxy on
/// `[::1]:15053`, which answers AAAA from the mesh's IPv6 VIPs (from the server asked)
/// and forwards the rest. A ServiceEntry endpoint known by hostname is resolved on demand
/// for AAAA too: reached over IPv6 through the service's IPv6 VIP, over IPv4 through its
/// IPv4 one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_dns_and_aaaa_answers() -> Result<()> {
    let workloads = "- {uid: Kubernetes/networking.istio.io/ServiceEntry/default/db/db.external.example, name: db, namespace: default,
   hostname: db.external.example, protocol: TCP, services: {default/db.external.example: {80: 8080}}}
";
    let services = "- {name: db, namespace: default, hostname: db.external.example, vips: [\"/10.96.0.50\", \"/fd00:96::50\"], ports: {80: 8080}}\n";
    let topo = Topology::build_family(&prefix("dn6"), &[1, 1], IpFamily::Dual)?;
    let (mesh, fake) = dns_mesh_in(
        topo,
        "[\"/10.96.0.10\", \"/fd00:96::10\"]",
        &[],
        workloads,
        services,
    )?;
    let (client, ext) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let server6 = SocketAddr::new(UPSTREAM_IP6.parse()?, 53);
    let mapped: SocketAddr =
        format!("[::ffff:{}]:53", std::net::Ipv4Addr::from(UPSTREAM_IP)).parse()?;

    // Mesh names over IPv6 (unconnected, connected, bound to the pod's IPv6 address; TCP),
    // and from an IPv6 socket to the IPv4 nameserver: answered from the mesh.
    for sock in [Sock::Unconnected, Sock::Connected, Sock::BoundToPodIp] {
        let r = ask_udp(client, server6, "echo.", RecordType::AAAA, sock)
            .with_context(|| mesh.logs())?;
        assert_eq!(addresses(&r), ["fd00:96::10"], "{sock:?}: {r:?}");
        assert!(r.metadata.authoritative);
    }
    assert_eq!(
        addresses(&ask_udp(
            client,
            server6,
            "echo.default.",
            RecordType::A,
            Sock::Unconnected
        )?),
        [VIP]
    );
    assert_eq!(
        addresses(&ask_tcp(
            client,
            server6,
            "echo.default.svc.cluster.local.",
            RecordType::AAAA
        )?),
        ["fd00:96::10"]
    );
    assert_eq!(
        addresses(&ask_udp(
            client,
            mapped,
            "echo.",
            RecordType::AAAA,
            Sock::Unconnected
        )?),
        ["fd00:96::10"]
    );
    assert!(
        fake.seen().iter().all(|(_, _, n, _)| !n.contains("echo")),
        "mesh names must not reach upstream: {:?}",
        fake.seen()
    );
    // Other names are forwarded (from node 1), AAAA included.
    let r = ask_udp(
        client,
        server6,
        "external.example.",
        RecordType::AAAA,
        Sock::Unconnected,
    )?;
    assert_eq!(addresses(&r), [EXTERNAL_IP6]);
    let asked = fake.asked("external.example.");
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(
        (asked[0].0, asked[0].3),
        (IpAddr::from([10, 0, 0, 1]), RecordType::AAAA),
        "forwarded from node 1's ztunnel"
    );

    // On-demand resolution asks A and AAAA; the connection keeps the family of the VIP.
    let echo = EchoServer::serve(ext.netns.listen_on("[::]:8080".parse()?)?, None)?;
    for (vip, family) in [("[fd00:96::50]:80", "IPv6"), ("10.96.0.50:80", "IPv4")] {
        let to: SocketAddr = vip.parse()?;
        let mut s = client.netns.connect(to).await?;
        assert_eq!(
            echo_roundtrip(&mut s, family.as_bytes())
                .await
                .with_context(|| mesh.logs())?,
            family.as_bytes()
        );
        let peer = echo.peers().last().copied().context("no connection")?;
        assert_eq!(
            Some(peer.ip()),
            client.ip_like(to.ip()),
            "through the {family} VIP: the endpoint reached over {family}"
        );
    }
    let kinds: Vec<RecordType> = fake
        .asked("db.external.example.")
        .iter()
        .map(|s| s.3)
        .collect();
    assert!(
        kinds.contains(&RecordType::A) && kinds.contains(&RecordType::AAAA),
        "{kinds:?}"
    );
    Ok(())
}
