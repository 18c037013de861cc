//! Waypoint end to end: client pod -> ztunnel (node1) -> waypoint pod -> ztunnel (node2)
//! -> server pod, all over HBONE with each hop's own identity.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::jwt::{b64url, es256_key, rs256_key, sign};
use mesh_tests::netsim::*;
use mesh_tests::{bins, fake_istiod, fake_kube, hbone_peer, http_app, netsim, test_servers};

mod connection_pool;
mod crl;
mod destination_rule;
mod egress;
mod http10;
mod idle;
mod istio_shape;
mod opaque;
mod retries;
mod stream_idle;
mod telemetry;
mod tenancy;
mod tls_routes;
mod trust_domain;
mod virtual_service;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_traffic_goes_through_the_waypoint() -> Result<()> {
    let topo = Topology::build(&prefix("wb"), &[2, 1])?;
    let (wp_ip, server_ip) = (topo.pod("n1p2").ip, topo.pod("n2p1").ip);
    let svc = ", services: {default/echo.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\", hboneMtlsPort: 15008}}}}\n\
         - {{name: lost, namespace: default, hostname: lost.default.svc.cluster.local, vips: [\"/10.96.0.11\"], ports: {{80: 8080}}, waypoint: {{destination: \"/10.10.9.9\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "echo", &svc.replace("{80: 8080}}", "{80: 8080}, default/lost.default.svc.cluster.local: {80: 8080}}")),
    );
    // The waypoint pod is not enrolled: it speaks HBONE itself.
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let echo = EchoServer::start(&server.netns, 8080, None)?;

    // Through the service VIP: client -> waypoint -> server, bytes intact.
    let data = pattern(256 * 1024, 5);
    let mut s = client.netns.connect("10.96.0.10:80".parse()?).await?;
    assert_eq!(echo_roundtrip(&mut s, &data).await?, data);
    wait_for("waypoint log", Duration::from_secs(5), || {
        waypoint.log_text().contains("connection complete")
    })?;
    let wl = waypoint.log_text();
    assert!(
        wl.contains("src.identity=spiffe://cluster.local/ns/default/sa/client"),
        "{wl}"
    );
    assert!(
        wl.contains("dst.workload=n2p1") && wl.contains("bytes_sent=262144"),
        "{wl}"
    );
    mesh.wait_logs(&[
        &format!("dst.addr={wp_ip}:15008"),
        "dst.identity=spiffe://cluster.local/ns/default/sa/waypoint",
        "src.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;
    // The server app still sees the waypoint's address as its peer (the waypoint is
    // the TCP client of the last hop), and the client's identity reached the waypoint.
    assert_eq!(echo.peers().last().map(|p| p.ip()), Some(wp_ip));

    // Direct pod traffic has no waypoint in this config: it goes straight to node2.
    let before = waypoint.log_text().matches("connection complete").count();
    let mut s = client
        .netns
        .connect(SocketAddr::new(server_ip, 8080))
        .await?;
    assert_eq!(echo_roundtrip(&mut s, b"direct").await?, b"direct");
    mesh.wait_logs(&["src.identity=spiffe://cluster.local/ns/default/sa/client"])?;
    assert_eq!(
        waypoint.log_text().matches("connection complete").count(),
        before
    );

    // A service whose waypoint is unknown fails instead of skipping the waypoint.
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = client.netns.connect("10.96.0.11:80".parse()?).await?;
        echo_roundtrip(&mut s, b"around?").await
    })
    .await?;
    assert!(
        r.map(|v| v.is_empty()).unwrap_or(true),
        "traffic went around an unknown waypoint"
    );
    mesh.wait_logs(&["waypoint /10.10.9.9 (not a known workload)"])?;

    // The waypoint relays only for destinations that use it: not to itself (a loop) and
    // not to a pod without a waypoint (that would swap the client's identity for its own).
    let ca = hbone_peer::load_ca(&t.dir.join("ca"))?;
    let me = ztunnel::identity::Identity::new("cluster.local", "default", "client");
    let wp_id = ztunnel::identity::Identity::new("cluster.local", "default", "waypoint");
    let h = hbone_peer::connect(t.node(1), &ca, &me, wp_id, SocketAddr::new(wp_ip, 15008)).await?;
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&format!("{wp_ip}:8080"))).await?,
        503
    );
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req(&format!("{server_ip}:8080"))).await?,
        503
    );
    assert_eq!(
        hbone_peer::status(&h, hbone_peer::connect_req("10.96.0.10:80")).await?,
        200
    );
    let wl = waypoint.log_text();
    assert!(
        wl.contains("not a service or workload that uses this waypoint"),
        "{wl}"
    );
    Ok(())
}

/// Starts our waypoint binary in `pod`'s netns on the mesh file `cfg`; waits until ready.
fn start_waypoint(
    t: &Topology,
    pod: &str,
    cfg: &std::path::Path,
    log: &str,
) -> Result<netsim::Child> {
    start_waypoint_with(t, pod, cfg, log, &[])
}

/// `start_waypoint` with more arguments.
fn start_waypoint_with(
    t: &Topology,
    pod: &str,
    cfg: &std::path::Path,
    log: &str,
    extra: &[&str],
) -> Result<netsim::Child> {
    let state = t.dir.join("ca");
    let (cfg, state) = (cfg.display().to_string(), state.display().to_string());
    let mut args = vec![
        "--local-xds-path",
        &cfg,
        "--workload-uid",
        pod,
        "--state-dir",
        &state,
    ];
    args.extend_from_slice(extra);
    let w = t.pod(pod).netns.spawn(
        bins::waypoint(),
        &args,
        &[("RUST_LOG", "info")],
        &t.dir.join(log),
    )?;
    w.wait_log("waypoint ready", READY)?;
    Ok(w)
}

/// An IPv6-only cluster: a service's traffic goes through its waypoint, which has no IPv4
/// address (listening on `[::]:15008`): ztunnel reaches it over IPv6 (neither skipping
/// it nor failing), and it reaches the endpoint over IPv6 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_only_waypoint_carries_service_traffic() -> Result<()> {
    let topo = Topology::build_family(&prefix("w6"), &[2, 1], IpFamily::V6)?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/fd00:96::10\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &t.dir.join("mesh-node1.yaml"),
        "waypoint.log",
        &["--listen", "[::]:15008"],
    )?;
    let echo = EchoServer::serve(server.netns.listen_on("[::]:8080".parse()?)?, None)?;
    let data = pattern(64 * 1024, 6);
    let mut s = client.netns.connect("[fd00:96::10]:80".parse()?).await?;
    assert_eq!(
        echo_roundtrip(&mut s, &data)
            .await
            .with_context(|| mesh.logs())?,
        data
    );
    wait_for("waypoint log", Duration::from_secs(5), || {
        waypoint.log_text().contains("connection complete")
    })?;
    mesh.wait_logs(&[
        &format!("dst.addr={}", SocketAddr::new(wp_ip, 15008)),
        "dst.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;
    assert_eq!(
        echo.peers().last().map(|p| p.ip()),
        Some(wp_ip),
        "the waypoint reached the endpoint over IPv6"
    );
    let wl = waypoint.log_text();
    assert!(
        wl.contains("src.identity=spiffe://cluster.local/ns/default/sa/client")
            && wl.contains("dst.workload=n2p1"),
        "{wl}"
    );
    Ok(())
}

fn spiffe(sa: &str) -> ztunnel::identity::Identity {
    ztunnel::identity::Identity::new("cluster.local", "default", sa)
}

/// Istio's workload waypoints: a pod whose `waypoint` is set is reached through it when
/// addressed directly (TCP and HTTP), and directly when reached through a service (Istio
/// follows only the service's waypoint for service traffic). The pod's ztunnel takes
/// the waypoint's tunnel like any other and, as Istio's, does not itself insist on the
/// waypoint: a peer that skips it is accepted, unless an ALLOW policy naming the
/// waypoint's identity says otherwise (that pod then refuses the direct peer, 401).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_traffic_goes_through_its_waypoint() -> Result<()> {
    let topo = Topology::build(&prefix("ww"), &[2, 2])?;
    let (client_ip, wp_ip, server_ip, locked_ip) = (
        topo.pod("n1p1").ip,
        topo.pod("n1p2").ip,
        topo.pod("n2p1").ip,
        topo.pod("n2p2").ip,
    );
    let behind = format!(", waypoint: {{destination: \"/{wp_ip}\"}}");
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n\
         policies:\n- {{name: only-waypoint, namespace: default, scope: WorkloadSelector, action: Allow, rules: [[[{{principals: [{{Exact: cluster.local/ns/default/sa/waypoint}}]}}]]]}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "echo", &format!("{behind}, services: {{default/echo.default.svc.cluster.local: {{80: 8080}}}}")),
        workload(&topo, "n2p2", "locked", &format!("{behind}, authorizationPolicies: [default/only-waypoint]")),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let waypoint = start_waypoint(t, "n1p2", &t.dir.join("mesh-node1.yaml"), "waypoint.log")?;
    let client = &t.pod("n1p1").netns;
    let echo = EchoServer::start(&t.pod("n2p1").netns, 8080, None)?;
    let locked = EchoServer::start(&t.pod("n2p2").netns, 8080, None)?;
    let _http = http_app::HttpApp::start(&t.pod("n2p1").netns, 9080, "n2p1", false)?;
    let relayed = || waypoint.log_text().matches("connection complete").count();

    // Addressed to the pod: client -> waypoint -> pod, bytes intact, each hop its identity.
    let data = pattern(64 * 1024, 3);
    let mut s = client.connect(SocketAddr::new(server_ip, 8080)).await?;
    assert_eq!(echo_roundtrip(&mut s, &data).await?, data);
    wait_for("the waypoint's log line", Duration::from_secs(5), || {
        relayed() == 1
    })?;
    let wl = waypoint.log_text();
    assert!(
        wl.contains("src.identity=spiffe://cluster.local/ns/default/sa/client")
            && wl.contains("dst.workload=n2p1"),
        "{wl}"
    );
    assert_eq!(
        echo.peers().last().map(|p| p.ip()),
        Some(wp_ip),
        "the pod's peer is the waypoint"
    );
    mesh.wait_logs(&[
        &format!("dst.addr={wp_ip}:15008"),
        "src.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;

    // HTTP to the pod: served by the waypoint (its client-certificate header names the client).
    let mut h =
        http_app::H1Client::connect(client, SocketAddr::new(server_ip, 9080), "n2p1").await?;
    let r = h.get("/hello").await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n2p1"),
        "{}",
        r.body
    );
    let xfcc = r.echoed("x-forwarded-client-cert");
    assert!(
        xfcc.iter()
            .any(|v| v.contains("URI=spiffe://cluster.local/ns/default/sa/client")),
        "{xfcc:?}"
    );
    wait_for("the waypoint's request log", Duration::from_secs(5), || {
        waypoint.log_text().contains("request complete")
    })?;

    // Through the service (which has no waypoint): straight to the pod, not via the waypoint.
    let mut s = client.connect("10.96.0.10:80".parse()?).await?;
    assert_eq!(echo_roundtrip(&mut s, b"by service").await?, b"by service");
    assert_eq!(echo.peers().last().map(|p| p.ip()), Some(client_ip));
    assert_eq!(
        relayed(),
        1,
        "service traffic went through the workload's waypoint"
    );

    // A pod whose policy admits only the waypoint: reached through it.
    let mut s = client.connect(SocketAddr::new(locked_ip, 8080)).await?;
    assert_eq!(
        echo_roundtrip(&mut s, b"via the waypoint").await?,
        b"via the waypoint"
    );
    assert_eq!(locked.peers().last().map(|p| p.ip()), Some(wp_ip));

    // A peer that skips the waypoint (HBONE straight to the pods, as the client):
    // accepted where no policy asks for the waypoint (Istio's ztunnel does the same),
    // denied by the policy that admits only the waypoint.
    let ca = hbone_peer::load_ca(&t.dir.join("ca"))?;
    let to = |ip: std::net::IpAddr| SocketAddr::new(ip, 15008);
    let direct = hbone_peer::connect(
        t.node(1),
        &ca,
        &spiffe("client"),
        spiffe("echo"),
        to(server_ip),
    )
    .await?;
    let (status, back) =
        hbone_peer::roundtrip(&direct, &format!("{server_ip}:8080"), b"around").await?;
    assert_eq!((status.as_u16(), back.as_slice()), (200, &b"around"[..]));
    let direct = hbone_peer::connect(
        t.node(1),
        &ca,
        &spiffe("client"),
        spiffe("locked"),
        to(locked_ip),
    )
    .await?;
    assert_eq!(
        hbone_peer::status(
            &direct,
            hbone_peer::connect_req(&format!("{locked_ip}:8080"))
        )
        .await?,
        401
    );
    Ok(())
}

/// Weighted waypoints (Istio's Service.weighted_waypoints, for a canary between two
/// waypoints): connections to the service are shared between both by weight, each
/// serves the service (the canary is named only in the set), and /config_dump shows the
/// set in upstream's shape. Then an ingress gateway stand-in that acts on
/// `ingress_use_waypoint` (read by our config parser) as istiod programs a gateway to:
/// for the service that sets it, CONNECT to the VIP through the waypoint; for the one that
/// does not, straight to the endpoint. Both routes are accepted: the destination's
/// ztunnel does not insist on the waypoint, as Istio's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_waypoints_share_a_service_and_ingress_follows_ingress_use_waypoint() -> Result<()>
{
    let topo = Topology::build(&prefix("wv"), &[3, 1])?;
    let (wp_ip, canary_ip, server_ip) = (
        topo.pod("n1p2").ip,
        topo.pod("n1p3").ip,
        topo.pod("n2p1").ip,
    );
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}},\n   \
            waypoint: {{destination: \"/{wp_ip}\"}}, ingressUseWaypoint: true,\n   \
            weightedWaypoints: [{{destination: {{destination: \"/{wp_ip}\"}}, weight: 1}}, {{destination: {{destination: \"/{canary_ip}\"}}, weight: 1}}]}}\n\
         - {{name: direct, namespace: default, hostname: direct.default.svc.cluster.local, vips: [\"/10.96.0.11\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        waypoint_workload(&topo, "n1p3", "waypoint-canary", ""),
        workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/direct.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let primary = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let canary = start_waypoint(t, "n1p3", &cfg_path, "canary.log")?;
    let echo = EchoServer::start(&t.pod("n2p1").netns, 8080, None)?;
    let relayed = |w: &netsim::Child| w.log_text().matches("connection complete").count();

    const N: usize = 30;
    for i in 0..N {
        let mut s = t
            .pod("n1p1")
            .netns
            .connect("10.96.0.10:80".parse()?)
            .await?;
        let msg = format!("connection {i}");
        assert_eq!(
            echo_roundtrip(&mut s, msg.as_bytes()).await?,
            msg.as_bytes()
        );
    }
    wait_for("both waypoints' log lines", Duration::from_secs(10), || {
        relayed(&primary) + relayed(&canary) == N
    })?;
    let (p, c) = (relayed(&primary), relayed(&canary));
    // 1:1 weights; both get a share (all 30 on one side: p = 2^-29).
    assert!(p > 0 && c > 0, "primary {p}, canary {c}");
    assert!(canary
        .log_text()
        .contains("src.identity=spiffe://cluster.local/ns/default/sa/client"));
    mesh.wait_logs(&["dst.identity=spiffe://cluster.local/ns/default/sa/waypoint-canary"])?;

    let mut admin =
        http_app::H1Client::connect(t.node(1), "127.0.0.1:15000".parse()?, "localhost").await?;
    let dump: serde_json::Value = serde_json::from_str(&admin.get("/config_dump").await?.body)?;
    let svc = dump["services"]
        .as_array()
        .context("services")?
        .iter()
        .find(|s| s["name"] == "echo")
        .context("echo in the dump")?;
    assert_eq!(
        svc["weightedWaypoints"],
        serde_json::json!([
            {"destination": {"destination": format!("/{wp_ip}"), "hboneMtlsPort": 15008}, "weight": 1},
            {"destination": {"destination": format!("/{canary_ip}"), "hboneMtlsPort": 15008}, "weight": 1},
        ])
    );

    // The ingress stand-in (identity sa/ingress, outside the mesh's capture).
    let parsed = ztunnel::config::LocalConfig::parse(&cfg_path, &cfg)?;
    let ca = hbone_peer::load_ca(&t.dir.join("ca"))?;
    let before = relayed(&primary);
    for svc in &parsed.services {
        let vip = svc.vips[0].address;
        let (status, back) = if svc.ingress_use_waypoint {
            let gw = hbone_peer::connect(
                t.node(1),
                &ca,
                &spiffe("ingress"),
                spiffe("waypoint"),
                SocketAddr::new(wp_ip, 15008),
            )
            .await?;
            hbone_peer::roundtrip(&gw, &format!("{vip}:80"), svc.name.as_bytes()).await?
        } else {
            let gw = hbone_peer::connect(
                t.node(1),
                &ca,
                &spiffe("ingress"),
                spiffe("echo"),
                SocketAddr::new(server_ip, 15008),
            )
            .await?;
            hbone_peer::roundtrip(&gw, &format!("{server_ip}:8080"), svc.name.as_bytes()).await?
        };
        assert_eq!(
            (status.as_u16(), back.as_slice()),
            (200, svc.name.as_bytes()),
            "{}",
            svc.name
        );
    }
    wait_for(
        "the ingress connection at the waypoint",
        Duration::from_secs(5),
        || relayed(&primary) == before + 1,
    )?;
    assert!(primary
        .log_text()
        .contains("src.identity=spiffe://cluster.local/ns/default/sa/ingress"));
    assert_eq!(echo.peers().len(), N + 2);
    mesh.wait_logs(&["src.identity=spiffe://cluster.local/ns/default/sa/ingress"])?;
    Ok(())
}

/// The sandwich (Istio's): a waypoint that is itself an enrolled pod behind ztunnel, with
/// `applicationTunnel: PROXY`. Its ztunnel accepts a CONNECT whose target is a service
/// or workload it is the waypoint of, and (LOCALHOST_APP_TUNNEL, Istio's default) hands
/// it to the app on 127.0.0.1:15088 with a PROXY header naming the client, its identity
/// and the original target; the app's own connection to that target is captured by the
/// same ztunnel and goes direct (the waypoint is not sent to itself). A target this pod
/// is not the waypoint of is refused (400), as are proxy ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandwiched_waypoint_gets_what_it_is_the_waypoint_of() -> Result<()> {
    use ztunnel::proxy_protocol::{self, Addresses};
    let topo = Topology::build(&prefix("ws"), &[2, 2])?;
    let (client_ip, wp_ip, server_ip, db_ip) = (
        topo.pod("n1p1").ip,
        topo.pod("n1p2").ip,
        topo.pod("n2p1").ip,
        topo.pod("n2p2").ip,
    );
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [\"/10.96.0.99\"], ports: {{15008: 15008}}}}\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}, waypoint: {{destination: default/waypoint.default.svc.cluster.local}}}}\n\
         - {{name: other, namespace: default, hostname: other.default.svc.cluster.local, vips: [\"/10.96.0.11\"], ports: {{80: 8080}}, waypoint: {{destination: \"/10.10.9.9\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "waypoint", ", applicationTunnel: {protocol: PROXY, port: 15088}, services: {default/waypoint.default.svc.cluster.local: {15008: 15008}}"),
        workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/other.default.svc.cluster.local: {80: 8080}}"),
        workload(&topo, "n2p2", "db", &format!(", waypoint: {{destination: \"/{wp_ip}\"}}")),
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n1p2", "n2p1", "n2p2"],
        &HashMap::new(),
        &[],
    )?;
    let t = &mesh.topo;
    let echo = EchoServer::start(&t.pod("n2p1").netns, 8080, None)?;
    let db = EchoServer::start(&t.pod("n2p2").netns, 5432, None)?;

    // The sandwiched waypoint's app: loopback only (nothing reaches it around ztunnel);
    // reads the header, dials the target it names from its pod, relays.
    let wp_ns = t.pod("n1p2").netns.clone();
    let listener = wp_ns.run(|| std::net::TcpListener::bind(("127.0.0.1", 15088)))??;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let app = tokio::spawn(async move {
        while let Ok((mut down, peer)) = listener.accept().await {
            let (record, ns) = (record.clone(), wp_ns.clone());
            tokio::spawn(async move {
                let Ok(header) = proxy_protocol::read_header(&mut down).await else {
                    return;
                };
                let Addresses::Ip { dst, .. } = header.addresses else {
                    return;
                };
                record.lock().unwrap().push((peer, header));
                if let Ok(mut up) = ns.connect(dst).await {
                    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                }
            });
        }
    });

    // To the service through the sandwiched waypoint, and to the workload behind it.
    let data = pattern(64 * 1024, 9);
    let mut s = t
        .pod("n1p1")
        .netns
        .connect("10.96.0.10:80".parse()?)
        .await?;
    assert_eq!(echo_roundtrip(&mut s, &data).await?, data);
    let mut s = t
        .pod("n1p1")
        .netns
        .connect(SocketAddr::new(db_ip, 5432))
        .await?;
    assert_eq!(echo_roundtrip(&mut s, b"to the db").await?, b"to the db");
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "{got:?}");
    for ((peer, header), target) in got.iter().zip([
        SocketAddr::from(([10, 96, 0, 10], 80)),
        SocketAddr::new(db_ip, 5432),
    ]) {
        assert!(
            peer.ip().is_loopback(),
            "LOCALHOST_APP_TUNNEL: delivered from {peer}"
        );
        let Addresses::Ip { src, dst } = header.addresses else {
            panic!("{header:?}")
        };
        assert_eq!((src.ip(), dst), (client_ip, target), "{header:?}");
        assert_eq!(
            header.peer_identity(),
            Some("spiffe://cluster.local/ns/default/sa/client")
        );
    }
    // The waypoint's own connections left from its pod to the endpoints, not back to it.
    assert_eq!(echo.peers().last().map(|p| p.ip()), Some(wp_ip));
    assert_eq!(db.peers().last().map(|p| p.ip()), Some(wp_ip));
    mesh.wait_logs(&[
        &format!("dst.hbone_addr={server_ip}:8080"),
        "src.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;

    // Targets this pod is not the waypoint of (a pod without one, a service with another
    // waypoint) and proxy ports are refused; its own service's VIP is taken.
    let ca = hbone_peer::load_ca(&t.dir.join("ca"))?;
    let h = hbone_peer::connect(
        t.node(1),
        &ca,
        &spiffe("client"),
        spiffe("waypoint"),
        SocketAddr::new(wp_ip, 15008),
    )
    .await?;
    for (target, want) in [
        (format!("{server_ip}:8080"), 400),
        ("10.96.0.11:80".into(), 400),
        ("10.96.0.10:15008".into(), 400),
        ("10.96.0.10:80".into(), 200),
    ] {
        assert_eq!(
            hbone_peer::status(&h, hbone_peer::connect_req(&target))
                .await?
                .as_u16(),
            want,
            "{target}"
        );
    }
    mesh.wait_logs(&[
        "CONNECT target is neither this pod nor a destination it is the waypoint of",
    ])?;
    app.abort();
    Ok(())
}

// ---------------------------------------------------------------------------------------
// L7: client (n1p1) -> ztunnel -> waypoint (n1p2) -> ztunnel -> echo pods on both nodes:
// n1p3 = echo-v2, n2p1 = echo-v1, n2p2 = echo-v1 that answers 503 on /flaky.

const ECHO_VIP: &str = "10.96.0.10";

const L7_ROUTES: &str = r#"
httpRoutes:
- name: echo
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{headers: [{name: x-version, value: v2}]}]
    backendRefs: [{name: echo-v2, port: 80}]
  - matches: [{headers: [{name: x-split, value: "yes"}]}]
    backendRefs: [{name: echo-v1, port: 80, weight: 90}, {name: echo-v2, port: 80, weight: 10}]
  - matches: [{path: {type: Exact, value: /flaky}}]
    backendRefs: [{name: echo-v1, port: 80}]
    retry: {attempts: 2, codes: [503], backoff: 10ms}
  - matches: [{path: {type: PathPrefix, value: /delay}}]
    backendRefs: [{name: echo-v1, port: 80}]
    timeouts: {request: 3s, backendRequest: 300ms}
  - matches: [{path: {type: PathPrefix, value: /echo.Echo/}}]
    backendRefs: [{name: echo-v2, port: 80}]
  - matches: [{path: {type: Exact, value: /old}}]
    filters: [{type: RequestRedirect, requestRedirect: {path: {type: ReplaceFullPath, replaceFullPath: /new}, statusCode: 301}}]
  - matches: [{path: {type: PathPrefix, value: /api}}]
    filters:
    - {type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /v2}}}
    - {type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-route, value: api}], remove: [x-drop]}}
    - {type: ResponseHeaderModifier, responseHeaderModifier: {add: [{name: x-served-by, value: waypoint}]}}
    - {type: RequestMirror, requestMirror: {backendRef: {name: echo-v2, port: 80}}}
    backendRefs: [{name: echo-v1, port: 80}]
  - backendRefs: [{name: echo-v1, port: 80}]
