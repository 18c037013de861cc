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
//! Providers: the waypoint's access log (its `request complete` lines) is Istio's `envoy`
//! provider or any `envoyFileAccessLog` one writing to stdout without a custom format; its
//! metrics are `prometheus`; its tracing is the mesh config's default tracing provider.
//! A Telemetry naming another provider, a custom metric, a tag UPSERT (CEL values), a
//! `reportingInterval`, custom tracing tags or a filter the waypoint cannot evaluate is
//! refused with the field named (the file; in a cluster it is logged and left out).

pub mod expr;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::Value;
use ztunnel::metrics::http::{is_label, HttpOverrides, MetricOverride};

use crate::object::{attaches, ObjectName, ObjectRef, Target};
pub use expr::Expr;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Telemetry {
    pub name: String,
    pub namespace: String,
    /// A workload proxy's: the waypoint does not take it.
    #[serde(default)]
    pub selector: Option<Value>,
    #[serde(default)]
    pub target_refs: Vec<ObjectRef>,
    #[serde(default)]
    pub target_ref: Option<ObjectRef>,
    #[serde(default)]
    pub access_logging: Vec<AccessLogging>,
    #[serde(default)]
    pub metrics: Vec<Metrics>,
    #[serde(default)]
    pub tracing: Vec<Tracing>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderRef {
    pub name: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModeSelector {
    #[serde(default)]
    pub mode: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccessLogging {
    #[serde(default)]
    pub providers: Vec<ProviderRef>,
    #[serde(default)]
    pub disabled: Option<bool>,
    #[serde(default)]
    pub filter: Option<LogFilter>,
    #[serde(default, rename = "match")]
    pub mode: Option<ModeSelector>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogFilter {
    pub expression: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metrics {
    #[serde(default)]
    pub providers: Vec<ProviderRef>,
    #[serde(default)]
    pub overrides: Vec<MetricsOverrides>,
    #[serde(default)]
    pub reporting_interval: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetricsOverrides {
    #[serde(default, rename = "match")]
    pub selector: Option<MetricSelector>,
    #[serde(default)]
    pub disabled: Option<bool>,
    #[serde(default)]
    pub tag_overrides: BTreeMap<String, TagOverride>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetricSelector {
    #[serde(default)]
    pub metric: Option<String>,
    #[serde(default)]
    pub custom_metric: Option<String>,
    #[serde(default)]
    pub mode: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagOverride {
    #[serde(default)]
    pub operation: Option<String>,
    #[serde(default)]
    pub value: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tracing {
    #[serde(default)]
    pub providers: Vec<ProviderRef>,
    #[serde(default, rename = "match")]
    pub mode: Option<ModeSelector>,
    #[serde(default)]
    pub random_sampling_percentage: Option<f64>,
    #[serde(default)]
    pub disable_span_reporting: Option<bool>,
    #[serde(default)]
    pub custom_tags: Option<Value>,
    #[serde(default)]
    pub use_request_id_for_trace_sampling: Option<bool>,
    #[serde(default)]
    pub enable_istio_tags: Option<bool>,
}

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

/// What the mesh config says about telemetry providers.
#[derive(Clone, Debug, Default)]
pub struct MeshProviders {
    /// Providers the waypoint's access log is (`envoy`, stdout `envoyFileAccessLog`s).
    access_logs: Vec<String>,
    default_access_logging: Vec<String>,
    /// Providers the waypoint's metrics are (`prometheus` and prometheus providers).
    metrics: Vec<String>,
    default_metrics: Vec<String>,
    /// The tracing provider spans go to, if any.
    tracing: Option<String>,
}

impl MeshProviders {
    /// From the mesh config (`extensionProviders`, `defaultProviders`) and the tracing
    /// provider in use. Istio's built-in `envoy` and `prometheus` are always there;
    /// without `defaultProviders.metrics`, `prometheus` is the default, as in Istio.
    pub fn from_mesh(mesh: Option<&Value>, tracing: Option<&str>) -> MeshProviders {
        let strings = |v: Option<&Value>| {
            v.and_then(Value::as_array).map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
        };
        let mut p = MeshProviders {
            access_logs: vec!["envoy".into()],
            metrics: vec!["prometheus".into()],
            tracing: tracing.map(str::to_string),
            ..Default::default()
        };
        let providers = mesh
            .and_then(|m| m.get("extensionProviders"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for e in &providers {
            let Some(name) = e.get("name").and_then(Value::as_str) else {
                continue;
            };
            if let Some(f) = e.get("envoyFileAccessLog") {
                let path = f
                    .get("path")
                    .and_then(Value::as_str)
                    .unwrap_or("/dev/stdout");
                if path == "/dev/stdout" && f.get("logFormat").is_none() {
                    p.access_logs.push(name.to_string());
                }
            }
            if e.get("prometheus").is_some() {
                p.metrics.push(name.to_string());
            }
        }
        let defaults = mesh.and_then(|m| m.get("defaultProviders"));
        p.default_access_logging =
            strings(defaults.and_then(|d| d.get("accessLogging"))).unwrap_or_default();
        p.default_metrics = strings(defaults.and_then(|d| d.get("metrics")))
            .unwrap_or_else(|| vec!["prometheus".into()]);
        p
    }
}

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
            let providers = ours(&mesh.access_logs, &l.providers, &at, "an access log this waypoint writes (envoy, or an envoyFileAccessLog provider to /dev/stdout without a logFormat)")?;
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
            if m.reporting_interval.is_some() {
                return Err(format!("{at}.reportingInterval: not supported (the waypoint reports TCP metrics when a connection opens and closes)"));
            }
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
                providers,
                overrides,
            });
        }
        let mut tracing = Vec::new();
        for (i, t) in self.tracing.iter().enumerate() {
            let at = format!("tracing[{i}]");
            let tracer = mesh.tracing.iter().cloned().collect::<Vec<_>>();
            ours(&tracer, &t.providers, &at, "the mesh config's tracing provider (defaultProviders.tracing), the one this waypoint exports to")?;
            if t.custom_tags.is_some() {
                return Err(format!("{at}.customTags: not supported"));
            }
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
    /// No Telemetry access logging and no default provider: every request (as before).
    #[default]
    Always,
    Off,
    /// On for requests any of these filters take (no filter: every request).
    Filtered(Vec<Arc<Expr>>),
}

/// What the Telemetries in force do to one request.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub log: LogPolicy,
    /// None: the metrics as they are (the fast path).
    pub http: Option<HttpOverrides>,
    pub tcp: Option<[MetricOverride; 4]>,
    /// `randomSamplingPercentage` in force, if any Telemetry sets it.
    pub sampling: Option<f64>,
    /// `disableSpanReporting`.
    pub spans_off: bool,
}

impl Applied {
    /// No Telemetry at all: one shared value (requests take a reference, not an allocation).
    pub fn defaults() -> Arc<Applied> {
        static NONE: std::sync::OnceLock<Arc<Applied>> = std::sync::OnceLock::new();
        NONE.get_or_init(Arc::default).clone()
    }

    /// The request headers a filter reads (kept for the log line).
    pub fn filter_headers(&self) -> impl Iterator<Item = &http::HeaderName> {
        let filters: &[Arc<Expr>] = match &self.log {
            LogPolicy::Filtered(f) => f,
            _ => &[],
        };
        filters.iter().flat_map(|f| f.headers())
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

    pub fn is_empty(&self) -> bool {
        self.list.is_empty() && self.mesh.default_access_logging.is_empty()
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
        }
        a
    }

    /// Istio's mergeLogs for the waypoint's one log (whichever of its names is used).
    fn logging(&self, tels: &[&Compiled]) -> LogPolicy {
        let defaults = &self.mesh.default_access_logging;
        if tels.iter().all(|c| c.logging.is_empty()) && defaults.is_empty() {
            return LogPolicy::Always;
        }
        let ours = |p: &String| {
            self.mesh
                .access_logs
                .iter()
                .any(|o| o.eq_ignore_ascii_case(p))
        };
        if tels.iter().all(|c| c.logging.is_empty()) {
            // Only the default providers: on, unfiltered, when ours is among them.
            return if defaults.iter().any(ours) {
                LogPolicy::Filtered(Vec::new())
            } else {
                LogPolicy::Off
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
        let on: Vec<Option<Arc<Expr>>> = state
            .into_iter()
            .filter(|(p, _)| ours(p))
            .filter_map(|(_, v)| v)
            .collect();
        if on.is_empty() {
            LogPolicy::Off
        } else if on.iter().any(Option::is_none) {
            LogPolicy::Filtered(Vec::new())
        } else {
            LogPolicy::Filtered(on.into_iter().flatten().collect())
        }
    }

    /// Istio's mergeMetrics for the waypoint's prometheus metrics (SERVER mode).
    fn metric_overrides(&self, tels: &[&Compiled], a: &mut Applied) {
        let entries: Vec<&MetricsEntry> = tels.iter().flat_map(|c| &c.metrics).collect();
        if entries.is_empty() {
            return;
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
