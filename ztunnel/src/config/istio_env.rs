//! Istio ztunnel's environment variables, under Istio's names and value formats
//! (docs/environment.md has the table). Pure functions over an [`Env`] snapshot, so the
//! binary and the tests read the same rules; the binary applies the results over its
//! own flags (whose environment names stay as aliases).

use std::collections::BTreeMap;
use std::time::Duration;

/// Parsed here from the environment; the socket options are the netns module's.
pub use crate::netns::Keepalive;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("invalid {name}={value:?}: {reason}")]
    Invalid {
        name: String,
        value: String,
        reason: String,
    },
    /// A setting we cannot honour and whose silent omission would weaken security or
    /// break traffic: the proxy refuses to start rather than run differently.
    #[error("{name}={value:?} is not supported by this ztunnel: {reason}; unset it to start")]
    Refused {
        name: String,
        value: String,
        reason: String,
    },
}

/// The process environment at start, as UTF-8 pairs (a variable that is not UTF-8 is
/// skipped: std::env::vars would panic on it).
#[derive(Debug, Default, Clone)]
pub struct Env(BTreeMap<String, String>);

impl Env {
    pub fn from_process() -> Env {
        Env(std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect())
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env(pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// Set and not empty (Istio treats an empty address as unset).
    pub fn non_empty(&self, name: &str) -> Option<&str> {
        self.get(name).filter(|v| !v.is_empty())
    }

    /// `(name without the prefix, value)` of every variable named `<prefix>...`.
    pub fn with_prefix<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        self.0
            .range(prefix.to_string()..)
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(move |(k, v)| (&k[prefix.len()..], v.as_str()))
    }

    fn invalid(&self, name: &str, reason: impl Into<String>) -> EnvError {
        EnvError::Invalid {
            name: name.into(),
            value: self.get(name).unwrap_or_default().into(),
            reason: reason.into(),
        }
    }

    fn refused(&self, name: &str, reason: impl Into<String>) -> EnvError {
        EnvError::Refused {
            name: name.into(),
            value: self.get(name).unwrap_or_default().into(),
            reason: reason.into(),
        }
    }

    /// A duration in Istio's format ("24h", "1h30m", "500ms", a bare number of seconds).
    pub fn duration(&self, name: &str) -> Result<Option<Duration>, EnvError> {
        self.get(name)
            .map(|v| parse_duration(v).map_err(|e| self.invalid(name, e)))
            .transpose()
    }

    /// `true` / `false`, as Rust's (and Istio's) bool parsing.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, EnvError> {
        self.number(name)
    }

    pub fn number<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, EnvError>
    where
        T::Err: std::fmt::Display,
    {
        self.get(name)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|e| self.invalid(name, e.to_string()))
            })
            .transpose()
    }
}

/// Istio's duration strings: one or more `<number><unit>` terms (units `ns`, `us`/`µs`,
/// `ms`, `s`, `m`, `h`, `d`; fractions allowed, spaces between terms allowed), or a bare
/// number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(format!(
                "{s:?}: expected a number before {rest:?} (e.g. \"24h\", \"1h30m\", \"500ms\")"
            ));
        }
        let value: f64 = rest[..num_len]
            .parse()
            .map_err(|_| format!("{s:?}: bad number {:?}", &rest[..num_len]))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.' || c.is_whitespace())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = rest[unit_len..].trim_start();
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            "" => {
                return Err(format!(
                    "{s:?}: a unit is needed after {value} (ns, us, ms, s, m, h, d)"
                ))
            }
            other => {
                return Err(format!(
                    "{s:?}: unknown unit {other:?} (ns, us, ms, s, m, h, d)"
                ))
            }
        };
        let term = Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{s:?}: {e}"))?;
        total = total
            .checked_add(term)
            .ok_or_else(|| format!("{s:?}: too long"))?;
    }
    Ok(total)
}

/// Istio's SO_MARK on the proxy's sockets, which istio-cni's rules (and ours) exempt.
pub const ISTIO_PACKET_MARK: u32 = 1337;

