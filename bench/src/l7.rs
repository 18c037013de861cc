//! Waypoint benchmark (not a timed test): HTTP/1.1 keep-alive request latency and proxy
//! CPU per request from a pod on node1 to a pod on node2, rounds interleaved across the
//! paths, medians and ratios reported. The paths:
//! - `direct`: no mesh (neither pod enrolled);
//! - `l4`: both pods enrolled, ztunnel to ztunnel over HBONE;
//! - `waypoint`: the same plus the waypoint hop (service with a waypoint, an HTTPRoute
//!   and an AuthorizationPolicy evaluated per request): every L7 feature off;
//!
//! and, each over `waypoint` with one feature on (the ones users enable most), so that
//! its cost is the difference to `waypoint` in the same run:
//! - `ext_authz`: a CUSTOM policy, every request checked by a gRPC ext_authz server
//!   (tonic, in the server's pod: one more HBONE round trip per request; its own CPU is
//!   not counted);
//! - `jwt`: RequestAuthentication with an inline JWKS, an RS256 token (2048-bit key) on
//!   every request, a DENY on `notRequestPrincipals` so every request needs it;
//! - `tracing`: the mesh's OpenTelemetry provider sampling 100%, a span per request
//!   exported over the mesh to an OTLP collector in the server's pod (its CPU not counted);
//! - `log_filter`: a mesh-wide Telemetry access log whose CEL filter passes errors and
//!   debug requests (the waypoint at `RUST_LOG=info`): the filter runs on every request,
//!   no request of the bench is logged;
//! - `log_all`: the same with a filter every request passes: a line per request;
//! - `dest_rule`: a DestinationRule with consistent hashing on a header the requests carry,
//!   outlierDetection and connectionPool limits (none reached);
//! - `vs_fault`: the route as a VirtualService with a 0% abort fault (rolled per request,
//!   never fires), a timeout and retries (none needed).
//!
//! Each feature path checks that the feature acted: the waypoint's `/config_dump` lists
//! its objects, a request without the token gets 403, the collector got a span per
//! request, the log has the lines the filter passes and no others.
//! CPU is the user+system time of the ztunnels and the waypoint over the measured
//! requests (from /proc), divided by the request count.
//!
//! The route and policy are the main suite's (`modes::L7_ROUTE`, `modes::L7_POLICY`).
//! `bench l7` gives the numbers (docs/benchmarks.md); `bench l7 --quick` is the smoke
//! pass CI runs (bench/tests/smoke.rs), over the paths of [`QUICK`].

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use mesh_tests::netsim::*;
use mesh_tests::{bins, http_app, jwt, test_servers};

use crate::modes::{L7_POLICY, L7_ROUTE};

#[derive(Clone, Default)]
struct Sample {
    req_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us_per_req: f64,
}

/// One path `bench l7` measures (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    Direct,
    L4,
    Waypoint,
    ExtAuthz,
    Jwt,
    Tracing,
    LogFilter,
    LogAll,
    DestRule,
    VsFault,
}

/// Every path, in the order each round runs them.
pub const ALL: [Path; 10] = [
    Path::Direct,
    Path::L4,
    Path::Waypoint,
    Path::ExtAuthz,
    Path::Jwt,
    Path::Tracing,
    Path::LogFilter,
    Path::LogAll,
    Path::DestRule,
    Path::VsFault,
];

