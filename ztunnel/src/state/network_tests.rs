//! Networks in the mesh state: addresses unique per network, not globally; endpoints
//! of another network reachable only through their gateway; the gateway itself.

use super::*;

const WORKLOADS: &str = "
- {uid: a-client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.10.1.11], protocol: HBONE, network: net-a}
- {uid: a-echo, name: echo-a, namespace: default, serviceAccount: echo, workloadIps: [10.10.1.12], protocol: HBONE, network: net-a,
   services: {default/echo.default.svc.cluster.local: {80: 8080}}}
# The same pod IP as a-echo, in the other network: no conflict.
- {uid: b-echo, name: echo-b, namespace: default, serviceAccount: echo, workloadIps: [10.10.1.12], protocol: HBONE, network: net-b,
   networkGateway: {destination: net-b/172.18.0.9}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}
# Istio's remote endpoint: no address, a gateway to reach it by.
- {uid: b-remote, name: echo-r, namespace: default, serviceAccount: echo, protocol: HBONE, network: net-b,
   networkGateway: {destination: istio-system/eastwest.istio-system.svc.cluster.local}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}
# No address and a gateway, in the client's own network: never used.
- {uid: a-odd, name: odd, namespace: default, protocol: HBONE, network: net-a,
   networkGateway: {destination: net-a/172.18.0.1}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}
- {uid: gw, name: eastwest, namespace: istio-system, serviceAccount: eastwest, workloadIps: [172.18.0.9, 10.0.1.254], protocol: HBONE, network: net-b,
   services: {istio-system/eastwest.istio-system.svc.cluster.local: {15008: 15008}}}
";

