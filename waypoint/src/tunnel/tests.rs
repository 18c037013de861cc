//! Which targets a waypoint serves, how each port's bytes are taken, and what the
//! policies make of an opaque connection.

use super::*;

#[test]
fn serves_what_names_it_as_primary_or_weighted_waypoint_and_nothing_else() {
    let workloads: Vec<Workload> = serde_yaml::from_str(
        "- {uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE}
- {uid: canary, name: canary, namespace: default, serviceAccount: canary, workloadIps: [10.0.0.8], protocol: HBONE}
- {uid: db, name: db, namespace: default, workloadIps: [10.0.0.4], protocol: HBONE, waypoint: {destination: /10.0.0.9}}
- {uid: plain, name: plain, namespace: default, workloadIps: [10.0.0.5], protocol: HBONE}",
    )
    .unwrap();
    let services: Vec<ztunnel::state::Service> = serde_yaml::from_str(
        "- {name: split, namespace: default, hostname: split.default.svc.cluster.local, vips: [/10.96.0.12], waypoint: {destination: /10.0.0.9},
   weightedWaypoints: [{destination: {destination: /10.0.0.9}, weight: 9}, {destination: {destination: /10.0.0.8}, weight: 1}]}
- {name: other, namespace: default, hostname: other.default.svc.cluster.local, vips: [/10.96.0.13]}",
    )
    .unwrap();
    let st = MeshState::build(workloads, services, Vec::new()).unwrap();
    let me = |uid: &str| {
        st.workload_by_uid(&ztunnel::state::WorkloadUid(uid.into()))
            .unwrap()
            .clone()
    };
    let at = |s: &str| s.parse::<SocketAddr>().unwrap();
    // Both of a weighted set serve the service, the canary named only in the set.
    assert!(
        serves(&st, &me("wp"), at("10.96.0.12:80"))
            && serves(&st, &me("canary"), at("10.96.0.12:80"))
    );
    // A workload serves as waypoint only what names it; nobody serves itself.
    assert!(serves(&st, &me("wp"), at("10.0.0.4:5432")));
    assert!(!serves(&st, &me("canary"), at("10.0.0.4:5432")));
    assert!(!serves(&st, &me("wp"), at("10.0.0.5:80")));
    assert!(!serves(&st, &me("wp"), at("10.96.0.13:80")));
    assert!(!serves(&st, &me("wp"), at("10.0.0.9:80")));
}

/// Only a port of unknown protocol is sniffed: an HTTP, HTTP2 or gRPC port is HTTP
/// only, a TCP or TLS port (or a TCPRoute's) opaque only, as Istio's waypoint chains.
#[test]
fn a_port_is_sniffed_only_when_its_protocol_is_unknown() {
    let services: Vec<ztunnel::state::Service> = serde_yaml::from_str(
        "- {name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [/10.96.0.12],
   ports: {80: 8080, 81: 8080, 82: 8080, 83: 8080, 84: 8080, 85: 8080},
   appProtocols: {80: HTTP11, 81: HTTP2, 82: GRPC, 83: TCP, 84: TLS}}",
    )
    .unwrap();
    let st = MeshState::build(Vec::new(), services, Vec::new()).unwrap();
    let at = |port: u16| {
        handling(
            false,
            port_protocol(&st, SocketAddr::from(([10, 96, 0, 12], port))),
        )
    };
    assert_eq!([at(80), at(81), at(82)], [Handling::Http; 3]);
    assert_eq!([at(83), at(84)], [Handling::Opaque; 2]);
    assert_eq!(at(85), Handling::Sniff, "a port istiod gave no protocol");
    // A workload addressed directly has no service port to declare anything.
    assert_eq!(
        handling(false, port_protocol(&st, "10.0.0.4:80".parse().unwrap())),
        Handling::Sniff
    );
    // A TCPRoute makes the port TCP, whatever it declares.
    assert_eq!(handling(true, AppProtocol::Http11), Handling::Opaque);
    assert_eq!(handling(true, AppProtocol::Unknown), Handling::Opaque);
}

/// An opaque connection in the scope of a CUSTOM policy is denied (an HTTP authorizer
/// cannot check it), with the policy named; out of its scope it passes.
#[test]
fn an_opaque_connection_under_a_custom_policy_is_denied() {
    let providers: extauthz::Providers = Arc::new(
        extauthz::provider::parse_all(&[serde_json::json!(
            {"name": "http-authz", "envoyExtAuthzHttp": {"service": "default/authz.default.svc.cluster.local", "port": 8000}}
        )])
        .unwrap(),
    );
    let policy: authz::AuthorizationPolicy = serde_yaml::from_str(
        "{name: ext, namespace: default, targetRefs: [{kind: Service, group: \"\", name: web}], action: CUSTOM, provider: {name: http-authz},
  rules: [{to: [{operation: {paths: [\"/private*\"], ports: [\"80\"]}}]}]}",
    )
    .unwrap();
    policy.validate().unwrap();
    let tunnel = |port: u16| Tunnel {
        src_identity: Identity::new("cluster.local", "default", "client"),
        src_addr: "10.0.0.1:40000".parse().unwrap(),
        target: SocketAddr::from(([10, 96, 0, 12], port)),
        trace: hbone::TraceParent::default(),
    };
    let why = l4_plan(&tunnel(80), &[&policy], &providers).unwrap_err();
    assert!(
        why.starts_with("denied by default/ext: ") && why.contains("http-authz"),
        "{why}"
    );
    assert_eq!(
        l4_plan(&tunnel(9000), &[&policy], &providers),
        Ok(L4Plan {
            check: None,
            verdict: Ok(())
        }),
        "the policy's rule is for port 80 only"
    );
}

/// With a gRPC provider the connection is checked (Envoy's network ext_authz) before
/// the DENY and ALLOW policies are applied; the plan keeps both.
#[test]
fn an_opaque_connection_under_a_grpc_custom_policy_is_checked() {
    let providers: extauthz::Providers = Arc::new(
        extauthz::provider::parse_all(&[serde_json::json!(
            {"name": "grpc-authz", "envoyExtAuthzGrpc": {"service": "default/authz.default.svc.cluster.local", "port": 9000}}
        )])
        .unwrap(),
    );
    let policy = |yaml: &str| {
        let p: authz::AuthorizationPolicy = serde_yaml::from_str(yaml).unwrap();
        p.validate().unwrap();
        p
    };
    let custom = policy("{name: ext, namespace: default, targetRefs: [{kind: Service, group: \"\", name: web}], action: CUSTOM, provider: {name: grpc-authz}, rules: [{}]}");
    let deny = policy("{name: no, namespace: default, targetRefs: [{kind: Service, group: \"\", name: web}], action: DENY, rules: [{to: [{operation: {ports: [\"81\"]}}]}]}");
    let tunnel = |port: u16| Tunnel {
        src_identity: Identity::new("cluster.local", "default", "client"),
        src_addr: "10.0.0.1:40000".parse().unwrap(),
        target: SocketAddr::from(([10, 96, 0, 12], port)),
        trace: hbone::TraceParent::default(),
    };
    let plan = l4_plan(&tunnel(80), &[&custom, &deny], &providers).unwrap();
    let (provider, name) = plan.check.expect("checked");
    assert_eq!((provider.common.port, name.as_str()), (9000, "default/ext"));
    assert_eq!(plan.verdict, Ok(()));
    // Checked, and denied by the DENY policy whatever the check says.
    let plan = l4_plan(&tunnel(81), &[&custom, &deny], &providers).unwrap();
    assert!(plan.check.is_some());
    assert_eq!(plan.verdict, Err("denied by default/no".into()));
}