/// `--quick` (CI's smoke pass): the baselines and ext_authz, as before the feature paths
/// came; each feature path adds a topology and a mesh start (~2 s), so they run only in
/// the full run or when named with `--paths`.
pub const QUICK: [Path; 4] = [Path::Direct, Path::L4, Path::Waypoint, Path::ExtAuthz];

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::L4 => "l4",
            Path::Waypoint => "waypoint",
            Path::ExtAuthz => "ext_authz",
            Path::Jwt => "jwt",
            Path::Tracing => "tracing",
            Path::LogFilter => "log_filter",
            Path::LogAll => "log_all",
            Path::DestRule => "dest_rule",
            Path::VsFault => "vs_fault",
        }
    }

    /// `--paths` takes these names.
    pub fn parse(s: &str) -> Result<Path> {
        ALL.into_iter().find(|p| p.name() == s).with_context(|| {
            format!(
                "unknown path {s:?}: one of {}",
                ALL.map(Path::name).join(", ")
            )
        })
    }

    fn via_waypoint(self) -> bool {
        !matches!(self, Path::Direct | Path::L4)
    }

    /// A feature path: one feature on over `waypoint`.
    fn is_feature(self) -> bool {
        self.via_waypoint() && self != Path::Waypoint
    }

    /// The waypoint's L7 config: the route, the policy, then what this path adds (after
    /// the policy list, so it may start with more policies).
    fn l7_config(self, jwks: &str) -> String {
        let route = if self == Path::VsFault {
            VS_FAULT
        } else {
            L7_ROUTE
        };
        let extra = match self {
            Path::ExtAuthz => EXT_AUTHZ.to_string(),
            Path::Jwt => JWT.replace("{jwks}", jwks),
            Path::Tracing => TRACING.to_string(),
            Path::LogFilter => {
                access_log("response.code >= 400 || request.headers['x-debug'] == 'on'")
            }
            Path::LogAll => access_log("response.code < 400 || request.headers['x-debug'] == 'on'"),
            Path::DestRule => DEST_RULE.to_string(),
            _ => String::new(),
        };
        format!("{route}{L7_POLICY}{extra}")
    }

    /// Request headers this path adds (each line ending in CRLF).
    fn headers(self, token: &str) -> String {
        match self {
            Path::Jwt => format!("authorization: Bearer {token}\r\n"),
            Path::DestRule => "x-user: bench\r\n".to_string(),
            _ => String::new(),
        }
    }

    /// The waypoint's log level: `warn` (no access log, Istio's default waypoint), `info`
    /// for the access-log paths.
    fn waypoint_log(self) -> &'static str {
        if matches!(self, Path::LogFilter | Path::LogAll) {
            "info"
        } else {
            "warn"
        }
    }

    /// The `/config_dump` list that must hold this path's objects.
    fn dump_list(self) -> Option<&'static str> {
        match self {
            Path::Jwt => Some("requestAuthentications"),
            Path::LogFilter | Path::LogAll => Some("telemetries"),
            Path::DestRule => Some("destinationRules"),
            Path::VsFault => Some("virtualServices"),
            _ => None,
        }
    }
}

/// The `ext_authz` path's provider and CUSTOM policy.
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

/// The `jwt` path: a DENY for requests without a token of the issuer (so each one is
/// verified before the policies pass it) and the RequestAuthentication (`{jwks}`: the
/// key set, inline).
const JWT: &str = r#"- name: need-jwt
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules: [{from: [{source: {notRequestPrincipals: ["https://bench.example/*"]}}]}]
requestAuthentications:
- name: jwt
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  jwtRules:
  - {issuer: "https://bench.example", jwks: '{jwks}'}
"#;

const ISSUER: &str = "https://bench.example";

/// The `tracing` path: every request sampled, spans to a collector Service over the mesh.
const TRACING: &str = r#"meshConfig:
  defaultProviders: {tracing: [otel]}
  defaultConfig: {tracing: {sampling: 100}}
  extensionProviders:
  - name: otel
    opentelemetry: {service: collector.default.svc.cluster.local, port: 4317}
"#;

/// A mesh-wide Telemetry: the access log (Istio's `envoy` provider) for the requests
/// `filter` passes.
fn access_log(filter: &str) -> String {
    format!(
        "telemetries:\n- name: mesh-default\n  namespace: istio-system\n  accessLogging:\n  - providers: [{{name: envoy}}]\n    filter: {{expression: \"{filter}\"}}\n"
    )
}

