//! What the mesh config says about telemetry providers: which access logs the waypoint
//! writes and how (meshConfig `accessLogFile` / `accessLogFormat` / `accessLogEncoding`
//! for the built-in `envoy` provider; `envoyFileAccessLog` providers), its metrics
//! providers, the default providers, and the tracing provider in use.

use std::sync::Arc;

use serde_json::Value;

use super::format::LogFormat;
use super::output::Output;
use super::tags::CustomTags;

/// What the mesh config says about telemetry providers.
#[derive(Clone, Debug, Default)]
pub struct MeshProviders {
    /// The access logs the waypoint writes, by provider name (lower case).
    pub(super) access_logs: Vec<(String, Arc<Output>)>,
    pub(super) default_access_logging: Vec<String>,
    /// Providers the waypoint's metrics are (`prometheus` and prometheus providers).
    pub(super) metrics: Vec<String>,
    pub(super) default_metrics: Vec<String>,
    /// The tracing provider spans go to, if any.
    pub(super) tracing: Option<String>,
    /// `defaultConfig.tracing.custom_tags` (ProxyConfig): the tags when no Telemetry
    /// sets any.
    pub(super) default_tags: Option<Arc<CustomTags>>,
    /// Access-log settings refused, the field named (those providers are not written).
    errors: Vec<String>,
}

/// The built-in `envoy` provider as the mesh config's access-log fields make it. With
/// none of them set, the waypoint's own `request complete` line.
fn mesh_access_log(mesh: Option<&Value>) -> Result<Arc<Output>, String> {
    let field = |k: &str| mesh.and_then(|m| m.get(k)).and_then(Value::as_str);
    let (file, format, encoding) = (
        field("accessLogFile"),
        field("accessLogFormat"),
        field("accessLogEncoding"),
    );
    if file.is_none() && format.is_none() && encoding.is_none() {
        return Ok(Output::own_line());
    }
    let path = file.filter(|f| !f.is_empty()).unwrap_or("/dev/stdout");
    let format = match encoding.unwrap_or("TEXT") {
        "TEXT" => match format.filter(|f| !f.is_empty()) {
            Some(f) => LogFormat::text(f).map_err(|e| format!("accessLogFormat: {e}"))?,
            None => LogFormat::istio_text(),
        },
        "JSON" => {
            let text = format.unwrap_or_default();
            match LogFormat::json_text(text) {
                Ok(f) => f,
                // As istiod: labels that do not parse as JSON give the default ones.
                Err(super::format::FormatError::Json(e)) => {
                    tracing::warn!(error = %e, "meshConfig.accessLogFormat: not JSON labels; Istio's default labels are used");
                    LogFormat::json(None).map_err(|e| format!("accessLogFormat: {e}"))?
                }
                Err(e) => return Err(format!("accessLogFormat: {e}")),
            }
        }
        other => return Err(format!("accessLogEncoding: {other:?} is not TEXT or JSON")),
    };
    Ok(Arc::new(Output::formatted(format, path)))
}

/// An `envoyFileAccessLog` provider's output (`path`, `logFormat.text` or `.labels`).
fn file_access_log(f: &Value) -> Result<Arc<Output>, String> {
    let path = f
        .get("path")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
        .unwrap_or("/dev/stdout");
    if f.get("omitEmptyValues").and_then(Value::as_bool) == Some(true) {
        return Err("omitEmptyValues: not supported".into());
    }
    let lf = f.get("logFormat");
    let format = match (
        lf.and_then(|l| l.get("text")).and_then(Value::as_str),
        lf.and_then(|l| l.get("labels")),
    ) {
        (Some(t), _) if !t.is_empty() => {
            LogFormat::text(t).map_err(|e| format!("logFormat.text: {e}"))?
        }
        (_, Some(labels)) => {
            LogFormat::json(Some(labels)).map_err(|e| format!("logFormat.labels: {e}"))?
        }
        _ => LogFormat::istio_text(),
    };
    Ok(Arc::new(Output::formatted(format, path)))
}

