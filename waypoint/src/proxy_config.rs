//! Istio's ProxyConfig for the waypoint process, read as pilot-agent reads it for Istio's
//! waypoint: istiod's waypoint template renders the merged `meshConfig.defaultConfig` and
//! ProxyConfig resources into the `PROXY_CONFIG` environment variable (JSON) and the
//! container's CPU limit into `ISTIO_CPU_LIMIT`. Two fields shape this process:
//!
//! - `concurrency`: worker threads. Unset: the CPU limit when there is one, else
//!   Istio's default of 2; `0`: one per CPU of the node.
//! - `terminationDrainDuration`: how long a drain (SIGTERM, `/quitquitquit`) lets open
//!   tunnels finish. Unset: the waypoint's own deadline from its grace period.
//!
//! The rest of ProxyConfig configures Envoy or the agent (stats, tracing, images...) and
//! is ignored here, as fields this process has no counterpart for.

use std::time::Duration;

use serde::Deserialize;

/// Istio's default worker threads (`mesh.DefaultProxyConfig`).
pub const DEFAULT_CONCURRENCY: usize = 2;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProxyConfigError {
    #[error("PROXY_CONFIG is not ProxyConfig JSON: {0} (istiod renders it; fix the ProxyConfig or meshConfig.defaultConfig it comes from)")]
    Json(String),
    #[error("PROXY_CONFIG terminationDrainDuration: {0}")]
    Duration(String),
    #[error("ISTIO_CPU_LIMIT {0:?} is not a whole number of CPUs")]
    CpuLimit(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    /// Written as a number (protobuf JSON's Int32Value).
    concurrency: Option<u32>,
    termination_drain_duration: Option<String>,
}

/// What this process takes from ProxyConfig.
#[derive(Debug, PartialEq, Eq)]
pub struct ProxySettings {
    /// Worker threads; `None`: one per CPU (concurrency 0).
    pub worker_threads: Option<usize>,
    /// The drain's length when ProxyConfig sets one.
    pub drain: Option<Duration>,
}

impl ProxySettings {
    /// From the values of `PROXY_CONFIG` and `ISTIO_CPU_LIMIT` (unset or empty: absent).
    pub fn from_env(
        proxy_config: Option<&str>,
        cpu_limit: Option<&str>,
    ) -> Result<ProxySettings, ProxyConfigError> {
        let raw: Raw = match proxy_config.map(str::trim).filter(|s| !s.is_empty()) {
            None => Raw::default(),
            Some(text) => {
                serde_json::from_str(text).map_err(|e| ProxyConfigError::Json(e.to_string()))?
            }
        };
        let cpu_limit = match cpu_limit.map(str::trim).filter(|s| !s.is_empty()) {
            None => 0,
            Some(v) => v
                .parse::<u32>()
                .map_err(|_| ProxyConfigError::CpuLimit(v.to_string()))?,
        };
        let concurrency = match raw.concurrency {
            Some(c) => c as usize,
            None if cpu_limit > 0 => cpu_limit as usize,
            None => DEFAULT_CONCURRENCY,
        };
        let drain = raw
            .termination_drain_duration
            .as_deref()
            .map(|d| {
                ztunnel::config::istio_env::parse_duration(d).map_err(ProxyConfigError::Duration)
            })
            .transpose()?;
        Ok(ProxySettings {
            worker_threads: (concurrency > 0).then_some(concurrency),
            drain,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_and_drain_as_pilot_agent_reads_them() {
        let s = |pc: Option<&str>, cpu: Option<&str>| ProxySettings::from_env(pc, cpu);
        // Istio's defaults.
        assert_eq!(
            s(None, None),
            Ok(ProxySettings {
                worker_threads: Some(2),
                drain: None
            })
        );
        // The CPU limit when concurrency is unset; concurrency when set; 0: every CPU.
        assert_eq!(s(Some("{}"), Some("4")).unwrap().worker_threads, Some(4));
        assert_eq!(
            s(Some(r#"{"concurrency": 1}"#), Some("4"))
                .unwrap()
                .worker_threads,
            Some(1)
        );
        assert_eq!(
            s(Some(r#"{"concurrency": 0}"#), None)
                .unwrap()
                .worker_threads,
            None
        );
        assert_eq!(
            s(
                Some(r#"{"terminationDrainDuration": "7s", "proxyMetadata": {"A": "b"}}"#),
                None
            )
            .unwrap()
            .drain,
            Some(Duration::from_secs(7))
        );
    }

    #[test]
    fn bad_values_are_refused_with_their_source_named() {
        let e = ProxySettings::from_env(Some("{concurrency"), None).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("PROXY_CONFIG is not ProxyConfig JSON"),
            "{e}"
        );
        let e = ProxySettings::from_env(Some(r#"{"concurrency": -1}"#), None).unwrap_err();
        assert!(matches!(e, ProxyConfigError::Json(_)), "{e}");
        let e = ProxySettings::from_env(Some(r#"{"terminationDrainDuration": "soon"}"#), None)
            .unwrap_err();
        assert!(matches!(e, ProxyConfigError::Duration(_)), "{e}");
        assert_eq!(
            ProxySettings::from_env(None, Some("1.5")),
            Err(ProxyConfigError::CpuLimit("1.5".into()))
        );
    }
}