/// How many data-path worker threads: `ZTUNNEL_WORKER_THREADS` as a number, `N%` of the
/// CPUs, or 0 (all CPUs); unset: Istio's CPU-aware default when the chart passes the
/// container's CPU resources (`ZTUNNEL_RESOURCE_CPU_*`), else `default`.
pub fn worker_threads(env: &Env, value: Option<&str>, default: usize) -> Result<usize, EnvError> {
    const NAME: &str = "ZTUNNEL_WORKER_THREADS";
    let invalid = |reason: String| EnvError::Invalid {
        name: NAME.into(),
        value: value.unwrap_or_default().into(),
        reason,
    };
    let threads = match value.map(str::trim) {
        Some(v) => match v.strip_suffix('%') {
            Some(p) => {
                let percent: f64 = p
                    .trim()
                    .parse()
                    .map_err(|e| invalid(format!("invalid percentage: {e}")))?;
                if !(percent > 0.0 && percent <= 100.0) {
                    return Err(invalid("percentage must be above 0 and at most 100".into()));
                }
                ((cpu_count(env)? as f64 * percent / 100.0).ceil() as usize).max(1)
            }
            None => match v
                .parse::<usize>()
                .map_err(|e| invalid(format!("invalid number: {e}")))?
            {
                0 => cpu_count(env)?,
                n => n,
            },
        },
        None => {
            let limit = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_LIMIT")?;
            let request = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_REQUEST")?;
            match (limit, request) {
                (None, None) => default,
                // Istio: an explicit limit wins (the request can raise it) ...
                (Some(limit), request) => limit.max(request.unwrap_or(0)),
                // ... otherwise a quarter of the CPUs, at least the request and 2.
                (None, Some(request)) => ((cpu_count(env)? as f64 * 0.25).ceil() as usize)
                    .max(request)
                    .max(2),
            }
        }
    };
    // A runaway value (e.g. a typo'd 10000) would only cost memory and wake-ups.
    Ok(threads.clamp(1, 1024))
}

/// The CPUs percentages refer to: the container's limit (`ZTUNNEL_RESOURCE_CPU_LIMIT`,
/// then `ZTUNNEL_CPU_LIMIT`, both from the downward API), else what the kernel lets us use.
pub fn cpu_count(env: &Env) -> Result<usize, EnvError> {
    if let Some(n) = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_LIMIT")? {
        return Ok(n);
    }
    match env.number::<usize>("ZTUNNEL_CPU_LIMIT")? {
        Some(n) if n > 0 => Ok(n),
        _ => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// A Kubernetes CPU quantity ("2", "1.5", "500m") rounded up to whole CPUs.
fn cpu_quantity(env: &Env, name: &str) -> Result<Option<usize>, EnvError> {
    let Some(raw) = env.non_empty(name) else {
        return Ok(None);
    };
    let cores = match raw.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().map(|m| m / 1000.0),
        None => raw.parse::<f64>(),
    }
    .map_err(|e| env.invalid(name, e.to_string()))?;
    if !cores.is_finite() || cores <= 0.0 {
        return Err(env.invalid(name, "must be a positive CPU quantity"));
    }
    Ok(Some((cores.ceil() as usize).min(1024)))
}

/// gRPC headers from `<prefix><NAME>=<value>` variables (Istio's XDS_HEADER_* and
/// CA_HEADER_*): names are lowercased, both must be valid ASCII metadata.
pub fn headers(
    env: &Env,
    prefix: &str,
) -> Result<
    Vec<(
        tonic::metadata::AsciiMetadataKey,
        tonic::metadata::AsciiMetadataValue,
    )>,
    EnvError,
> {
    env.with_prefix(prefix)
        .map(|(key, value)| {
            let name = format!("{prefix}{key}");
            let bad = |reason: &str| EnvError::Invalid {
                name: name.clone(),
                value: value.into(),
                reason: reason.into(),
            };
            let k = tonic::metadata::AsciiMetadataKey::from_bytes(key.as_bytes())
                .map_err(|_| bad("not a valid gRPC header name"))?;
            let v = tonic::metadata::AsciiMetadataValue::try_from(value)
                .map_err(|_| bad("not a valid gRPC header value"))?;
            Ok((k, v))
        })
        .collect()
}

/// The xDS node metadata from the environment, as Istio's ztunnel sends it:
/// `ISTIO_META_<KEY>=v` as the string `v` under `<KEY>`, then `ISTIO_METAJSON_<KEY>` as
/// parsed JSON (overriding). A JSON value that does not parse is left out with a warning,
/// as upstream does. Returns the metadata and the warnings.
pub fn node_metadata(env: &Env) -> (BTreeMap<String, serde_json::Value>, Vec<String>) {
    let mut meta: BTreeMap<String, serde_json::Value> = env
        .with_prefix("ISTIO_META_")
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), serde_json::Value::String(v.into())))
        .collect();
    let mut warnings = Vec::new();
    for (k, v) in env
        .with_prefix("ISTIO_METAJSON_")
        .filter(|(k, _)| !k.is_empty())
    {
        match serde_json::from_str(v) {
            Ok(json) => {
                meta.insert(k.to_string(), json);
            }
            Err(e) => warnings.push(format!(
                "ISTIO_METAJSON_{k} is not valid JSON ({e}); left out of the xDS node metadata"
            )),
        }
    }
    (meta, warnings)
}

