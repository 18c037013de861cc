//! Istio's Telemetry API, as far as it reaches a waypoint (istiod's `applicableTelemetries`
//! for a waypoint, its listeners being SERVER mode): access logging on or off and its
//! `filter.expression`, metric overrides (a metric dropped, tags removed), and tracing's
//! `randomSamplingPercentage` and `disableSpanReporting`.
//!
//! Which Telemetries apply to a request, later ones over earlier ones: the root
//! namespace's namespace-wide one (no `selector`, no `targetRefs`: mesh-wide), the
//! waypoint's namespace's, the namespace-wide one of the addressed Service's namespace
//! when that is another, then the Telemetries of that last namespace whose `targetRefs`
//! name the waypoint's Gateway or the Service. `selector` ones are the workloads' proxies'.
//!
//! Providers: the waypoint's access logs are Istio's `envoy` provider (its own `request
//! complete` line, or Envoy's formats when the mesh config sets them) and
//! `envoyFileAccessLog` ones (`providers.rs`, `format.rs`, `output.rs`); its metrics are
//! `prometheus`; its tracing is the mesh config's default tracing provider, with the
//! Telemetry's `customTags` (`tags.rs`); `reportingInterval` paces the counting of open
//! TCP connections' bytes (Istio's 5 s by default). A Telemetry naming another provider,
//! a custom metric, a tag UPSERT (CEL values) or a filter the waypoint cannot evaluate is
//! refused with the field named (the file; in a cluster it is logged and left out).

mod api;
pub mod expr;
pub mod format;
pub mod otel_log;
pub mod output;
mod providers;
pub mod tags;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ztunnel::metrics::http::{is_label, HttpOverrides, MetricOverride};

use crate::object::{attaches, ObjectName, ObjectRef, Target};
pub use api::*;
pub use expr::Expr;
use output::Output;
pub use providers::MeshProviders;

/// The metrics a waypoint exports, by Istio's names: the HTTP four, then the TCP four.
const METRICS: [&str; 8] = [
    "REQUEST_COUNT",
    "REQUEST_DURATION",
    "REQUEST_SIZE",
    "RESPONSE_SIZE",
    "TCP_OPENED_CONNECTIONS",
    "TCP_CLOSED_CONNECTIONS",
    "TCP_RECEIVED_BYTES",
    "TCP_SENT_BYTES",
];
/// Istio's gRPC message counts, which the waypoint does not export: overriding them
/// changes nothing.
const NOT_EXPORTED: [&str; 2] = ["GRPC_REQUEST_MESSAGES", "GRPC_RESPONSE_MESSAGES"];

/// One Telemetry, checked and compiled.
#[derive(Clone, Debug)]
pub struct Compiled {
    namespace: String,
    /// A `selector` one: a workload proxy's, never the waypoint's.
    workload: bool,
    /// None: namespace-wide (no selector, no targetRefs).
    targets: Option<Vec<ObjectRef>>,
    logging: Vec<LogEntry>,
    metrics: Vec<MetricsEntry>,
    tracing: Vec<TracingEntry>,
}

#[derive(Clone, Debug)]
struct LogEntry {
    providers: Vec<String>,
    server: bool,
    disabled: bool,
    filter: Option<Arc<Expr>>,
}

#[derive(Clone, Debug)]
struct MetricsEntry {
    providers: Vec<String>,
    /// `reportingInterval`: how often open TCP connections' bytes are counted.
    reporting_interval: Option<std::time::Duration>,
    overrides: Vec<OverrideEntry>,
}

#[derive(Clone, Debug)]
struct OverrideEntry {
    /// Indexes into METRICS; None: every metric.
    metrics: Option<Vec<usize>>,
    server: bool,
    disabled: Option<bool>,
    remove: Vec<String>,
}

#[derive(Clone, Debug)]
struct TracingEntry {
    server: bool,
    sampling: Option<f64>,
    disabled: Option<bool>,
    tags: Option<Arc<tags::CustomTags>>,
}

/// Whether an entry with this `match.mode` applies to the waypoint (SERVER).
fn server_mode(mode: Option<&str>, field: &str) -> Result<bool, String> {
    match mode.unwrap_or("CLIENT_AND_SERVER") {
        "CLIENT_AND_SERVER" | "SERVER" => Ok(true),
        "CLIENT" => Ok(false),
        other => Err(format!(
            "{field}: {other:?} is not one of CLIENT_AND_SERVER, SERVER, CLIENT"
        )),
    }
}