grpcRoutes:
- name: echo-grpc
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{method: {service: echo.Health, method: Check}}, {method: {type: RegularExpression, method: "Canary.*"}, headers: [{name: x-canary, value: "yes"}]}]
    filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-route, value: grpc}]}}]
    backendRefs: [{name: echo-v2, port: 80}]
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - to: [{operation: {ports: ["80"], paths: ["/admin", "/admin/*"]}}]
  - to: [{operation: {ports: ["80"], methods: ["DELETE"]}}]
  - to: [{operation: {ports: ["80"]}}]
    when: [{key: "request.headers[x-block]", values: ["yes"]}]
- name: allow-client
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: ALLOW
  rules:
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {notPaths: ["/admin-only"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {ports: ["9000"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/admin"]}}]
"#;

struct L7Mesh {
    mesh: Mesh,
    waypoint: netsim::Child,
    apps: HashMap<&'static str, http_app::HttpApp>,
    _tcp: Vec<EchoServer>,
    cfg_path: std::path::PathBuf,
    base: String,
}

impl L7Mesh {
    fn mesh_config(topo: &Topology, extra_workloads: &str, extra_services: &str) -> String {
        let wp_ip = topo.pod("n1p2").ip;
        let both = ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/echo-v1.default.svc.cluster.local: {80: 8080, 9000: 9000}}";
        let v2 = ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/echo-v2.default.svc.cluster.local: {80: 8080, 9000: 9000}}";
        // n2p1 also serves the ext_authz test's authorizers (HTTP 8000, gRPC 9100).
        let both_authz = ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/echo-v1.default.svc.cluster.local: {80: 8080, 9000: 9000}, \
                          default/authz.default.svc.cluster.local: {8000: 8000, 8001: 8001, 9100: 9100}}";
        format!(
            "workloads:\n{}{}{}{}{}{extra_workloads}services:\n{extra_services}\
             - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/{ECHO_VIP}\"], ports: {{80: 8080, 9000: 9000}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
             - {{name: echo-v1, namespace: default, hostname: echo-v1.default.svc.cluster.local, vips: [\"/10.96.0.21\"], ports: {{80: 8080, 9000: 9000}}}}\n\
             - {{name: echo-v2, namespace: default, hostname: echo-v2.default.svc.cluster.local, vips: [\"/10.96.0.22\"], ports: {{80: 8080, 9000: 9000}}}}\n\
             - {{name: authz, namespace: default, hostname: authz.default.svc.cluster.local, vips: [\"/10.96.0.30\"], ports: {{8000: 8000, 8001: 8001, 9100: 9100}}}}\n",
            workload(topo, "n1p1", "client", ""),
            waypoint_workload(topo, "n1p2", "waypoint", ""),
            workload(topo, "n1p3", "echo", &format!("{v2}, labels: {{app: echo, version: v2}}")),
            workload(topo, "n2p1", "echo", &format!("{both_authz}, labels: {{app: echo, version: v1}}")),
            workload(topo, "n2p2", "echo", &format!("{both}, labels: {{app: echo, version: v1}}")),
        )
    }

    async fn start(tag: &str, l7: &str, waypoint_env: &[(&str, &str)]) -> Result<L7Mesh> {
        L7Mesh::start_with(tag, l7, waypoint_env, "", "").await
    }

    /// As `start`, with more workloads and services in the mesh config (YAML list items).
    async fn start_with(
        tag: &str,
        l7: &str,
        waypoint_env: &[(&str, &str)],
        extra_workloads: &str,
        extra_services: &str,
    ) -> Result<L7Mesh> {
        let topo = Topology::build(&prefix(tag), &[3, 2])?;
        let base = L7Mesh::mesh_config(&topo, extra_workloads, extra_services);
        let cfg = format!("{base}{l7}");
        let mesh = Mesh::start(
            topo,
            &cfg,
            &["n1p1", "n1p3", "n2p1", "n2p2"],
            &HashMap::new(),
            &[],
        )?;
        let t = &mesh.topo;
        let cfg_path = t.dir.join("waypoint.yaml");
        std::fs::write(&cfg_path, &cfg)?;
        let state = t.dir.join("ca");
        let mut env = vec![("RUST_LOG", "info"), ("CONFIG_POLL_INTERVAL_MS", "100")];
        env.extend_from_slice(waypoint_env);
        let waypoint = t.pod("n1p2").netns.spawn(
            bins::waypoint(),
            &[
                "--local-xds-path",
                &cfg_path.display().to_string(),
                "--workload-uid",
                "n1p2",
                "--state-dir",
                &state.display().to_string(),
            ],
            &env,
            &t.dir.join("waypoint.log"),
        )?;
        waypoint.wait_log("waypoint ready", READY)?;
        let mut apps = HashMap::new();
        let mut tcp = Vec::new();
        for (pod, flaky) in [("n1p3", false), ("n2p1", false), ("n2p2", true)] {
            apps.insert(
                pod,
                http_app::HttpApp::start(&t.pod(pod).netns, 8080, pod, flaky)?,
            );
            tcp.push(EchoServer::start(&t.pod(pod).netns, 9000, Some(pod))?);
        }
        Ok(L7Mesh {
            mesh,
            waypoint,
            apps,
            _tcp: tcp,
            cfg_path,
            base,
        })
    }

    fn client(&self) -> &netsim::Netns {
        &self.mesh.topo.pod("n1p1").netns
    }

    async fn h1(&self) -> Result<http_app::H1Client> {
        http_app::H1Client::connect(
            self.client(),
            format!("{ECHO_VIP}:80").parse()?,
            "echo.default.svc.cluster.local",
        )
        .await
    }

    fn log(&self) -> String {
        self.waypoint.log_text()
    }

    /// Scrapes the waypoint's Prometheus endpoint from inside its pod.
    async fn metrics(&self) -> Result<String> {
        let ns = &self.mesh.topo.pod("n1p2").netns;
        let mut c =
            http_app::H1Client::connect(ns, "127.0.0.1:15020".parse()?, "localhost").await?;
        Ok(c.get("/stats/prometheus").await?.body)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_routes_by_header_and_weight_over_keepalive() -> Result<()> {
    let m = L7Mesh::start("l7r", L7_ROUTES, &[]).await?;
    let mut c = m.h1().await?;
    // Default rule -> echo-v1 (n2p1/n2p2); header rule -> echo-v2 (n1p3).
    let r = c.get("/hello").await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert!(["n2p1", "n2p2"].contains(&r.pod().as_str()), "{r:?}");
    let r = c.request("GET", "/hello", &[("x-version", "v2")]).await?;
    assert_eq!(r.pod(), "n1p3", "{r:?}");
    // The server sees the original Host and the client's identity from the waypoint.
    assert_eq!(r.echoed("host"), ["echo.default.svc.cluster.local"]);
    assert_eq!(r.echoed("x-forwarded-client-cert"), ["By=spiffe://cluster.local/ns/default/sa/waypoint;URI=spiffe://cluster.local/ns/default/sa/client".to_string()]);

    // 90/10 over 1000 requests, all on the one keep-alive connection.
    let mut v2 = 0;
    for _ in 0..1000 {
        let r = c.request("GET", "/split", &[("x-split", "yes")]).await?;
        assert_eq!(r.status, 200, "{r:?}");
        if r.pod() == "n1p3" {
            v2 += 1;
        }
    }
    // Binomial(1000, 0.1): sd 9.5; 60..140 is beyond 4 sd either way.
    assert!(
        (60..=140).contains(&v2),
        "echo-v2 got {v2} of 1000, expected about 100"
    );
    // The waypoint reuses its upstream HTTP connections too.
    let conns: u64 = m
        .apps
        .values()
        .map(|a| *a.connections.lock().unwrap())
        .sum();
    assert!(
        conns <= 10,
        "{conns} upstream connections for 1002 requests"
    );

    // Istio request metrics, reporter=waypoint, with the standard labels.
    let text = m.metrics().await?;
    let line = text
        .lines()
        .find(|l| {
            l.starts_with("istio_requests_total{")
                && l.contains("destination_workload=\"n1p3\"")
                && l.contains("response_code=\"200\"")
        })
        .with_context(|| text.clone())?;
    for label in [
        "reporter=\"waypoint\"",
        "source_workload=\"n1p1\"",
        "source_principal=\"spiffe://cluster.local/ns/default/sa/client\"",
        "destination_service=\"echo-v2.default.svc.cluster.local\"",
        "request_protocol=\"http\"",
        "connection_security_policy=\"mutual_tls\"",
    ] {
        assert!(line.contains(label), "{label} missing in {line}");
    }
    let count: f64 = line.rsplit(' ').next().unwrap_or("0").parse()?;
    assert!(
        (count - (v2 as f64 + 1.0)).abs() < 0.5,
        "{line}: expected {} requests",
        v2 + 1
    );
    for name in [
        "istio_request_duration_milliseconds_bucket{",
        "istio_request_bytes_bucket{",
        "istio_response_bytes_bucket{",
    ] {
        assert!(text.contains(name), "{name} missing");
    }
    // One access log line per request.
    wait_for("access log", Duration::from_secs(5), || {
        m.log().matches("request complete").count() >= 1002
    })?;
    let log = m.log();
    assert!(
        log.contains("path=/split")
            && log.contains("status=200")
            && log.contains("route=\"default/echo#1\""),
        "{}",
        &log[log.len().saturating_sub(3000)..]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_retries_eject_and_time_out() -> Result<()> {
    let m = L7Mesh::start("l7t", L7_ROUTES, &[("OUTLIER_CONSECUTIVE_5XX", "3")]).await?;
    let mut c = m.h1().await?;
    // n2p2 answers 503 on /flaky; a retry goes to the other endpoint, so every request succeeds.
    for i in 0..40 {
        let r = c.get("/flaky").await?;
        assert_eq!(r.status, 200, "request {i}: {r:?}\n{}", m.log());
        assert_eq!(r.pod(), "n2p1");
    }
    let log = m.log();
    assert!(log.contains("attempts=2"), "no request was retried: {log}");
    // After 3 failures in a row n2p2 is ejected: later requests go straight to n2p1.
    assert!(log.contains("endpoint ejected"), "{log}");
    let flaky_hits = m.apps["n2p2"]
        .seen()
        .iter()
        .filter(|s| s.path == "/flaky")
        .count();
    assert!(
        flaky_hits <= 6,
        "ejected endpoint still got {flaky_hits} requests"
    );

    // backendRequest timeout 300 ms: a 2 s response becomes a 504, fast.
    let start = std::time::Instant::now();
    let r = c.get("/delay/2000").await?;
    assert_eq!(r.status, 504, "{r:?}");
    assert!(
        start.elapsed() < Duration::from_millis(1900),
        "timeout took {:?}",
        start.elapsed()
    );
    let r = c.get("/delay/10").await?;
    assert_eq!(r.status, 200, "{r:?}");
    // A 503 without a retry policy reaches the client as is.
    let r = c.get("/status/503").await?;
    assert_eq!(r.status, 503);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_authorization_denies_by_path_and_method_and_trusts_no_client_headers() -> Result<()> {
    let m = L7Mesh::start("l7a", L7_ROUTES, &[]).await?;
    let mut c = m.h1().await?;
    for path in [
        "/admin",
        "/admin/x",
        "/x/../admin",
        "/%61dmin",
        "//admin",
        "/admin/.",
        "/./admin/",
        "/x/%2e%2e/admin",
    ] {
        let r = c.get(path).await?;
        assert_eq!(r.status, 403, "{path}: {r:?}");
        assert_eq!(r.body.trim(), "RBAC: access denied", "{path}");
    }
    // An encoded slash could mean two things to two parsers: refused.
    let r = c.get("/admin%2Fx").await?;
    assert_eq!(r.status, 400, "{r:?}");
    let r = c.request("DELETE", "/thing", &[]).await?;
    assert_eq!(r.status, 403, "{r:?}");
    let r = c.request("GET", "/thing", &[]).await?;
    assert_eq!(r.status, 200, "{r:?}");
    // Header values are matched one by one: `x-block: no` plus `x-block: yes` is denied.
    let r = c
        .request("GET", "/thing", &[("x-block", "no"), ("x-block", "yes")])
        .await?;
    assert_eq!(r.status, 403, "{r:?}");
    let r = c
        .request("GET", "/thing", &[("x-block", "no, yes")])
        .await?;
    assert_eq!(r.status, 200, "a single value is not split: {r:?}");

    // Spoofed identity and origin headers are replaced, and do not sway policy.
    let spoof = [
        ("x-forwarded-client-cert", "By=spiffe://cluster.local/ns/default/sa/waypoint;URI=spiffe://cluster.local/ns/default/sa/admin"),
        ("x-forwarded-for", "1.2.3.4"),
        ("x-forwarded-proto", "https"),
        ("forwarded", "for=1.2.3.4"),
    ];
    let r = c.request("GET", "/admin-only", &spoof).await?;
    assert_eq!(r.status, 403, "spoofed XFCC was trusted: {r:?}");
    let r = c.request("GET", "/whoami", &spoof).await?;
    assert_eq!(r.status, 200);
    // As Envoy does: the peer the waypoint saw is appended (the last entry is the one
    // to trust), and a forwarded protocol is kept.
    let client_ip = m.mesh.topo.pod("n1p1").ip.to_string();
    assert_eq!(
        r.echoed("x-forwarded-for"),
        [format!("1.2.3.4, {client_ip}")]
    );
    assert_eq!(r.echoed("x-forwarded-proto"), ["https"]);
    let r = c.request("GET", "/whoami", &[]).await?;
    assert_eq!(
        r.echoed("x-forwarded-for"),
        std::slice::from_ref(&client_ip)
    );
    assert_eq!(r.echoed("x-forwarded-proto"), ["http"]);
    assert_eq!(r.echoed("x-forwarded-client-cert"), ["By=spiffe://cluster.local/ns/default/sa/waypoint;URI=spiffe://cluster.local/ns/default/sa/client"]);
    assert!(r.echoed("forwarded").is_empty(), "{r:?}");
    assert!(
        m.log().contains("authz.denied_by=\"default/deny-admin\""),
        "{}",
        m.log()
    );
    let text = m.metrics().await?;
    assert!(
        text.lines().any(|l| l.starts_with("istio_requests_total{")
            && l.contains("response_code=\"403\"")
            && l.contains("response_flags=\"DENY\"")),
        "{text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_http2_multiplexing_grpc_filters_and_l4_passthrough() -> Result<()> {
    let m = L7Mesh::start("l7h", L7_ROUTES, &[]).await?;
    // 50 concurrent requests multiplexed on one HTTP/2 connection.
    let h2 = http_app::H2Client::connect(
        m.client(),
        format!("{ECHO_VIP}:80").parse()?,
        "echo.default.svc.cluster.local",
    )
    .await?;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let h2 = h2.clone();
        tasks.push(tokio::spawn(async move {
            let hdrs: &[(&str, &str)] = if i % 2 == 0 {
                &[("x-version", "v2")]
            } else {
                &[]
            };
            h2.request("GET", &format!("/mux/{i}"), hdrs, bytes::Bytes::new())
                .await
                .map(|r| (i, r))
        }));
    }
    for t in tasks {
        let (i, r) = t.await??;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.field("version").as_deref(), Some("HTTP/2.0"), "{r:?}");
        if i % 2 == 0 {
            assert_eq!(r.pod(), "n1p3");
        } else {
            assert_ne!(r.pod(), "n1p3");
        }
    }
    // gRPC unary, routed by its service path to echo-v2.
    let (r, msg) = h2.grpc_unary("/echo.Echo/Say", b"\x0a\x05hello").await?;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.pod(), "n1p3");
    assert_eq!(&msg[..], b"\x0a\x05hello");
    assert_eq!(
        r.trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .map(|v| v.as_bytes()),
        Some(&b"0"[..]),
        "{r:?}"
    );
    wait_for("grpc log", Duration::from_secs(5), || {
        m.log().contains("protocol=\"grpc\"") || m.log().contains("protocol=grpc")
    })?;
    // GRPCRoute: by service and method, or a method pattern with a header, to echo-v2
    // with its filter; other methods fall to the HTTPRoute's catch-all (echo-v1).
    let grpc = |path: &'static str, canary: bool| {
        let h2 = h2.clone();
        async move {
            let mut hdrs = vec![("content-type", "application/grpc"), ("te", "trailers")];
            if canary {
                hdrs.push(("x-canary", "yes"));
            }
            h2.request(
                "POST",
                path,
                &hdrs,
                bytes::Bytes::from_static(b"\0\0\0\0\0"),
            )
            .await
        }
    };
    let r = grpc("/echo.Health/Check", false).await?;
    assert_eq!(r.pod(), "n1p3", "{r:?}");
    let seen = m.apps["n1p3"].seen();
    let check = seen
        .iter()
        .rev()
        .find(|s| s.path.ends_with("/echo.Health/Check"))
        .context("echo-v2 got the call")?;
    assert_eq!(
        check.headers.get("x-route").map(|v| v.as_bytes()),
        Some(&b"grpc"[..]),
        "the GRPCRoute's filter applies"
    );
    assert_eq!(grpc("/any.Svc/CanaryRelease", true).await?.pod(), "n1p3");
    assert_ne!(grpc("/any.Svc/CanaryRelease", false).await?.pod(), "n1p3");
    assert_ne!(grpc("/echo.Health/Watch", false).await?.pod(), "n1p3");

    // Filters over HTTP/1.1: redirect, rewrite, header modifiers, mirror.
    let mut c = m.h1().await?;
    let r = c.get("/old?q=1").await?;
    assert_eq!(r.status, 301);
    assert_eq!(
        r.headers.get("location").and_then(|v| v.to_str().ok()),
        Some("http://echo.default.svc.cluster.local/new?q=1")
    );
    let r = c
        .request(
            "GET",
            "/api/items?x=1",
            &[("x-drop", "1"), ("x-route", "client")],
        )
        .await?;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.field("path").as_deref(), Some("/v2/items?x=1"), "{r:?}");
    assert_eq!(r.echoed("x-route"), ["api"]);
    assert!(r.echoed("x-drop").is_empty());
    // A client's Connection header cannot remove what the route set.
    let r = c
        .request("GET", "/api/items", &[("connection", "x-route")])
        .await?;
    assert_eq!(r.echoed("x-route"), ["api"], "{r:?}");
    assert_eq!(
        r.headers.get("x-served-by").and_then(|v| v.to_str().ok()),
        Some("waypoint")
    );
    wait_for("mirrored request", Duration::from_secs(5), || {
        m.apps["n1p3"].seen().iter().any(|s| {
            s.path.ends_with("/v2/items?x=1")
                && s.headers
                    .get("host")
                    .is_some_and(|h| h == "echo.default.svc.cluster.local-shadow")
        })
    })?;

    // An HTTP request after an empty line is still HTTP (and still authorized).
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:80").parse()?)
        .await?;
    tokio::io::AsyncWriteExt::write_all(
        &mut s,
        b"\r\nGET /admin HTTP/1.1\r\nhost: echo\r\nconnection: close\r\n\r\n",
    )
    .await?;
    let mut got = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read_to_end(&mut s, &mut got),
    )
    .await??;
    assert!(
        got.starts_with(b"HTTP/1.1 403"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // A request without Host has no host for policy or routes: 400 (an HTTP/1.1 one:
    // HTTP/1.0 is refused before that, 426, as Envoy's codec does; waypoint::http10).
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:80").parse()?)
        .await?;
    tokio::io::AsyncWriteExt::write_all(
        &mut s,
        b"GET /hello HTTP/1.1\r\nconnection: close\r\n\r\n",
    )
    .await?;
    let mut got = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read_to_end(&mut s, &mut got),
    )
    .await??;
    assert!(
        got.starts_with(b"HTTP/1.1 400"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // Non-HTTP bytes to a port with HTTPRoutes are refused, not relayed around them.
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:80").parse()?)
        .await?;
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        echo_roundtrip(&mut s, b"\x16\x03\x01 not http"),
    )
    .await?;
    assert!(
        r.map(|v| v.is_empty()).unwrap_or(true),
        "opaque bytes got through a port with routes"
    );
    wait_for("refusal log", Duration::from_secs(5), || {
        m.log()
            .contains("non-HTTP traffic to a target with HTTPRoutes")
    })?;

    // Non-HTTP bytes pass at L4 (port 9000), whole and in order.
    let data = pattern(64 * 1024, 9);
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:9000").parse()?)
        .await?;
    let got = echo_roundtrip(&mut s, &data).await?;
    let (greeting, rest) = got.split_at(
        got.iter()
            .position(|b| *b == b'\n')
            .map(|i| i + 1)
            .unwrap_or(0),
    );
    assert!(
        greeting.starts_with(b"n"),
        "{:?}",
        String::from_utf8_lossy(greeting)
    );
    assert_eq!(rest, &data[..]);
    wait_for("L4 log", Duration::from_secs(5), || {
        m.log().contains("protocol=\"TCP\"") && m.log().contains("direction=\"waypoint\"")
    })?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_config_reloads_without_dropping_connections() -> Result<()> {
    let m = L7Mesh::start("l7c", L7_ROUTES, &[]).await?;
    let mut c = m.h1().await?;
    assert_ne!(c.get("/before").await?.pod(), "n1p3");
    // Everything to echo-v2 now; the open keep-alive connection carries on.
    let all_v2 = "httpRoutes:\n- {name: echo, namespace: default, parentRefs: [{kind: Service, group: \"\", name: echo}], rules: [{backendRefs: [{name: echo-v2, port: 80}]}]}\n";
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(&tmp, format!("{}{all_v2}", m.base))?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    m.waypoint
        .wait_log("config reloaded", Duration::from_secs(5))?;
    let r = c.get("/after").await?;
    assert_eq!(r.pod(), "n1p3", "{r:?}");
    // A broken file is refused with the field named; the last good config stays.
    std::fs::write(
        &tmp,
        format!("{}{}", m.base, all_v2.replace("backendRefs", "backendRef")),
    )?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    m.waypoint
        .wait_log("config change rejected", Duration::from_secs(5))?;
    assert!(m.log().contains("backendRef"), "{}", m.log());
    let r = c.get("/still").await?;
    assert_eq!((r.status.as_u16(), r.pod().as_str()), (200, "n1p3"));
    Ok(())
}

/// The admin endpoint on 127.0.0.1:15000 in the waypoint's pod, as ztunnel's: the dump
/// names what is loaded, /logging changes what is logged, /quitquitquit drains as SIGTERM
/// does (open tunnels finish) and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waypoints_admin_endpoint_dumps_config_changes_logging_and_drains() -> Result<()> {
    let mut m = L7Mesh::start(
        "adm",
        L7_ROUTES,
        &[
            ("TERMINATION_GRACE_PERIOD_SECONDS", "10"),
            // Istio's ProxyConfig, as istiod renders it for its waypoint.
            (
                "PROXY_CONFIG",
                r#"{"concurrency": 1, "terminationDrainDuration": "4s", "proxyMetadata": {"X": "y"}}"#,
            ),
        ],
    )
    .await?;
    let wp_ns = m.mesh.topo.pod("n1p2").netns.clone();
    let admin: SocketAddr = "127.0.0.1:15000".parse()?;
    let mut a = http_app::H1Client::connect(&wp_ns, admin, "localhost").await?;
    let r = a.get("/config_dump").await?;
    assert_eq!(r.status, 200, "{r:?}");
    let d: serde_json::Value = serde_json::from_str(&r.body)?;
    assert_eq!(
        d["waypoint"]["identity"],
        "spiffe://cluster.local/ns/default/sa/waypoint"
    );
    // Without --gateway-name: its workload name.
    assert_eq!(d["waypoint"]["gateway"], "default/n1p2");
    assert_eq!(d["waypoint"]["workloadUid"], "n1p2");
    assert!(
        d["waypoint"]["configSource"]
            .as_str()
            .is_some_and(|s| s.ends_with("waypoint.yaml")),
        "{}",
        r.body
    );
    assert_eq!(d["httpRoutes"][0]["name"], "echo");
    assert_eq!(d["httpRoutes"][0]["parentRefs"][0]["name"], "echo");
    let policies: Vec<&str> = d["authorizationPolicies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(policies, ["deny-admin", "allow-client"]);
    // ztunnel's shapes for what it knows and holds.
    assert!(
        d["workloads"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["uid"] == "n1p1")),
        "{}",
        r.body
    );
    assert!(d["services"].as_array().is_some_and(|s| s
        .iter()
        .any(|s| s["hostname"] == "echo.default.svc.cluster.local")));
    assert_eq!(
        d["certificates"][0]["identity"],
        "spiffe://cluster.local/ns/default/sa/waypoint"
    );
    assert_eq!(d["certificates"][0]["state"], "Available");
    assert_eq!(
        d["config"]["adminAddr"],
        serde_json::json!({"Localhost": [false, 15000]})
    );
    // ProxyConfig's concurrency and terminationDrainDuration, not the grace period's 9 s.
    assert_eq!(d["config"]["workerThreads"], 1, "{}", r.body);
    assert_eq!(
        d["config"]["selfTerminationDeadline"],
        serde_json::json!({"secs": 4, "nanos": 0})
    );
    // One version for the whole workspace (Cargo.toml), the waypoint's included.
    assert_eq!(d["version"]["version"], env!("CARGO_PKG_VERSION"));

    // Logging: at warn, requests log nothing; back at info they do.
    assert_eq!(
        a.get("/logging").await?.body.trim(),
        "current log level is info"
    );
    let r = a.request("POST", "/logging?level=warn", &[]).await?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (200, "current log level is warn"),
        "{r:?}"
    );
    let mut c = m.h1().await?;
    let logged = || m.log().matches("request complete").count();
    let before = logged();
    // Requests the waypoint has finished with: its metrics count each one just before
    // its log line would be written (the same call).
    let requests = || async {
        let text = m.metrics().await?;
        anyhow::Ok(
            text.lines()
                .filter(|l| l.starts_with("istio_requests_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>(),
        )
    };
    let counted = requests().await?;
    assert_eq!(c.get("/quiet").await?.status, 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while requests().await? < counted + 1.0 {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the waypoint never counted GET /quiet"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(logged(), before, "a request was logged at level warn");
    let r = a.request("POST", "/logging?reset", &[]).await?;
    assert_eq!(r.body.trim(), "current log level is info", "{r:?}");
    assert_eq!(c.get("/loud").await?.status, 200);
    wait_for("request log at info", Duration::from_secs(5), || {
        m.log().contains("path=/loud")
    })?;
    assert!(
        !m.log().contains("path=/quiet"),
        "GET /quiet was logged at level warn"
    );
    let r = a.request("POST", "/logging?level=loud", &[]).await?;
    assert_eq!(r.status, 400, "{r:?}");

    // Drain: an open tunnel keeps working, then the waypoint exits 0. (HTTP keep-alive
    // tunnels also run until they end: close ours.)
    drop(c);
    let mut tunnel = m
        .client()
        .connect(format!("{ECHO_VIP}:9000").parse()?)
        .await?;
    let greeting = read_line(&mut tunnel).await?;
    let r = a.request("POST", "/quitquitquit", &[]).await?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (200, "draining"),
        "{r:?}"
    );
    m.waypoint.wait_log(
        "drain requested through /quitquitquit",
        Duration::from_secs(5),
    )?;
    m.waypoint
        .wait_log("draining: listener closed", Duration::from_secs(5))?;
    assert_eq!(
        echo_roundtrip(&mut tunnel, b"still here").await?,
        b"still here",
        "after {greeting:?}"
    );
    drop(tunnel);
    let status = tokio::task::block_in_place(|| m.waypoint.wait_exit(Duration::from_secs(15)))
        .context("the waypoint did not exit")?;
    assert!(status.success(), "{status:?}\n{}", m.log());
    assert!(
        !m.log().contains("drain deadline reached"),
        "the tunnel's end should have ended the drain:\n{}",
        m.log()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// In a cluster: ztunnels and the waypoint configured by a fake istiod (xDS and the Istio
// CA), the waypoint's routes and policies from a fake Kubernetes API. n1p1 (sleep) calls
// the echo service, whose waypoint is the Service `waypoint` (pod n1p2); echo-v1 is n2p1,
// echo-v2 is n1p3.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waypoint_in_a_cluster_follows_istiod_and_kubernetes() -> Result<()> {
    use fake_istiod::*;
    use serde_json::json;
    use ztunnel::xds::proto::istio::workload as pb;
    let topo = Topology::build(&prefix("wk"), &[3, 1])?;
    let token = topo.dir.join("istio-token");
    std::fs::write(&token, TOKEN)?;
    let istiod = FakeIstiod::start(topo.node(1), "10.0.0.1:15012".parse()?, &topo.dir)?;
    let kube = fake_kube::FakeKube::start(topo.node(1), "10.0.0.1:6443".parse()?)?;
    let (echo, v1, v2, wp) = (
        "echo.default.svc.cluster.local",
        "echo-v1.default.svc.cluster.local",
        "echo-v2.default.svc.cluster.local",
        "waypoint.default.svc.cluster.local",
    );
    let cart = "cart.shop.svc.cluster.local";
    istiod.update(|r| {
        r.set_workload(pod_workload("n1p1", topo.pod("n1p1").ip, 1, "sleep", &[]));
        // As istiod describes Istio's waypoint pod: not captured, so TCP.
        let mut w = pod_workload(
            "n1p2",
            topo.pod("n1p2").ip,
            1,
            "waypoint",
            &[(wp, 15008, 15008)],
        );
        w.tunnel_protocol = pb::TunnelProtocol::None as i32;
        r.set_workload(w);
        r.set_workload(pod_workload(
            "n1p3",
            topo.pod("n1p3").ip,
            1,
            "echo",
            &[(echo, 80, 8080), (v2, 80, 8080)],
        ));
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[
                (echo, 80, 8080),
                (v1, 80, 8080),
                (&format!("shop/{cart}"), 80, 8080),
            ],
        ));
        let via_waypoint = Some(pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Hostname(
                pb::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: wp.into(),
                },
            )),
            hbone_mtls_port: 15008,
        });
        let mut s = service("echo", [10, 96, 0, 10], 80, 8080);
        s.waypoint = via_waypoint.clone();
        r.set_service(s);
        // Namespace shop's Service cart uses the waypoint of namespace default.
        let mut s = service("cart", [10, 96, 0, 20], 80, 8080);
        (s.namespace, s.hostname, s.waypoint) = ("shop".into(), cart.into(), via_waypoint);
        r.set_service(s);
        r.set_service(service("echo-v1", [10, 96, 0, 11], 80, 8080));
        r.set_service(service("echo-v2", [10, 96, 0, 12], 80, 8080));
        r.set_service(service("waypoint", [10, 96, 0, 99], 15008, 15008));
    });
    // Services of other namespaces may use it (Gateway API's default is Same).
    kube.apply("gateways", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": "waypoint"},
        "spec": {"gatewayClassName": "istio-waypoint", "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE", "allowedRoutes": {"namespaces": {"from": "All"}}}]}}));
    for ns in ["default", "shop", "istio-system"] {
        kube.apply(
            "namespaces",
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        );
    }
    // Istio's labels for a Service that uses a waypoint of another namespace.
    kube.apply("services", json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "cart", "namespace": "shop",
        "labels": {"istio.io/use-waypoint": "waypoint", "istio.io/use-waypoint-namespace": "default"}}, "spec": {"ports": [{"port": 80}]}}));
    // Its own namespace's route for it: applied by our waypoint.
    kube.apply("httproutes", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "cart", "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart"}],
                 "rules": [{"filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "x-route", "value": "shop/cart"}]}}]}]}}));
    // A namespace whose Services do not use it: its (broken) route is none of ours.
    kube.apply("httproutes", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "blog", "namespace": "blog"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "blog"}], "rules": [{"backendRefs": [{"name": "blog"}]}]}}));
    // Mesh-wide, from the root namespace: every waypoint denies /root-denied.
    kube.apply("authorizationpolicies", json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "mesh-deny", "namespace": "istio-system"},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "GatewayClass", "name": "istio-waypoint"}], "action": "DENY",
                 "rules": [{"to": [{"operation": {"paths": ["/root-denied"]}}]}]}}));
    // Revisions: the waypoint is of revision canary (REVISION below): a policy labelled
    // for revision stable is istiod-stable's, not ours; one labelled canary is ours.
    for (rev, path) in [("stable", "/rev-stable"), ("canary", "/rev-canary")] {
        kube.apply("authorizationpolicies", json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": format!("deny-{rev}"), "namespace": "istio-system", "labels": {"istio.io/rev": rev}},
            "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "GatewayClass", "name": "istio-waypoint"}], "action": "DENY",
                     "rules": [{"to": [{"operation": {"paths": [path]}}]}]}}));
    }
    let route = |v2_rule: serde_json::Value| {
        json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "echo"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
                 "rules": [v2_rule, {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v1", "port": 80, "weight": 1}]}]}})
    };
    kube.apply("httproutes", route(json!({"matches": [{"headers": [{"type": "Exact", "name": "x-version", "value": "v2"}]}],
        "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v2", "port": 80, "weight": 1}]})));
    let env = istiod.env(&token);
    let node_args = [
        vec![
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n1p1"),
                topo.pod("n1p1").netns.path().display()
            ),
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n1p3"),
                topo.pod("n1p3").netns.path().display()
            ),
        ],
        vec![
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n2p1"),
                topo.pod("n2p1").netns.path().display()
            ),
        ],
    ];
    let mesh = Mesh::start_with_istiod(topo, &node_args, &env)?;
    let t = &mesh.topo;
    let kubeconfig = t.dir.join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig)?;
    let mut wenv: Vec<(String, String)> = env.clone();
    wenv.extend([
        ("RUST_LOG".into(), "info".into()),
        ("POD_NAME".into(), "n1p2".into()),
        ("POD_NAMESPACE".into(), "default".into()),
        ("INSTANCE_IP".into(), t.pod("n1p2").ip.to_string()),
        ("SERVICE_ACCOUNT".into(), "waypoint".into()),
        ("WAYPOINT_GATEWAY_NAME".into(), "waypoint".into()),
        ("KUBECONFIG".into(), kubeconfig.display().to_string()),
        ("REVISION".into(), "canary".into()),
        // The revision's own would be istio-canary; this test's is Istio's default name.
        ("MESH_CONFIG_MAP".into(), "istio".into()),
    ]);
    let wenv: Vec<(&str, &str)> = wenv.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let waypoint =
        t.pod("n1p2")
            .netns
            .spawn(bins::waypoint(), &[], &wenv, &t.dir.join("waypoint.log"))?;
    waypoint.wait_log("waypoint ready", READY)?;
    let _apps = [
        http_app::HttpApp::start(&t.pod("n1p3").netns, 8080, "n1p3", false)?,
        http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false)?,
    ];
    // Ready once istiod's state and the Kubernetes objects are in.
    let ready_at: SocketAddr = SocketAddr::new(t.pod("n1p2").ip, 15021);
    wait_for_ready(t.node(1), ready_at)
        .await
        .with_context(|| waypoint.log_text())?;
    // Its certificate came from the Istio CA, for its own identity.
    let wp_id = "spiffe://cluster.local/ns/default/sa/waypoint";
    istiod
        .wait("the waypoint's certificate", Duration::from_secs(5), |r| {
            r.issued
                .iter()
                .any(|i| i.identity == wp_id && i.impersonated.is_none())
        })
        .await?;
    istiod
        .wait("the waypoint's subscription", Duration::from_secs(5), |r| {
            r.seen.iter().any(|s| {
                s.node_id.as_deref()
                    == Some("router~10.10.1.12~n1p2.default~default.svc.cluster.local")
            })
        })
        .await?;

    // Routing from the HTTPRoute: header to v2, default to v1.
    let mut c =
        http_app::H1Client::connect(&t.pod("n1p1").netns, "10.96.0.10:80".parse()?, echo).await?;
    let r = c.get("/x").await.with_context(|| waypoint.log_text())?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n2p1"),
        "{r:?}\n{}",
        waypoint.log_text()
    );
    assert_eq!(
        c.request("GET", "/x", &[("x-version", "v2")]).await?.pod(),
        "n1p3"
    );
    assert_eq!(
        r.echoed("x-forwarded-client-cert"),
        [format!(
            "By={wp_id};URI=spiffe://cluster.local/ns/default/sa/sleep"
        )]
    );

    // Namespace shop's route applies to its Service; the root namespace's DENY to both.
    let mut shop =
        http_app::H1Client::connect(&t.pod("n1p1").netns, "10.96.0.20:80".parse()?, cart).await?;
    let r = shop.get("/x").await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n2p1"),
        "{r:?}\n{}",
        waypoint.log_text()
    );
    assert_eq!(r.echoed("x-route"), ["shop/cart"], "{r:?}");
    assert_eq!(shop.get("/root-denied").await?.status, 403);
    assert_eq!(c.get("/root-denied").await?.status, 403);
    // Only our revision's policy applies.
    assert_eq!(c.get("/rev-stable").await?.status, 200);
    let r = c.get("/rev-canary").await?;
    assert_eq!(r.status, 403, "{r:?}");
    assert!(
        waypoint
            .log_text()
            .contains("authz.denied_by=\"istio-system/mesh-deny\"")
            && waypoint
                .log_text()
                .contains("authz.denied_by=\"istio-system/deny-canary\""),
        "{}",
        waypoint.log_text()
    );
    // The admin endpoint names what was taken from where, and why.
    let (code, body) = fake_istiod::http_get(
        &t.pod("n1p2").netns,
        "127.0.0.1:15000".parse()?,
        "/config_dump",
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let d: serde_json::Value = serde_json::from_str(&body)?;
    let names = |k: &str| {
        d[k].as_array()
            .into_iter()
            .flatten()
            .map(|o| {
                format!(
                    "{}/{}",
                    o["namespace"].as_str().unwrap_or("?"),
                    o["name"].as_str().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(names("httpRoutes"), ["default/echo", "shop/cart"], "{body}");
    assert_eq!(
        names("authorizationPolicies"),
        ["istio-system/deny-canary", "istio-system/mesh-deny"],
        "only this revision's and unlabelled policies: {body}"
    );
    assert_eq!(d["config"]["revision"], "canary", "{body}");
    assert_eq!(names("authorizationPolicies").len(), 2, "{body}");
    assert_eq!(d["waypoint"]["configSource"], "kubernetes");
    assert_eq!(
        d["waypoint"]["scope"]["labelledServices"],
        json!(["shop/cart"]),
        "{body}"
    );
    assert_eq!(
        d["waypoint"]["scope"]["servicesFromIstiod"],
        json!(["default/echo", "shop/cart"]),
        "{body}"
    );
    assert_eq!(
        d["waypoint"]["rejected"],
        json!([]),
        "blog's route is not ours to reject: {body}"
    );
    assert!(
        d["services"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["hostname"] == cart)),
        "{body}"
    );

    // A GRPCRoute arrives from Kubernetes: one method to v2.
    kube.apply("grpcroutes", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute", "metadata": {"name": "echo-grpc"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}],
                 "rules": [{"matches": [{"method": {"type": "Exact", "service": "echo.Health", "method": "Check"}}],
                            "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v2", "port": 80, "weight": 1}]}]}}));
    let mut to_v2 = false;
    for _ in 0..50 {
        if c.request("POST", "/echo.Health/Check", &[]).await?.pod() == "n1p3" {
            to_v2 = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(to_v2, "{}", waypoint.log_text());
    assert_eq!(
        c.request("POST", "/echo.Health/Watch", &[]).await?.pod(),
        "n2p1"
    );

    // DestinationRule subsets in a cluster: endpoints by their Pods' labels (read from
    // the API). Until n1p3's labels are known no endpoint is in subset v2 (503); then it is.
    kube.apply("destinationrules", json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": "echo"},
        "spec": {"host": echo, "subsets": [{"name": "v2", "labels": {"version": "v2"}}]}}));
    kube.apply("virtualservices", json!({"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "echo"},
        "spec": {"hosts": [echo], "http": [{"match": [{"headers": {"x-subset": {"exact": "v2"}}}], "route": [{"destination": {"host": "echo", "subset": "v2"}}]}]}}));
    wait_for_status_with(&mut c, "/subset", &[("x-subset", "v2")], 503)
        .await
        .with_context(|| waypoint.log_text())?;
    kube.apply("pods", json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "n1p3", "namespace": "default", "labels": {"app": "echo", "version": "v2"}}}));
    kube.apply("pods", json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "n2p1", "namespace": "default", "labels": {"app": "echo", "version": "v1"}}}));
    wait_for_status_with(&mut c, "/subset", &[("x-subset", "v2")], 200)
        .await
        .with_context(|| waypoint.log_text())?;
    for _ in 0..5 {
        assert_eq!(
            c.request("GET", "/subset", &[("x-subset", "v2")])
                .await?
                .pod(),
            "n1p3"
        );
    }
    kube.delete("virtualservices", "echo");
    kube.delete("destinationrules", "echo");

    // A mesh-wide Telemetry (root namespace) from the API: the access log only for requests
    // with a debug header.
    kube.apply("telemetries", json!({"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry", "metadata": {"name": "mesh-default", "namespace": "istio-system"},
        "spec": {"accessLogging": [{"providers": [{"name": "envoy"}], "filter": {"expression": "request.headers['x-debug'] == 'on'"}}]}}));
    let mut listed = false;
    for _ in 0..50 {
        let (_, body) = fake_istiod::http_get(
            &t.pod("n1p2").netns,
            "127.0.0.1:15000".parse()?,
            "/config_dump",
        )
        .await?;
        if body.contains("mesh-default") {
            listed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(listed, "{}", waypoint.log_text());
    assert_eq!(c.get("/k8s-quiet").await?.status, 200);
    assert_eq!(
        c.request("GET", "/k8s-logged", &[("x-debug", "on")])
            .await?
            .status,
        200
    );
    wait_for("the debug line", Duration::from_secs(5), || {
        waypoint.log_text().contains("path=/k8s-logged")
    })?;
    assert!(
        !waypoint.log_text().contains("path=/k8s-quiet"),
        "{}",
        waypoint.log_text()
    );
    kube.delete_in("telemetries", "istio-system", "mesh-default");

    // A backend in another namespace: 500 until a ReferenceGrant there allows it.
    kube.apply("httproutes", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "to-shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}],
                 "rules": [{"matches": [{"headers": [{"type": "Exact", "name": "x-shop", "value": "yes"}]}],
                            "backendRefs": [{"group": "", "kind": "Service", "name": "cart", "namespace": "shop", "port": 80, "weight": 1}]}]}}));
    wait_for_status_with(&mut c, "/cart", &[("x-shop", "yes")], 500)
        .await
        .with_context(|| waypoint.log_text())?;
    kube.apply("referencegrants", json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant", "metadata": {"name": "routes-from-default", "namespace": "shop"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "default"}], "to": [{"group": "", "kind": "Service", "name": "cart"}]}}));
    wait_for_status_with(&mut c, "/cart", &[("x-shop", "yes")], 200)
        .await
        .with_context(|| waypoint.log_text())?;
    assert_eq!(
        c.request("GET", "/cart", &[("x-shop", "yes")]).await?.pod(),
        "n2p1"
    );
    kube.delete("httproutes", "to-shop");

    // An AuthorizationPolicy arrives from Kubernetes: denied by path.
    kube.apply("authorizationpolicies", json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "deny-admin"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/admin*"]}}]}]}}));
    wait_for_status(&mut c, "/admin", 403)
        .await
        .with_context(|| waypoint.log_text())?;
    assert_eq!(c.get("/x").await?.status, 200);

    // The route changes: everything to v2. A broken route is refused and changes nothing.
    kube.apply("httproutes", route(json!({"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v2", "port": 80, "weight": 1}]})));
    kube.apply("httproutes", json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "broken"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}], "rules": [{"backendRefs": [{"name": "echo-v1"}]}]}}));
    wait_for("route change", Duration::from_secs(10), || {
        waypoint.log_text().contains("object rejected")
    })?;
    let mut all_v2 = false;
    for _ in 0..50 {
        if c.get("/y").await?.pod() == "n1p3" {
            all_v2 = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(all_v2, "{}", waypoint.log_text());
    // The policy goes away: /admin reaches the app again.
    kube.delete("authorizationpolicies", "deny-admin");
    wait_for_status(&mut c, "/admin", 200).await?;

    // An ALLOW the waypoint cannot enforce (a condition it does not know) denies every
    // request to its target instead of vanishing (which would allow everyone).
    kube.apply("authorizationpolicies", json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "jwt-only"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "ALLOW", "rules": [{"when": [{"key": "connection.sni", "values": ["x"]}]}]}}));
    wait_for_status(&mut c, "/x", 403)
        .await
        .with_context(|| waypoint.log_text())?;
    assert!(
        waypoint
            .log_text()
            .contains("denying every request to its targets"),
        "{}",
        waypoint.log_text()
    );
    let mut mc = http_app::H1Client::connect(
        &t.pod("n1p2").netns,
        "127.0.0.1:15020".parse()?,
        "localhost",
    )
    .await?;
    let text = mc.get("/stats/prometheus").await?.body;
    assert!(
        text.lines()
            .any(|l| l == "ztunnel_unenforceable_policies{source=\"kubernetes\"} 1"),
        "{text}"
    );
    kube.delete("authorizationpolicies", "jwt-only");
    wait_for_status(&mut c, "/x", 200).await?;

    // A RequestAuthentication arrives from Kubernetes: a token of another issuer is 401.
    let jwk = json!({"keys": [{"kty": "EC", "crv": "P-256", "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]});
    kube.apply("requestauthentications", json!({"apiVersion": "security.istio.io/v1", "kind": "RequestAuthentication", "metadata": {"name": "jwt"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "jwtRules": [{"issuer": "https://idp.example", "jwks": jwk.to_string()}]}}));
    let other = format!(
        "Bearer {}.{}.AAAA",
        b64url(br#"{"alg":"ES256"}"#),
        b64url(br#"{"iss":"https://other.example","sub":"x"}"#)
    );
    let mut got = 0;
    for _ in 0..50 {
        got = c
            .request("GET", "/x", &[("authorization", &other)])
            .await?
            .status
            .as_u16();
        if got == 401 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 401, "{}", waypoint.log_text());
    assert_eq!(c.get("/x").await?.status, 200, "no token: passes on");
    kube.delete("requestauthentications", "jwt");
    for _ in 0..50 {
        got = c
            .request("GET", "/x", &[("authorization", &other)])
            .await?
            .status
            .as_u16();
        if got == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 200, "the RequestAuthentication is gone");

    // CUSTOM: its provider comes from the `istio` ConfigMap of the root namespace.
    // Before there is one the policy denies what it matches; once its provider is there
    // (failing open: its service is nowhere) the request passes.
    kube.apply("authorizationpolicies", json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "ext"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "CUSTOM", "provider": {"name": "open"},
                 "rules": [{"to": [{"operation": {"paths": ["/ext*"]}}]}]}}));
    wait_for_status(&mut c, "/ext", 403)
        .await
        .with_context(|| waypoint.log_text())?;
    assert_eq!(c.get("/x").await?.status, 200);
    kube.apply("configmaps", json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "istio", "namespace": "istio-system"},
        "data": {"mesh": "extensionProviders:\n- {name: open, envoyExtAuthzHttp: {service: nowhere.default.svc.cluster.local, port: 80, failOpen: true}}\n"}}));
    wait_for_status(&mut c, "/ext", 200)
        .await
        .with_context(|| waypoint.log_text())?;
    let (_, body) = fake_istiod::http_get(
        &t.pod("n1p2").netns,
        "127.0.0.1:15000".parse()?,
        "/config_dump",
    )
    .await?;
    assert!(
        body.contains("envoyExtAuthzHttp"),
        "the dump names the provider: {body}"
    );
    kube.delete("authorizationpolicies", "ext");

    // shop/cart drops its labels: the label watch loses it (istiod still routes it here,
    // so its route stays in force).
    kube.apply("services", json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "cart", "namespace": "shop"}, "spec": {"ports": [{"port": 80}]}}));
    let mut scope = serde_json::Value::Null;
    for _ in 0..50 {
        let (_, body) = fake_istiod::http_get(
            &t.pod("n1p2").netns,
            "127.0.0.1:15000".parse()?,
            "/config_dump",
        )
        .await?;
        scope = serde_json::from_str::<serde_json::Value>(&body)?["waypoint"]["scope"].take();
        if scope["labelledServices"] == json!([]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(scope["labelledServices"], json!([]), "{scope}");
    assert_eq!(shop.get("/x").await?.echoed("x-route"), ["shop/cart"]);
    Ok(())
}

async fn wait_for_ready(ns: &netsim::Netns, addr: SocketAddr) -> Result<()> {
    for _ in 0..100 {
        if fake_istiod::readiness(ns, addr)
            .await
            .is_ok_and(|(c, _)| c == 200)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("not ready: {:?}", fake_istiod::readiness(ns, addr).await)
}

async fn wait_for_status(c: &mut http_app::H1Client, path: &str, status: u16) -> Result<()> {
    wait_for_status_with(c, path, &[], status).await
}

async fn wait_for_status_with(
    c: &mut http_app::H1Client,
    path: &str,
    headers: &[(&str, &str)],
    status: u16,
) -> Result<()> {
    for _ in 0..100 {
        if c.request("GET", path, headers).await?.status.as_u16() == status {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("{path} never answered {status}")
}

/// The waypoint's HBONE server has ztunnel's limits (the same code): handshakes from one
/// source over HBONE_MAX_HANDSHAKES_PER_IP are closed at once and counted, the rest at the
/// 5 s deadline, while mesh traffic through the waypoint goes on; an authenticated
/// connection with no stream is closed after HBONE_IDLE_TIMEOUT_SECONDS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waypoints_hbone_server_limits_handshakes_and_closes_idle_connections() -> Result<()> {
    const FLOOD: usize = 20;
    let m = L7Mesh::start(
        "l7hl",
        "",
        &[
            ("HBONE_MAX_HANDSHAKES_PER_IP", "2"),
            ("HBONE_IDLE_TIMEOUT_SECONDS", "1"),
        ],
    )
    .await?;
    let t = &m.mesh.topo;
    let hbone = SocketAddr::new(t.pod("n1p2").ip, 15008);
    // From the node's netns: a source outside the mesh that stalls in the handshake.
    let mut flood = Vec::new();
    for _ in 0..FLOOD {
        let opened = std::time::Instant::now();
        let Ok(mut s) = t.node(1).connect(hbone).await else {
            flood.push(tokio::spawn(async { Some(Duration::ZERO) }));
            continue;
        };
        flood.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 256];
            let r = tokio::time::timeout(Duration::from_secs(15), async {
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            r.ok().map(|_| opened.elapsed())
        }));
    }
    let r = m.h1().await?.get("/hello").await?;
    assert_eq!(
        r.status,
        200,
        "a request through the waypoint during the flood: {r:?}\n{}",
        m.log()
    );
    let mut closed = Vec::new();
    for f in flood {
        closed.push(
            f.await?
                .context("a flooding connection was still open after 15 s")?,
        );
    }
    let at_once = closed
        .iter()
        .filter(|d| **d < Duration::from_secs(1))
        .count();
    assert!(
        at_once >= FLOOD - 2,
        "{at_once} of {FLOOD} closed at once: {closed:?}"
    );
    assert!(
        closed.iter().all(|d| *d <= Duration::from_millis(6500)),
        "held past the 5 s deadline: {closed:?}"
    );
    let text = m.metrics().await?;
    let counted: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ztunnel_hbone_rejections_total{reason=\"handshake_limit\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        counted >= (FLOOD - 2) as u64,
        "{counted} refusals counted:\n{text}"
    );

    // A mesh peer that completes the handshakes and opens nothing.
    let ca = hbone_peer::load_ca(&t.dir.join("ca"))?;
    let id = |sa: &str| ztunnel::identity::Identity::new("cluster.local", "default", sa);
    let cert = ca.issue(&id("client"), Duration::from_secs(600))?;
    let key = rustls::crypto::ring::sign::any_supported_type(&cert.key)?;
    let cfg = ztunnel::tls::client_config(
        &rustls::sign::CertifiedKey::new(cert.chain.clone(), key),
        &[ca.root()],
        vec![id("waypoint")],
    )?;
    let tcp = t.node(1).connect(hbone).await?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(
            rustls_pki_types::ServerName::IpAddress(hbone.ip().into()),
            tcp,
        )
        .await?;
    let started = std::time::Instant::now();
    let (_send, conn) = h2::client::handshake(tls).await?;
    let ended = tokio::time::timeout(Duration::from_secs(5), conn)
        .await
        .context("an HBONE connection without streams stayed open")?;
    let took = started.elapsed();
    assert!(
        ended.is_ok(),
        "closed with an error, not GOAWAY NO_ERROR: {ended:?}"
    );
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the idle timeout"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The Grafana dashboards the charts ship (scripts/dashboards.py) query only metrics that
// the binaries export.

/// Metrics a dashboard queries that this test's traffic does not produce: each must be
/// exported with a sample by the metrics library once its event happens (`library_scrape`)
/// or by the other binary's scrape.
const ZTUNNEL_EVENT_ONLY: &[&str] = &[
    // Local config: no xDS stream to istiod.
    "istio_xds_connection_terminations_total",
    "istio_xds_message_total",
    "istio_xds_message_bytes_total",
    // pod_limit, fd_exhaustion, accept_error.
    "ztunnel_connections_refused_total",
];
const WAYPOINT_EVENT_ONLY: &[&str] = &[
    "istio_xds_message_total",
    // An upstream dial that fails (the L4 relay's CONNECT flag).
    "istio_tcp_connections_failed_total",
];

/// The metrics registry of both binaries with one of each event the e2e traffic cannot
/// cause recorded (the encoder leaves out families without samples).
fn library_scrape() -> String {
    let m = ztunnel::metrics::Metrics::default();
    m.xds.terminated("closed");
    m.xds
        .message("type.googleapis.com/istio.workload.Address", 100, 0);
    m.connection_refused("pod_limit");
    let peers = ztunnel::metrics::TcpLabels::new(
        "waypoint",
        Default::default(),
        Default::default(),
        None,
        true,
    );
    m.failed(&peers, "CONNECT");
    m.encode()
}

/// The metric names a dashboard's queries and variables select: each is written right
/// before its `{` selector (scripts/dashboards.py checks that every query has one).
fn dashboard_metrics(path: &std::path::Path) -> Result<std::collections::BTreeSet<String>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let d: serde_json::Value =
        serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    let mut exprs: Vec<&str> = Vec::new();
    for p in d["panels"].as_array().context("no panels")? {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.extend(t["expr"].as_str());
        }
    }
    for v in d["templating"]["list"]
        .as_array()
        .context("no templating")?
    {
        exprs.extend(v["definition"].as_str());
    }
    let re = regex::Regex::new(r"(?:^|[^A-Za-z0-9_:$])([A-Za-z_:][A-Za-z0-9_:]*)\{")?;
    let names: std::collections::BTreeSet<String> = exprs
        .iter()
        .flat_map(|e| re.captures_iter(e).map(|c| c[1].to_string()))
        .collect();
    anyhow::ensure!(names.len() > 5, "{}: only {names:?}", path.display());
    Ok(names)
}

