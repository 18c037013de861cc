//! HTTP/1.0 through the waypoint, as Envoy's waypoint handles it: without
//! `accept_http_10` (istiod sets it only when its PILOT_HTTP10 is true or the proxy's
//! ISTIO_META_HTTP10 is "1") an HTTP/1.0 request is answered 426 `Upgrade Required`
//! before any route or policy, and the connection is closed; with it, it is served.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::http_app;
use mesh_tests::netsim::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::start_waypoint_with;

const VIP: &str = "10.96.0.52:80";

/// Sends `request` as it is and reads the reply until the waypoint closes the connection.
async fn raw(ns: &Netns, request: &str) -> Result<String> {
    let mut s = ns.connect(VIP.parse()?).await?;
    s.write_all(request.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .context("the waypoint kept the HTTP/1.0 connection open")??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_is_refused_with_426_unless_pilot_http10() -> Result<()> {
    let topo = Topology::build(&prefix("wphttp10"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/10.96.0.52\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "server", ", services: {default/web.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "web", false)?;
    let client = &t.pod("n1p1").netns;
    let ten = "GET /ten HTTP/1.0\r\nHost: web.default.svc.cluster.local\r\n\r\n";

    // The default: HTTP/1.1 is served, HTTP/1.0 refused.
    let waypoint = start_waypoint_with(t, "n1p2", &cfg_path, "waypoint.log", &[])?;
    let mut ok = false;
    for _ in 0..50 {
        let mut c =
            http_app::H1Client::connect(client, VIP.parse()?, "web.default.svc.cluster.local")
                .await?;
        if c.get("/eleven").await.is_ok_and(|r| r.status == 200) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ok, "HTTP/1.1 never served\n{}", waypoint.log_text());
    let reply = raw(client, ten).await?;
    let status_line = reply.lines().next().unwrap_or_default();
    assert!(
        status_line.starts_with("HTTP/1.") && status_line.contains(" 426 "),
        "HTTP/1.0 not refused with 426: {reply:?}"
    );
    assert!(reply.trim_end().ends_with("Upgrade Required"), "{reply:?}");
    // Its access-log line: 426 for that path.
    wait_for("the 426 in the access log", Duration::from_secs(5), || {
        waypoint
            .log_text()
            .lines()
            .any(|l| l.contains("status=426") && l.contains("path=/ten"))
    })
    .with_context(|| waypoint.log_text())?;
    assert!(
        web.seen().iter().all(|s| s.path != "/ten"),
        "the refused HTTP/1.0 request reached the app"
    );
    drop(waypoint);

    // PILOT_HTTP10: served, and the app sees it.
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint-http10.log",
        &["--http10", "true"],
    )?;
    let mut reply = String::new();
    for _ in 0..50 {
        reply = raw(client, ten).await.unwrap_or_default();
        if reply.starts_with("HTTP/1.") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status_line = reply.lines().next().unwrap_or_default();
    assert!(
        status_line.contains(" 200 "),
        "HTTP/1.0 not served with PILOT_HTTP10: {reply:?}\n{}",
        waypoint.log_text()
    );
    assert!(web.seen().iter().any(|s| s.path == "/ten"));
    Ok(())
}
