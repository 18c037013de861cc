//! Idle timeouts in the waypoint (CONNECTION_IDLE_TIMEOUT_SECONDS, Istio's 1 h): an
//! opaque TCP tunnel and a keep-alive HTTP connection that go silent are closed, so a
//! client cannot hold them (and the upstream connections behind them) open for ever.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mesh_tests::http_app;
use mesh_tests::netsim::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::start_waypoint_with;

/// Reads until EOF or reset, up to `limit`; the time it took.
async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> Result<Duration> {
    let start = Instant::now();
    let mut buf = vec![0u8; 4096];
    loop {
        match tokio::time::timeout_at((start + limit).into(), s.read(&mut buf))
            .await
            .context("still open")?
        {
            Ok(0) | Err(_) => return Ok(start.elapsed()),
            Ok(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tunnels_and_connections_through_the_waypoint_are_closed() -> Result<()> {
    let topo = Topology::build(&prefix("widle"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: tcp, namespace: default, hostname: tcp.default.svc.cluster.local, vips: [\"/10.96.0.50\"], ports: {{80: 9000}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/10.96.0.51\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "server", ", services: {default/tcp.default.svc.cluster.local: {80: 9000}, default/web.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let _waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--idle-timeout-seconds", "1"],
    )?;
    let _echo = EchoServer::start(&t.pod("n2p1").netns, 9000, None)?;
    let _web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "web", false)?;
    let client = &t.pod("n1p1").netns;

    // Opaque TCP (not HTTP from its first bytes): echoed, then closed once silent.
    let mut s = client.connect("10.96.0.50:80".parse()?).await?;
    assert_eq!(
        echo_roundtrip_open(&mut s, b"hi there\n").await?,
        b"hi there\n"
    );
    let took = closed_within(&mut s, Duration::from_secs(15))
        .await
        .context("a silent TCP tunnel through the waypoint stayed open")?;
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}: before the idle timeout"
    );

    // A keep-alive HTTP/1.1 connection: answered, then closed once silent.
    let mut s = client.connect("10.96.0.51:80".parse()?).await?;
    s.write_all(b"GET / HTTP/1.1\r\nhost: web.default.svc.cluster.local\r\n\r\n")
        .await?;
    let mut head = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut head)).await??;
    assert_eq!(&head, b"HTTP/1.1 200");
    closed_within(&mut s, Duration::from_secs(15))
        .await
        .context("a silent HTTP connection through the waypoint stayed open")?;
    Ok(())
}

async fn echo_roundtrip_open(s: &mut tokio::net::TcpStream, data: &[u8]) -> Result<Vec<u8>> {
    s.write_all(data).await?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await??;
    Ok(back)
}
