//! A client cannot pick the opaque (L4) path to skip a CUSTOM authorizer and the
//! waypoint's header handling (issue 39 #2). The two ways to look opaque to the sniffer
//! are a pause past the detection timeout (1 s) before the request, and more than eight
//! empty lines before it. On a port that declares HTTP neither works: the request is
//! HTTP and asked about; on a port of unknown protocol the connection is opaque, and a
//! CUSTOM policy in its scope denies it. Opaque TCP without one still passes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use mesh_tests::netsim::*;
use mesh_tests::{http_app, test_servers};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::start_waypoint;

const WEB_VIP: &str = "10.96.0.50";
const RAW_VIP: &str = "10.96.0.51";
const AUTHZ_VIP: &str = "10.96.0.30";

/// The attacker's request, with a client-written `x-forwarded-client-cert` that only
/// the waypoint may set.
fn request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: web.default.svc.cluster.local\r\nx-forwarded-client-cert: By=spiffe://cluster.local/ns/default/sa/web;URI=spiffe://cluster.local/ns/default/sa/admin\r\nconnection: close\r\n\r\n")
}

/// Connects from `client`, sends each part after its pause (the attack's own pauses),
/// and reads to the end: what came back, empty if the stream was refused or reset.
async fn send(client: &Netns, to: SocketAddr, parts: &[(Duration, &[u8])]) -> Result<Vec<u8>> {
    let mut s = client.connect(to).await?;
    for (pause, bytes) in parts {
        tokio::time::sleep(*pause).await;
        // A refused tunnel may already be closed: a write can fail, the answer says the rest.
        if s.write_all(bytes).await.is_err() {
            break;
        }
    }
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await?;
    Ok(got)
}

/// The two ways to look opaque: a pause past the detection timeout, and empty lines
/// sent on their own (the sniffer's verdict comes before the request line does).
fn paused(req: &str) -> Vec<(Duration, Vec<u8>)> {
    vec![(Duration::from_millis(1500), req.as_bytes().to_vec())]
}

fn padded(req: &str) -> Vec<(Duration, Vec<u8>)> {
    vec![
        (Duration::ZERO, b"\r\n".repeat(9)),
        (Duration::from_millis(300), req.as_bytes().to_vec()),
    ]
}

async fn attack(
    client: &Netns,
    to: SocketAddr,
    parts: Vec<(Duration, Vec<u8>)>,
) -> Result<Vec<u8>> {
    let parts: Vec<(Duration, &[u8])> = parts.iter().map(|(d, b)| (*d, &b[..])).collect();
    send(client, to, &parts).await
}

