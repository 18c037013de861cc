//! The tunnels curve: the main suite's L4 topology (client pod on node 1, server pod on
//! node 2, both enrolled, HBONE between the two ztunnels), with 1k, 10k, ... idle
//! tunnels held open (each proven by a 1-byte echo), and a victim beside them: 1 KiB
//! request/response round trips on one more connection at a constant rate. RSS of
//! both ztunnels per tunnel above the no-tunnel baseline.

use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::modes::{Binaries, Env, Mode};
use crate::{load, procstat};

/// File descriptors every process may have here: the hard RLIMIT_NOFILE, which only
/// CAP_SYS_RESOURCE could raise. Each tunnel takes one in the client (the bench), one in
/// the server app and one in each ztunnel.
fn fd_limit() -> usize {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(_, hard)| hard as usize)
        .unwrap_or(1024)
}

/// Room each process keeps for its own files, listeners and pooled connections.
const FD_HEADROOM: usize = 1500;

/// The eBPF capture's bound on one pod's captured connections at a time (its share of
/// the per-connection maps, ORIG_PER_NETNS and LOCAL_PER_NETNS in
/// ebpf/bpf/capture.bpf.c): past it, connect() fails with EPERM. All tunnels here come
/// from one client pod to one server pod, so a few below it is this topology's ceiling.
const EBPF_PER_POD: usize = 16384;
const EBPF_HEADROOM: usize = 384;

/// The largest tunnel count one client pod can hold here, and what sets it.
fn ceiling() -> (usize, String) {
    let fds = fd_limit();
    let by_fds = (fds.saturating_sub(FD_HEADROOM).max(1), format!("the hard RLIMIT_NOFILE of {fds} per process (raising it needs CAP_SYS_RESOURCE, which this container lacks)"));
    if mesh_tests::netsim::capture_mode() == "ebpf" && EBPF_PER_POD - EBPF_HEADROOM < by_fds.0 {
        return (
            EBPF_PER_POD - EBPF_HEADROOM,
            format!("the eBPF capture's bound of {EBPF_PER_POD} captured connections per pod (ebpf/bpf/capture.bpf.c), below {}", by_fds.1),
        );
    }
    by_fds
}

pub struct Plan {
    pub sizes: Vec<usize>,
    /// The first size asked for beyond the ceiling, and what sets the ceiling.
    pub capped: Option<(usize, String)>,
    pub victim_rate: f64,
    pub victim_duration: Duration,
    pub settle: Duration,
}

