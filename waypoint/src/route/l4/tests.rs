//! L4 route selection as Istio's waypoint builds it: TLS before TCP, `sniHosts` only as
//! the service's own hostname, `port`, matches Istio's waypoint never matches, and
//! TLSRoute hostnames narrowed per parent Service.

use super::*;
use crate::object::{ObjectName, ServiceKind};
use crate::route::{HttpRoute, TlsRoute, VirtualService};

const WEB: &str = "web.default.svc.cluster.local";

fn vs(yaml: &str) -> L4Route {
    let v: VirtualService = serde_yaml::from_str(yaml).expect("parses");
    v.routes().expect("converts").l4.expect("has L4 rules")
}

fn tls_route(yaml: &str) -> L4Route {
    let r: TlsRoute = serde_yaml::from_str(yaml).expect("parses");
    r.to_l4().expect("converts")
}

/// The backend (name, port) the selected rule's first destination names.
fn pick(routes: &[L4Route], tcp: &[HttpRoute], service: &str, port: u16) -> Option<String> {
    let gateway = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let svc = ObjectName {
        namespace: "default".into(),
        name: service.into(),
    };
    let target = Target {
        gateway: &gateway,
        root_namespace: "istio-system",
        service: Some(&svc),
        service_kind: ServiceKind::Kubernetes,
        port,
    };
    let hostname = format!("{service}.default.svc.cluster.local");
    select_l4(routes, tcp, &target, Some(&hostname)).map(|s| {
        let b = &s.rule.backend_refs[0].backend;
        format!(
            "{} {}[{}] {}:{}",
            s.route.name,
            if s.tls { "tls" } else { "tcp" },
            s.index,
            b.name,
            b.port.unwrap_or(0)
        )
    })
}

#[test]
fn tls_rules_come_before_tcp_rules_and_sni_hosts_count_only_as_the_service() {
    let routes = [
        vs("{name: a, namespace: default, hosts: [web],
  tcp: [{route: [{destination: {host: tcp-all, port: {number: 1}}}]}]}"),
        vs(&format!(
            "{{name: b, namespace: default, hosts: [web, other.other.svc.cluster.local, {WEB}],
  tls: [
   {{match: [{{sniHosts: [other.other.svc.cluster.local]}}], route: [{{destination: {{host: other.other.svc.cluster.local}}}}]}},
   {{match: [{{sniHosts: [{WEB}, other.other.svc.cluster.local]}}], route: [{{destination: {{host: two-hosts}}}}]}},
   {{match: [{{sniHosts: [web]}}], route: [{{destination: {{host: short-name}}}}]}},
   {{match: [{{sniHosts: [{WEB}], port: 8443}}], route: [{{destination: {{host: other-port}}}}]}},
   {{match: [{{sniHosts: [{WEB}], sourceLabels: {{app: x}}}}, {{sniHosts: [{WEB}], sourceNamespace: default}}], route: [{{destination: {{host: never}}}}]}},
   {{match: [{{sniHosts: [{WEB}], destinationSubnets: [10.0.0.0/8], gateways: [mesh]}}], route: [{{destination: {{host: own, port: {{number: 443}}}}}}]}}]}}"
        )),
    ];
    // The first VirtualService's catch-all tcp rule loses to the second's tls rule:
    // only the last tls match counts (subnets are not looked at), on any port but 8443.
    assert_eq!(
        pick(&routes, &[], "web", 443).as_deref(),
        Some("b tls[5] own:443")
    );
    assert_eq!(
        pick(&routes, &[], "web", 8443).as_deref(),
        Some("b tls[3] other-port:0")
    );
    // Another service: neither VirtualService names it.
    assert_eq!(pick(&routes, &[], "shop", 443), None);
    // Without the tls rules, the tcp rule.
    assert_eq!(
        pick(&routes[..1], &[], "web", 443).as_deref(),
        Some("a tcp[0] tcp-all:1")
    );
}

#[test]
fn a_tls_rule_naming_only_other_hosts_leaves_the_connection_to_the_service() {
    let routes = [vs(
        "{name: a, namespace: default, hosts: [web.default.svc.cluster.local, other.other.svc.cluster.local],
  tls: [{match: [{sniHosts: [other.other.svc.cluster.local]}], route: [{destination: {host: other.other.svc.cluster.local}}]}]}",
    )];
    assert_eq!(pick(&routes, &[], "web", 443), None);
}

#[test]
fn tcp_matches_take_the_port_and_routes_follow_tcp_routes() {
    let routes = [vs(
        "{name: a, namespace: default, hosts: [web],
  tcp: [{match: [{port: 9000}], route: [{destination: {host: web, subset: v2}}]},
        {match: [{port: 9001, sourceLabels: {app: x}}], route: [{destination: {host: never}}]}]}",
    )];
    let tcp: Vec<HttpRoute> = serde_yaml::from_str::<Vec<crate::route::TcpRoute>>(
        "- {name: t, namespace: default, parentRefs: [{group: '', kind: Service, name: web}], rules: [{backendRefs: [{name: echo, port: 7}]}]}",
    )
    .unwrap()
    .iter()
    .map(|t| t.to_http().unwrap())
    .collect();
    assert_eq!(
        pick(&routes, &tcp, "web", 9000).as_deref(),
        Some("a tcp[0] web:0")
    );
    assert_eq!(
        pick(&routes, &tcp, "web", 9001).as_deref(),
        Some("t tcp[0] echo:7")
    );
}

