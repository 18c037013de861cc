use super::*;

use crate::authz;
use crate::object::{ServiceKind, Target};

fn object_in(ns: &str, kind: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "x/v1", "kind": kind,
        "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
        "spec": spec,
    }))
    .unwrap()
}

fn object(kind: &str, name: &str, spec: Value) -> DynamicObject {
    object_in("default", kind, name, spec)
}

/// A Namespace or Service with labels.
fn labelled(ns: Option<&str>, name: &str, labels: &[(&str, &str)]) -> DynamicObject {
    let labels: Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let mut meta = json!({"name": name, "resourceVersion": "1", "labels": labels});
    if let Some(ns) = ns {
        meta["namespace"] = json!(ns);
    }
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "X", "metadata": meta})).unwrap()
}

fn settings() -> Settings {
    Settings {
        gateway: ObjectName {
            namespace: "default".into(),
            name: "waypoint".into(),
        },
        root_namespace: "istio-system".into(),
        identity: Identity::new("cluster.local", "default", "waypoint"),
        mesh_config_map: "istio".into(),
        revision: None,
    }
}

/// A store with every kind listed and `objects` in it.
fn store(objects: Vec<(Kind, DynamicObject)>) -> Store {
    let mut s = Store::default();
    let settings = settings();
    for kind in KINDS {
        s.event(kind, Event::Init, &settings);
        for (_, o) in objects.iter().filter(|(k, _)| *k == kind) {
            s.event(kind, Event::InitApply(o.clone()), &settings);
        }
        s.event(kind, Event::InitDone, &settings);
    }
    s
}

/// Istio's `istio` ConfigMap in the root namespace gives the extensionProviders;
/// without it the config still publishes and CUSTOM has no provider (denies).
#[test]
fn extension_providers_come_from_the_mesh_config_map() {
    let mesh = "defaultConfig: {discoveryAddress: istiod.istio-system.svc:15012}\nextensionProviders:\n\
                - {name: authz, envoyExtAuthzGrpc: {service: authz.default.svc.cluster.local, port: 9000}}\n\
                - {name: broken, envoyExtAuthzHttp: {service: x, port: 0}}\n";
    let cm: DynamicObject = serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio", "namespace": "istio-system", "resourceVersion": "7"}, "data": {"mesh": mesh}})).unwrap();
    let cfg = store(vec![(Kind::MeshConfig, cm)])
        .publish(&settings())
        .unwrap();
    assert!(
        matches!(
            cfg.providers.get("authz"),
            Some(Ok(crate::extauthz::Provider::Grpc(_)))
        ),
        "{:?}",
        cfg.providers
    );
    assert!(cfg.providers["broken"].is_err());
    assert_eq!(
        cfg.dump["extensionProviders"]["providers"]["authz"]["kind"],
        "envoyExtAuthzGrpc"
    );
    assert!(
        cfg.dump["extensionProviders"]["providers"]["broken"]["error"].is_string(),
        "{}",
        cfg.dump
    );
    // The ConfigMap is not waited for.
    let mut s = Store::default();
    for kind in KINDS.into_iter().filter(|k| *k != Kind::MeshConfig) {
        s.event(kind, Event::Init, &settings());
        s.event(kind, Event::InitDone, &settings());
    }
    let cfg = s
        .publish(&settings())
        .expect("published without the mesh config");
    assert!(cfg.providers.is_empty());
    assert!(cfg.dump["extensionProviders"]["error"]
        .as_str()
        .unwrap_or_default()
        .contains("not found"));
}

/// The mesh ConfigMap's defaultHttpRetryPolicy is every route's that sets none; one
/// that does not convert is logged and shown, and Istio's own default applies.
#[test]
fn default_retry_policy_comes_from_the_mesh_config_map() {
    let cm = |mesh: &str| -> DynamicObject {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "istio", "namespace": "istio-system", "resourceVersion": "7"}, "data": {"mesh": mesh}})).unwrap()
    };
    let cfg = store(vec![(
        Kind::MeshConfig,
        cm("defaultHttpRetryPolicy: {attempts: 4, retryOn: 5xx}\n"),
    )])
    .publish(&settings())
    .unwrap();
    let d = cfg.default_retry.as_ref().expect("policy");
    assert_eq!((d.retry.attempts, d.retry.codes.len()), (Some(4), 100));
    assert_eq!(cfg.dump["defaultHttpRetryPolicy"]["attempts"], 4);
    let bad = store(vec![(
        Kind::MeshConfig,
        cm("defaultHttpRetryPolicy: {attempts: 4, retryOn: never}\n"),
    )])
    .publish(&settings())
    .unwrap();
    assert!(bad.default_retry.is_none());
    assert!(
        bad.dump["defaultHttpRetryPolicy"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("retryOn")),
        "{}",
        bad.dump
    );
}