impl Plan {
    pub fn new(quick: bool) -> Plan {
        let wanted: Vec<usize> = if quick {
            vec![100, 500]
        } else {
            vec![1000, 10_000, 50_000]
        };
        let (limit, why) = ceiling();
        let mut sizes: Vec<usize> = wanted.iter().map(|&n| n.min(limit)).collect();
        sizes.dedup();
        let capped = wanted
            .iter()
            .copied()
            .find(|&n| n > limit)
            .map(|n| (n, why));
        let (victim_duration, settle) = if quick {
            (Duration::from_secs(1), Duration::from_millis(500))
        } else {
            (Duration::from_secs(5), Duration::from_secs(3))
        };
        Plan {
            sizes,
            capped,
            victim_rate: 200.0,
            victim_duration,
            settle,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct TunnelsPoint {
    pub tunnels: usize,
    pub open_seconds: f64,
    /// Both ztunnels.
    pub rss_mib: f64,
    pub anon_mib: f64,
    /// (RSS − RSS with no tunnels) / tunnels, both ztunnels, bytes.
    pub bytes_per_tunnel: f64,
    pub victim_rps: f64,
    pub victim_p50_us: f64,
    pub victim_p99_us: f64,
    pub victim_max_us: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct TunnelsCurve {
    pub capture: String,
    pub fd_limit: usize,
    /// The first size asked for that did not fit, if any, and what set the ceiling.
    pub capped_from: Option<usize>,
    pub capped_by: Option<String>,
    pub victim_rate: f64,
    pub victim_seconds: f64,
    /// The baseline: no idle tunnels.
    pub points: Vec<TunnelsPoint>,
}

fn usage(env: &Env) -> (f64, f64) {
    let rd: Vec<procstat::Reading> = env
        .proxy_pids()
        .iter()
        .filter_map(|(_, p)| procstat::read(*p))
        .collect();
    (
        rd.iter().map(|r| r.rss_kib as f64 / 1024.0).sum(),
        rd.iter().map(|r| r.anon_kib as f64 / 1024.0).sum(),
    )
}

pub fn run(plan: &Plan, bins: &Binaries) -> Result<TunnelsCurve> {
    let mut env =
        Env::start(Mode::L4, 0, bins, crate::Outside::None).context("set up the L4 topology")?;
    // Every tunnel joins the same two addresses (one client pod, one echo port): with the
    // default range (32768-60999, connect() preferring even ports) the kernel's search
    // for a free source port grows long past ~10,000 connections, in the client and in
    // the server pod where ztunnel delivers from the client's address. That is this
    // topology's cost, not the proxies': every netns of it gets the widest range.
    let client = env
        .client_ns
        .file_name()
        .and_then(|n| n.to_str())
        .context("client netns name")?
        .to_string();
    let prefix = client
        .strip_suffix("-n1p1")
        .context("client netns is n1p1")?;
    for ns in ["n1p1", "n2p1", "n1", "n2"] {
        mesh_tests::netsim::Netns {
            name: format!("{prefix}-{ns}"),
        }
        .exec(
            "sysctl",
            &["-qw", "net.ipv4.ip_local_port_range=1024 65535"],
        )?;
    }
    // Certificates and the pooled HBONE connection, as in the main suite.
    load::max_rate(&env.client_ns, env.http, 4, Duration::from_millis(500)).context("warm-up")?;
    let mut curve = TunnelsCurve {
        capture: mesh_tests::netsim::capture_mode(),
        fd_limit: fd_limit(),
        capped_from: plan.capped.as_ref().map(|(n, _)| *n),
        capped_by: plan.capped.as_ref().map(|(_, why)| why.clone()),
        victim_rate: plan.victim_rate,
        victim_seconds: plan.victim_duration.as_secs_f64(),
        points: Vec::new(),
    };
    let mut held: Vec<load::IdleConns> = Vec::new();
    let mut base_rss = 0.0;
    for n in std::iter::once(0).chain(plan.sizes.iter().copied()) {
        crate::cleanup::check()?;
        env.check_alive()?;
        let have: usize = held.iter().map(|h| h.conns.len()).sum();
        let mut open_seconds = 0.0;
        if n > have {
            // Bounded: about 4x the time the slowest path needs on this machine.
            let deadline = Duration::from_secs_f64(((n - have) as f64 / 250.0).max(10.0));
            let c = load::open_idle(&env.client_ns, env.echo, n - have, deadline)?;
            open_seconds = c.open_seconds;
            held.push(c);
        }
        let established: usize = held.iter().map(|h| h.conns.len()).sum();
        std::thread::sleep(plan.settle);
        let (rss, anon) = usage(&env);
        if n == 0 {
            base_rss = rss;
        }
        let v = load::constant_rate(
            &env.client_ns,
            env.http,
            plan.victim_rate,
            1,
            plan.victim_duration,
        )
        .context("victim")?;
        let p = TunnelsPoint {
            tunnels: established,
            open_seconds,
            rss_mib: rss,
            anon_mib: anon,
            bytes_per_tunnel: if established > 0 {
                (rss - base_rss) * 1048576.0 / established as f64
            } else {
                0.0
            },
            victim_rps: v.achieved_rps,
            victim_p50_us: v.latency.p50_us,
            victim_p99_us: v.latency.p99_us,
            victim_max_us: v.latency.max_us,
        };
        progress!(
            "tunnels {established:>6} held (opened in {open_seconds:.1} s): ztunnels RSS {rss:.1} MiB, {:.0} B/tunnel; victim {:.0} req/s p50 {:.0} us p99 {:.0} us",
            p.bytes_per_tunnel,
            p.victim_rps,
            p.victim_p50_us,
            p.victim_p99_us
        );
        curve.points.push(p);
        anyhow::ensure!(established >= n, "only {established} of {n} tunnels opened");
    }
    drop(held);
    Ok(curve)
}
