//! Entry points for the cargo-fuzz targets in `fuzz/` (not an API: they may change with
//! the targets), as `ztunnel::fuzzing` for the node proxy. A panic here is a bug in the
//! waypoint.

use std::path::Path;

use http::HeaderMap;

use crate::authz;
use crate::config::Config;
use crate::object::{ObjectName, Target};
use crate::route::{self, RouteRequest};

/// Input larger than this is cut, as in `ztunnel::fuzzing`.
const MAX_INPUT: usize = 64 * 1024;

/// The local config file as the waypoint loads it (its L7 lists), then routing and
/// authorization of a few requests to every Service and Gateway the config names.
pub fn config_yaml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(&data[..data.len().min(MAX_INPUT)]) else {
        return;
    };
    let Ok(cfg) = Config::parse(Path::new("fuzz.yaml"), text) else {
        return;
    };
    let refs = cfg
        .routes
        .iter()
        .flat_map(|r| r.parent_refs.iter().map(|p| p.object_name(&r.namespace)));
    let names: Vec<ObjectName> = refs
        .chain(
            cfg.policies
                .iter()
                .flat_map(|p| p.target_refs.iter().map(|t| t.object_name(&p.namespace))),
        )
        .collect();
    let routes: Vec<&route::HttpRoute> = cfg.routes.iter().collect();
    let headers = HeaderMap::new();
    let id = ztunnel::identity::Identity::new("cluster.local", "default", "client");
    for name in &names {
        for (service, path) in [
            (Some(name), "/"),
            (None, "/api/v1"),
            (Some(name), "/admin/x"),
        ] {
            let target = Target {
                gateway: name,
                service,
                service_kind: Default::default(),
                root_namespace: crate::object::DEFAULT_ROOT_NAMESPACE,
                port: 80,
            };
            let req = RouteRequest {
                method: &http::Method::GET,
                path,
                query: Some("a=b"),
                headers: &headers,
                host: "echo.default.svc.cluster.local",
                authority: "echo.default.svc.cluster.local",
            };
            if let route::Selection::Matched(s) = route::select(&routes, &target, &req) {
                let _ = (
                    s.rule.pick_backend(7),
                    s.rule.request_timeout(),
                    s.rule.backend_timeout(),
                );
            }
            let policies = cfg.policies.iter().filter(|p| p.applies_to(&target));
            let areq = authz::Request {
                source_principal: Some(&id),
                source_ip: std::net::Ipv4Addr::new(10, 0, 0, 1).into(),
                destination_port: 80,
                host: req.host,
                method: "GET",
                path,
                headers: &headers,
                auth: None,
            };
            let _ = authz::evaluate(policies.clone(), &areq);
            // As the waypoint does for opaque TCP.
            let tcp: Vec<authz::AuthorizationPolicy> =
                policies.map(authz::AuthorizationPolicy::for_tcp).collect();
            let _ = authz::evaluate(&tcp, &areq);
        }
    }
}

/// A request's authority (`Host` bytes, or an HTTP/2 `:authority`): what
/// `http::authority` accepts is exactly `host[:port]`, reads the same to `http` (so to
/// policy and to the backend alike), and makes an upstream URI with that authority and
/// the planned path, never another; what it refuses is refused with a short reason.
pub fn http_authority(data: &[u8]) {
    use crate::http::authority::{Authority, AuthorityError};
    use http::uri::PathAndQuery;
    let data = &data[..data.len().min(MAX_INPUT)];
    let parsed = Authority::from_bytes(data);
    // As the Host header of an origin-form request: the same verdict.
    if let Ok(host) = http::HeaderValue::from_bytes(data) {
        let mut req = http::Request::new(());
        req.headers_mut().insert(http::header::HOST, host);
        assert_eq!(Authority::of_request(&req.into_parts().0), parsed);
    }
    let a = match parsed {
        Ok(a) => a,
        Err(e) => {
            // Never "accepted here, refused by `http`": this grammar is within `http`'s.
            assert_ne!(e, AuthorityError::Unrepresentable, "{data:?}");
            assert!(e.to_string().len() < 200, "a long reason: {e}");
            return;
        }
    };
    let s = a.as_str();
    assert_eq!(s.as_bytes(), data, "kept as received");
    let forbidden = |b: u8| matches!(b, b'/' | b'?' | b'#' | b'@' | b'%') || !b.is_ascii_graphic();
    assert!(!s.bytes().any(forbidden), "{s:?}");
    assert!(!a.host().is_empty() && s.starts_with(a.host()), "{s:?}");
    let port = s[a.host().len()..]
        .strip_prefix(':')
        .map(|p| p.parse::<u16>().ok());
    assert_eq!(port, a.port().map(Some), "{s:?}");
    assert_ne!(a.port(), Some(0));
    // `http` reads the same host and port.
    let theirs = http::uri::Authority::try_from(s);
    let theirs = theirs.unwrap_or_else(|e| panic!("{s:?} accepted here, not by http: {e}"));
    assert_eq!(
        (theirs.host(), theirs.port_u16()),
        (a.host(), a.port()),
        "{s:?}"
    );
    // The upstream URI, as a backend reads it back: this authority, this path.
    let uri = a.uri_with(PathAndQuery::from_static("/public?x=1"));
    let uri = uri.unwrap_or_else(|e| panic!("{s:?} makes no URI: {e}"));
    let back: http::Uri = uri
        .to_string()
        .parse()
        .unwrap_or_else(|e| panic!("{uri}: {e}"));
    let read = (
        back.authority().map(|x| x.as_str()),
        back.path(),
        back.query(),
    );
    assert_eq!(read, (Some(s), "/public", Some("x=1")));
    // As an HTTP/2 request's :authority: the same authority.
    let mut req = http::Request::new(());
    *req.uri_mut() = uri;
    assert_eq!(Authority::of_request(&req.into_parts().0).as_ref(), Ok(&a));
}