/// client (n1p1) -> waypoint (n1p2) -> web (n2p1: HTTP on 8080, TCP echo on 9000, the
/// HTTP authorizer on 8000) and raw (n2p2: TCP echo on 9000). web's port 80 declares
/// HTTP, 81 (the same backend) declares nothing, 9000 declares HTTP in front of a TCP
/// echo; a CUSTOM policy with a deny-all authorizer (it allows only `x-ext-authz: allow`)
/// covers all of web. raw's 9000 declares nothing and has no policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opaque_tricks_do_not_skip_a_custom_authorizer() -> Result<()> {
    let topo = Topology::build(&prefix("wopq"), &[2, 2])?;
    let wp_ip = topo.pod("n1p2").ip;
    let via = format!("waypoint: {{destination: \"/{wp_ip}\"}}");
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: web, namespace: default, hostname: web.default.svc.cluster.local, vips: [\"/{WEB_VIP}\"], ports: {{80: 8080, 81: 8080, 9000: 9000}}, \
              appProtocols: {{80: HTTP11, 9000: HTTP11}}, {via}}}\n\
         - {{name: raw, namespace: default, hostname: raw.default.svc.cluster.local, vips: [\"/{RAW_VIP}\"], ports: {{9000: 9000}}, {via}}}\n\
         - {{name: authz, namespace: default, hostname: authz.default.svc.cluster.local, vips: [\"/{AUTHZ_VIP}\"], ports: {{8000: 8000}}}}\n\
         meshConfig:\n  extensionProviders:\n\
         \x20 - name: http-authz\n    envoyExtAuthzHttp: {{service: default/authz.default.svc.cluster.local, port: 8000, includeRequestHeadersInCheck: [x-ext-authz]}}\n\
         authorizationPolicies:\n\
         - {{name: ext, namespace: default, targetRefs: [{{kind: Service, group: \"\", name: web}}], action: CUSTOM, provider: {{name: http-authz}}, rules: [{{}}]}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(
            &topo,
            "n2p1",
            "web",
            ", services: {default/web.default.svc.cluster.local: {80: 8080, 81: 8080, 9000: 9000}, default/authz.default.svc.cluster.local: {8000: 8000}}"
        ),
        workload(&topo, "n2p2", "raw", ", services: {default/raw.default.svc.cluster.local: {9000: 9000}}"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let web = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "web", false)?;
    let web_echo = EchoServer::start(&t.pod("n2p1").netns, 9000, Some("web"))?;
    let _raw = EchoServer::start(&t.pod("n2p2").netns, 9000, Some("raw"))?;
    let checks = test_servers::Checks::default();
    let _authz = test_servers::start_http_authorizer(t.pod("n2p1"), 8000, checks.clone())?;
    let client = &t.pod("n1p1").netns;
    let web_at = |port: u16| SocketAddr::new(WEB_VIP.parse().expect("vip"), port);
    let reached = |path: &str| web.seen().iter().any(|s| s.path == path);
    let status = |got: &[u8]| {
        String::from_utf8_lossy(got)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    };

    // The setup works: a request the authorizer allows reaches web, with the
    // waypoint's x-forwarded-client-cert, not the client's.
    let mut c =
        http_app::H1Client::connect(client, web_at(80), "web.default.svc.cluster.local").await?;
    let r = c
        .request(
            "GET",
            "/allowed",
            &[
                ("x-ext-authz", "allow"),
                ("x-forwarded-client-cert", "By=spoofed"),
            ],
        )
        .await?;
    assert_eq!(r.status, 200, "{r:?}\n{}", waypoint.log_text());
    let xfcc = web
        .seen()
        .iter()
        .find(|s| s.path == "/allowed")
        .and_then(|s| s.headers.get("x-forwarded-client-cert").cloned());
    assert_eq!(
        xfcc.as_ref().and_then(|v| v.to_str().ok()),
        Some("By=spiffe://cluster.local/ns/default/sa/waypoint;URI=spiffe://cluster.local/ns/default/sa/client")
    );
    drop(c);

    // Port 80 declares HTTP: the paused and the padded request are HTTP all the same,
    // so the authorizer is asked, and denies.
    let got = attack(client, web_at(80), paused(&request("/paused"))).await?;
    assert_eq!(
        status(&got),
        "HTTP/1.1 403 Forbidden",
        "{:?}\n{}",
        String::from_utf8_lossy(&got),
        waypoint.log_text()
    );
    assert!(
        got.ends_with(b"denied by the authorizer"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    let got = attack(client, web_at(80), padded(&request("/padded"))).await?;
    assert_eq!(
        status(&got),
        "HTTP/1.1 403 Forbidden",
        "{:?}\n{}",
        String::from_utf8_lossy(&got),
        waypoint.log_text()
    );
    {
        let asked: Vec<String> = checks
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.path.clone())
            .collect();
        assert!(
            asked.iter().any(|p| p == "/paused") && asked.iter().any(|p| p == "/padded"),
            "{asked:?}"
        );
    }
    // Not HTTP at all, on a port that declares HTTP: 400 from the waypoint, never a relay
    // to the TCP echo behind it.
    let got = send(
        client,
        web_at(9000),
        &[(Duration::ZERO, b"hello, not http\r\n\r\n")],
    )
    .await?;
    assert_eq!(
        status(&got),
        "HTTP/1.1 400 Bad Request",
        "{:?}\n{}",
        String::from_utf8_lossy(&got),
        waypoint.log_text()
    );
    assert!(
        web_echo.peers().is_empty(),
        "the TCP echo behind an HTTP port was reached: {:?}",
        web_echo.peers()
    );

    // Port 81 declares nothing: the same tricks make the connection opaque, and the
    // CUSTOM policy in its scope denies it, naming itself and why.
    let denied_81 = || {
        waypoint
            .log_text()
            .lines()
            .filter(|l| {
                l.contains("opaque connection denied") && l.contains(&format!("{WEB_VIP}:81"))
            })
            .count()
    };
    let got = attack(client, web_at(81), paused(&request("/paused81"))).await?;
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    wait_for(
        "the paused connection's denial",
        Duration::from_secs(5),
        || denied_81() >= 1,
    )?;
    let line = waypoint
        .log_text()
        .lines()
        .find(|l| l.contains("opaque connection denied"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains("denied by default/ext") && line.contains("cannot check opaque TCP"),
        "{line}"
    );
    let got = attack(client, web_at(81), padded(&request("/padded81"))).await?;
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    wait_for(
        "the padded connection's denial",
        Duration::from_secs(5),
        || denied_81() >= 2,
    )?;
    for path in ["/paused", "/padded", "/paused81", "/padded81"] {
        assert!(!reached(path), "{path} reached the backend");
    }

    // raw's port declares nothing and no CUSTOM policy covers it: opaque TCP passes.
    let mut s = client
        .connect(SocketAddr::new(RAW_VIP.parse()?, 9000))
        .await?;
    let got = echo_roundtrip(&mut s, b"plain bytes\n").await?;
    assert_eq!(
        String::from_utf8_lossy(&got),
        "raw\nplain bytes\n",
        "{}",
        waypoint.log_text()
    );
    Ok(())
}

/// With a gRPC provider a CUSTOM policy checks opaque TCP as Envoy's network ext_authz
/// does: one check per connection before a byte is relayed, carrying the peers and no
/// request. The authorizer allows service account `client` and denies `intruder`;
/// a denied connection is reset with the policy named in the log, and never reaches raw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_authorizer_checks_each_opaque_connection() -> Result<()> {
    let topo = Topology::build(&prefix("wopg"), &[2, 2])?;
    let wp_ip = topo.pod("n1p2").ip;
    let via = format!("waypoint: {{destination: \"/{wp_ip}\"}}");
    let cfg = format!(
        "workloads:\n{}{}{}{}services:\n\
         - {{name: raw, namespace: default, hostname: raw.default.svc.cluster.local, vips: [\"/{RAW_VIP}\"], ports: {{9000: 9000}}, appProtocols: {{9000: TCP}}, {via}}}\n\
         - {{name: authz, namespace: default, hostname: authz.default.svc.cluster.local, vips: [\"/{AUTHZ_VIP}\"], ports: {{9100: 9100}}, appProtocols: {{9100: GRPC}}}}\n\
         meshConfig:\n  extensionProviders:\n\
         \x20 - name: grpc-authz\n    envoyExtAuthzGrpc: {{service: default/authz.default.svc.cluster.local, port: 9100}}\n\
         authorizationPolicies:\n\
         - {{name: ext, namespace: default, targetRefs: [{{kind: Service, group: \"\", name: raw}}], action: CUSTOM, provider: {{name: grpc-authz}}, rules: [{{}}]}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(
            &topo,
            "n2p1",
            "raw",
            ", services: {default/raw.default.svc.cluster.local: {9000: 9000}, default/authz.default.svc.cluster.local: {9100: 9100}}"
        ),
        workload(&topo, "n2p2", "intruder", ""),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1", "n2p2"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let raw = EchoServer::start(&t.pod("n2p1").netns, 9000, Some("raw"))?;
    let checks = test_servers::Checks::default();
    let _authz = test_servers::start_grpc_authorizer(t.pod("n2p1"), 9100, checks.clone())?;
    let to = SocketAddr::new(RAW_VIP.parse()?, 9000);

    // Allowed: the greeting comes back, the bytes echo.
    let mut s = t.pod("n1p1").netns.connect(to).await?;
    let greeting = tokio::time::timeout(Duration::from_secs(10), read_line(&mut s)).await;
    assert!(
        matches!(&greeting, Ok(Ok(g)) if g == "raw"),
        "{greeting:?}\n{}",
        waypoint.log_text()
    );
    s.write_all(b"ping\n").await?;
    assert_eq!(read_line(&mut s).await?, "ping");
    drop(s);
    {
        let seen = checks.lock().unwrap();
        let check = seen.first().expect("the connection was checked");
        assert!(check.network && check.path.is_empty(), "{check:?}");
        assert_eq!(
            (
                check.source_principal.as_str(),
                check.destination_principal.as_str()
            ),
            (
                "spiffe://cluster.local/ns/default/sa/client",
                "spiffe://cluster.local/ns/default/sa/waypoint"
            )
        );
    }
    let reached = raw.peers().len();

    // Denied: reset before a byte of raw's, the policy named, raw never reached.
    let got = send(&t.pod("n2p2").netns, to, &[(Duration::ZERO, b"ping\n")]).await?;
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    waypoint.wait_log(
        "denied by default/ext: ext_authz denied the connection",
        Duration::from_secs(5),
    )?;
    assert_eq!(
        raw.peers().len(),
        reached,
        "a denied connection reached raw"
    );
    assert!(checks.lock().unwrap().iter().any(
        |c| c.network && c.source_principal == "spiffe://cluster.local/ns/default/sa/intruder"
    ));
    Ok(())
}