/// Istio's variables for features this ztunnel does not have (or has only one way):
/// harmless ones give a warning naming them; ones whose omission would change security
/// or break traffic refuse the start. Returns the warnings.
pub fn unsupported(env: &Env) -> Result<Vec<String>, EnvError> {
    let mut warnings = Vec::new();
    let mut warn = |name: &str, what: &str| {
        warnings.push(format!(
            "{name}={:?} ignored: {what}",
            env.get(name).unwrap_or_default()
        ))
    };

    if let Some(mode) = env.get("PROXY_MODE") {
        if !mode.eq_ignore_ascii_case("shared") {
            return Err(env.refused(
                "PROXY_MODE",
                "only the shared node proxy mode exists (PROXY_MODE=shared)",
            ));
        }
    }
    if env.bool("ENABLE_PROXY")? == Some(false) {
        return Err(env.refused(
            "ENABLE_PROXY",
            "a DNS-only ztunnel does not exist; the proxy always runs",
        ));
    }
    if let Some(mark) = env.number::<u32>("PACKET_MARK")? {
        if mark != ISTIO_PACKET_MARK {
            return Err(env.refused(
                "PACKET_MARK",
                format!("the proxy's socket mark is fixed at {ISTIO_PACKET_MARK} (Istio's default, which istio-cni's rules exempt); another mark would loop or drop the proxy's own traffic"),
            ));
        }
    }
    if let Some(v) = env.get("ISTIO_META_DNS_PROXY_ADDR") {
        let ok = matches!(v.trim(), "localhost:15053" | "127.0.0.1:15053");
        if !ok {
            warn("ISTIO_META_DNS_PROXY_ADDR", "the DNS proxy always listens on 127.0.0.1:15053 in each pod (istio-cni redirects DNS there)");
        }
    }
    // Istio's ztunnel reads COMPLIANCE_POLICY for HBONE's key exchange: `pqc` offers and
    // accepts X25519MLKEM768 only. ring (our provider: tls.rs) has no ML-KEM, and a FIPS
    // policy needs a validated module we do not build: running on X25519 or non-validated
    // crypto where the operator asked otherwise would be a silent downgrade.
    match env.non_empty("COMPLIANCE_POLICY").map(str::trim) {
        None => {}
        Some(p) if p.eq_ignore_ascii_case("pqc") => {
            return Err(env.refused("COMPLIANCE_POLICY", "post-quantum key exchange (X25519MLKEM768) needs ML-KEM, which this build's TLS provider (ring) does not have; HBONE here uses X25519 or P-256"))
        }
        Some(_) => {
            return Err(env.refused("COMPLIANCE_POLICY", "this build has no FIPS-validated crypto module (HBONE's TLS uses ring)"));
        }
    }
    // Istio's ztunnel enables TLS 1.2 for exactly "true" and ignores any other value.
    if env.get("TLS12_ENABLED") == Some("true") {
        warn("TLS12_ENABLED", "HBONE stays TLS 1.3 only (stricter; every HBONE peer, Istio's ztunnel included, speaks TLS 1.3)");
    }
    // IPV6_ENABLED is honoured (main.rs); parsed here so a bad value is refused early.
    env.bool("IPV6_ENABLED")?;
    if env.bool("ENABLE_ORIG_SRC")? == Some(false) {
        warn(
            "ENABLE_ORIG_SRC",
            "inbound deliveries always keep the client's source address",
        );
    }
    if env.bool("XDS_ON_DEMAND")? == Some(true) {
        warn(
            "XDS_ON_DEMAND",
            "the xDS client always subscribes to every resource",
        );
    }
    if env.bool("UNSTABLE_ENABLE_SOCKS5")? == Some(true) {
        warn("UNSTABLE_ENABLE_SOCKS5", "there is no SOCKS5 listener");
    }
    for name in [
        "PREFERED_SERVICE_NAMESPACE",
        "PROXY_CONFIG",
        "AUTHZ_POLICY_INFO_LOGGING",
    ] {
        if env.non_empty(name).is_some() {
            warn(name, "not implemented");
        }
    }
    Ok(warnings)
}