/// Whether a scrape has a sample of `sample` (a name as a query writes it: `x_total`,
/// `x_bucket`, a gauge's name) and declares its family with the type that name implies.
/// The encoder writes no family without samples.
fn exported(scrapes: &[&str], sample: &str) -> bool {
    scrapes.iter().any(|s| {
        let declared = |family: &str, types: &[&str]| {
            s.lines().any(|l| {
                let mut w = l.strip_prefix("# TYPE ").unwrap_or("").split_whitespace();
                w.next() == Some(family) && w.next().is_some_and(|t| types.contains(&t))
            })
        };
        let typed = declared(sample, &["gauge", "unknown"])
            || sample
                .strip_suffix("_total")
                .is_some_and(|f| declared(f, &["counter"]))
            || ["_bucket", "_sum", "_count"].iter().any(|sfx| {
                sample
                    .strip_suffix(sfx)
                    .is_some_and(|f| declared(f, &["histogram"]))
            });
        typed
            && s.lines().any(|l| {
                l.strip_prefix(sample)
                    .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            })
    })
}

/// A DNS query for `name` (type A) from `pod` to its in-pod DNS proxy; the answer count.
fn dns_answers(pod: &Pod, name: &str) -> Result<u16> {
    let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(u8::try_from(label.len())?);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    pod.netns.run(move || -> Result<u16> {
        let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.send_to(&q, "127.0.0.1:15053")?;
        let mut buf = [0u8; 512];
        let n = s.recv(&mut buf)?;
        anyhow::ensure!(
            n >= 12 && buf[..2] == [0x12, 0x34] && buf[3] & 0x0f == 0,
            "bad DNS answer {:?}",
            &buf[..n]
        );
        Ok(u16::from_be_bytes([buf[6], buf[7]]))
    })?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_query_only_exported_metrics() -> Result<()> {
    let m = L7Mesh::start("dash", L7_ROUTES, &[]).await?;
    // HTTP through the waypoint (200 and a 403 from policy), L4 through it (port 9000),
    // and a DNS query to node1's DNS proxy.
    let mut c = m.h1().await?;
    assert_eq!(c.get("/hello").await?.status, 200);
    assert_eq!(c.get("/admin").await?.status, 403);
    drop(c);
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:9000").parse()?)
        .await?;
    assert!(!echo_roundtrip(&mut s, b"opaque").await?.is_empty());
    let client = m.mesh.topo.pod("n1p1");
    assert!(dns_answers(client, "echo.default.svc.cluster.local")? >= 1);
    wait_for("L4 log", Duration::from_secs(5), || {
        m.log().contains("direction=\"waypoint\"")
    })?;
    // Failures: a name outside the mesh (forwarded upstream, whatever the answer), a port
    // nothing listens on, and bytes that are not TLS on a pod's HBONE port.
    let q = [
        0x43, 0x21, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 7, b'e', b'x', b'a', b'm', b'p', b'l',
        b'e', 3, b'c', b'o', b'm', 0, 0, 1, 0, 1,
    ];
    client.netns.run(|| {
        std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.send_to(&q, "127.0.0.1:15053"))
    })??;
    let server = m.mesh.topo.pod("n2p1").ip;
    if let Ok(mut s) = client.netns.connect(SocketAddr::new(server, 7777)).await {
        let _ =
            tokio::time::timeout(Duration::from_secs(5), echo_roundtrip(&mut s, b"anyone?")).await;
    }
    let mut s = m
        .mesh
        .topo
        .node(1)
        .connect(SocketAddr::new(server, 15008))
        .await?;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        echo_roundtrip(&mut s, b"GET / HTTP/1.1\r\n\r\n"),
    )
    .await;

    // Counters are updated as connections end: wait for the failures to be counted.
    let mut ztunnels = Vec::new();
    for _ in 0..100 {
        ztunnels.clear();
        for n in 1..=2 {
            let mut mc = http_app::H1Client::connect(
                m.mesh.topo.node(n),
                "127.0.0.1:15020".parse()?,
                "localhost",
            )
            .await?;
            ztunnels.push(mc.get("/stats/prometheus").await?.body);
        }
        let z: Vec<&str> = ztunnels.iter().map(String::as_str).collect();
        let counted = |name| exported(&z, name);
        if counted("istio_tcp_connections_failed_total")
            && counted("ztunnel_hbone_rejections_total")
            && counted("istio_dns_upstream_requests_total")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waypoint = m.metrics().await?;
    let library = library_scrape();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    let z: Vec<&str> = ztunnels.iter().map(String::as_str).collect();
    for (dashboard, scrapes, event_only) in [
        (
            "charts/ztunnel/files/dashboards/ztunnel.json",
            z.clone(),
            ZTUNNEL_EVENT_ONLY,
        ),
        (
            "charts/waypoint/files/dashboards/waypoint.json",
            vec![waypoint.as_str()],
            WAYPOINT_EVENT_ONLY,
        ),
    ] {
        let others: Vec<&str> = z
            .iter()
            .copied()
            .chain([waypoint.as_str(), library.as_str()])
            .collect();
        for name in dashboard_metrics(&root.join(dashboard))? {
            let ok = exported(&scrapes, &name)
                || (event_only.contains(&name.as_str()) && exported(&others, &name));
            if !ok {
                problems.push(format!("{dashboard}: {name} is not exported (no sample of a family of that type) after traffic"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n--- ztunnel node1:\n{}\n--- waypoint:\n{waypoint}",
        problems.join("\n"),
        ztunnels[0]
    );
    Ok(())
}

/// nginx in `pod` (one process, so nothing outlives the test): HTTP/1.1 on 8080 and h2c
/// (HTTP/2 prior knowledge only) on 8081, each answering with the protocol it was asked in.
fn start_nginx(pod: &Pod, dir: &std::path::Path) -> Result<netsim::Child> {
    let servers = "server { listen 8080; location / { return 200 \"proto=$server_protocol\\n\"; } }
  server { listen 8081 http2; location / { return 200 \"proto=$server_protocol\\n\"; } }";
    start_nginx_in(&pod.netns, &dir.join("nginx"), servers, &[8080, 8081])
}

/// nginx in `ns` with these `server` blocks, its files in `dir`; waits for `ports`.
fn start_nginx_in(
    ns: &netsim::Netns,
    dir: &std::path::Path,
    servers: &str,
    ports: &[u16],
) -> Result<netsim::Child> {
    std::fs::create_dir_all(dir)?;
    let p = dir.display();
    let conf = format!(
        "master_process off; daemon off; pid {p}/nginx.pid; error_log {p}/error.log;
events {{}}
http {{
  access_log off;
  client_body_temp_path {p}/body; proxy_temp_path {p}/proxy; fastcgi_temp_path {p}/fcgi; uwsgi_temp_path {p}/uwsgi; scgi_temp_path {p}/scgi;
  {servers}
}}
"
    );
    std::fs::write(dir.join("nginx.conf"), conf)?;
    let conf_path = dir.join("nginx.conf").display().to_string();
    let child = ns.spawn(
        "nginx",
        &["-p", &p.to_string(), "-c", &conf_path],
        &[],
        &dir.join("stdout.log"),
    )?;
    for &port in ports {
        wait_for(&format!("nginx on {port}"), Duration::from_secs(5), || {
            ns.run(move || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
                .unwrap_or(false)
        })?;
    }
    Ok(child)
}

/// Issue 21 item 0, with real clients: the waypoint speaks to the backend in the protocol
/// its service port declares (Istio's appProtocol / port name), not the client's: curl
/// with HTTP/2 prior knowledge and h2load reach nginx's HTTP/1.1 port, curl's HTTP/1.1
/// (and its h2c upgrade offer) reach nginx's h2c-only port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_upstream_protocol_follows_the_service_port_with_real_clients() -> Result<()> {
    for tool in ["nginx", "curl", "h2load"] {
        anyhow::ensure!(
            sh("sh", &["-c", &format!("command -v {tool}")]).is_ok(),
            "{tool} is needed (scripts/deps.sh installs it)"
        );
    }
    let topo = Topology::build(&prefix("wproto"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/10.96.0.30\"], ports: {{80: 8080}}, appProtocols: {{80: HTTP11}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: web-h2, namespace: default, hostname: web-h2.default.svc.cluster.local, vips: [\"/10.96.0.31\"], ports: {{80: 8081}}, appProtocols: {{80: HTTP2}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "web", ", services: {default/web.default.svc.cluster.local: {80: 8080}, default/web-h2.default.svc.cluster.local: {80: 8081}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let _nginx = start_nginx(t.pod("n2p1"), &t.dir)?;
    let client = &t.pod("n1p1").netns;
    let curl = |args: &[&str]| -> Result<String> {
        let mut all = vec![
            "-sS",
            "--max-time",
            "10",
            "-w",
            " %{http_version} %{http_code}",
        ];
        all.extend_from_slice(args);
        client
            .exec("curl", &all)
            .with_context(|| waypoint.log_text())
    };
    // The client's protocol is what the client sees; the backend's is what the port says.
    assert_eq!(
        curl(&["--http2-prior-knowledge", "http://10.96.0.30/"])?,
        "proto=HTTP/1.1\n 2 200"
    );
    assert_eq!(
        curl(&["--http1.1", "http://10.96.0.30/"])?,
        "proto=HTTP/1.1\n 1.1 200"
    );
    assert_eq!(
        curl(&["--http1.1", "http://10.96.0.31/"])?,
        "proto=HTTP/2.0\n 1.1 200"
    );
    assert_eq!(
        curl(&["--http2-prior-knowledge", "http://10.96.0.31/"])?,
        "proto=HTTP/2.0\n 2 200"
    );
    // curl --http2 offers an h2c upgrade; the waypoint answers in HTTP/1.1 (as Envoy does
    // without upgrade config) and the backend still gets HTTP/2.
    assert_eq!(
        curl(&["--http2", "http://10.96.0.31/"])?,
        "proto=HTTP/2.0\n 1.1 200"
    );
    // h2load: many multiplexed HTTP/2 requests, every one answered by the HTTP/1.1 backend.
    let out = client.exec(
        "h2load",
        &["-n", "400", "-c", "4", "-m", "10", "http://10.96.0.30/"],
    )?;
    let line = out
        .lines()
        .find(|l| l.starts_with("requests:"))
        .context("no h2load summary")?
        .to_string();
    assert!(line.contains("400 succeeded, 0 failed"), "{line}\n{out}");
    let codes = out
        .lines()
        .find(|l| l.starts_with("status codes:"))
        .unwrap_or_default()
        .to_string();
    assert!(codes.starts_with("status codes: 400 2xx"), "{codes}");
    Ok(())
}

/// Issue 39 item 1, with real clients: a Host that carries a path (`web/admin#`,
/// `web/admin?`, `admin.example.com/`) is refused with 400 before policy, where it used
/// to pass a DENY on `/admin*` (or on a host) as `GET /public` and reach the HTTP/2
/// backend, whose URI was pasted together from it, as `:path /admin`. nginx (h2c) keeps
/// an access log: `/admin` never reaches it, a plain request does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_a_host_header_cannot_smuggle_a_path_past_policy() -> Result<()> {
    for tool in ["nginx", "curl"] {
        let found = sh("sh", &["-c", &format!("command -v {tool}")]).is_ok();
        anyhow::ensure!(found, "{tool} is needed (scripts/deps.sh installs it)");
    }
    let topo = Topology::build(&prefix("wauth"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let web = "{name: web, namespace: default, hostname: web.default.svc.cluster.local, \
               vips: [\"/10.96.0.32\"], ports: {80: 8081}, appProtocols: {80: HTTP2}";
    let cfg = format!(
        "workloads:\n{}{}{}services:\n- {web}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(
            &topo,
            "n2p1",
            "web",
            ", services: {default/web.default.svc.cluster.local: {80: 8081}}"
        ),
    );
    let deny = |name: &str, operation: &str| {
        format!(
            "- {{name: {name}, namespace: default, targetRefs: [{{kind: Service, name: web}}], \
             action: DENY, rules: [{{to: [{{operation: {{{operation}}}}}]}}]}}\n"
        )
    };
    let policies = format!(
        "authorizationPolicies:\n{}{}",
        deny("no-admin", "paths: ['/admin*']"),
        deny("no-admin-host", "hosts: [admin.example.com]")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, format!("{cfg}{policies}"))?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let nginx_dir = t.dir.join("nginx");
    let access_log = nginx_dir.join("access.log");
    let server = format!(
        "server {{ listen 8081 http2; access_log {}; \
         location / {{ return 200 \"path=$request_uri\\n\"; }} }}",
        access_log.display()
    );
    let _nginx = start_nginx_in(&t.pod("n2p1").netns, &nginx_dir, &server, &[8081])?;
    let client = &t.pod("n1p1").netns;
    let curl = |args: &[&str]| -> Result<String> {
        let mut all = vec!["-sS", "--max-time", "10", "-w", " %{http_code}"];
        all.extend_from_slice(args);
        client
            .exec("curl", &all)
            .with_context(|| waypoint.log_text())
    };
    let url = "http://10.96.0.32/public";
    assert_eq!(curl(&["--http1.1", url])?, "path=/public\n 200");
    // The policies hold for requests that say what they mean.
    assert!(curl(&["--http1.1", "http://10.96.0.32/admin"])?.ends_with(" 403"));
    let admin_host = curl(&["--http1.1", "-H", "Host: admin.example.com", url])?;
    assert!(admin_host.ends_with(" 403"), "{admin_host}");
    // A path smuggled in Host: 400 from the waypoint, with what is wrong.
    for host in [
        "web.default.svc.cluster.local/admin#",
        "web/admin?",
        "admin.example.com/",
    ] {
        let out = curl(&["--http1.1", "-H", &format!("Host: {host}"), url])?;
        assert!(
            out.ends_with(" 400"),
            "Host: {host}: {out}\n{}",
            waypoint.log_text()
        );
        assert!(
            out.contains("'/' is not allowed in the authority"),
            "Host: {host}: {out}"
        );
    }
    // Over HTTP/2 curl sends the Host as :authority, which h2 refuses as malformed
    // (a stream error) or the waypoint answers 400: never anything from the backend.
    let h2 = curl(&["--http2-prior-knowledge", "-H", "Host: web/admin#", url]);
    assert!(h2.as_ref().map_or(true, |o| o.ends_with(" 400")), "{h2:?}");
    assert_eq!(
        curl(&["--http2-prior-knowledge", url])?,
        "path=/public\n 200"
    );

    let log = std::fs::read_to_string(&access_log)?;
    assert!(
        log.contains("GET /public HTTP/2.0"),
        "nginx saw no request:\n{log}"
    );
    assert!(
        !log.contains("/admin"),
        "a smuggled path reached nginx:\n{log}"
    );
    assert_eq!(log.lines().count(), 2, "{log}");
    Ok(())
}

/// RequestAuthentication in the waypoint: RS256 tokens against an inline JWKS, ES256
/// ones against a jwksUri served by a small HTTP server in the waypoint's pod (fetched,
/// then kept when the server goes away), an ALLOW on requestPrincipals and a DENY on a
/// claim, the token removed before the backend and a claim copied to a header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_request_authentication_with_jwt() -> Result<()> {
    use serde_json::json;
    let keydir = std::env::temp_dir().join(format!("wp-jwt-{}", std::process::id()));
    std::fs::create_dir_all(&keydir)?;
    let rsa = rs256_key(&keydir, "rsa-1");
    let _ = std::fs::remove_dir_all(&keydir);
    let (rsa, ec, stranger) = (rsa?, es256_key("ec-1")?, es256_key("ec-1")?);
    let inline = json!({"keys": [rsa.jwk.clone()]}).to_string();
    let policies = |ec_rule: &str| {
        format!(
            "requestAuthentications:\n\
             - name: jwt\n  namespace: default\n  targetRefs: [{{kind: Service, group: \"\", name: echo}}]\n  jwtRules:\n\
             \x20 - {{issuer: https://rsa.example, jwks: '{inline}', outputClaimToHeaders: [{{header: x-jwt-sub, claim: sub}}]}}\n{ec_rule}\
             authorizationPolicies:\n\
             - name: need-jwt\n  namespace: default\n  targetRefs: [{{kind: Service, group: \"\", name: echo}}]\n  action: ALLOW\n\
             \x20 rules: [{{from: [{{source: {{requestPrincipals: ['https://rsa.example/*', 'https://ec.example/*']}}}}]}}]\n\
             - name: gold-only\n  namespace: default\n  targetRefs: [{{kind: Service, group: \"\", name: echo}}]\n  action: DENY\n\
             \x20 rules: [{{to: [{{operation: {{paths: [/premium]}}}}], when: [{{key: 'request.auth.claims[plan][tier]', notValues: [gold]}}]}}]\n"
        )
    };
    let m = L7Mesh::start(
        "l7j",
        &policies(""),
        &[("JWKS_REFRESH_INTERVAL_SECONDS", "1")],
    )
    .await?;
    let mut c = m.h1().await?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let claims = |iss: &str, tier: &str| json!({"iss": iss, "sub": "alice", "exp": now + 3600, "plan": {"tier": tier}});
    let bearer = |t: &str| format!("Bearer {t}");

    let good = sign(&rsa, claims("https://rsa.example", "gold"))?;
    let r = c
        .request("GET", "/x", &[("authorization", &bearer(&good))])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert!(
        r.echoed("authorization").is_empty(),
        "the token reached the backend: {r:?}"
    );
    assert_eq!(r.echoed("x-jwt-sub"), ["alice"]);
    // No token: not authenticated, so the ALLOW on requestPrincipals denies.
    let r = c.get("/x").await?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (403, "RBAC: access denied")
    );
    // A bad signature, an expired token, an unknown issuer: 401 whatever the policies.
    // The good token with its payload swapped for another subject's.
    let mut parts: Vec<String> = good.split('.').map(str::to_string).collect();
    let mut admin = claims("https://rsa.example", "gold");
    admin["sub"] = json!("admin");
    parts[1] = b64url(admin.to_string().as_bytes());
    let forged = parts.join(".");
    let mut old = claims("https://rsa.example", "gold");
    old["exp"] = json!(now - 3600);
    let expired = sign(&rsa, old)?;
    let unknown = sign(&rsa, claims("https://other.example", "gold"))?;
    for (t, body) in [
        (&forged, "Jwt verification fails"),
        (&expired, "Jwt is expired"),
        (&unknown, "Jwt issuer is not configured"),
    ] {
        let r = c
            .request("GET", "/x", &[("authorization", &bearer(t))])
            .await?;
        assert_eq!((r.status.as_u16(), r.body.trim()), (401, body), "{r:?}");
        assert_eq!(
            r.headers
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok()),
            Some(
                "Bearer realm=\"http://echo.default.svc.cluster.local/x\", error=\"invalid_token\""
            )
        );
    }
    // The claim-based DENY.
    let silver = sign(&rsa, claims("https://rsa.example", "silver"))?;
    let r = c
        .request("GET", "/premium", &[("authorization", &bearer(&silver))])
        .await?;
    assert_eq!(r.status, 403, "{r:?}");
    let r = c
        .request("GET", "/premium", &[("authorization", &bearer(&good))])
        .await?;
    assert_eq!(r.status, 200, "{r:?}");

    // ES256 keys from a jwksUri: a small HTTP server in the waypoint's pod.
    let pod = &m.mesh.topo.pod("n1p2");
    let www = m.mesh.topo.dir.join("jwks");
    std::fs::create_dir_all(&www)?;
    std::fs::write(
        www.join("jwks.json"),
        json!({"keys": [ec.jwk.clone()]}).to_string(),
    )?;
    let www_s = www.display().to_string();
    let mut server = pod.netns.spawn(
        "python3",
        &[
            "-m",
            "http.server",
            "18080",
            "--bind",
            "127.0.0.1",
            "--directory",
            &www_s,
        ],
        &[],
        &m.mesh.topo.dir.join("jwks-server.log"),
    )?;
    let mut up = false;
    for _ in 0..100 {
        if let Ok(mut h) =
            http_app::H1Client::connect(&pod.netns, "127.0.0.1:18080".parse()?, "localhost").await
        {
            if h.get("/jwks.json").await.is_ok_and(|r| r.status == 200) {
                up = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::ensure!(up, "the JWKS server did not start");
    let ec_rule = "  - {issuer: https://ec.example, jwksUri: 'http://127.0.0.1:18080/jwks.json', timeout: 2s}\n";
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(&tmp, format!("{}{}", m.base, policies(ec_rule)))?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    m.waypoint
        .wait_log("JWKS fetched", Duration::from_secs(10))?;
    let ec_good = sign(&ec, claims("https://ec.example", "gold"))?;
    let r = c
        .request("GET", "/x", &[("authorization", &bearer(&ec_good))])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    let ec_forged = sign(&stranger, claims("https://ec.example", "gold"))?;
    let r = c
        .request("GET", "/x", &[("authorization", &bearer(&ec_forged))])
        .await?;
    assert_eq!(r.status, 401, "{r:?}");
    // The server goes away: refreshes fail, the last good keys stay in force.
    server.stop();
    m.waypoint
        .wait_log("JWKS fetch failed", Duration::from_secs(10))?;
    assert!(m.log().contains("kept_last_good_keys=true"), "{}", m.log());
    let r = c
        .request("GET", "/x", &[("authorization", &bearer(&ec_good))])
        .await?;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        m.log().contains("authn.principal=https://ec.example/alice")
            || m.log()
                .contains("authn.principal=\"https://ec.example/alice\""),
        "{}",
        m.log()
    );
    Ok(())
}

/// Issue 21 item 4, with real peers: WebSockets through the waypoint as Istio's Envoy
/// waypoint passes them. The `websockets` package's client and server (HTTP/1.1
/// upgrade), hypercorn as an h2c backend with RFC 8441 extended CONNECT, and an HTTP/2
/// client driving extended CONNECT with the `h2` library (tests/ws_peers.py): every
/// client/backend version pair echoes text, binary and 1 MB messages; a DENY policy on
/// the path refuses the upgrade with 403, an HTTPRoute sends one path to the other
/// backend; the log and the metrics have the relayed bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_websockets_pass_with_real_clients_and_servers() -> Result<()> {
    anyhow::ensure!(
        sh("python3", &["-c", "import websockets, h2, hypercorn"]).is_ok(),
        "python3 with the websockets, h2 and hypercorn packages is needed (scripts/deps.sh installs them)"
    );
    let peers = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/ws_peers.py")
        .display()
        .to_string();
    let topo = Topology::build(&prefix("wws"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: ws, namespace: default, hostname: ws.default.svc.cluster.local, vips: [\"/10.96.0.40\"], ports: {{80: 8080}}, appProtocols: {{80: HTTP11}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: ws-h2, namespace: default, hostname: ws-h2.default.svc.cluster.local, vips: [\"/10.96.0.41\"], ports: {{80: 8081}}, appProtocols: {{80: HTTP2}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "ws", ", services: {default/ws.default.svc.cluster.local: {80: 8080}, default/ws-h2.default.svc.cluster.local: {80: 8081}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    let deny = "authorizationPolicies:\n- {name: no-private, namespace: default, targetRefs: [{kind: Service, name: ws}], action: DENY, rules: [{to: [{operation: {paths: [/private]}}]}]}\n";
    // An HTTPRoute on ws sends /to-h2 to ws-h2 (everything else stays on ws).
    let route = "httpRoutes:\n- {name: ws, namespace: default, parentRefs: [{group: \"\", kind: Service, name: ws, port: 80}], rules: [\
        {matches: [{path: {type: PathPrefix, value: /to-h2}}], backendRefs: [{name: ws-h2, port: 80}]}, {matches: [{path: {type: PathPrefix, value: /}}]}]}\n";
    std::fs::write(&cfg_path, format!("{cfg}{deny}{route}"))?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let server = t.pod("n2p1");
    let h1 = server.netns.spawn(
        "python3",
        &[&peers, "serve-h1", "8080"],
        &[],
        &t.dir.join("ws-h1.log"),
    )?;
    let h2 = server.netns.spawn(
        "python3",
        &[&peers, "serve-h2", "8081"],
        &[],
        &t.dir.join("ws-h2.log"),
    )?;
    for (port, child) in [(8080, &h1), (8081, &h2)] {
        wait_for(
            &format!("websocket server on {port}"),
            Duration::from_secs(15),
            || {
                server
                    .netns
                    .run(move || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
                    .unwrap_or(false)
            },
        )
        .with_context(|| child.log_text())?;
    }
    let client = &t.pod("n1p1").netns;
    let run = |args: &[&str]| -> Result<String> {
        let mut all = vec![peers.as_str()];
        all.extend_from_slice(args);
        let out = client.exec("timeout", &[&["60", "python3"][..], &all].concat());
        out.map(|s| s.trim().to_string()).with_context(|| {
            format!(
                "{}\n--- h1 server:\n{}\n--- h2 server:\n{}",
                waypoint.log_text(),
                h1.log_text(),
                h2.log_text()
            )
        })
    };
    // HTTP/1.1 client -> HTTP/1.1 backend: the upgrade passes as is.
    assert_eq!(run(&["client", "ws://10.96.0.40/chat"])?, "ok 3 echoes");
    // The upgrade request is authorized like any other.
    assert_eq!(run(&["status", "ws://10.96.0.40/private"])?, "status 403");
    // HTTP/2 extended CONNECT -> HTTP/1.1 backend: 200 <-> 101.
    assert_eq!(
        run(&["client-h2", "10.96.0.40", "80", "/chat"])?,
        "ok 3 echoes over extended CONNECT"
    );
    // HTTP/1.1 client -> HTTP/2 backend (port says HTTP2): extended CONNECT upstream,
    // the waypoint answers the client's key.
    assert_eq!(run(&["client", "ws://10.96.0.41/chat"])?, "ok 3 echoes");
    // HTTP/2 to HTTP/2: extended CONNECT both ways.
    assert_eq!(
        run(&["client-h2", "10.96.0.41", "80", "/chat"])?,
        "ok 3 echoes over extended CONNECT"
    );
    assert_eq!(
        h2.log_text().matches("websocket over HTTP/2").count(),
        2,
        "{}",
        h2.log_text()
    );
    // Routes apply to the upgrade: ws's /to-h2 is served by hypercorn, over HTTP/2.
    assert_eq!(run(&["client", "ws://10.96.0.40/to-h2"])?, "ok 3 echoes");
    assert_eq!(
        h2.log_text().matches("websocket over HTTP/2").count(),
        3,
        "{}",
        h2.log_text()
    );
    assert!(
        waypoint.log_text().contains("route=\"default/ws#0\""),
        "{}",
        waypoint.log_text()
    );

    // One log line per WebSocket once both sides closed, with the relayed bytes (each
    // way over 1 MB: the 1 MB message and its echo).
    wait_for("websocket log lines", Duration::from_secs(10), || {
        waypoint
            .log_text()
            .lines()
            .filter(|l| l.contains("request complete") && l.contains("path=/chat"))
            .count()
            >= 4
    })
    .with_context(|| waypoint.log_text())?;
    let wl = waypoint.log_text();
    let lines: Vec<&str> = wl
        .lines()
        .filter(|l| l.contains("request complete") && l.contains("path=/chat"))
        .collect();
    let field = |l: &str, k: &str| -> u64 {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    for l in &lines {
        assert!(
            field(l, "bytes_recv=") > 1_000_000 && field(l, "bytes_sent=") > 1_000_000,
            "{l}"
        );
        // hypercorn ends its streams only by closing its connection (tests/ws_peers.py).
        assert!(
            !l.contains("error=") || l.contains("dst.service=\"ws-h2."),
            "{l}"
        );
    }
    // The status and method the client saw: 101 to a GET, 200 to an extended CONNECT.
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("status=101") && l.contains("method=GET"))
            .count(),
        2,
        "{wl}"
    );
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("status=200") && l.contains("method=CONNECT"))
            .count(),
        2,
        "{wl}"
    );
    assert!(
        wl.contains("status=403") && wl.contains("authz.denied_by=\"default/no-private\""),
        "{wl}"
    );
    // The request metrics count them (the routed one too) with the relayed bytes.
    let mut mc = http_app::H1Client::connect(
        &t.pod("n1p2").netns,
        "127.0.0.1:15020".parse()?,
        "localhost",
    )
    .await?;
    let metrics = mc.get("/stats/prometheus").await?.body;
    let count = |code: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("istio_requests_total{")
                    && l.contains(&format!("response_code=\"{code}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(
        (count("101"), count("200"), count("403")),
        (3, 2, 1),
        "{metrics}"
    );
    let sent: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("istio_response_bytes_sum{") && l.contains("response_code=\"101\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(sent > 2_000_000.0, "{metrics}");

    // The cost of a relayed WebSocket (docs/benchmarks.md): ZTUNNEL_BENCH=1 prints the
    // waypoint's CPU per MiB relayed (both ways) for 200 MiB echoed each way.
    if std::env::var_os("ZTUNNEL_BENCH").is_some() {
        for url in ["ws://10.96.0.40/bulk", "ws://10.96.0.41/bulk"] {
            let before = waypoint.cpu_time().context("waypoint CPU time")?;
            let out = run(&["bulk", url, "200"])?;
            let cpu = waypoint.cpu_time().context("waypoint CPU time")? - before;
            println!(
                "{url}: {out}; waypoint CPU {:.2} s, {:.2} ms per MiB relayed",
                cpu.as_secs_f64(),
                cpu.as_secs_f64() * 1000.0 / 400.0
            );
        }
    }
    Ok(())
}

const EXT_AUTHZ_PROVIDERS: &str = r#"
meshConfig:
  extensionProviders:
  - name: http-authz
    envoyExtAuthzHttp:
      service: default/authz.default.svc.cluster.local
      port: 8000
      pathPrefix: /check
      includeRequestHeadersInCheck: [x-ext-authz]
      headersToUpstreamOnAllow: [x-user]
      headersToDownstreamOnDeny: [x-reason]
      headersToDownstreamOnAllow: [x-authz-*]
  - name: grpc-authz
    envoyExtAuthzGrpc:
      service: authz.default.svc.cluster.local
      port: 9100
      timeout: 2s
  - name: down
    envoyExtAuthzHttp: {service: authz.default.svc.cluster.local, port: 8001, timeout: 2s, statusOnError: "503"}
  - name: down-open
    envoyExtAuthzGrpc: {service: authz.default.svc.cluster.local, port: 8001, timeout: 2s, failOpen: true}
  - name: zipkin
    zipkin: {service: zipkin.istio-system.svc.cluster.local, port: 9411}
"#;

/// A CUSTOM policy on the echo service for `/private*`, checked by `provider`.
fn custom_policy(provider: &str) -> String {
    format!(
        "authorizationPolicies:\n- {{name: ext, namespace: default, targetRefs: [{{kind: Service, group: \"\", name: echo}}], action: CUSTOM, \
         provider: {{name: {provider}}}, rules: [{{to: [{{operation: {{paths: [\"/private*\"]}}}}]}}]}}\n"
    )
}

/// AuthorizationPolicy CUSTOM through the waypoint, with real ext_authz servers in a
/// mesh pod: an HTTP authorizer (Istio's envoyExtAuthzHttp) and a gRPC one (Envoy's
/// `envoy.service.auth.v3.Authorization/Check`, served by tonic), only for what the
/// policy's rules match; failures answer statusOnError or fail open; a provider that is
/// missing or not an authorizer denies what its policy matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_custom_policies_ask_http_and_grpc_authorizers() -> Result<()> {
    use test_servers::{start_grpc_authorizer, start_http_authorizer, Checks};
    let l7 = format!("{EXT_AUTHZ_PROVIDERS}{}", custom_policy("http-authz"));
    let m = L7Mesh::start("l7x", &l7, &[]).await?;
    let authz_pod = m.mesh.topo.pod("n2p1");
    let (http_checks, grpc_checks) = (Checks::default(), Checks::default());
    let _h = start_http_authorizer(authz_pod, 8000, http_checks.clone())?;
    let _g = start_grpc_authorizer(authz_pod, 9100, grpc_checks.clone())?;
    let mut c = m.h1().await?;

    // HTTP provider. Paths the rules don't match are never checked.
    let r = c
        .request("GET", "/public", &[("x-ext-authz", "deny")])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert!(http_checks.lock().unwrap().is_empty());
    let r = c
        .request(
            "GET",
            "/private/a?q=1",
            &[("x-ext-authz", "allow"), ("x-other", "o")],
        )
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert_eq!(
        r.echoed("x-user"),
        ["alice"],
        "headersToUpstreamOnAllow reach the backend"
    );
    assert_eq!(
        r.headers.get("x-authz-said").map(|v| v.as_bytes()),
        Some(&b"ok"[..]),
        "headersToDownstreamOnAllow reach the client"
    );
    assert!(r.echoed("x-unlisted").is_empty() && r.headers.get("x-unlisted").is_none());
    {
        let seen = http_checks.lock().unwrap();
        let check = seen.last().context("checked")?;
        // Envoy's check request: the method, pathPrefix + path, Host, no body, and only the listed headers.
        assert_eq!(
            (check.method.as_str(), check.path.as_str()),
            ("GET", "/check/private/a?q=1")
        );
        assert_eq!(
            check.headers.get("host").map(String::as_str),
            Some("echo.default.svc.cluster.local")
        );
        assert_eq!(
            check.headers.get("content-length").map(String::as_str),
            Some("0")
        );
        assert!(
            check.headers.contains_key("x-ext-authz") && !check.headers.contains_key("x-other"),
            "{check:?}"
        );
    }
    let r = c
        .request("GET", "/private", &[("x-ext-authz", "deny")])
        .await?;
    assert_eq!(
        (r.status.as_u16(), r.body.as_str()),
        (403, "denied by the authorizer"),
        "{r:?}"
    );
    assert_eq!(
        r.headers.get("x-reason").map(|v| v.as_bytes()),
        Some(&b"nope"[..])
    );
    assert!(
        r.headers.get("x-secret").is_none(),
        "only headersToDownstreamOnDeny reach the client"
    );
    wait_for("deny log", Duration::from_secs(5), || {
        m.log().contains("response_flags=\"UAEX\"")
    })?;

    let reloads = |n: usize| {
        wait_for("config reloaded", Duration::from_secs(5), || {
            m.log().matches("config reloaded").count() >= n
        })
    };
    let reload = |provider: &str, n: usize| -> Result<()> {
        let tmp = m.cfg_path.with_extension("tmp");
        std::fs::write(
            &tmp,
            format!("{}{EXT_AUTHZ_PROVIDERS}{}", m.base, custom_policy(provider)),
        )?;
        std::fs::rename(&tmp, &m.cfg_path)?;
        reloads(n)
    };

    // gRPC provider: the CheckRequest names both peers; answers set and remove headers.
    reload("grpc-authz", 1)?;
    let r = c
        .request("POST", "/private/g", &[("x-ext-authz", "allow")])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert_eq!(r.echoed("x-user"), ["grpc-alice"]);
    assert!(
        r.echoed("x-ext-authz").is_empty(),
        "headers_to_remove is applied"
    );
    assert_eq!(
        r.headers.get("x-grpc-said").map(|v| v.as_bytes()),
        Some(&b"ok"[..])
    );
    {
        let seen = grpc_checks.lock().unwrap();
        let check = seen.last().context("checked")?;
        assert_eq!(
            (check.method.as_str(), check.path.as_str()),
            ("POST", "/private/g")
        );
        assert_eq!(
            check.source_principal,
            "spiffe://cluster.local/ns/default/sa/client"
        );
        assert_eq!(
            check.destination_principal,
            "spiffe://cluster.local/ns/default/sa/waypoint"
        );
        assert_eq!(
            check.headers.get(":authority").map(String::as_str),
            Some("echo.default.svc.cluster.local")
        );
    }
    let r = c
        .request("GET", "/private", &[("x-ext-authz", "deny")])
        .await?;
    assert_eq!(
        (r.status.as_u16(), r.body.as_str()),
        (429, "the gRPC authorizer says no"),
        "{r:?}"
    );
    assert_eq!(
        r.headers.get("x-reason").map(|v| v.as_bytes()),
        Some(&b"grpc-nope"[..])
    );
    assert_eq!(
        c.request("GET", "/private", &[("x-ext-authz", "unauth")])
            .await?
            .status,
        401
    );
    assert_eq!(c.request("GET", "/public", &[]).await?.status, 200);

    // Nobody listens on 8001: statusOnError, or an allow when the provider fails open.
    reload("down", 2)?;
    let r = c
        .request("GET", "/private", &[("x-ext-authz", "allow")])
        .await?;
    assert_eq!(r.status, 503, "{r:?}\n{}", m.log());
    reload("down-open", 3)?;
    let r = c
        .request("GET", "/private", &[("x-ext-authz", "allow")])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());

    // Not an authorizer, or not there: what the policy matches is denied, the rest passes.
    for (provider, n) in [("zipkin", 4), ("missing", 5)] {
        reload(provider, n)?;
        assert_eq!(
            c.request("GET", "/private", &[("x-ext-authz", "allow")])
                .await?
                .status,
            403,
            "{provider}"
        );
        assert_eq!(
            c.request("GET", "/public", &[]).await?.status,
            200,
            "{provider}"
        );
    }
    // A bad provider in the file is refused with the field named; the last config stays.
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(
        &tmp,
        format!(
            "{}{}{}",
            m.base,
            EXT_AUTHZ_PROVIDERS.replace("port: 9100", "port: 0"),
            custom_policy("http-authz")
        ),
    )?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    m.waypoint
        .wait_log("config change rejected", Duration::from_secs(5))?;
    assert!(
        m.log()
            .contains("meshConfig.extensionProviders[1].envoyExtAuthzGrpc.port"),
        "{}",
        m.log()
    );
    Ok(())
}

/// TCPRoute: connections to the echo service's port 9000 are relayed at L4 without
/// looking for HTTP, each to a backend picked by weight (echo-v1 or echo-v2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_tcp_routes_split_connections_by_weight() -> Result<()> {
    let l7 = "tcpRoutes:\n- {name: echo-tcp, namespace: default, parentRefs: [{group: \"\", kind: Service, name: echo, port: 9000}], \
              rules: [{backendRefs: [{name: echo-v1, port: 9000, weight: 1}, {name: echo-v2, port: 9000, weight: 1}]}]}\n";
    let m = L7Mesh::start("l7p", l7, &[]).await?;
    let (mut v1, mut v2) = (0, 0);
    for i in 0..40 {
        let mut s = m
            .client()
            .connect(format!("{ECHO_VIP}:9000").parse()?)
            .await?;
        // HTTP bytes are not served as HTTP: they come back as the echo server sent them.
        let req = format!("GET /{i} HTTP/1.1\r\nhost: echo\r\n\r\n");
        let out = String::from_utf8(echo_roundtrip(&mut s, req.as_bytes()).await?)?;
        let (pod, rest) = out
            .split_once('\n')
            .with_context(|| format!("{out:?}\n{}", m.log()))?;
        assert_eq!(rest, req, "connection {i}");
        match pod {
            "n1p3" => v2 += 1,
            "n2p1" | "n2p2" => v1 += 1,
            other => anyhow::bail!("connection {i} reached {other}"),
        }
    }
    assert!(
        v1 > 0 && v2 > 0,
        "1:1 weights over 40 connections gave v1 {v1}, v2 {v2}"
    );
    // Port 80 is untouched: HTTP as before.
    assert_eq!(m.h1().await?.get("/x").await?.status, 200);
    Ok(())
}

/// DestinationRule on the echo service: a consistent hash on a header keeps each user
/// on one endpoint; http2MaxRequests 1 answers a second concurrent request 503 (UO).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_destination_rules_hash_and_break_circuits() -> Result<()> {
    let l7 = "destinationRules:\n- {name: echo, namespace: default, host: echo, trafficPolicy: {loadBalancer: {consistentHash: {httpHeaderName: x-user}}, \
              connectionPool: {http: {http2MaxRequests: 1}}}}\n";
    let m = L7Mesh::start("l7d", l7, &[]).await?;
    let mut c = m.h1().await?;
    let mut by_user = HashMap::new();
    for i in 0..60 {
        let user = format!("user-{}", i % 6);
        let r = c
            .request("GET", "/hash", &[("x-user", user.as_str())])
            .await?;
        assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
        let pod = by_user.entry(user.clone()).or_insert_with(|| r.pod());
        assert_eq!(*pod, r.pod(), "{user} moved");
    }
    let pods: std::collections::HashSet<_> = by_user.values().collect();
    assert!(pods.len() >= 2, "six users all on {pods:?}");
    // One slow request in flight: the next one overflows, and passes once it is done.
    let mut slow = m.h1().await?;
    let in_flight = tokio::spawn(async move { slow.get("/delay/1500").await });
    let mut overflowed = false;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = c.get("/x").await?;
        if r.status == 503 {
            assert!(r.body.contains("overflow"), "{r:?}");
            overflowed = true;
            break;
        }
    }
    assert!(
        overflowed,
        "no request overflowed while one was in flight\n{}",
        m.log()
    );
    assert_eq!(in_flight.await??.status, 200);
    assert_eq!(c.get("/x").await?.status, 200);
    wait_for("UO log", Duration::from_secs(5), || {
        m.log().contains("response_flags=\"UO\"")
    })?;
    Ok(())
}

/// An Istio VirtualService on the echo service: a header route to v2, fault injection
/// (an abort and a delay, both for every matching request), the rest weighted to v1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_virtual_services_route_and_inject_faults() -> Result<()> {
    let l7 = r#"virtualServices:
- name: echo
  namespace: default
  hosts: [echo.default.svc.cluster.local]
  http:
  - match: [{headers: {x-version: {exact: v2}}}]
    route: [{destination: {host: echo-v2, port: {number: 80}}}]
  - match: [{uri: {prefix: /abort}}]
    fault: {abort: {httpStatus: 429, percentage: {value: 100}}}
    route: [{destination: {host: echo-v1}}]
  - match: [{uri: {prefix: /slow}}]
    fault: {delay: {fixedDelay: 200ms, percentage: {value: 100}}}
    route: [{destination: {host: echo-v1}}]
  - route: [{destination: {host: echo-v1}, weight: 100}]
    headers: {request: {set: {x-vs: applied}}}
"#;
    let m = L7Mesh::start("l7v", l7, &[]).await?;
    let mut c = m.h1().await?;
    let r = c.get("/x").await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    assert!(["n2p1", "n2p2"].contains(&r.pod().as_str()), "{r:?}");
    assert_eq!(r.echoed("x-vs"), ["applied"]);
    assert_eq!(
        c.request("GET", "/x", &[("x-version", "v2")]).await?.pod(),
        "n1p3"
    );
    let r = c.get("/abort/now").await?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (429, "fault filter abort"),
        "{r:?}"
    );
    let r = c.get("/slow").await?;
    assert_eq!(r.status, 200, "{r:?}");
    wait_for("fault logs", Duration::from_secs(5), || {
        let log = m.log();
        log.contains("response_flags=\"FI\"") && log.contains("response_flags=\"DI\"")
    })?;
    Ok(())
}

/// A Service whose endpoint is outside the mesh (protocol TCP: a server on node 2, as a
/// ServiceEntry's endpoint would be) behind the waypoint: the waypoint sends to it in
/// plain HTTP and, for non-HTTP bytes, plain TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_endpoints_outside_the_mesh_are_reached_in_plaintext() -> Result<()> {
    let wp_ip = "10.10.1.12";
    let workloads = "- {uid: ext, name: ext, namespace: default, workloadIps: [10.0.0.2], protocol: TCP, \
                     services: {default/external.default.svc.cluster.local: {80: 8090, 9000: 9090}}}\n";
    let services = format!(
        "- {{name: external, namespace: default, hostname: external.default.svc.cluster.local, vips: [\"/10.96.0.40\"], \
         ports: {{80: 8090, 9000: 9090}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n"
    );
    let m = L7Mesh::start_with("l7e", "", &[], workloads, &services).await?;
    assert_eq!(
        m.mesh.topo.pod("n1p2").ip.to_string(),
        wp_ip,
        "the test names the waypoint's address"
    );
    let node2 = m.mesh.topo.node(2);
    let app = http_app::HttpApp::start(node2, 8090, "ext", false)?;
    let _tcp = EchoServer::start(node2, 9090, Some("ext"))?;
    let mut c = http_app::H1Client::connect(
        m.client(),
        "10.96.0.40:80".parse()?,
        "external.default.svc.cluster.local",
    )
    .await?;
    let r = c.get("/plain").await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "ext"),
        "{r:?}\n{}",
        m.log()
    );
    // Plain HTTP from the waypoint: no HBONE, and the waypoint's own headers on it.
    let seen = app.seen();
    let last = seen.last().context("the server got the request")?;
    assert!(
        last.headers.contains_key("x-forwarded-client-cert"),
        "{last:?}"
    );
    // Non-HTTP bytes: a plain TCP relay.
    let mut s = m.client().connect("10.96.0.40:9000".parse()?).await?;
    let out = echo_roundtrip(&mut s, b"not http").await?;
    assert_eq!(out, b"ext\nnot http", "{}", m.log());
    Ok(())
}

/// HTTPRoute sessionPersistence: the first request of a session gets a cookie (or
/// header) naming its endpoint; the next ones with it stay on that endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_session_persistence_keeps_a_session_on_its_endpoint() -> Result<()> {
    let l7 = r#"httpRoutes:
- name: sticky
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /cookie}}]
    backendRefs: [{name: echo-v1, port: 80}]
    sessionPersistence: {sessionName: session, type: Cookie}
  - matches: [{path: {type: PathPrefix, value: /header}}]
    backendRefs: [{name: echo-v1, port: 80}]
    sessionPersistence: {sessionName: x-session, type: Header}