impl Telemetry {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether it is a workload proxy's (a `selector`): not the waypoint's.
    pub fn is_workload_scoped(&self) -> bool {
        self.selector.is_some()
    }

    /// Checks it against what the waypoint can do; the field path first in errors.
    pub fn compile(&self, mesh: &MeshProviders) -> Result<Compiled, String> {
        if self.name.is_empty() || self.namespace.is_empty() {
            return Err("name and namespace: required".into());
        }
        let refs: Vec<ObjectRef> = self
            .target_refs
            .iter()
            .chain(self.target_ref.iter())
            .cloned()
            .collect();
        for (i, r) in refs.iter().enumerate() {
            if crate::object::ref_kind(r).is_none() {
                return Err(format!("targetRefs[{i}]: kind {:?} is not a Service, ServiceEntry, Gateway or GatewayClass", r.kind.as_deref().unwrap_or_default()));
            }
        }
        let ours = |list: &[String],
                    providers: &[ProviderRef],
                    field: &str,
                    what: &str|
         -> Result<Vec<String>, String> {
            providers
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    if list.iter().any(|o| o.eq_ignore_ascii_case(&p.name)) {
                        Ok(p.name.to_ascii_lowercase())
                    } else {
                        Err(format!(
                            "{field}.providers[{i}].name: {:?} is not {what}",
                            p.name
                        ))
                    }
                })
                .collect()
        };
        let mut logging = Vec::new();
        for (i, l) in self.access_logging.iter().enumerate() {
            let at = format!("accessLogging[{i}]");
            let providers = ours(
                &mesh.access_log_names(),
                &l.providers,
                &at,
                "an access log this waypoint writes (envoy, or an envoyFileAccessLog provider)",
            )?;
            let filter = match &l.filter {
                Some(f) => Some(Arc::new(
                    Expr::compile(&f.expression)
                        .map_err(|e| format!("{at}.filter.expression: {e}"))?,
                )),
                None => None,
            };
            logging.push(LogEntry {
                providers,
                server: server_mode(
                    l.mode.as_ref().and_then(|m| m.mode.as_deref()),
                    &format!("{at}.match.mode"),
                )?,
                disabled: l.disabled == Some(true),
                filter,
            });
        }
        let mut metrics = Vec::new();
        for (i, m) in self.metrics.iter().enumerate() {
            let at = format!("metrics[{i}]");
            let providers = ours(
                &mesh.metrics,
                &m.providers,
                &at,
                "a metrics provider this waypoint exports (prometheus)",
            )?;
            let reporting_interval = m
                .reporting_interval
                .as_deref()
                .map(|t| {
                    crate::extauthz::provider::parse_duration(t)
                        .map_err(|e| format!("{at}.reportingInterval: {e}"))
                })
                .transpose()?
                // Bounded: every open connection wakes this often.
                .map(|d| d.max(MIN_TCP_REPORTING));
            let mut overrides = Vec::new();
            for (j, o) in m.overrides.iter().enumerate() {
                let oat = format!("{at}.overrides[{j}]");
                let sel = o.selector.clone().unwrap_or_default();
                if sel.custom_metric.is_some() {
                    return Err(format!(
                        "{oat}.match.customMetric: custom metrics are not supported"
                    ));
                }
                let which = match sel.metric.as_deref() {
                    None | Some("ALL_METRICS") => None,
                    Some(name) => match METRICS.iter().position(|m| *m == name) {
                        Some(k) => Some(vec![k]),
                        None if NOT_EXPORTED.contains(&name) => Some(Vec::new()),
                        None => return Err(format!("{oat}.match.metric: {name:?} is not one of Istio's metrics (ALL_METRICS, {}, {})", METRICS.join(", "), NOT_EXPORTED.join(", "))),
                    },
                };
                let mut remove = Vec::new();
                for (tag, t) in &o.tag_overrides {
                    let tat = format!("{oat}.tagOverrides.{tag}");
                    match t.operation.as_deref().unwrap_or("UPSERT") {
                        "REMOVE" => {}
                        "UPSERT" => return Err(format!("{tat}.operation: UPSERT takes a CEL value the waypoint does not evaluate; only REMOVE is supported")),
                        other => return Err(format!("{tat}.operation: {other:?} is not UPSERT or REMOVE")),
                    }
                    if !is_label(tag) {
                        return Err(format!("{tat}: not a label of Istio's standard metrics"));
                    }
                    remove.push(tag.clone());
                }
                let server = server_mode(sel.mode.as_deref(), &format!("{oat}.match.mode"))?;
                overrides.push(OverrideEntry {
                    metrics: which,
                    server,
                    disabled: o.disabled,
                    remove,
                });
            }
            metrics.push(MetricsEntry {
                reporting_interval,
                providers,
                overrides,
            });
        }
        let mut tracing = Vec::new();
        for (i, t) in self.tracing.iter().enumerate() {
            let at = format!("tracing[{i}]");
            let tracer = mesh.tracing.iter().cloned().collect::<Vec<_>>();
            ours(&tracer, &t.providers, &at, "the mesh config's tracing provider (defaultProviders.tracing), the one this waypoint exports to")?;
            let tags = match &t.custom_tags {
                Some(v) => Some(Arc::new(
                    tags::CustomTags::parse(v, |n| std::env::var(n).ok())
                        .map_err(|e| format!("{at}.customTags.{e}"))?,
                )),
                None => None,
            };
            if let Some(p) = t.random_sampling_percentage {
                if !(0.0..=100.0).contains(&p) {
                    return Err(format!(
                        "{at}.randomSamplingPercentage: a percentage, 0 to 100"
                    ));
                }
            }
            tracing.push(TracingEntry {
                server: server_mode(
                    t.mode.as_ref().and_then(|m| m.mode.as_deref()),
                    &format!("{at}.match.mode"),
                )?,
                sampling: t.random_sampling_percentage,
                disabled: t.disable_span_reporting,
                tags,
            });
        }
        let targets = (!refs.is_empty()).then_some(refs);
        Ok(Compiled {
            namespace: self.namespace.clone(),
            workload: self.is_workload_scoped(),
            targets,
            logging,
            metrics,
            tracing,
        })
    }
}