/// The mesh ConfigMap's trustDomainAliases rewrite policies' principals, as istiod
/// writes them for Istio's waypoint.
#[test]
fn policy_principals_follow_the_mesh_config_trust_domain_aliases() {
    let mesh = "trustDomain: new-td\ntrustDomainAliases: [old-td]\n";
    let cm: DynamicObject = serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio", "namespace": "istio-system", "resourceVersion": "7"}, "data": {"mesh": mesh}})).unwrap();
    let p = object(
        "AuthorizationPolicy",
        "p",
        json!({"targetRefs": [{"group": "", "kind": "Service", "name": "web"}], "action": "ALLOW",
               "rules": [{"from": [{"source": {"principals": ["old-td/ns/a/sa/b", "other/ns/a/sa/b"]}}]}]}),
    );
    let cfg = store(vec![(Kind::MeshConfig, cm), (Kind::AuthorizationPolicy, p)])
        .publish(&settings())
        .unwrap();
    assert_eq!(
        cfg.policies[0].rules[0].from[0].source.principals,
        ["new-td/ns/a/sa/b", "old-td/ns/a/sa/b", "other/ns/a/sa/b"]
    );
}

/// With a revision, config labelled `istio.io/rev` for another revision is ignored
/// (and dropped when relabelled away); unlabelled config applies; without one, all of
/// it applies (Istio's `LabelsInRevision`).
#[test]
fn config_of_another_revision_is_ignored() {
    let policy = |name: &str, rev: Option<&str>| {
        let mut o = object(
            "AuthorizationPolicy",
            name,
            json!({"targetRefs": [{"group": "", "kind": "Service", "name": "web"}], "action": "DENY", "rules": [{}]}),
        );
        if let Some(r) = rev {
            o.metadata.labels = Some([(REV_LABEL.to_string(), r.to_string())].into());
        }
        o
    };
    let names = |settings: &Settings, objects: Vec<DynamicObject>| {
        let mut s = Store::default();
        for kind in KINDS {
            s.event(kind, Event::Init, settings);
            if kind == Kind::AuthorizationPolicy {
                for o in &objects {
                    s.event(kind, Event::InitApply(o.clone()), settings);
                }
            }
            s.event(kind, Event::InitDone, settings);
        }
        let cfg = s.publish(settings).unwrap();
        let mut n: Vec<String> = cfg.policies.iter().map(|p| p.name.clone()).collect();
        n.sort();
        (s, n)
    };
    let objects = vec![
        policy("global", None),
        policy("mine", Some("canary")),
        policy("theirs", Some("stable")),
    ];
    let canary = Settings {
        revision: Some("canary".into()),
        ..settings()
    };
    let (mut s, got) = names(&canary, objects.clone());
    assert_eq!(got, ["global", "mine"]);
    // Relabelled to another revision: gone.
    s.event(
        Kind::AuthorizationPolicy,
        Event::Apply(policy("mine", Some("stable"))),
        &canary,
    );
    let cfg = s.publish(&canary).unwrap();
    assert_eq!(
        cfg.policies
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["global"]
    );
    // No revision: everything.
    assert_eq!(names(&settings(), objects).1, ["global", "mine", "theirs"]);
}

