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
}