/// How one request is logged.
#[derive(Clone, Debug, Default)]
pub enum LogPolicy {
    /// No Telemetry access logging and no default provider: every request, to the
    /// built-in `envoy` provider (as before).
    #[default]
    Always,
    Off,
    /// To each of these providers, when its filter takes the request (none: always).
    Providers(Vec<ProviderLog>),
}

/// One access-log provider in force for a request.
#[derive(Clone, Debug)]
pub struct ProviderLog {
    pub name: String,
    pub output: Arc<Output>,
    pub filter: Option<Arc<Expr>>,
}

/// Istio's default `reportingInterval`: open TCP connections' bytes are counted that
/// often (Envoy's `tcp_reporting_duration`).
pub const TCP_REPORTING: std::time::Duration = std::time::Duration::from_secs(5);

/// The shortest `reportingInterval` applied (a shorter one is raised to it): each open
/// TCP connection through the waypoint wakes once per interval.
pub const MIN_TCP_REPORTING: std::time::Duration = std::time::Duration::from_millis(100);

/// What the Telemetries in force do to one request.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub log: LogPolicy,
    /// None: the metrics as they are (the fast path).
    pub http: Option<HttpOverrides>,
    pub tcp: Option<[MetricOverride; 4]>,
    /// `reportingInterval` of the Telemetry in force that sets one (the most specific);
    /// None: Istio's default, [`TCP_REPORTING`].
    pub tcp_reporting: Option<std::time::Duration>,
    /// `randomSamplingPercentage` in force, if any Telemetry sets it.
    pub sampling: Option<f64>,
    /// `disableSpanReporting`.
    pub spans_off: bool,
    /// `customTags` in force (the last Telemetry's that sets them).
    pub tags: Option<Arc<tags::CustomTags>>,
}

impl Applied {
    /// No Telemetry at all: one shared value (requests take a reference, not an allocation).
    pub fn defaults() -> Arc<Applied> {
        static NONE: std::sync::OnceLock<Arc<Applied>> = std::sync::OnceLock::new();
        NONE.get_or_init(Arc::default).clone()
    }

