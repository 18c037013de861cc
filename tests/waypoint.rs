//! Waypoint end to end: client pod -> ztunnel (node1) -> waypoint pod -> ztunnel (node2)
//! -> server pod, all over HBONE with each hop's own identity.

mod netsim;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use netsim::*;

const WAYPOINT: &str = env!("CARGO_BIN_EXE_waypoint");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_traffic_goes_through_the_waypoint() -> Result<()> {
    let topo = Topology::build(&prefix("w"), &[2, 1])?;
    let (wp_ip, server_ip) = (topo.pod("n1p2").ip, topo.pod("n2p1").ip);
    let svc = ", services: {default/echo.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\", hboneMtlsPort: 15008}}}}\n\
         - {{name: lost, namespace: default, hostname: lost.default.svc.cluster.local, vips: [\"/10.96.0.11\"], ports: {{80: 8080}}, waypoint: {{destination: \"/10.10.9.9\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "echo", &svc.replace("{80: 8080}}", "{80: 8080}, default/lost.default.svc.cluster.local: {80: 8080}}")),
    );
    // The waypoint pod is not enrolled: it speaks HBONE itself.
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let wp_log = t.dir.join("waypoint.log");
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let state = t.dir.join("ca");
    let waypoint = t.pod("n1p2").netns.spawn(
        WAYPOINT,
        &["--local-xds-path", &cfg_path.display().to_string(), "--workload-uid", "n1p2", "--state-dir", &state.display().to_string()],
        &[("RUST_LOG", "info")],
        &wp_log,
    )?;
    waypoint.wait_log("waypoint ready", READY)?;
    let echo = EchoServer::start(&server.netns, 8080, None)?;

    // Through the service VIP: client -> waypoint -> server, bytes intact.
    let data = pattern(256 * 1024, 5);
    let mut s = client.netns.connect("10.96.0.10:80".parse()?).await?;
    assert_eq!(echo_roundtrip(&mut s, &data).await?, data);
    wait_for("waypoint log", Duration::from_secs(5), || waypoint.log_text().contains("connection complete"))?;
    let wl = waypoint.log_text();
    assert!(wl.contains("src.identity=spiffe://cluster.local/ns/default/sa/client"), "{wl}");
    assert!(wl.contains("dst.workload=n2p1") && wl.contains("bytes_sent=262144"), "{wl}");
    mesh.wait_logs(&[
        &format!("dst.hbone_addr={wp_ip}:15008"),
        "dst.identity=spiffe://cluster.local/ns/default/sa/waypoint",
        "src.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;
    // The server app still sees the waypoint's address as its peer (the waypoint is
    // the TCP client of the last hop), and the client's identity reached the waypoint.
    assert_eq!(echo.peers().last().map(|p| p.ip()), Some(std::net::IpAddr::from(wp_ip)));

    // Direct pod traffic has no waypoint in this config: it goes straight to node2.
    let before = waypoint.log_text().matches("connection complete").count();
    let mut s = client.netns.connect(SocketAddr::new(server_ip.into(), 8080)).await?;
    assert_eq!(echo_roundtrip(&mut s, b"direct").await?, b"direct");
    mesh.wait_logs(&["src.identity=spiffe://cluster.local/ns/default/sa/client"])?;
    assert_eq!(waypoint.log_text().matches("connection complete").count(), before);

    // A service whose waypoint is unknown fails instead of skipping the waypoint.
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = client.netns.connect("10.96.0.11:80".parse()?).await?;
        echo_roundtrip(&mut s, b"around?").await
    })
    .await?;
    assert!(r.map(|v| v.is_empty()).unwrap_or(true), "traffic went around an unknown waypoint");
    mesh.wait_logs(&["waypoint /10.10.9.9 (not a known workload)"])?;
    Ok(())
}