/// HBONE's HTTP/2 sizes from Istio's `HTTP2_STREAM_WINDOW_SIZE`,
/// `HTTP2_CONNECTION_WINDOW_SIZE` and `HTTP2_FRAME_SIZE` (bytes; unset: Istio's defaults).
pub fn h2_sizes(env: &Env) -> Result<crate::hbone::H2Sizes, EnvError> {
    use crate::hbone::tuning::{FRAME_RANGE, MAX_WINDOW};
    let d = crate::hbone::H2Sizes::default();
    let window = |name: &str, default: u32| -> Result<u32, EnvError> {
        match env.number::<u32>(name)? {
            None => Ok(default),
            // Below the protocol's initial 65,535 a peer could not even send its first frame.
            Some(v) if (65_535..=MAX_WINDOW).contains(&v) => Ok(v),
            Some(_) => Err(env.invalid(
                name,
                format!("must be between 65535 and {MAX_WINDOW} bytes"),
            )),
        }
    };
    let max_frame = match env.number::<u32>("HTTP2_FRAME_SIZE")? {
        None => d.max_frame,
        Some(v) if FRAME_RANGE.contains(&v) => v,
        Some(_) => {
            return Err(env.invalid(
                "HTTP2_FRAME_SIZE",
                format!(
                    "must be between {} and {} bytes (HTTP/2's range)",
                    FRAME_RANGE.start(),
                    FRAME_RANGE.end()
                ),
            ))
        }
    };
    Ok(crate::hbone::H2Sizes {
        stream_window: window("HTTP2_STREAM_WINDOW_SIZE", d.stream_window)?,
        connection_window: window("HTTP2_CONNECTION_WINDOW_SIZE", d.connection_window)?,
        max_frame,
    })
}