/// istiod's conversion for a Service parent: no hostnames means the Service's own; one
/// hostname must be it; of several, those matching it are kept and must come down to it.
#[test]
fn tls_route_hostnames_are_narrowed_to_the_parent_service() {
    let route = |hostnames: &str| {
        tls_route(&format!(
            "{{name: r, namespace: default, parentRefs: [{{group: '', kind: Service, name: web, port: 443}}], {hostnames}
  rules: [{{backendRefs: [{{name: web-v2, port: 443}}]}}]}}"
        ))
    };
    let to_v2 = Some("r tls[0] web-v2:443".to_string());
    assert_eq!(pick(&[route("")], &[], "web", 443), to_v2);
    assert_eq!(
        pick(&[route("")], &[], "web", 80),
        None,
        "the parentRef's port"
    );
    assert_eq!(
        pick(&[route(&format!("hostnames: [{WEB}],"))], &[], "web", 443),
        to_v2
    );
    assert_eq!(
        pick(
            &[route(&format!("hostnames: [api.example.com, {WEB}],"))],
            &[],
            "web",
            443
        ),
        to_v2
    );
    for other in [
        "[api.example.com]",
        "['*.default.svc.cluster.local']",
        &format!("['*.default.svc.cluster.local', {WEB}]"),
    ] {
        assert_eq!(
            pick(&[route(&format!("hostnames: {other},"))], &[], "web", 443),
            None,
            "{other}"
        );
    }
}

#[test]
fn invalid_l4_rules_refuse_the_object_with_the_field_named() {
    let err = |yaml: &str| {
        serde_yaml::from_str::<VirtualService>(yaml)
            .map_err(|e| e.to_string())
            .and_then(|v| v.routes().map(|_| ()))
            .unwrap_err()
    };
    let e = err(
        "{name: a, namespace: default, hosts: [web], tls: [{route: [{destination: {host: web}}]}]}",
    );
    assert!(
        e.starts_with("tls[0].match: a TLS route must have at least one match"),
        "{e}"
    );
    let e = err("{name: a, namespace: default, hosts: [web], tls: [{match: [{port: 1}], route: [{destination: {host: web}}]}]}");
    assert!(
        e.contains("tls[0].match[0].sniHosts: a TLS match must have at least one SNI host"),
        "{e}"
    );
    let e = err("{name: a, namespace: default, hosts: [web], tls: [{match: [{sniHosts: [api.example.com]}], route: [{destination: {host: web}}]}]}");
    assert!(
        e.contains("not a compatible subset of any of the virtual service hosts"),
        "{e}"
    );
    let e = err("{name: a, namespace: default, hosts: [web], tcp: [{match: [{port: 70000}], route: [{destination: {host: web}}]}]}");
    assert!(
        e.contains("tcp[0].match[0].port: 70000 is not a port"),
        "{e}"
    );
    let e = err("{name: a, namespace: default, hosts: [web], tcp: [{match: [{destinationSubnets: [10.0.0.0/33]}], route: [{destination: {host: web}}]}]}");
    assert!(e.contains("is not an IP address or CIDR"), "{e}");
    let e = err("{name: a, namespace: default, hosts: [web], tcp: [{}]}");
    assert!(e.contains("tcp[0].route: required"), "{e}");
    let e = err("{name: a, namespace: default, hosts: [web], tcp: [{route: [{destination: {host: a}, weight: 0}, {destination: {host: b}, weight: 0}]}]}");
    assert!(e.contains("total destination weight = 0"), "{e}");
    let e = err("{name: a, namespace: default, hosts: [web]}");
    assert!(e.contains("http, tcp or tls must be provided"), "{e}");
    // A VirtualService with only L4 rules has no HTTP route (HTTP to it goes on as before).
    let v: VirtualService = serde_yaml::from_str(
        "{name: a, namespace: default, hosts: [web], tcp: [{route: [{destination: {host: web}}]}]}",
    )
    .unwrap();
    let r = v.routes().unwrap();
    assert!(r.http.is_none() && r.l4.is_some());
    // TLSRoute: backends need their port, hostnames must be DNS names.
    let e = serde_yaml::from_str::<TlsRoute>(
        "{name: r, namespace: default, parentRefs: [{group: '', kind: Service, name: web}], rules: [{backendRefs: [{name: b}]}]}",
    )
    .unwrap()
    .to_l4()
    .unwrap_err();
    assert!(e.contains("port: required"), "{e}");
    let e = serde_yaml::from_str::<TlsRoute>(
        "{name: r, namespace: default, hostnames: ['10.0.0.1:443'], parentRefs: [{group: '', kind: Service, name: web}], rules: [{backendRefs: [{name: b, port: 1}]}]}",
    )
    .unwrap()
    .to_l4()
    .unwrap_err();
    assert!(e.starts_with("hostnames[0]"), "{e}");
}