"#;
    let m = L7Mesh::start("l7s", l7, &[("WAYPOINT_LB_POLICY", "round-robin")]).await?;
    let mut c = m.h1().await?;
    let r = c.get("/cookie").await?;
    let set = r
        .headers
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .with_context(|| format!("{r:?}\n{}", m.log()))?
        .to_string();
    let cookie = set.split(';').next().context("cookie")?.to_string();
    assert!(
        cookie.starts_with("session=") && set.contains("HttpOnly"),
        "{set}"
    );
    let first = r.pod();
    for _ in 0..10 {
        let r = c
            .request("GET", "/cookie", &[("cookie", cookie.as_str())])
            .await?;
        assert_eq!(r.pod(), first, "a session stays on its endpoint");
        assert!(
            r.headers.get("set-cookie").is_none(),
            "the session is kept: no new cookie"
        );
    }
    // Without the cookie round robin spreads the requests.
    let mut spread = std::collections::HashSet::new();
    for _ in 0..6 {
        spread.insert(c.get("/cookie").await?.pod());
    }
    assert_eq!(spread.len(), 2, "{spread:?}");
    // Header sessions: the response names the endpoint in the header, echoed back.
    let r = c.get("/header").await?;
    let id = r
        .headers
        .get("x-session")
        .and_then(|v| v.to_str().ok())
        .context("x-session header")?
        .to_string();
    let first = r.pod();
    for _ in 0..6 {
        assert_eq!(
            c.request("GET", "/header", &[("x-session", id.as_str())])
                .await?
                .pod(),
            first
        );
    }
    // A session naming an endpoint that is not the backend's is not followed.
    let bogus = c
        .request("GET", "/header", &[("x-session", "MTAuOTkuOTkuOTk6ODA")])
        .await?;
    assert_eq!(bogus.status, 200);
    assert!(
        bogus.headers.get("x-session").is_some(),
        "a new session replaces a bogus one"
    );
    Ok(())
}

