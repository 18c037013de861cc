//! DestinationRule settings as Istio's waypoint applies them, seen from real peers: the
//! HTTP version the endpoints get (`h2UpgradePolicy`, `useClientProtocol`), Envoy's
//! generated hash cookie (`httpCookie.ttl`), and the upstream connections the kernel
//! shows (`connectTimeout`, `tcpKeepalive`, `maxConnectionDuration`).

use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::http_app;

use super::L7Mesh;

const ECHO_DR: &str = "destinationRules:\n- {name: echo, namespace: default, host: echo.default.svc.cluster.local, trafficPolicy: POLICY}\n";

fn reload(m: &L7Mesh, policy: &str) -> Result<()> {
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(
        &tmp,
        format!("{}{}", m.base, ECHO_DR.replace("POLICY", policy)),
    )?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    Ok(())
}

/// Waits for the `n`th "config reloaded" line of the waypoint's log.
fn wait_reloads(m: &L7Mesh, n: usize) -> Result<()> {
    mesh_tests::netsim::wait_for("config reloads", Duration::from_secs(5), || {
        m.log().matches("config reloaded").count() >= n
    })
}

/// `h2UpgradePolicy: UPGRADE` sends an HTTP/1.1 client's requests to the endpoints as
/// HTTP/2, `useClientProtocol` as the client spoke; a consistent hash on a cookie with
/// a `ttl` gives a client without the cookie one (Envoy's `Set-Cookie` form), and the
/// requests that carry it stay on one endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_destination_rule_upgrades_to_http2_and_generates_a_hash_cookie() -> Result<()> {
    let policy = "{connectionPool: {http: {h2UpgradePolicy: UPGRADE}}, \
                  loadBalancer: {consistentHash: {httpCookie: {name: srv, path: /, ttl: 60s}}}}";
    let m = L7Mesh::start("l7dr", &ECHO_DR.replace("POLICY", policy), &[]).await?;
    let mut c = m.h1().await?;
    let first = c.get("/").await?;
    assert_eq!(first.status, 200, "{first:?}\n{}", m.log());
    assert_eq!(
        first.field("version").as_deref(),
        Some("HTTP/2.0"),
        "upgraded: {first:?}"
    );
    let set = first
        .headers
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .context("a generated cookie")?
        .to_string();
    let value = set
        .strip_prefix("srv=\"")
        .and_then(|v| v.split_once('"'))
        .map(|(v, rest)| (v.to_string(), rest.to_string()));
    let Some((value, attrs)) = value else {
        anyhow::bail!("not Envoy's cookie form: {set}");
    };
    assert_eq!(attrs, "; Max-Age=60; Path=/; HttpOnly", "{set}");
    assert_eq!(value.len(), 16, "a hex hash: {set}");
    // With the cookie: one endpoint, the one the cookie's first request went to.
    let cookie = format!("srv=\"{value}\"");
    for _ in 0..8 {
        let r = c.request("GET", "/", &[("cookie", &cookie)]).await?;
        assert_eq!(r.status, 200);
        assert!(r.headers.get("set-cookie").is_none(), "had one: {r:?}");
        assert_eq!(r.pod(), first.pod(), "{r:?}");
    }

    // useClientProtocol: the client's HTTP/1.1 goes up as HTTP/1.1 (over the upgrade).
    reload(
        &m,
        "{connectionPool: {http: {h2UpgradePolicy: UPGRADE, useClientProtocol: true}}}",
    )?;
    wait_reloads(&m, 1)?;
    let r = c.get("/").await?;
    assert_eq!(r.field("version").as_deref(), Some("HTTP/1.1"), "{r:?}");
    Ok(())
}

/// To an endpoint outside the mesh: `tcpKeepalive` is on the waypoint's socket (the
/// kernel's keep-alive timer, with the rule's time), `maxConnectionDuration` retires a
/// kept connection, and `connectTimeout` fails a dial that gets no answer with 503 `UF`
/// (the waypoint's own connect timeout is set far longer than the client waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_destination_rule_connection_settings_reach_the_socket() -> Result<()> {
    let wp_ip = "10.10.1.12";
    let workloads =
        "- {uid: ext, name: ext, namespace: default, workloadIps: [10.0.0.2], protocol: TCP, \
                     services: {default/external.default.svc.cluster.local: {80: 8090}, \
                     default/silent.default.svc.cluster.local: {80: 8091}}}\n";
    let services = format!(
        "- {{name: external, namespace: default, hostname: external.default.svc.cluster.local, vips: [\"/10.96.0.40\"], \
         ports: {{80: 8090}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: silent, namespace: default, hostname: silent.default.svc.cluster.local, vips: [\"/10.96.0.41\"], \
         ports: {{80: 8091}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n"
    );
    let rules = "destinationRules:\n\
        - {name: external, namespace: default, host: external.default.svc.cluster.local, trafficPolicy: \
           {connectionPool: {tcp: {maxConnectionDuration: 500ms, tcpKeepalive: {time: 77s, interval: 5s, probes: 4}}}}}\n\
        - {name: silent, namespace: default, host: silent.default.svc.cluster.local, trafficPolicy: \
           {connectionPool: {tcp: {connectTimeout: 300ms}}}}\n";
    let m = L7Mesh::start_with(
        "l7dc",
        rules,
        &[("CONNECT_TIMEOUT_MS", "60000")],
        workloads,
        &services,
    )
    .await?;
    assert_eq!(
        m.mesh.topo.pod("n1p2").ip.to_string(),
        wp_ip,
        "the test names the waypoint's address"
    );
    let wp = &m.mesh.topo.pod("n1p2").netns;
    let node2 = m.mesh.topo.node(2);
    let app = http_app::HttpApp::start(node2, 8090, "ext", false)?;
    // Port 8091 answers nothing: the waypoint's SYNs to it are dropped.
    wp.exec("nft", &["add", "table", "inet", "silent"])?;
    wp.exec(
        "nft",
        &["add chain inet silent out { type filter hook output priority 0 ; }"],
    )?;
    wp.exec(
        "nft",
        &["add rule inet silent out ip daddr 10.0.0.2 tcp dport 8091 drop"],
    )?;

    let mut c = http_app::H1Client::connect(
        m.client(),
        "10.96.0.40:80".parse()?,
        "external.default.svc.cluster.local",
    )
    .await?;
    let connections = || *app.connections.lock().unwrap();
    for _ in 0..3 {
        let r = c.get("/").await?;
        assert_eq!((r.status.as_u16(), r.pod().as_str()), (200, "ext"), "{r:?}");
    }
    assert_eq!(connections(), 1, "one kept connection");
    // The kernel's view of the waypoint's socket: keep-alive on, with the rule's time.
    let ss = wp.exec("ss", &["-tnoH", "dst", "10.0.0.2:8090"])?;
    assert!(
        ss.contains("timer:(keepalive,1min"),
        "keep-alive timer of ~77 s: {ss}"
    );
    // The behaviour under test is a connection's age: let it pass.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let r = c.get("/").await?;
    assert_eq!(r.status, 200);
    assert_eq!(connections(), 2, "the old connection was not reused");

    let mut s = http_app::H1Client::connect(
        m.client(),
        "10.96.0.41:80".parse()?,
        "silent.default.svc.cluster.local",
    )
    .await?;
    let r = s.get("/").await.context(
        "no answer within the client's 10 s: the rule's 300ms connectTimeout was not applied",
    )?;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("timed out"), "{r:?}");
    m.waypoint
        .wait_log("response_flags=\"UF\"", Duration::from_secs(5))?;
    Ok(())
}
