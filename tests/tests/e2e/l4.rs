//! End-to-end L4 mesh tests: two simulated nodes, pods as network namespaces, one real
//! ztunnel process per node, eBPF or nftables capture (ZTUNNEL_TEST_CAPTURE), real TCP.
//! The suite runs on IPv4, IPv6-only and dual-stack topologies (ZTUNNEL_TEST_IP_FAMILY,
//! see netsim.rs): tests take every address from the topology; the few that are about
//! IPv4 itself say so and skip where it does not exist.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::crl::{cert_serial, write_crl};
use mesh_tests::netsim::*;
use mesh_tests::{bins, hbone_peer};
use tokio::io::AsyncReadExt;

/// Node 1 runs pod n1p1 (identity sa/client), node 2 pod n2p1 (sa/server), both enrolled.
fn client_server_mesh(tag: &str, env: &[(&str, &str)]) -> Result<Mesh> {
    let topo = Topology::build(&prefix(tag), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), env)
}

/// Node 2 runs pod n2p1 (sa/server), enrolled; n1p1 on node 1 is outside the mesh (no
/// workload, no capture) and reaches n2p1 in plain TCP, which n2p1's ztunnel captures.
fn plaintext_client_mesh(tag: &str) -> Result<Mesh> {
    let topo = Topology::build(&prefix(tag), &[1, 1])?;
    let cfg = format!("workloads:\n{}", workload(&topo, "n2p1", "server", ""));
    Mesh::start(topo, &cfg, &["n2p1"], &HashMap::new(), &[])
}

async fn roundtrip(from: &Pod, to: SocketAddr, data: &[u8]) -> Result<Vec<u8>> {
    let mut s = from.netns.connect(to).await?;
    echo_roundtrip(&mut s, data).await
}

fn addr(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(pod.ip, port)
}

/// An address as logs print it before `:port` (IPv6 in brackets).
fn host(ip: std::net::IpAddr) -> String {
    let s = SocketAddr::new(ip, 0).to_string();
    s.trim_end_matches(":0").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_node_traffic_is_hbone_and_keeps_client_ip() -> Result<()> {
    let mesh = client_server_mesh("x", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let capture = Capture::start(mesh.topo.node(1), "eth0", &mesh.topo.dir)?;

    let marker = b"plaintext-marker-that-must-not-cross-the-node-link".repeat(20);
    let mut s = client.netns.connect(addr(server, 8080)).await?;
    // eBPF rewrote the connect to the proxy's loopback listener; getpeername4/6 hide it.
    assert_eq!(
        s.peer_addr()?,
        addr(server, 8080),
        "the app sees the address it dialed"
    );
    let back = echo_roundtrip(&mut s, &marker).await?;
    assert_eq!(back, marker);
    let packets = capture.stop()?;

    // The app saw the client pod's own IP, not a proxy address.
    assert_eq!(
        echo.peers().iter().map(|p| p.ip()).collect::<Vec<_>>(),
        vec![client.ip]
    );
    // On the node link, everything is client pod <-> server pod:15008, TLS from the first byte.
    let data: Vec<&Packet> = packets.iter().filter(|p| !p.payload.is_empty()).collect();
    assert!(
        !data.is_empty(),
        "capture saw no TCP payload ({} packets)",
        packets.len()
    );
    for p in &data {
        assert!(
            p.dst.port() == 15008 || p.src.port() == 15008,
            "non-HBONE packet on node link: {} -> {}",
            p.src,
            p.dst
        );
    }
    let first = data
        .iter()
        .find(|p| p.dst.port() == 15008)
        .expect("no packet to 15008");
    assert_eq!(
        &first.payload[..2],
        &[0x16, 0x03],
        "first bytes to 15008 are not a TLS handshake record"
    );
    let all: Vec<u8> = data.iter().flat_map(|p| p.payload.clone()).collect();
    assert!(
        !all.windows(16).any(|w| w == &marker[..16]),
        "plaintext leaked onto the node link"
    );
    mesh.wait_logs(&[
        "src.identity=spiffe://cluster.local/ns/default/sa/client",
        "dst.identity=spiffe://cluster.local/ns/default/sa/server",
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_node_pod_to_pod() -> Result<()> {
    let topo = Topology::build(&prefix("s"), &[2, 0])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n1p2"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n1p2"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let data = pattern(64 * 1024, 7);
    assert_eq!(roundtrip(client, addr(server, 8080), &data).await?, data);
    assert_eq!(echo.peers()[0].ip(), client.ip);
    mesh.wait_logs(&[&format!("dst.addr={}", addr(server, 15008))])?;
    Ok(())
}

/// The client closes first, so each delivery leaves the inbound ztunnel's side (from the
/// client's address) in TIME_WAIT in the server pod. Deliveries come from the ports
/// outside the pod's ephemeral range: with that range set to leave four (1024-1027), a
/// fifth connection would find every port's tuple waiting if the kernel picked the port;
/// ztunnel picks it and takes over its own TIME_WAIT tuples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_outlast_the_pods_ephemeral_ports() -> Result<()> {
    let mesh = client_server_mesh("tw", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    server.netns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=1028 65535"],
    )?;
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    for i in 0..24u64 {
        let data = pattern(1024, i);
        let back = roundtrip(client, addr(server, 8080), &data)
            .await
            .with_context(|| format!("connection {i}"))?;
        assert_eq!(back, data, "connection {i}");
    }
    let peers = echo.peers();
    assert_eq!(peers.len(), 24);
    assert!(
        peers
            .iter()
            .all(|p| p.ip() == client.ip && (1024..=1027).contains(&p.port())),
        "{peers:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_vip_balances_across_nodes() -> Result<()> {
    let topo = Topology::build(&prefix("v"), &[2, 1])?;
    let svc = " , services: {default/echo.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: {}, ports: {{80: 8080}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "echo", svc),
        workload(&topo, "n2p1", "echo", svc),
        vips_yaml(10),
    )
    .replace(" , ", ", ");
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n1p2", "n2p1"], &HashMap::new(), &[])?;
    let _a = EchoServer::start(&mesh.topo.pod("n1p2").netns, 8080, Some("n1p2"))?;
    let _b = EchoServer::start(&mesh.topo.pod("n2p1").netns, 8080, Some("n2p1"))?;
    let client = mesh.topo.pod("n1p1");
    let mut seen: HashMap<String, usize> = HashMap::new();
    for _ in 0..40 {
        let mut s = client.netns.connect(SocketAddr::new(vip(10), 80)).await?;
        *seen.entry(read_line(&mut s).await?).or_default() += 1;
    }
    assert_eq!(seen.len(), 2, "both endpoints must serve the VIP: {seen:?}");
    assert!(seen.values().all(|&n| n >= 5), "{seen:?}");
    Ok(())
}

/// Locality-aware load balancing, end to end: a client in zone a, three server pods in
/// two zones (one of them in zone a unhealthy). FAILOVER stays in the client's zone while
/// it has a healthy endpoint and fails over when it has none; STRICT refuses instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locality_failover_and_strict() -> Result<()> {
    let topo = Topology::build(&prefix("lo"), &[1, 3])?;
    let zone = |z: &str, extra: &str| format!(", locality: {{region: r1, zone: {z}}}{extra}");
    let svcs = |names: &[&str]| {
        let list: Vec<String> = names
            .iter()
            .map(|n| format!("default/{n}.default.svc.cluster.local: {{80: 8080}}"))
            .collect();
        format!(", services: {{{}}}", list.join(", "))
    };
    let service = |name: &str, n: u8, mode: &str| {
        format!("- {{name: {name}, namespace: default, hostname: {name}.default.svc.cluster.local, vips: {}, ports: {{80: 8080}},
   loadBalancer: {{mode: {mode}, routingPreferences: [Region, Zone]}}}}\n", vips_yaml(n))
    };
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n{}{}{}",
        workload(&topo, "n1p1", "client", &zone("a", "")),
        workload(&topo, "n2p1", "echo", &zone("a", &svcs(&["near"]))),
        workload(
            &topo,
            "n2p2",
            "echo",
            &zone("b", &svcs(&["near", "sick", "strict"]))
        ),
        workload(
            &topo,
            "n2p3",
            "echo",
            &zone(
                "a",
                &format!(", status: Unhealthy{}", svcs(&["sick", "strict"]))
            )
        ),
        service("near", 81, "Failover"),
        service("sick", 82, "Failover"),
        service("strict", 83, "Strict"),
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n2p1", "n2p2", "n2p3"],
        &HashMap::new(),
        &[],
    )?;
    let _echo: Vec<EchoServer> = ["n2p1", "n2p2", "n2p3"]
        .iter()
        .map(|p| EchoServer::start(&mesh.topo.pod(p).netns, 8080, Some(p)))
        .collect::<Result<_>>()?;
    let client = mesh.topo.pod("n1p1");
    let backends = |n: u8| async move {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..10 {
            let mut s = client.netns.connect(SocketAddr::new(vip(n), 80)).await?;
            seen.insert(read_line(&mut s).await?);
        }
        anyhow::Ok(seen)
    };
    let only = |p: &str| std::collections::BTreeSet::from([p.to_string()]);
    assert_eq!(
        backends(81).await?,
        only("n2p1"),
        "FAILOVER stays in the client's zone"
    );
    assert_eq!(
        backends(82).await?,
        only("n2p2"),
        "FAILOVER leaves a zone without healthy endpoints"
    );
    // STRICT: no endpoint in the client's region and zone, so the connection is reset, not sent elsewhere.
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        roundtrip(client, SocketAddr::new(vip(83), 80), b"x"),
    )
    .await?;
    assert!(
        r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
        "STRICT must not leave the zone: {r:?}"
    );
    // Refused for the reason the test names (not, say, a failed tunnel to n2p2).
    mesh.wait_log_line(&[
        "connection failed",
        &format!("dst={}", SocketAddr::new(vip(83), 80)),
        "service=default/strict.default.svc.cluster.local",
        "no healthy endpoint",
    ])?;
    Ok(())
}