    /// The filters in force.
    pub fn filters(&self) -> impl Iterator<Item = &Arc<Expr>> {
        let providers: &[ProviderLog] = match &self.log {
            LogPolicy::Providers(p) => p,
            _ => &[],
        };
        providers.iter().filter_map(|p| p.filter.as_ref())
    }
}

/// The Telemetries a waypoint holds, and what they come to per addressed Service
/// (memoized: one entry per Service the config has seen requests for).
#[derive(Debug, Default)]
pub struct Telemetries {
    list: Vec<Compiled>,
    mesh: MeshProviders,
    applied: Mutex<HashMap<Option<ObjectName>, Arc<Applied>>>,
}

impl Telemetries {
    pub fn new(list: Vec<Compiled>, mesh: MeshProviders) -> Telemetries {
        Telemetries {
            list,
            mesh,
            applied: Mutex::default(),
        }
    }

    /// The built-in `envoy` provider's output.
    pub fn envoy(&self) -> Arc<Output> {
        self.mesh.envoy()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
            && self.mesh.default_access_logging.is_empty()
            && self.mesh.default_tags.is_none()
    }

    /// What applies to a request to `target` (its Service, the waypoint's Gateway).
    pub fn for_target(&self, target: &Target<'_>) -> Arc<Applied> {
        if self.is_empty() {
            return Applied::defaults();
        }
        let key = target.service.cloned();
        let mut memo = self.applied.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = memo.get(&key) {
            return a.clone();
        }
        let a = Arc::new(self.resolve(target));
        // Bounded by the config's Services; a stray key costs a recomputation only.
        if memo.len() < 10_000 {
            memo.insert(key, a.clone());
        }
        a
    }

    /// The Telemetries in force for `target`, in order (later over earlier).
    fn in_force<'t>(&'t self, target: &Target<'_>) -> Vec<&'t Compiled> {
        let wide = |ns: &str| {
            self.list
                .iter()
                .find(|c| c.namespace == ns && c.targets.is_none() && !c.workload)
        };
        let (root, own) = (target.root_namespace, target.gateway.namespace.as_str());
        let mut out: Vec<&Compiled> = wide(root).into_iter().collect();
        if own != root {
            out.extend(wide(own));
        }
        let mut ns = own;
        if let Some(svc) = target.service.filter(|s| s.namespace != own) {
            ns = &svc.namespace;
            out.extend(wide(ns));
        }
        out.extend(self.list.iter().filter(|c| {
            c.namespace == ns
                && !c.workload
                && c.targets
                    .as_deref()
                    .is_some_and(|refs| attaches(ns, refs, target))
        }));
        out
    }

    fn resolve(&self, target: &Target<'_>) -> Applied {
        let tels = self.in_force(target);
        let mut a = Applied {
            log: self.logging(&tels),
            // As istiod: the ProxyConfig's tags when no Telemetry sets any.
            tags: self.mesh.default_tags.clone(),
            ..Applied::default()
        };
        self.metric_overrides(&tels, &mut a);
        for t in tels.iter().flat_map(|c| &c.tracing).filter(|t| t.server) {
            if let Some(s) = t.sampling {
                a.sampling = Some(s);
            }
            if let Some(d) = t.disabled {
                a.spans_off = d;
            }
            if let Some(tags) = &t.tags {
                a.tags = Some(tags.clone());
            }
        }
        a
    }