/// Tracing: the waypoint exports a span per request (OTLP/gRPC to the mesh config's
/// opentelemetry provider, a tonic collector here), joins the client's W3C trace, and
/// passes it on to the backend as the span's child.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_requests_are_traced_to_an_otlp_collector() -> Result<()> {
    let l7 = r#"meshConfig:
  defaultProviders: {tracing: [otel]}
  defaultConfig: {tracing: {sampling: 100}}
  extensionProviders:
  - name: otel
    opentelemetry: {service: authz.default.svc.cluster.local, port: 9100}
"#;
    let m = L7Mesh::start("l7q", l7, &[]).await?;
    let spans = test_servers::Spans::default();
    let _collector =
        test_servers::start_otlp_collector(m.mesh.topo.pod("n2p1"), 9100, spans.clone())?;
    let mut c = m.h1().await?;
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let r = c
        .request("GET", "/traced", &[("traceparent", parent)])
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    let upstream = r.echoed("traceparent");
    let [tp] = upstream.as_slice() else {
        anyhow::bail!("the backend got no traceparent: {r:?}")
    };
    assert!(
        tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-") && !tp.contains("b7ad6b7169203331"),
        "{tp}"
    );
    let waypoint_span = tp.split('-').nth(2).context("span id")?.to_string();
    let _ = c.get("/untraced-client").await?;
    wait_for("spans exported", Duration::from_secs(10), || {
        spans.lock().unwrap().len() >= 2
    })?;
    let seen = spans.lock().unwrap().clone();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let joined = seen
        .iter()
        .find(|s| hex(&s.0) == "0af7651916cd43dd8448eb211c80319c")
        .with_context(|| format!("{seen:?}"))?;
    assert_eq!(
        (hex(&joined.1), hex(&joined.2)),
        (waypoint_span, "b7ad6b7169203331".to_string()),
        "the span is the client's child and the backend's parent"
    );
    assert_eq!(joined.3, "echo.default.svc.cluster.local:80/*");
    assert!(
        seen.iter()
            .any(|s| hex(&s.0) != "0af7651916cd43dd8448eb211c80319c" && s.2.is_empty()),
        "a request without a trace starts one: {seen:?}"
    );
    Ok(())
}

