//! Waypoint benchmark (not a timed test): HTTP/1.1 keep-alive request latency and proxy
//! CPU per request from a pod on node1 to a pod on node2, three ways in the same run,
//! rounds interleaved, medians and ratios reported:
//! - `direct`: no mesh (neither pod enrolled);
//! - `l4`: both pods enrolled, ztunnel to ztunnel over HBONE;
//! - `waypoint`: the same plus the waypoint hop (service with a waypoint, L7 routing and
//!   an AuthorizationPolicy evaluated per request);
//! - `ext_authz`: the same plus a CUSTOM policy: every request checked by a gRPC ext_authz
//!   server (tonic, in the server's pod: one more HBONE round trip per request; its own
//!   CPU is not counted).
//! CPU is the user+system time of the ztunnels and the waypoint over the measured
//! requests (from /proc), divided by the request count.
//!
//! The route and policy are the main suite's (`modes::L7`). `bench l7` gives the numbers
//! (docs/benchmarks.md); `bench l7 --quick` is the smoke pass CI runs
//! (bench/tests/smoke.rs).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mesh_tests::netsim::*;
use mesh_tests::{bins, http_app, test_servers};

use crate::modes::L7;

#[derive(Clone, Default)]
struct Sample {
    req_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us_per_req: f64,
}