/// The `dest_rule` path: the traffic policy users set most, with limits no request of
/// the bench reaches.
const DEST_RULE: &str = r#"destinationRules:
- name: echo
  namespace: default
  host: echo.default.svc.cluster.local
  trafficPolicy:
    loadBalancer: {consistentHash: {httpHeaderName: x-user}}
    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 30s, maxEjectionPercent: 50}
    connectionPool:
      tcp: {maxConnections: 100, connectTimeout: 2s}
      http: {http1MaxPendingRequests: 100, http2MaxRequests: 1000, maxRetries: 3}
"#;

/// The `vs_fault` path's route: the HTTPRoute's, as a VirtualService with a fault that
/// never fires, a timeout and retries.
const VS_FAULT: &str = r#"virtualServices:
- name: echo
  namespace: default
  hosts: [echo.default.svc.cluster.local]
  http:
  - match: [{uri: {prefix: /bench}}]
    fault: {abort: {httpStatus: 503, percentage: {value: 0}}}
    timeout: 3s
    retries: {attempts: 2, perTryTimeout: 1s, retryOn: "5xx,connect-failure"}
    route: [{destination: {host: echo.default.svc.cluster.local, port: {number: 80}}}]
"#;

/// Blocking HTTP/1.1 keep-alive client: `n` times `request`, each answered with
/// `status`; the latency of each.
fn run_requests(
    pod: &Pod,
    to: SocketAddr,
    n: usize,
    request: &[u8],
    status: u16,
) -> Result<Vec<f64>> {
    let want = format!("HTTP/1.1 {status} ");
    pod.netns.run(move || -> Result<Vec<f64>> {
        let s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        let mut w = s.try_clone()?;
        let mut r = BufReader::new(s);
        let mut lat = Vec::with_capacity(n);
        let mut line = String::new();
        for _ in 0..n {
            let t = Instant::now();
            w.write_all(request)?;
            let mut len = 0usize;
            line.clear();
            r.read_line(&mut line)?;
            if !line.starts_with(&want) {
                bail!("unexpected response {line:?}, wanted {want:?}");
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

fn request(extra_headers: &str) -> Vec<u8> {
    format!("GET /bench HTTP/1.1\r\nhost: echo.default.svc.cluster.local\r\nuser-agent: bench\r\nx-ext-authz: allow\r\n{extra_headers}\r\n").into_bytes()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The waypoint's access log lines so far.
fn logged_requests(log: &std::path::Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches("request complete")
        .count()
}

/// The `paths` (default: all, or [`QUICK`] when `quick`), `rounds` interleaved rounds of
/// `requests` each (defaults: 5 x 5000, or 1 x 50 when `quick`).
pub fn main(
    quick: bool,
    requests: Option<usize>,
    rounds: Option<usize>,
    paths: Option<Vec<Path>>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let _guard = rt.enter();
    let (default_rounds, default_requests) = if quick { (1, 50) } else { (5, 5000) };
    let requests = requests.unwrap_or(default_requests);
    let rounds = rounds.unwrap_or(default_rounds).max(1);
    let paths = paths.unwrap_or_else(|| if quick { QUICK.to_vec() } else { ALL.to_vec() });
    let (jwks, token) = if paths.contains(&Path::Jwt) {
        jwt_key()?
    } else {
        Default::default()
    };

    let mut results: HashMap<Path, Vec<Sample>> = HashMap::new();
    for round in 0..rounds {
        for (i, &path) in paths.iter().enumerate() {
            let s = run_path(&rt, path, &format!("wb{round}{i}"), requests, &jwks, &token)
                .with_context(|| format!("path {}", path.name()))?;
            println!(
                "round {round} {:<10} {:>8.0} req/s  p50 {:>7.1} us  p99 {:>7.1} us  proxy CPU {:>6.1} us/req",
                path.name(),
                s.req_per_s,
                s.p50_us,
                s.p99_us,
                s.cpu_us_per_req
            );
            results.entry(path).or_default().push(s);
        }
    }
    report(&paths, &results, rounds, requests);
    Ok(())
}

/// One RS256 key for the run (openssl makes it): its key set (JSON) and a token.
fn jwt_key() -> Result<(String, String)> {
    let keydir = std::env::temp_dir().join(format!("bench-l7-jwt-{}", std::process::id()));
    std::fs::create_dir_all(&keydir)?;
    let key = jwt::rs256_key(&keydir, "bench-1");
    let _ = std::fs::remove_dir_all(&keydir);
    let key = key?;
    let jwks = serde_json::json!({"keys": [key.jwk.clone()]}).to_string();
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        + 24 * 3600;
    let token = jwt::sign(
        &key,
        serde_json::json!({"iss": ISSUER, "sub": "client", "exp": exp}),
    )?;
    Ok((jwks, token))
}

/// One round of one path on a topology of its own: start, warm up, check the feature is
/// on, measure, check it acted.
fn run_path(
    rt: &tokio::runtime::Runtime,
    path: Path,
    tag: &str,
    requests: usize,
    jwks: &str,
    token: &str,
) -> Result<Sample> {
    let topo = Topology::build(&prefix(tag), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let waypoint_ref = if path.via_waypoint() {
        format!(", waypoint: {{destination: \"/{wp_ip}\"}}")
    } else {
        String::new()
    };
    let cfg = format!(
        "workloads:\n{}{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}{waypoint_ref}}}\n\
         - {{name: authz, namespace: default, hostname: authz.default.svc.cluster.local, vips: [\"/10.96.0.30\"], ports: {{9100: 9100}}}}\n\
         - {{name: collector, namespace: default, hostname: collector.default.svc.cluster.local, vips: [\"/10.96.0.31\"], ports: {{4317: 4317}}}}\n{}",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(
            &topo,
            "n2p1",
            "echo",
            ", services: {default/echo.default.svc.cluster.local: {80: 8080}, default/authz.default.svc.cluster.local: {9100: 9100}, \
             default/collector.default.svc.cluster.local: {4317: 4317}}"
        ),
        path.l7_config(jwks),
    );
    let enrolled: &[&str] = if path == Path::Direct {
        &[]
    } else {
        &["n1p1", "n2p1"]
    };
    let mesh = if path == Path::Direct {
        Mesh {
            ztunnels: vec![],
            commands: vec![],
            topo,
        }
    } else {
        Mesh::start(topo, &cfg, enrolled, &HashMap::new(), &[])?
    };
    let t = &mesh.topo;
    let wp_log = t.dir.join("waypoint.log");
    let waypoint = if path.via_waypoint() {
        let cfg_path = t.dir.join("waypoint.yaml");
        std::fs::write(&cfg_path, &cfg)?;
        let state = t.dir.join("ca");
        let w = t.pod("n1p2").netns.spawn(
            bins::waypoint(),
            &[
                "--local-xds-path",
                &cfg_path.display().to_string(),
                "--workload-uid",
                "n1p2",
                "--state-dir",
                &state.display().to_string(),
            ],
            &[("RUST_LOG", path.waypoint_log())],
            &wp_log,
        )?;
        wait_for("waypoint listening", READY, || {
            t.pod("n1p2")
                .netns
                .exec("ss", &["-Htln", "sport = :15008"])
                .is_ok_and(|o| !o.trim().is_empty())
        })
        .with_context(|| w.log_text())?;
        Some(w)
    } else {
        None
    };
    if let Some(list) = path.dump_list() {
        let dump = t
            .pod("n1p2")
            .netns
            .exec("curl", &["-sf", "http://127.0.0.1:15000/config_dump"])?;
        let dump: serde_json::Value =
            serde_json::from_str(&dump).context("waypoint /config_dump")?;
        ensure!(
            dump[list].as_array().is_some_and(|l| !l.is_empty()),
            "the waypoint did not take the path's {list}: {}",
            dump[list]
        );
    }
    let _app =
        rt.block_on(async { http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false) })?;
    let checks = test_servers::Checks::default();
    let _authz = if path == Path::ExtAuthz {
        Some(rt.block_on(async {
            test_servers::start_grpc_authorizer(t.pod("n2p1"), 9100, checks.clone())
        })?)
    } else {
        None
    };
    let spans = test_servers::Spans::default();
    let _collector = if path == Path::Tracing {
        Some(rt.block_on(async {
            test_servers::start_otlp_collector(t.pod("n2p1"), 4317, spans.clone())
        })?)
    } else {
        None
    };
    let to: SocketAddr = if path == Path::Direct {
        SocketAddr::new(t.pod("n2p1").ip, 8080)
    } else {
        "10.96.0.10:80".parse()?
    };
    let client = t.pod("n1p1");
    let req = request(&path.headers(token));
    const WARM_UP: usize = 50;
    run_requests(client, to, WARM_UP, &req, 200).context("warm-up")?;
    match path {
        Path::Jwt => {
            run_requests(client, to, 1, &request(""), 403)
                .context("a request without the token")?;
        }
        Path::LogFilter => {
            run_requests(client, to, 1, &request("x-debug: on\r\n"), 200)
                .context("a debug request")?;
            wait_for(
                "the debug request's log line",
                Duration::from_secs(5),
                || logged_requests(&wp_log) >= 1,
            )?;
        }
        _ => {}
    }
    let cpu = || -> Duration {
        mesh.ztunnels
            .iter()
            .chain(waypoint.iter())
            .filter_map(|c| c.cpu_time())
            .sum()
    };
    let cpu0 = cpu();
    let start = Instant::now();
    let mut lat = run_requests(client, to, requests, &req, 200)?;
    let elapsed = start.elapsed().as_secs_f64();
    let cpu_used = cpu() - cpu0;
    match path {
        Path::ExtAuthz => {
            let n = checks.lock().map(|c| c.len()).unwrap_or(0);
            ensure!(
                n >= requests,
                "ext_authz: {n} checks for {requests} requests"
            );
        }
        // Spans and lines are counted, not required: a full export queue drops spans by
        // design, and that is a result to report, not a reason to lose the run.
        Path::Tracing => {
            let want = WARM_UP + requests;
            let got = || spans.lock().map(|s| s.len()).unwrap_or(0);
            if wait_for(
                "a span per request at the collector",
                Duration::from_secs(10),
                || got() >= want,
            )
            .is_err()
            {
                println!(
                    "note: tracing: the collector got {} spans for {want} requests",
                    got()
                );
            }
        }
        Path::LogFilter => {
            let n = logged_requests(&wp_log);
            ensure!(
                n == 1,
                "log_filter: {n} access log lines, wanted only the debug request's"
            );
        }
        Path::LogAll => {
            let want = WARM_UP + requests;
            if wait_for("a log line per request", Duration::from_secs(10), || {
                logged_requests(&wp_log) >= want
            })
            .is_err()
            {
                println!(
                    "note: log_all: {} access log lines for {want} requests",
                    logged_requests(&wp_log)
                );
            }
        }
        _ => {}
    }
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    Ok(Sample {
        req_per_s: requests as f64 / elapsed,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        cpu_us_per_req: cpu_used.as_secs_f64() * 1e6 / requests as f64,
    })
}

/// Medians per path, ratios, and each feature's cost over `waypoint` (also as a markdown
/// table for docs/benchmarks.md).
fn report(paths: &[Path], results: &HashMap<Path, Vec<Sample>>, rounds: usize, requests: usize) {
    let med =
        |p: Path, f: fn(&Sample) -> f64| results.get(&p).map(|v| median(v.iter().map(f).collect()));
    let cpu: fn(&Sample) -> f64 = |s| s.cpu_us_per_req;
    let rps: fn(&Sample) -> f64 = |s| s.req_per_s;
    let p50: fn(&Sample) -> f64 = |s| s.p50_us;
    let p99: fn(&Sample) -> f64 = |s| s.p99_us;
    println!("\nmedians of {rounds} round(s), {requests} keep-alive HTTP/1.1 requests each");
    println!(
        "{:<10} {:>9} {:>12} {:>12} {:>16}",
        "path", "req/s", "p50 us", "p99 us", "proxy CPU us/req"
    );
    for &p in paths {
        let m = |f: fn(&Sample) -> f64| med(p, f).unwrap_or(f64::NAN);
        println!(
            "{:<10} {:>9.0} {:>12.1} {:>12.1} {:>16.1}",
            p.name(),
            m(rps),
            m(p50),
            m(p99),
            m(cpu)
        );
    }
    let ratio = |a: Path, b: Path, f: fn(&Sample) -> f64| Some(med(a, f)? / med(b, f)?);
    println!("\nratios (same run):");
    for (a, b) in [
        (Path::Waypoint, Path::L4),
        (Path::L4, Path::Direct),
        (Path::Waypoint, Path::Direct),
    ] {
        if let (Some(r), Some(p5), Some(p9)) =
            (ratio(a, b, rps), ratio(a, b, p50), ratio(a, b, p99))
        {
            println!(
                "  {}/{}: req/s x{r:.2}, p50 x{p5:.2}, p99 x{p9:.2}",
                a.name(),
                b.name()
            );
        }
    }
    if let (Some(r), Some(w), Some(l)) = (
        ratio(Path::Waypoint, Path::L4, cpu),
        med(Path::Waypoint, cpu),
        med(Path::L4, cpu),
    ) {
        println!(
            "  proxy CPU per request: waypoint/l4 x{r:.2} ({:.1} us added by the L7 hop)",
            w - l
        );
    }
    if !results.contains_key(&Path::Waypoint) {
        return;
    }
    let base = Path::Waypoint;
    for &p in paths.iter().filter(|p| p.is_feature()) {
        let (Some(c), Some(b)) = (med(p, cpu), med(base, cpu)) else {
            continue;
        };
        println!(
            "  proxy CPU per request: {}/waypoint x{:.2} ({:+.1} us by the feature); req/s x{:.2}, p50 x{:.2}, p99 x{:.2}",
            p.name(),
            c / b,
            c - b,
            ratio(p, base, rps).unwrap_or(f64::NAN),
            ratio(p, base, p50).unwrap_or(f64::NAN),
            ratio(p, base, p99).unwrap_or(f64::NAN)
        );
    }
    println!("\n| path | req/s | P50 | P99 | proxy CPU / request | CPU over `waypoint` | req/s vs `waypoint` |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for &p in paths {
        let m = |f: fn(&Sample) -> f64| med(p, f).unwrap_or(f64::NAN);
        let over = if p.is_feature() {
            format!(
                "{:+.0} µs (x{:.2})",
                m(cpu) - med(base, cpu).unwrap_or(f64::NAN),
                ratio(p, base, cpu).unwrap_or(f64::NAN)
            )
        } else {
            "–".to_string()
        };
        let vs = if p.is_feature() {
            format!("x{:.2}", ratio(p, base, rps).unwrap_or(f64::NAN))
        } else {
            "–".to_string()
        };
        let c = if p == Path::Direct {
            "–".to_string()
        } else {
            format!("{:.0} µs", m(cpu))
        };
        println!(
            "| `{}` | {:.0} | {:.0} µs | {:.0} µs | {c} | {over} | {vs} |",
            p.name(),
            m(rps),
            m(p50),
            m(p99)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path's L7 config is one the waypoint loads (the full run is the only one
    /// that starts the feature paths, so CI checks their configs here).
    #[test]
    fn every_path_config_loads_in_the_waypoint() {
        let (jwks, _) = jwt_key().expect("an RS256 key (openssl)");
        for p in ALL {
            let cfg = p.l7_config(&jwks);
            if let Err(e) =
                waypoint::config::Config::parse(std::path::Path::new("bench.yaml"), &cfg)
            {
                panic!("{}: {e}\n{cfg}", p.name());
            }
        }
    }
}
