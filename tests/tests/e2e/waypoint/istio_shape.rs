//! Waypoints as istiod describes Istio's: the waypoint pod is not captured, so its
//! workload is TCP (no `networking.istio.io/tunnel` label, no redirection annotation),
//! and services name it by the waypoint Service's VIP with `hboneMtlsPort: 15008`,
//! a port that Service lists (Istio's waypoint template). ztunnel must still reach it
//! over HBONE, as Istio's ztunnel does whatever the waypoint workload's protocol.

use std::collections::HashMap;

use anyhow::Result;
use mesh_tests::http_app;
use mesh_tests::netsim::*;

use super::start_waypoint;

const WAYPOINT_VIP: &str = "10.96.0.99";
const WEB_VIP: &str = "10.96.0.40";

/// client (n1p1, enrolled) -> ztunnel -> waypoint (n1p2, TCP workload, by its Service's
/// VIP) -> web (n2p1, enrolled); and legacy (n2p2), a TCP workload outside the mesh whose
/// own waypoint is the same one: Istio's ztunnel sends it there too, and the waypoint
/// reaches it in plaintext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waypoint_istiod_describes_as_tcp_carries_its_services_traffic_under_l7_policy(
) -> Result<()> {
    let topo = Topology::build(&prefix("wtcp"), &[2, 2])?;
    let via = format!("waypoint: {{destination: \"/{WAYPOINT_VIP}\", hboneMtlsPort: 15008}}");
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [\"/{WAYPOINT_VIP}\"], ports: {{15021: 15021, 15008: 15008}}}}\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/{WEB_VIP}\"], ports: {{80: 8080}}, {via}}}\n\
         authorizationPolicies:\n\
         - name: deny-admin\n  namespace: default\n  targetRefs: [{{kind: Service, group: \"\", name: web}}]\n  action: DENY\n\
         \x20 rules:\n  - to: [{{operation: {{paths: [\"/admin\", \"/admin/*\"]}}}}]\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ", services: {default/waypoint.default.svc.cluster.local: {15008: 15008, 15021: 15021}}"),
        workload(&topo, "n2p1", "web", ", services: {default/web.default.svc.cluster.local: {80: 8080}}"),
        waypoint_workload(&topo, "n2p2", "legacy", &format!(", {via}")),
    );
    // Only the client and web are captured; the waypoint and legacy are not.
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let _web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "web", false)?;
    let _legacy = http_app::HttpApp::start(&t.pod("n2p2").netns, 8080, "legacy", false)?;
    let wp_ip = t.pod("n1p2").ip;
    let client = &t.pod("n1p1").netns;

    // Through the service VIP: over HBONE to the waypoint on 15008, then to web.
    let mut c = http_app::H1Client::connect(
        client,
        format!("{WEB_VIP}:80").parse()?,
        "web.default.svc.cluster.local",
    )
    .await?;
    let r = c.get("/").await?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, waypoint.log_text());
    assert_eq!(
        r.headers.get("x-pod").map(|v| v.as_bytes()),
        Some(&b"web"[..])
    );
    // The waypoint's L7 policy applies: denied with its reason, on the same connection.
    let r = c.get("/admin/keys").await?;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.body.trim_end(), "RBAC: access denied");
    wait_for(
        "the waypoint's deny",
        std::time::Duration::from_secs(5),
        || {
            waypoint
                .log_text()
                .contains("authz.denied_by=\"default/deny-admin\"")
        },
    )?;
    // ztunnel logs the tunnel when it closes: to the waypoint's address on 15008.
    drop(c);
    mesh.wait_logs(&[
        &format!("dst.addr={wp_ip}:15008"),
        "dst.identity=spiffe://cluster.local/ns/default/sa/waypoint",
    ])?;

    // A workload outside the mesh behind the same waypoint, by its own address: through
    // the waypoint (as Istio's ztunnel does), which reaches it in plaintext.
    let legacy = t.pod("n2p2").ip;
    let mut c =
        http_app::H1Client::connect(client, std::net::SocketAddr::new(legacy, 8080), "legacy")
            .await?;
    let r = c.get("/hello").await?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, waypoint.log_text());
    assert_eq!(
        r.headers.get("x-pod").map(|v| v.as_bytes()),
        Some(&b"legacy"[..])
    );
    wait_for(
        "the waypoint's log of the legacy request",
        std::time::Duration::from_secs(5),
        || {
            waypoint
                .log_text()
                .lines()
                .any(|l| l.contains("path=/hello") && l.contains(&format!("{legacy}:8080")))
        },
    )?;
    Ok(())
}
