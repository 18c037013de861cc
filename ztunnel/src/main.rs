//! ztunnel binary: loads the mesh config, starts the built-in CA, enrolls pods.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

use ztunnel::app::{cert_manager, init_logging, serve_observability, BuiltinCa, ReloadableLog};
use ztunnel::config::istio_env::Env;
use ztunnel::config::settings::{
    ListenAddress, RedactedHeader, RootCertSource, Settings, SocketConfig,
};
use ztunnel::config::{CaptureMode, LocalConfig, ProxyConfig};
use ztunnel::hbone::Pool;
use ztunnel::netns::InPodNetns;
use ztunnel::proxy::{self, ProxyInputs};
use ztunnel::state::SharedState;
use ztunnel::state::WorkloadUid;

// The global allocator, a build-time choice (default: the C library's malloc);
// `ztunnel::memory` releases free heap under whichever this is. Measured in
// docs/benchmarks.md ("The allocator").
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(clap::Parser, Debug)]
#[command(
    name = "ztunnel",
    version,
    about = "Ambient mesh node proxy (HBONE, mTLS, L4 policy)",
    after_help = "Istio's container arguments `proxy ztunnel` are accepted (and mean: run the proxy); so is `version`. Istio's environment variables: docs/environment.md."
)]
#[command(subcommand_negates_reqs = true, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: Args,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Play the istio-cni agent's side of ZDS for a standalone node: serve the pods
    /// recorded in --pods-dir (by `ztunnel enroll`) to the node's ztunnel.
    CniServer {
        #[arg(long, default_value = ztunnel::zds::DEFAULT_SOCKET)]
        socket: PathBuf,
        #[arg(long)]
        pods_dir: PathBuf,
    },
    /// Enroll a pod: record it for the CNI server, which sends ztunnel an Add with its netns.
    Enroll {
        #[arg(long)]
        pods_dir: PathBuf,
        #[arg(long)]
        uid: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        namespace: String,
        #[arg(long, default_value = "default")]
        service_account: String,
        /// The pod's network namespace, e.g. /var/run/netns/pod-a
        #[arg(long)]
        netns: PathBuf,
    },
    /// Remove a pod from the mesh (the CNI server sends ztunnel a Del).
    Unenroll {
        #[arg(long)]
        pods_dir: PathBuf,
        #[arg(long)]
        uid: String,
    },
}