/// A response as curl printed it with `-i`: status, headers (names lowercase), body.
struct CurlReply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl CurlReply {
    fn parse(out: &str) -> Result<CurlReply> {
        let (head, body) = out
            .split_once("\r\n\r\n")
            .with_context(|| format!("no header end in {out:?}"))?;
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("no status in {out:?}"))?;
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok(CurlReply {
            status,
            headers,
            body: body.to_string(),
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The HTTPRoute CORS filter with curl as the browser: a preflight from an allowed
/// origin is answered by the waypoint (over HTTP/1.1 and HTTP/2, never reaching a
/// backend), one from another origin gets no Access-Control-Allow-Origin, and actual
/// requests from allowed origins get the allow and expose headers on the backend's
/// response; a rule without the filter is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_cors_preflights_and_actual_requests_with_curl() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v curl"]).is_ok(),
        "curl is needed (scripts/deps.sh installs it)"
    );
    let l7 = r#"
httpRoutes:
- name: echo
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /api}}]
    filters:
    - type: CORS
      cors:
        allowOrigins: ["https://app.example.com", "https://*.example.org"]
        allowCredentials: true
        allowMethods: [GET, PUT]
        allowHeaders: [x-token, content-type]
        exposeHeaders: [x-pod]
        maxAge: 600
    backendRefs: [{name: echo-v1, port: 80}]
  - backendRefs: [{name: echo-v1, port: 80}]
