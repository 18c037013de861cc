//! Which service an inbound connection is labelled with (`MeshState::inbound_service`).

use super::*;

fn state() -> MeshState {
    let workloads: Vec<Workload> = serde_yaml::from_str(
        "- {uid: echo, name: echo, namespace: default, workloadIps: [10.0.0.2], protocol: HBONE,
   services: {default/echo.default.svc.cluster.local: {80: 8080}, default/admin.default.svc.cluster.local: {}}}
- {uid: other, name: other, namespace: default, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {default/other.default.svc.cluster.local: {80: 8080}}}",
    )
    .unwrap();
    let services: Vec<Service> = serde_yaml::from_str(
        "- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [/10.96.0.2], ports: {80: 8080}}
- {name: admin, namespace: default, hostname: admin.default.svc.cluster.local, vips: [/10.96.0.4], ports: {9000: 0, 8080: 8080}}
- {name: other, namespace: default, hostname: other.default.svc.cluster.local, vips: [/10.96.0.3], ports: {80: 8080}}",
    )
    .unwrap();
    MeshState::build(workloads, services, Vec::new()).unwrap()
}

fn name(s: Option<&Arc<Service>>) -> Option<&str> {
    s.map(|s| s.name.as_str())
}

#[test]
fn the_service_the_client_named_wins_among_the_workloads_own() {
    let st = state();
    let echo = st.workload_by_uid(&WorkloadUid("echo".into())).unwrap();
    // Both of echo's services serve 8080; the client side said which one it meant.
    assert_eq!(
        name(st.inbound_service(echo, Some("echo.default.svc.cluster.local"), 8080)),
        Some("echo")
    );
    assert_eq!(
        name(st.inbound_service(echo, Some("admin.default.svc.cluster.local"), 8080)),
        Some("admin")
    );
    // Without a claim: the first by name whose port maps to the target port.
    assert_eq!(name(st.inbound_service(echo, None, 8080)), Some("admin"));
    assert_eq!(
        name(st.inbound_service(echo, None, 9000)),
        Some("admin"),
        "target port 0 means the service port"
    );
    assert_eq!(name(st.inbound_service(echo, None, 7000)), None);
}

#[test]
fn a_claimed_service_the_workload_is_not_in_is_not_believed() {
    let st = state();
    let echo = st.workload_by_uid(&WorkloadUid("echo".into())).unwrap();
    assert_eq!(
        name(st.inbound_service(echo, Some("other.default.svc.cluster.local"), 7000)),
        None
    );
    assert_eq!(
        name(st.inbound_service(echo, Some("other.default.svc.cluster.local"), 8080)),
        Some("admin")
    );
}
