//! The Telemetry resource (`telemetry.istio.io/v1`) as the waypoint reads it: Istio's
//! field names; unknown fields are refused.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::object::ObjectRef;

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