/// A connection's first bytes on a TLS port, as the waypoint reads its ClientHello
/// (`tunnel::client_hello`): the verdict does not depend on how the bytes were split
/// (the first byte picks a split), a server name read is printable ASCII, and nothing
/// panics.
pub fn tls_client_hello(data: &[u8]) {
    use crate::tunnel::client_hello::{verdicts, Hello};
    let data = &data[..data.len().min(MAX_INPUT)];
    let split = data.first().map_or(0, |b| usize::from(*b) * 7);
    let (whole, pieces) = verdicts(data, split);
    assert_eq!(whole, pieces, "the verdict depends on the split at {split}");
    if let Some(Hello::Tls { sni: Some(name) }) = &whole {
        assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic()),
            "{name:?}"
        );
    }
}

/// A Telemetry's access-log `filter.expression` and an access-log format, from the same
/// text: what compiles is evaluated and rendered for a request; neither the compiler,
/// the walk, the interpreter nor the formatter panics, and a refusal names a short
/// reason (the panic guard in `Expr::matches` is not relied on: evaluation runs bare).
pub fn telemetry_filter(data: &[u8]) {
    use crate::telemetry::expr::{Attributes, Expr};
    use crate::telemetry::format::{Entry, LogFormat};
    let Ok(text) = std::str::from_utf8(&data[..data.len().min(MAX_INPUT)]) else {
        return;
    };
    let headers = [(http::HeaderName::from_static("x-debug"), "on".to_string())];
    let src: std::net::SocketAddr = ([10, 0, 0, 1], 40000).into();
    let dst: std::net::SocketAddr = ([10, 96, 0, 10], 80).into();
    match Expr::compile(text) {
        Ok(e) => {
            let a = Attributes {
                code: 503,
                grpc_status: Some("14"),
                method: "GET",
                path: "/a",
                query: Some("b=1"),
                host: "echo",
                protocol: "HTTP/2",
                headers: &headers,
                source: src,
                destination: dst,
                upstream: Some(dst),
                peer_san: "spiffe://cluster.local/ns/default/sa/client",
                request_size: 1,
                request_total_size: 100,
                response_size: 7,
                response_flags: "UF,URX",
            };
            let _ = e.eval_bare(&a);
        }
        Err(e) => assert!(e.to_string().len() < 64 * 1024, "a long reason"),
    }
    let entry = Entry {
        start: std::time::SystemTime::UNIX_EPOCH,
        duration: std::time::Duration::from_millis(1),
        method: "GET",
        path: "/a?b=1",
        authority: "echo",
        protocol: "HTTP/1.1",
        code: 200,
        response_flags: "-",
        code_details: None,
        bytes_received: 0,
        bytes_sent: 0,
        request_headers: &headers,
        response_headers: &[],
        upstream: None,
        upstream_cluster: None,
        downstream_local: dst,
        downstream_remote: src,
        peer_uri_san: None,
        route: None,
        hostname: "h",
        trace_id: None,
        grpc_status: None,
        attempts: 0,
    };
    if let Ok(f) = LogFormat::text(text) {
        assert!(f.render(&entry).ends_with('\n'));
    }
    if let Ok(f) = LogFormat::json_text(text) {
        let line = f.render(&entry);
        serde_json::from_str::<serde_json::Value>(&line).expect("a JSON line");
    }
}

#[cfg(test)]
mod tests {
    /// The `config_yaml` target's committed inputs (`fuzz/corpus/config_yaml/`, and
    /// `fuzz/regressions/config_yaml/` when there are any) pass the waypoint's half of it
    /// (ztunnel's unit tests replay them through the mesh half).
    #[test]
    fn committed_config_inputs_pass() {
        let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let replayed = ztunnel::fuzzing::replay_committed(&fuzz, "config_yaml", super::config_yaml);
        assert!(
            replayed > 0,
            "no committed config_yaml inputs under {}",
            fuzz.display()
        );
    }

    /// The `http_authority` target's committed inputs pass its checks.
    #[test]
    fn committed_authority_inputs_pass() {
        let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let target = "http_authority";
        let replayed = ztunnel::fuzzing::replay_committed(&fuzz, target, super::http_authority);
        assert!(
            replayed > 0,
            "no committed {target} inputs under {}",
            fuzz.display()
        );
    }

    /// The `tls_client_hello` target's committed inputs pass its checks.
    #[test]
    fn committed_tls_client_hello_inputs_pass() {
        let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let target = "tls_client_hello";
        let replayed = ztunnel::fuzzing::replay_committed(&fuzz, target, super::tls_client_hello);
        assert!(
            replayed > 0,
            "no committed {target} inputs under {}",
            fuzz.display()
        );
    }

    /// The `telemetry_filter` target's committed inputs pass its checks.
    #[test]
    fn committed_telemetry_filter_inputs_pass() {
        let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let target = "telemetry_filter";
        let replayed = ztunnel::fuzzing::replay_committed(&fuzz, target, super::telemetry_filter);
        assert!(
            replayed > 0,
            "no committed {target} inputs under {}",
            fuzz.display()
        );
    }
}
