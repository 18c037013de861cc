//! A DestinationRule's `connectionPool` settings for how the waypoint's upstream
//! connections to a Service are made and kept, as Istio's `applyConnectionPool` /
//! `applyH2Upgrade` give them to Envoy's cluster:
//! - `tcp.connectTimeout`: a dial (TCP or HBONE, and the TLS the rule originates) that
//!   takes longer fails (`UF`); default the waypoint's connect timeout;
//! - `tcp.tcpKeepalive`: TCP keep-alive probes on a connection straight to an endpoint
//!   outside the mesh (an HBONE endpoint's connection is the node's shared tunnel, as in
//!   Istio's waypoint, where the cluster's sockets are internal ones);
//! - `tcp.maxConnectionDuration`: an HTTP connection older than that takes no new request
//!   and closes once its requests are done;
//! - `http.idleTimeout`, else `tcp.idleTimeout` (Istio falls back to it): a kept HTTP
//!   connection idle that long is closed; `http.maxRequestsPerConnection`;
//! - `http.http2KeepAlive`: HTTP/2 PINGs on the Service's HTTP/2 connections;
//! - `http.h2UpgradePolicy` / `useClientProtocol`: which HTTP version goes upstream.

use std::time::Duration;

use super::spec::{ConnectionPool, Http2KeepAlive, TcpKeepalive};
use crate::extauthz::provider::parse_duration;

/// How the Service's upstream connections are made and reused. Connections are shared
/// only between requests whose rules ask for the same (it is part of their pool key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Reuse {
    /// `http.maxRequestsPerConnection`: a connection takes no request past that many.
    pub max_requests: Option<u32>,
    /// `http.idleTimeout` (or `tcp.idleTimeout`): a connection without a request in
    /// flight that long is closed; default: the waypoint's own limits.
    pub idle: Option<Duration>,
    /// `tcp.maxConnectionDuration`: an HTTP connection that old takes no new request; an
    /// opaque TCP connection through the waypoint that old is closed (Envoy's tcp_proxy
    /// `max_downstream_connection_duration`, as Istio's waypoint sets it).
    pub max_age: Option<Duration>,
    /// `tcp.idleTimeout` for opaque TCP through the waypoint (Istio's tcp_proxy idle
    /// timeout): `Some(ZERO)` turns it off; None: the waypoint's own.
    pub tcp_idle: Option<Duration>,
    /// `tcp.connectTimeout`, in place of the waypoint's connect timeout.
    pub connect_timeout: Option<Duration>,
    /// `tcp.tcpKeepalive` on a TCP connection straight to the endpoint.
    pub keepalive: Option<Keepalive>,
    /// `http.http2KeepAlive`: (PING interval, how long to wait for its answer).
    pub h2_ping: Option<(Duration, Duration)>,
}

/// TCP keep-alive as Envoy sets it: SO_KEEPALIVE, with the kernel's values for what is
/// left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Keepalive {
    pub probes: Option<u32>,
    pub time: Option<Duration>,
    pub interval: Option<Duration>,
}

/// Which HTTP version the waypoint speaks to the Service, when the rule says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamProtocol {
    /// `h2UpgradePolicy: UPGRADE`: HTTP/2, whatever the port's protocol.
    Upgrade,
    /// `h2UpgradePolicy: DO_NOT_UPGRADE`: the port's, and never the mesh's upgrade.
    DoNotUpgrade,
    /// `useClientProtocol`: the client's (over `h2UpgradePolicy`, as in Istio).
    Client,
}

/// Envoy's HTTP/2 PING timeout when `http2KeepAlive` leaves it out.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// A duration where `0s` (any zero) means "none", as Istio's `idleTimeout` and
/// `maxConnectionDuration`.
fn optional_duration(field: &str, v: &Option<String>) -> Result<Option<Duration>, String> {
    match v {
        None => Ok(None),
        Some(t) if is_zero(t) => Ok(None),
        Some(t) => parse_duration(t)
            .map(Some)
            .map_err(|e| format!("{field}: {e}")),
    }
}

impl Reuse {
    /// The idle timeout of opaque TCP relayed to the Service: the rule's, else `default`.
    pub fn opaque_idle(&self, default: Option<Duration>) -> Option<Duration> {
        match self.tcp_idle {
            Some(d) if d.is_zero() => None,
            Some(d) => Some(d),
            None => default,
        }
    }
}

/// `0s`, `0ms`, `0.0s`...
fn is_zero(t: &str) -> bool {
    let n = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    !n.is_empty() && n.len() < t.len() && n.chars().all(|c| c == '0' || c == '.')
}

