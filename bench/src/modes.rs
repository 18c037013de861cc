//! The paths being compared, each on its own topology (2 nodes; client pod n1p1,
//! waypoint pod n1p2, server pod n2p1), all built up front and kept side by side so
//! scenarios can be interleaved across modes.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::server::{self, Server};
use crate::Outside;
use mesh_tests::netsim::{self, Child, Topology};

mod zds;

#[derive(Clone, Debug)]
pub enum Mode {
    /// No mesh: plain pod-to-pod TCP.
    Direct,
    /// Both pods enrolled in our ztunnel: HBONE between the two nodes' ztunnels.
    L4,
    /// L4 plus our waypoint (a service with a waypoint; L7 routing and policy per request).
    Waypoint,
    /// Another node proxy binary started exactly where ztunnel is.
    Reference(PathBuf),
    /// Another node proxy driven as istio-cni drives Istio's ztunnel: configured by
    /// environment variables (`LOCAL_XDS_PATH`, `INPOD_UDS`, `FAKE_CA`, ...), pods sent
    /// over ZDS by `ztunnel cni-server`, traffic captured by istio-cni's in-pod rules.
    ReferenceZds(PathBuf),
}

impl Mode {
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::L4 => "ztunnel-l4",
            Mode::Waypoint => "ztunnel+waypoint",
            Mode::Reference(_) => "reference-l4",
            Mode::ReferenceZds(_) => "reference-zds-l4",
        }
    }
}

pub struct Binaries {
    pub ztunnel: PathBuf,
    pub waypoint: PathBuf,
}

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// L7 config for the waypoint, in two parts: [`L7_ROUTE`], one route to the echo
/// service's HTTP port, then [`L7_POLICY`]. The route names port 80: a Service with routes
/// on a port refuses non-HTTP bytes there, and the echo and sink ports carry raw TCP
/// (relayed at L4). `bench l7` uses both (its `vs_fault` path swaps the route for a
/// VirtualService).
pub const L7_ROUTE: &str = r#"httpRoutes:
- name: echo
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /bench}}]
    backendRefs: [{name: echo, port: 80}]
"#;

/// An ALLOW policy per request (method + path), plus the TCP ports of the echo and sink
/// for the client. It ends with the list of policies, so more policies may follow it.
pub const L7_POLICY: &str = r#"authorizationPolicies:
- name: allow-client
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  rules:
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {methods: [GET, POST], paths: ["/bench*"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {ports: ["9000", "9001"]}}]
"#;

/// One mode's running system. Field order is drop order: the app and the proxies stop
/// before the topology (namespaces, bpffs) goes.
pub struct Env {
    pub mode: Mode,
    pub client_ns: PathBuf,
    pub http: SocketAddr,
    pub echo: SocketAddr,
    pub sink: SocketAddr,
    _server: Server,
    pub proxies: Vec<(String, Child)>,
    /// Processes the mode needs that are not proxies (the ZDS agents): not metered.
    _helpers: Vec<Child>,
    _topo: Topology,
}

impl Env {
    pub fn proxy_pids(&self) -> Vec<(String, u32)> {
        self.proxies
            .iter()
            .filter_map(|(n, c)| c.pid().map(|p| (n.clone(), p)))
            .collect()
    }

    /// The server app (the same program in every mode): its CPU per request is this
    /// machine's price of one plain process hop, the yardstick for the proxies' CPU.
    pub fn server_pid(&self) -> u32 {
        self._server.pid()
    }

