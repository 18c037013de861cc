//! The waypoint binary: settings, who this waypoint is and where its config comes from,
//! then the HBONE listener until SIGTERM and Istio's drain (the proxy is the `waypoint`
//! library).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use clap::Parser;
use waypoint::context::Waypoint;
use waypoint::object::ObjectName;
use waypoint::{authn, config, http, k8s, lb, server, upstream};
use ztunnel::app::{cert_manager, init_logging, serve_observability, BuiltinCa};
use ztunnel::drain::Drain;
use ztunnel::hbone::{self, Pool};
use ztunnel::identity::manager::IdentityCert;
use ztunnel::identity::{CertManager, Identity};
use ztunnel::metrics::http::HttpMetrics;
use ztunnel::metrics::Metrics;
use ztunnel::netns::InPodNetns;
use ztunnel::state::{Workload, WorkloadUid};

#[derive(Parser, Debug)]
#[command(
    name = "waypoint",
    version,
    about = "Waypoint proxy: HBONE in, L7 policy and routing, HBONE out",
    after_help = "`waypoint version` prints the version, as `ztunnel version` does. Admin endpoint (--admin-addr): GET /config_dump, GET/POST /logging, POST /quitquitquit."
)]
struct Args {
    /// Mesh config (the same local config YAML as ztunnel's, with httpRoutes and
    /// authorizationPolicies); reloaded when it changes. Without it (in a cluster), the
    /// mesh state comes from istiod (XDS_ADDRESS) and the L7 config from the Kubernetes API.
    #[arg(long, env = "LOCAL_XDS_PATH", required_unless_present = "xds_address")]
    local_xds_path: Option<PathBuf>,
    /// With a local config: this waypoint's own workload uid in it (its identity and address).
    #[arg(
        long,
        env = "WAYPOINT_WORKLOAD_UID",
        required_unless_present = "xds_address"
    )]
    workload_uid: Option<String>,
    #[command(flatten)]
    istiod: ztunnel::istiod::IstiodArgs,
    /// The Gateway this waypoint implements, for parentRefs/targetRefs of kind Gateway
    /// (default: the workload's canonicalName, else its name; in a cluster: "waypoint").
    #[arg(long, env = "WAYPOINT_GATEWAY_NAME")]
    gateway_name: Option<String>,
    /// Directory holding the mesh CA (`ca-cert.pem`, `ca-key.pem`), as ztunnel's
    /// --state-dir; not used with the Istio CA (CA_ADDRESS).
    #[arg(long, env = "ZTUNNEL_STATE_DIR", default_value = "/var/lib/ztunnel")]
    state_dir: PathBuf,
    /// The mesh's root namespace (Istio's meshConfig.rootNamespace): its
    /// AuthorizationPolicies that target the GatewayClass istio-waypoint apply to every
    /// request through this waypoint.
    #[arg(long, env = "ROOT_NAMESPACE", default_value = waypoint::object::DEFAULT_ROOT_NAMESPACE)]
    root_namespace: String,
    /// In a cluster: the root namespace's ConfigMap holding Istio's MeshConfig (key
    /// `mesh`), whose extensionProviders CUSTOM AuthorizationPolicies name. Default:
    /// Istio's `istio`, or `istio-<revision>` with REVISION (as istiod of that revision).
    #[arg(long, env = "MESH_CONFIG_MAP")]
    mesh_config_map: Option<String>,
    /// In a cluster: the Istio revision (`istio.io/rev`) this waypoint belongs to. Config
    /// objects labelled `istio.io/rev` for another revision are ignored, as istiod of this
    /// revision ignores them; unlabelled objects apply. Unset: every object applies.
    #[arg(long, env = "REVISION")]
    revision: Option<String>,
    /// Where HBONE is accepted; `0.0.0.0` means both families (`[::]`) with Istio's
    /// IPV6_ENABLED (default true).
    #[arg(long, default_value = "0.0.0.0:15008")]
    listen: SocketAddr,
    /// Admin endpoint (/config_dump, /logging, /quitquitquit), as ztunnel's and Istio's
    /// waypoints' (15000); must be a loopback address.
    #[arg(long, env = "WAYPOINT_ADMIN_ADDR", default_value = "127.0.0.1:15000")]
    admin_addr: SocketAddr,
    /// Prometheus metrics (`/stats/prometheus`, `/metrics`); `0.0.0.0` means both
    /// families with IPV6_ENABLED.
    #[arg(long, env = "WAYPOINT_METRICS_ADDR", default_value = "0.0.0.0:15020")]
    metrics_addr: SocketAddr,
    /// Readiness (`/healthz/ready`); `0.0.0.0` means both families with IPV6_ENABLED.
    #[arg(long, env = "WAYPOINT_READINESS_ADDR", default_value = "0.0.0.0:15021")]
    readiness_addr: SocketAddr,
    /// Lifetime of the built-in CA's certificates, in seconds (rotated at half-life).
    #[arg(long, env = "WORKLOAD_CERT_TTL_SECONDS", default_value_t = 24 * 3600)]
    cert_ttl_seconds: u64,
    /// Deadline for one upstream HBONE dial: TCP, TLS, HTTP/2 and the CONNECT answer.
    #[arg(long, env = "CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// HBONE streams per pooled upstream connection (Istio: 100).
    #[arg(long, env = "POOL_MAX_STREAMS_PER_CONNECTION", default_value_t = 100)]
    pool_max_streams: usize,
    /// An idle pooled upstream connection is closed after this many seconds.
    #[arg(
        long,
        env = "POOL_UNUSED_RELEASE_TIMEOUT_SECONDS",
        default_value_t = 300
    )]
    pool_idle_timeout_seconds: u64,
    /// How long a tunnel to a port of unknown protocol may stay silent before it is relayed at L4 (server-first protocols); ports that declare HTTP never are.
    #[arg(long, env = "PROTOCOL_DETECTION_TIMEOUT_MS", default_value_t = 1000)]
    protocol_detection_timeout_ms: u64,
    /// TLS to a DYNAMIC_DNS wildcard ServiceEntry's TLS port goes to the host its SNI names (istiod's opt-in of the same name, off by default: then such connections are reset). Only names the wildcard covers are resolved and reached.
    #[arg(long, env = "ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS", default_value_t = false, action = clap::ArgAction::Set)]
    enable_wildcard_host_service_entries_for_tls: bool,
    /// How an endpoint is picked among a backend's healthy ones.
    #[arg(
        long,
        value_enum,
        env = "WAYPOINT_LB_POLICY",
        default_value = "least-request"
    )]
    lb_policy: lb::LbPolicy,
    /// Consecutive 5xx / connect failures that eject an endpoint (0: never).
    #[arg(long, env = "OUTLIER_CONSECUTIVE_5XX", default_value_t = 5)]
    outlier_consecutive_5xx: u32,
    /// First ejection length; each further ejection of the same endpoint lasts longer.
    #[arg(long, env = "OUTLIER_BASE_EJECTION_MS", default_value_t = 30_000)]
    outlier_base_ejection_ms: u64,
    /// How often a RequestAuthentication's jwksUri is fetched again (Istio: 20 minutes).
    #[arg(long, env = "JWKS_REFRESH_INTERVAL_SECONDS", default_value_t = 1200)]
    jwks_refresh_interval_seconds: u64,
    /// Resolvers for the hostnames of backends' endpoints that have no IP (DNS
    /// ServiceEntries), comma-separated IP or IP:PORT; default: the nameservers of the
    /// waypoint's /etc/resolv.conf (its pod's DNS, as Envoy's).
    #[arg(long, env = "WAYPOINT_DNS_UPSTREAM", value_delimiter = ',')]
    dns_upstream: Vec<String>,
    /// How often the mesh config file is checked for changes (hot reload).
    #[arg(long, env = "CONFIG_POLL_INTERVAL_MS", default_value_t = 1000)]
    config_poll_interval_ms: u64,
    /// Drain deadline on SIGTERM: grace - 5 s when over 10 s, else grace - 1 s.
    #[arg(long, env = "TERMINATION_GRACE_PERIOD_SECONDS", default_value_t = 30)]
    termination_grace_period_seconds: u64,
    /// TLS + HTTP/2 handshakes in flight at once (0: no limit); more are closed at once
    /// and counted, as in ztunnel.
    #[arg(long, env = "HBONE_MAX_HANDSHAKES", default_value_t = hbone::server::MAX_HANDSHAKES)]
    hbone_max_handshakes: usize,
    /// The same from one source address (an IPv6 /64) (0: no limit).
    #[arg(long, env = "HBONE_MAX_HANDSHAKES_PER_IP", default_value_t = hbone::server::MAX_HANDSHAKES_PER_IP)]
    hbone_max_handshakes_per_ip: usize,
    /// Close an HBONE connection that has had no stream open for this many seconds,
    /// with GOAWAY (0: never).
    #[arg(long, env = "HBONE_IDLE_TIMEOUT_SECONDS", default_value_t = hbone::server::IDLE_TIMEOUT.as_secs())]
    hbone_idle_timeout_seconds: u64,
    /// A relayed TCP tunnel or HTTP connection with no byte either way for this many
    /// seconds is closed (0: never); Istio's 1 h (Envoy's tcp_proxy and HTTP connection
    /// idle timeouts, ztunnel's CONNECTION_IDLE_TIMEOUT_SECONDS).
    #[arg(long, env = "CONNECTION_IDLE_TIMEOUT_SECONDS", default_value_t = 3600)]
    idle_timeout_seconds: u64,
    /// A request stream (one request and its response) with nothing read of its request
    /// body nor sent of its response body for this many seconds is ended (0: never):
    /// before the response head with Envoy's local reply `stream timeout` (504, or 408
    /// while the request body was still arriving; flag SI), after it by resetting the
    /// stream. Envoy's stream_idle_timeout, 5 min in Istio. Upgraded WebSockets are
    /// exempt (CONNECTION_IDLE_TIMEOUT_SECONDS applies).
    #[arg(long, env = "STREAM_IDLE_TIMEOUT_SECONDS", default_value_t = 300)]
    stream_idle_timeout_seconds: u64,
    /// Certificate revocation lists (PEM or DER) peers are checked against, as ztunnel's
    /// CRL_PATH: a revoked client or upstream is refused, open connections of a peer a
    /// reload revokes are closed. The file may appear after the start.
    #[arg(long, env = "CRL_PATH")]
    crl_path: Option<PathBuf>,
    /// Accept HTTP/1.0 requests (Envoy's `accept_http_10`), which istiod turns on for
    /// Istio's waypoint when its PILOT_HTTP10 is true or the proxy's ISTIO_META_HTTP10 is
    /// "1" (read here too); otherwise an HTTP/1.0 request is answered 426 Upgrade Required.
    #[arg(long, env = "PILOT_HTTP10", default_value_t = false, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    http10: bool,
}