/// DestinationRules, GRPCRoutes, TCPRoutes and ReferenceGrants from the API, each as
/// the file writes it; a broken DestinationRule is rejected and named.
#[test]
fn traffic_objects_convert_from_kubernetes() {
    let svc = json!([{"group": "", "kind": "Service", "name": "echo"}]);
    let objs = vec![
        (
            Kind::DestinationRule,
            object(
                "DestinationRule",
                "dr",
                json!({"host": "echo", "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}}),
            ),
        ),
        (
            Kind::DestinationRule,
            object(
                "DestinationRule",
                "bad",
                json!({"host": "legacy", "exportTo": ["."], "trafficPolicy": {"loadBalancer": {"simple": "PASSTHROUGH"}}}),
            ),
        ),
        (
            Kind::DestinationRule,
            object(
                "DestinationRule",
                "sidecar",
                json!({"host": "echo", "workloadSelector": {"matchLabels": {"app": "x"}}}),
            ),
        ),
        // Asks for TLS origination and cannot have it: its host's traffic fails instead.
        (
            Kind::DestinationRule,
            object(
                "DestinationRule",
                "tls",
                json!({"host": "api.example.com", "trafficPolicy": {"portLevelSettings": [
            {"port": {"number": 443}, "tls": {"mode": "SIMPLE", "credentialName": "egress-ca"}}]}}),
            ),
        ),
        (
            Kind::GrpcRoute,
            object(
                "GRPCRoute",
                "g",
                json!({"parentRefs": svc, "rules": [{"matches": [{"method": {"service": "a.B"}}]}]}),
            ),
        ),
        (
            Kind::TcpRoute,
            object(
                "TCPRoute",
                "t",
                json!({"parentRefs": svc, "rules": [{"backendRefs": [{"name": "echo", "port": 9000}]}]}),
            ),
        ),
        // A TLSRoute (v1alpha2's shape: no hostnames) and a VirtualService with only
        // L4 rules: L4 routes, no HTTP route.
        (
            Kind::TlsRoute,
            object(
                "TLSRoute",
                "tls-route",
                json!({"parentRefs": svc, "rules": [{"backendRefs": [{"name": "echo", "port": 443}]}]}),
            ),
        ),
        (
            Kind::VirtualService,
            object(
                "VirtualService",
                "vs-l4",
                json!({"hosts": ["echo.default.svc.cluster.local"], "tcp": [{"match": [{"port": 9000}], "route": [{"destination": {"host": "echo"}}]}]}),
            ),
        ),
        (
            Kind::ReferenceGrant,
            object_in(
                "shop",
                "ReferenceGrant",
                "rg",
                json!({"from": [{"group": GATEWAY_GROUP, "kind": "HTTPRoute", "namespace": "default"}], "to": [{"group": "", "kind": "Service"}]}),
            ),
        ),
    ];
    let cfg = store(objs).publish(&settings()).unwrap();
    assert_eq!(
        cfg.destination_rules
            .iter()
            .map(|(d, _)| d.name.as_str())
            .collect::<Vec<_>>(),
        ["bad", "dr", "tls"]
    );
    assert_eq!(
        cfg.destination_rules[1]
            .1
            .policies()
            .next()
            .and_then(|p| p.pick.clone()),
        Some(crate::destination::Pick::Random)
    );
    let refused = |i: usize, port: u16| {
        cfg.destination_rules[i]
            .1
            .policy(None, port)
            .and_then(|p| p.refused.clone())
            .unwrap_or_default()
    };
    assert!(
        refused(2, 443).contains("credentialName"),
        "{}",
        refused(2, 443)
    );
    assert_eq!(cfg.destination_rules[2].0.host, "api.example.com");
    // A field the waypoint does not apply fails the rule's host in the rule's scope
    // (its exportTo kept), named.
    assert!(refused(0, 80).contains("PASSTHROUGH"), "{}", refused(0, 80));
    assert_eq!(
        (
            cfg.destination_rules[0].0.host.as_str(),
            cfg.destination_rules[0].0.export_to.clone()
        ),
        ("legacy", vec![".".to_string()])
    );
    assert_eq!(cfg.unenforceable, 2);
    let rejected = cfg.dump["rejected"].as_array().unwrap();
    assert!(
        rejected.iter().any(|r| r["kind"] == "DestinationRule"
            && r["name"] == "bad"
            && r["effect"].as_str().unwrap_or_default().contains("fails")),
        "{}",
        cfg.dump
    );
    assert!(
        rejected
            .iter()
            .any(|r| r["name"] == "tls"
                && r["effect"].as_str().unwrap_or_default().contains("fails")),
        "{}",
        cfg.dump
    );
    assert_eq!(
        (
            cfg.routes.len(),
            cfg.tcp_routes.len(),
            cfg.l4_routes.len(),
            cfg.grants.len()
        ),
        (1, 1, 2, 1)
    );
    assert_eq!(cfg.routes[0].kind, crate::route::RouteKind::Grpc);
    assert_eq!(
        cfg.dump["tlsRoutes"][0]["name"], "tls-route",
        "{}",
        cfg.dump
    );
    assert_eq!(
        cfg.dump["virtualServices"][0]["name"], "vs-l4",
        "{}",
        cfg.dump
    );
}

/// A VirtualService of a Service's namespace applies only when exported to the
/// waypoint's namespace, as in Istio's waypoint scope; DestinationRules of every
/// namespace are read (the lookup decides which one applies).
#[test]
fn virtual_services_honour_export_to() {
    let vs = |name: &str, export: Value| {
        object_in(
            "shop",
            "VirtualService",
            name,
            json!({"hosts": ["cart"], "exportTo": export,
            "http": [{"route": [{"destination": {"host": "cart"}}]}]}),
        )
    };
    let mut s = store(vec![
        (Kind::VirtualService, vs("private", json!(["."]))),
        (Kind::VirtualService, vs("elsewhere", json!(["blog"]))),
        (Kind::VirtualService, vs("to-us", json!(["default"]))),
        (Kind::VirtualService, vs("everyone", json!(["*"]))),
        (Kind::VirtualService, vs("unset", json!([]))),
        (
            Kind::VirtualService,
            object(
                "VirtualService",
                "own-hidden",
                json!({"hosts": ["echo"], "exportTo": ["blog"],
            "http": [{"route": [{"destination": {"host": "echo"}}]}]}),
            ),
        ),
    ]);
    s.from_istiod.insert(ObjectName {
        namespace: "shop".into(),
        name: "cart".into(),
    });
    let cfg = s.publish(&settings()).unwrap();
    let mut names: Vec<&str> = cfg.dump["virtualServices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["everyone", "to-us", "unset"], "{}", cfg.dump);
}

/// A root VirtualService's `delegate` rules take the delegate's (any namespace, no
/// hosts) when it is exported to the root's namespace; a delegate is never applied on
/// its own; one not exported to the root drops that rule only, shown in the dump.
#[test]
fn virtual_service_delegates_merge_across_namespaces() {
    let root = object(
        "VirtualService",
        "root",
        json!({"hosts": ["echo"], "http": [
            {"match": [{"uri": {"prefix": "/team"}}], "delegate": {"name": "team", "namespace": "team"}},
            {"match": [{"uri": {"prefix": "/hidden"}}], "delegate": {"name": "hidden", "namespace": "team"}},
            {"route": [{"destination": {"host": "echo"}}]}]}),
    );
    let team = object_in(
        "team",
        "VirtualService",
        "team",
        json!({"exportTo": ["default"], "http": [{"route": [{"destination": {"host": "api"}}]}]}),
    );
    let hidden = object_in(
        "team",
        "VirtualService",
        "hidden",
        json!({"exportTo": ["."], "http": [{"route": [{"destination": {"host": "secret"}}]}]}),
    );
    let unused = object_in(
        "anyone",
        "VirtualService",
        "unused",
        json!({"http": [{"route": [{"destination": {"host": "x"}}]}]}),
    );
    let cfg = store(vec![
        (Kind::VirtualService, root),
        (Kind::VirtualService, team),
        (Kind::VirtualService, hidden),
        (Kind::VirtualService, unused),
    ])
    .publish(&settings())
    .unwrap();
    assert_eq!(cfg.routes.len(), 1, "delegates are not routes of their own");
    let r = &cfg.routes[0];
    assert_eq!(r.rules.len(), 2, "{:?}", r.rules);
    let b = &r.rules[0].backend_refs[0].backend;
    assert_eq!(
        (b.name.as_str(), b.namespace.as_deref()),
        ("api", Some("team")),
        "the delegate's short host is its own namespace's"
    );
    let shown: Vec<&str> = cfg.dump["virtualServices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        !shown.contains(&"unused"),
        "a delegate no root names is not kept: {shown:?}"
    );
    let root_dump = cfg.dump["virtualServices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "root")
        .cloned()
        .unwrap_or_default();
    assert!(
        root_dump["delegateRulesDropped"][0]
            .as_str()
            .is_some_and(|d| d.contains("team/hidden is not exported to default")),
        "{}",
        cfg.dump
    );
}

#[test]
fn routes_convert_from_kubernetes_objects() {
    // As the API server stores it, with Gateway API's defaults filled in.
    let r = route(&object("HTTPRoute", "echo", json!({
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
        "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                   "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v1", "port": 80, "weight": 1}]}]
    })))
    .unwrap();
    assert_eq!((r.name.as_str(), r.namespace.as_str()), ("echo", "default"));
    let bad = route(&object(
        "HTTPRoute",
        "bad",
        json!({"parentRefs": [{"kind": "Service", "group": "", "name": "e"}], "rules": [{"backendRefs": [{"name": "x"}]}]}),
    ));
    assert!(bad.unwrap_err().contains("port"));
}

#[test]
fn policies_for_the_waypoint_only() {
    let p = policy(&object(
        "AuthorizationPolicy",
        "deny",
        json!({
            "targetRef": {"group": "", "kind": "Service", "name": "echo"},
            "action": "DENY",
            "rules": [{"to": [{"operation": {"methods": ["DELETE"]}}]}]
        }),
    ))
    .unwrap()
    .unwrap();
    assert_eq!(p.target_refs.len(), 1);
    let sidecar = policy(&object(
        "AuthorizationPolicy",
        "s",
        json!({"selector": {"matchLabels": {"app": "x"}}, "action": "DENY", "rules": [{}]}),
    ));
    assert!(
        sidecar.unwrap().is_none(),
        "selector policies are not the waypoint's"
    );
    let custom = policy(&object(
        "AuthorizationPolicy",
        "c",
        json!({"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "waypoint"}], "action": "CUSTOM", "provider": {"name": "x"}}),
    ));
    assert_eq!(
        custom.unwrap().unwrap().provider.map(|p| p.name).as_deref(),
        Some("x")
    );
    let no_provider = policy(&object(
        "AuthorizationPolicy",
        "c",
        json!({"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "waypoint"}], "action": "CUSTOM"}),
    ));
    assert!(no_provider.is_err());
}

#[test]
fn request_authentications_convert_and_a_broken_one_refuses_tokens() {
    let jwks = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;
    let good = object(
        "RequestAuthentication",
        "jwt",
        json!({
        "targetRef": {"group": "", "kind": "Service", "name": "echo"},
        "jwtRules": [{"issuer": "iss", "jwks": jwks, "fromHeaders": [{"name": "x-jwt"}]}]}),
    );
    let a = authentication(&good).unwrap().unwrap();
    assert_eq!(
        (
            a.target_refs.len(),
            a.jwt_rules[0].from_headers[0].name.as_str()
        ),
        (1, "x-jwt")
    );
    let sidecar = object(
        "RequestAuthentication",
        "s",
        json!({"selector": {"matchLabels": {"app": "x"}}, "jwtRules": [{"issuer": "i", "jwks": jwks}]}),
    );
    assert!(authentication(&sidecar).unwrap().is_none());
    let broken = object(
        "RequestAuthentication",
        "broken",
        json!({
        "targetRefs": [{"group": "", "kind": "Service", "name": "other"}], "jwtRules": [{"issuer": "i", "jwksUri": "ftp://x"}]}),
    );
    let cfg = store(vec![
        (Kind::RequestAuthentication, good),
        (Kind::RequestAuthentication, broken),
    ])
    .publish(&settings())
    .unwrap();
    assert_eq!((cfg.authentications.len(), cfg.unenforceable), (2, 1));
    let stand_in = cfg
        .authentications
        .iter()
        .find(|a| a.name == "broken")
        .unwrap();
    assert!(stand_in.reject_tokens && stand_in.jwt_rules.is_empty());
    assert_eq!(stand_in.target_refs[0].name, "other");
    assert!(
        cfg.dump["requestAuthentications"][0]["unenforceable"].is_string(),
        "{}",
        cfg.dump
    );
}

fn verdict(cfg: &L7Config, service: Option<(&str, &str)>) -> authz::Verdict {
    verdict_kind(cfg, service, ServiceKind::Kubernetes)
}

fn verdict_kind(
    cfg: &L7Config,
    service: Option<(&str, &str)>,
    service_kind: ServiceKind,
) -> authz::Verdict {
    let gateway = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let svc = service.map(|(ns, name)| ObjectName {
        namespace: ns.into(),
        name: name.into(),
    });
    let target = Target {
        gateway: &gateway,
        service: svc.as_ref(),
        service_kind,
        root_namespace: "istio-system",
        port: 80,
    };
    let id = Identity::new("cluster.local", "default", "sleep");
    let headers = http::HeaderMap::new();
    let req = authz::Request {
        source_principal: Some(&id),
        source_ip: "10.0.0.1".parse().unwrap(),
        destination_port: 80,
        host: "echo",
        method: "GET",
        path: "/",
        headers: &headers,
        auth: None,
    };
    authz::evaluate(cfg.policies.iter().filter(|p| p.applies_to(&target)), &req)
}

/// A kind answered with 404 (its CRD not installed) or 403 (not listable) does not
/// hold the config back: it publishes without it, and the dump names its state.
/// AuthorizationPolicies that cannot be listed deny every request (a forbidden list
/// may hide a DENY), RequestAuthentications refuse every token; not served, there
/// are none, and nothing is denied for them.
#[test]
fn unavailable_kinds_do_not_block_and_unreadable_policies_fail_closed() {
    let settings = settings();
    let without = |gone: &[(Kind, Unavailable)]| {
        let mut s = Store::default();
        for kind in KINDS {
            if let Some((_, u)) = gone.iter().find(|(k, _)| *k == kind) {
                s.update(kind, Update::Unavailable(u.clone()), &settings);
                continue;
            }
            s.update(kind, Update::Served("v1".into()), &settings);
            for e in [Event::Init, Event::InitDone] {
                s.update(kind, Update::Event(Box::new(e)), &settings);
            }
        }
        s
    };
    let not_served = || Unavailable::NotServed("404".into());
    let forbidden = || Unavailable::Forbidden("403".into());
    // Waiting for one kind that failed otherwise (unreachable): nothing published.
    let mut s = without(&[]);
    s.synced.remove(&Kind::Telemetry);
    s.update(
        Kind::Telemetry,
        Update::Failed("connection refused".into()),
        &settings,
    );
    assert!(s.publish(&settings).is_none());

    let cfg = without(&[
        (Kind::TcpRoute, not_served()),
        (Kind::Telemetry, forbidden()),
        (Kind::AuthorizationPolicy, not_served()),
    ])
    .publish(&settings)
    .expect("published without the unavailable kinds");
    assert!(verdict(&cfg, Some(("default", "echo"))).allowed);
    assert_eq!(cfg.unenforceable, 0);
    let w = &cfg.dump["kubernetes"];
    assert_eq!(w["TCPRoute"]["state"], "notServed", "{w}");
    assert_eq!(w["Telemetry"]["state"], "forbidden", "{w}");
    assert_eq!(w["HTTPRoute"]["state"], "listed", "{w}");

    let cfg = without(&[
        (Kind::AuthorizationPolicy, forbidden()),
        (Kind::RequestAuthentication, forbidden()),
    ])
    .publish(&settings)
    .unwrap();
    for svc in [("default", "echo"), ("other", "svc")] {
        let v = verdict(&cfg, Some(svc));
        assert!(!v.allowed, "{svc:?}");
        assert_eq!(
            v.denied_by.as_deref(),
            Some("istio-system/authorizationpolicies-unreadable")
        );
    }
    assert_eq!(cfg.unenforceable, 2);
    assert!(cfg.authentications.iter().any(|a| a.reject_tokens));
    assert!(
        cfg.dump["kubernetes"]["AuthorizationPolicy"]["effect"]
            .as_str()
            .is_some_and(|e| e.contains("fail closed")),
        "{}",
        cfg.dump
    );

    // Listed once, then forbidden: what was listed stays.
    let mut s = without(&[]);
    s.update(
        Kind::AuthorizationPolicy,
        Update::Unavailable(forbidden()),
        &settings,
    );
    assert!(!s.unreadable(Kind::AuthorizationPolicy));
    // A CRD deleted: its objects go with it.
    let mut s = store(vec![(
        Kind::HttpRoute,
        object(
            "HTTPRoute",
            "r",
            json!({"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}], "rules": [{}]}),
        ),
    )]);
    assert_eq!(s.publish(&settings).unwrap().routes.len(), 1);
    s.update(
        Kind::HttpRoute,
        Update::Unavailable(not_served()),
        &settings,
    );
    assert!(s.publish(&settings).unwrap().routes.is_empty());
}

#[test]
fn unenforceable_policies_deny_all_in_their_scope() {
    let cases = [
        // An ALLOW with a condition we do not know: dropping it would allow everyone.
        json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "ALLOW",
               "rules": [{"when": [{"key": "connection.sni", "values": ["x"]}]}]}),
        // CUSTOM without its provider.
        json!({"targetRef": {"group": "", "kind": "Service", "name": "echo"}, "action": "CUSTOM", "rules": [{}]}),
        // A condition we cannot evaluate.
        json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "DENY",
               "rules": [{"when": [{"key": "request.auth.claims[]", "values": ["admin"]}]}]}),
    ];
    for spec in cases {
        let cfg = store(vec![(
            Kind::AuthorizationPolicy,
            object("AuthorizationPolicy", "p", spec.clone()),
        )])
        .publish(&settings())
        .unwrap();
        let v = verdict(&cfg, Some(("default", "echo")));
        assert!(!v.allowed, "{spec}: the unenforceable policy was dropped");
        assert_eq!(v.denied_by.as_deref(), Some("default/p"), "{spec}");
        assert!(
            verdict(&cfg, Some(("default", "other"))).allowed,
            "{spec}: only its targets are denied"
        );
        assert_eq!(cfg.unenforceable, 1);
        assert!(
            cfg.dump["authorizationPolicies"][0]["unenforceable"].is_string(),
            "{}",
            cfg.dump
        );
    }
    // A targetRef we cannot place (a kind Istio does not attach), in the waypoint's
    // namespace: everything that namespace may target, the whole waypoint, is denied.
    let pod = object(
        "AuthorizationPolicy",
        "pod",
        json!({
        "targetRefs": [{"group": "", "kind": "Pod", "name": "ext"}], "action": "DENY", "rules": [{}]}),
    );
    let cfg = store(vec![(Kind::AuthorizationPolicy, pod)])
        .publish(&settings())
        .unwrap();
    assert!(!verdict(&cfg, Some(("default", "other"))).allowed);
    assert!(!verdict(&cfg, None).allowed);
    assert_eq!(cfg.unenforceable, 1);
}

/// The egress layout: a DENY on a ServiceEntry (`networking.istio.io`), in the
/// waypoint's namespace, is enforced on that ServiceEntry's hosts only (it was refused
/// and became a deny-all of the whole waypoint).
#[test]
fn a_service_entry_target_in_the_waypoints_namespace() {
    let se = object(
        "AuthorizationPolicy",
        "se",
        json!({
        "targetRefs": [{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "ext"}], "action": "DENY", "rules": [{}]}),
    );
    let cfg = store(vec![(Kind::AuthorizationPolicy, se)])
        .publish(&settings())
        .unwrap();
    assert_eq!(cfg.unenforceable, 0, "{}", cfg.dump);
    let v = verdict_kind(&cfg, Some(("default", "ext")), ServiceKind::ServiceEntry);
    assert_eq!(v.denied_by.as_deref(), Some("default/se"));
    // Not a Kubernetes Service of that name, nor the waypoint's other targets.
    assert!(verdict(&cfg, Some(("default", "ext"))).allowed);
    assert!(verdict(&cfg, Some(("default", "other"))).allowed);
    assert!(verdict(&cfg, None).allowed);
}

/// Policies of another namespace on what Istio attaches to the waypoint: its
/// ServiceEntry (used through us, as istiod says) and a Service written with group
/// `core`. Both were never converted, so their DENY was not enforced (fail open).
#[test]
fn other_namespaces_service_entry_and_core_group_targets() {
    let deny = |ns: &str, name: &str, refs: Value| {
        object_in(
            ns,
            "AuthorizationPolicy",
            name,
            json!({"targetRefs": refs, "action": "DENY", "rules": [{}]}),
        )
    };
    let mut s = store(vec![
        (
            Kind::AuthorizationPolicy,
            deny(
                "egress",
                "no-ext",
                json!([{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "ext"}]),
            ),
        ),
        (
            Kind::AuthorizationPolicy,
            deny(
                "shop",
                "no-cart",
                json!([{"group": "core", "kind": "Service", "name": "cart"}]),
            ),
        ),
        // Not used through us: never taken.
        (
            Kind::AuthorizationPolicy,
            deny(
                "other",
                "elsewhere",
                json!([{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "x"}]),
            ),
        ),
    ]);
    s.from_istiod.insert(ObjectName {
        namespace: "egress".into(),
        name: "ext".into(),
    });
    s.from_istiod.insert(ObjectName {
        namespace: "shop".into(),
        name: "cart".into(),
    });
    let cfg = s.publish(&settings()).unwrap();
    assert_eq!(
        verdict_kind(&cfg, Some(("egress", "ext")), ServiceKind::ServiceEntry)
            .denied_by
            .as_deref(),
        Some("egress/no-ext")
    );
    assert_eq!(
        verdict(&cfg, Some(("shop", "cart"))).denied_by.as_deref(),
        Some("shop/no-cart")
    );
    assert!(verdict(&cfg, Some(("shop", "web"))).allowed);
    assert!(verdict(&cfg, None).allowed);
    assert_eq!(cfg.policies.len(), 2, "{}", cfg.dump);
    assert_eq!(cfg.unenforceable, 0);
}

/// What an Istio waypoint in `default` takes from other namespaces: `shop` uses it
/// by its Namespace label, `blog` does not (only its Service `api` would, by its own
/// labels, but the Gateway admits only `shop`); the root namespace's policies on
/// the GatewayClass apply to every waypoint.
#[test]
fn other_namespaces_and_the_root_namespace() {
    let route_for = |ns: &str, svc: &str, broken: bool| {
        let rule = if broken {
            json!({"backendRefs": [{"name": svc}]})
        } else {
            json!({"backendRefs": [{"name": svc, "port": 80}]})
        };
        object_in(
            ns,
            "HTTPRoute",
            &format!("{svc}-route"),
            json!({"parentRefs": [{"group": "", "kind": "Service", "name": svc}], "rules": [rule]}),
        )
    };
    let deny = |ns: &str, name: &str, refs: Value| {
        object_in(
            ns,
            "AuthorizationPolicy",
            name,
            json!({"targetRefs": refs, "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/x"]}}]}]}),
        )
    };
    let gateway = object(
        "Gateway",
        "waypoint",
        json!({"gatewayClassName": "istio-waypoint", "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE",
        "allowedRoutes": {"namespaces": {"from": "Selector", "selector": {"matchLabels": {"mesh": "shared"}}}}}]}),
    );
    let class = json!([{"group": "gateway.networking.k8s.io", "kind": "GatewayClass", "name": "istio-waypoint"}]);
    let objects = vec![
        (Kind::Gateway, gateway),
        (
            Kind::Namespace,
            labelled(None, "default", &[("mesh", "shared")]),
        ),
        (
            Kind::Namespace,
            labelled(
                None,
                "shop",
                &[
                    (USE_WAYPOINT, "waypoint"),
                    (USE_WAYPOINT_NAMESPACE, "default"),
                    ("mesh", "shared"),
                ],
            ),
        ),
        (Kind::Namespace, labelled(None, "blog", &[])),
        (
            Kind::Service,
            labelled(Some("shop"), "legacy", &[(USE_WAYPOINT, "none")]),
        ),
        (
            Kind::Service,
            labelled(
                Some("blog"),
                "api",
                &[
                    (USE_WAYPOINT, "waypoint"),
                    (USE_WAYPOINT_NAMESPACE, "default"),
                ],
            ),
        ),
        (Kind::HttpRoute, route_for("shop", "cart", false)),
        (Kind::HttpRoute, route_for("shop", "legacy", true)),
        (Kind::HttpRoute, route_for("blog", "api", true)),
        (
            Kind::AuthorizationPolicy,
            deny(
                "shop",
                "cart-deny",
                json!([{"group": "", "kind": "Service", "name": "cart"}]),
            ),
        ),
        (
            Kind::AuthorizationPolicy,
            deny(
                "shop",
                "ingress",
                json!([{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "ingress"}]),
            ),
        ),
        (
            Kind::AuthorizationPolicy,
            deny("istio-system", "mesh-deny", class.clone()),
        ),
        (
            Kind::AuthorizationPolicy,
            deny(
                "istio-system",
                "ingress-jwt",
                json!([{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "ingress"}]),
            ),
        ),
        (Kind::AuthorizationPolicy, deny("blog", "class", class)),
    ];
    let mut s = store(objects);
    let cfg = s.publish(&settings()).unwrap();
    let names = |v: &Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|o| {
                format!(
                    "{}/{}",
                    o["namespace"].as_str().unwrap(),
                    o["name"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&cfg.dump["httpRoutes"]), ["shop/cart-route"]);
    assert_eq!(
        names(&cfg.dump["authorizationPolicies"]),
        ["istio-system/mesh-deny", "shop/cart-deny"]
    );
    // The broken routes of Services that do not use us were never looked at.
    assert_eq!(cfg.dump["rejected"], json!([]), "{}", cfg.dump);
    assert_eq!(cfg.dump["scope"]["labelledNamespaces"], json!(["shop"]));
    assert_eq!(cfg.dump["scope"]["refusedByGateway"], json!(["blog/api"]));
    // The root namespace's policy covers every target of the waypoint.
    assert_eq!(
        verdict(&cfg, None).denied_by.as_deref(),
        None,
        "rules need /x"
    );
    // Nothing changed: nothing to publish.
    assert!(s.publish(&settings()).is_none());

    // istiod routes blog/api through us after all: its namespace's route is taken
    // (and found broken), and a policy on a GatewayClass outside the root still isn't.
    s.from_istiod.insert(ObjectName {
        namespace: "blog".into(),
        name: "api".into(),
    });
    let cfg = s.publish(&settings()).unwrap();
    assert_eq!(cfg.dump["rejected"][0]["name"], "api-route", "{}", cfg.dump);
    assert_eq!(
        names(&cfg.dump["authorizationPolicies"]),
        ["istio-system/mesh-deny", "shop/cart-deny"]
    );
}

mod egress;