/// The connection settings of one `connectionPool`, and the upstream protocol it asks for.
pub fn settings(cp: &ConnectionPool) -> Result<(Reuse, Option<UpstreamProtocol>), String> {
    let mut r = Reuse::default();
    let mut tcp_idle = None;
    if let Some(tcp) = &cp.tcp {
        if let Some(t) = &tcp.connect_timeout {
            if is_zero(t) {
                return Err("tcp.connectTimeout: must be at least 1ms".into());
            }
            let d = parse_duration(t).map_err(|e| format!("tcp.connectTimeout: {e}"))?;
            r.connect_timeout = Some(d);
        }
        r.max_age = optional_duration("tcp.maxConnectionDuration", &tcp.max_connection_duration)?;
        tcp_idle = optional_duration("tcp.idleTimeout", &tcp.idle_timeout)?;
        if tcp.idle_timeout.is_some() {
            r.tcp_idle = Some(tcp_idle.unwrap_or(Duration::ZERO));
        }
        if let Some(k) = &tcp.tcp_keepalive {
            r.keepalive = Some(keepalive(k).map_err(|e| format!("tcp.tcpKeepalive.{e}"))?);
        }
    }
    let mut protocol = None;
    match &cp.http {
        Some(http) => {
            // Istio: 0 (or unset) is no limit.
            r.max_requests = http.max_requests_per_connection.filter(|n| *n > 0);
            r.idle = match &http.idle_timeout {
                Some(_) => optional_duration("http.idleTimeout", &http.idle_timeout)?,
                None => tcp_idle,
            };
            if let Some(k) = &http.http2_keep_alive {
                r.h2_ping = Some(h2_ping(k).map_err(|e| format!("http.http2KeepAlive.{e}"))?);
            }
            protocol = match (http.use_client_protocol, http.h2_upgrade_policy.as_deref()) {
                (Some(true), _) => Some(UpstreamProtocol::Client),
                (_, None | Some("DEFAULT")) => None,
                (_, Some("UPGRADE")) => Some(UpstreamProtocol::Upgrade),
                (_, Some("DO_NOT_UPGRADE")) => Some(UpstreamProtocol::DoNotUpgrade),
                (_, Some(other)) => {
                    return Err(format!(
                        "http.h2UpgradePolicy: {other:?} is not one of DEFAULT, DO_NOT_UPGRADE, UPGRADE"
                    ))
                }
            };
            if http.max_concurrent_streams.is_some_and(|n| n > 0) {
                return Err("http.maxConcurrentStreams: the waypoint keeps one HTTP/2 connection per endpoint and \
                            does not open more past a stream limit (Envoy does); remove it to apply the rule"
                    .into());
            }
        }
        None => r.idle = tcp_idle,
    }
    Ok((r, protocol))
}

fn keepalive(k: &TcpKeepalive) -> Result<Keepalive, String> {
    let secs = |field: &str, v: &Option<String>| -> Result<Option<Duration>, String> {
        v.as_deref()
            .map(|t| parse_duration(t).map_err(|e| format!("{field}: {e}")))
            .transpose()
            // Envoy takes whole seconds (Istio passes `.Seconds`).
            .map(|d| d.map(|d| Duration::from_secs(d.as_secs().max(1))))
    };
    Ok(Keepalive {
        probes: k.probes.filter(|p| *p > 0),
        time: secs("time", &k.time)?,
        interval: secs("interval", &k.interval)?,
    })
}

fn h2_ping(k: &Http2KeepAlive) -> Result<(Duration, Duration), String> {
    let interval = match &k.interval {
        Some(t) if is_zero(t) => return Err("interval: must be more than 0s".into()),
        Some(t) => parse_duration(t).map_err(|e| format!("interval: {e}"))?,
        None => return Err("interval: required (how often to send a PING)".into()),
    };
    let timeout = match &k.timeout {
        Some(t) => parse_duration(t).map_err(|e| format!("timeout: {e}"))?,
        None => H2_PING_TIMEOUT,
    };
    Ok((interval, timeout))
}

/// meshConfig `h2UpgradePolicy: UPGRADE` (Istio's default DO_NOT_UPGRADE).
pub fn mesh_h2_upgrade(mesh: Option<&serde_json::Value>) -> bool {
    mesh.and_then(|m| m.get("h2UpgradePolicy"))
        .and_then(serde_json::Value::as_str)
        == Some("UPGRADE")
}