/// MESH_CONFIG_MAP, or istiod's name for its revision's: `istio` for the default revision,
/// `istio-<revision>` for another.
fn mesh_config_map(args: &Args) -> String {
    match (&args.mesh_config_map, args.revision.as_deref()) {
        (Some(m), _) => m.clone(),
        (None, Some(r)) if !r.is_empty() && r != "default" => format!("istio-{r}"),
        (None, _) => "istio".into(),
    }
}

/// PILOT_HTTP10 (`--http10`), or the proxy's ISTIO_META_HTTP10 "1", as istiod reads them
/// for Istio's waypoint.
fn accepts_http10(args: &Args) -> bool {
    args.http10 || std::env::var("ISTIO_META_HTTP10").is_ok_and(|v| v == "1")
}

/// Who this waypoint is and where its config comes from.
struct Setup {
    config: Arc<ArcSwap<config::Config>>,
    me: Arc<Workload>,
    identity: Identity,
    ip: IpAddr,
    gateway: ObjectName,
    certs: Arc<CertManager>,
}

/// Standalone: everything from the local config file; certificates from the mesh CA files
/// (or the Istio CA).
async fn local_setup(
    args: &Args,
    path: &std::path::Path,
    ttl: Duration,
    jwks: &Arc<authn::JwksStore>,
) -> anyhow::Result<Setup> {
    let cfg = config::Config::load(path)?;
    jwks.sync(cfg.jwks_uris());
    let uid = args
        .workload_uid
        .clone()
        .context("--workload-uid is required with --local-xds-path")?;
    let me = cfg
        .state
        .workload_by_uid(&WorkloadUid(uid.clone()))
        .cloned()
        .with_context(|| {
            format!(
                "--workload-uid {uid}: no such workload in {}",
                path.display()
            )
        })?;
    waypoint::network::set(&me.network);
    // Its IPv4 address if it has one (what it is named by in logs and the dump).
    let ip = me
        .address_for(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), None)
        .with_context(|| format!("workload {} has no IP address", me.uid))?;
    let identity = me.identity();
    let gateway = ObjectName {
        namespace: me.namespace.clone(),
        name: args.gateway_name.clone().unwrap_or_else(|| {
            if me.canonical_name.is_empty() {
                me.name.clone()
            } else {
                me.canonical_name.clone()
            }
        }),
    };
    // With the Istio CA, this waypoint asks for its own identity, its workload's, not
    // the environment's (POD_NAMESPACE, SERVICE_ACCOUNT): any other would go as an
    // impersonation, which Istio's CA allows node agents only.
    let mut istiod = args.istiod.clone();
    istiod.trust_domain = me.trust_domain.clone();
    istiod.pod_namespace = me.namespace.clone();
    istiod.service_account = me.service_account.clone();
    let certs = cert_manager(
        &istiod,
        ttl,
        BuiltinCa::Shared {
            state_dir: &args.state_dir,
        },
    )?;
    let config = Arc::new(ArcSwap::from_pointee(cfg));
    let jwks = jwks.clone();
    tokio::spawn(config::watch(
        path.to_path_buf(),
        config.clone(),
        Duration::from_millis(args.config_poll_interval_ms),
        move |c| jwks.sync(c.jwks_uris()),
    ));
    Ok(Setup {
        config,
        me,
        identity,
        ip,
        gateway,
        certs,
    })
}

