use super::*;

fn state(yaml: &str) -> Arc<MeshState> {
    crate::config::Config::parse(std::path::Path::new("t.yaml"), yaml)
        .expect("test config")
        .state
}

const MESH: &str = "workloads:\n\
    - {uid: api, name: api, namespace: egress, hostname: api.external.test, protocol: TCP, services: {egress/api.external.test: {80: 443}}}\n\
    services:\n\
    - {name: wild, namespace: egress, hostname: \"*.wild.test\", vips: [\"/240.240.0.1\"], ports: {80: 80}}\n\
    - {name: api, namespace: egress, hostname: api.external.test, vips: [\"/240.240.0.2\"], ports: {80: 443}}\n\
    - {name: none, namespace: egress, hostname: \"*.none.test\", vips: [\"/240.240.0.3\"], ports: {80: 80}, loadBalancer: {mode: Passthrough}}\n\
    - {name: api, namespace: tenant, hostname: api.external.test, vips: [\"/240.240.0.4\"], ports: {80: 80}}\n\
    - {name: other, namespace: tenant, hostname: other.external.test, vips: [\"/240.240.0.5\"], ports: {80: 80}}\n\
    - {name: other, namespace: evil, hostname: other.external.test, vips: [\"/240.240.0.6\"], ports: {80: 80}}\n\
    - {name: only, namespace: evil, hostname: only.external.test, vips: [\"/240.240.0.7\"], ports: {80: 80}}\n";

fn hostname_ref(host: &str) -> ObjectRef {
    ObjectRef {
        group: Some(NETWORKING_GROUP.into()),
        kind: Some("Hostname".into()),
        name: host.into(),
        port: Some(80),
        ..ObjectRef::default()
    }
}

/// A wildcard entry with a VIP, no endpoint and not PASSTHROUGH is DYNAMIC_DNS; one
/// with endpoints, a PASSTHROUGH (resolution NONE) one or a plain host is not.
#[test]
fn which_entries_are_dynamic_dns() {
    let st = state(MESH);
    let svc = |ns: &str, name: &str| st.service_by_name(ns, name).expect("service").clone();
    assert!(is_dynamic_dns(&st, &svc("egress", "wild")));
    assert!(!is_dynamic_dns(&st, &svc("egress", "none")), "PASSTHROUGH");
    assert!(
        !is_dynamic_dns(&st, &svc("egress", "api")),
        "not a wildcard"
    );
    let with_endpoint = MESH.replace(
        "services: {egress/api.external.test: {80: 443}}}",
        "services: {egress/api.external.test: {80: 443}, \"egress/*.wild.test\": {80: 80}}}",
    );
    let st = state(&with_endpoint);
    let wild = st.service_by_name("egress", "wild").expect("wild").clone();
    assert!(
        !is_dynamic_dns(&st, &wild),
        "a STATIC wildcard with endpoints"
    );
}

/// A `Hostname` backend is the route's namespace's declaration of the host, else the
/// only one; never one of several other tenants' (a squatter's).
#[test]
fn hostname_backends_prefer_the_routes_namespace_and_refuse_ambiguity() {
    let st = state(MESH);
    let ns_of = |route_ns: &str, host: &str| {
        backend_service(&st, route_ns, &hostname_ref(host)).map(|s| s.namespace.clone())
    };
    assert_eq!(ns_of("egress", "api.external.test"), Ok("egress".into()));
    assert_eq!(ns_of("tenant", "api.external.test"), Ok("tenant".into()));
    assert_eq!(ns_of("egress", "API.External.Test"), Ok("egress".into()));
    assert_eq!(
        ns_of("default", "other.external.test"),
        Err(EgressError::Ambiguous {
            host: "other.external.test".into(),
            namespaces: vec!["evil".into(), "tenant".into()]
        })
    );
    assert_eq!(ns_of("default", "only.external.test"), Ok("evil".into()));
    assert_eq!(
        ns_of("default", "gone.external.test"),
        Err(EgressError::NotFound("gone.external.test".into()))
    );
    // A Service ref is by name, in the ref's namespace or the route's.
    let svc_ref = ObjectRef {
        name: "api".into(),
        ..ObjectRef::default()
    };
    assert_eq!(
        backend_service(&st, "tenant", &svc_ref).map(|s| s.hostname.clone()),
        Ok("api.external.test".into())
    );
    // The ServiceEntry kind is no backend kind: not looked up by hostname.
    let se_ref = ObjectRef {
        kind: Some("ServiceEntry".into()),
        group: Some(NETWORKING_GROUP.into()),
        ..hostname_ref("api.external.test")
    };
    assert!(!is_hostname_ref(&se_ref));
}

