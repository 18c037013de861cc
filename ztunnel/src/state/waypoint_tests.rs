//! Who counts as a waypoint (`MeshState::is_waypoint`, `waypoint_identity`,
//! `is_waypoint_of`) and which of a weighted set is picked (`pick_waypoint`).

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
    for d in [
        "default/waypoint.default.svc.cluster.local",
        "/10.96.0.99",
        "/10.0.0.9",
    ] {
        assert!(st.is_waypoint(&gw(d), &wl(&st, "wp").identity()), "{d}");
        assert!(
            !st.is_waypoint(&gw(d), &wl(&st, "client").identity()),
            "{d}"
        );
    }
}

#[test]
fn a_member_of_the_waypoint_service_with_another_identity_is_not_the_waypoint() {
    let st = state(
        "- {uid: intruder, name: intruder, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {default/waypoint.default.svc.cluster.local: {15008: 15008}}}",
    );
    for d in ["default/waypoint.default.svc.cluster.local", "/10.96.0.99"] {
        assert!(
            !st.is_waypoint(&gw(d), &wl(&st, "intruder").identity()),
            "{d}: selector membership made a pod the waypoint"
        );
        // Two identities behind one waypoint: which is the waypoint cannot be told.
        assert_eq!(st.waypoint_identity(&gw(d)), None, "{d}");
    }
    // By the workload's own address, its identity.
    assert!(st.is_waypoint(&gw("/10.0.0.9"), &wl(&st, "wp").identity()));
}

/// `state` plus: services `echo` (waypoint by hostname), `split` (primary `wp`, 10% to the
/// canary `wp2`), `plain` (none); workload `db` behind `wp` by its IP; the canary `wp2`.
fn with_destinations(extra: &str) -> MeshState {
    let wls = format!(
        "- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE,
   services: {{default/waypoint.default.svc.cluster.local: {{15008: 15008}}}}}}
- {{uid: wp2, name: wp2, namespace: default, serviceAccount: waypoint-canary, workloadIps: [10.0.0.8], protocol: HBONE,
   services: {{default/canary.default.svc.cluster.local: {{15008: 15008}}}}}}
- {{uid: db, name: db, namespace: default, serviceAccount: db, workloadIps: [10.0.0.4], protocol: HBONE, waypoint: {{destination: /10.0.0.9}}}}
{extra}"
    );
    let workloads: Vec<Workload> = serde_yaml::from_str(&wls).unwrap();
    let services: Vec<Service> = serde_yaml::from_str(
        "- {name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {15008: 15008}}
- {name: canary, namespace: default, hostname: canary.default.svc.cluster.local, vips: [/10.96.0.98], ports: {15008: 15008}}
- {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [/10.96.0.10],
   waypoint: {destination: default/waypoint.default.svc.cluster.local}}
- {name: split, namespace: default, hostname: split.default.svc.cluster.local, vips: [/10.96.0.12], waypoint: {destination: /10.96.0.99},
   weightedWaypoints: [{destination: {destination: /10.96.0.99}, weight: 90}, {destination: {destination: default/canary.default.svc.cluster.local}, weight: 10}]}
- {name: plain, namespace: default, hostname: plain.default.svc.cluster.local, vips: [/10.96.0.11]}",
    )
    .unwrap();
    MeshState::build(workloads, services, Vec::new()).unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn a_pod_is_the_waypoint_of_what_names_it() {
    let st = with_destinations("");
    let (wp, wp2) = (wl(&st, "wp"), wl(&st, "wp2"));
    // A service naming the waypoint's Service by hostname, a workload naming the pod's IP.
    assert!(st.is_waypoint_of("", ip("10.96.0.10"), wp));
    assert!(st.is_waypoint_of("", ip("10.0.0.4"), wp));
    // Both of a weighted set serve it, the canary too (named only in the set).
    assert!(
        st.is_waypoint_of("", ip("10.96.0.12"), wp) && st.is_waypoint_of("", ip("10.96.0.12"), wp2)
    );
    // Not: another waypoint's destinations, destinations without a waypoint, unknown ones.
    assert!(!st.is_waypoint_of("", ip("10.96.0.10"), wp2));
    assert!(!st.is_waypoint_of("", ip("10.0.0.4"), wp2));
    assert!(!st.is_waypoint_of("", ip("10.96.0.11"), wp));
    assert!(!st.is_waypoint_of("", ip("192.0.2.1"), wp));
}

#[test]
fn joining_the_waypoint_service_or_sharing_its_identity_alone_makes_no_waypoint() {
    // In the waypoint Service with another identity: the waypoint's identity is no longer
    // one, so nobody is taken for it (fail closed).
    let st = with_destinations(
        "- {uid: intruder, name: intruder, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.3], protocol: HBONE,
   services: {default/waypoint.default.svc.cluster.local: {15008: 15008}}}",
    );
    assert!(!st.is_waypoint_of("", ip("10.96.0.10"), wl(&st, "intruder")));
    assert!(!st.is_waypoint_of("", ip("10.96.0.10"), wl(&st, "wp")));
    // The waypoint's identity without being named by the destination: not its waypoint.
    let st = with_destinations("- {uid: twin, name: twin, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.5], protocol: HBONE}");
    assert!(!st.is_waypoint_of("", ip("10.96.0.10"), wl(&st, "twin")));
    assert!(!st.is_waypoint_of("", ip("10.0.0.4"), wl(&st, "twin")));
}