#[derive(clap::Args, Debug)]
struct Args {
    /// Local mesh config (Istio's local config YAML: workloads, services, policies).
    /// Without it, mesh state comes from istiod (XDS_ADDRESS; its default in Kubernetes).
    #[arg(long, env = "LOCAL_XDS_PATH")]
    local_xds_path: Option<PathBuf>,
    /// The local mesh config inline (Istio's LOCAL_XDS), instead of a file.
    #[arg(
        long,
        env = "LOCAL_XDS",
        conflicts_with = "local_xds_path",
        hide_env_values = true
    )]
    local_xds: Option<String>,
    #[command(flatten)]
    istiod: ztunnel::istiod::IstiodArgs,
    /// This node's name; only workloads with `node: <this>` may be enrolled here.
    #[arg(long, env = "NODE_NAME", required = true)]
    node_name: Option<String>,
    /// Where the built-in CA keeps its root when --ca-cert/--ca-key are not given.
    #[arg(long, env = "ZTUNNEL_STATE_DIR", default_value = "/var/lib/ztunnel")]
    state_dir: PathBuf,
    /// Use the built-in CA even with istiod (Istio's FAKE_CA): self-signed, per node
    /// unless --ca-cert/--ca-key give a shared root.
    #[arg(long, env = "FAKE_CA", default_value_t = false, action = clap::ArgAction::Set)]
    fake_ca: bool,
    /// The built-in CA's root certificate (PEM), with --ca-key: one root shared by every node.
    #[arg(long, requires = "ca_key")]
    ca_cert: Option<PathBuf>,
    /// The built-in CA's private key (PEM), with --ca-cert.
    #[arg(long, requires = "ca_cert")]
    ca_key: Option<PathBuf>,
    /// Lifetime of issued workload certificates, in seconds (rotated at half-life);
    /// Istio's SECRET_TTL (a duration such as "24h") also sets it.
    #[arg(long, env = "WORKLOAD_CERT_TTL_SECONDS", default_value_t = 24 * 3600)]
    cert_ttl_seconds: u64,
    /// Enroll a pod at start: UID=NETNS_PATH (for example uid1=/var/run/netns/pod-a). Repeatable.
    #[arg(long = "pod", value_name = "UID=NETNS")]
    pods: Vec<String>,
    /// Receive pods from the CNI agent over ZDS on this socket.
    #[arg(long, env = "INPOD_UDS")]
    zds_socket: Option<PathBuf>,
    /// How pods' traffic is captured. eBPF falls back to nftables (with a warning) where the
    /// kernel or the build cannot do it. Default `none` when INPOD_UDS is set in the
    /// environment (istio-cni is there and captures), else `ebpf`.
    #[arg(long, env = "ZTUNNEL_CAPTURE", value_enum, default_value = "ebpf")]
    capture: CaptureMode,
    /// Where eBPF maps and links are pinned (bpffs); capture survives restarts through it.
    #[arg(long, env = "ZTUNNEL_BPF_PIN_DIR", default_value = ztunnel_ebpf::DEFAULT_PIN_DIR)]
    bpf_pin_dir: PathBuf,
    /// The cgroup (v2) the eBPF socket programs attach to; default: the hierarchy's root.
    #[arg(long, env = "ZTUNNEL_CGROUP_PATH")]
    cgroup_path: Option<PathBuf>,
    /// Inbound destination ports never captured, comma-separated (the app answers them itself).
    #[arg(long, env = "EXCLUDE_INBOUND_PORTS", value_delimiter = ',')]
    exclude_inbound_ports: Vec<u16>,
    /// HBONE streams per pooled connection before another connection opens (Istio: 100).
    #[arg(long, env = "POOL_MAX_STREAMS_PER_CONNECTION", default_value_t = 100)]
    pool_max_streams: usize,
    /// Idle pooled HBONE connections close after this many seconds; Istio's
    /// POOL_UNUSED_RELEASE_TIMEOUT (a duration) also sets it.
    #[arg(
        long,
        env = "POOL_UNUSED_RELEASE_TIMEOUT_SECONDS",
        default_value_t = 300
    )]
    pool_idle_timeout_seconds: u64,
    /// Timeout for the proxy's own TCP connects (HBONE dials, passthrough, app delivery).
    #[arg(long, env = "CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// Close a proxied connection after this many seconds without a byte either way
    /// (0: never). Envoy's TCP proxy uses 1 h.
    #[arg(long, env = "CONNECTION_IDLE_TIMEOUT_SECONDS", default_value_t = 3600)]
    idle_timeout_seconds: u64,
    /// Connections one pod may have open through ztunnel at once; more are refused
    /// (0: no limit).
    #[arg(long, env = "MAX_CONNECTIONS_PER_POD", default_value_t = 0)]
    max_connections_per_pod: usize,
    /// Tokio worker threads of the data path: a number, `N%` of the CPUs (ZTUNNEL_CPU_LIMIT
    /// or the container's), or 0 for all (Istio's ztunnel: the same variable). Default 2,
    /// or Istio's CPU-aware default when ZTUNNEL_RESOURCE_CPU_* are set. Not one per
    /// core: a node proxy on a 64-core node does not need 64 workers, and each idle one
    /// adds wake-ups (futex, IPIs) to every request it steals.
    #[arg(long, env = "ZTUNNEL_WORKER_THREADS")]
    worker_threads: Option<String>,
    /// Concurrent streams an HBONE peer may open on one connection (Istio: 200).
    #[arg(long, env = "HBONE_MAX_STREAMS_PER_CONNECTION", default_value_t = ztunnel::hbone::SERVER_MAX_STREAMS)]
    hbone_max_streams: u32,
    /// Largest request header block an HBONE peer may send, in bytes.
    #[arg(long, env = "HBONE_MAX_HEADER_BYTES", default_value_t = ztunnel::hbone::MAX_HEADER_BYTES)]
    hbone_max_header_bytes: u32,
    /// TLS + HTTP/2 handshakes in flight on 15008 at once, all pods together (0: no
    /// limit); more are closed at once and counted.
    #[arg(long, env = "HBONE_MAX_HANDSHAKES", default_value_t = ztunnel::hbone::server::MAX_HANDSHAKES)]
    hbone_max_handshakes: usize,
    /// The same from one source address (an IPv6 /64) (0: no limit).
    #[arg(long, env = "HBONE_MAX_HANDSHAKES_PER_IP", default_value_t = ztunnel::hbone::server::MAX_HANDSHAKES_PER_IP)]
    hbone_max_handshakes_per_ip: usize,
    /// Close an HBONE connection that has had no stream open for this many seconds,
    /// with GOAWAY (0: never).
    #[arg(long, env = "HBONE_IDLE_TIMEOUT_SECONDS", default_value_t = ztunnel::hbone::server::IDLE_TIMEOUT.as_secs())]
    hbone_idle_timeout_seconds: u64,
    /// Admin endpoint (/logging, /quitquitquit); must be a loopback address.
    #[arg(long, default_value = "127.0.0.1:15000")]
    admin_addr: std::net::SocketAddr,
    /// Prometheus metrics (/metrics, /stats/prometheus); `0.0.0.0` means both families
    /// (`[::]`) with IPV6_ENABLED.
    #[arg(long, default_value = "0.0.0.0:15020")]
    metrics_addr: std::net::SocketAddr,
    /// Readiness (/healthz/ready); `0.0.0.0` means both families (`[::]`) with
    /// IPV6_ENABLED.
    #[arg(long, default_value = "0.0.0.0:15021")]
    readiness_addr: std::net::SocketAddr,
    /// The pod's termination grace period; draining ends 5 s before it (1 s if it is 10 s
    /// or less), or after Istio's CONNECTION_TERMINATION_DEADLINE (a duration) when set.
    #[arg(long, env = "TERMINATION_GRACE_PERIOD_SECONDS", default_value_t = 30)]
    termination_grace_period_seconds: u64,
    #[command(flatten)]
    dns: DnsArgs,
    /// Log as JSON (LOG_FORMAT=json) instead of text.
    #[arg(long, env = "LOG_FORMAT", default_value = "text")]
    log_format: String,
}

