//! One waypoint shared by tenants (issue 39): another namespace's objects must not
//! capture or weaken a tenant's traffic. A tenant's Service squatting the authorizer's
//! hostname, or the same external hostname in two namespaces, never receives the checks;
//! a tenant's `host: "*"` DestinationRule never throttles other Services.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use mesh_tests::http_app;
use mesh_tests::netsim::*;

use super::{custom_policy, L7Mesh};

/// The real authorizer (`default/authz`, endpoint n2p1) and what tenants declare: `evil`
/// squats its `.svc` hostname and shares `authz.example.com` with `sec`, neither with an
/// endpoint that answers.
const TENANT_SERVICES: &str = "\
- {name: squat, namespace: evil, hostname: authz.default.svc.cluster.local, vips: [\"/10.96.0.31\"], ports: {8000: 8000}}\n\
- {name: ext, namespace: evil, hostname: authz.example.com, vips: [\"/10.96.0.32\"], ports: {8000: 8000}}\n\
- {name: ext, namespace: sec, hostname: authz.example.com, vips: [\"/10.96.0.33\"], ports: {8000: 8000}}\n";

const PROVIDERS: &str = "meshConfig:\n  extensionProviders:\n\
\x20 - {name: svc, envoyExtAuthzHttp: {service: authz.default.svc.cluster.local, port: 8000, pathPrefix: /check, includeRequestHeadersInCheck: [x-ext-authz]}}\n\
\x20 - {name: bare, envoyExtAuthzHttp: {service: authz.example.com, port: 8000, timeout: 2s}}\n";

/// A tenant's `host: "*"` DestinationRule with `http2MaxRequests: 1`, in a namespace
/// that sorts first and is listed first.
const THROTTLE: &str = "destinationRules:\n\
- {name: throttle, namespace: aaa-tenant, host: \"*\", trafficPolicy: {connectionPool: {http: {http2MaxRequests: 1}}}}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_objects_neither_capture_nor_throttle_traffic() -> Result<()> {
    use mesh_tests::test_servers::{start_http_authorizer, Checks};
    let l7 = format!("{PROVIDERS}{THROTTLE}{}", custom_policy("svc"));
    let m = L7Mesh::start_with("wten", &l7, &[], "", TENANT_SERVICES).await?;
    let checks = Checks::default();
    let _h = start_http_authorizer(m.mesh.topo.pod("n2p1"), 8000, checks.clone())?;
    let mut c = m.h1().await?;

    // The `.svc` hostname is default's: every check reaches the real authorizer (in hash
    // order the squatter's entry, with no endpoint, was picked for some).
    for i in 0..10 {
        let r = c
            .request("GET", &format!("/private/{i}"), &[("x-ext-authz", "allow")])
            .await?;
        assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    }
    assert_eq!(checks.lock().unwrap().len(), 10);

    // The tenant's throttle does not apply: a slow request in flight, others pass.
    let mut slow = m.h1().await?;
    let in_flight = tokio::spawn(async move { slow.get("/delay/1500").await });
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = c.get("/x").await?;
        assert_eq!(r.status, 200, "{r:?}\n{}", m.log());
    }
    assert_eq!(in_flight.await??.status, 200);
    assert!(!m.log().contains("response_flags=\"UO\""), "{}", m.log());

    // A bare hostname two namespaces declare: refused (statusOnError, 403), and the dump says why.
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(
        &tmp,
        format!("{}{PROVIDERS}{}", m.base, custom_policy("bare")),
    )?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    wait_for("config reloaded", Duration::from_secs(5), || {
        m.log().contains("config reloaded")
    })?;
    let r = c
        .request("GET", "/private", &[("x-ext-authz", "allow")])
        .await?;
    assert_eq!(r.status, 403, "{r:?}\n{}", m.log());
    assert_eq!(c.request("GET", "/public", &[]).await?.status, 200);
    let admin: SocketAddr = "127.0.0.1:15000".parse()?;
    let mut a =
        http_app::H1Client::connect(&m.mesh.topo.pod("n1p2").netns, admin, "localhost").await?;
    let d: serde_json::Value = serde_json::from_str(&a.get("/config_dump").await?.body)?;
    let why = d["extensionProviders"]["bare"]["service"]["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        why.contains("multiple namespaces") && why.contains("evil") && why.contains("sec"),
        "{}",
        d["extensionProviders"]
    );
    Ok(())
}