/// Only a Host the wildcard covers, as Envoy's virtual host domain matches it, is an
/// upstream: hostile and odd forms are refused before any lookup.
#[test]
fn dynamic_hosts_are_the_wildcards_own() {
    let host = |h: &str| {
        let a = Authority::parse(h).expect("authority");
        dynamic_host("*.wild.test", &a)
    };
    assert_eq!(host("a.wild.test"), Ok("a.wild.test".into()));
    assert_eq!(host("A.Wild.TEST"), Ok("a.wild.test".into()), "case");
    assert_eq!(
        host("x.y.wild.test"),
        Ok("x.y.wild.test".into()),
        "several labels"
    );
    for (bad, why) in [
        ("evil.other.test", "another domain"),
        ("wild.test", "another domain"),
        ("evilwild.test", "another domain"),
        ("a.wild.test.evil", "another domain"),
        ("a.wild.test.", "another domain"),
        ("a.wild.test:80", "it has a port"),
        ("a.wild.test:8443", "it has a port"),
        ("10.0.0.1", "it is an IP address"),
        ("[::1]", "it is an IP address"),
        (".wild.test", "no DNS name"),
        ("a..wild.test", "no DNS name"),
    ] {
        let Ok(a) = Authority::parse(bad) else {
            continue;
        };
        match dynamic_host("*.wild.test", &a) {
            Err(EgressError::NotCovered { why: w, .. }) => assert_eq!(w, why, "{bad}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    let long = format!("{}.wild.test", ["a"; 130].join("."));
    assert!(host(&long).is_err(), "longer than a DNS name");
    // A plain host is no pattern to forward by.
    let a = Authority::parse("a.wild.test").expect("authority");
    assert!(dynamic_host("api.external.test", &a).is_err());
}

/// The upstream port is Envoy's dynamic forward proxy default: 443 with TLS origination.
#[test]
fn dynamic_endpoints_are_outside_the_mesh_on_80_or_443() {
    let st = state(MESH);
    let wild = st.service_by_name("egress", "wild").expect("wild").clone();
    let (wl, port) = dynamic_endpoint(&wild, "a.wild.test", false);
    assert_eq!(
        (wl.hostname.as_str(), wl.protocol, port),
        ("a.wild.test", MeshProtocol::TCP, 80)
    );
    assert!(wl.workload_ips.is_empty());
    assert_eq!(dynamic_endpoint(&wild, "a.wild.test", true).1, 443);
}

/// ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS: TLS to a DYNAMIC_DNS entry goes to the
/// SNI's host at the service port; an SNI the wildcard does not cover, or none, is
/// refused (Istio's flag forwards any SNI); another backend is left alone.
#[test]
fn tls_goes_to_the_sni_the_wildcard_covers() {
    let st = state(MESH);
    let svc = |name: &str| st.service_by_name("egress", name).expect("service").clone();
    let backend = |s: &Arc<Service>| Backend {
        service: Some(s.clone()),
        endpoints: Vec::new(),
        unresolved: Vec::new(),
        http2: None,
        policy: None,
        dynamic_dns: false,
    };
    let wild = svc("wild");
    let mut b = backend(&wild);
    send_to_sni(&st, &mut b, Some("a.wild.test"), 443).expect("covered");
    assert_eq!(b.unresolved.len(), 1);
    assert_eq!(
        (b.unresolved[0].0.hostname.as_str(), b.unresolved[0].1),
        ("a.wild.test", 443)
    );
    for sni in [
        Some("evil.other.test"),
        Some("wild.test"),
        Some("10.0.0.2"),
        None,
    ] {
        let mut b = backend(&wild);
        let e = send_to_sni(&st, &mut b, sni, 443).expect_err("refused");
        assert!(b.unresolved.is_empty(), "{sni:?}: {e}");
    }
    let api = svc("api");
    let mut b = backend(&api);
    send_to_sni(&st, &mut b, Some("evil.other.test"), 80).expect("not a DYNAMIC_DNS entry");
    assert!(b.unresolved.is_empty());
}
