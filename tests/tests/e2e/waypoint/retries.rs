//! Istio's default retries in the waypoint: with no retry policy on the route, a request
//! whose connection to an endpoint fails goes to another (2 more attempts, any method),
//! while a 5xx answer is never retried (no status codes are listed by default), and a
//! VirtualService with `retries.attempts: 0` turns them off.

use std::collections::HashMap;

use anyhow::{Context, Result};
use mesh_tests::http_app;
use mesh_tests::netsim::*;

use super::start_waypoint_with;

const VIP: &str = "10.96.0.60";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connection_is_retried_by_default_and_a_5xx_answer_is_not() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v h2load"]).is_ok(),
        "h2load is needed (scripts/deps.sh installs it)"
    );
    let topo = Topology::build(&prefix("wretry"), &[2, 2])?;
    let wp_ip = topo.pod("n1p2").ip;
    let web = ", services: {default/web.default.svc.cluster.local: {80: 8080}, default/web-once.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/{VIP}\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: web-once, namespace: default, hostname: web-once.default.svc.cluster.local, vips: [\"/10.96.0.61\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         virtualServices:\n\
         - name: web-once\n  namespace: default\n  hosts: [web-once.default.svc.cluster.local]\n\
         \x20 http: [{{route: [{{destination: {{host: web-once.default.svc.cluster.local}}}}], retries: {{attempts: 0}}}}]\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "web", web),
        // Its pod runs no server: every connection to it is refused.
        workload(&topo, "n2p2", "web", web),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    // Outlier detection off, so the dead endpoint stays in the pick for the whole run.
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--outlier-consecutive-5xx", "0"],
    )?;
    let _web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false)?;
    let client = &t.pod("n1p1").netns;

    // h2load, GET and POST: every request answered, about half of them after a retry.
    for method in [&[][..], &["-d", "/etc/hostname"][..]] {
        let mut args = vec!["-n", "200", "-c", "4", "-m", "4"];
        args.extend_from_slice(method);
        let url = format!("http://{VIP}/");
        args.push(&url);
        let out = client.exec("h2load", &args)?;
        let line = out
            .lines()
            .find(|l| l.starts_with("requests:"))
            .context("no h2load summary")?
            .to_string();
        assert!(
            line.contains("200 succeeded, 0 failed"),
            "{method:?}: {line}\n{out}\n{}",
            waypoint.log_text()
        );
        let codes = out
            .lines()
            .find(|l| l.starts_with("status codes:"))
            .unwrap_or_default()
            .to_string();
        assert!(
            codes.starts_with("status codes: 200 2xx"),
            "{method:?}: {codes}"
        );
    }
    let log = waypoint.log_text();
    assert!(log.contains("attempts=2"), "no request was retried: {log}");
    assert!(!log.contains("status=503"), "a request got a 503: {log}");

    // A 5xx answer is the backend's: not retried by default.
    let mut c = http_app::H1Client::connect(
        client,
        format!("{VIP}:80").parse()?,
        "web.default.svc.cluster.local",
    )
    .await?;
    let mut fives = 0;
    for _ in 0..20 {
        let r = c.get("/status/503").await?;
        if r.status == 503 {
            fives += 1;
        }
    }
    assert_eq!(fives, 20, "a 503 answer was retried into a success");

    // retries.attempts: 0 turns them off: some requests meet the dead endpoint and fail.
    let mut c = http_app::H1Client::connect(
        client,
        "10.96.0.61:80".parse()?,
        "web-once.default.svc.cluster.local",
    )
    .await?;
    let mut failed = 0;
    for _ in 0..40 {
        if c.get("/").await?.status == 503 {
            failed += 1;
        }
    }
    assert!(
        failed > 0,
        "with retries off, no request met the refusing endpoint in 40 (1 in 2^40 by chance)"
    );
    Ok(())
}