const ALLOW_ONLY_CLIENT: &str = "policies:
- name: only-client
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/client}]
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_allows_and_denies() -> Result<()> {
    let topo = Topology::build(&prefix("p"), &[2, 1])?;
    let cfg = format!(
        "workloads:\n{}{}{}{ALLOW_ONLY_CLIENT}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "intruder", ""),
        workload(&topo, "n2p1", "server", ""),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n1p2", "n2p1"], &HashMap::new(), &[])?;
    let server = mesh.topo.pod("n2p1");
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(
        roundtrip(mesh.topo.pod("n1p1"), addr(server, 8080), b"hi").await?,
        b"hi"
    );

    // The intruder's connection is accepted by its own proxy, then closed/reset with no data.
    let r = roundtrip(mesh.topo.pod("n1p2"), addr(server, 8080), b"let me in").await;
    assert!(
        r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
        "denied client got data: {r:?}"
    );
    assert_eq!(
        echo.peers().len(),
        1,
        "the denied connection must never reach the app"
    );
    mesh.wait_logs(&[
        "response_flags=\"DENY\"",
        "no ALLOW policy matched",
        &format!("CONNECT {} answered 401", addr(server, 8080)),
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_server_identity_is_refused() -> Result<()> {
    let topo = Topology::build(&prefix("i"), &[1, 1])?;
    let client_view = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    // Node 2 believes the pod is someone else, so its proxy presents that identity.
    let node2_view = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "impostor", "")
    );
    let per_node = HashMap::from([(2, node2_view)]);
    let mesh = Mesh::start(topo, &client_view, &["n1p1", "n2p1"], &per_node, &[])?;
    let server = mesh.topo.pod("n2p1");
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let r = roundtrip(mesh.topo.pod("n1p1"), addr(server, 8080), b"secret").await;
    assert!(r.as_ref().map(|v| v.is_empty()).unwrap_or(true), "{r:?}");
    assert!(echo.peers().is_empty());
    mesh.wait_logs(&[
        "server identity spiffe://cluster.local/ns/default/sa/impostor is not one of the expected",
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_client_to_mesh_pod() -> Result<()> {
    // n1p1 is not in the mesh (not enrolled, no capture); it reaches the mesh pod via 15006.
    let mesh = plaintext_client_mesh("t")?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    // Two source ports for the proxy's deliveries into the pod (those outside its
    // ephemeral range, read on its first one), and a client that uses the first every
    // time: a delivery from the client's address and port would reverse the tuple of the
    // connection the proxy accepted, and hang.
    server.netns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=1026 65535"],
    )?;
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"plain").await?,
        b"plain"
    );
    assert_eq!(echo.peers()[0].ip(), client.ip);
    mesh.wait_logs(&["connection_security_policy=\"unknown\""])?;
    let to = addr(server, 8080);
    for round in 0..12 {
        let from = SocketAddr::new(client.ip, 1024);
        let s = client
            .netns
            .run(move || -> std::io::Result<std::net::TcpStream> {
                let s = socket2::Socket::new(
                    socket2::Domain::for_address(to),
                    socket2::Type::STREAM,
                    None,
                )?;
                // Takes over its own TIME_WAIT of the round before (TCP timestamps are on).
                s.set_reuse_address(true)?;
                s.bind(&from.into())?;
                s.connect_timeout(&to.into(), Duration::from_secs(5))?;
                Ok(s.into())
            })??;
        s.set_nonblocking(true)?;
        let mut s = tokio::net::TcpStream::from_std(s)?;
        let echoed =
            tokio::time::timeout(Duration::from_secs(5), echo_roundtrip(&mut s, b"same port"))
                .await;
        assert!(
            matches!(&echoed, Ok(Ok(v)) if v == b"same port"),
            "round {round}, from {from}: {echoed:?}"
        );
        let delivered = echo.peers().last().copied();
        assert_eq!(
            delivered,
            Some(SocketAddr::new(client.ip, 1025)),
            "the delivery takes the port the client does not hold"
        );
    }
    drop(echo);
    drop(mesh);

    // Same, with a policy that needs a principal: the plaintext client is denied.
    let topo = Topology::build(&prefix("u"), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{ALLOW_ONLY_CLIENT}",
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let r = roundtrip(client, addr(server, 8080), b"plain").await;
    assert!(r.as_ref().map(|v| v.is_empty()).unwrap_or(true), "{r:?}");
    assert!(echo.peers().is_empty());
    mesh.wait_logs(&["response_flags=\"DENY\""])?;
    Ok(())
}

/// A client outside the mesh holding connections to a mesh pod: its next connections come
/// from its ephemeral ports, which the proxy's open deliveries from its address never
/// take (they come from outside the pod's ephemeral range, the same as the client's
/// here). From the same ten ports, a new connection of the client would meet an open
/// delivery's port (its SYN taken by the app's side of that delivery) nearly every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_clients_new_ports_never_meet_open_deliveries() -> Result<()> {
    let mesh = plaintext_client_mesh("pp")?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    for pod in [client, server] {
        pod.netns.exec(
            "sysctl",
            &["-qw", "net.ipv4.ip_local_port_range=40000 40009"],
        )?;
    }
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let mut held = Vec::new();
    for i in 0..8 {
        let mut s = tokio::time::timeout(
            Duration::from_secs(5),
            client.netns.connect(addr(server, 8080)),
        )
        .await
        .with_context(|| format!("connection {i} hung"))??;
        let from = s.local_addr()?;
        tokio::io::AsyncWriteExt::write_all(&mut s, b"x").await?;
        let mut b = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut b))
            .await
            .with_context(|| format!("connection {i} from {from}: no echo"))??;
        assert!(
            (40000..=40009).contains(&from.port()),
            "the client's own port: {from}"
        );
        held.push(s);
    }
    let delivered = echo.peers();
    assert_eq!(delivered.len(), 8);
    assert!(
        delivered
            .iter()
            .all(|p| p.ip() == client.ip && !(40000..=40009).contains(&p.port())),
        "{delivered:?}"
    );
    Ok(())
}

/// Installed over Istio with istio-cni capturing (ztunnel's own capture off): istio-cni's
/// in-pod rules steer the pods' traffic to ztunnel, and ztunnel's deliveries to the app
/// carry the mark those rules route the replies by (Istio's), so the app answers through
/// ztunnel and sees its real client, for tunnels and for plaintext clients alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_cni_in_pod_rules_capture_for_ztunnel() -> Result<()> {
    // istio-cni's rules as the harness writes them are its IPv4 ones: run on IPv4 (the
    // default run) only.
    if ip_family() != IpFamily::V4 {
        return skipped("istio-cni's rules as the harness writes them are IPv4 only");
    }
    let topo = Topology::build(&prefix("c"), &[2, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let cfg_path = topo.dir.join("mesh.yaml");
    std::fs::write(&cfg_path, cfg)?;
    let (client, plain, server) = (topo.pod("n1p1"), topo.pod("n1p2"), topo.pod("n2p1"));
    for pod in [client, server] {
        istio_cni_capture(pod)?;
    }
    let mut ztunnels = Vec::new();
    for (n, pod) in [(1, client), (2, server)] {
        let (cfg, state, netns) = (
            cfg_path.display().to_string(),
            topo.dir.join("ca").display().to_string(),
            pod.netns.path(),
        );
        let pod_arg = format!("{}={}", pod.name, netns.display());
        let args = [
            "--local-xds-path",
            &cfg,
            "--node-name",
            &format!("node{n}"),
            "--state-dir",
            &state,
            "--capture",
            "none",
            "--pod",
            &pod_arg,
        ];
        let z = topo.node(n).spawn(
            bins::ztunnel(),
            &args,
            &[("RUST_LOG", "info")],
            &topo.dir.join(format!("ztunnel-node{n}.log")),
        )?;
        z.wait_log("ztunnel ready", READY)?;
        ztunnels.push(z);
    }
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    let data = pattern(256 * 1024, 3);
    assert_eq!(roundtrip(client, addr(server, 8080), &data).await?, data);
    assert_eq!(
        roundtrip(plain, addr(server, 8080), b"plain").await?,
        b"plain"
    );
    let peers: Vec<std::net::IpAddr> = echo.peers().iter().map(|p| p.ip()).collect();
    assert_eq!(peers, vec![client.ip, plain.ip]);
    let server_log = || ztunnels[1].log_text();
    wait_for(
        "both connections logged by node2",
        Duration::from_secs(5),
        || {
            let l = server_log();
            l.contains("src.identity=spiffe://cluster.local/ns/default/sa/client")
                && l.contains("connection_security_policy=\"unknown\"")
        },
    )
    .with_context(server_log)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_are_byte_exact() -> Result<()> {
    let mesh = client_server_mesh("b", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    for (len, seed) in [(1 << 20, 1u64), (100 << 20, 2)] {
        let data = pattern(len, seed);
        let back = roundtrip(client, addr(server, 8080), &data).await?;
        assert_eq!(back.len(), data.len(), "length after echo of {len} bytes");
        assert!(back == data, "echoed bytes differ for {len} bytes");
    }
    Ok(())
}

/// Istio's HTTP2_* sizes at HTTP/2's minimum (one 64 KiB window, 16 KiB frames) on both
/// node proxies: flow control works hard, every byte still arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smallest_http2_windows_and_frames_still_copy_every_byte() -> Result<()> {
    let env = [
        ("HTTP2_STREAM_WINDOW_SIZE", "65535"),
        ("HTTP2_CONNECTION_WINDOW_SIZE", "65535"),
        ("HTTP2_FRAME_SIZE", "16384"),
    ];
    let mesh = client_server_mesh("h2w", &env)?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let data = pattern(8 << 20, 4);
    let back = roundtrip(client, addr(server, 8080), &data).await?;
    assert!(
        back == data,
        "echoed bytes differ ({} of {})",
        back.len(),
        data.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_and_reset_propagate() -> Result<()> {
    let mesh = client_server_mesh("h", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    // A server that reads to EOF, then answers with the byte count: needs client FIN to arrive.
    let l = server.netns.listen(9000)?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let _ = s.read_to_end(&mut buf).await;
                let _ = tokio::io::AsyncWriteExt::write_all(
                    &mut s,
                    format!("got {}", buf.len()).as_bytes(),
                )
                .await;
            });
        }
    });
    let back = roundtrip(client, addr(server, 9000), &pattern(300_000, 3)).await?;
    assert_eq!(String::from_utf8_lossy(&back), "got 300000");

    // A server that resets: the client must see a reset (not a clean close) promptly,
    // never hang. It resets once it has the client's byte, so the client's connect has
    // completed (a reset before that would race with it) and the reset has to cross both
    // proxies and the tunnel to reach the client.
    let l = server.netns.listen(9001)?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = [0u8; 1];
                let _ = s.read_exact(&mut b).await;
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                drop(s);
            });
        }
    });
    let mut s = client.netns.connect(addr(server, 9001)).await?;
    tokio::io::AsyncWriteExt::write_all(&mut s, b"x").await?;
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    assert!(
        matches!(&r, Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "expected the server's reset, got {r:?} (Ok(Ok(0)) is a clean close)"
    );
    Ok(())
}

/// Counts established TCP connections to port 15008 from a pod (the pooled HBONE connections).
fn hbone_connections(pod: &Pod) -> Result<usize> {
    let out = pod.netns.exec(
        "ss",
        &["-Htn", "state", "established", "( dport = :15008 )"],
    )?;
    Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
}

