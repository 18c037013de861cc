//! The waypoint's stream idle timeout (STREAM_IDLE_TIMEOUT_SECONDS, Envoy's and Istio's
//! 5 min): a request whose backend says nothing for that long gets Envoy's local reply
//! `stream timeout` (504 SI: the request had all arrived), one that answers in time is
//! untouched, and the HTTP/2 connection that carried the stalled request goes on.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mesh_tests::http_app;
use mesh_tests::netsim::*;

use super::start_waypoint_with;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_no_activity_gets_stream_timeout() -> Result<()> {
    let topo = Topology::build(&prefix("wsidle"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/10.96.0.51\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "server", ", services: {default/web.default.svc.cluster.local: {80: 8080}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("mesh-node1.yaml");
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--stream-idle-timeout-seconds", "1"],
    )?;
    let _web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "web", false)?;
    let client = &t.pod("n1p1").netns;

    // One HTTP/2 connection (prior knowledge) for all of it.
    let c = http_app::H2Client::connect(
        client,
        "10.96.0.51:80".parse()?,
        "web.default.svc.cluster.local",
    )
    .await?;
    let get = |path: &'static str| {
        let c = c.clone();
        async move { c.request("GET", path, &[], bytes::Bytes::new()).await }
    };
    // Warm up (the waypoint has its config and the endpoint).
    let mut ok = false;
    for _ in 0..50 {
        if get("/").await.is_ok_and(|r| r.status == 200) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        ok,
        "the web app never answered through the waypoint\n{}",
        waypoint.log_text()
    );

    // The stalled request, and meanwhile others on the same connection.
    let start = Instant::now();
    let stalled = tokio::spawn(get("/delay/5000"));
    let mut others = 0;
    while !stalled.is_finished() && start.elapsed() < Duration::from_secs(10) {
        let r = get("/delay/200")
            .await
            .context("a request next to the stalled one")?;
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.body.contains("delayed=200"), "{r:?}");
        others += 1;
    }
    let took = start.elapsed();
    let r = stalled.await?.context("the stalled request")?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (504, "stream timeout"),
        "after {took:?}\n{}",
        waypoint.log_text()
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "the stream timeout came after {took:?}"
    );
    assert!(
        others >= 2,
        "only {others} requests went through next to the stalled one"
    );

    // The connection still serves.
    assert_eq!(get("/delay/200").await?.status, 200);
    let log = waypoint.log_text();
    assert!(
        log.contains("response_flags=\"SI\""),
        "no SI in the waypoint's access log\n{log}"
    );
    Ok(())
}
