//! The pods curve: one node's ztunnel (local config, the test capture mode) with pods
//! enrolled one at a time over ZDS. The bench itself plays the CNI agent (the ZDS
//! server side, with ztunnel's own message types), so an Add's timing is exact; the
//! stand-in `ztunnel cni-server` polls its directory every 100 ms, which would hide
//! ztunnel's own time. Per pod: Add → ztunnel's ACK, and Add → the first connection
//! from the pod served (a connection to a service VIP, which has no route without
//! ztunnel's capture, echoed by a server pod outside the mesh). At each checkpoint:
//! RSS and open fds, and CPU over an idle interval (no traffic).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use mesh_tests::netsim::{self, Pod, Topology};
use ztunnel::zds::{
    AddWorkload, Payload, ResponsePayload, SeqPacket, SnapshotSent, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello,
};

use crate::procstat;

const VIP: &str = "10.96.0.10:80";
const ECHO_PORT: u16 = 9000;

pub struct Plan {
    /// Checkpoints: enrolled pod counts, ascending.
    pub sizes: Vec<usize>,
    pub idle: Duration,
    pub settle: Duration,
}

impl Plan {
    pub fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                sizes: vec![1, 5],
                idle: Duration::from_secs(1),
                settle: Duration::from_millis(300),
            }
        } else {
            Plan {
                sizes: vec![1, 50, 200],
                idle: Duration::from_secs(10),
                settle: Duration::from_secs(2),
            }
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PodsPoint {
    pub pods: usize,
    pub rss_mib: f64,
    pub anon_mib: f64,
    pub fds: usize,
    /// (RSS − RSS with 1 pod) / (pods − 1), KiB.
    pub rss_kib_per_pod: Option<f64>,
    pub fds_per_pod: Option<f64>,
    /// Over the pods enrolled since the previous checkpoint: ZDS Add → ztunnel's ACK.
    pub enroll_ack_median_ms: f64,
    pub enroll_ack_max_ms: f64,
    /// ZDS Add → the pod's first connection through ztunnel answered.
    pub enroll_served_median_ms: f64,
    pub enroll_served_max_ms: f64,
    /// ztunnel CPU with no traffic, ms per second, over the idle interval.
    pub idle_cpu_ms_per_s: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PodsCurve {
    pub capture: String,
    pub idle_seconds: f64,
    pub points: Vec<PodsPoint>,
}

fn config(topo: &Topology, pods: usize, server: &Pod) -> String {
    let mut cfg = String::from("workloads:\n");
    for j in 1..=pods {
        cfg.push_str(&netsim::workload(
            topo,
            &format!("n1p{j}"),
            &format!("sa-{j}"),
            "",
        ));
    }
    // The server is outside the mesh (plain TCP): reached through the client pod's
    // ztunnel only, which is what the probe proves.
    cfg.push_str(&format!(
        "- {{uid: {n}, name: {n}, namespace: default, serviceAccount: echo, workloadIps: {ips}, protocol: TCP, node: node1, \
         services: {{default/echo.default.svc.cluster.local: {{80: {ECHO_PORT}}}}}}}\n",
        n = server.name,
        ips = netsim::ips_yaml(&server.ips)
    ));
    cfg.push_str(&format!(
        "services:\n- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: {ECHO_PORT}}}}}\n"
    ));
    cfg
}

/// The CNI agent's side of one ZDS session.
struct Agent {
    sock: SeqPacket,
}

impl Agent {
    async fn accept(listener: &ztunnel::zds::server::Listener) -> Result<Agent> {
        let sock = listener.accept().await?;
        let _: (ZdsHello, _) = sock.recv().await?;
        let a = Agent { sock };
        // No pods at start: the snapshot is empty.
        a.request(Payload::SnapshotSent(SnapshotSent {}), None)
            .await?;
        Ok(a)
    }

    async fn request(&self, payload: Payload, netns: Option<&std::fs::File>) -> Result<()> {
        self.sock
            .send(
                &WorkloadRequest {
                    payload: Some(payload),
                },
                netns.map(|f| f.as_raw_fd()),
            )
            .await?;
        let (resp, _): (WorkloadResponse, _) = self.sock.recv().await?;
        match resp.payload {
            Some(ResponsePayload::Ack(a)) if a.error.is_empty() => Ok(()),
            Some(ResponsePayload::Ack(a)) => bail!("ztunnel refused the request: {}", a.error),
            None => bail!("ztunnel answered without an ACK"),
        }
    }

    async fn add(&self, pod: &Pod) -> Result<()> {
        let netns = std::fs::File::open(pod.netns.path())?;
        let add = AddWorkload {
            uid: pod.name.clone(),
            workload_info: Some(WorkloadInfo {
                name: pod.name.clone(),
                namespace: "default".into(),
                service_account: sa(pod),
            }),
        };
        self.request(Payload::Add(add), Some(&netns)).await
    }
}

fn sa(pod: &Pod) -> String {
    format!("sa-{}", pod.name.trim_start_matches("n1p"))
}

/// Connects from `pod` to the VIP until a 1-byte echo comes back (within `timeout`).
fn probe(pod: &Pod, timeout: Duration) -> Result<()> {
    use std::io::{Read, Write};
    let vip: SocketAddr = VIP.parse()?;
    pod.netns
        .run(|| -> Result<()> {
            let deadline = Instant::now() + timeout;
            loop {
                crate::cleanup::check()?;
                let attempt = (|| -> std::io::Result<()> {
                    let mut s =
                        std::net::TcpStream::connect_timeout(&vip, Duration::from_millis(500))?;
                    s.set_read_timeout(Some(Duration::from_secs(2)))?;
                    s.write_all(b"x")?;
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b)
                })();
                match attempt {
                    Ok(()) => return Ok(()),
                    Err(e) if Instant::now() > deadline => bail!(
                        "no connection from {} through ztunnel in {timeout:?}: {e}",
                        pod.name
                    ),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        })?
        .with_context(|| format!("probe from {}", pod.name))
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

pub fn run(
    plan: &Plan,
    ztunnel: &std::path::Path,
    rt: &tokio::runtime::Runtime,
) -> Result<PodsCurve> {
    let max = *plan.sizes.iter().max().context("no pod counts")?;
    let prefix = netsim::prefix("scp");
    progress!("pods    building {} pod namespaces", max + 1);
    let topo = Topology::build(&prefix, &[max + 1])?;
    crate::cleanup::register_prefix(&prefix, &topo.bpffs);
    let server = topo.pod(&format!("n1p{}", max + 1));
    let cfg = topo.dir.join("mesh.yaml");
    std::fs::write(&cfg, config(&topo, max, server))?;
    let _echo = {
        let _g = rt.enter();
        netsim::EchoServer::start(&server.netns, ECHO_PORT, None)?
    };
    let socket = topo.dir.join("zds.sock");
    let listener = {
        let _g = rt.enter();
        ztunnel::zds::server::listen(&socket)?
    };
    let mut args = vec![
        "--local-xds-path".to_string(),
        cfg.display().to_string(),
        "--node-name".into(),
        "node1".into(),
        "--state-dir".into(),
        topo.dir.join("ca").display().to_string(),
        "--zds-socket".into(),
        socket.display().to_string(),
    ];
    args.extend(topo.capture_args(1));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut z = topo.node(1).spawn(
        &ztunnel.display().to_string(),
        &args,
        &[("RUST_LOG", "info"), ("RUST_BACKTRACE", "0")],
        &topo.dir.join("ztunnel.log"),
    )?;
    let pid = z.pid().context("ztunnel pid")?;
    crate::cleanup::register_pid(pid);
    let agent = rt
        .block_on(async { tokio::time::timeout(netsim::READY, Agent::accept(&listener)).await })
        .context("ztunnel did not connect to the ZDS socket")
        .and_then(|r| r)
        .with_context(|| super::log_tail(&z))?;
    z.wait_log("ztunnel ready", netsim::READY)?;
    netsim::check_capture_mode(&z)?;
    let mut curve = PodsCurve {
        capture: netsim::capture_mode(),
        idle_seconds: plan.idle.as_secs_f64(),
        points: Vec::new(),
    };
    let (mut acks, mut served) = (Vec::new(), Vec::new());
    for j in 1..=max {
        crate::cleanup::check()?;
        let pod = topo.pod(&format!("n1p{j}"));
        let t = Instant::now();
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), agent.add(pod)).await })
            .context("no ZDS ACK in 30 s")
            .and_then(|r| r)
            .with_context(|| format!("enroll {}; log tail:\n{}", pod.name, super::log_tail(&z)))?;
        acks.push(t.elapsed().as_secs_f64() * 1000.0);
        probe(pod, Duration::from_secs(20)).with_context(|| super::log_tail(&z))?;
        served.push(t.elapsed().as_secs_f64() * 1000.0);
        if !plan.sizes.contains(&j) {
            continue;
        }
        if let Some(st) = z.wait_exit(Duration::ZERO) {
            bail!("ztunnel exited ({st}); log tail:\n{}", super::log_tail(&z));
        }
        std::thread::sleep(plan.settle);
        let before = procstat::read(pid).context("ztunnel gone")?;
        let fd_count = fds(pid);
        std::thread::sleep(plan.idle);
        let after = procstat::read(pid).context("ztunnel gone")?;
        let mut p = PodsPoint {
            pods: j,
            rss_mib: before.rss_kib as f64 / 1024.0,
            anon_mib: before.anon_kib as f64 / 1024.0,
            fds: fd_count,
            enroll_ack_median_ms: super::config::median(&mut acks),
            enroll_ack_max_ms: acks.iter().copied().fold(0.0, f64::max),
            enroll_served_median_ms: super::config::median(&mut served),
            enroll_served_max_ms: served.iter().copied().fold(0.0, f64::max),
            idle_cpu_ms_per_s: after.cpu.saturating_sub(before.cpu).as_secs_f64() * 1000.0
                / plan.idle.as_secs_f64(),
            ..Default::default()
        };
        if let Some(first) = curve.points.first().filter(|f| j > f.pods) {
            let extra = (j - first.pods) as f64;
            p.rss_kib_per_pod = Some((p.rss_mib - first.rss_mib) * 1024.0 / extra);
            p.fds_per_pod = Some((p.fds as f64 - first.fds as f64) / extra);
        }
        progress!(
            "pods    {j:>4} enrolled: RSS {:.1} MiB ({} KiB/pod), {} fds ({} /pod), Add→ACK median {:.1} ms max {:.1}, Add→served median {:.1} ms max {:.1}, idle {:.2} CPU-ms/s",
            p.rss_mib,
            p.rss_kib_per_pod.map(|v| format!("{v:.0}")).unwrap_or("-".into()),
            p.fds,
            p.fds_per_pod.map(|v| format!("{v:.1}")).unwrap_or("-".into()),
            p.enroll_ack_median_ms,
            p.enroll_ack_max_ms,
            p.enroll_served_median_ms,
            p.enroll_served_max_ms,
            p.idle_cpu_ms_per_s
        );
        curve.points.push(p);
        acks.clear();
        served.clear();
    }
    z.stop();
    Ok(curve)
}
