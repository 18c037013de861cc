//! Benchmark suite (issue 7): no mesh vs ztunnel L4 (HBONE) vs ztunnel + waypoint, and
//! optionally a reference node proxy in ztunnel's place, on a network-namespace topology
//! in one run. See docs/benchmarks.md for the method and `bench --help` for the flags.

// Before the modules: `bench scale`'s use it too.
/// Logged as it happens, so a long run shows where it is.
macro_rules! progress {
    ($($t:tt)*) => {{
        use std::io::Write;
        println!("[{:>7.1}s] {}", $crate::started().elapsed().as_secs_f64(), format!($($t)*));
        let _ = std::io::stdout().flush();
    }};
}

mod capture;
mod cleanup;
mod l7;
mod load;
mod modes;
mod plot;
mod procstat;
mod report;
mod scale;
mod server;
mod summary;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde::{Deserialize, Serialize};

use modes::{Env, Mode};

#[derive(Parser, Debug)]
#[command(
    about = "Mesh benchmark on a netns topology: direct vs ztunnel L4 vs ztunnel + waypoint (vs --reference)"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Where results.md, results.json and the plots go (`scale`: scale.md, scale.json, scale-*.svg).
    #[arg(long, default_value = "target/bench", global = true)]
    out: PathBuf,
    /// Smoke run: short steps, two rates, small bulk and idle counts (well under 2 minutes);
    /// with a subcommand, one round of a few connections and requests.
    #[arg(long, global = true)]
    quick: bool,
    /// Another node-proxy binary run in ztunnel's place (it must accept ztunnel's command
    /// line: --local-xds-path, --node-name, --state-dir, --capture, --bpf-pin-dir, --pod,
    /// and answer 200 on :15021/healthz/ready in the node netns).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Another node-proxy binary run as istio-cni runs Istio's ztunnel: configured by
    /// environment variables (LOCAL_XDS_PATH, NODE_NAME, INPOD_UDS, FAKE_CA=true,
    /// XDS_ADDRESS empty), pods over ZDS from `ztunnel cni-server`, captured by
    /// istio-cni's in-pod nftables rules. Istio's ztunnel needs `--features testing`
    /// for FAKE_CA.
    #[arg(long)]
    reference_zds: Option<PathBuf>,
    /// ztunnel binary (default: next to this binary).
    #[arg(long, global = true)]
    ztunnel: Option<PathBuf>,
    /// waypoint binary (default: next to this binary).
    #[arg(long)]
    waypoint: Option<PathBuf>,
    /// Seconds per measured step (default 15, quick 2).
    #[arg(long)]
    duration: Option<f64>,
    /// Constant-rate steps in req/s, comma-separated.
    #[arg(long, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// Bulk transfer size in MiB (default 1024, quick 64).
    #[arg(long)]
    bulk_mib: Option<u64>,
    /// Idle tunnels to hold open (default 10000, quick 500).
    #[arg(long)]
    idle: Option<usize>,
    /// Only these modes: direct, l4, waypoint, reference, reference-zds (default: all available).
    #[arg(long, value_delimiter = ',')]
    modes: Option<Vec<String>>,
    /// Only these scenarios: rate, max, bulk, conn, idle (default: all).
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<String>>,
    /// Run the scenarios this many times, the order of the modes reversed every other
    /// round (no mode always goes first); results.md adds each step's median over the
    /// rounds and the ratios of the medians. Idle tunnels run in the last round only.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    rounds: u32,
    /// The server pod outside the mesh (no workload, not enrolled): the client's node
    /// proxy relays plain TCP to it (passthrough, TCP ⇄ TCP) and the server's carries
    /// nothing. The waypoint mode needs a mesh server and is left out.
    #[arg(long)]
    passthrough: bool,
    /// The client pod outside the mesh (no workload, not enrolled): it reaches the server
    /// in plain TCP, which the server's node proxy captures (inbound plaintext) and
    /// delivers from the client's address (TCP ⇄ TCP). The waypoint mode is left out.
    #[arg(long, conflicts_with = "passthrough")]
    plaintext_client: bool,
    /// Internal: run the server app in this netns (the bench starts itself this way).
    #[arg(long, hide = true)]
    serve: Option<PathBuf>,
}