impl Keepalive {
    /// Istio's KEEPALIVE_* and USER_TIMEOUT_ENABLED; unset: Istio's defaults.
    pub fn from_env(env: &Env) -> Result<Keepalive, EnvError> {
        let d = Keepalive::default();
        let k = Keepalive {
            enabled: env.bool("KEEPALIVE_ENABLED")?.unwrap_or(d.enabled),
            time: env.duration("KEEPALIVE_TIME")?.unwrap_or(d.time),
            interval: env.duration("KEEPALIVE_INTERVAL")?.unwrap_or(d.interval),
            retries: env.number("KEEPALIVE_RETRIES")?.unwrap_or(d.retries),
            user_timeout: env.bool("USER_TIMEOUT_ENABLED")?.unwrap_or(d.user_timeout),
        };
        // The kernel takes whole seconds (at least 1) for these.
        for (name, v) in [
            ("KEEPALIVE_TIME", k.time),
            ("KEEPALIVE_INTERVAL", k.interval),
        ] {
            if k.enabled && v < Duration::from_secs(1) {
                return Err(env.invalid(name, "must be at least 1s"));
            }
        }
        if k.enabled && k.retries == 0 {
            return Err(env.invalid("KEEPALIVE_RETRIES", "must be at least 1"));
        }
        Ok(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_istio_format() {
        for (s, want) in [
            ("24h", Duration::from_secs(86400)),
            ("1h30m", Duration::from_secs(5400)),
            ("1h 30m", Duration::from_secs(5400)),
            ("500ms", Duration::from_millis(500)),
            ("1.5s", Duration::from_millis(1500)),
            ("300", Duration::from_secs(300)),
            ("2d", Duration::from_secs(2 * 86400)),
            ("10us", Duration::from_micros(10)),
        ] {
            assert_eq!(parse_duration(s), Ok(want), "{s}");
        }
        for bad in ["", "h", "5x", "1.2.3s", "-5s", "5 s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
        let env = Env::from_pairs([("SECRET_TTL", "12h"), ("BAD", "12 hours")]);
        assert_eq!(
            env.duration("SECRET_TTL"),
            Ok(Some(Duration::from_secs(43200)))
        );
        let err = env.duration("BAD").unwrap_err().to_string();
        assert!(
            err.contains("BAD=\"12 hours\"") && err.contains("unit"),
            "{err}"
        );
        assert_eq!(env.duration("UNSET"), Ok(None));
    }

    #[test]
    fn worker_threads_accept_percentages_of_the_cpu_limit() {
        let env = Env::from_pairs([("ZTUNNEL_CPU_LIMIT", "8")]);
        assert_eq!(worker_threads(&env, Some("50%"), 2), Ok(4));
        assert_eq!(worker_threads(&env, Some("10%"), 2), Ok(1));
        assert_eq!(worker_threads(&env, Some("100%"), 2), Ok(8));
        assert_eq!(worker_threads(&env, Some("3"), 2), Ok(3));
        assert_eq!(worker_threads(&env, Some("0"), 2), Ok(8), "0: all CPUs");
        assert_eq!(worker_threads(&env, None, 2), Ok(2));
        for bad in ["0%", "150%", "x%", "two", "-1"] {
            let err = worker_threads(&env, Some(bad), 2).unwrap_err().to_string();
            assert!(err.contains("ZTUNNEL_WORKER_THREADS"), "{bad}: {err}");
        }
        // The chart's resource fields: Istio's default from the limit and request.
        let env = Env::from_pairs([
            ("ZTUNNEL_RESOURCE_CPU_LIMIT", "500m"),
            ("ZTUNNEL_CPU_LIMIT", "1"),
        ]);
        assert_eq!(worker_threads(&env, None, 2), Ok(1));
        assert_eq!(worker_threads(&env, Some("100%"), 2), Ok(1));
        let env = Env::from_pairs([
            ("ZTUNNEL_RESOURCE_CPU_REQUEST", "3"),
            ("ZTUNNEL_CPU_LIMIT", "16"),
        ]);
        assert_eq!(worker_threads(&env, None, 2), Ok(4));
        let env = Env::from_pairs([("ZTUNNEL_RESOURCE_CPU_LIMIT", "-1")]);
        assert!(worker_threads(&env, None, 2).is_err());
    }

    #[test]
    fn headers_from_prefixed_variables() {
        let env = Env::from_pairs([
            ("XDS_HEADER_X-Tenant", "a"),
            ("XDS_HEADER_foo", "b"),
            ("CA_HEADER_bar", "c"),
            ("XDS_HEADERX", "no"),
        ]);
        let h: Vec<(String, String)> = headers(&env, "XDS_HEADER_")
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
            .collect();
        assert_eq!(
            h,
            vec![
                ("x-tenant".to_string(), "a".to_string()),
                ("foo".to_string(), "b".to_string())
            ]
        );
        assert_eq!(headers(&env, "CA_HEADER_").unwrap().len(), 1);
        let bad = Env::from_pairs([("XDS_HEADER_a b", "x")]);
        assert!(headers(&bad, "XDS_HEADER_")
            .unwrap_err()
            .to_string()
            .contains("XDS_HEADER_a b"));
        let bad = Env::from_pairs([("CA_HEADER_ok", "line\nbreak")]);
        assert!(headers(&bad, "CA_HEADER_")
            .unwrap_err()
            .to_string()
            .contains("header value"));
    }

    #[test]
    fn node_metadata_strings_and_json() {
        let env = Env::from_pairs([
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("ISTIO_META_CLUSTER_ID", "c1"),
            ("ISTIO_METAJSON_LABELS", r#"{"app":"ztunnel"}"#),
            ("ISTIO_METAJSON_BROKEN", "{"),
            ("ISTIO_META_", "empty key"),
            ("OTHER", "x"),
        ]);
        let (meta, warnings) = node_metadata(&env);
        assert_eq!(meta["DNS_CAPTURE"], serde_json::json!("true"));
        assert_eq!(meta["CLUSTER_ID"], serde_json::json!("c1"));
        assert_eq!(meta["LABELS"], serde_json::json!({"app": "ztunnel"}));
        assert_eq!(meta.len(), 3, "{meta:?}");
        assert!(
            warnings.len() == 1 && warnings[0].contains("ISTIO_METAJSON_BROKEN"),
            "{warnings:?}"
        );
    }

    #[test]
    fn http2_sizes_are_istios_and_checked() {
        assert_eq!(
            h2_sizes(&Env::default()),
            Ok(crate::hbone::H2Sizes::default())
        );
        let env = Env::from_pairs([
            ("HTTP2_STREAM_WINDOW_SIZE", "65535"),
            ("HTTP2_CONNECTION_WINDOW_SIZE", "1048576"),
            ("HTTP2_FRAME_SIZE", "16384"),
        ]);
        assert_eq!(
            h2_sizes(&env),
            Ok(crate::hbone::H2Sizes {
                stream_window: 65_535,
                connection_window: 1_048_576,
                max_frame: 16_384
            })
        );
        for (name, bad) in [
            ("HTTP2_FRAME_SIZE", "1024"),
            ("HTTP2_FRAME_SIZE", "16777216"),
            ("HTTP2_STREAM_WINDOW_SIZE", "100"),
            ("HTTP2_CONNECTION_WINDOW_SIZE", "4294967295"),
            ("HTTP2_STREAM_WINDOW_SIZE", "big"),
        ] {
            let e = h2_sizes(&Env::from_pairs([(name, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(name), "{name}={bad}: {e}");
        }
    }

    #[test]
    fn unsupported_settings_warn_or_refuse() {
        assert_eq!(unsupported(&Env::default()), Ok(vec![]));
        // Istio's defaults and values we match exactly are accepted quietly.
        let same = Env::from_pairs([
            ("PACKET_MARK", "1337"),
            ("PROXY_MODE", "shared"),
            ("ENABLE_PROXY", "true"),
            ("IPV6_ENABLED", "false"),
            ("ENABLE_ORIG_SRC", "true"),
            ("HTTP2_FRAME_SIZE", "1048576"),
            ("ISTIO_META_DNS_PROXY_ADDR", "localhost:15053"),
            ("CRL_PATH", ""),
            ("NETWORK", "net1"),
        ]);
        assert_eq!(unsupported(&same), Ok(vec![]));
        // IPV6_ENABLED is honoured either way; a value that is not a bool is refused.
        assert_eq!(
            unsupported(&Env::from_pairs([("IPV6_ENABLED", "true")])),
            Ok(vec![])
        );
        assert!(matches!(
            unsupported(&Env::from_pairs([("IPV6_ENABLED", "yes")])),
            Err(EnvError::Invalid { .. })
        ));
        let harmless = Env::from_pairs([("XDS_ON_DEMAND", "true"), ("TLS12_ENABLED", "true")]);
        let w = unsupported(&harmless).unwrap();
        for name in ["XDS_ON_DEMAND", "TLS12_ENABLED"] {
            assert!(w.iter().any(|w| w.starts_with(name)), "{name}: {w:?}");
        }
        assert_eq!(
            unsupported(&Env::from_pairs([
                ("TLS12_ENABLED", "false"),
                ("COMPLIANCE_POLICY", "")
            ])),
            Ok(vec![])
        );
        assert_eq!(
            unsupported(&Env::from_pairs([("TLS12_ENABLED", "maybe")])),
            Ok(vec![]),
            "ignored, as by Istio's ztunnel"
        );
        for (name, value) in [
            ("PROXY_MODE", "dedicated"),
            ("PACKET_MARK", "7"),
            ("ENABLE_PROXY", "false"),
            ("COMPLIANCE_POLICY", "pqc"),
            ("COMPLIANCE_POLICY", "fips-140-2"),
            ("COMPLIANCE_POLICY", "fips-140-3"),
        ] {
            let err = unsupported(&Env::from_pairs([(name, value)])).unwrap_err();
            assert!(matches!(err, EnvError::Refused { .. }), "{name}: {err}");
            assert!(err.to_string().contains(name), "{err}");
        }
        assert!(matches!(
            unsupported(&Env::from_pairs([("PACKET_MARK", "x")])),
            Err(EnvError::Invalid { .. })
        ));
    }

    #[test]
    fn keepalive_from_istio_variables() {
        assert_eq!(
            Keepalive::from_env(&Env::default()),
            Ok(Keepalive::default())
        );
        let k = Keepalive::from_env(&Env::from_pairs([
            ("KEEPALIVE_TIME", "30s"),
            ("KEEPALIVE_INTERVAL", "10s"),
            ("KEEPALIVE_RETRIES", "3"),
            ("USER_TIMEOUT_ENABLED", "true"),
        ]))
        .unwrap();
        assert_eq!(
            (k.time, k.interval, k.retries, k.user_timeout),
            (Duration::from_secs(30), Duration::from_secs(10), 3, true)
        );
        assert!(
            !Keepalive::from_env(&Env::from_pairs([("KEEPALIVE_ENABLED", "false")]))
                .unwrap()
                .enabled
        );
        assert!(Keepalive::from_env(&Env::from_pairs([("KEEPALIVE_TIME", "100ms")])).is_err());
        assert!(Keepalive::from_env(&Env::from_pairs([("KEEPALIVE_ENABLED", "yes")])).is_err());
    }
}