async fn open_concurrent(
    client: &Pod,
    to: SocketAddr,
    n: usize,
) -> Result<Vec<tokio::net::TcpStream>> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let ns = client.netns.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = ns.connect(to).await?;
            // One echo byte proves the tunnel is open end to end.
            tokio::io::AsyncWriteExt::write_all(&mut s, b"x").await?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await?;
            Ok::<_, anyhow::Error>(s)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connections_share_pooled_http2() -> Result<()> {
    let mesh = client_server_mesh("cq", &[("POOL_MAX_STREAMS_PER_CONNECTION", "200")])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    // A burst of 200 concurrent first connections: one TLS connection carries them all.
    let conns = open_concurrent(client, addr(server, 8080), 200).await?;
    assert_eq!(echo.peers().len(), 200);
    assert_eq!(
        hbone_connections(client)?,
        1,
        "200 streams must share one pooled HTTP/2 connection"
    );
    drop(conns);
    drop(mesh);

    // With Istio's default limit of 100 streams per connection, 200 need exactly two.
    let mesh = client_server_mesh("d", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let conns = open_concurrent(client, addr(server, 8080), 200).await?;
    assert_eq!(hbone_connections(client)?, 2);
    drop(conns);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pooled_connection_is_released() -> Result<()> {
    let mesh = client_server_mesh("l", &[("POOL_UNUSED_RELEASE_TIMEOUT_SECONDS", "1")])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(roundtrip(client, addr(server, 8080), b"a").await?, b"a");
    wait_for(
        "idle HBONE connection to close",
        Duration::from_secs(10),
        || hbone_connections(client).map(|n| n == 0).unwrap_or(false),
    )?;
    // A new connection after release dials again and works.
    assert_eq!(roundtrip(client, addr(server, 8080), b"b").await?, b"b");
    Ok(())
}

#[test]
fn malformed_config_is_rejected_with_file_and_field() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("zt-badcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        "workloads:\n- uid: a\n  name: a\n  namespace: default\n  workloadIPs: [10.0.0.1]\n",
    )?;
    let out = std::process::Command::new(bins::ztunnel())
        .args([
            "--local-xds-path",
            path.to_str().unwrap_or_default(),
            "--node-name",
            "n",
            "--state-dir",
        ])
        .arg(dir.join("st"))
        .env("RUST_BACKTRACE", "0")
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml")
            && err.contains("unknown field `workloadIPs`")
            && err.contains("line 5"),
        "{err}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbone_server_answers_400_401_503_as_istio() -> Result<()> {
    use ztunnel::identity::Identity;
    let topo = Topology::build(&prefix("r"), &[1, 2])?;
    // n1p1 is an unenrolled host speaking HBONE by hand; n2p2 is another mesh pod.
    let cfg = format!(
        "workloads:\n{}{}policies:\n- {{name: no-evil, namespace: default, scope: Global, action: Deny, rules: [[[{{principals: [{{Exact: cluster.local/ns/default/sa/evil}}]}}]]]}}\n",
        workload(&topo, "n2p1", "server", ""),
        workload(&topo, "n2p2", "other", ""),
    );
    let mesh = Mesh::start(topo, &cfg, &["n2p1", "n2p2"], &HashMap::new(), &[])?;
    let (peer, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let ca = hbone_peer::load_ca(&mesh.topo.dir.join("ca"))?;
    let me = Identity::new("cluster.local", "default", "client");
    let server_id = Identity::new("cluster.local", "default", "server");
    let hbone = addr(server, 15008);
    let h = hbone_peer::connect(&peer.netns, &ca, &me, server_id.clone(), hbone).await?;

    let target = |pod: &str, port: u16| addr(mesh.topo.pod(pod), port).to_string();
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&target("n2p1", 8080))).await?,
        200
    );
    // CONNECT target is another pod than the L3 destination.
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&target("n2p2", 8080))).await?,
        400
    );
    // CONNECT to the proxy's own port.
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&target("n2p1", 15008))).await?,
        400
    );
    // Not CONNECT.
    let get = http::Request::builder()
        .method("GET")
        .uri(format!("http://{}/", target("n2p1", 8080)))
        .body(())?;
    assert_eq!(hbone_peer::status(&h, get).await?, 400);
    // Nothing listens on 9999: 503.
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&target("n2p1", 9999))).await?,
        503
    );
    // The DENY policy names this identity: 401.
    let evil = Identity::new("cluster.local", "default", "evil");
    let h2 = hbone_peer::connect(&peer.netns, &ca, &evil, server_id.clone(), hbone).await?;
    assert_eq!(
        hbone_peer::status(&h2, hbone_peer::connect_req(&target("n2p1", 8080))).await?,
        401
    );
    // A client certificate from another trust domain is refused at the TLS layer.
    let foreign = Identity::new("other.domain", "default", "client");
    let r = async {
        let h3 = hbone_peer::connect(&peer.netns, &ca, &foreign, server_id.clone(), hbone).await?;
        hbone_peer::status(&h3, hbone_peer::connect_req(&target("n2p1", 8080))).await
    }
    .await;
    assert!(r.is_err(), "foreign trust domain was accepted: {r:?}");
    mesh.wait_logs(&[
        "client identity spiffe://other.domain/ns/default/sa/client is from trust domain",
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_workloads_and_unknown_addresses_pass_through() -> Result<()> {
    let topo = Topology::build(&prefix("q"), &[1, 1])?;
    let p = topo.pod("n2p1");
    let cfg = format!(
        "workloads:\n{}- {{uid: legacy, name: legacy, namespace: default, workloadIps: {}, protocol: TCP, node: node2}}\n",
        workload(&topo, "n1p1", "client", ""),
        ips_yaml(&p.ips)
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"plain tcp").await?,
        b"plain tcp"
    );
    assert_eq!(echo.peers()[0].ip(), client.ip);
    mesh.wait_logs(&[
        "protocol=\"TCP\"",
        &format!("dst.addr={}", addr(server, 8080)),
    ])?;
    // Connecting to a closed port of a passthrough destination fails fast (reset), no hang.
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        roundtrip(client, addr(server, 8081), b"x"),
    )
    .await?;
    assert!(
        r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
        "a closed port answered: {r:?}"
    );
    // Refused because the server refused it (passed through, not tunnelled or dropped).
    mesh.wait_log_line(&[
        "passthrough connect failed",
        &format!("dst={}", addr(server, 8081)),
        "Connection refused",
    ])?;
    Ok(())
}

/// Egress as Istio models it: a server outside the mesh (n2p1, not enrolled, in no
/// workload) reached through a PASSTHROUGH service whose CIDR VIP covers its address, and
/// through a CIDR VIP whose endpoint is a plaintext workload entry for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_servers_through_passthrough_and_cidr_vip_services() -> Result<()> {
    let topo = Topology::build(&prefix("eg"), &[1, 1])?;
    let ext = ips_yaml(&topo.pod("n2p1").ips);
    // Node 2's pod range and an outside range, in the topology's families.
    let (pods, outside, dialed): (Vec<&str>, Vec<&str>, SocketAddr) = match ip_family() {
        IpFamily::V4 => (
            vec!["10.10.2.0/24"],
            vec!["10.200.0.0/16"],
            "10.200.1.1:80".parse()?,
        ),
        IpFamily::V6 => (
            vec!["fd00:10:2::/64"],
            vec!["fd00:200::/32"],
            "[fd00:200::1:1]:80".parse()?,
        ),
        IpFamily::Dual => (
            vec!["10.10.2.0/24", "fd00:10:2::/64"],
            vec!["10.200.0.0/16", "fd00:200::/32"],
            "[fd00:200::1:1]:80".parse()?,
        ),
    };
    let cfg = format!(
        "workloads:\n{}- {{uid: ext, name: ext, namespace: default, workloadIps: {ext}, protocol: TCP,
   services: {{default/ext.example.com: {{80: 8080}}}}}}
services:
- {{name: egress, namespace: default, hostname: egress.example.com, cidrVips: {:?}, loadBalancer: {{mode: Passthrough}}}}
- {{name: ext, namespace: default, hostname: ext.example.com, cidrVips: {:?}, ports: {{80: 8080}}}}
",
        workload(&topo, "n1p1", "client", ""),
        pods,
        outside,
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    // PASSTHROUGH: to the original destination, named as the service's traffic.
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"egress").await?,
        b"egress"
    );
    mesh.wait_logs(&["dst.service=egress.example.com"])?;
    // Any address of the CIDR VIP reaches the service's endpoint on its target port.
    assert_eq!(roundtrip(client, dialed, b"cidr vip").await?, b"cidr vip");
    mesh.wait_logs(&["dst.service=ext.example.com"])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_calls_and_client_resets() -> Result<()> {
    let mesh = client_server_mesh("k", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    // Connections whose original destination is the proxy itself are refused, not looped.
    let loopback: std::net::IpAddr = if ip_family() == IpFamily::V4 {
        "127.0.0.1".parse()?
    } else {
        "::1".parse()?
    };
    for to in [SocketAddr::new(loopback, 15001), addr(client, 15006)] {
        let r =
            tokio::time::timeout(Duration::from_secs(5), roundtrip(client, to, b"loop?")).await?;
        assert!(
            r.map(|v| v.is_empty()).unwrap_or(true),
            "self-call to {to} was served"
        );
    }
    if capture_mode() == "nftables" {
        mesh.wait_logs(&[
            "refusing a connection to the proxy's own port",
            "refusing plaintext connection",
        ])?;
    } else {
        // eBPF leaves in-pod connections alone, so these reach the listeners with no
        // original destination at all.
        mesh.wait_logs(&[
            &format!("outbound{{src={}", host(loopback)),
            &format!("inbound_plaintext{{src={}", host(client.ip)),
            "cannot read the original destination; closing",
        ])?;
    }

    // A client that resets: the server app sees the connection end promptly.
    let l = server.netns.listen(9002)?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Told when the bytes sent before the reset have reached the app.
    let (arrived_tx, arrived) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Ok((mut s, _)) = l.accept().await {
            let mut buf = [0u8; 64];
            let mut got = 0;
            let mut arrived_tx = Some(arrived_tx);
            let end = loop {
                match s.read(&mut buf).await {
                    Ok(0) => break "eof",
                    Ok(n) => got += n,
                    Err(_) => break "reset",
                }
                if got >= 7 {
                    if let Some(t) = arrived_tx.take() {
                        let _ = t.send(());
                    }
                }
            };
            let _ = tx.send((got, end));
        }
    });
    let mut s = client.netns.connect(addr(server, 9002)).await?;
    tokio::io::AsyncWriteExt::write_all(&mut s, b"partial").await?;
    // Reset only once they are there: a reset overtaking them would discard them in flight.
    tokio::time::timeout(Duration::from_secs(5), arrived)
        .await?
        .map_err(|_| anyhow::anyhow!("the server app never got the bytes sent before the reset"))?;
    socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO))?;
    drop(s);
    let (got, end) = tokio::time::timeout(Duration::from_secs(5), rx).await??;
    assert_eq!(got, 7, "bytes sent before the reset must arrive");
    assert_eq!(
        end, "reset",
        "a client RST must reach the server as a reset, not a clean close"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_to_unreachable_peer_fails_together() -> Result<()> {
    let mesh = client_server_mesh("o", &[("CONNECT_TIMEOUT_MS", "1000")])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    // Node 2 silently drops HBONE: dials hang until the connect timeout.
    let node2 = mesh.topo.node(2);
    node2.exec("nft", &["add", "table", "inet", "blackhole"])?;
    node2.exec(
        "nft",
        &["add chain inet blackhole hold { type filter hook forward priority 0; }"],
    )?;
    node2.exec(
        "nft",
        &["add rule inet blackhole hold tcp dport 15008 drop"],
    )?;
    let start = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let ns = client.netns.clone();
        let to = addr(server, 8080);
        tasks.push(tokio::spawn(async move {
            let mut s = ns.connect(to).await?;
            echo_roundtrip(&mut s, b"x").await
        }));
    }
    for t in tasks {
        let r = t.await?;
        assert!(
            r.map(|v| v.is_empty()).unwrap_or(true),
            "got data through a black hole"
        );
    }
    let took = start.elapsed();
    // One shared dial attempt (1 s), not twenty in a row.
    assert!(
        took < Duration::from_secs(6),
        "queued connections redialed one by one: {took:?}"
    );
    mesh.wait_logs(&["failed while this request waited for it"])?;
    Ok(())
}

/// GET a path from a ztunnel's own HTTP endpoints, from inside its node netns.
async fn http_get(node: &Netns, port: u16, path: &str) -> Result<String> {
    http_request(node, "GET", port, path).await
}

async fn http_request(node: &Netns, method: &str, port: u16, path: &str) -> Result<String> {
    let mut s = node
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await?;
    let req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let body = echo_roundtrip(&mut s, req.as_bytes()).await?;
    Ok(String::from_utf8_lossy(&body).to_string())
}