/// Focused comparisons beside the main suite, printed as tables (`scale` also writes files).
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Capture alone: connection rate and 1 KiB round trips with eBPF, nftables and no
    /// capture, for a fully meshed pair and for inbound capture only (ARCHITECTURE.md).
    Capture,
    /// The L7 hop: keep-alive HTTP/1.1 latency and proxy CPU per request, direct vs L4 vs
    /// waypoint, and the waypoint with one L7 feature on per path (ext_authz, JWT, tracing,
    /// access log, DestinationRule, VirtualService fault) (docs/benchmarks.md).
    L7 {
        /// Requests per round (default 5000; quick 50).
        #[arg(long)]
        requests: Option<usize>,
        /// Interleaved rounds (default 5; quick 1); medians are over them.
        #[arg(long)]
        rounds: Option<usize>,
        /// Paths to run, comma-separated (default: all; quick: direct,l4,waypoint,ext_authz).
        /// direct, l4, waypoint, ext_authz, jwt, tracing, log_filter, log_all, dest_rule, vs_fault.
        #[arg(long, value_delimiter = ',', value_parser = l7::Path::parse)]
        paths: Option<Vec<l7::Path>>,
    },
    /// Scale curves (issue 19): ztunnel against a fake istiod serving 1k-50k workloads
    /// (time to apply the state and one push, RSS, CPU per push, policy evaluation),
    /// 1-200 pods enrolled over ZDS on one node (RSS, fds, enrollment time, idle CPU),
    /// and 1k-50k idle tunnels (RSS per tunnel, a victim's latency); writes scale.md,
    /// scale.json and scale-<curve>.svg to --out (docs/benchmarks.md).
    Scale {
        /// Curves to run, comma-separated: config, pods, tunnels (default: all).
        #[arg(long, value_delimiter = ',', value_parser = scale::Curve::parse)]
        curves: Option<Vec<scale::Curve>>,
    },
    /// Print the current-results page (one table per scenario, medians over the rounds,
    /// ours over the reference) of a stored run's results.json; every run also writes it
    /// as summary.md. docs/benchmarks/current.md is this page.
    Summary {
        /// A results.json written by a run.
        from: PathBuf,
        /// The commit the run measured, for a run that did not record it.
        #[arg(long)]
        commit: Option<String>,
        /// What a mode was, `MODE=TEXT` (repeatable), e.g.
        /// `reference-zds-l4="Istio's ztunnel 1.28, istio-cni capture"`: printed as a legend.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(m, t)| (m.trim().to_string(), t.trim().to_string()))
        .filter(|(m, t)| !m.is_empty() && !t.is_empty())
        .ok_or_else(|| format!("--label wants MODE=TEXT, got {s:?}"))
}

/// `bench summary`: no root, no binaries, only the stored run.
fn summarize(
    from: &std::path::Path,
    commit: Option<&str>,
    labels: &[(String, String)],
) -> Result<()> {
    let text = std::fs::read_to_string(from).with_context(|| format!("read {}", from.display()))?;
    let mut res: Results = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a results.json written by bench", from.display()))?;
    if let Some(c) = commit {
        res.commit = c.to_string();
    }
    print!("{}", summary::with_legend(&summary::markdown(&res), labels));
    Ok(())
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Plan {
    pub quick: bool,
    pub step_seconds: f64,
    pub warmup_seconds: f64,
    pub rates: Vec<f64>,
    pub rate_connections: usize,
    pub max_rate_connections: Vec<usize>,
    pub bulk_bytes: u64,
    pub conn_rate_workers: usize,
    pub idle_connections: usize,
    pub rounds: usize,
    /// The pod left outside the mesh, if any (`--passthrough`, `--plaintext-client`).
    pub outside: Outside,
}

/// Which pod a run leaves outside the mesh: with the server outside, the client's node
/// proxy relays plain TCP to it (outbound passthrough); with the client outside, the
/// server's captures its plain TCP (inbound plaintext).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outside {
    #[default]
    None,
    Server,
    Client,
}

