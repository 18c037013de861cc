//! Routes and policies of another namespace on its ServiceEntries (egress).

use super::*;

/// A route of another namespace attached to a ServiceEntry there is taken when the
/// entry uses the waypoint (istiod routes its hosts through it), as a route on such a
/// Service is; one on an entry that does not use it is not even converted.
#[test]
fn routes_on_another_namespaces_service_entries() {
    let route = |name: &str, parent: &str| {
        object_in(
            "egress",
            "HTTPRoute",
            name,
            json!({"parentRefs": [{"group": "networking.istio.io", "kind": "ServiceEntry", "name": parent}],
                   "rules": [{"backendRefs": [{"group": "networking.istio.io", "kind": "Hostname", "name": "api.external.test", "port": 80}]}]}),
        )
    };
    let mut s = store(vec![
        (Kind::HttpRoute, route("to-ext", "ext")),
        (Kind::HttpRoute, route("to-unused", "unused")),
    ]);
    s.from_istiod.insert(ObjectName {
        namespace: "egress".into(),
        name: "ext".into(),
    });
    let cfg = s.publish(&settings()).unwrap();
    let names: Vec<&str> = cfg.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["to-ext"], "{}", cfg.dump);
}
