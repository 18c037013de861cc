//! Istio's `HTTPRetry` (a VirtualService route's `retries`, and the mesh config's
//! `defaultHttpRetryPolicy`) as the waypoint's `Retry`, with Istio's semantics
//! (`pilot/pkg/networking/core/route/retry/retry.go` `ConvertPolicy`): `attempts` 0 or
//! unset turns retries off; `retryOn` unset is Istio's default list; status codes and
//! `retriable-status-codes` listed; `backoff` the base interval.

use std::time::Duration;

use serde::Deserialize;

use super::super::model::Retry;
use crate::extauthz::provider::parse_duration;

/// Istio's `retryOn` when a policy sets none (`retry.go` `defaultRetryOn`); no status
/// code is listed, so no 5xx answer is retried.
pub const DEFAULT_RETRY_ON: &str =
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes";

/// Istio's HTTPRetry, as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsRetries {
    pub attempts: Option<i64>,
    pub per_try_timeout: Option<String>,
    pub retry_on: Option<String>,
    pub backoff: Option<String>,
    /// Envoy's `previous_hosts` predicate (Istio's default true): a retry goes to another
    /// endpoint when there is one. The waypoint always prefers another endpoint; with
    /// `false` Envoy may (by chance) pick the same one again, which ours never does
    /// while another is healthy.
    pub retry_ignore_previous_hosts: Option<bool>,
    /// Envoy's `previous_priorities`: retries go to the next locality priority. Locality
    /// priorities are not how the waypoint picks endpoints (a Service's
    /// `routingPreferences` are): `true` cannot be enforced (see `Converted::unsupported`).
    pub retry_remote_localities: Option<bool>,
}

/// The error type of this module: the field path and what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct RetryError(pub String);

/// Istio's `retryOn` policies as the status codes the waypoint retries on (503 and
/// 504 also stand for a failed connection and a timeout).
pub fn retry_codes(on: &str) -> Result<Vec<u16>, RetryError> {
    let mut codes = Vec::new();
    for p in on.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match p {
            "5xx" => codes.extend(500..=599),
            "gateway-error" => codes.extend([502, 503, 504]),
            "connect-failure" | "refused-stream" | "reset" | "unavailable" => codes.push(503),
            "retriable-4xx" => codes.push(409),
            "retriable-status-codes" | "cancelled" | "deadline-exceeded" | "resource-exhausted" => {
            }
            n => codes.push(
                n.parse::<u16>()
                    .ok()
                    .filter(|c| (100..600).contains(c))
                    .ok_or_else(|| {
                        RetryError(format!(
                            "retryOn: {n:?} is not a retry policy or status code"
                        ))
                    })?,
            ),
        }
    }
    codes.sort_unstable();
    codes.dedup();
    Ok(codes)
}

/// A policy as the waypoint applies it, and its per-try timeout.
pub struct Converted {
    /// `attempts: Some(0)` when the policy turns retries off.
    pub retry: Retry,
    pub per_try_timeout: Option<Duration>,
    /// A valid field the waypoint cannot enforce: what uses the policy fails closed
    /// (the rule answers 503 naming it) rather than retry otherwise than asked.
    pub unsupported: Option<String>,
}

impl VsRetries {
    /// Istio's `ConvertPolicy`: errors name the field (relative to the policy).
    pub fn convert(&self) -> Result<Converted, RetryError> {
        let dur = |s: &Option<String>, field: &str| {
            s.as_deref()
                .map(parse_duration)
                .transpose()
                .map_err(|e| RetryError(format!("{field}: {e}")))
        };
        let per_try_timeout = dur(&self.per_try_timeout, "perTryTimeout")?;
        let backoff = dur(&self.backoff, "backoff")?;
        let unsupported = (self.retry_remote_localities == Some(true)).then(|| {
            "retryRemoteLocalities: retrying in other locality priorities is not supported \
             (the waypoint picks endpoints by the Service's routingPreferences)"
                .to_string()
        });
        let attempts = self.attempts.unwrap_or(0);
        if attempts > 10 {
            return Err(RetryError("attempts: at most 10 retries".into()));
        }
        // `attempts` 0 or unset turns retries off, Istio's defaults included
        // (`retry.ConvertPolicy`: attempts <= 0 is no policy at all).
        if attempts <= 0 {
            return Ok(Converted {
                retry: Retry {
                    codes: Vec::new(),
                    attempts: Some(0),
                    backoff: None,
                },
                per_try_timeout: None,
                unsupported: None,
            });
        }
        let on = self
            .retry_on
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_RETRY_ON);
        Ok(Converted {
            retry: Retry {
                codes: retry_codes(on)?,
                attempts: u32::try_from(attempts).ok(),
                backoff,
            },
            per_try_timeout,
            unsupported,
        })
    }
}

/// The mesh config's `defaultHttpRetryPolicy`: the policy of every route that sets none
/// (Istio's `route.go`: `policy = opts.Mesh.GetDefaultHttpRetryPolicy()` when the route's
/// is nil, and the default route's). None when the mesh config has none: Istio's own
/// default applies.
pub fn mesh_default(mesh: Option<&serde_json::Value>) -> Result<Option<MeshRetry>, RetryError> {
    let Some(v) = mesh.and_then(|m| m.get("defaultHttpRetryPolicy")) else {
        return Ok(None);
    };
    if v.is_null() {
        return Ok(None);
    }
    let raw: VsRetries = serde_json::from_value(v.clone())
        .map_err(|e| RetryError(format!("defaultHttpRetryPolicy: {e}")))?;
    let c = raw
        .convert()
        .map_err(|e| RetryError(format!("defaultHttpRetryPolicy.{e}")))?;
    if let Some(u) = c.unsupported {
        return Err(RetryError(format!("defaultHttpRetryPolicy.{u}")));
    }
    Ok(Some(MeshRetry {
        retry: c.retry,
        per_try_timeout: c.per_try_timeout,
    }))
}

/// `meshConfig.defaultHttpRetryPolicy`, converted.
#[derive(Clone, Debug)]
pub struct MeshRetry {
    pub retry: Retry,
    /// Its `perTryTimeout`, for routes without their own per-try timeout.
    pub per_try_timeout: Option<Duration>,
}