    /// Fails if a proxy died (its log tail says why).
    pub fn check_alive(&mut self) -> Result<()> {
        for (name, c) in &mut self.proxies {
            if c.wait_exit(Duration::ZERO).is_some() {
                let log = c.log_text();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!(
                    "{name} exited; log tail:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        Ok(())
    }

    /// The pod `outside` names is no mesh workload and is not enrolled.
    pub fn start(mode: Mode, index: usize, bins: &Binaries, outside: Outside) -> Result<Env> {
        let prefix = netsim::prefix(&format!("bm{index}"));
        let topo = Topology::build(&prefix, &[2, 1])?;
        crate::cleanup::register_prefix(&prefix, &topo.bpffs);
        let (client, wp, srv) = (topo.pod("n1p1"), topo.pod("n1p2"), topo.pod("n2p1"));
        let in_mesh = |p: &netsim::Pod| match outside {
            Outside::None => true,
            Outside::Server => p.name != srv.name,
            Outside::Client => p.name != client.name,
        };
        // The connection-rate step leaves tens of thousands of TIME_WAIT sockets to one
        // destination; without reuse every later connect() scans for a free port, and
        // that cost would land on whichever step runs next.
        client
            .netns
            .exec("sysctl", &["-qw", "net.ipv4.tcp_tw_reuse=1"])?;
        let waypoint_ref = if matches!(mode, Mode::Waypoint) {
            format!(", waypoint: {{destination: \"/{}\"}}", wp.ip)
        } else {
            String::new()
        };
        let cfg = format!(
            "workloads:\n{}{}{}services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/{VIP}\"], \
             ports: {{80: {}, {ECHO}: {ECHO}, {SINK}: {SINK}}}{waypoint_ref}}}\n{L7_ROUTE}{L7_POLICY}",
            // `services` is required on every workload by Istio's parser (--reference-zds).
            if in_mesh(client) { netsim::workload(&topo, "n1p1", "client", ", services: {}") } else { String::new() },
            netsim::waypoint_workload(&topo, "n1p2", "waypoint", ", services: {}"),
            if !in_mesh(srv) {
                String::new()
            } else {
                netsim::workload(
                    &topo,
                    "n2p1",
                    "echo",
                    &format!(
                        ", services: {{default/echo.default.svc.cluster.local: {{80: {}, {e}: {e}, {s}: {s}}}}}",
                        server::HTTP_PORT,
                        e = server::ECHO_PORT,
                        s = server::SINK_PORT
                    ),
                )
            },
            server::HTTP_PORT,
            ECHO = server::ECHO_PORT,
            SINK = server::SINK_PORT,
        );
        let cfg_path = topo.dir.join("mesh.yaml");
        std::fs::write(&cfg_path, &cfg)?;
        let mut proxies = Vec::new();
        let mut helpers = Vec::new();
        let node_proxy = match &mode {
            Mode::Direct => None,
            Mode::L4 | Mode::Waypoint => Some(bins.ztunnel.clone()),
            Mode::Reference(p) => Some(p.clone()),
            Mode::ReferenceZds(p) => {
                // Istio's local config has only these three lists and refuses unknown
                // fields: the waypoint's part of ours is left out (this mode has none).
                let l4 = topo.dir.join("mesh-l4.yaml");
                std::fs::write(&l4, cfg.split("httpRoutes:").next().unwrap_or(&cfg))?;
                for n in 1..=2 {
                    let name = format!("reference-zds-node{n}");
                    let pods: Vec<_> = [(client, "client"), (srv, "echo")]
                        .into_iter()
                        .filter(|(p, _)| p.node == n && in_mesh(p))
                        .collect();
                    let (agent, c) = zds::start(&topo, &bins.ztunnel, p, &l4, n, &pods, &name)?;
                    helpers.push(agent);
                    proxies.push((name, c));
                }
                None
            }
        };
        if let Some(bin) = node_proxy {
            for n in 1..=2 {
                let name = format!(
                    "{}-node{n}",
                    if matches!(mode, Mode::Reference(_)) {
                        "reference"
                    } else {
                        "ztunnel"
                    }
                );
                let c = start_node_proxy(&topo, &bin, &cfg_path, n, &name, in_mesh)?;
                proxies.push((name, c));
            }
            if !matches!(mode, Mode::Reference(_)) {
                for (_, c) in &proxies {
                    netsim::check_capture_mode(c)?;
                }
            }
        }
        if matches!(mode, Mode::Waypoint) {
            let state = topo.dir.join("ca");
            let log = topo.dir.join("waypoint.log");
            let w = wp.netns.spawn(
                &bins.waypoint.display().to_string(),
                &[
                    "--local-xds-path",
                    &cfg_path.display().to_string(),
                    "--workload-uid",
                    "n1p2",
                    "--state-dir",
                    &state.display().to_string(),
                ],
                &[("RUST_LOG", "warn")],
                &log,
            )?;
            if let Some(pid) = w.pid() {
                crate::cleanup::register_pid(pid);
            }
            netsim::wait_for("waypoint listening on 15008", netsim::READY, || {
                wp.netns
                    .exec("ss", &["-Htln", "sport = :15008"])
                    .is_ok_and(|o| !o.trim().is_empty())
            })
            .with_context(|| w.log_text())?;
            proxies.push(("waypoint".into(), w));
        }
        let server = Server::start(&srv.netns.path())?;
        let dst = if matches!(mode, Mode::Waypoint) {
            std::net::IpAddr::V4(VIP)
        } else {
            srv.ip
        };
        let http_port = if matches!(mode, Mode::Waypoint) {
            80
        } else {
            server::HTTP_PORT
        };
        Ok(Env {
            client_ns: client.netns.path(),
            http: SocketAddr::new(dst, http_port),
            echo: SocketAddr::new(dst, server::ECHO_PORT),
            sink: SocketAddr::new(dst, server::SINK_PORT),
            _server: server,
            proxies,
            _helpers: helpers,
            _topo: topo,
            mode,
        })
    }
}

/// Starts a node proxy with our ztunnel's command line (see docs/benchmarks.md for what a
/// reference binary must accept) and waits for its readiness endpoint.
fn start_node_proxy(
    topo: &Topology,
    bin: &Path,
    cfg: &Path,
    n: usize,
    name: &str,
    in_mesh: impl Fn(&netsim::Pod) -> bool,
) -> Result<Child> {
    let mut args = vec![
        "--local-xds-path".to_string(),
        cfg.display().to_string(),
        "--node-name".into(),
        format!("node{n}"),
        "--state-dir".into(),
        topo.dir.join("ca").display().to_string(),
    ];
    args.extend(topo.capture_args(n));
    for pod in topo
        .pods
        .iter()
        .filter(|p| p.node == n && p.name != "n1p2" && in_mesh(p))
    {
        args.push("--pod".into());
        args.push(format!("{}={}", pod.name, pod.netns.path().display()));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node = topo.node(n);
    let c = node.spawn(
        &bin.display().to_string(),
        &args,
        // info is ztunnel's default (one access log line per connection, as Istio's).
        &[("RUST_LOG", "info"), ("RUST_BACKTRACE", "0")],
        &topo.dir.join(format!("{name}.log")),
    )?;
    if let Some(pid) = c.pid() {
        crate::cleanup::register_pid(pid);
    }
    wait_ready(topo, n, name, c)
}

/// Waits for `200` on 127.0.0.1:15021/healthz/ready in node `n`'s netns.
fn wait_ready(topo: &Topology, n: usize, name: &str, c: Child) -> Result<Child> {
    let node = topo.node(n);
    let ready = || {
        node.run(|| -> bool {
            use std::io::{Read, Write};
            let Ok(mut s) = std::net::TcpStream::connect_timeout(
                &"127.0.0.1:15021".parse().expect("constant address"),
                Duration::from_millis(200),
            ) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            if s.write_all(
                b"GET /healthz/ready HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n",
            )
            .is_err()
            {
                return false;
            }
            let mut b = [0u8; 12];
            s.read_exact(&mut b).is_ok() && b.starts_with(b"HTTP/1.1 200")
        })
        .unwrap_or(false)
    };
    netsim::wait_for(&format!("{name} ready on :15021"), netsim::READY, ready)
        .with_context(|| c.log_text())?;
    Ok(c)
}
