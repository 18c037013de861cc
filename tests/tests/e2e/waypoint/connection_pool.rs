//! A DestinationRule's `connectionPool.http.maxRequestsPerConnection` and `idleTimeout`
//! as Envoy applies them to the waypoint's upstream connections: counted at the echo
//! pods as the TCP connections their node's ztunnel opens (one per HBONE stream, one
//! HBONE stream per upstream HTTP/1.1 or HTTP/2 connection of the waypoint).

use std::time::Duration;

use anyhow::Result;

use super::{L7Mesh, ECHO_VIP};

const DR: &str = "destinationRules:\n- {name: echo, namespace: default, host: echo.default.svc.cluster.local, trafficPolicy: {connectionPool: {http: HTTP}}}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_destination_rule_bounds_requests_per_connection_and_idle_connections() -> Result<()> {
    let m = L7Mesh::start("l7cp", "", &[]).await?;
    let accepted = || -> u64 {
        m.apps
            .values()
            .map(|a| *a.connections.lock().unwrap())
            .sum()
    };
    let reload = |http: &str| -> Result<()> {
        let tmp = m.cfg_path.with_extension("tmp");
        std::fs::write(&tmp, format!("{}{}", m.base, DR.replace("HTTP", http)))?;
        std::fs::rename(&tmp, &m.cfg_path)?;
        Ok(())
    };
    let mut c = m.h1().await?;
    // Without a rule: kept connections, at most one per endpoint (3 pods).
    let before = accepted();
    for _ in 0..12 {
        assert_eq!(c.get("/").await?.status, 200);
    }
    assert!(
        accepted() - before <= 3,
        "{} connections",
        accepted() - before
    );

    // maxRequestsPerConnection: 1 (Istio: keep-alive off): one connection per request.
    reload("{maxRequestsPerConnection: 1}")?;
    m.waypoint
        .wait_log("config reloaded", Duration::from_secs(5))?;
    let before = accepted();
    for _ in 0..12 {
        assert_eq!(c.get("/").await?.status, 200);
    }
    assert_eq!(accepted() - before, 12, "{}", m.log());
    // The same for HTTP/2 upstream (the client's protocol): a connection per stream.
    let h2 = mesh_tests::http_app::H2Client::connect(
        m.client(),
        format!("{ECHO_VIP}:80").parse()?,
        "echo.default.svc.cluster.local",
    )
    .await?;
    let before = accepted();
    for _ in 0..6 {
        let r = h2.request("GET", "/", &[], bytes::Bytes::new()).await?;
        assert_eq!(r.status, 200);
    }
    assert_eq!(accepted() - before, 6, "{}", m.log());

    // idleTimeout: a connection idle past it is not used again (closed); within it, kept.
    reload("{idleTimeout: 300ms}")?;
    wait_reloads(&m, 2)?;
    for _ in 0..6 {
        assert_eq!(c.get("/").await?.status, 200);
    }
    let before = accepted();
    for _ in 0..6 {
        assert_eq!(c.get("/").await?.status, 200);
    }
    assert!(accepted() - before <= 3, "kept within the idle timeout");
    // The behaviour under test is a timeout: let it pass.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before = accepted();
    assert_eq!(c.get("/").await?.status, 200);
    assert_eq!(accepted() - before, 1, "an idle connection was reused");
    Ok(())
}

/// Waits for the `n`th "config reloaded" line of the waypoint's log.
fn wait_reloads(m: &L7Mesh, n: usize) -> Result<()> {
    mesh_tests::netsim::wait_for("config reloads", Duration::from_secs(5), || {
        m.log().matches("config reloaded").count() >= n
    })
}