/// The value of the one series of `name` whose labels contain all of `labels`.
fn series(scrape: &str, name: &str, labels: &[&str]) -> Option<u64> {
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_connections_and_exact_bytes() -> Result<()> {
    let topo = Topology::build(&prefix("m"), &[2, 1])?;
    let cfg = format!(
        "workloads:\n{}{}{}{ALLOW_ONLY_CLIENT}",
        workload(&topo, "n1p1", "client", ", canonicalName: sleep"),
        workload(&topo, "n1p2", "intruder", ""),
        workload(&topo, "n2p1", "server", ", canonicalName: echo"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n1p2", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert!(http_get(mesh.topo.node(2), 15021, "/healthz/ready")
        .await?
        .starts_with("HTTP/1.1 200"));

    for len in [1000usize, 2345] {
        assert_eq!(
            roundtrip(client, addr(server, 8080), &pattern(len, 9))
                .await?
                .len(),
            len
        );
    }
    let denied = roundtrip(mesh.topo.pod("n1p2"), addr(server, 8080), b"no").await;
    assert!(denied.map(|v| v.is_empty()).unwrap_or(true));
    mesh.wait_logs(&["connection denied"])?;

    let dst = [
        "source_principal=\"spiffe://cluster.local/ns/default/sa/client\"",
        "destination_principal=\"spiffe://cluster.local/ns/default/sa/server\"",
        "source_canonical_service=\"sleep\"",
        "destination_canonical_service=\"echo\"",
        "connection_security_policy=\"mutual_tls\"",
        "response_flags=\"-\"",
    ];
    let want = |reporter: &'static str| {
        let mut v = dst.to_vec();
        v.push(if reporter == "source" {
            "reporter=\"source\""
        } else {
            "reporter=\"destination\""
        });
        v
    };
    // Counters are updated as connections end; wait until both sides saw both connections.
    let mut node1 = String::new();
    let mut node2 = String::new();
    for _ in 0..100 {
        node1 = http_get(mesh.topo.node(1), 15020, "/metrics").await?;
        node2 = http_get(mesh.topo.node(2), 15020, "/stats/prometheus").await?;
        if series(
            &node1,
            "istio_tcp_connections_closed_total",
            &want("source"),
        ) == Some(2)
            && series(
                &node2,
                "istio_tcp_connections_closed_total",
                &want("destination"),
            ) == Some(2)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (scrape, reporter) in [(&node1, "source"), (&node2, "destination")] {
        let l = want(reporter);
        assert_eq!(
            series(scrape, "istio_tcp_connections_opened_total", &l),
            Some(2),
            "{reporter}:\n{scrape}"
        );
        assert_eq!(
            series(scrape, "istio_tcp_connections_closed_total", &l),
            Some(2),
            "{reporter}:\n{scrape}"
        );
        assert_eq!(
            series(scrape, "istio_tcp_received_bytes_total", &l),
            Some(3345),
            "{reporter}:\n{scrape}"
        );
        assert_eq!(
            series(scrape, "istio_tcp_sent_bytes_total", &l),
            Some(3345),
            "{reporter}:\n{scrape}"
        );
    }
    let deny = [
        "reporter=\"destination\"",
        "source_principal=\"spiffe://cluster.local/ns/default/sa/intruder\"",
        "response_flags=\"DENY\"",
    ];
    assert_eq!(
        series(&node2, "istio_tcp_connections_failed_total", &deny),
        Some(1),
        "{node2}"
    );
    let deny_src = [
        "reporter=\"source\"",
        "response_flags=\"DENY\"",
        "source_workload=\"n1p2\"",
    ];
    assert_eq!(
        series(&node1, "istio_tcp_connections_failed_total", &deny_src),
        Some(1),
        "{node1}"
    );
    // Istio's ztunnel dashboard panels: build info and the pod manager.
    assert!(
        node1.contains("istio_build{component=\"ztunnel\",tag=\""),
        "{node1}"
    );
    assert!(
        node1.contains("\nworkload_manager_active_proxy_count 2\n"),
        "{node1}"
    );
    assert!(
        node1.contains("\nworkload_manager_proxies_started_total 2\n"),
        "{node1}"
    );
    assert!(
        node1.contains("\nworkload_manager_pending_proxy_count 0\n"),
        "{node1}"
    );
    Ok(())
}

/// What Istio's dashboards, Kiali and `istioctl ztunnel-config connections` read about a
/// connection to a service: the inbound side names the service the client meant (from
/// the CONNECT's `forwarded: ...;host=`), both sides carry app/version/cluster labels and
/// the open-socket gauge, the access log names the clusters, and the admin dump lists the
/// open connection under each pod's `workloadState`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_names_the_service_and_lists_open_connections() -> Result<()> {
    let topo = Topology::build(&prefix("te"), &[1, 1])?;
    let meta = |app: &str| {
        format!(", canonicalName: {app}, canonicalRevision: v1, workloadName: {app}, workloadType: deployment, clusterId: c1")
    };
    let cfg = format!(
        "workloads:\n{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: {}, ports: {{80: 8080}}}}\n",
        workload(&topo, "n1p1", "client", &meta("sleep")),
        workload(&topo, "n2p1", "echo", &format!("{}, services: {{default/echo.default.svc.cluster.local: {{80: 8080}}}}", meta("echo"))),
        vips_yaml(10),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let mut open = client.netns.connect(SocketAddr::new(vip(10), 80)).await?;
    let mut buf = [0u8; 5];
    tokio::io::AsyncWriteExt::write_all(&mut open, b"hello").await?;
    open.read_exact(&mut buf).await?;

    // While it is open: listed on both sides, and counted as an open socket.
    let dump = |node: usize| {
        let n = mesh.topo.node(node).clone();
        async move {
            let text = http_get(&n, 15000, "/config_dump").await?;
            let body = text.split("\r\n\r\n").nth(1).context("no body")?;
            anyhow::Ok(serde_json::from_str::<serde_json::Value>(body)?)
        }
    };
    let d1 = dump(1).await?;
    let st = &d1["workloadState"]["n1p1"];
    assert_eq!(st["state"], "Up", "{d1:#}");
    assert_eq!(st["info"]["serviceAccount"], "client");
    let out = &st["connections"]["outbound"][0];
    assert_eq!(
        out["src"]
            .as_str()
            .map(|s| s.starts_with(&format!("{}:", host(client.ip)))),
        Some(true),
        "{st:#}"
    );
    assert_eq!(
        out["originalDst"],
        SocketAddr::new(vip(10), 80).to_string(),
        "{st:#}"
    );
    assert_eq!(out["actualDst"], addr(server, 15008).to_string(), "{st:#}");
    assert_eq!(out["protocol"], "HBONE");
    let d2 = dump(2).await?;
    let inb = &d2["workloadState"]["n2p1"]["connections"]["inbound"][0];
    assert_eq!(
        inb["originalDst"], "echo.default.svc.cluster.local",
        "{d2:#}"
    );
    assert_eq!(inb["actualDst"], addr(server, 8080).to_string());
    assert_eq!(
        inb["src"]
            .as_str()
            .map(|s| s.starts_with(&format!("{}:", host(client.ip)))),
        Some(true),
        "{inb}"
    );
    let node1 = http_get(mesh.topo.node(1), 15020, "/metrics").await?;
    assert!(
        node1.contains("istio_tcp_sockets_open{reporter=\"source\"} 1"),
        "{node1}"
    );
    let node2 = http_get(mesh.topo.node(2), 15020, "/metrics").await?;
    assert!(
        node2.contains("istio_tcp_sockets_open{reporter=\"destination\"} 1"),
        "{node2}"
    );
    drop(open);

    let labels = [
        "destination_service=\"echo.default.svc.cluster.local\"",
        "destination_service_name=\"echo\"",
        "source_app=\"sleep\"",
        "source_version=\"v1\"",
        "source_cluster=\"c1\"",
        "destination_app=\"echo\"",
        "destination_version=\"v1\"",
        "destination_cluster=\"c1\"",
    ];
    let mut scrapes = (String::new(), String::new());
    for _ in 0..100 {
        scrapes = (
            http_get(mesh.topo.node(1), 15020, "/metrics").await?,
            http_get(mesh.topo.node(2), 15020, "/metrics").await?,
        );
        let closed = |s: &str, r: &str| {
            series(
                s,
                "istio_tcp_connections_closed_total",
                &[&[r][..], &labels[..]].concat(),
            ) == Some(1)
        };
        // The socket gauge falls when the connection's task ends, just after the closed
        // counter rises (its access log line is written between the two).
        let released = scrapes
            .0
            .contains("istio_tcp_sockets_open{reporter=\"source\"} 0");
        if closed(&scrapes.0, "reporter=\"source\"")
            && closed(&scrapes.1, "reporter=\"destination\"")
            && released
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (node1, node2) = scrapes;
    assert_eq!(
        series(&node1, "istio_tcp_connections_closed_total", &labels),
        Some(1),
        "{node1}"
    );
    assert_eq!(
        series(&node2, "istio_tcp_connections_closed_total", &labels),
        Some(1),
        "the inbound side names the service:\n{node2}"
    );
    assert!(
        node1.contains("istio_tcp_sockets_open{reporter=\"source\"} 0"),
        "{node1}"
    );
    mesh.wait_logs(&[
        "src.cluster=c1",
        "dst.cluster=c1",
        "dst.service=echo.default.svc.cluster.local",
    ])?;
    let logs = mesh.logs();
    let line = |direction: &str| {
        logs.lines()
            .find(|l| l.contains(direction) && l.contains("connection complete"))
            .unwrap_or_default()
    };
    assert!(
        line("direction=\"inbound\"").contains("dst.service=echo.default.svc.cluster.local"),
        "{logs}"
    );
    // The client as the mesh knows it (the pod's address), not the loopback hop capture used.
    assert!(
        line("direction=\"outbound\"").contains(&format!("src.addr={}:", host(client.ip))),
        "{logs}"
    );
    let d1 = dump(1).await?;
    assert_eq!(
        d1["workloadState"]["n1p1"]["connections"]["outbound"],
        serde_json::json!([]),
        "closed connections leave the list"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_exits_zero() -> Result<()> {
    // Grace period 4 s -> drain deadline 3 s.
    let mut mesh = client_server_mesh("g", &[("TERMINATION_GRACE_PERIOD_SECONDS", "4")])?;
    let (client, server) = (mesh.topo.pod("n1p1").netns.clone(), mesh.topo.pod("n2p1"));
    let to = addr(server, 8080);
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    // A long-lived connection, open before the drain.
    let mut long = client.connect(to).await?;
    let mut buf = [0u8; 5];
    tokio::io::AsyncWriteExt::write_all(&mut long, b"hello").await?;
    long.read_exact(&mut buf).await?;

    mesh.ztunnels[1].terminate()?;
    mesh.wait_logs(&["draining: listeners closed, GOAWAY sent on HBONE"])?;
    assert!(
        http_get(mesh.topo.node(2), 15021, "/healthz/ready")
            .await?
            .starts_with("HTTP/1.1 503"),
        "draining proxy reports ready"
    );
    // The established connection keeps working during the drain...
    tokio::io::AsyncWriteExt::write_all(&mut long, b"still").await?;
    long.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"still");
    // ...new ones are refused (fail closed, never a hang).
    let fresh = tokio::time::timeout(
        Duration::from_secs(5),
        roundtrip(mesh.topo.pod("n1p1"), to, b"new"),
    )
    .await?;
    assert!(
        fresh.map(|v| v.is_empty()).unwrap_or(true),
        "a new connection was served while draining"
    );
    // The drain deadline ends the long-lived connection and the process exits 0.
    let started = std::time::Instant::now();
    let status = mesh.ztunnels[1]
        .wait_exit(Duration::from_secs(10))
        .context("ztunnel did not exit after the drain deadline")?;
    assert!(status.success(), "exit status {status}");
    assert!(started.elapsed() < Duration::from_secs(5));
    mesh.wait_logs(&["drain deadline reached"])?;
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), long.read_to_end(&mut rest)).await?;
    assert!(
        end.is_err() || rest.is_empty(),
        "connection should end with the process"
    );

    // Without connections in flight, the drain ends at once.
    let mut mesh = client_server_mesh("f", &[])?;
    let started = std::time::Instant::now();
    mesh.ztunnels[0].terminate()?;
    let status = mesh.ztunnels[0]
        .wait_exit(Duration::from_secs(10))
        .context("idle ztunnel did not exit")?;
    assert!(
        status.success() && started.elapsed() < Duration::from_secs(3),
        "{status} after {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_hands_over_without_failed_connections() -> Result<()> {
    let mut mesh = client_server_mesh("w", &[("TERMINATION_GRACE_PERIOD_SECONDS", "6")])?;
    let (client, server) = (mesh.topo.pod("n1p1").netns.clone(), mesh.topo.pod("n2p1"));
    let to = addr(server, 8080);
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let mut long = client.connect(to).await?;
    let mut buf = [0u8; 4];

    // A client opening new connections in a loop for the whole hand-off.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looper = {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = async {
                    let mut s = client.connect(to).await?;
                    echo_roundtrip(&mut s, b"ping").await
                };
                match tokio::time::timeout(Duration::from_secs(5), r).await {
                    Ok(Ok(v)) if v == b"ping" => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The new node-2 proxy binds beside the old one, then the old one drains.
    let new = mesh.spawn_ztunnel(2, "ztunnel-node2-new.log")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    mesh.ztunnels[1].terminate()?;
    // The established connection is served by the old proxy until it finishes draining.
    tokio::io::AsyncWriteExt::write_all(&mut long, b"live").await?;
    long.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"live");
    let status = mesh.ztunnels[1]
        .wait_exit(Duration::from_secs(15))
        .context("old ztunnel did not exit")?;
    assert!(status.success());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = looper.await?;
    assert!(
        failed.is_empty(),
        "{} of {} connections failed during the hand-off: {failed:?}",
        failed.len(),
        ok as usize + failed.len()
    );
    assert!(ok > 20, "too few connections exercised the hand-off: {ok}");
    assert!(
        new.log_text().contains("direction=\"inbound\""),
        "the new proxy never served a connection"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_is_local_and_controls_logging_and_drain() -> Result<()> {
    let mut mesh = client_server_mesh("a", &[])?;
    let node = mesh.topo.node(1).clone();
    assert!(http_get(&node, 15000, "/logging")
        .await?
        .contains("current log level is info"));
    let r = http_request(&node, "POST", 15000, "/logging?level=debug").await?;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("current log level is debug"),
        "{r}"
    );
    let r = http_request(&node, "POST", 15000, "/logging?level=no=such=filter[").await?;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    // Istio's forms: an empty level (or none) lists and changes nothing; scopes by Istio's
    // names, percent-encoded; reset returns to the start-up levels.
    for list in ["/logging?level=", "/logging"] {
        let r = http_request(&node, "POST", 15000, list).await?;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.contains("current log level is debug\n"),
            "{list}: {r}"
        );
    }
    let r = http_request(
        &node,
        "POST",
        15000,
        "/logging?level=access%3Dwarn%2Cproxy%3Dtrace",
    )
    .await?;
    assert!(r.contains("current log level is access=warn,ztunnel::access_log=warn,proxy=trace,ztunnel::proxy=trace,debug\n"), "{r}");
    let r = http_request(&node, "POST", 15000, "/logging?reset").await?;
    assert!(r.contains("current log level is info\n"), "{r}");
    let r = http_request(&node, "POST", 15000, "/logging?level=debug").await?;
    assert!(r.contains("current log level is debug\n"), "{r}");
    // Debug now reaches the log: pool events are logged at debug.
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(roundtrip(client, addr(server, 8080), b"dbg").await?, b"dbg");
    wait_for("debug log line", Duration::from_secs(5), || {
        mesh.ztunnels[0]
            .log_text()
            .contains("opened pooled HBONE connection")
    })?;
    // Only on localhost: the node's own address does not answer.
    let via_node_ip = node.connect(SocketAddr::new(node_ip(1), 15000)).await;
    assert!(via_node_ip.is_err(), "admin reachable on the node address");
    // /quitquitquit drains like SIGTERM and exits 0.
    assert!(http_request(&node, "POST", 15000, "/quitquitquit")
        .await?
        .starts_with("HTTP/1.1 200"));
    let status = mesh.ztunnels[0]
        .wait_exit(Duration::from_secs(10))
        .context("no exit after /quitquitquit")?;
    assert!(status.success());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_ebpf_falls_back_to_nftables_with_a_warning() -> Result<()> {
    let topo = Topology::build(&prefix("e"), &[2, 0])?;
    let cfg_path = topo.dir.join("mesh.yaml");
    std::fs::write(
        &cfg_path,
        format!(
            "workloads:\n{}{}",
            workload(&topo, "n1p1", "client", ""),
            workload(&topo, "n1p2", "server", "")
        ),
    )?;
    // A pin directory that is not on a bpf filesystem: eBPF cannot start.
    let not_bpffs = topo.dir.join("plain-dir");
    let (client, server) = (topo.pod("n1p1"), topo.pod("n1p2"));
    let pods = [
        format!("n1p1={}", client.netns.path().display()),
        format!("n1p2={}", server.netns.path().display()),
    ];
    let args = [
        "--local-xds-path",
        cfg_path.to_str().unwrap_or_default(),
        "--node-name",
        "node1",
        "--state-dir",
        &topo.dir.join("ca").display().to_string(),
        "--capture",
        "ebpf",
        "--bpf-pin-dir",
        not_bpffs.to_str().unwrap_or_default(),
        "--pod",
        &pods[0],
        "--pod",
        &pods[1],
    ]
    .map(String::from);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let z = topo.node(1).spawn(
        bins::ztunnel(),
        &args,
        &[("RUST_LOG", "info")],
        &topo.dir.join("ztunnel.log"),
    )?;
    z.wait_log("ztunnel ready", READY)?;
    let log = z.log_text();
    assert!(
        log.contains("\twarn\t")
            && log.contains("falling back to nftables capture")
            && log.contains("not a bpf filesystem"),
        "{log}"
    );
    assert!(log.contains("capture=nftables"), "{log}");
    // And capture works: the pods talk over HBONE.
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"fallback").await?,
        b"fallback"
    );
    let needle = format!("dst.addr={}", addr(server, 15008));
    wait_for("HBONE", Duration::from_secs(5), || {
        z.log_text().contains(&needle)
    })?;
    Ok(())
}

/// v4-mapped addresses reach IPv4 pods, so this is about IPv4: skipped on an IPv6-only
/// topology.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_sockets_are_captured_too() -> Result<()> {
    if !ip_family().has_v4() {
        return skipped("v4-mapped addresses need IPv4 pods");
    }
    let mesh = client_server_mesh("6", &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    // An AF_INET6 socket dialing a v4-mapped address (Java's default) must not bypass
    // the mesh.
    let v4 = server
        .ip_like("0.0.0.0".parse()?)
        .context("an IPv4 address")?;
    let mapped: SocketAddr = format!("[::ffff:{v4}]:8080").parse()?;
    let mut s = client.netns.connect(mapped).await?;
    assert_eq!(s.peer_addr()?, mapped, "the app sees the address it dialed");
    assert_eq!(echo_roundtrip(&mut s, b"dual stack").await?, b"dual stack");
    mesh.wait_logs(&[
        &format!("dst.addr={v4}:15008"),
        "src.identity=spiffe://cluster.local/ns/default/sa/client",
    ])?;
    Ok(())
}

/// Dual-stack pods, in every run: a pod dialed over IPv4 or IPv6, by address or through a
/// dual-stack service's VIP of either family, is reached in that family end to end (the
/// HBONE tunnel between the nodes, and the client address the app sees), as Istio's
/// ztunnel picks the endpoint address of the original destination's family.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_pods_keep_the_clients_family() -> Result<()> {
    let topo = Topology::build_family(&prefix("ds"), &[1, 1], IpFamily::Dual)?;
    let cfg = format!(
        "workloads:\n{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\", \"/fd00:96::10\"], ports: {{80: 8080}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    // `[::]` takes both families (IPv4 clients recorded as IPv4).
    let echo = EchoServer::serve(server.netns.listen_on("[::]:8080".parse()?)?, None)?;
    let (v4, v6): (std::net::IpAddr, std::net::IpAddr) =
        ("10.10.2.11".parse()?, "fd00:10:2::11".parse()?);
    assert_eq!(server.ips, [v4, v6]);
    let dialed = [
        SocketAddr::new(v4, 8080),
        SocketAddr::new(v6, 8080),
        "10.96.0.10:80".parse()?,
        "[fd00:96::10]:80".parse()?,
    ];
    for (i, to) in dialed.into_iter().enumerate() {
        let data = format!("over {to}");
        assert_eq!(
            roundtrip(client, to, data.as_bytes()).await?,
            data.as_bytes()
        );
        let peer = echo
            .peers()
            .get(i)
            .copied()
            .context("the app saw no connection")?;
        assert_eq!(
            Some(peer.ip()),
            client.ip_like(to.ip()),
            "dialed {to}: the app's peer is the client's address of that family"
        );
    }
    // The tunnels went to the server's address of each family.
    mesh.wait_logs(&[
        &format!("dst.addr={}", SocketAddr::new(v4, 15008)),
        &format!("dst.addr={}", SocketAddr::new(v6, 15008)),
    ])?;
    Ok(())
}

/// Istio's IPV6_ENABLED=false on dual-stack pods: IPv4 is meshed as ever; IPv6 has no
/// listeners, so it fails closed both ways, never reaching an app around the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_disabled_fails_closed_for_ipv6_only() -> Result<()> {
    let topo = Topology::build_family(&prefix("d6"), &[1, 2], IpFamily::Dual)?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n2p1"],
        &HashMap::new(),
        &[("IPV6_ENABLED", "false")],
    )?;
    let (client, server, outsider) = (
        mesh.topo.pod("n1p1"),
        mesh.topo.pod("n2p1"),
        mesh.topo.pod("n2p2"),
    );
    let echo = EchoServer::serve(server.netns.listen_on("[::]:8080".parse()?)?, None)?;
    let (v4, v6): (std::net::IpAddr, std::net::IpAddr) =
        ("10.10.2.11".parse()?, "fd00:10:2::11".parse()?);
    assert_eq!(
        roundtrip(client, SocketAddr::new(v4, 8080), b"v4").await?,
        b"v4"
    );
    mesh.wait_logs(&[&format!("dst.addr={}", SocketAddr::new(v4, 15008))])?;
    // Outbound IPv6 from an enrolled pod (eBPF: EPERM at connect; nftables: redirected to
    // a loopback port nothing listens on, reset) and inbound IPv6 from outside the mesh
    // (eBPF: dropped; nftables: reset).
    for from in [client, outsider] {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            roundtrip(from, SocketAddr::new(v6, 8080), b"v6"),
        )
        .await?;
        assert!(
            r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
            "IPv6 from {} got through: {r:?}",
            from.name
        );
    }
    assert_eq!(
        echo.peers().iter().map(|p| p.ip()).collect::<Vec<_>>(),
        [client.ips[0]],
        "only the IPv4 connection reached the app"
    );
    Ok(())
}