/// The upstream's HTTP version (true: HTTP/2), as Istio's `shouldH2Upgrade` and
/// `useClientProtocol` decide it: `port` is what the Service port's protocol says (None:
/// not an HTTP port, the client's version goes up), `client` the client's version.
pub fn upstream_http2(
    rule: Option<UpstreamProtocol>,
    mesh_upgrade: bool,
    port: Option<bool>,
    client: bool,
) -> bool {
    match rule {
        Some(UpstreamProtocol::Client) => client,
        Some(UpstreamProtocol::Upgrade) => true,
        Some(UpstreamProtocol::DoNotUpgrade) => port.unwrap_or(client),
        // The mesh's upgrade only for ports named HTTP (not sniffed ones).
        None => port.map_or(client, |h2| h2 || mesh_upgrade),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<(Reuse, Option<UpstreamProtocol>), String> {
        settings(&serde_yaml::from_str(yaml).expect("yaml"))
    }

    #[test]
    fn tcp_settings_parse() {
        let (r, p) = parse(
            "tcp: {connectTimeout: 250ms, maxConnectionDuration: 30s, idleTimeout: 7s, \
             tcpKeepalive: {probes: 3, time: 10s, interval: 1500ms}}",
        )
        .unwrap();
        assert_eq!(r.connect_timeout, Some(Duration::from_millis(250)));
        assert_eq!(r.max_age, Some(Duration::from_secs(30)));
        // tcp.idleTimeout stands in for http.idleTimeout (Istio's applyConnectionPool).
        assert_eq!(r.idle, Some(Duration::from_secs(7)));
        assert_eq!(
            r.keepalive,
            Some(Keepalive {
                probes: Some(3),
                time: Some(Duration::from_secs(10)),
                interval: Some(Duration::from_secs(1)),
            })
        );
        assert_eq!(p, None);
        let (r, _) = parse("tcp: {idleTimeout: 7s}\nhttp: {idleTimeout: 2s}").unwrap();
        assert_eq!(r.idle, Some(Duration::from_secs(2)));
        let (r, _) = parse("tcp: {maxConnectionDuration: 0s}").unwrap();
        assert_eq!(r.max_age, None);
    }

    #[test]
    fn upstream_protocol_follows_istio() {
        let proto = |http: &str| parse(&format!("http: {http}")).unwrap().1;
        assert_eq!(
            proto("{h2UpgradePolicy: UPGRADE}"),
            Some(UpstreamProtocol::Upgrade)
        );
        assert_eq!(
            proto("{h2UpgradePolicy: DO_NOT_UPGRADE}"),
            Some(UpstreamProtocol::DoNotUpgrade)
        );
        assert_eq!(proto("{h2UpgradePolicy: DEFAULT}"), None);
        // useClientProtocol wins over an upgrade (Istio's shouldH2Upgrade).
        assert_eq!(
            proto("{h2UpgradePolicy: UPGRADE, useClientProtocol: true}"),
            Some(UpstreamProtocol::Client)
        );
        let (r, _) = parse("http: {http2KeepAlive: {interval: 5s}}").unwrap();
        assert_eq!(r.h2_ping, Some((Duration::from_secs(5), H2_PING_TIMEOUT)));
    }

    /// Istio's `shouldH2Upgrade`: the rule's UPGRADE for any port, the mesh's for HTTP
    /// ports only, DO_NOT_UPGRADE and useClientProtocol over the mesh's.
    #[test]
    fn the_upstream_version_is_istios() {
        use UpstreamProtocol::*;
        let http1_port = Some(false);
        let h2_port = Some(true);
        let unknown_port = None;
        for (rule, mesh, port, client, want) in [
            (None, false, http1_port, true, false),
            (None, true, http1_port, false, true),
            (None, true, unknown_port, false, false),
            (None, false, unknown_port, true, true),
            (Some(Upgrade), false, http1_port, false, true),
            (Some(Upgrade), false, unknown_port, false, true),
            (Some(DoNotUpgrade), true, http1_port, false, false),
            (Some(DoNotUpgrade), false, h2_port, false, true),
            (Some(Client), true, http1_port, false, false),
            (Some(Client), false, h2_port, false, false),
            (Some(Client), false, http1_port, true, true),
        ] {
            assert_eq!(
                upstream_http2(rule, mesh, port, client),
                want,
                "{rule:?} mesh {mesh} port {port:?} client {client}"
            );
        }
    }

    #[test]
    fn what_cannot_be_applied_names_the_field() {
        for (yaml, want) in [
            (
                "tcp: {connectTimeout: 0s}",
                "tcp.connectTimeout: must be at least 1ms",
            ),
            ("tcp: {connectTimeout: soon}", "tcp.connectTimeout"),
            ("tcp: {tcpKeepalive: {time: x}}", "tcp.tcpKeepalive.time"),
            (
                "http: {h2UpgradePolicy: SOMETIMES}",
                "http.h2UpgradePolicy: \"SOMETIMES\"",
            ),
            (
                "http: {maxConcurrentStreams: 10}",
                "http.maxConcurrentStreams",
            ),
            (
                "http: {http2KeepAlive: {timeout: 1s}}",
                "http.http2KeepAlive.interval: required",
            ),
        ] {
            let e = parse(yaml).expect_err(yaml);
            assert!(e.contains(want), "{yaml}: {e}");
        }
        // 0 streams is Istio's "no limit".
        assert!(parse("http: {maxConcurrentStreams: 0}").is_ok());
    }
}