/// Marks `part` of readiness done (`Metrics::wait_for`); logs "waypoint ready" when the
/// last one is, so that the log says it when `/healthz/ready` does.
fn part_ready(m: &Metrics, part: &'static str) {
    static ANNOUNCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    m.ready_part(part);
    if m.is_ready() && !ANNOUNCED.swap(true, std::sync::atomic::Ordering::AcqRel) {
        tracing::info!("waypoint ready");
    }
}

/// In a cluster: mesh state from istiod, L7 config from the Kubernetes API, certificates
/// from the Istio CA; readiness waits for the first full state of both.
async fn cluster_setup(
    args: &Args,
    ttl: Duration,
    metrics: &Arc<Metrics>,
    jwks: &Arc<authn::JwksStore>,
) -> anyhow::Result<Setup> {
    let ia = &args.istiod;
    let ip: IpAddr = ia
        .instance_ip
        .parse()
        .with_context(|| format!("INSTANCE_IP {:?} is not an IP address", ia.instance_ip))?;
    let identity = ia.own_identity();
    let certs = cert_manager(
        ia,
        ttl,
        BuiltinCa::Shared {
            state_dir: &args.state_dir,
        },
    )?;
    // Our own entry as istiod will name it; until istiod has it, what we know ourselves.
    let uid = format!(
        "{}//Pod/{}/{}",
        ia.cluster_id, ia.pod_namespace, ia.pod_name
    );
    // Istio's gateway pods carry their network as ISTIO_META_NETWORK; NETWORK as ztunnel's.
    let network = ["NETWORK", "ISTIO_META_NETWORK"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_default();
    ztunnel::state::workload::validate_network(&network)
        .map_err(|e| anyhow::anyhow!("NETWORK: {e}"))?;
    waypoint::network::set(&network);
    let me = Arc::new(Workload {
        network,
        service_account: ia.service_account.clone(),
        trust_domain: ia.trust_domain.clone(),
        workload_ips: vec![ip],
        protocol: ztunnel::state::Protocol::HBONE,
        cluster_id: ia.cluster_id.clone(),
        ..Workload::new(uid, ia.pod_name.clone(), ia.pod_namespace.clone())
    });
    let gateway = ObjectName {
        namespace: ia.pod_namespace.clone(),
        name: args
            .gateway_name
            .clone()
            .unwrap_or_else(|| "waypoint".into()),
    };
    let state = Arc::new(ztunnel::state::SharedState::default());
    metrics.wait_for("xds");
    let m = metrics.clone();
    // Istio's proxy type for gateways and waypoints.
    ia.start_xds("router", "", &certs, state.clone(), metrics, move || {
        part_ready(&m, "xds")
    })
    .await?;
    metrics.wait_for("kubernetes");
    let client = kube::Client::try_default().await.context(
        "cannot configure the Kubernetes client (in-cluster service account or KUBECONFIG)",
    )?;
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    let settings = k8s::Settings {
        gateway: gateway.clone(),
        root_namespace: args.root_namespace.clone(),
        identity: identity.clone(),
        mesh_config_map: mesh_config_map(args),
        revision: args.revision.clone().filter(|r| !r.is_empty()),
    };
    let labels = Arc::new(waypoint::labels::Labels::default());
    tokio::spawn(k8s::watch_pod_labels(
        client.clone(),
        ia.cluster_id.clone(),
        labels.clone(),
    ));
    tokio::spawn(k8s::watch(
        client,
        settings,
        state.clone(),
        tx,
        metrics.xds.clone(),
    ));
    let m = metrics.clone();
    let mut ready_rx = rx.clone();
    tokio::spawn(async move {
        if ready_rx.wait_for(Option::is_some).await.is_ok() {
            part_ready(&m, "kubernetes");
        }
    });
    rx.mark_changed();
    let config = Arc::new(ArcSwap::from_pointee(config::Config::empty(
        state.load_full(),
    )));
    let jwks = jwks.clone();
    tokio::spawn(config::combine(
        state,
        labels,
        rx,
        config.clone(),
        move |c| jwks.sync(c.jwks_uris()),
    ));
    Ok(Setup {
        config,
        me,
        identity,
        ip,
        gateway,
        certs,
    })
}

/// `waypoint version`, as `ztunnel version`: the version.
fn istio_args(mut argv: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if argv.len() == 2 && argv[1] == "version" {
        argv[1] = "--version".into();
    }
    argv
}

/// The settings in the dump's `config`, under ztunnel's (upstream's) names and shapes
/// where it has the setting, then the waypoint's own.
fn settings_dump(
    args: &Args,
    drain_deadline: Duration,
    proxy: &waypoint::proxy_config::ProxySettings,
) -> serde_json::Value {
    use ztunnel::admin::config_dump::{address, duration};
    let ia = &args.istiod;
    serde_json::json!({
        "adminAddr": address(args.admin_addr),
        "statsAddr": address(args.metrics_addr),
        "readinessAddr": address(args.readiness_addr),
        "inboundAddr": args.listen.to_string(),
        "clusterId": ia.cluster_id,
        "xdsAddress": ia.xds_address,
        "caAddress": ia.ca_address,
        "secretTtl": duration(Duration::from_secs(args.cert_ttl_seconds)),
        "poolMaxStreamsPerConn": args.pool_max_streams,
        "poolUnusedReleaseTimeout": duration(Duration::from_secs(args.pool_idle_timeout_seconds)),
        "selfTerminationDeadline": duration(drain_deadline),
        "workerThreads": proxy.worker_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        "proxyArgs": ztunnel::config::settings::redacted_args(std::env::args().skip(1)),
        // The waypoint's own.
        "crlPath": args.crl_path,
        "idleTimeout": duration(Duration::from_secs(args.idle_timeout_seconds)),
        "acceptHttp10": accepts_http10(args),
        "localXdsPath": args.local_xds_path,
        "gatewayName": args.gateway_name,
        "rootNamespace": args.root_namespace,
        "revision": args.revision,
        "meshConfigMap": mesh_config_map(args),
        "connectTimeout": duration(Duration::from_millis(args.connect_timeout_ms)),
        "lbPolicy": format!("{:?}", args.lb_policy),
        "outlierConsecutive5xx": args.outlier_consecutive_5xx,
        "jwksRefreshInterval": duration(Duration::from_secs(args.jwks_refresh_interval_seconds)),
        "dnsUpstream": args.dns_upstream,
        "outlierBaseEjection": duration(Duration::from_millis(args.outlier_base_ejection_ms)),
        "protocolDetectionTimeout": duration(Duration::from_millis(args.protocol_detection_timeout_ms)),
        "enableWildcardHostServiceEntriesForTls": args.enable_wildcard_host_service_entries_for_tls,
        "hboneMaxHandshakes": args.hbone_max_handshakes,
        "hboneMaxHandshakesPerIp": args.hbone_max_handshakes_per_ip,
        "hboneIdleTimeout": duration(Duration::from_secs(args.hbone_idle_timeout_seconds)),
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse_from(istio_args(std::env::args_os().collect()));
    // Istio's ProxyConfig as pilot-agent reads it for its waypoint: worker threads first.
    let var = |name: &str| std::env::var(name).ok();
    let proxy = waypoint::proxy_config::ProxySettings::from_env(
        var("PROXY_CONFIG").as_deref(),
        var("ISTIO_CPU_LIMIT").as_deref(),
    )?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = proxy.worker_threads {
        rt.worker_threads(n);
    }
    rt.enable_all().build()?.block_on(run(args, proxy))
}

async fn run(mut args: Args, proxy: waypoint::proxy_config::ProxySettings) -> anyhow::Result<()> {
    // As ztunnel: with Istio's IPV6_ENABLED (default true) the wildcard takes both families.
    let ipv6 = ztunnel::config::istio_env::Env::from_process()
        .bool("IPV6_ENABLED")?
        .unwrap_or(true);
    for addr in [
        &mut args.listen,
        &mut args.metrics_addr,
        &mut args.readiness_addr,
    ] {
        *addr = ztunnel::app::both_families(*addr, ipv6);
    }
    // As ztunnel's: Istio's line shapes on stderr, the filter changeable at /logging.
    let log = init_logging(&std::env::var("LOG_FORMAT").unwrap_or_default());
    anyhow::ensure!(
        args.admin_addr.ip().is_loopback(),
        "--admin-addr {} is not a loopback address; the admin endpoint must stay on localhost",
        args.admin_addr
    );
    ztunnel::netns::init().context("cannot open this process's network namespace")?;
    // Istio's HTTP2_* sizes, as ztunnel reads them, for the HBONE sides and the h2 upstreams.
    ztunnel::hbone::set_h2_sizes(ztunnel::config::istio_env::h2_sizes(
        &ztunnel::config::istio_env::Env::from_process(),
    )?);
    let ttl = Duration::from_secs(args.cert_ttl_seconds);
    let mut metrics = Metrics::default();
    metrics.build.set_component("waypoint");
    let http_metrics = HttpMetrics::register(&mut metrics.registry);
    let dns_metrics =
        ztunnel::metrics::on_demand_dns::OnDemandDnsMetrics::register(&mut metrics.registry);
    let metrics = Arc::new(metrics);
    // Bound first, as the other ports: a conflict fails the start.
    let admin_listener = ztunnel::http_endpoint::bind(args.admin_addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.admin_addr))?;
    serve_observability(&[args.metrics_addr, args.readiness_addr], &metrics).await?;
    // jwksUri key sets: Istio's refresh interval; a failed fetch is retried after 1 s, then less often.
    let jwks = authn::JwksStore::new(authn::JwksSettings {
        refresh: Duration::from_secs(args.jwks_refresh_interval_seconds.max(1)),
        retry: Duration::from_secs(1),
    });
    let Setup {
        config,
        me,
        identity,
        ip,
        gateway,
        certs,
    } = match &args.local_xds_path {
        Some(path) => local_setup(&args, path, ttl, &jwks).await?,
        None => cluster_setup(&args, ttl, &metrics, &jwks).await?,
    };
    // The admin endpoint serves from here on, also while the certificate is on its way.
    // ProxyConfig's terminationDrainDuration when it sets one.
    let drain_deadline = proxy.drain.unwrap_or_else(|| {
        ztunnel::drain::deadline_for_grace_period(Duration::from_secs(
            args.termination_grace_period_seconds,
        ))
    });
    let quit = Arc::new(tokio::sync::Notify::new());
    let config_dump = {
        let who = waypoint::dump::Me {
            identity: identity.clone(),
            gateway: gateway.clone(),
            workload_uid: me.uid.0.clone(),
            ip,
            root_namespace: args.root_namespace.clone(),
        };
        let (config, certs, settings) = (
            config.clone(),
            certs.clone(),
            settings_dump(&args, drain_deadline, &proxy),
        );
        Box::new(move || {
            waypoint::dump::config_dump(&who, &config.load(), &certs, settings.clone())
        })
    };
    let admin = Arc::new(ztunnel::admin::Admin {
        log: Box::new(log),
        quit: quit.clone(),
        config_dump,
    });
    tokio::spawn(ztunnel::admin::serve(admin_listener, admin));
    certs.allow(&identity);
    certs.set_metrics(metrics.certs.clone());
    let _ = metrics.process.certs.set(certs.clone());
    let cert = certs.fetch(&identity).await?;
    // As ztunnel: a CRL file that is there but unusable refuses the start (running
    // without it would accept the peers it revokes); later changes are polled for.
    let crls = match args
        .crl_path
        .as_deref()
        .filter(|p| !p.as_os_str().is_empty())
    {
        Some(path) => Some(ztunnel::tls::Crls::load(path)?),
        None => None,
    };
    if let Some(c) = &crls {
        tokio::spawn(c.clone().watch(ztunnel::tls::crl::POLL_INTERVAL));
    }
    let tls = Arc::new(ztunnel::tls::server_config_with_crls(
        IdentityCert {
            certs: certs.clone(),
            identity: identity.clone(),
        },
        &cert.cert.roots,
        &identity.trust_domain,
        crls.as_ref(),
    )?);
    let connect_timeout = Duration::from_millis(args.connect_timeout_ms);
    let pool = Pool::with_crls(
        certs.clone(),
        args.pool_max_streams,
        Duration::from_secs(args.pool_idle_timeout_seconds),
        connect_timeout,
        crls.clone().map(|c| (c, metrics.clone())),
    );
    let netns = InPodNetns::open(std::path::Path::new("/proc/self/ns/net"))?;
    let (spans, span_rx) = waypoint::trace::SpanQueue::new();
    let (otel_logs, otel_log_rx) = waypoint::telemetry::otel_log::LogQueue::new();
    let dns_upstreams = if args.dns_upstream.is_empty() {
        ztunnel::dns::forwarder::read_resolv_conf(std::path::Path::new("/etc/resolv.conf")).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no DNS resolvers: backends' hostname endpoints cannot be resolved (set --dns-upstream)");
            Vec::new()
        })
    } else {
        args.dns_upstream
            .iter()
            .map(|s| ztunnel::dns::forwarder::parse_upstream(s))
            .collect::<Result<_, _>>()?
    };
    let resolver = Arc::new(ztunnel::dns::on_demand::OnDemandResolver::new(
        ztunnel::dns::on_demand::OnDemandConfig {
            upstreams: dns_upstreams,
            ..Default::default()
        },
        dns_metrics,
    ));
    let wp = Arc::new(Waypoint {
        config: config.clone(),
        me,
        identity: identity.clone(),
        gateway,
        root_namespace: args.root_namespace.clone(),
        ip,
        upstreams: upstream::Upstreams::new(pool.clone(), netns.clone(), identity.clone(), ip),
        pool,
        netns,
        balancer: lb::Balancer::new(
            args.lb_policy,
            lb::OutlierConfig {
                consecutive_5xx: args.outlier_consecutive_5xx,
                base_ejection: Duration::from_millis(args.outlier_base_ejection_ms),
                local_origin: None,
            },
        ),
        circuits: lb::Circuits::default(),
        http_metrics,
        metrics: metrics.clone(),
        drain: Arc::new(Drain::default()),
        detect_timeout: Duration::from_millis(args.protocol_detection_timeout_ms),
        wildcard_tls: args.enable_wildcard_host_service_entries_for_tls,
        jwks,
        mirror_slots: Arc::new(tokio::sync::Semaphore::new(http::MAX_MIRRORS_IN_FLIGHT)),
        spans,
        otel_logs,
        resolver,
        crls,
        certs: certs.clone(),
        idle_timeout: (args.idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(args.idle_timeout_seconds)),
        stream_idle_timeout: (args.stream_idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(args.stream_idle_timeout_seconds)),
        accept_http10: accepts_http10(&args),
    });
    tokio::spawn(http::trace_export::run(wp.clone(), span_rx));
    tokio::spawn(http::log_export::run(wp.clone(), otel_log_rx));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    tracing::info!(identity = %identity, gateway = %format!("{}/{}", wp.gateway.namespace, wp.gateway.name), listen = %args.listen, "waypoint listening");
    tokio::spawn(ztunnel::memory::release_periodically());
    part_ready(&metrics, "startup");
    if !metrics.is_ready() {
        tracing::info!(reason = %metrics.not_ready_reason(), "waypoint not ready yet");
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    // ztunnel's HBONE server limits, counted in the same metric.
    let hbone_server = Arc::new(hbone::server::Server {
        handshakes: hbone::server::HandshakeLimiter::new(
            args.hbone_max_handshakes,
            args.hbone_max_handshakes_per_ip,
        ),
        max_streams: hbone::SERVER_MAX_STREAMS,
        max_header_bytes: hbone::MAX_HEADER_BYTES,
        idle_timeout: (args.hbone_idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(args.hbone_idle_timeout_seconds)),
        metrics: metrics.clone(),
    });
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = quit.notified() => tracing::info!("drain requested through /quitquitquit"),
        }
    };
    server::serve(listener, wp.clone(), hbone_server, acceptor, stop).await;
    // Istio's drain: no new connections (`serve` closed the listener), GOAWAY on open
    // ones, in-flight tunnels run until they end or the deadline passes.
    metrics.set_not_ready();
    wp.drain.start();
    let deadline = drain_deadline;
    tracing::info!(deadline = ?deadline, active = wp.drain.active(), "draining: listener closed, GOAWAY sent");
    if !wp.drain.wait_idle(deadline).await {
        tracing::warn!(
            active = wp.drain.active(),
            "drain deadline reached; closing remaining tunnels"
        );
    }
    tracing::info!("waypoint stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn version_and_help() {
        let os = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            istio_args(os(&["waypoint", "version"])),
            os(&["waypoint", "--version"])
        );
        assert_eq!(
            istio_args(os(&["waypoint", "--listen", "version"])),
            os(&["waypoint", "--listen", "version"])
        );
        let e = Args::try_parse_from(["waypoint", "--version"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
        assert_eq!(
            e.to_string().trim(),
            format!("waypoint {}", env!("CARGO_PKG_VERSION"))
        );
        // Every flag says what it is for.
        let cmd = Args::command();
        let bare: Vec<_> = cmd
            .get_arguments()
            .filter(|a| a.get_help().is_none() && !a.is_hide_set())
            .map(|a| a.get_id().to_string())
            .collect();
        assert!(bare.is_empty(), "flags without help: {bare:?}");
        let a = Args::try_parse_from([
            "waypoint",
            "--local-xds-path",
            "m.yaml",
            "--workload-uid",
            "w",
        ])
        .unwrap();
        assert_eq!(
            (a.admin_addr, a.root_namespace.as_str()),
            ("127.0.0.1:15000".parse().unwrap(), "istio-system")
        );
    }

    #[test]
    fn flag_reference_is_current() {
        let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md");
        ztunnel::app::flags::check_reference(&doc, "waypoint", &Args::command()).unwrap();
    }
}