#[test]
fn a_weighted_set_is_picked_by_weight_else_the_primary() {
    let st = with_destinations("");
    let split = st.service_by_vip("", ip("10.96.0.12")).unwrap();
    let at = |p| pick_waypoint_at(split, p).map(|g| g.destination.to_string());
    // Points 0..90 are the primary's, 90..100 the canary's.
    assert_eq!(at(0).as_deref(), Some("/10.96.0.99"));
    assert_eq!(at(89).as_deref(), Some("/10.96.0.99"));
    assert_eq!(
        at(90).as_deref(),
        Some("default/canary.default.svc.cluster.local")
    );
    assert_eq!(
        at(99).as_deref(),
        Some("default/canary.default.svc.cluster.local")
    );
    // At random: about 10% to the canary.
    let canary = (0..2000)
        .filter(|_| {
            pick_waypoint(split)
                .is_some_and(|g| g.destination.to_string().starts_with("default/canary"))
        })
        .count();
    assert!(
        (100..=320).contains(&canary),
        "{canary} of 2000 to the canary"
    );
    // Weight 0 is never picked; all 0 (or no set) is the single waypoint; no waypoint at all is none.
    let mut s = (**split).clone();
    s.weighted_waypoints[0].weight = 0;
    assert!((0..200).all(|_| pick_waypoint(&s)
        .is_some_and(|g| g.destination.to_string().starts_with("default/canary"))));
    s.weighted_waypoints[1].weight = 0;
    assert_eq!(
        pick_waypoint(&s)
            .map(|g| g.destination.to_string())
            .as_deref(),
        Some("/10.96.0.99")
    );
    s.waypoint = None;
    assert_eq!(pick_waypoint(&s), None);
    let echo = st.service_by_vip("", ip("10.96.0.10")).unwrap();
    assert_eq!(pick_waypoint(echo), echo.waypoint.as_ref());
    assert_eq!(
        pick_waypoint(st.service_by_vip("", ip("10.96.0.11")).unwrap()),
        None
    );
}

/// Istio's waypoint as istiod describes it: its pod is not captured, so its workload is
/// TCP; its Service lists the HBONE port 15008 (Istio's waypoint template).
fn istio_waypoint(wp_extra: &str, extra: &str, svc_ports: &str) -> MeshState {
    let workloads: Vec<Workload> = serde_yaml::from_str(&format!(
        "- {{uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: TCP,
   services: {{default/waypoint.default.svc.cluster.local: {{15008: 15008, 15021: 15021}}}}{wp_extra}}}
- {{uid: client, name: client, namespace: default, serviceAccount: sleep, workloadIps: [10.0.0.1], protocol: HBONE}}
{extra}"
    ))
    .unwrap();
    let services: Vec<Service> = serde_yaml::from_str(&format!(
        "- {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [/10.96.0.99], ports: {svc_ports}}}"
    ))
    .unwrap();
    MeshState::build(workloads, services, Vec::new()).unwrap()
}

#[test]
fn a_waypoint_is_reached_whatever_its_workloads_protocol() {
    let st = istio_waypoint("", "", "{15008: 15008, 15021: 15021}");
    for d in [
        "default/waypoint.default.svc.cluster.local",
        "/10.96.0.99",
        "/10.0.0.9",
    ] {
        let mut g = gw(d);
        g.hbone_mtls_port = 15008;
        assert_eq!(
            st.waypoint_workload(&g, "")
                .map(|w| w.uid.0.clone())
                .as_deref(),
            Some("wp"),
            "{d}"
        );
        assert!(st.is_waypoint(&g, &wl(&st, "wp").identity()), "{d}");
    }
}

#[test]
fn an_unhealthy_waypoint_or_one_its_service_gives_no_hbone_port_is_not_picked() {
    let by_name = gw("default/waypoint.default.svc.cluster.local");
    // Only healthy endpoints, as Istio's ztunnel.
    let st = istio_waypoint(", status: Unhealthy", "", "{15008: 15008, 15021: 15021}");
    assert!(st.waypoint_workload(&by_name, "").is_none());
    // The Service does not list the HBONE port: only a workload that takes an
    // application tunnel qualifies (Istio's `load_balance` in waypoint mode).
    let st = istio_waypoint("", "", "{15021: 15021}");
    assert!(st.waypoint_workload(&by_name, "").is_none());
    let st = istio_waypoint(
        ", applicationTunnel: {protocol: PROXY, port: 15088}",
        "",
        "{15021: 15021}",
    );
    assert_eq!(
        st.waypoint_workload(&by_name, "")
            .map(|w| w.uid.0.clone())
            .as_deref(),
        Some("wp")
    );
}