/// The DNS proxy (127.0.0.1:15053 in every pod).
#[derive(clap::Args, Debug)]
struct DnsArgs {
    /// Run the DNS proxy in every enrolled pod; Istio's ISTIO_META_DNS_CAPTURE (anything
    /// but "true" turns it off) also sets it.
    #[arg(long, env = "DNS_PROXY", default_value_t = true, action = clap::ArgAction::Set)]
    dns_proxy: bool,
    /// Capture the pods' DNS (UDP and TCP port 53) to the DNS proxy. Turn off when someone
    /// else captures (istio-cni with dnsCapture redirects to 15053 itself) or to leave DNS alone.
    #[arg(long, env = "ZTUNNEL_DNS_CAPTURE", default_value_t = true, action = clap::ArgAction::Set)]
    dns_capture: bool,
    /// Upstream resolvers for names outside the mesh and for the hostnames of workloads
    /// without an IP, comma-separated IP or IP:PORT; default: the nameservers of
    /// ztunnel's own /etc/resolv.conf.
    #[arg(long, env = "ZTUNNEL_DNS_UPSTREAM", value_delimiter = ',')]
    dns_upstream: Vec<String>,
    /// The cluster's DNS domain, for search-domain expansion.
    #[arg(long, env = "CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// Forwarded answers cached, at most (0: no cache); the cache also stays under 4 MiB.
    #[arg(long, env = "ZTUNNEL_DNS_CACHE_ENTRIES", default_value_t = 4096)]
    dns_cache_entries: usize,
}

impl DnsArgs {
    fn upstreams(&self) -> anyhow::Result<Vec<std::net::SocketAddr>> {
        if self.dns_upstream.is_empty() {
            // Without upstreams the proxy still answers mesh names (and says why it cannot do more).
            Ok(
                ztunnel::dns::forwarder::read_resolv_conf(std::path::Path::new("/etc/resolv.conf"))
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "DNS: no upstream resolvers");
                        Vec::new()
                    }),
            )
        } else {
            Ok(self
                .dns_upstream
                .iter()
                .map(|s| ztunnel::dns::forwarder::parse_upstream(s))
                .collect::<Result<_, _>>()?)
        }
    }

    fn config(&self, upstreams: Vec<std::net::SocketAddr>, ipv6: bool) -> ztunnel::dns::DnsConfig {
        ztunnel::dns::DnsConfig {
            cluster_domain: self.cluster_domain.clone(),
            upstreams,
            cache_entries: self.dns_cache_entries,
            ipv6,
            ..Default::default()
        }
    }
}

