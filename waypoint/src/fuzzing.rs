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
    let Ok(text) = std::str::from_utf8(&data[..data.len().min(MAX_INPUT)]) else { return };
    let Ok(cfg) = Config::parse(Path::new("fuzz.yaml"), text) else { return };
    let refs = cfg.routes.iter().flat_map(|r| r.parent_refs.iter().map(|p| p.object_name(&r.namespace)));
    let names: Vec<ObjectName> = refs.chain(cfg.policies.iter().flat_map(|p| p.target_refs.iter().map(|t| t.object_name(&p.namespace)))).collect();
    let routes: Vec<&route::HttpRoute> = cfg.routes.iter().collect();
    let headers = HeaderMap::new();
    let id = ztunnel::identity::Identity::new("cluster.local", "default", "client");
    for name in &names {
        for (service, path) in [(Some(name), "/"), (None, "/api/v1"), (Some(name), "/admin/x")] {
            let target = Target { gateway: name, service, service_kind: Default::default(), root_namespace: crate::object::DEFAULT_ROOT_NAMESPACE, port: 80 };
            let req = RouteRequest { method: &http::Method::GET, path, query: Some("a=b"), headers: &headers, host: "echo.default.svc.cluster.local" };
            if let route::Selection::Matched(s) = route::select(&routes, &target, &req) {
                let _ = (s.rule.pick_backend(7), s.rule.request_timeout(), s.rule.backend_timeout());
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
            let tcp: Vec<authz::AuthorizationPolicy> = policies.map(authz::AuthorizationPolicy::for_tcp).collect();
            let _ = authz::evaluate(&tcp, &areq);
        }
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
        assert!(replayed > 0, "no committed config_yaml inputs under {}", fuzz.display());
    }
}