    /// Istio's mergeLogs for the waypoint's one log (whichever of its names is used).
    fn logging(&self, tels: &[&Compiled]) -> LogPolicy {
        let defaults = &self.mesh.default_access_logging;
        if tels.iter().all(|c| c.logging.is_empty()) && defaults.is_empty() {
            return LogPolicy::Always;
        }
        let output = |p: &String| self.mesh.access_log(p).cloned();
        if tels.iter().all(|c| c.logging.is_empty()) {
            // Only the default providers: on, unfiltered, when ours is among them.
            let on: Vec<ProviderLog> = defaults
                .iter()
                .filter_map(|p| {
                    Some(ProviderLog {
                        name: p.to_ascii_lowercase(),
                        output: output(p)?,
                        filter: None,
                    })
                })
                .collect();
            return if on.is_empty() {
                LogPolicy::Off
            } else {
                LogPolicy::Providers(on)
            };
        }
        // In scope: the defaults, replaced by the providers each Telemetry's entries name.
        let mut in_scope: Vec<String> = defaults.clone();
        let mut filters: HashMap<String, Option<Arc<Expr>>> = HashMap::new();
        for c in tels {
            let mut names = Vec::new();
            for l in c.logging.iter().filter(|l| l.server) {
                for p in &l.providers {
                    names.push(p.clone());
                    filters.insert(p.clone(), l.filter.clone());
                }
            }
            if !names.is_empty() {
                in_scope = names;
            }
        }
        let mut state: HashMap<String, Option<Option<Arc<Expr>>>> = HashMap::new();
        let mut parent = defaults.clone();
        for c in tels {
            for l in &c.logging {
                let providers = if l.providers.is_empty() {
                    parent.clone()
                } else {
                    l.providers.clone()
                };
                parent = providers.clone();
                for p in providers
                    .iter()
                    .filter(|p| in_scope.contains(p) && l.server)
                {
                    let v = if l.disabled {
                        None
                    } else {
                        Some(filters.get(p).cloned().flatten())
                    };
                    state.insert(p.clone(), v);
                }
            }
        }
        let mut on: Vec<ProviderLog> = state
            .into_iter()
            .filter_map(|(p, v)| {
                Some(ProviderLog {
                    output: output(&p)?,
                    filter: v?,
                    name: p,
                })
            })
            .collect();
        on.sort_by(|a, b| a.name.cmp(&b.name));
        if on.is_empty() {
            LogPolicy::Off
        } else {
            LogPolicy::Providers(on)
        }
    }

    /// Istio's mergeMetrics for the waypoint's prometheus metrics (SERVER mode).
    fn metric_overrides(&self, tels: &[&Compiled], a: &mut Applied) {
        let entries: Vec<&MetricsEntry> = tels.iter().flat_map(|c| &c.metrics).collect();
        if entries.is_empty() {
            return;
        }
        // Istio: the last (most specific) Telemetry's interval for the provider wins.
        if let Some(i) = entries.iter().rev().find_map(|m| m.reporting_interval) {
            a.tcp_reporting = Some(i);
        }
        let ours = |p: &String| self.mesh.metrics.iter().any(|o| o.eq_ignore_ascii_case(p));
        let mut in_scope = self.mesh.default_metrics.clone();
        for m in &entries {
            if !m.providers.is_empty() {
                in_scope = m.providers.clone();
            }
        }
        let mut per: [MetricOverride; 8] = Default::default();
        let mut all_off = false;
        let mut parent = self.mesh.default_metrics.clone();
        for m in &entries {
            let providers = if m.providers.is_empty() {
                parent.clone()
            } else {
                m.providers.clone()
            };
            parent = providers.clone();
            if !providers.iter().any(|p| ours(p) && in_scope.contains(p)) {
                continue;
            }
            for o in m.overrides.iter().filter(|o| o.server) {
                if o.metrics.is_none() && o.disabled == Some(true) {
                    all_off = true;
                    continue;
                }
                all_off = false;
                let which: Vec<usize> = o
                    .metrics
                    .clone()
                    .unwrap_or_else(|| (0..METRICS.len()).collect());
                for k in which {
                    if let Some(d) = o.disabled {
                        per[k].disabled = d;
                    }
                    for r in &o.remove {
                        if !per[k].remove.contains(r) {
                            per[k].remove.push(r.clone());
                        }
                    }
                }
            }
        }
        // Our provider out of scope (a Telemetry chose none of ours): no metrics at all.
        let exported = in_scope.iter().any(ours);
        if all_off || !exported {
            for p in per.iter_mut() {
                p.disabled = true;
            }
        }
        if per.iter().all(MetricOverride::is_none) {
            return;
        }
        let [c, d, q, s, o, cl, r, se] = per;
        a.http = Some(HttpOverrides {
            requests: c,
            duration: d,
            request_bytes: q,
            response_bytes: s,
        });
        a.tcp = Some([o, cl, r, se]);
    }
}

#[cfg(test)]
mod tests;
