//! Istio's default retries in the waypoint: with no retry policy on the route, a request
//! whose connection to an endpoint fails goes to another (2 more attempts, any method),
//! while a 5xx answer is never retried (no status codes are listed by default), and a
//! VirtualService with `retries.attempts: 0` turns them off.

use std::collections::HashMap;
use std::time::Duration;

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

/// h2load's summary lines: `requests: ...` and `status codes: ...`.
fn h2load_summary(out: &str) -> (String, String) {
    let line = |p: &str| {
        out.lines()
            .find(|l| l.starts_with(p))
            .unwrap_or_default()
            .to_string()
    };
    (line("requests:"), line("status codes:"))
}

/// Two backend pods (real `python3 -m http.server` processes) and no retry policy; one
/// is killed (SIGKILL) in the middle of an h2load run. Istio's default policy retries
/// every request whose connection to it then fails (connect-failure) on the other pod:
/// the only requests that can fail are those the killed pod had already accepted (its
/// connection reset under them: Envoy's `UC`, which Istio's default `retryOn` does not
/// list). The run after the kill gets no 503 at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_during_an_h2load_run_costs_only_its_requests_in_flight() -> Result<()> {
    anyhow::ensure!(
        sh("sh", &["-c", "command -v h2load && command -v python3"]).is_ok(),
        "h2load and python3 are needed (scripts/deps.sh installs them)"
    );
    let topo = Topology::build(&prefix("wkill"), &[2, 2])?;
    let wp_ip = topo.pod("n1p2").ip;
    let web = ", services: {default/web.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/{VIP}\"], ports: {{80: 8080}}, appProtocols: {{80: HTTP11}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "web", web),
        workload(&topo, "n2p2", "web", web),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    // Outlier detection off: the dead pod stays in the pick, every request may meet it.
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--outlier-consecutive-5xx", "0"],
    )?;
    let www = t.dir.join("www");
    std::fs::create_dir_all(&www)?;
    std::fs::write(www.join("index.html"), "hello\n")?;
    let www = www.display().to_string();
    let server = |pod: &str| {
        t.pod(pod).netns.spawn(
            "python3",
            &[
                "-m",
                "http.server",
                "8080",
                "--bind",
                "0.0.0.0",
                "--directory",
                &www,
            ],
            &[("PYTHONUNBUFFERED", "1")],
            &t.dir.join(format!("{pod}-http.log")),
        )
    };
    let mut doomed = server("n2p1")?;
    let alive = server("n2p2")?;
    let client = &t.pod("n1p1").netns;
    for s in [&doomed, &alive] {
        s.wait_log("Serving HTTP on", Duration::from_secs(20))?;
    }
    let url = format!("http://{VIP}/");
    let mut load = client.spawn(
        "h2load",
        &["-n", "3000", "-c", "4", "-m", "4", &url],
        &[],
        &t.dir.join("h2load-kill.log"),
    )?;
    // Kill once the doomed pod has served some of the run (its access log counts them).
    wait_for(
        "the doomed pod to serve 100 requests",
        Duration::from_secs(60),
        || doomed.log_text().matches("\"GET / ").count() >= 100,
    )?;
    let pid = doomed.pid().context("doomed pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    doomed
        .wait_exit(Duration::from_secs(10))
        .context("the pod did not die")?;
    load.wait_exit(Duration::from_secs(120))
        .context("h2load did not finish")?;
    let out = load.log_text();
    let (requests, codes) = h2load_summary(&out);
    assert!(requests.contains("3000 total"), "{out}");
    let log = waypoint.log_text();
    // Every failure is a request the killed pod had accepted (UC), never a failed
    // connection (those were retried).
    let failed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("request complete") && !l.contains("status=200"))
        .collect();
    assert!(
        failed.iter().all(|l| l.contains("response_flags=\"UC\"")),
        "a request failed otherwise than in flight on the killed pod:\n{}",
        failed.join("\n")
    );
    assert!(
        failed.len() <= 16,
        "more failures than requests in flight (4 connections x 4 streams): {codes}\n{}",
        failed.join("\n")
    );
    assert!(
        log.contains("attempts=2"),
        "no request was retried after the kill"
    );

    // After the kill: the whole run succeeds, half the requests retried off the dead pod.
    let out = client.exec("h2load", &["-n", "400", "-c", "4", "-m", "4", &url])?;
    let (requests, codes) = h2load_summary(&out);
    assert!(
        requests.contains("400 succeeded, 0 failed") && codes.starts_with("status codes: 400 2xx"),
        "{requests}\n{codes}\n{out}"
    );
    Ok(())
}

/// meshConfig.defaultHttpRetryPolicy is the policy of every route that sets none (and of
/// requests no route matches): here 5xx answers are retried on the other pod, while a
/// VirtualService with its own `retries.attempts: 0` keeps its 503s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_default_retry_policy_applies_where_routes_set_none() -> Result<()> {
    let topo = Topology::build(&prefix("wmret"), &[2, 2])?;
    let wp_ip = topo.pod("n1p2").ip;
    let web = ", services: {default/web.default.svc.cluster.local: {80: 8080}, default/web-once.default.svc.cluster.local: {80: 8080}}";
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/{VIP}\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: web-once, namespace: default, hostname: web-once.default.svc.cluster.local, vips: [\"/10.96.0.61\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         meshConfig:\n  defaultHttpRetryPolicy: {{attempts: 2, retryOn: 5xx, perTryTimeout: 5s}}\n\
         virtualServices:\n\
         - name: web-once\n  namespace: default\n  hosts: [web-once.default.svc.cluster.local]\n\
         \x20 http: [{{route: [{{destination: {{host: web-once.default.svc.cluster.local}}}}], retries: {{attempts: 0}}}}]\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "web", web),
        workload(&topo, "n2p2", "web", web),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--outlier-consecutive-5xx", "0"],
    )?;
    // n2p2 answers /flaky with 503, n2p1 with 200.
    let _ok = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false)?;
    let _flaky = http_app::HttpApp::start(&t.pod("n2p2").netns, 8080, "n2p2", true)?;
    let client = &t.pod("n1p1").netns;
    let mut c = http_app::H1Client::connect(
        client,
        format!("{VIP}:80").parse()?,
        "web.default.svc.cluster.local",
    )
    .await?;
    for _ in 0..30 {
        let r = c.get("/flaky").await?;
        assert_eq!(r.status, 200, "{r:?}\n{}", waypoint.log_text());
    }
    assert!(waypoint.log_text().contains("attempts=2"));
    let mut once = http_app::H1Client::connect(
        client,
        "10.96.0.61:80".parse()?,
        "web-once.default.svc.cluster.local",
    )
    .await?;
    let mut fives = 0;
    for _ in 0..40 {
        if once.get("/flaky").await?.status == 503 {
            fives += 1;
        }
    }
    assert!(
        fives > 0,
        "the route's own attempts: 0 was overridden by the mesh default (1 in 2^40 by chance)"
    );
    Ok(())
}