/// Istio's container arguments: `proxy ztunnel` (its chart's) runs the proxy, as no
/// arguments do; `version` prints the version.
fn istio_args(mut argv: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>, String> {
    match argv.get(1).and_then(|a| a.to_str()) {
        Some("proxy") => {
            argv.remove(1);
            match argv.get(1).and_then(|a| a.to_str()) {
                Some("ztunnel") => {
                    argv.remove(1);
                }
                Some(other) if !other.starts_with('-') => {
                    return Err(format!("`proxy {other}`: this binary is the ztunnel node proxy; run it as `proxy ztunnel` or without arguments"));
                }
                _ => {}
            }
        }
        Some("version") if argv.len() == 2 => argv[1] = "--version".into(),
        _ => {}
    }
    Ok(argv)
}

/// Settings that only Istio's environment variables carry (no flag of ours).
#[derive(Debug)]
struct IstioSettings {
    worker_threads: usize,
    termination_deadline: Option<Duration>,
    network: String,
    /// LOCALHOST_APP_TUNNEL (Istio's default: true).
    localhost_app_tunnel: bool,
    /// CRL_PATH: the certificate revocation lists peers are checked against.
    crl_path: Option<std::path::PathBuf>,
    /// IPV6_ENABLED (Istio's default: true).
    ipv6_enabled: bool,
    /// ENABLE_RESPONSE_BAGGAGE (Istio's default: true).
    response_baggage: bool,
    /// Messages for the log, gathered before logging exists.
    warnings: Vec<String>,
    infos: Vec<String>,
}

/// Istio's environment variables over our flags: where both name a setting, our flag or
/// our own variable (given explicitly) wins, with a warning; Istio's otherwise.
fn apply_istio_env(
    args: &mut Args,
    m: &clap::ArgMatches,
    env: &Env,
) -> anyhow::Result<IstioSettings> {
    let explicit = |id: &str| {
        matches!(
            m.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    let mut warnings = ztunnel::config::istio_env::unsupported(env)?;
    let mut infos = Vec::new();
    let mut shadowed =
        |istio: &str, ours: &str| warnings.push(format!("{istio} ignored: {ours} is set and wins"));
    if let Some(ttl) = env.duration("SECRET_TTL")? {
        match explicit("cert_ttl_seconds") {
            true => shadowed(
                "SECRET_TTL",
                "--cert-ttl-seconds (WORKLOAD_CERT_TTL_SECONDS)",
            ),
            false => args.cert_ttl_seconds = ttl.as_secs().max(1),
        }
    }
    if let Some(t) = env.duration("POOL_UNUSED_RELEASE_TIMEOUT")? {
        match explicit("pool_idle_timeout_seconds") {
            true => shadowed(
                "POOL_UNUSED_RELEASE_TIMEOUT",
                "--pool-idle-timeout-seconds (POOL_UNUSED_RELEASE_TIMEOUT_SECONDS)",
            ),
            false => args.pool_idle_timeout_seconds = t.as_secs().max(1),
        }
    }
    // Istio runs its DNS server unless the DNS_CAPTURE metadata says otherwise.
    if let Some(v) = env.get("ISTIO_META_DNS_CAPTURE") {
        let istio = v.eq_ignore_ascii_case("true");
        match explicit("dns_proxy") {
            // Both set and agreeing (our chart derives DNS_PROXY from it): nothing to say.
            true if args.dns.dns_proxy == istio => {}
            true => shadowed("ISTIO_META_DNS_CAPTURE", "--dns-proxy (DNS_PROXY)"),
            false => args.dns.dns_proxy = istio,
        }
    }
    // INPOD_UDS in the environment is how Istio's chart says istio-cni is there; it
    // captures, so ours would redirect the same connections twice. (The --zds-socket flag
    // alone keeps our capture: `ztunnel cni-server` does none.)
    if m.value_source("zds_socket") == Some(ValueSource::EnvVariable) && !explicit("capture") {
        args.capture = CaptureMode::None;
        infos.push("INPOD_UDS is set: istio-cni captures the pods' traffic, so ztunnel's own capture is off (set ZTUNNEL_CAPTURE to change)".into());
    }
    let ipv6_enabled = env.bool("IPV6_ENABLED")?.unwrap_or(true);
    args.metrics_addr = ztunnel::app::both_families(args.metrics_addr, ipv6_enabled);
    args.readiness_addr = ztunnel::app::both_families(args.readiness_addr, ipv6_enabled);
    let worker_threads =
        ztunnel::config::istio_env::worker_threads(env, args.worker_threads.as_deref(), 2)?;
    let socket = ztunnel::netns::SocketOptions {
        keepalive: ztunnel::config::istio_env::Keepalive::from_env(env)?,
        no_port_reuse: env.bool("INPOD_PORT_REUSE")? == Some(false),
        // Without a capture of ours, istio-cni's rules (or whoever captures in its place)
        // route the deliveries' replies, keyed on Istio's mark.
        delivery: match args.capture {
            CaptureMode::None => ztunnel::netns::DeliveryReplies::IstioCni,
            _ => ztunnel::netns::DeliveryReplies::OwnCapture,
        },
    };
    ztunnel::netns::set_socket_options(socket);
    ztunnel::hbone::set_h2_sizes(ztunnel::config::istio_env::h2_sizes(env)?);
    let local_config = args.local_xds_path.is_some() || args.local_xds.is_some();
    let builtin_ca = args.fake_ca || args.ca_cert.is_some();
    warnings.extend(args.istiod.apply_istio_env(env, local_config, builtin_ca)?);
    anyhow::ensure!(
        local_config || args.istiod.xds_address.is_some(),
        "no mesh config: set XDS_ADDRESS (istiod, the default in Kubernetes) or LOCAL_XDS_PATH / --local-xds-path"
    );
    let network = env.get("NETWORK").unwrap_or_default().to_string();
    ztunnel::state::workload::validate_network(&network).map_err(|e| {
        anyhow::anyhow!("NETWORK: {e} (a network name, as the workloads' `network` says)")
    })?;
    Ok(IstioSettings {
        worker_threads,
        termination_deadline: env.duration("CONNECTION_TERMINATION_DEADLINE")?,
        network,
        localhost_app_tunnel: env.bool("LOCALHOST_APP_TUNNEL")?.unwrap_or(true),
        crl_path: env.non_empty("CRL_PATH").map(std::path::PathBuf::from),
        ipv6_enabled,
        response_baggage: env.bool("ENABLE_RESPONSE_BAGGAGE")?.unwrap_or(true),
        warnings,
        infos,
    })
}

/// Every proxied connection holds two sockets; the default soft limit (often 1024) is far
/// too low for a node proxy, so raise it to the hard limit.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised RLIMIT_NOFILE"),
            Err(e) => tracing::warn!(error = %e, "cannot raise RLIMIT_NOFILE"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read RLIMIT_NOFILE"),
    }
}

fn main() -> anyhow::Result<()> {
    let argv = istio_args(std::env::args_os().collect()).map_err(anyhow::Error::msg)?;
    let matches = Cli::command().get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let mut args = cli.run;
    let istio = match cli.cmd {
        None => Some(apply_istio_env(&mut args, &matches, &Env::from_process())?),
        Some(_) => None,
    };
    let log = init_logging(&args.log_format);
    match cli.cmd {
        None => {}
        Some(Cmd::CniServer { socket, pods_dir }) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            return Ok(rt.block_on(ztunnel::zds::server::serve(&socket, &pods_dir))?);
        }
        Some(Cmd::Enroll {
            pods_dir,
            uid,
            name,
            namespace,
            service_account,
            netns,
        }) => {
            anyhow::ensure!(
                netns.exists(),
                "network namespace {} does not exist",
                netns.display()
            );
            let pod = ztunnel::zds::server::PodSpec {
                uid,
                name,
                namespace,
                service_account,
                netns,
            };
            ztunnel::zds::server::write_pod(&pods_dir, &pod)
                .with_context(|| format!("cannot record pod in {}", pods_dir.display()))?;
            return Ok(());
        }
        Some(Cmd::Unenroll { pods_dir, uid }) => {
            ztunnel::zds::server::remove_pod(&pods_dir, &uid)
                .with_context(|| format!("pod {uid} is not enrolled in {}", pods_dir.display()))?;
            return Ok(());
        }
    }
    let Some(istio) = istio else {
        anyhow::bail!("unreachable: no Istio settings for the proxy")
    };
    for w in &istio.warnings {
        tracing::warn!("{w}");
    }
    for i in &istio.infos {
        tracing::info!("{i}");
    }
    raise_fd_limit();
    ztunnel::listen::reserve_spare_fd();
    // Remember our own netns before any thread visits a pod's.
    ztunnel::netns::init().context("cannot open the proxy's own network namespace")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(istio.worker_threads)
        .enable_all()
        .build()?;
    rt.block_on(run(args, istio, log))
}

async fn run(args: Args, istio: IstioSettings, log: ReloadableLog) -> anyhow::Result<()> {
    let Some(node_name) = args.node_name.clone() else {
        anyhow::bail!("--node-name (NODE_NAME) is required");
    };
    // A CRL file that is there but unusable refuses the start (running without it would
    // accept the peers it revokes); later changes are polled for.
    let crls = match &istio.crl_path {
        Some(path) => Some(ztunnel::tls::Crls::load(path)?),
        None => None,
    };
    if let Some(c) = &crls {
        tokio::spawn(c.clone().watch(ztunnel::tls::crl::POLL_INTERVAL));
    }
    let state = Arc::new(SharedState::default());
    if let Some(path) = &args.local_xds_path {
        state.store(LocalConfig::load(path)?.into_state(path)?);
    }
    if let Some(text) = &args.local_xds {
        let path = std::path::Path::new("LOCAL_XDS");
        state.store(LocalConfig::parse(path, text)?.into_state(path)?);
    }
    let ttl = Duration::from_secs(args.cert_ttl_seconds);
    let ia = &args.istiod;
    let builtin = BuiltinCa::LoadOrCreate {
        state_dir: &args.state_dir,
        cert: args.ca_cert.as_deref(),
        key: args.ca_key.as_deref(),
    };
    let certs = cert_manager(ia, ttl, builtin)?;
    let pcfg = ProxyConfig {
        node_name: node_name.clone(),
        pool_max_streams: args.pool_max_streams,
        pool_idle_timeout: Duration::from_secs(args.pool_idle_timeout_seconds),
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        idle_timeout: (args.idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(args.idle_timeout_seconds)),
        max_connections_per_pod: args.max_connections_per_pod,
        hbone_max_streams: args.hbone_max_streams,
        hbone_max_header_bytes: args.hbone_max_header_bytes,
        hbone_max_handshakes: args.hbone_max_handshakes,
        hbone_max_handshakes_per_ip: args.hbone_max_handshakes_per_ip,
        hbone_idle_timeout: (args.hbone_idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(args.hbone_idle_timeout_seconds)),
        localhost_app_tunnel: istio.localhost_app_tunnel,
        network: istio.network.clone(),
        ipv6_enabled: istio.ipv6_enabled,
        response_baggage: istio.response_baggage,
    };
    let mut metrics = ztunnel::metrics::Metrics::default();
    let upstreams = args.dns.upstreams()?;
    let dns = if args.dns.dns_proxy {
        let dns_metrics = ztunnel::metrics::dns::DnsMetrics::register(&mut metrics.registry);
        Some(Arc::new(ztunnel::dns::DnsProxy::new(
            args.dns.config(upstreams.clone(), istio.ipv6_enabled),
            state.clone(),
            dns_metrics,
        )))
    } else {
        None
    };
    let on_demand_dns = Arc::new(ztunnel::dns::on_demand::OnDemandResolver::new(
        ztunnel::dns::on_demand::OnDemandConfig {
            upstreams,
            ipv6: istio.ipv6_enabled,
            ..Default::default()
        },
        ztunnel::metrics::on_demand_dns::OnDemandDnsMetrics::register(&mut metrics.registry),
    ));
    let metrics = Arc::new(metrics);
    let pool = Pool::with_crls(
        certs.clone(),
        pcfg.pool_max_streams,
        pcfg.pool_idle_timeout,
        pcfg.connect_timeout,
        crls.clone().map(|c| (c, metrics.clone())),
    );
    certs.set_metrics(metrics.certs.clone());
    let _ = metrics.process.certs.set(certs.clone());
    let drain = Arc::new(ztunnel::drain::Drain::default());
    anyhow::ensure!(
        args.admin_addr.ip().is_loopback(),
        "--admin-addr {} is not a loopback address; the admin endpoint must stay on localhost",
        args.admin_addr
    );
    let quit = Arc::new(tokio::sync::Notify::new());
    let sockets = ztunnel::netns::socket_options();
    let drain_deadline = istio.termination_deadline.unwrap_or_else(|| {
        ztunnel::drain::deadline_for_grace_period(Duration::from_secs(
            args.termination_grace_period_seconds,
        ))
    });
    let redacted = |h: &[(
        tonic::metadata::AsciiMetadataKey,
        tonic::metadata::AsciiMetadataValue,
    )]| {
        h.iter()
            .map(|(k, _)| RedactedHeader(k.as_str().to_string()))
            .collect::<Vec<_>>()
    };
    let h2 = ztunnel::hbone::h2_sizes();
    let ports = |ip: &str, port: u16| format!("{ip}:{port}");
    let wildcard = if istio.ipv6_enabled {
        "[::]"
    } else {
        "0.0.0.0"
    };
    let settings = Arc::new(Settings {
        proxy: true,
        dns_proxy: args.dns.dns_proxy,
        window_size: h2.stream_window,
        connection_window_size: h2.connection_window,
        frame_size: h2.max_frame,
        socks5_addr: None,
        admin_addr: args.admin_addr.into(),
        stats_addr: args.metrics_addr.into(),
        readiness_addr: args.readiness_addr.into(),
        // Istio's values: its wildcard is `[::]` with IPv6 on (ours: one listener per
        // family, and the outbound one on loopback only).
        inbound_addr: ports(wildcard, ztunnel::ports::HBONE),
        inbound_plaintext_addr: ports(wildcard, ztunnel::ports::INBOUND_PLAINTEXT),
        outbound_addr: ports(wildcard, ztunnel::ports::OUTBOUND),
        dns_proxy_addr: ListenAddress::Localhost(istio.ipv6_enabled, ztunnel::ports::DNS),
        illegal_ports: vec![
            ztunnel::ports::HBONE,
            ztunnel::ports::INBOUND_PLAINTEXT,
            ztunnel::ports::OUTBOUND,
        ],
        network: istio.network.clone(),
        proxy_mode: "Shared",
        proxy_workload_information: None,
        cluster_id: ia.cluster_id.clone(),
        cluster_domain: args.dns.cluster_domain.clone(),
        ca_address: ia.ca_address.clone(),
        ca_root_cert: RootCertSource::of(&ia.ca_root_ca),
        alt_ca_hostname: ia.alt_ca_hostname.clone(),
        xds_address: ia.xds_address.clone(),
        xds_root_cert: RootCertSource::of(&ia.xds_root_ca),
        alt_xds_hostname: ia.alt_xds_hostname.clone(),
        prefered_service_namespace: None,
        secret_ttl: ttl,
        xds_on_demand: false,
        fake_ca: ia.ca_address.is_none(),
        fake_self_inbound: false,
        self_termination_deadline: drain_deadline,
        proxy_metadata: ia
            .node_metadata
            .iter()
            .filter(|(_, v)| v.is_string())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        num_worker_threads: istio.worker_threads,
        require_original_source: true,
        proxy_args: ztunnel::config::settings::redacted_args(std::env::args().skip(1)),
        inpod_uds: args.zds_socket.clone(),
        inpod_port_reuse: !sockets.no_port_reuse,
        packet_mark: ztunnel::PROXY_MARK,
        socket_config: SocketConfig {
            keepalive_time: sockets.keepalive.time,
            keepalive_interval: sockets.keepalive.interval,
            keepalive_retries: sockets.keepalive.retries,
            keepalive_enabled: sockets.keepalive.enabled,
            user_timeout_enabled: sockets.keepalive.user_timeout,
        },
        xds_headers: redacted(&ia.xds_headers),
        ca_headers: redacted(&ia.ca_headers),
        localhost_app_tunnel: istio.localhost_app_tunnel,
        ztunnel_identity: ia
            .ca_address
            .as_ref()
            .map(|_| ia.own_identity().to_string()),
        ipv6_enabled: istio.ipv6_enabled,
        crl_path: istio.crl_path.clone(),
        enable_enhanced_baggage: istio.response_baggage,
        proxy_config: pcfg,
        local_xds_path: args.local_xds_path.clone(),
        capture_mode: format!("{:?}", args.capture).to_lowercase(),
        dns_capture: args.dns.dns_proxy && args.dns.dns_capture,
    });
    let pcfg = &settings.proxy_config;
    let workload_states = Arc::new(ztunnel::proxy::WorkloadStates::default());
    let config_dump = {
        let (state, certs, states, settings, crls) = (
            state.clone(),
            certs.clone(),
            workload_states.clone(),
            settings.clone(),
            crls.clone(),
        );
        Box::new(move || {
            let config = serde_json::to_value(&*settings)
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
            let mut dump = ztunnel::admin::config_dump::dump(&state.load(), &certs, config);
            if let Some(d) = dump.as_object_mut() {
                d.insert(
                    "workloadState".into(),
                    ztunnel::admin::config_dump::workload_state(&states.snapshot()),
                );
                // Ours (Istio's dump has only config.crlPath): the CRLs in force.
                if let Some(c) = &crls {
                    d.insert("crl".into(), c.dump());
                }
            }
            dump
        })
    };
    let admin = Arc::new(ztunnel::admin::Admin {
        log: Box::new(log),
        quit: quit.clone(),
        config_dump,
    });
    let admin_listener = ztunnel::http_endpoint::bind(args.admin_addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.admin_addr))?;
    tokio::spawn(ztunnel::admin::serve(admin_listener, admin));
    serve_observability(&[args.metrics_addr, args.readiness_addr], &metrics).await?;
    let capture = ztunnel::capture::Backend::start(
        args.capture,
        &ztunnel::capture::CaptureOptions {
            bpf_pin_dir: Some(args.bpf_pin_dir.clone()),
            cgroup: args.cgroup_path.clone(),
            exempt_inbound_ports: args.exclude_inbound_ports.clone(),
            capture_dns: args.dns.dns_proxy && args.dns.dns_capture,
        },
    );
    tracing::info!(capture = ?capture, "traffic capture");
    if ia.xds_address.is_some() {
        metrics.wait_for("xds");
        let m = metrics.clone();
        ia.start_xds(
            "ztunnel",
            &node_name,
            &certs,
            state.clone(),
            &metrics,
            move || m.ready_part("xds"),
        )
        .await?;
    }
    // With istiod, the CNI agent (or --pod) may name a pod before istiod pushed it.
    let enroll_wait = if ia.xds_address.is_some() {
        ztunnel::proxy::ENROLL_WAIT
    } else {
        Duration::ZERO
    };
    let hbone_server = Arc::new(ztunnel::hbone::server::Server {
        handshakes: ztunnel::hbone::server::HandshakeLimiter::new(
            pcfg.hbone_max_handshakes,
            pcfg.hbone_max_handshakes_per_ip,
        ),
        max_streams: pcfg.hbone_max_streams,
        max_header_bytes: pcfg.hbone_max_header_bytes,
        idle_timeout: pcfg.hbone_idle_timeout,
        metrics: metrics.clone(),
    });
    let inputs = Arc::new(ProxyInputs {
        hbone_server,
        capture,
        state,
        certs,
        pool,
        cfg: pcfg.clone(),
        metrics: metrics.clone(),
        drain: drain.clone(),
        dns,
        workload_states,
        on_demand_dns,
        crls,
    });

    let pods = ztunnel::proxy::Pods::default();
    for spec in &args.pods {
        let (uid, path) = spec
            .split_once('=')
            .with_context(|| format!("--pod {spec:?}: expected UID=NETNS_PATH"))?;
        let netns = InPodNetns::open(path.as_ref())?;
        let pod = proxy::enroll(
            inputs.clone(),
            &WorkloadUid(uid.to_string()),
            netns,
            enroll_wait,
        )
        .await
        .with_context(|| format!("cannot enroll pod {uid}"))?;
        pods.insert(WorkloadUid(uid.to_string()), pod).await;
    }
    // With ZDS, readiness waits for the agent's first snapshot (which also drops capture
    // of pods removed while no ztunnel ran); without, the --pod list is the whole truth.
    if args.zds_socket.is_none() {
        pods.retain_capture(&inputs.capture).await;
    }
    if let Some(sock) = args.zds_socket.clone() {
        metrics.wait_for("zds");
        tokio::spawn(ztunnel::zds::client::run(
            sock,
            inputs.clone(),
            pods.clone(),
        ));
    }
    metrics.set_ready();
    let enrolled = pods.count().await;
    tracing::info!(node = %node_name, pods = enrolled, allocator = ztunnel::memory::ALLOCATOR, "ztunnel ready");
    tokio::spawn(ztunnel::memory::release_periodically());

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = quit.notified() => tracing::info!("drain requested through /quitquitquit"),
    }
    // Capture stays in the pods (the CNI owns it): while no proxy runs, their traffic
    // fails closed instead of bypassing mTLS and policy, and a new proxy can take over.
    let deadline = drain_deadline;
    tracing::info!(deadline = ?deadline, active = drain.active(), "draining: listeners closed, GOAWAY sent on HBONE");
    metrics.set_not_ready();
    drain.start();
    if drain.wait_idle(deadline).await {
        tracing::info!("drained; exiting");
    } else {
        tracing::warn!(
            active = drain.active(),
            "drain deadline reached; closing remaining connections"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Args, IstioSettings)> {
        let argv = istio_args(argv.iter().map(Into::into).collect()).map_err(anyhow::Error::msg)?;
        let m = Cli::command().try_get_matches_from(argv)?;
        let mut args = Cli::from_arg_matches(&m)?.run;
        let s = apply_istio_env(&mut args, &m, &Env::from_pairs(env.iter().copied()))?;
        Ok((args, s))
    }

    const BASE: &[&str] = &[
        "ztunnel",
        "--node-name",
        "n1",
        "--local-xds-path",
        "/dev/null",
    ];

    #[test]
    fn flag_reference_is_current() {
        let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md");
        ztunnel::app::flags::check_reference(&doc, "ztunnel", &Cli::command()).unwrap();
    }

    #[test]
    fn istio_container_args() {
        let os = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            istio_args(os(&["ztunnel", "proxy", "ztunnel", "--node-name", "a"])),
            Ok(os(&["ztunnel", "--node-name", "a"]))
        );
        assert_eq!(istio_args(os(&["ztunnel", "proxy"])), Ok(os(&["ztunnel"])));
        assert_eq!(istio_args(os(&["ztunnel"])), Ok(os(&["ztunnel"])));
        assert_eq!(
            istio_args(os(&["ztunnel", "version"])),
            Ok(os(&["ztunnel", "--version"]))
        );
        assert!(istio_args(os(&["ztunnel", "proxy", "router"]))
            .unwrap_err()
            .contains("proxy router"));
        // Our subcommands are untouched.
        assert_eq!(
            istio_args(os(&["ztunnel", "cni-server"])),
            Ok(os(&["ztunnel", "cni-server"]))
        );
        let (args, _) = parse(
            &[
                "ztunnel",
                "proxy",
                "ztunnel",
                "--node-name",
                "n1",
                "--local-xds-path",
                "/dev/null",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(args.node_name.as_deref(), Some("n1"));
    }

    #[test]
    fn istio_names_apply_unless_ours_are_given() {
        let env = [
            ("SECRET_TTL", "12h"),
            ("POOL_UNUSED_RELEASE_TIMEOUT", "90s"),
            ("ISTIO_META_DNS_CAPTURE", "false"),
            ("CONNECTION_TERMINATION_DEADLINE", "3s"),
        ];
        let (args, s) = parse(BASE, &env).unwrap();
        assert_eq!(args.cert_ttl_seconds, 12 * 3600);
        assert_eq!(args.pool_idle_timeout_seconds, 90);
        assert!(
            !args.dns.dns_proxy,
            "ISTIO_META_DNS_CAPTURE=false turns the DNS proxy off"
        );
        assert_eq!(s.termination_deadline, Some(Duration::from_secs(3)));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        // Our own flag wins, and the Istio variable it shadows is named.
        let mut argv = BASE.to_vec();
        argv.extend(["--cert-ttl-seconds", "600", "--dns-proxy", "true"]);
        let (args, s) = parse(&argv, &env).unwrap();
        assert_eq!(args.cert_ttl_seconds, 600);
        assert!(args.dns.dns_proxy);
        assert!(
            s.warnings
                .iter()
                .any(|w| w.starts_with("SECRET_TTL ignored")),
            "{:?}",
            s.warnings
        );
        assert!(
            s.warnings
                .iter()
                .any(|w| w.starts_with("ISTIO_META_DNS_CAPTURE ignored")),
            "{:?}",
            s.warnings
        );
        // Both given and agreeing (as our chart renders them): no warning.
        let mut argv = BASE.to_vec();
        argv.extend(["--dns-proxy", "false"]);
        let (args, s) = parse(&argv, &[("ISTIO_META_DNS_CAPTURE", "false")]).unwrap();
        assert!(!args.dns.dns_proxy);
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        assert!(parse(BASE, &[("SECRET_TTL", "a day")])
            .unwrap_err()
            .to_string()
            .contains("SECRET_TTL"));
        // Worker threads as a share of ZTUNNEL_CPU_LIMIT.
        let mut argv = BASE.to_vec();
        argv.extend(["--worker-threads", "25%"]);
        assert_eq!(
            parse(&argv, &[("ZTUNNEL_CPU_LIMIT", "8")])
                .unwrap()
                .1
                .worker_threads,
            2
        );
        assert_eq!(parse(BASE, &[]).unwrap().1.worker_threads, 2);
        // LOCALHOST_APP_TUNNEL: on unless set false (Istio's default); not a bool is refused.
        assert!(parse(BASE, &[]).unwrap().1.localhost_app_tunnel);
        assert!(
            !parse(BASE, &[("LOCALHOST_APP_TUNNEL", "false")])
                .unwrap()
                .1
                .localhost_app_tunnel
        );
        assert!(parse(BASE, &[("LOCALHOST_APP_TUNNEL", "yes")])
            .unwrap_err()
            .to_string()
            .contains("LOCALHOST_APP_TUNNEL"));
        // ENABLE_RESPONSE_BAGGAGE: the same (Istio's default true), and no longer warned
        // about as unsupported.
        let (_, on) = parse(BASE, &[]).unwrap();
        assert!(on.response_baggage);
        let (_, off) = parse(BASE, &[("ENABLE_RESPONSE_BAGGAGE", "false")]).unwrap();
        assert!(!off.response_baggage);
        assert!(!off
            .warnings
            .iter()
            .any(|w| w.contains("ENABLE_RESPONSE_BAGGAGE")));
        assert!(parse(BASE, &[("ENABLE_RESPONSE_BAGGAGE", "maybe")])
            .unwrap_err()
            .to_string()
            .contains("ENABLE_RESPONSE_BAGGAGE"));
    }

    #[test]
    fn a_mesh_config_source_is_required_and_xds_brings_its_ca() {
        let err = parse(&["ztunnel", "--node-name", "n1"], &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("XDS_ADDRESS") && err.contains("LOCAL_XDS_PATH"),
            "{err}"
        );
        // In Kubernetes, istiod is the default for both.
        let (args, _) = parse(
            &["ztunnel", "--node-name", "n1"],
            &[("KUBERNETES_SERVICE_HOST", "10.96.0.1")],
        )
        .unwrap();
        assert_eq!(
            args.istiod.xds_address.as_deref(),
            Some(ztunnel::istiod::DEFAULT_ADDRESS)
        );
        assert_eq!(
            args.istiod.ca_address.as_deref(),
            Some(ztunnel::istiod::DEFAULT_ADDRESS)
        );
        // FAKE_CA chooses the built-in CA explicitly.
        let (args, _) = parse(
            &[
                "ztunnel",
                "--node-name",
                "n1",
                "--xds-address",
                "istiod:15012",
                "--fake-ca",
                "true",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(args.istiod.ca_address, None);
    }

    #[test]
    fn inpod_uds_in_the_environment_means_istio_cni_captures() {
        // The only test here that touches the process environment (clap reads it).
        std::env::set_var("INPOD_UDS", "/var/run/ztunnel/ztunnel.sock");
        let from_env = parse(BASE, &[]);
        let explicit = parse(&[BASE, &["--capture", "nftables"]].concat(), &[]);
        std::env::remove_var("INPOD_UDS");
        let (args, s) = from_env.unwrap();
        assert_eq!(args.capture, CaptureMode::None);
        assert!(
            s.infos.iter().any(|i| i.contains("istio-cni captures")),
            "{:?}",
            s.infos
        );
        assert_eq!(explicit.unwrap().0.capture, CaptureMode::Nftables);
        // The flag alone (our own `ztunnel cni-server` does no capture) keeps ours.
        let (args, _) = parse(&[BASE, &["--zds-socket", "/tmp/zds.sock"]].concat(), &[]).unwrap();
        assert_eq!(args.capture, CaptureMode::Ebpf);
    }
}