const SERVICES: &str = "
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [net-a/10.96.0.10, net-b/10.96.0.10], ports: {80: 8080},
   cidrVips: [net-b/10.200.0.0/16], subjectAltNames: [spiffe://cluster.local/ns/default/sa/echo]}
- {name: eastwest, namespace: istio-system, hostname: eastwest.istio-system.svc.cluster.local, vips: [net-b/10.96.9.9], ports: {15008: 15008},
   subjectAltNames: [spiffe://cluster.local/ns/istio-system/sa/eastwest-canary]}
";

fn state() -> MeshState {
    let workloads: Vec<Workload> = serde_yaml::from_str(WORKLOADS).unwrap();
    let services: Vec<Service> = serde_yaml::from_str(SERVICES).unwrap();
    MeshState::build(workloads, services, Vec::new()).unwrap()
}

fn wl<'a>(st: &'a MeshState, uid: &str) -> &'a Arc<Workload> {
    st.workload_by_uid(&WorkloadUid(uid.into())).unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn an_address_is_unique_per_network_not_globally() {
    let st = state();
    assert_eq!(
        st.workload_by_ip("net-a", ip("10.10.1.12"))
            .map(|w| w.uid.0.as_str()),
        Some("a-echo")
    );
    assert_eq!(
        st.workload_by_ip("net-b", ip("10.10.1.12"))
            .map(|w| w.uid.0.as_str()),
        Some("b-echo")
    );
    assert!(
        st.workload_by_ip("", ip("10.10.1.12")).is_none(),
        "the default network is a network of its own"
    );
    // One service, a VIP in each network; a range in one only.
    assert!(
        st.service_by_vip("net-a", ip("10.96.0.10")).is_some()
            && st.service_by_vip("net-b", ip("10.96.0.10")).is_some()
    );
    assert!(st.service_by_vip("net-b", ip("10.200.3.4")).is_some());
    assert!(st.service_by_vip("net-a", ip("10.200.3.4")).is_none());
    // Within a network an address still has one owner: the strict build refuses, naming it.
    let mut twice: Vec<Workload> = serde_yaml::from_str(WORKLOADS).unwrap();
    twice[2].network = "net-a".into();
    let err = MeshState::build(twice, Vec::new(), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("net-a/10.10.1.12") && err.contains("a-echo") && err.contains("b-echo"),
        "{err}"
    );
    let vips: Vec<Service> = serde_yaml::from_str(
        "- {name: x, namespace: d, hostname: x.d, vips: [net-a/10.96.0.1]}\n- {name: y, namespace: d, hostname: y.d, vips: [net-b/10.96.0.1, net-a/10.96.0.1]}",
    )
    .unwrap();
    let err = MeshState::build(Vec::new(), vips, Vec::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("service VIP net-a/10.96.0.1"), "{err}");
}

#[test]
fn another_networks_endpoints_are_reachable_only_through_a_gateway() {
    let st = state();
    let echo = st
        .service_by_hostname(&NamespacedHostname(
            "default/echo.default.svc.cluster.local".into(),
        ))
        .unwrap()
        .clone();
    let uids = |network: &str| {
        let mut v: Vec<String> = st
            .usable_endpoints(&echo, 80, network)
            .iter()
            .map(|(w, _)| w.uid.0.clone())
            .collect();
        v.sort();
        v
    };
    // From net-a: the remote endpoint without an address (it has a gateway), not the
    // address-less one of net-a itself (a gateway is never used within its network).
    assert_eq!(uids("net-a"), ["a-echo", "b-echo", "b-remote"]);
    // From net-b the address-less remote endpoint is its own network's: unusable there.
    assert_eq!(uids("net-b"), ["a-echo", "a-odd", "b-echo"]);
}

#[test]
fn the_gateway_is_found_by_address_or_service_with_the_identities_it_proves() {
    let st = state();
    let client = wl(&st, "a-client");
    let dst: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let by_ip = st
        .network_gateway(
            wl(&st, "b-echo").network_gateway.as_ref().unwrap(),
            client,
            dst,
        )
        .unwrap();
    assert_eq!(
        (by_ip.workload.uid.0.as_str(), by_ip.addr.to_string()),
        ("gw", "172.18.0.9:15008".to_string())
    );
    assert_eq!(
        by_ip.identities,
        vec![Identity::new("cluster.local", "istio-system", "eastwest")]
    );
    // By its service: an endpoint on the port the HBONE port maps to; the service's SANs too.
    let by_name = st
        .network_gateway(
            wl(&st, "b-remote").network_gateway.as_ref().unwrap(),
            client,
            dst,
        )
        .unwrap();
    assert_eq!(by_name.workload.uid.0, "gw");
    assert_eq!(by_name.addr.port(), 15008);
    assert_eq!(
        by_name.identities,
        vec![
            Identity::new("cluster.local", "istio-system", "eastwest"),
            Identity::new("cluster.local", "istio-system", "eastwest-canary")
        ]
    );
    // A gateway nobody knows: nothing to verify it by.
    let unknown: GatewayAddress = serde_yaml::from_str("{destination: net-b/172.18.0.77}").unwrap();
    assert!(st.network_gateway(&unknown, client, dst).is_none());
    // What the gateway is to the far side: a forwarder of other identities.
    assert!(st.is_network_gateway(wl(&st, "gw")));
    assert!(!st.is_network_gateway(wl(&st, "b-echo")) && !st.is_network_gateway(client));
}

#[test]
fn a_connect_naming_a_service_reaches_only_a_pod_of_it() {
    let st = state();
    let echo = wl(&st, "b-echo");
    let (svc, port) = st
        .hostname_target(echo, "echo.default.svc.cluster.local", 80)
        .unwrap();
    assert_eq!((svc.name.as_str(), port), ("echo", 8080));
    assert_eq!(
        st.hostname_target(echo, "ECHO.default.svc.cluster.local.", 80)
            .map(|(_, p)| p),
        Some(8080)
    );
    // A port the service does not have, a service the pod is not in, a client pod.
    assert!(st
        .hostname_target(echo, "echo.default.svc.cluster.local", 81)
        .is_none());
    assert!(st
        .hostname_target(echo, "eastwest.istio-system.svc.cluster.local", 15008)
        .is_none());
    assert!(st
        .hostname_target(wl(&st, "a-client"), "echo.default.svc.cluster.local", 80)
        .is_none());
}

#[test]
fn a_network_preference_keeps_traffic_in_the_clients_network() {
    let lb = |mode: &str| {
        let services: Vec<Service> = serde_yaml::from_str(&format!(
            "- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [net-a/10.96.0.10], ports: {{80: 8080}},
   loadBalancer: {{mode: {mode}, routingPreferences: [Network, Zone]}}}}"
        ))
        .unwrap();
        let workloads: Vec<Workload> = serde_yaml::from_str(WORKLOADS).unwrap();
        MeshState::build(workloads, services, Vec::new()).unwrap()
    };
    for mode in ["Failover", "Strict"] {
        let st = lb(mode);
        let echo = st
            .service_by_vip("net-a", ip("10.96.0.10"))
            .unwrap()
            .clone();
        let client = wl(&st, "a-client").clone();
        for _ in 0..30 {
            let (picked, _) = st.pick_endpoint(&client, &echo, 80).unwrap();
            assert_eq!(picked.uid.0, "a-echo", "{mode}");
        }
    }
    // The local endpoint gone: FAILOVER crosses to the other network, STRICT refuses.
    let without = |mode: &str| {
        let services: Vec<Service> = serde_yaml::from_str(&format!(
            "- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [net-a/10.96.0.10], ports: {{80: 8080}},
   loadBalancer: {{mode: {mode}, routingPreferences: [Network]}}}}"
        ))
        .unwrap();
        let workloads: Vec<Workload> = serde_yaml::from_str::<Vec<Workload>>(WORKLOADS)
            .unwrap()
            .into_iter()
            .filter(|w| w.uid.0 != "a-echo")
            .collect();
        MeshState::build(workloads, services, Vec::new()).unwrap()
    };
    let st = without("Failover");
    let echo = st
        .service_by_vip("net-a", ip("10.96.0.10"))
        .unwrap()
        .clone();
    let picked = st.pick_endpoint(wl(&st, "a-client"), &echo, 80).unwrap().0;
    assert_eq!(picked.network, "net-b");
    let st = without("Strict");
    let echo = st
        .service_by_vip("net-a", ip("10.96.0.10"))
        .unwrap()
        .clone();
    assert!(st.pick_endpoint(wl(&st, "a-client"), &echo, 80).is_none());
}