"#;
    let m = L7Mesh::start("l7o", l7, &[]).await?;
    let curl = |args: &[&str]| -> Result<CurlReply> {
        let mut all = vec!["-sS", "-i", "--max-time", "10"];
        all.extend_from_slice(args);
        let out = m.client().exec("curl", &all).with_context(|| m.log())?;
        CurlReply::parse(&out)
    };
    let url = format!("http://{ECHO_VIP}/api/items");
    let preflight = |origin: &str, version: &'static str| {
        let origin = format!("Origin: {origin}");
        curl(&[
            version,
            "-X",
            "OPTIONS",
            "-H",
            &origin,
            "-H",
            "Access-Control-Request-Method: PUT",
            "-H",
            "Access-Control-Request-Headers: x-token",
            &url,
        ])
    };

    for version in ["--http1.1", "--http2-prior-knowledge"] {
        let r = preflight("https://app.example.com", version)?;
        assert_eq!(r.status, 200, "{version}: {:?}", r.headers);
        assert_eq!(
            r.header("access-control-allow-origin"),
            Some("https://app.example.com"),
            "{version}"
        );
        assert_eq!(r.header("access-control-allow-methods"), Some("GET,PUT"));
        assert_eq!(
            r.header("access-control-allow-headers"),
            Some("x-token,content-type")
        );
        assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
        assert_eq!(r.header("access-control-max-age"), Some("600"));
        assert_eq!(
            (r.header("x-pod"), r.body.as_str()),
            (None, ""),
            "{version}: answered by the waypoint"
        );
    }
    let r = preflight("https://shop.eu.example.org", "--http1.1")?;
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://shop.eu.example.org"),
        "wildcard origin"
    );
    // Another origin's preflight: 200 from the waypoint, no allow-origin (the browser fails it).
    let r = preflight("https://evil.example.com", "--http1.1")?;
    assert_eq!(
        (
            r.status,
            r.header("access-control-allow-origin"),
            r.header("x-pod")
        ),
        (200, None, None),
        "{:?}",
        r.headers
    );
    let apps = || m.apps.values().flat_map(|a| a.seen()).collect::<Vec<_>>();
    assert!(
        apps().iter().all(|s| s.method != "OPTIONS"),
        "a preflight reached a backend"
    );

    // Actual requests: the backend answers, the waypoint adds the CORS headers.
    let r = curl(&[
        "-X",
        "PUT",
        "-H",
        "Origin: https://app.example.com",
        "-H",
        "x-token: t",
        &url,
    ])?;
    assert_eq!(
        (r.status, r.header("x-pod").is_some()),
        (200, true),
        "{}",
        r.body
    );
    assert!(
        r.body.contains("method=PUT") && r.body.contains("origin: https://app.example.com"),
        "{}",
        r.body
    );
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example.com")
    );
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    assert_eq!(r.header("access-control-expose-headers"), Some("x-pod"));
    assert_eq!(
        r.header("access-control-allow-methods"),
        None,
        "preflight headers only on preflights"
    );
    let r = curl(&["-H", "Origin: https://evil.example.com", &url])?;
    assert_eq!(
        (
            r.status,
            r.header("access-control-allow-origin"),
            r.header("access-control-allow-credentials")
        ),
        (200, None, None)
    );
    // A rule without the filter: an OPTIONS preflight goes to the backend, no CORS headers.
    let other = format!("http://{ECHO_VIP}/other");
    let r = curl(&[
        "-X",
        "OPTIONS",
        "-H",
        "Origin: https://app.example.com",
        "-H",
        "Access-Control-Request-Method: PUT",
        &other,
    ])?;
    assert_eq!(
        (r.status, r.header("access-control-allow-origin")),
        (200, None)
    );
    assert!(r.body.contains("method=OPTIONS"), "{}", r.body);
    assert_eq!(apps().iter().filter(|s| s.method == "OPTIONS").count(), 1);
    Ok(())
}

/// A test PKI in a directory of its own (removed on drop): `ca.pem`, a server
/// certificate `server.pem` / `server-key.pem` for `names`, and a client certificate
/// `client.pem` / `client-key.pem` (CN `waypoint-egress`), all from that CA.
struct TestPki {
    dir: std::path::PathBuf,
}

impl TestPki {
    fn new(tag: &str, names: &[&str]) -> Result<TestPki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let dir = std::env::temp_dir().join(format!("wp-pki-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let pki = TestPki { dir };
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "egress test CA");
        let ca_cert = ca.self_signed(&ca_key)?;
        std::fs::write(pki.dir.join("ca.pem"), ca_cert.pem())?;
        let issuer = Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key)?;
        for (file, cn, sans) in [
            (
                "server",
                "server",
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            ),
            ("client", "waypoint-egress", vec![]),
        ] {
            let key = KeyPair::generate()?;
            let mut p = CertificateParams::new(sans)?;
            p.distinguished_name.push(DnType::CommonName, cn);
            let cert = p.signed_by(&key, &issuer)?;
            std::fs::write(pki.dir.join(format!("{file}.pem")), cert.pem())?;
            std::fs::write(pki.dir.join(format!("{file}-key.pem")), key.serialize_pem())?;
        }
        Ok(pki)
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Issue 21 items 5 and 8: an egress waypoint originating TLS to hosts outside the mesh
/// (ServiceEntry-like Services with static addresses on node 2, which is not in the
/// mesh), as DestinationRule `tls` asks: SIMPLE (the request's host as SNI and as the
/// name checked, HTTP/1.1 and, on an HTTP/2 port, h2 by ALPN), MUTUAL (nginx requiring
/// the client certificate), a certificate that does not name the host (503, nothing
/// sent), SIMPLE to the MUTUAL server (nginx refuses it), and opaque TCP with `sni`
/// (`openssl s_server -rev`). The client is curl; every hop from the waypoint is TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_egress_originates_tls_simple_and_mutual() -> Result<()> {
    for tool in ["nginx", "curl", "openssl"] {
        anyhow::ensure!(
            sh("sh", &["-c", &format!("command -v {tool}")]).is_ok(),
            "{tool} is needed (scripts/deps.sh installs it)"
        );
    }
    let pki = TestPki::new(
        "egress",
        &[
            "api.example.com",
            "h2.example.com",
            "mtls.example.com",
            "tcp.example.com",
        ],
    )?;
    let wp_ip = "10.10.1.12";
    let workloads = "- {uid: ext, name: ext, namespace: default, workloadIps: [10.0.0.2], protocol: TCP, services: {\
                     default/api.example.com: {80: 8443}, default/h2.example.com: {80: 8445}, default/mtls.example.com: {80: 8444}, \
                     default/simple-to-mtls.example.com: {80: 8444}, default/wrong.example.com: {80: 8443}, default/tcp.example.com: {9000: 9443}}}\n";
    let svc = |name: &str, vip: &str, ports: &str, extra: &str| {
        format!("- {{name: {name}, namespace: default, hostname: {name}, vips: [\"/{vip}\"], ports: {{{ports}}}{extra}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n")
    };
    let services = [
        svc("api.example.com", "10.96.0.50", "80: 8443", ""),
        svc(
            "h2.example.com",
            "10.96.0.51",
            "80: 8445",
            ", appProtocols: {80: HTTP2}",
        ),
        svc("mtls.example.com", "10.96.0.52", "80: 8444", ""),
        svc("simple-to-mtls.example.com", "10.96.0.53", "80: 8444", ""),
        svc("wrong.example.com", "10.96.0.54", "80: 8443", ""),
        svc("tcp.example.com", "10.96.0.55", "9000: 9443", ""),
    ]
    .concat();
    let ca = pki.path("ca.pem");
    let simple = format!("{{mode: SIMPLE, caCertificates: {ca}}}");
    let mutual = format!(
        "{{mode: MUTUAL, caCertificates: {ca}, clientCertificate: {}, privateKey: {}}}",
        pki.path("client.pem"),
        pki.path("client-key.pem")
    );
    let l7 = format!(
        "destinationRules:\n\
         - {{name: api, namespace: default, host: api.example.com, trafficPolicy: {{portLevelSettings: [{{port: {{number: 80}}, tls: {simple}}}]}}}}\n\
         - {{name: h2, namespace: default, host: h2.example.com, trafficPolicy: {{tls: {simple}}}}}\n\
         - {{name: mtls, namespace: default, host: mtls.example.com, trafficPolicy: {{tls: {mutual}}}}}\n\
         - {{name: simple-to-mtls, namespace: default, host: simple-to-mtls.example.com, trafficPolicy: {{tls: {{mode: SIMPLE, caCertificates: {ca}, sni: mtls.example.com}}}}}}\n\
         - {{name: wrong, namespace: default, host: wrong.example.com, trafficPolicy: {{tls: {simple}}}}}\n\
         - {{name: tcp, namespace: default, host: tcp.example.com, trafficPolicy: {{tls: {{mode: SIMPLE, caCertificates: {ca}, sni: tcp.example.com, subjectAltNames: [tcp.example.com]}}}}}}\n"
    );
    let m = L7Mesh::start_with("l7xt", &l7, &[], workloads, &services).await?;
    let node2 = m.mesh.topo.node(2);
    let (cert, key) = (pki.path("server.pem"), pki.path("server-key.pem"));
    let answer = "return 200 \"proto=$server_protocol tls=$ssl_protocol sni=$ssl_server_name alpn=$ssl_alpn_protocol client=$ssl_client_s_dn\\n\";";
    let servers = format!(
        "ssl_certificate {cert}; ssl_certificate_key {key};
  server {{ listen 8443 ssl; ssl_protocols TLSv1.2; location / {{ {answer} }} }}
  server {{ listen 8445 ssl http2; ssl_protocols TLSv1.3; location / {{ {answer} }} }}
  server {{ listen 8444 ssl; ssl_protocols TLSv1.3; ssl_client_certificate {ca}; ssl_verify_client on; location / {{ {answer} }} }}"
    );
    let _nginx = start_nginx_in(
        node2,
        &m.mesh.topo.dir.join("nginx-egress"),
        &servers,
        &[8443, 8444, 8445],
    )?;
    let _s_server = node2.spawn(
        "openssl",
        &[
            "s_server", "-accept", "9443", "-cert", &cert, "-key", &key, "-rev", "-quiet",
        ],
        &[],
        &m.mesh.topo.dir.join("s_server.log"),
    )?;
    wait_for("s_server on 9443", Duration::from_secs(5), || {
        node2
            .run(|| std::net::TcpStream::connect(("127.0.0.1", 9443)).is_ok())
            .unwrap_or(false)
    })?;

    let curl = |host: &str, vip: &str| -> Result<CurlReply> {
        let out = m
            .client()
            .exec(
                "curl",
                &[
                    "-sS",
                    "-i",
                    "--max-time",
                    "10",
                    "-H",
                    &format!("host: {host}"),
                    &format!("http://{vip}/egress"),
                ],
            )
            .with_context(|| m.log())?;
        CurlReply::parse(&out)
    };
    // SIMPLE: plain HTTP from the client, TLS from the waypoint with the host as SNI
    // (this server speaks TLS 1.2 only, the others 1.3 only: both are Envoy's defaults).
    let r = curl("api.example.com", "10.96.0.50")?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert_eq!(
        r.body.trim(),
        "proto=HTTP/1.1 tls=TLSv1.2 sni=api.example.com alpn= client=",
        "{}",
        m.log()
    );
    // An HTTP/2 port: h2 negotiated by ALPN inside the TLS.
    let r = curl("h2.example.com", "10.96.0.51")?;
    assert_eq!(
        r.body.trim(),
        "proto=HTTP/2.0 tls=TLSv1.3 sni=h2.example.com alpn=h2 client=",
        "{}",
        m.log()
    );
    // MUTUAL: the server required and got the waypoint's client certificate.
    let r = curl("mtls.example.com", "10.96.0.52")?;
    assert_eq!(
        (r.status, r.body.trim()),
        (
            200,
            "proto=HTTP/1.1 tls=TLSv1.3 sni=mtls.example.com alpn= client=CN=waypoint-egress"
        ),
        "{}",
        m.log()
    );
    // SIMPLE to that server: no client certificate, nginx says so.
    let r = curl("simple-to-mtls.example.com", "10.96.0.53")?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("No required SSL certificate was sent"),
        "{}",
        r.body
    );
    // A certificate that does not name the host: nothing is sent, 503.
    let r = curl("wrong.example.com", "10.96.0.54")?;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.body.contains("TLS to 10.0.0.2:8443") && r.body.contains("NotValidForName"),
        "{}",
        r.body
    );
    wait_for("UF log", Duration::from_secs(5), || {
        m.log().contains("response_flags=\"UF\"")
    })?;
    // Opaque TCP: the client's bytes inside the waypoint's TLS, with the rule's sni.
    let mut s = m.client().connect("10.96.0.55:9000".parse()?).await?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"hello egress\n").await?;
    let mut buf = vec![0u8; 13];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf))
        .await
        .context("no answer")??;
    assert_eq!(buf, b"sserge olleh\n", "{}", m.log());
    drop(s);
    wait_for("L4 TLS log", Duration::from_secs(5), || {
        m.log().contains("tls=\"originated\"")
    })?;
    Ok(())
}

/// Issue 21 item 3: a ServiceEntry's endpoints known only by hostname, behind the
/// waypoint. The waypoint resolves them with the node proxy's on-demand resolver
/// through its own resolvers (here a DNS server on node 2, outside the mesh), every
/// address an endpoint, cached for the TTL; HTTP and opaque TCP reach the host; a name
/// that does not resolve gets 503 saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_hostname_endpoints_are_resolved_by_the_waypoint() -> Result<()> {
    let wp_ip = "10.10.1.12";
    let workloads = "- {uid: Kubernetes/networking.istio.io/ServiceEntry/default/api/api.external.test, name: api, namespace: default, \
                     hostname: api.external.test, protocol: TCP, services: {default/api.external.test: {80: 8090, 9000: 9090}}}\n\
                     - {uid: Kubernetes/networking.istio.io/ServiceEntry/default/gone/gone.external.test, name: gone, namespace: default, \
                     hostname: gone.external.test, protocol: TCP, services: {default/gone.external.test: {80: 8090}}}\n";
    let services = format!(
        "- {{name: api, namespace: default, hostname: api.external.test, vips: [\"/10.96.0.60\"], ports: {{80: 8090, 9000: 9090}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: gone, namespace: default, hostname: gone.external.test, vips: [\"/10.96.0.61\"], ports: {{80: 8090}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n"
    );
    let m = L7Mesh::start_with(
        "l7hn",
        "",
        &[("WAYPOINT_DNS_UPSTREAM", "10.0.0.2")],
        workloads,
        &services,
    )
    .await?;
    let node2 = m.mesh.topo.node(2);
    let dns = DnsResponder::start(node2, &[("api.external.test", &["10.0.0.2".parse()?])])?;
    let _app = http_app::HttpApp::start(node2, 8090, "external", false)?;
    let _tcp = EchoServer::start(node2, 9090, Some("external"))?;

    let mut c =
        http_app::H1Client::connect(m.client(), "10.96.0.60:80".parse()?, "api.external.test")
            .await?;
    for i in 0..3 {
        let r = c.get("/resolved").await?;
        assert_eq!(
            (r.status.as_u16(), r.pod().as_str()),
            (200, "external"),
            "request {i}: {r:?}\n{}",
            m.log()
        );
    }
    assert_eq!(
        dns.asked("api.external.test"),
        1,
        "resolved once, then from the cache"
    );
    wait_for("log", Duration::from_secs(5), || {
        m.log().contains("dst.addr=\"10.0.0.2:8090\"")
    })?;
    // Opaque TCP to the same host.
    let mut s = m.client().connect("10.96.0.60:9000".parse()?).await?;
    assert_eq!(
        echo_roundtrip(&mut s, b"not http").await?,
        b"external\nnot http",
        "{}",
        m.log()
    );
    // A name that does not resolve: 503, and why.
    let mut c =
        http_app::H1Client::connect(m.client(), "10.96.0.61:80".parse()?, "gone.external.test")
            .await?;
    let r = c.get("/").await?;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("endpoint gone.external.test: no address for gone.external.test (upstream answered Non-Existent Domain"), "{}", r.body);
    // Istio's on-demand DNS metric, with the waypoint as the source.
    let text = m.metrics().await?;
    let line = text
        .lines()
        .find(|l| {
            l.starts_with("istio_on_demand_dns_total{")
                && l.contains("hostname=\"api.external.test\"")
        })
        .with_context(|| text.clone())?;
    assert!(
        line.contains("source_workload=\"n1p2\"") && line.ends_with(" 4"),
        "{line}"
    );
    Ok(())
}