/// A pod whose workload lists an IPv6 address but whose netns has IPv6 off (as Istio
/// checks its loopback): it enrolls on IPv4, saying why its IPv6 is not served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_ipv6_off_enrolls_on_ipv4() -> Result<()> {
    let topo = Topology::build_family(&prefix("lo6"), &[1, 1], IpFamily::Dual)?;
    topo.pod("n2p1")
        .netns
        .exec("sysctl", &["-qw", "net.ipv6.conf.all.disable_ipv6=1"])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::serve(server.netns.listen_on("0.0.0.0:8080".parse()?)?, None)?;
    let v4: std::net::IpAddr = "10.10.2.11".parse()?;
    assert_eq!(
        roundtrip(client, SocketAddr::new(v4, 8080), b"v4").await?,
        b"v4"
    );
    mesh.wait_logs(&[
        "IPv6 is off on the pod's loopback",
        &format!("dst.addr={}", SocketAddr::new(v4, 15008)),
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_marks_from_another_pod_exempt_nothing() -> Result<()> {
    // n1p2 is a same-node pod outside the mesh that sets the proxy's marks on its own
    // sockets (SO_MARK needs only CAP_NET_RAW). It must still meet the server's policy.
    let topo = Topology::build(&prefix("n"), &[2, 0])?;
    let cfg = format!(
        "workloads:\n{}{ALLOW_ONLY_CLIENT}",
        workload(&topo, "n1p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1"], &HashMap::new(), &[])?;
    let (server, attacker) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n1p2"));
    let echo = EchoServer::start(&server.netns, 8080, None)?;
    for mark in [ztunnel::DELIVERY_MARK, ztunnel::PROXY_MARK] {
        let to = addr(server, 8080);
        let s = attacker
            .netns
            .run(move || -> std::io::Result<std::net::TcpStream> {
                let s = socket2::Socket::new(
                    socket2::Domain::for_address(to),
                    socket2::Type::STREAM,
                    None,
                )?;
                s.set_mark(mark)?;
                s.connect_timeout(&to.into(), Duration::from_secs(5))?;
                Ok(s.into())
            })?;
        if let Ok(s) = s {
            s.set_nonblocking(true)?;
            let mut s = tokio::net::TcpStream::from_std(s)?;
            let r =
                tokio::time::timeout(Duration::from_secs(5), echo_roundtrip(&mut s, b"bypass?"))
                    .await?;
            assert!(
                r.map(|v| v.is_empty()).unwrap_or(true),
                "mark {mark:#x} from another pod reached the app"
            );
        }
    }
    assert!(echo.peers().is_empty(), "the app saw {:?}", echo.peers());
    mesh.wait_logs(&[
        &format!("inbound_plaintext{{src={}", host(attacker.ip)),
        "response_flags=\"DENY\"",
    ])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_has_istio_fields_as_json() -> Result<()> {
    let mesh = client_server_mesh("j", &[("LOG_FORMAT", "json")])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"0123456789").await?,
        b"0123456789"
    );
    mesh.wait_logs(&["\"direction\":\"outbound\"", "\"direction\":\"inbound\""])?;
    let logs = mesh.logs();
    let events: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "connection complete")
        .collect();
    for direction in ["outbound", "inbound"] {
        let e = events
            .iter()
            .find(|e| e["direction"] == direction)
            .with_context(|| format!("no {direction} line in {logs}"))?;
        for field in [
            "src.addr",
            "src.workload",
            "src.namespace",
            "src.identity",
            "dst.addr",
            "dst.hbone_addr",
            "dst.workload",
            "dst.namespace",
            "dst.identity",
            "bytes_sent",
            "bytes_recv",
            "duration",
        ] {
            assert!(!e[field].is_null(), "{direction} line lacks {field}: {e}");
        }
        assert_eq!(e["bytes_sent"], 10, "{e}");
        assert_eq!(e["bytes_recv"], 10, "{e}");
        assert_eq!(e["src.workload"], "n1p1");
        assert_eq!(e["dst.namespace"], "default");
        assert!(
            e["duration"].as_str().is_some_and(|d| d.ends_with("ms")),
            "{e}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_refuses_new_connections_and_keeps_open_ones() -> Result<()> {
    // n1p1 is a plaintext client outside the mesh; n2p1 is a mesh pod whose ztunnel we
    // starve of file descriptors (each plaintext connection costs it two).
    let topo = Topology::build(&prefix("y"), &[1, 1])?;
    let cfg = format!("workloads:\n{}", workload(&topo, "n2p1", "server", ""));
    let mesh = Mesh::start(topo, &cfg, &["n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let mut first = client.netns.connect(addr(server, 8080)).await?;
    echo_once(&mut first, b"before").await?;
    let pid = mesh.ztunnels[1].pid().context("node2 ztunnel pid")?;
    let in_use = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    let limit = in_use + 20;
    sh(
        "prlimit",
        &[
            "--pid",
            &pid.to_string(),
            &format!("--nofile={limit}:{limit}"),
        ],
    )?;

    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..40 {
        let started = std::time::Instant::now();
        let attempt = async {
            let mut s = client.netns.connect(addr(server, 8080)).await?;
            echo_once(&mut s, b"x").await?;
            Ok::<_, anyhow::Error>(s)
        };
        match attempt.await {
            Ok(s) => held.push(s),
            Err(_) => {
                refused += 1;
                assert!(
                    started.elapsed() < Duration::from_secs(2),
                    "a refused connection hung for {:?}",
                    started.elapsed()
                );
            }
        }
    }
    assert!(
        refused > 0,
        "{} connections fit in {limit} descriptors?",
        held.len()
    );
    assert!(
        held.len() >= 5,
        "only {} connections before exhaustion",
        held.len()
    );
    // The open connections are unaffected and the proxy is alive.
    echo_once(&mut first, b"during").await?;
    for s in held.iter_mut().take(3) {
        echo_once(s, b"y").await?;
    }
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "ztunnel died"
    );
    // Descriptors come back as connections close: new connections work again.
    drop(held);
    wait_for("recovery", Duration::from_secs(10), || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() < limit - 4)
            .unwrap_or(false)
    })?;
    let mut again = client.netns.connect(addr(server, 8080)).await?;
    echo_once(&mut again, b"after").await?;
    echo_once(&mut first, b"still").await?;
    let text = mesh.topo.node(2).exec("curl", &["-s", "http://127.0.0.1:15020/stats/prometheus"]).or_else(|_| {
        // No curl: read it with a raw request.
        mesh.topo.node(2).exec("sh", &["-c", "exec 3<>/dev/tcp/127.0.0.1/15020; printf 'GET /stats/prometheus HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"])
    })?;
    let refused_counted = text.lines().any(|l| {
        (l.starts_with("ztunnel_connections_refused_total{reason=\"fd_exhaustion\"}")
            && !l.ends_with(" 0"))
            || (l.starts_with("istio_tcp_connections_failed_total{")
                && l.contains("response_flags=\"CONNECT\""))
    });
    assert!(refused_counted, "refusals not counted:\n{text}");
    Ok(())
}

/// Writes `data` on an open connection and reads the echo back.
async fn echo_once(s: &mut tokio::net::TcpStream, data: &[u8]) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    s.write_all(data).await?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await??;
    anyhow::ensure!(back == data, "echo mismatch");
    Ok(())
}