impl MeshProviders {
    /// From the mesh config (`extensionProviders`, `defaultProviders`, the access-log
    /// fields) and the tracing provider in use. Istio's built-in `envoy` and `prometheus`
    /// are always there; without `defaultProviders.metrics`, `prometheus` is the default,
    /// as in Istio. Access-log settings the waypoint refuses are in `errors()` (and
    /// logged); their providers are not written.
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
            metrics: vec!["prometheus".into()],
            tracing: tracing.map(str::to_string),
            ..Default::default()
        };
        let envoy = mesh_access_log(mesh);
        match &envoy {
            Ok(o) => p.access_logs.push(("envoy".into(), o.clone())),
            Err(e) => p.errors.push(format!("meshConfig.{e}")),
        }
        let providers = mesh
            .and_then(|m| m.get("extensionProviders"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for (i, e) in providers.iter().enumerate() {
            let Some(name) = e.get("name").and_then(Value::as_str) else {
                continue;
            };
            if let Some(f) = e.get("envoyFileAccessLog") {
                let name = name.to_ascii_lowercase();
                // As istiod: a provider named `envoy` without a format is the mesh's.
                let out = if name == "envoy" && f.get("logFormat").is_none() {
                    envoy.clone().map_err(|e| format!("meshConfig.{e}"))
                } else {
                    file_access_log(f).map_err(|err| {
                        format!("meshConfig.extensionProviders[{i}].envoyFileAccessLog.{err} (provider {name})")
                    })
                };
                match out {
                    Ok(o) => {
                        p.access_logs.retain(|(n, _)| *n != name);
                        p.access_logs.push((name, o));
                    }
                    Err(e) => {
                        p.access_logs.retain(|(n, _)| *n != name);
                        p.errors.push(e);
                    }
                }
            }
            if let Some(o) = e.get("envoyOtelAls") {
                let name = name.to_ascii_lowercase();
                p.access_logs.retain(|(n, _)| *n != name);
                match super::otel_log::OtelLog::parse(o) {
                    Ok(o) => p.access_logs.push((name, Arc::new(Output::otel(o)))),
                    Err(err) => p.errors.push(format!(
                        "meshConfig.extensionProviders[{i}].envoyOtelAls.{err} (provider {name})"
                    )),
                }
            }
            if e.get("prometheus").is_some() {
                p.metrics.push(name.to_string());
            }
        }
        let tags = mesh
            .and_then(|m| m.pointer("/defaultConfig/tracing"))
            .and_then(|t| t.get("customTags").or_else(|| t.get("custom_tags")));
        if let Some(t) = tags {
            match CustomTags::parse(t, |n| std::env::var(n).ok()) {
                Ok(t) if t.is_empty() => {}
                Ok(t) => p.default_tags = Some(Arc::new(t)),
                Err(e) => p
                    .errors
                    .push(format!("meshConfig.defaultConfig.tracing.customTags.{e}")),
            }
        }
        for e in &p.errors {
            tracing::warn!(error = %e, "telemetry setting refused");
        }
        let defaults = mesh.and_then(|m| m.get("defaultProviders"));
        p.default_access_logging =
            strings(defaults.and_then(|d| d.get("accessLogging"))).unwrap_or_default();
        p.default_metrics = strings(defaults.and_then(|d| d.get("metrics")))
            .unwrap_or_else(|| vec!["prometheus".into()]);
        p
    }

    /// Access-log settings refused, each with its field.
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// The names of the access logs the waypoint writes.
    pub(super) fn access_log_names(&self) -> Vec<String> {
        self.access_logs.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The output of access-log provider `name` (case-insensitive).
    pub fn access_log(&self, name: &str) -> Option<&Arc<Output>> {
        self.access_logs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, o)| o)
    }

    /// The built-in `envoy` provider's output (the log of a request no Telemetry
    /// configures).
    pub fn envoy(&self) -> Arc<Output> {
        self.access_log("envoy")
            .cloned()
            .unwrap_or_else(Output::own_line)
    }
}