impl Outside {
    fn from_args(a: &Args) -> Outside {
        match (a.passthrough, a.plaintext_client) {
            (true, _) => Outside::Server,
            (_, true) => Outside::Client,
            _ => Outside::None,
        }
    }

    /// The flag that leaves the pod out, if one does.
    fn flag(self) -> Option<&'static str> {
        match self {
            Outside::None => None,
            Outside::Server => Some("--passthrough"),
            Outside::Client => Some("--plaintext-client"),
        }
    }
}

/// What the proxies (all ztunnels and the waypoint of a mode) used during one measurement.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Usage {
    pub wall_s: f64,
    pub cpu_s: f64,
    /// cpu_s / wall_s: cores busy on average.
    pub vcpu: f64,
    /// Requests, connections or GiB the CPU is divided by.
    pub units: f64,
    /// CPU seconds per 1000 units (per GiB for bulk).
    pub cpu_s_per_1000: f64,
    /// Sum of VmRSS at the end of the measurement, MiB.
    pub rss_mib: f64,
    /// Sum of VmHWM over the measurement (peaks reset at its start), MiB.
    pub peak_mib: f64,
    /// Sum of RssAnon at the end, MiB: RSS without the mapped binary's pages, which
    /// are most of a ztunnel's RSS.
    pub anon_mib: f64,
    /// CPU seconds of the server app per 1000 units: what one ordinary process hop (a
    /// wake-up, a read, an HTTP parse, a write) costs on this machine, in every mode.
    pub app_cpu_s_per_1000: f64,
    pub processes: Vec<ProcUsage>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcUsage {
    pub name: String,
    pub cpu_s: f64,
    pub vcpu: f64,
    pub rss_mib: f64,
    pub peak_mib: f64,
    pub anon_mib: f64,
}

struct Meter {
    start: Instant,
    before: Vec<(String, u32, procstat::Reading)>,
    app: (u32, procstat::Reading),
}

impl Meter {
    fn start(env: &Env) -> Meter {
        let before = env
            .proxy_pids()
            .into_iter()
            .map(|(name, pid)| {
                let _ = procstat::reset_peak(pid);
                (name, pid, procstat::read(pid).unwrap_or_default())
            })
            .collect();
        let app = env.server_pid();
        Meter {
            start: Instant::now(),
            before,
            app: (app, procstat::read(app).unwrap_or_default()),
        }
    }