/// Istio's "sandwich" mode: the server workload has `applicationTunnel: {protocol: PROXY,
/// port: 15088}`, so an inbound HBONE connection to it arrives on 15088 (nothing listens
/// on the target port 8080) and starts with a PROXY v2 header naming the client pod and
/// its SPIFFE id; the tunnelled bytes follow intact. With LOCALHOST_APP_TUNNEL (Istio's
/// default) it arrives on 127.0.0.1 from loopback; with LOCALHOST_APP_TUNNEL=false on the
/// pod's address from the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_tunnel_gets_a_proxy_protocol_header() -> Result<()> {
    use ztunnel::proxy_protocol::{self, Addresses, Command};
    for (tag, env, localhost) in [
        ("z", &[][..], true),
        ("zf", &[("LOCALHOST_APP_TUNNEL", "false")][..], false),
    ] {
        let topo = Topology::build(&prefix(tag), &[1, 1])?;
        let tunnel = ", applicationTunnel: {protocol: PROXY, port: 15088}";
        let cfg = format!(
            "workloads:\n{}{}",
            workload(&topo, "n1p1", "client", ""),
            workload(&topo, "n2p1", "server", tunnel)
        );
        let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), env)?;
        let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
        // The app behind the tunnel: reads exactly the header, then echoes the rest.
        let listener = server.netns.listen(15088)?;
        let app = tokio::spawn(async move {
            let (mut s, peer) = listener.accept().await?;
            let local = s.local_addr()?;
            let header = proxy_protocol::read_header(&mut s).await?;
            let (mut r, mut w) = s.split();
            tokio::io::copy(&mut r, &mut w).await?;
            tokio::io::AsyncWriteExt::shutdown(&mut w).await?;
            Ok::<_, anyhow::Error>((peer, local, header))
        });
        let data = pattern(256 * 1024, 11);
        let back = roundtrip(client, addr(server, 8080), &data).await?;
        assert!(
            back == data,
            "payload through the tunnel differs ({} bytes back of {})",
            back.len(),
            data.len()
        );
        let (peer, local, header) = tokio::time::timeout(Duration::from_secs(10), app)
            .await
            .context("app never got a connection")???;
        if localhost {
            assert!(
                peer.ip().is_loopback() && local.ip().is_loopback(),
                "delivered {peer} -> {local}, not over loopback"
            );
        } else {
            assert_eq!(peer.ip(), client.ip, "the app's TCP peer is the client pod");
            assert_eq!(local, addr(server, 15088));
        }
        assert_eq!(header.command, Command::Proxy);
        let Addresses::Ip { src, dst } = header.addresses else {
            panic!("no IP addresses in {header:?}")
        };
        assert_eq!(src.ip(), client.ip, "{header:?}");
        assert_eq!(
            dst,
            addr(server, 8080),
            "the original target, not the tunnel port"
        );
        assert_eq!(
            header.peer_identity(),
            Some("spiffe://cluster.local/ns/default/sa/client")
        );
    }
    Ok(())
}

const ADMIN: &str = "127.0.0.1:15000";

/// Whether a connection is cut (EOF or reset) within 5 s; a hang is not.
async fn is_cut(s: &mut tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 16];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// CRL_PATH (Istio's, for plugged-in CAs): a CRL that does not list a peer lets traffic
/// through; a reload that revokes the server's certificate closes the open tunnel and
/// refuses new ones (A's ztunnel checks B's certificate); one that revokes the client's
/// is refused by B's ztunnel. The file appears only after the start (Istio's chart mounts
/// it as optional).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crl_refuses_revoked_peers_and_reload_closes_open_connections() -> Result<()> {
    let topo = Topology::build(&prefix("crl"), &[1, 1])?;
    let crl = topo.dir.join("ca-crl.pem");
    let crl_env = crl.display().to_string();
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n2p1"],
        &HashMap::new(),
        &[("CRL_PATH", &crl_env)],
    )?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"no CRL yet").await?,
        b"no CRL yet"
    );
    // The mesh's root, which node 1's ztunnel created; CRLs are signed with its key.
    let ca_dir = mesh.topo.dir.join("ca");
    let ca = ztunnel::identity::ca::Ca::from_files(
        &ca_dir.join("ca-cert.pem"),
        &ca_dir.join("ca-key.pem"),
    )?;
    let server_serial = cert_serial(
        mesh.topo.node(2),
        ADMIN.parse()?,
        "spiffe://cluster.local/ns/default/sa/server",
    )
    .await?;
    let client_serial = cert_serial(
        mesh.topo.node(1),
        ADMIN.parse()?,
        "spiffe://cluster.local/ns/default/sa/client",
    )
    .await?;
    let reloads = || {
        mesh.logs()
            .matches("reloaded certificate revocation lists")
            .count()
    };
    let ttl = Duration::from_secs(3600);

    // A CRL revoking someone else: traffic flows, and a tunnel stays open across the reload.
    write_crl(&crl, &ca.revocation_list(&["0badc0de"], 1, ttl)?)?;
    wait_for(
        "both ztunnels to load the first CRL",
        Duration::from_secs(10),
        || reloads() >= 2,
    )?;
    let mut open = client.netns.connect(addr(server, 8080)).await?;
    assert_eq!(echo_roundtrip_open(&mut open, b"before").await?, b"before");
    write_crl(
        &crl,
        &ca.revocation_list(&["0badc0de", "0badc0df"], 2, ttl)?,
    )?;
    wait_for("the second CRL", Duration::from_secs(10), || reloads() >= 4)?;
    assert_eq!(
        echo_roundtrip_open(&mut open, b"after").await?,
        b"after",
        "a reload that revokes no peer cut the tunnel"
    );
    assert_eq!(
        roundtrip(client, addr(server, 8080), b"other revoked").await?,
        b"other revoked"
    );

    // The server's certificate revoked: node 1 closes the open tunnel and refuses a new one.
    write_crl(
        &crl,
        &ca.revocation_list(&["0badc0de", &server_serial], 3, ttl)?,
    )?;
    wait_for(
        "the CRL revoking the server",
        Duration::from_secs(10),
        || reloads() >= 6,
    )?;
    assert!(
        is_cut(&mut open).await,
        "the tunnel to a revoked server stayed open"
    );
    let refused = |what: &'static str| async move {
        let r = roundtrip(client, addr(server, 8080), what.as_bytes()).await;
        assert!(
            r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
            "{what}: got through: {r:?}"
        );
    };
    refused("to a revoked server").await;
    mesh.wait_logs(&["closing a pooled HBONE connection: the server's certificate is revoked"])?;
    let scrape = http_get(mesh.topo.node(1), 15020, "/metrics").await?;
    assert!(
        series(
            &scrape,
            "istio_crl_policy_rejections_total",
            &["reporter=\"source\""]
        )
        .unwrap_or(0)
            >= 2,
        "{scrape}"
    );

    // Un-revoked, a tunnel opens again; revoking the client then makes node 2 close it
    // and refuse the client's next handshake.
    write_crl(&crl, &ca.revocation_list(&["0badc0de"], 4, ttl)?)?;
    wait_for(
        "the CRL un-revoking the server",
        Duration::from_secs(10),
        || reloads() >= 8,
    )?;
    let mut open = client.netns.connect(addr(server, 8080)).await?;
    assert_eq!(echo_roundtrip_open(&mut open, b"again").await?, b"again");
    write_crl(&crl, &ca.revocation_list(&[&client_serial], 5, ttl)?)?;
    wait_for(
        "the CRL revoking the client",
        Duration::from_secs(10),
        || reloads() >= 10,
    )?;
    assert!(
        is_cut(&mut open).await,
        "the tunnel from a revoked client stayed open"
    );
    refused("from a revoked client").await;
    mesh.wait_logs(&["closing an HBONE connection: the peer's certificate is revoked"])?;
    let scrape = http_get(mesh.topo.node(2), 15020, "/metrics").await?;
    assert!(
        series(
            &scrape,
            "istio_crl_policy_rejections_total",
            &["reporter=\"destination\""]
        )
        .unwrap_or(0)
            >= 2,
        "{scrape}"
    );

    // A broken file keeps the CRLs in force (the client stays refused); /config_dump says why.
    write_crl(&crl, "-----BEGIN X509 CRL-----\ntruncated")?;
    wait_for(
        "both ztunnels to see the broken CRL",
        Duration::from_secs(10),
        || {
            mesh.logs()
                .matches("CRL file changed but cannot be used")
                .count()
                >= 2
        },
    )?;
    refused("after a broken CRL").await;
    let text = http_get(mesh.topo.node(2), 15000, "/config_dump").await?;
    let dump: serde_json::Value =
        serde_json::from_str(text.split("\r\n\r\n").nth(1).context("no body")?)?;
    assert_eq!(
        dump["config"]["crlPath"],
        crl_env.as_str(),
        "{:#}",
        dump["config"]
    );
    assert_eq!(dump["crl"]["crls"][0]["revoked"], 1, "{:#}", dump["crl"]);
    assert!(
        dump["crl"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("not valid")),
        "{:#}",
        dump["crl"]
    );
    Ok(())
}

