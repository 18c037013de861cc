//! Who counts as a waypoint (`MeshState::is_waypoint`, `waypoint_identity`).

use super::*;

fn state(extra: &str) -> MeshState {
    let workloads: Vec<Workload> = serde_yaml::from_str(&format!(
        "- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE,
   services: {{default/waypoint.default.svc.cluster.local: {{15008: 15008}}}}}}
- {{uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE}}
{extra}"
    ))
    .unwrap();
    let services: Vec<Service> = serde_yaml::from_str(
        "- {name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {15008: 15008}}",
    )
    .unwrap();
    MeshState::build(workloads, services, Vec::new()).unwrap()
}

fn gw(destination: &str) -> GatewayAddress {
    serde_yaml::from_str(&format!("{{destination: \"{destination}\"}}")).unwrap()
}

fn wl<'a>(st: &'a MeshState, uid: &str) -> &'a Arc<Workload> {
    st.workload_by_uid(&WorkloadUid(uid.into())).unwrap()
}

#[test]
fn the_waypoint_is_known_by_its_identity() {
    let st = state("");
    for d in ["default/waypoint.default.svc.cluster.local", "/10.96.0.99", "/10.0.0.9"] {
        assert!(st.is_waypoint(&gw(d), &wl(&st, "wp").identity()), "{d}");
        assert!(!st.is_waypoint(&gw(d), &wl(&st, "client").identity()), "{d}");
    }
}

#[test]
fn a_member_of_the_waypoint_service_with_another_identity_is_not_the_waypoint() {
    let st = state(
        "- {uid: intruder, name: intruder, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {default/waypoint.default.svc.cluster.local: {15008: 15008}}}",
    );
    for d in ["default/waypoint.default.svc.cluster.local", "/10.96.0.99"] {
        assert!(!st.is_waypoint(&gw(d), &wl(&st, "intruder").identity()), "{d}: selector membership made a pod the waypoint");
        // Two identities behind one waypoint: which is the waypoint cannot be told.
        assert_eq!(st.waypoint_identity(&gw(d)), None, "{d}");
    }
    // By the workload's own address, its identity.
    assert!(st.is_waypoint(&gw("/10.0.0.9"), &wl(&st, "wp").identity()));
}