/// Blocking HTTP/1.1 keep-alive client: `n` GETs, latency of each.
fn run_requests(pod: &Pod, to: SocketAddr, n: usize) -> Result<Vec<f64>> {
    pod.netns.run(move || -> Result<Vec<f64>> {
        let s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        let mut w = s.try_clone()?;
        let mut r = BufReader::new(s);
        let mut lat = Vec::with_capacity(n);
        let mut line = String::new();
        for _ in 0..n {
            let t = Instant::now();
            w.write_all(b"GET /bench HTTP/1.1\r\nhost: echo.default.svc.cluster.local\r\nuser-agent: bench\r\nx-ext-authz: allow\r\n\r\n")?;
            let mut len = 0usize;
            line.clear();
            r.read_line(&mut line)?;
            if !line.starts_with("HTTP/1.1 200") {
                bail!("unexpected response {line:?}");
            }
            loop {
                line.clear();
                r.read_line(&mut line)?;
                if line == "\r\n" || line.is_empty() {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse()?;
                }
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).context("response body")?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(lat)
    })?
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `ext_authz` mode's provider and CUSTOM policy (the L7 config above besides).
const EXT_AUTHZ: &str = r#"- name: check-all
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: CUSTOM
  provider: {name: authz}
  rules: [{to: [{operation: {paths: ["/bench*"]}}]}]
meshConfig:
  extensionProviders:
  - name: authz
    envoyExtAuthzGrpc: {service: authz.default.svc.cluster.local, port: 9100}
"#;

/// Every path, `rounds` interleaved rounds of `requests` each (defaults: 5 x 5000, or
/// 1 x 50 when `quick`).
pub fn main(quick: bool, requests: Option<usize>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let _guard = rt.enter();
    let (rounds, default_requests) = if quick { (1, 50) } else { (5, 5000) };
    let requests = requests.unwrap_or(default_requests);
    let modes = ["direct", "l4", "waypoint", "ext_authz"];
    let mut results: HashMap<&str, Vec<Sample>> = HashMap::new();
    for round in 0..rounds {
        for mode in modes {
            let topo = Topology::build(&prefix(&format!("wb{round}{}", &mode[..1])), &[2, 1])?;
            let wp_ip = topo.pod("n1p2").ip;
            let via_waypoint = mode == "waypoint" || mode == "ext_authz";
            let waypoint_ref = if via_waypoint { format!(", waypoint: {{destination: \"/{wp_ip}\"}}") } else { String::new() };
            let ext = if mode == "ext_authz" { EXT_AUTHZ } else { "" };
            let cfg = format!(
                "workloads:\n{}{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}{waypoint_ref}}}\n\
                 - {{name: authz, namespace: default, hostname: authz.default.svc.cluster.local, vips: [\"/10.96.0.30\"], ports: {{9100: 9100}}}}\n{L7}{ext}",
                workload(&topo, "n1p1", "client", ""),
                workload(&topo, "n1p2", "waypoint", ""),
                workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/authz.default.svc.cluster.local: {9100: 9100}}"),
            );
            let enrolled: &[&str] = if mode == "direct" { &[] } else { &["n1p1", "n2p1"] };
            let mesh = if mode == "direct" {
                Mesh { ztunnels: vec![], commands: vec![], topo }
            } else {
                Mesh::start(topo, &cfg, enrolled, &HashMap::new(), &[])?
            };
            let t = &mesh.topo;
            let waypoint = if via_waypoint {
                let cfg_path = t.dir.join("waypoint.yaml");
                std::fs::write(&cfg_path, &cfg)?;
                let state = t.dir.join("ca");
                let w = t.pod("n1p2").netns.spawn(
                    bins::waypoint(),
                    &["--local-xds-path", &cfg_path.display().to_string(), "--workload-uid", "n1p2", "--state-dir", &state.display().to_string()],
                    &[("RUST_LOG", "warn")],
                    &t.dir.join("waypoint.log"),
                )?;
                wait_for("waypoint listening", READY, || {
                    t.pod("n1p2").netns.exec("ss", &["-Htln", "sport = :15008"]).is_ok_and(|o| !o.trim().is_empty())
                })?;
                Some(w)
            } else {
                None
            };
            let _app = rt.block_on(async { http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false) })?;
            let checks = test_servers::Checks::default();
            let _authz = rt.block_on(async { test_servers::start_grpc_authorizer(t.pod("n2p1"), 9100, checks.clone()) })?;
            let to: SocketAddr = if mode == "direct" { SocketAddr::new(t.pod("n2p1").ip.into(), 8080) } else { "10.96.0.10:80".parse()? };
            run_requests(t.pod("n1p1"), to, 50).context("warm-up")?;
            let cpu = || -> Duration { mesh.ztunnels.iter().chain(waypoint.iter()).filter_map(|c| c.cpu_time()).sum() };
            let cpu0 = cpu();
            let start = Instant::now();
            let mut lat = run_requests(t.pod("n1p1"), to, requests)?;
            let elapsed = start.elapsed().as_secs_f64();
            let cpu_used = cpu() - cpu0;
            lat.sort_by(f64::total_cmp);
            let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
            let s = Sample {
                req_per_s: requests as f64 / elapsed,
                p50_us: pct(0.5),
                p99_us: pct(0.99),
                cpu_us_per_req: cpu_used.as_secs_f64() * 1e6 / requests as f64,
            };
            println!(
                "round {round} {mode:<8} {:>8.0} req/s  p50 {:>7.1} us  p99 {:>7.1} us  proxy CPU {:>6.1} us/req",
                s.req_per_s, s.p50_us, s.p99_us, s.cpu_us_per_req
            );
            if mode == "ext_authz" {
                let n = checks.lock().map(|c| c.len()).unwrap_or(0);
                if n < requests {
                    bail!("ext_authz: {n} checks for {requests} requests");
                }
            }
            results.entry(mode).or_default().push(s);
        }
    }
    let med = |mode: &str, f: fn(&Sample) -> f64| median(results[mode].iter().map(f).collect());
    println!("\nmedians of {rounds} round(s), {requests} keep-alive HTTP/1.1 requests each");
    println!("{:<9} {:>9} {:>12} {:>12} {:>16}", "path", "req/s", "p50 us", "p99 us", "proxy CPU us/req");
    for mode in modes {
        println!(
            "{mode:<9} {:>9.0} {:>12.1} {:>12.1} {:>16.1}",
            med(mode, |s| s.req_per_s),
            med(mode, |s| s.p50_us),
            med(mode, |s| s.p99_us),
            med(mode, |s| s.cpu_us_per_req)
        );
    }
    let ratio = |a: &str, b: &str, f: fn(&Sample) -> f64| med(a, f) / med(b, f);
    println!("\nratios (same run):");
    for (a, b) in [("waypoint", "l4"), ("l4", "direct"), ("waypoint", "direct"), ("ext_authz", "waypoint")] {
        println!(
            "  {a}/{b}: req/s x{:.2}, p50 x{:.2}, p99 x{:.2}",
            ratio(a, b, |s| s.req_per_s),
            ratio(a, b, |s| s.p50_us),
            ratio(a, b, |s| s.p99_us)
        );
    }
    println!(
        "  proxy CPU per request: waypoint/l4 x{:.2} ({:.1} us added by the L7 hop)",
        ratio("waypoint", "l4", |s| s.cpu_us_per_req),
        med("waypoint", |s| s.cpu_us_per_req) - med("l4", |s| s.cpu_us_per_req)
    );
    println!(
        "  proxy CPU per request: ext_authz/waypoint x{:.2} ({:.1} us added by the gRPC check)",
        ratio("ext_authz", "waypoint", |s| s.cpu_us_per_req),
        med("ext_authz", |s| s.cpu_us_per_req) - med("waypoint", |s| s.cpu_us_per_req)
    );
    Ok(())
}