/// One echo exchange on a connection that stays open.
async fn echo_roundtrip_open(s: &mut tokio::net::TcpStream, data: &[u8]) -> Result<Vec<u8>> {
    tokio::io::AsyncWriteExt::write_all(s, data).await?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .context("echo timed out")??;
    Ok(back)
}

/// Multi-network (east-west), as Istio's ambient multi-network: network net0 (node 1:
/// client n1p1, intruder n1p3, a local echo n1p2) and net1 (node 2: echo pods n2p1,
/// n2p2) joined only through the gateway netns, where a stand-in east-west gateway
/// (`hbone_peer::EastWestGateway`) forwards double HBONE. net1's workloads name it as their
/// `networkGateway`; each ztunnel runs with its NETWORK. The client reaches a service
/// whose pods are all in net1 through the gateway only (no route from net0 to net1's
/// pods; on the gateway's net1 leg only TLS to :15008 from the gateway, never the
/// plaintext); net1's ztunnel sees the client's identity (its ALLOW policy lets the
/// client in and keeps the intruder out, 401 inside the gateway's stream); a FAILOVER
/// service with a NETWORK preference stays in net0 while a STANDARD one spreads over both
/// networks; a net1 endpoint without a gateway is refused, never dialed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_network_is_reached_through_its_east_west_gateway() -> Result<()> {
    // The multi-network topology is IPv4: run in the default (IPv4) run only.
    if ip_family() != IpFamily::V4 {
        return skipped("the multi-network topology is IPv4 only");
    }
    use ztunnel::identity::Identity;
    let topo = Topology::build_networks(&prefix("mn"), &[&[3], &[2]])?;
    let gw_net0 = Topology::gateway_ip(0);
    let gw_net1 = Topology::gateway_ip(1);
    let via_gw = format!(", networkGateway: {{destination: net1/{gw_net0}}}");
    let svcs = |names: &[&str]| {
        let list: Vec<String> = names
            .iter()
            .map(|n| format!("default/{n}.default.svc.cluster.local: {{80: 8080}}"))
            .collect();
        format!(", services: {{{}}}", list.join(", "))
    };
    let service = |name: &str, vip: u8, extra: &str| {
        format!(
            "- {{name: {name}, namespace: default, hostname: {name}.default.svc.cluster.local, vips: [net0/10.96.0.{vip}, net1/10.96.1.{vip}], ports: {{80: 8080}},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/echo]{extra}}}\n"
        )
    };
    let cfg = format!(
        "workloads:\n{}{}{}{}{}\
- {{uid: eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest, workloadIps: [{gw_net0}, {gw_net1}], network: net1}}
- {{uid: lonely, name: lonely, namespace: default, serviceAccount: echo, workloadIps: [10.10.2.99], protocol: HBONE, network: net1{}}}
services:\n{}{}{}{}{ALLOW_ONLY_CLIENT}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "echo", &svcs(&["near", "spread"])),
        workload(&topo, "n1p3", "intruder", ""),
        workload(&topo, "n2p1", "echo", &format!("{via_gw}{}", svcs(&["echo", "near", "spread"]))),
        workload(&topo, "n2p2", "echo", &format!("{via_gw}{}", svcs(&["echo"]))),
        svcs(&["lonely"]),
        service("echo", 50, ""),
        service("near", 51, ", loadBalancer: {mode: Failover, routingPreferences: [Network]}"),
        service("spread", 52, ""),
        service("lonely", 53, ""),
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n1p2", "n1p3", "n2p1", "n2p2"],
        &HashMap::new(),
        &[],
    )?;
    let topo = &mesh.topo;
    let ca = hbone_peer::load_ca(&topo.dir.join("ca"))?;
    let state = ztunnel::config::LocalConfig::parse(std::path::Path::new("mesh.yaml"), &cfg)?
        .into_state(std::path::Path::new("mesh.yaml"))?;
    let gw_ns = topo.gateway.clone().context("no gateway netns")?;
    let gateway = hbone_peer::EastWestGateway::start(
        &gw_ns,
        &ca,
        &Identity::new("cluster.local", "istio-system", "eastwest"),
        state,
        "net1",
    )
    .await?;
    let mut echoes = Vec::new();
    for pod in ["n1p2", "n2p1", "n2p2"] {
        echoes.push(EchoServer::start(&topo.pod(pod).netns, 8080, Some(pod))?);
    }
    let (client, intruder) = (topo.pod("n1p1"), topo.pod("n1p3"));

    // By routes: net0 has no path to net1's pods (no route: refused at once, not a timeout).
    let direct = topo.node(1).connect(addr(topo.pod("n2p1"), 8080)).await;
    assert!(direct.is_err(), "net0 reached a net1 pod directly");

    // The service whose pods are all in net1, through the gateway; the plaintext never
    // crosses the gateway's net1 leg (TLS to the pods' 15008 only, from the gateway).
    let capture = Capture::start(&gw_ns, "eth1", &topo.dir)?;
    let marker = b"plaintext-marker-that-must-not-cross-networks".repeat(20);
    let mut answered: HashMap<String, usize> = HashMap::new();
    for _ in 0..20 {
        let mut s = client.netns.connect("10.96.0.50:80".parse()?).await?;
        let who = read_line(&mut s).await?;
        assert_eq!(echo_roundtrip(&mut s, &marker).await?, marker, "{who}");
        *answered.entry(who).or_default() += 1;
    }
    let packets = capture.stop()?;
    // Nested flow control (a stream inside a stream) still copies every byte.
    let big = pattern(8 << 20, 11);
    let mut s = client.netns.connect("10.96.0.50:80".parse()?).await?;
    let who = read_line(&mut s).await?;
    let started = std::time::Instant::now();
    assert!(
        echo_roundtrip(&mut s, &big).await? == big,
        "8 MiB through the gateway came back altered ({who})"
    );
    println!(
        "8 MiB echoed through the east-west gateway in {:?}",
        started.elapsed()
    );
    assert_eq!(
        answered
            .keys()
            .map(String::as_str)
            .filter(|w| w.starts_with("n2p"))
            .count(),
        2,
        "both net1 pods serve: {answered:?}"
    );
    assert!(
        !answered.contains_key("n1p2"),
        "the echo service has no net0 endpoint: {answered:?}"
    );
    let data: Vec<&Packet> = packets.iter().filter(|p| !p.payload.is_empty()).collect();
    assert!(
        !data.is_empty(),
        "nothing crossed the gateway's net1 leg ({} packets)",
        packets.len()
    );
    for p in &data {
        let (gw, pod) = if p.src.ip() == std::net::IpAddr::from(gw_net1) {
            (p.src, p.dst)
        } else {
            (p.dst, p.src)
        };
        assert_eq!(
            gw.ip(),
            std::net::IpAddr::from(gw_net1),
            "a packet on net1 not from or to the gateway: {} -> {}",
            p.src,
            p.dst
        );
        assert_eq!(
            pod.port(),
            15008,
            "net1 reached on another port than HBONE's: {} -> {}",
            p.src,
            p.dst
        );
    }
    let first = data
        .iter()
        .find(|p| p.dst.port() == 15008)
        .context("no packet to 15008")?;
    assert_eq!(
        &first.payload[..2],
        &[0x16, 0x03],
        "the inner tunnel does not start with a TLS handshake"
    );
    let all: Vec<u8> = data.iter().flat_map(|p| p.payload.clone()).collect();
    assert!(
        !all.windows(16).any(|w| w == &marker[..16]),
        "plaintext crossed the gateway"
    );
    // The app sees the gateway as its peer (as with Istio's gateway).
    assert!(echoes[1]
        .peers()
        .iter()
        .chain(echoes[2].peers().iter())
        .all(|p| p.ip() == std::net::IpAddr::from(gw_net1)));
    // The gateway saw the client's identity and a CONNECT naming the service, and no
    // network header (that is for the inner CONNECT, which it cannot read).
    let seen = gateway.seen();
    assert!(seen.len() >= 20, "{seen:?}");
    for f in seen.iter().filter(|f| f.status == 200) {
        assert_eq!(
            f.client,
            Identity::new("cluster.local", "default", "client")
        );
        assert_eq!(f.authority, "echo.default.svc.cluster.local:80");
        assert_eq!(f.forwarded_network, None);
    }
    // End to end: net1's ztunnel verified the client's identity inside the gateway's
    // stream, and the client's verified net1's (the service's SAN).
    let line_with = |node: usize, needles: &[String]| {
        let z = &mesh.ztunnels[node - 1];
        wait_for(
            &format!("a node{node} log line with {needles:?}"),
            Duration::from_secs(5),
            || {
                z.log_text()
                    .lines()
                    .any(|l| needles.iter().all(|n| l.contains(n.as_str())))
            },
        )
        .with_context(|| z.log_text())
    };
    let client_id = "src.identity=spiffe://cluster.local/ns/default/sa/client".to_string();
    let hbone_addr = "dst.hbone_addr=echo.default.svc.cluster.local:80".to_string();
    line_with(
        2,
        &[
            "direction=\"inbound\"".into(),
            client_id.clone(),
            hbone_addr.clone(),
            format!("src.addr={gw_net1}:"),
        ],
    )?;
    line_with(
        1,
        &[
            "direction=\"outbound\"".into(),
            client_id,
            hbone_addr,
            format!("dst.addr={gw_net0}:15008"),
            // The destination is the one that answered (its response baggage and the
            // identity it proved), not the gateway (response_baggage_labels_...).
            "dst.namespace=default".into(),
            "dst.identity=spiffe://cluster.local/ns/default/sa/echo".into(),
        ],
    )?;

    // Policy on net1 applies to the client's identity: the intruder is denied there.
    let r = roundtrip(intruder, "10.96.0.50:80".parse()?, b"let me in").await;
    assert!(
        r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
        "the intruder got data: {r:?}"
    );
    mesh.wait_logs(&[
        "src.identity=spiffe://cluster.local/ns/default/sa/intruder",
        "no ALLOW policy matched",
        "answered 401",
    ])?;

    // A NETWORK preference keeps the client in net0; without one both networks serve.
    let mut near = HashMap::new();
    let mut spread = HashMap::new();
    for _ in 0..16 {
        let mut s = client.netns.connect("10.96.0.51:80".parse()?).await?;
        *near.entry(read_line(&mut s).await?).or_insert(0) += 1;
        let mut s = client.netns.connect("10.96.0.52:80".parse()?).await?;
        *spread.entry(read_line(&mut s).await?).or_insert(0) += 1;
    }
    assert_eq!(
        near.keys().collect::<Vec<_>>(),
        ["n1p2"],
        "FAILOVER with a NETWORK preference left net0: {near:?}"
    );
    assert!(
        spread.contains_key("n1p2") && spread.contains_key("n2p1"),
        "STANDARD picks in both networks: {spread:?}"
    );

    // /config_dump in Istio's shape: the node's network, workloads' networks and gateways.
    let text = http_get(topo.node(1), 15000, "/config_dump").await?;
    let d: serde_json::Value =
        serde_json::from_str(text.split("\r\n\r\n").nth(1).context("no body")?)?;
    assert_eq!(d["config"]["network"], "net0");
    let n2p1 = d["workloads"]
        .as_array()
        .and_then(|w| w.iter().find(|w| w["uid"] == "n2p1"))
        .context("n2p1 not in the dump")?;
    assert_eq!(
        (&n2p1["network"], &n2p1["networkGateway"]),
        (
            &serde_json::json!("net1"),
            &serde_json::json!({"destination": format!("net1/{gw_net0}"), "hboneMtlsPort": 15008})
        )
    );

    // A net1 endpoint with no gateway: refused by the client's ztunnel, never dialed.
    let before = gateway.seen().len();
    let r = roundtrip(client, "10.96.0.53:80".parse()?, b"anyone?").await;
    assert!(r.as_ref().map(|v| v.is_empty()).unwrap_or(true), "{r:?}");
    mesh.wait_logs(&["endpoint lonely is in network \"net1\" and names no gateway to it"])?;
    assert_eq!(
        gateway.seen().len(),
        before,
        "the gateway was asked for an endpoint it does not serve"
    );
    Ok(())
}