/// Issue 21 item 3: BackendRef filters (Gateway API `backendRefs[].filters`, the header
/// modifiers Istio supports there): each backend's request and response headers are its
/// own, the rule's apply to both; curl as the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_backend_ref_filters_modify_headers_per_backend() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v curl"]).is_ok(),
        "curl is needed (scripts/deps.sh installs it)"
    );
    let l7 = r#"
httpRoutes:
- name: echo
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-rule, value: applied}]}}]
    backendRefs:
    - name: echo-v1
      port: 80
      filters:
      - {type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-backend, value: v1}], remove: [x-secret]}}
      - {type: ResponseHeaderModifier, responseHeaderModifier: {add: [{name: x-served-by, value: v1}]}}
    - name: echo-v2
      port: 80
      filters:
      - {type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-backend, value: v2}]}}
"#;
    let m = L7Mesh::start("l7b", l7, &[]).await?;
    let (mut v1, mut v2) = (0, 0);
    for i in 0..30 {
        let out = m
            .client()
            .exec(
                "curl",
                &[
                    "-sS",
                    "-i",
                    "--max-time",
                    "10",
                    "-H",
                    "x-secret: s",
                    &format!("http://{ECHO_VIP}/b{i}"),
                ],
            )
            .with_context(|| m.log())?;
        let r = CurlReply::parse(&out)?;
        assert_eq!(r.status, 200, "{}", r.body);
        let echoed = |name: &str| {
            r.body
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                .map(str::to_string)
        };
        assert_eq!(echoed("x-rule").as_deref(), Some("applied"), "{}", r.body);
        match r.header("x-pod") {
            Some("n1p3") => {
                v2 += 1;
                assert_eq!(
                    (
                        echoed("x-backend").as_deref(),
                        echoed("x-secret").as_deref(),
                        r.header("x-served-by")
                    ),
                    (Some("v2"), Some("s"), None),
                    "{}",
                    r.body
                );
            }
            Some("n2p1" | "n2p2") => {
                v1 += 1;
                assert_eq!(
                    (
                        echoed("x-backend").as_deref(),
                        echoed("x-secret"),
                        r.header("x-served-by")
                    ),
                    (Some("v1"), None, Some("v1")),
                    "{}",
                    r.body
                );
            }
            other => anyhow::bail!("request {i} answered by {other:?}"),
        }
    }
    assert!(
        v1 > 0 && v2 > 0,
        "1:1 weights over 30 requests gave v1 {v1}, v2 {v2}"
    );
    Ok(())
}

/// Issue 21 item 5: DestinationRule subsets, picked by VirtualService destinations: the
/// echo pods' labels (version v1 on node 2, v2 on node 1) make the subsets; a subset's own
/// policy applies to it; a subset no rule defines is 503 NC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_virtual_service_subsets_select_pods_by_labels() -> Result<()> {
    let l7 = r#"destinationRules:
- name: echo
  namespace: default
  host: echo.default.svc.cluster.local
  subsets:
  - {name: v1, labels: {version: v1}, trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}}
  - {name: v2, labels: {version: v2}}
virtualServices:
- name: echo
  namespace: default
  hosts: [echo.default.svc.cluster.local]
  http:
  - match: [{headers: {x-version: {exact: v2}}}]
    route: [{destination: {host: echo, subset: v2}}]
  - match: [{uri: {prefix: /missing}}]
    route: [{destination: {host: echo, subset: v3}}]
  - route: [{destination: {host: echo, subset: v1}}]
"#;
    let m = L7Mesh::start("l7u", l7, &[]).await?;
    let mut c = m.h1().await?;
    let mut v1_pods = std::collections::HashSet::new();
    for i in 0..10 {
        let r = c.get("/x").await?;
        assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
        assert!(
            ["n2p1", "n2p2"].contains(&r.pod().as_str()),
            "request {i} went to {}",
            r.pod()
        );
        v1_pods.insert(r.pod());
        assert_eq!(
            c.request("GET", "/x", &[("x-version", "v2")]).await?.pod(),
            "n1p3"
        );
    }
    assert_eq!(
        v1_pods.len(),
        2,
        "the v1 subset's round robin uses both v1 pods"
    );
    let r = c.get("/missing").await?;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(
        r.body.contains("no DestinationRule defines subset \"v3\""),
        "{}",
        r.body
    );
    wait_for("NC log", Duration::from_secs(5), || {
        m.log().contains("response_flags=\"NC\"")
    })?;
    Ok(())
}

/// Issue 21 item 5: `tcp.maxConnections: 1` with `http1MaxPendingRequests: 1` on echo-v1
/// (HTTP/1.1 upstream): with h2load sending 6 slow requests at once over HTTP/1.1, one is
/// in flight, one waits for the connection and is served after it, the rest overflow
/// with 503 `UO` at once; nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_pending_requests_wait_in_a_bounded_queue() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v h2load"]).is_ok(),
        "h2load is needed (scripts/deps.sh installs it)"
    );
    let l7 = "destinationRules:\n- {name: v1, namespace: default, host: echo-v1, trafficPolicy: {connectionPool: {tcp: {maxConnections: 1}, http: {http1MaxPendingRequests: 1}}}}\n\
              httpRoutes:\n- {name: echo, namespace: default, parentRefs: [{group: '', kind: Service, name: echo, port: 80}], rules: [{backendRefs: [{name: echo-v1, port: 80}]}]}\n";
    let m = L7Mesh::start("l7w", l7, &[]).await?;
    let out = m
        .client()
        .exec(
            "h2load",
            &[
                "--h1",
                "-n",
                "6",
                "-c",
                "6",
                &format!("http://{ECHO_VIP}/delay/1000"),
            ],
        )
        .with_context(|| m.log())?;
    let codes = out
        .lines()
        .find(|l| l.starts_with("status codes:"))
        .with_context(|| out.clone())?
        .to_string();
    // "status codes: A 2xx, 0 3xx, 0 4xx, B 5xx"
    let count = |class: &str| {
        codes
            .split(',')
            .find(|c| c.trim().ends_with(class))
            .and_then(|c| c.split_whitespace().rev().nth(1))
            .and_then(|n| n.parse::<u32>().ok())
    };
    let (ok, overflowed) = (count("2xx").unwrap_or(0), count("5xx").unwrap_or(0));
    assert_eq!(ok + overflowed, 6, "every request answered: {codes}\n{out}");
    assert!(
        ok >= 2,
        "the one in flight and the one waiting are served: {codes}"
    );
    assert!(overflowed >= 1, "a full queue overflows: {codes}");
    wait_for("UO log", Duration::from_secs(5), || {
        m.log().contains("response_flags=\"UO\"")
    })?;
    Ok(())
}

/// Issue 21 item 5: the waypoint picks endpoints as ztunnel does for the Service's
/// load-balancing mode: FAILOVER by node sends everything to the echo endpoint on the
/// waypoint's own node (n1p3), the others only when it is gone; a PASSTHROUGH Service
/// goes to its original destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_service_load_balancing_modes_pick_the_endpoints() -> Result<()> {
    let wp_ip = "10.10.1.12";
    let services = format!(
        "- {{name: near, namespace: default, hostname: near.default.svc.cluster.local, vips: [\"/10.96.0.70\"], ports: {{80: 8080}}, \
         loadBalancer: {{mode: Failover, routingPreferences: [Node]}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: direct, namespace: default, hostname: direct.default.svc.cluster.local, vips: [\"/10.10.2.11\"], ports: {{8080: 8080}}, \
         loadBalancer: {{mode: Passthrough}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n"
    );
    // Every echo pod is an endpoint of `near`; n1p3 is on the waypoint's node.
    let l7 = "";
    let m = L7Mesh::start_with("l7m", l7, &[], "", &services).await?;
    let cfg = std::fs::read_to_string(&m.cfg_path)?;
    let cfg = cfg.replace("default/echo.default.svc.cluster.local: {80: 8080}", "default/echo.default.svc.cluster.local: {80: 8080}, default/near.default.svc.cluster.local: {80: 8080}");
    std::fs::write(&m.cfg_path, &cfg)?;
    wait_for("reload", Duration::from_secs(10), || {
        m.log().matches("config reloaded").count() >= 1
    })?;
    let mut c = http_app::H1Client::connect(
        m.client(),
        "10.96.0.70:80".parse()?,
        "near.default.svc.cluster.local",
    )
    .await?;
    for i in 0..10 {
        let r = c.get("/near").await?;
        assert_eq!(
            (r.status.as_u16(), r.pod().as_str()),
            (200, "n1p3"),
            "request {i}: {r:?}\n{}",
            m.log()
        );
    }
    // PASSTHROUGH: the original destination (the address the client dialed), n2p1 here.
    let mut c = http_app::H1Client::connect(
        m.client(),
        "10.10.2.11:8080".parse()?,
        "direct.default.svc.cluster.local",
    )
    .await?;
    let r = c.get("/direct").await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n2p1"),
        "{r:?}\n{}",
        m.log()
    );
    wait_for("log", Duration::from_secs(5), || {
        m.log()
            .contains("dst.service=\"direct.default.svc.cluster.local\"")
    })?;
    Ok(())
}

/// Issue 21 item 9: the Telemetry API in the waypoint. Mesh-wide (root namespace): the
/// access log only for errors (`response.code >= 400`) or a debug header, REQUEST_COUNT
/// without `source_principal`, REQUEST_DURATION dropped, every request traced (a mesh
/// sampling of 0 overridden). Then a Telemetry on the echo Service turns its access log
/// off (a reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_telemetry_filters_access_logs_and_overrides_metrics() -> Result<()> {
    let l7 = r#"meshConfig:
  defaultProviders: {tracing: [otel]}
  defaultConfig: {tracing: {sampling: 0}}
  extensionProviders:
  - name: otel
    opentelemetry: {service: authz.default.svc.cluster.local, port: 9100}
telemetries:
- name: mesh-default
  namespace: istio-system
  accessLogging:
  - providers: [{name: envoy}]
    filter: {expression: "response.code >= 400 || request.headers['x-debug'] == 'on'"}
  metrics:
  - providers: [{name: prometheus}]
    overrides:
    - match: {metric: REQUEST_COUNT, mode: CLIENT_AND_SERVER}
      tagOverrides: {source_principal: {operation: REMOVE}}
    - match: {metric: REQUEST_DURATION}
      disabled: true
  tracing:
  - randomSamplingPercentage: 100
"#;
    let m = L7Mesh::start("l7y", l7, &[]).await?;
    let spans = test_servers::Spans::default();
    let _collector =
        test_servers::start_otlp_collector(m.mesh.topo.pod("n2p1"), 9100, spans.clone())?;
    let mut c = m.h1().await?;
    assert_eq!(c.get("/quiet").await?.status, 200);
    assert_eq!(c.get("/status/404").await?.status, 404);
    assert_eq!(
        c.request("GET", "/debugged", &[("x-debug", "on")])
            .await?
            .status,
        200
    );
    wait_for("filtered log lines", Duration::from_secs(5), || {
        m.log().contains("path=/debugged")
    })?;
    let log = m.log();
    assert!(
        log.contains("path=/status/404") && !log.contains("path=/quiet"),
        "{log}"
    );
    // Metrics: the count without source_principal (exported empty), no duration series.
    let text = m.metrics().await?;
    let count = text
        .lines()
        .find(|l| l.starts_with("istio_requests_total{") && l.contains("response_code=\"404\""))
        .with_context(|| text.clone())?;
    assert!(
        count.contains("source_principal=\"\"") && count.contains("source_workload=\"n1p1\""),
        "{count}"
    );
    assert!(
        !text.contains("istio_request_duration_milliseconds_bucket{"),
        "REQUEST_DURATION is dropped"
    );
    let bytes = text
        .lines()
        .find(|l| l.starts_with("istio_request_bytes_count{"))
        .with_context(|| text.clone())?;
    assert!(
        bytes.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client\""),
        "other metrics keep it: {bytes}"
    );
    // Traced although the mesh samples 0%: the Telemetry's 100% wins.
    wait_for("spans", Duration::from_secs(10), || {
        spans.lock().unwrap().len() >= 3
    })?;

    // A Telemetry on the Service: its access log off, whatever the mesh says.
    let cfg = std::fs::read_to_string(&m.cfg_path)?;
    let off = "- name: echo-quiet\n  namespace: default\n  targetRefs: [{kind: Service, group: \"\", name: echo}]\n  accessLogging: [{providers: [{name: envoy}], disabled: true}]\n";
    std::fs::write(&m.cfg_path, format!("{cfg}{off}"))?;
    wait_for("reload", Duration::from_secs(10), || {
        m.log().matches("config reloaded").count() >= 1
    })?;
    assert_eq!(c.get("/status/500").await?.status, 500);
    assert_eq!(
        c.request("GET", "/debugged-again", &[("x-debug", "on")])
            .await?
            .status,
        200
    );
    // A line for a request after these would show up; none for them does.
    let mut later = m.h1().await?;
    std::fs::write(&m.cfg_path, &cfg)?;
    wait_for("second reload", Duration::from_secs(10), || {
        m.log().matches("config reloaded").count() >= 2
    })?;
    assert_eq!(later.get("/status/503").await?.status, 503);
    wait_for("the later line", Duration::from_secs(5), || {
        m.log().contains("path=/status/503")
    })?;
    let log = m.log();
    assert!(
        !log.contains("path=/status/500") && !log.contains("path=/debugged-again"),
        "{log}"
    );
    Ok(())
}

/// The trace id of the first `<span>{id=...` in lines that contain `needle`.
fn trace_ids(log: &str, span: &str, needle: &str) -> Vec<String> {
    // The span's fields, `span{a=1 id=... b=2}` (an id recorded after the span was made
    // comes last).
    let open = format!("{span}{{");
    log.lines()
        .filter(|l| l.contains(needle))
        .filter_map(|l| {
            let fields = l.split_once(open.as_str())?.1.split('}').next()?;
            let id = fields.split(' ').find_map(|f| f.strip_prefix("id="))?;
            Some(
                id.chars()
                    .take_while(char::is_ascii_hexdigit)
                    .collect::<String>(),
            )
        })
        .collect()
}

/// Issue 21 item 7: ztunnel joins the trace of the CONNECT, as Istio's does: each
/// outbound connection gets a traceparent, sent on its CONNECT, whose trace id names its
/// log lines (`outbound{id=...}`); the other end's stream takes the CONNECT's
/// (`stream{id=...}`). Through the waypoint the same trace goes on: at L4 the waypoint's
/// own CONNECT passes the tunnel's trace on. (An HTTP request's new upstream connection
/// joins the request's trace; pooled, it logs only when it closes, so it is not checked
/// here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_joins_the_trace_of_the_connect() -> Result<()> {
    let m = L7Mesh::start("l7zt", "", &[]).await?;
    let (node1, node2) = (&m.mesh.ztunnels[0], &m.mesh.ztunnels[1]);
    // Direct: n1p1 -> n2p1, no waypoint.
    let mut s = m.client().connect("10.10.2.11:9000".parse()?).await?;
    assert_eq!(echo_roundtrip(&mut s, b"direct").await?, b"n2p1\ndirect");
    wait_for("both ends logged", Duration::from_secs(5), || {
        !trace_ids(&node1.log_text(), "outbound", "dst.addr=10.10.2.11:15008").is_empty()
            && !trace_ids(&node2.log_text(), "stream", "connection complete").is_empty()
    })?;
    let out = trace_ids(&node1.log_text(), "outbound", "dst.addr=10.10.2.11:15008");
    let inb = trace_ids(&node2.log_text(), "stream", "connection complete");
    assert!(
        out[0].len() == 32 && inb.contains(&out[0]),
        "node1 {out:?}, node2 {inb:?}\n{}",
        m.mesh.logs()
    );

    // Opaque TCP through the waypoint: one trace from the client's ztunnel, through the
    // waypoint, to the backend's.
    let mut s = m
        .client()
        .connect(format!("{ECHO_VIP}:9000").parse()?)
        .await?;
    let out = echo_roundtrip(&mut s, b"not http").await?;
    let pod = String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    let wp_ip = m.mesh.topo.pod("n1p2").ip;
    wait_for(
        "the client's ztunnel logged it",
        Duration::from_secs(5),
        || {
            !trace_ids(
                &node1.log_text(),
                "outbound",
                &format!("dst.addr={wp_ip}:15008"),
            )
            .is_empty()
        },
    )?;
    let id = trace_ids(
        &node1.log_text(),
        "outbound",
        &format!("dst.addr={wp_ip}:15008"),
    )
    .pop()
    .context("id")?;
    wait_for("the waypoint joined it", Duration::from_secs(5), || {
        trace_ids(&m.log(), "stream", "connection complete").contains(&id)
    })?;
    let backend = if pod == "n1p3" { node1 } else { node2 };
    wait_for(
        "the backend's ztunnel joined it",
        Duration::from_secs(5),
        || trace_ids(&backend.log_text(), "stream", "").contains(&id),
    )?;
    Ok(())
}

/// Issue 21 item 2: ext_authz with the request body (`includeRequestBodyInCheck`, Envoy's
/// `with_request_body`), curl as the client. The HTTP authorizer gets the body (up to
/// `maxRequestBytes`) with `x-envoy-auth-partial-body: false`; a longer body is refused
/// with 413 and never checked. The gRPC authorizer, `allowPartialMessage` and
/// `packAsBytes`, gets the first `maxRequestBytes` in `raw_body`, marked partial. The
/// backend gets every byte either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_ext_authz_checks_the_request_body() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v curl"]).is_ok(),
        "curl is needed (scripts/deps.sh installs it)"
    );
    let providers = r#"
meshConfig:
  extensionProviders:
  - name: http-body
    envoyExtAuthzHttp:
      service: authz.default.svc.cluster.local
      port: 8000
      includeRequestHeadersInCheck: [x-ext-authz]
      includeRequestBodyInCheck: {maxRequestBytes: 16}
  - name: grpc-body
    envoyExtAuthzGrpc:
      service: authz.default.svc.cluster.local
      port: 9100
      includeRequestBodyInCheck: {maxRequestBytes: 8, allowPartialMessage: true, packAsBytes: true}
"#;
    let m = L7Mesh::start(
        "l7k",
        &format!("{providers}{}", custom_policy("http-body")),
        &[],
    )
    .await?;
    let (http_checks, grpc_checks) = (
        test_servers::Checks::default(),
        test_servers::Checks::default(),
    );
    let authz = m.mesh.topo.pod("n2p1");
    let _h = test_servers::start_http_authorizer(authz, 8000, http_checks.clone())?;
    let _g = test_servers::start_grpc_authorizer(authz, 9100, grpc_checks.clone())?;
    let post = |path: &str, body: &str| -> Result<CurlReply> {
        let url = format!("http://{ECHO_VIP}{path}");
        let out = m
            .client()
            .exec(
                "curl",
                &[
                    "-sS",
                    "-i",
                    "--max-time",
                    "10",
                    "-H",
                    "x-ext-authz: allow",
                    "-H",
                    "content-type: text/plain",
                    "--data-binary",
                    body,
                    &url,
                ],
            )
            .with_context(|| m.log())?;
        CurlReply::parse(&out)
    };
    let r = post("/private/upload", "hello authz")?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert!(
        r.body.contains("body_len=11"),
        "the backend got it all: {}",
        r.body
    );
    let seen = http_checks
        .lock()
        .unwrap()
        .last()
        .cloned()
        .context("checked")?;
    assert_eq!(
        (
            seen.body.as_slice(),
            seen.headers
                .get("x-envoy-auth-partial-body")
                .map(String::as_str)
        ),
        (&b"hello authz"[..], Some("false"))
    );
    // Longer than maxRequestBytes without allowPartialMessage: 413, no check.
    let before = http_checks.lock().unwrap().len();
    let r = post("/private/upload", "twenty bytes of body")?;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(http_checks.lock().unwrap().len(), before, "not checked");

    // The gRPC provider: partial, as bytes.
    let cfg = std::fs::read_to_string(&m.cfg_path)?.replace("name: http-body}", "name: grpc-body}");
    std::fs::write(&m.cfg_path, cfg)?;
    wait_for("reload", Duration::from_secs(10), || {
        m.log().contains("config reloaded")
    })?;
    let r = post("/private/upload", "0123456789abcdef")?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert!(
        r.body.contains("body_len=16"),
        "the backend got it all: {}",
        r.body
    );
    let seen = grpc_checks
        .lock()
        .unwrap()
        .last()
        .cloned()
        .context("checked over gRPC")?;
    assert_eq!(
        (
            seen.body.as_slice(),
            seen.headers
                .get("x-envoy-auth-partial-body")
                .map(String::as_str)
        ),
        (&b"01234567"[..], Some("true"))
    );
    Ok(())
}