    fn finish(self, units: f64, per_gib: bool) -> Usage {
        let wall_s = self.start.elapsed().as_secs_f64();
        let mib = |kib: u64| kib as f64 / 1024.0;
        let processes: Vec<ProcUsage> = self
            .before
            .iter()
            .map(|(name, pid, b)| {
                let a = procstat::read(*pid).unwrap_or_default();
                let cpu_s = a.cpu.saturating_sub(b.cpu).as_secs_f64();
                ProcUsage {
                    name: name.clone(),
                    cpu_s,
                    vcpu: cpu_s / wall_s,
                    rss_mib: mib(a.rss_kib),
                    peak_mib: mib(a.hwm_kib),
                    anon_mib: mib(a.anon_kib),
                }
            })
            .collect();
        let cpu_s = total(processes.iter().map(|p| p.cpu_s));
        let scale = if per_gib { 1.0 } else { 1000.0 };
        let per_unit = |cpu: f64| {
            if units > 0.0 {
                cpu / units * scale
            } else {
                0.0
            }
        };
        let app_cpu_s = procstat::read(self.app.0)
            .unwrap_or_default()
            .cpu
            .saturating_sub(self.app.1.cpu)
            .as_secs_f64();
        Usage {
            wall_s,
            cpu_s,
            vcpu: cpu_s / wall_s,
            units,
            cpu_s_per_1000: per_unit(cpu_s),
            app_cpu_s_per_1000: per_unit(app_cpu_s),
            rss_mib: total(processes.iter().map(|p| p.rss_mib)),
            peak_mib: total(processes.iter().map(|p| p.peak_mib)),
            anon_mib: total(processes.iter().map(|p| p.anon_mib)),
            processes,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row<T> {
    pub mode: String,
    /// 0-based, see `--rounds`.
    #[serde(default)]
    pub round: usize,
    pub result: T,
    pub usage: Usage,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct IdleResult {
    pub requested: usize,
    pub established: usize,
    pub open_seconds: f64,
    pub rss_before_mib: f64,
    pub rss_after_mib: f64,
    /// (RSS with the tunnels open - RSS before) / established, all proxies, bytes.
    pub bytes_per_conn: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Results {
    pub date: String,
    /// `git describe --always --dirty` of the directory bench ran in (the binaries' source
    /// when they were built there); empty when unknown.
    pub commit: String,
    pub host: String,
    pub command: String,
    /// /proc/loadavg before and after: other work on the machine shows up here.
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub plan: Option<Plan>,
    pub modes: Vec<String>,
    pub constant_rate: Vec<Row<load::RateResult>>,
    pub max_rate: Vec<Row<load::MaxRateResult>>,
    pub bulk: Vec<Row<load::BulkResult>>,
    pub conn_rate: Vec<Row<load::ConnRateResult>>,
    pub idle: Vec<Row<IdleResult>>,
    pub errors: Vec<String>,
}

fn plan(a: &Args) -> Plan {
    let quick = a.quick;
    let outside = Outside::from_args(a);
    Plan {
        quick,
        step_seconds: a.duration.unwrap_or(if quick { 2.0 } else { 15.0 }),
        warmup_seconds: if quick { 0.5 } else { 2.0 },
        rates: a.rates.clone().unwrap_or_else(|| {
            if quick {
                vec![500.0, 1000.0]
            } else {
                vec![500.0, 750.0, 1000.0, 1250.0, 1500.0]
            }
        }),
        rate_connections: 4,
        max_rate_connections: vec![1, 32],
        bulk_bytes: a.bulk_mib.unwrap_or(if quick { 64 } else { 1024 }) << 20,
        conn_rate_workers: 4,
        idle_connections: idle_fd_room(outside, a.idle.unwrap_or(if quick { 500 } else { 10_000 })),
        rounds: a.rounds as usize,
        outside,
    }
}

/// With a pod outside the mesh, one node proxy holds both descriptors of each idle
/// connection (the captured one and its own to the other pod) under the hard
/// RLIMIT_NOFILE it inherits (20,000 on this machine, and raising it needs
/// CAP_SYS_RESOURCE), so `n` is capped to fit.
fn idle_fd_room(outside: Outside, n: usize) -> usize {
    let Ok((_, hard)) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
    else {
        return n;
    };
    let room = usize::try_from(hard.saturating_sub(1024) / 2).unwrap_or(usize::MAX);
    if outside != Outside::None && n > room {
        progress!("{outside:?} outside the mesh: {room} idle connections instead of {n} (two descriptors each in one proxy; hard RLIMIT_NOFILE {hard})");
        room
    } else {
        n
    }
}

/// A sum that is +0 when there is nothing to add (`Iterator::sum` of no floats is -0.0,
/// which printed as "-0.000" for the mode without proxies).
fn total(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |a, b| a + b)
}

fn started() -> Instant {
    static T: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *T.get_or_init(Instant::now)
}

fn main() -> Result<()> {
    started();
    let args = Args::parse();
    // Both ends of 10,000 idle tunnels need file descriptors: take the hard limit (raising
    // it needs CAP_SYS_RESOURCE, which a container may not have).
    if let Ok((_, hard)) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
    {
        let _ =
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    }
    if let Some(ns) = &args.serve {
        return server::serve_main(ns);
    }
    if let Some(Command::Summary {
        from,
        commit,
        labels,
    }) = &args.command
    {
        return summarize(from, commit.as_deref(), labels);
    }
    if !nix::unistd::Uid::effective().is_root() {
        bail!("bench needs root (network namespaces, eBPF)");
    }
    cleanup::install()?;
    let here = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let bins = modes::Binaries {
        ztunnel: args.ztunnel.clone().unwrap_or_else(|| here.join("ztunnel")),
        waypoint: args
            .waypoint
            .clone()
            .unwrap_or_else(|| here.join("waypoint")),
    };
    for b in [&bins.ztunnel, &bins.waypoint]
        .into_iter()
        .chain(args.reference.as_ref())
        .chain(args.reference_zds.as_ref())
    {
        if !b.exists() {
            bail!("{} not found (build it: cargo build --release -p ztunnel -p waypoint -p bench, or pass --ztunnel/--waypoint)", b.display());
        }
    }
    // The harness starts proxies by itself in the subcommands: these binaries, not a build.
    mesh_tests::bins::use_binaries(bins.ztunnel.clone(), bins.waypoint.clone())?;
    match args.command {
        Some(Command::Capture) => return capture::main(args.quick),
        Some(Command::L7 {
            requests,
            rounds,
            paths,
        }) => return l7::main(args.quick, requests, rounds, paths),
        Some(Command::Scale { curves }) => {
            return scale::main(args.quick, curves, &args.out, &bins)
        }
        Some(Command::Summary { .. }) | None => {}
    }
    let outside = Outside::from_args(&args);
    if let Some(flag) = outside.flag().filter(|_| {
        args.modes
            .as_ref()
            .is_some_and(|m| m.iter().any(|x| x == "waypoint"))
    }) {
        bail!("{flag} leaves a pod outside the mesh, where no waypoint applies: drop waypoint from --modes");
    }
    let mut all = if outside != Outside::None {
        vec![Mode::Direct, Mode::L4]
    } else {
        vec![Mode::Direct, Mode::L4, Mode::Waypoint]
    };
    if let Some(r) = &args.reference {
        all.push(Mode::Reference(std::fs::canonicalize(r)?));
    }
    if let Some(r) = &args.reference_zds {
        all.push(Mode::ReferenceZds(std::fs::canonicalize(r)?));
    }
    let key = |m: &Mode| match m {
        Mode::Direct => "direct",
        Mode::L4 => "l4",
        Mode::Waypoint => "waypoint",
        Mode::Reference(_) => "reference",
        Mode::ReferenceZds(_) => "reference-zds",
    };
    let modes: Vec<Mode> = all
        .into_iter()
        .filter(|m| {
            args.modes
                .as_ref()
                .is_none_or(|w| w.iter().any(|x| x == key(m)))
        })
        .collect();
    let wants = |s: &str| {
        args.scenarios
            .as_ref()
            .is_none_or(|w| w.iter().any(|x| x == s))
    };
    let plan = plan(&args);
    std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _rt = rt.enter();
    let mut res = Results {
        date: sh_out("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        commit: sh_out("git", &["describe", "--always", "--dirty"]),
        host: host_info(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        loadavg_start: loadavg(),
        plan: Some(plan.clone()),
        modes: modes.iter().map(|m| m.name().to_string()).collect(),
        ..Default::default()
    };
    progress!("plan: {plan:?}");
    let run = run_all(&modes, &bins, &plan, &wants, &mut res);
    if let Err(e) = &run {
        res.errors.push(format!("{e:#}"));
    }
    res.loadavg_end = loadavg();
    report::write_all(&args.out, &res)?;
    progress!(
        "wrote {}/results.md, summary.md, results.json, latency.svg",
        args.out.display()
    );
    run?;
    if !res.errors.is_empty() {
        bail!(
            "{} scenario(s) failed: {}",
            res.errors.len(),
            res.errors.join("; ")
        );
    }
    Ok(())
}

fn run_all(
    modes: &[Mode],
    bins: &modes::Binaries,
    plan: &Plan,
    wants: &dyn Fn(&str) -> bool,
    res: &mut Results,
) -> Result<()> {
    let mut envs = Vec::new();
    for (i, m) in modes.iter().enumerate() {
        progress!("setting up {}", m.name());
        let env = Env::start(m.clone(), i, bins, plan.outside)
            .with_context(|| format!("set up {}", m.name()))?;
        // Warm up: certificates, pooled HBONE connections, the waypoint's upstreams.
        load::max_rate(&env.client_ns, env.http, 4, Duration::from_millis(500))
            .with_context(|| format!("{} warm-up", m.name()))?;
        envs.push(env);
    }
    progress!("all modes up");
    let step = Duration::from_secs_f64(plan.step_seconds);
    // One scenario step for every mode, back to back, so drift hits all modes alike; in
    // every other round the modes go in reverse order, so none always goes first.
    let mut each = |round: usize,
                    label: &str,
                    res: &mut Results,
                    f: &mut dyn FnMut(&Env, &mut Results) -> Result<String>|
     -> Result<()> {
        let mut order: Vec<&mut Env> = envs.iter_mut().collect();
        if round % 2 == 1 {
            order.reverse();
        }
        let label = if plan.rounds > 1 {
            format!("{label} [{}]", round + 1)
        } else {
            label.to_string()
        };
        for env in order {
            cleanup::check()?;
            let name = env.mode.name();
            let r = env.check_alive().and_then(|()| f(env, res));
            match r {
                Ok(line) => progress!("{label:<22} {name:<17} {line}"),
                Err(e) => {
                    cleanup::check()?;
                    progress!("{label:<22} {name:<17} FAILED: {e:#}");
                    res.errors.push(format!("{name} {label}: {e:#}"));
                }
            }
        }
        Ok(())
    };
    for round in 0..plan.rounds {
        if wants("rate") {
            for &rate in &plan.rates {
                each(
                    round,
                    &format!("constant {rate} req/s"),
                    res,
                    &mut |env, res| {
                        let warm = Duration::from_secs_f64(plan.warmup_seconds);
                        load::constant_rate(
                            &env.client_ns,
                            env.http,
                            rate,
                            plan.rate_connections,
                            warm,
                        )?;
                        let m = Meter::start(env);
                        let r = load::constant_rate(
                            &env.client_ns,
                            env.http,
                            rate,
                            plan.rate_connections,
                            step,
                        )?;
                        let u = m.finish(r.latency.count as f64, false);
                        let line = format!(
                        "{:>7.0} req/s  p50 {:>6.0} p90 {:>6.0} p99 {:>6.0} p99.9 {:>6.0} us  proxy {:.3} vCPU {:.3} cpu-s/1k req",
                        r.achieved_rps, r.latency.p50_us, r.latency.p90_us, r.latency.p99_us, r.latency.p999_us, u.vcpu, u.cpu_s_per_1000
                    );
                        res.constant_rate.push(Row {
                            mode: env.mode.name().into(),
                            round,
                            result: r,
                            usage: u,
                        });
                        Ok(line)
                    },
                )?;
            }
        }
        if wants("max") {
            for &c in &plan.max_rate_connections {
                each(
                    round,
                    &format!("max rate {c} conn"),
                    res,
                    &mut |env, res| {
                        let m = Meter::start(env);
                        let r = load::max_rate(&env.client_ns, env.http, c, step)?;
                        let u = m.finish(r.requests as f64, false);
                        let line = format!(
                            "{:>7.0} req/s  p50 {:>6.0} p99 {:>6.0} us  proxy {:.3} cpu-s/1k req",
                            r.rps, r.latency.p50_us, r.latency.p99_us, u.cpu_s_per_1000
                        );
                        res.max_rate.push(Row {
                            mode: env.mode.name().into(),
                            round,
                            result: r,
                            usage: u,
                        });
                        Ok(line)
                    },
                )?;
            }
        }
        if wants("bulk") {
            each(
                round,
                &format!("bulk {} MiB", plan.bulk_bytes >> 20),
                res,
                &mut |env, res| {
                    let m = Meter::start(env);
                    let r = load::bulk(&env.client_ns, env.sink, plan.bulk_bytes)?;
                    let u = m.finish(r.bytes as f64 / (1u64 << 30) as f64, true);
                    let line = format!(
                        "{:>6.2} Gbit/s  {:.2} s  proxy {:.3} cpu-s/GiB",
                        r.gbit_per_s, r.seconds, u.cpu_s_per_1000
                    );
                    res.bulk.push(Row {
                        mode: env.mode.name().into(),
                        round,
                        result: r,
                        usage: u,
                    });
                    Ok(line)
                },
            )?;
        }
        if wants("conn") {
            each(round, "new connections", res, &mut |env, res| {
                let m = Meter::start(env);
                let r = load::conn_rate(&env.client_ns, env.echo, plan.conn_rate_workers, step)?;
                let u = m.finish(r.connections as f64, false);
                let line = format!(
                    "{:>7.0} conn/s  p50 {:>6.0} p99 {:>6.0} us  {} errors  proxy {:.3} cpu-s/1k conn",
                    r.conn_per_s, r.latency.p50_us, r.latency.p99_us, r.errors, u.cpu_s_per_1000
                );
                res.conn_rate.push(Row {
                    mode: env.mode.name().into(),
                    round,
                    result: r,
                    usage: u,
                });
                Ok(line)
            })?;
        }
        // Memory per idle tunnel is the RSS a fresh set of tunnels adds: once the proxies have
        // held 10,000, their allocators keep the room, so it is measured in the last round only.
        if wants("idle") && round + 1 == plan.rounds {
            let n = plan.idle_connections;
            each(round, &format!("{n} idle tunnels"), res, &mut |env, res| {
                let rss = |env: &Env| -> f64 {
                    total(
                        env.proxy_pids()
                            .iter()
                            .filter_map(|(_, p)| procstat::read(*p))
                            .map(|r| r.rss_kib as f64 / 1024.0),
                    )
                };
                let before = rss(env);
                let m = Meter::start(env);
                // Bounded: about 4x the time the slowest path needs on this machine.
                let deadline = Duration::from_secs_f64((n as f64 / 250.0).max(10.0));
                let conns = load::open_idle(&env.client_ns, env.echo, n, deadline)?;
                // Let the proxies settle (allocator, lazily grown buffers) before reading RSS.
                std::thread::sleep(Duration::from_secs(if plan.quick { 1 } else { 3 }));
                let after = rss(env);
                let established = conns.conns.len();
                let u = m.finish(established as f64, false);
                let r = IdleResult {
                    requested: n,
                    established,
                    open_seconds: conns.open_seconds,
                    rss_before_mib: before,
                    rss_after_mib: after,
                    bytes_per_conn: if established > 0 {
                        (after - before) * 1048576.0 / established as f64
                    } else {
                        0.0
                    },
                };
                let line = format!("{established} open in {:.1} s  proxy RSS {before:.1} -> {after:.1} MiB  {:.0} B/conn", r.open_seconds, r.bytes_per_conn);
                res.idle.push(Row {
                    mode: env.mode.name().into(),
                    round,
                    result: r,
                    usage: u,
                });
                drop(conns);
                // Connections closing take the proxies a moment; the next mode starts clean.
                std::thread::sleep(Duration::from_millis(500));
                if established < n {
                    bail!("only {established} of {n} tunnels opened in {deadline:?}");
                }
                Ok(line)
            })?;
        }
    }
    progress!("stopping");
    Ok(())
}

fn sh_out(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn host_info() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{cores} vCPU ({cpu}), Linux {}", sh_out("uname", &["-r"]))
}