/// Response baggage (Istio's `ENABLE_RESPONSE_BAGGAGE`, on by default) through an
/// east-west gateway, where neither end can look the other up: the client's ztunnel
/// labels the destination by the baggage on the inner tunnel's 200 (not as the gateway
/// it dialed), and the destination's ztunnel labels the source by the CONNECT's baggage
/// (the source address is the gateway's). Network net0: node 1 (client n1p1); net1:
/// node 2 (n2p1, service echo-a) and node 3 (n3p1, service echo-b), node 3's ztunnel
/// with `ENABLE_RESPONSE_BAGGAGE=false`: its 200 carries no baggage, so the client
/// labels that destination `unknown` but for the principal it proved, and it ignores
/// the request's baggage (source `unknown` but for the principal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_baggage_labels_the_peer_behind_an_east_west_gateway() -> Result<()> {
    if ip_family() != IpFamily::V4 {
        return skipped("the multi-network topology is IPv4 only");
    }
    use ztunnel::identity::Identity;
    let topo = Topology::build_networks(&prefix("rb"), &[&[1], &[1, 1]])?;
    let gw_net0 = Topology::gateway_ip(0);
    let gw_net1 = Topology::gateway_ip(1);
    let meta = |name: &str, rev: &str, cluster: &str, zone: &str| {
        format!(
            ", workloadName: {name}, workloadType: deployment, canonicalName: {name}-svc, canonicalRevision: {rev}, clusterId: {cluster}, locality: {{region: r1, zone: {zone}}}"
        )
    };
    let endpoint_of = |svc: &str| {
        format!(
            ", networkGateway: {{destination: net1/{gw_net0}}}, services: {{default/{svc}.default.svc.cluster.local: {{80: 8080}}}}"
        )
    };
    let service = |name: &str, vip: u8| {
        format!(
            "- {{name: {name}, namespace: default, hostname: {name}.default.svc.cluster.local, vips: [net0/10.96.0.{vip}, net1/10.96.1.{vip}], ports: {{80: 8080}},
   subjectAltNames: [spiffe://cluster.local/ns/default/sa/echo]}}\n"
        )
    };
    let cfg = format!(
        "workloads:\n{}{}{}\
- {{uid: eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest, workloadIps: [{gw_net0}, {gw_net1}], network: net1}}
services:\n{}{}",
        workload(&topo, "n1p1", "client", &meta("sleep", "v0", "west", "z0")),
        workload(
            &topo,
            "n2p1",
            "echo",
            &format!("{}{}", endpoint_of("echo-a"), meta("echo-a", "v1", "east", "z1"))
        ),
        workload(
            &topo,
            "n3p1",
            "echo",
            &format!("{}{}", endpoint_of("echo-b"), meta("echo-b", "v2", "east", "z2"))
        ),
        service("echo-a", 60),
        service("echo-b", 61),
    );
    let node_env = HashMap::from([(3, vec![("ENABLE_RESPONSE_BAGGAGE", "false")])]);
    let mesh = Mesh::start_with_node_env(
        topo,
        &cfg,
        &["n1p1", "n2p1", "n3p1"],
        &HashMap::new(),
        &[],
        &node_env,
    )?;
    let topo = &mesh.topo;
    let ca = hbone_peer::load_ca(&topo.dir.join("ca"))?;
    let state = ztunnel::config::LocalConfig::parse(std::path::Path::new("mesh.yaml"), &cfg)?
        .into_state(std::path::Path::new("mesh.yaml"))?;
    let _gateway = hbone_peer::EastWestGateway::start(
        topo.gateway.as_ref().context("no gateway netns")?,
        &ca,
        &Identity::new("cluster.local", "istio-system", "eastwest"),
        state,
        "net1",
    )
    .await?;
    let _echoes = [
        EchoServer::start(&topo.pod("n2p1").netns, 8080, Some("n2p1"))?,
        EchoServer::start(&topo.pod("n3p1").netns, 8080, Some("n3p1"))?,
    ];
    let client = topo.pod("n1p1");
    for (vip, pod) in [("10.96.0.60:80", "n2p1"), ("10.96.0.61:80", "n3p1")] {
        let mut s = client.netns.connect(vip.parse()?).await?;
        assert_eq!(read_line(&mut s).await?, pod);
        assert_eq!(echo_roundtrip(&mut s, b"hello").await?, b"hello");
    }

    // Each side counts the connection as it opens (before any byte is relayed).
    let opened = "istio_tcp_connections_opened_total";
    let client_id = "spiffe://cluster.local/ns/default/sa/client";
    let echo_id = "spiffe://cluster.local/ns/default/sa/echo";
    let scrape = |n: usize| http_get(topo.node(n), 15020, "/metrics");
    let (node1, node2, node3) = (scrape(1).await?, scrape(2).await?, scrape(3).await?);
    // The client's ztunnel: echo-a's destination as its 200 described it (Istio's
    // derived destination: app is the workload name), with the identity it proved.
    let echo_a = format!(
        "reporter=\"source\",source_workload=\"sleep\",source_canonical_service=\"sleep-svc\",source_canonical_revision=\"v0\",source_workload_namespace=\"default\",source_principal=\"{client_id}\",source_app=\"sleep-svc\",source_version=\"v0\",source_cluster=\"west\",\
destination_workload=\"echo-a\",destination_canonical_service=\"echo-a-svc\",destination_canonical_revision=\"v1\",destination_workload_namespace=\"default\",destination_principal=\"{echo_id}\",destination_app=\"echo-a\",destination_version=\"v1\",destination_cluster=\"east\",\
destination_service=\"echo-a.default.svc.cluster.local\""
    );
    assert_eq!(
        series(
            &node1,
            opened,
            &[&echo_a, "destination_region=\"r1\",destination_zone=\"z1\""]
        ),
        Some(1),
        "{node1}"
    );
    // echo-b's said nothing (ENABLE_RESPONSE_BAGGAGE=false there): unknown, not the gateway.
    let echo_b = format!(
        "destination_workload=\"unknown\",destination_canonical_service=\"unknown\",destination_canonical_revision=\"unknown\",destination_workload_namespace=\"unknown\",destination_principal=\"{echo_id}\",destination_app=\"unknown\",destination_version=\"unknown\",destination_cluster=\"unknown\",\
destination_service=\"echo-b.default.svc.cluster.local\""
    );
    assert_eq!(
        series(&node1, opened, &["reporter=\"source\"", &echo_b]),
        Some(1),
        "{node1}"
    );
    assert!(
        !node1.contains("destination_workload=\"eastwest\""),
        "a destination labelled as the gateway:\n{node1}"
    );
    // Node 2: the source as its request baggage describes it.
    let from_baggage = format!(
        "reporter=\"destination\",source_workload=\"sleep\",source_canonical_service=\"sleep-svc\",source_canonical_revision=\"v0\",source_workload_namespace=\"default\",source_principal=\"{client_id}\",source_app=\"sleep\",source_version=\"v0\",source_cluster=\"west\",destination_workload=\"echo-a\""
    );
    assert_eq!(
        series(
            &node2,
            opened,
            &[&from_baggage, "source_region=\"r1\",source_zone=\"z0\""]
        ),
        Some(1),
        "{node2}"
    );
    // Node 3 ignores it: only the verified identity.
    let unknown_source = format!(
        "reporter=\"destination\",source_workload=\"unknown\",source_canonical_service=\"unknown\",source_canonical_revision=\"unknown\",source_workload_namespace=\"unknown\",source_principal=\"{client_id}\",source_app=\"unknown\",source_version=\"unknown\",source_cluster=\"unknown\",destination_workload=\"echo-b\""
    );
    assert_eq!(
        series(&node3, opened, &[&unknown_source]),
        Some(1),
        "{node3}"
    );

    // The access logs say the same (Istio's fields: the destination's workload name, the
    // source's canonical service).
    let line_with = |node: usize, needles: &[&str], absent: &str| {
        let z = &mesh.ztunnels[node - 1];
        wait_for(
            &format!("a node{node} log line with {needles:?} and without {absent:?}"),
            Duration::from_secs(5),
            || {
                z.log_text()
                    .lines()
                    .any(|l| needles.iter().all(|n| l.contains(n)) && !l.contains(absent))
            },
        )
        .with_context(|| z.log_text())
    };
    let dst_id = format!("dst.identity={echo_id}");
    let gw = format!("dst.addr={gw_net0}:15008");
    line_with(
        1,
        &[
            "direction=\"outbound\"",
            "dst.hbone_addr=echo-a.default.svc.cluster.local:80",
            &gw,
            "dst.workload=echo-a",
            "dst.namespace=default",
            "dst.cluster=east",
            &dst_id,
        ],
        "dst.workload=eastwest",
    )?;
    line_with(
        1,
        &[
            "direction=\"outbound\"",
            "dst.hbone_addr=echo-b.default.svc.cluster.local:80",
            &gw,
            &dst_id,
        ],
        "dst.workload",
    )?;
    let src_id = format!("src.identity={client_id}");
    line_with(
        2,
        &[
            "direction=\"inbound\"",
            "src.workload=sleep-svc",
            "src.namespace=default",
            "src.cluster=west",
            &src_id,
        ],
        "src.workload=n1p1",
    )?;
    line_with(3, &["direction=\"inbound\"", &src_id], "src.workload")?;

    // The dumps show each node's setting under Istio's name.
    for (n, on) in [(1, true), (3, false)] {
        let text = http_get(topo.node(n), 15000, "/config_dump").await?;
        let d: serde_json::Value =
            serde_json::from_str(text.split("\r\n\r\n").nth(1).context("no body")?)?;
        assert_eq!(d["config"]["enableEnhancedBaggage"], on, "node{n}");
    }
    Ok(())
}
