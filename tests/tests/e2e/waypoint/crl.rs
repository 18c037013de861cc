//! CRL_PATH in the waypoint, as in ztunnel: a client whose certificate a CRL revokes is
//! refused at the handshake and its open connection closed on reload; an upstream
//! whose certificate is revoked is not dialed, and a pooled connection to it is closed.
//! (Before, the waypoint read no CRL: a peer ztunnel refuses was served through it.)

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use mesh_tests::crl::{cert_serial, write_crl};
use mesh_tests::netsim::*;
use tokio::io::AsyncReadExt;

use super::start_waypoint_with;

const VIP: &str = "10.96.0.10:80";

/// Whether a connection is cut (EOF or reset) within 5 s; a hang is not.
async fn is_cut(s: &mut tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 16];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waypoint_refuses_peers_its_crl_revokes() -> Result<()> {
    let topo = Topology::build(&prefix("wcrl"), &[2, 1])?;
    let wp_ip = topo.pod("n1p2").ip;
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/{}\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n",
        workload(&topo, "n1p1", "client", ""),
        waypoint_workload(&topo, "n1p2", "waypoint", ""),
        workload(&topo, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}}"),
        VIP.trim_end_matches(":80"),
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let t = &mesh.topo;
    let crl = t.dir.join("ca-crl.pem");
    let crl_arg = crl.display().to_string();
    let cfg_path = t.dir.join("mesh-node1.yaml");
    // The file appears only after the start (Istio's chart mounts it as optional).
    let waypoint = start_waypoint_with(
        t,
        "n1p2",
        &cfg_path,
        "waypoint.log",
        &["--crl-path", &crl_arg],
    )?;
    let _echo = EchoServer::start(&t.pod("n2p1").netns, 8080, None)?;
    let client = t.pod("n1p1");
    let roundtrip = |what: &'static str| async move {
        let mut s = client.netns.connect(VIP.parse()?).await?;
        echo_roundtrip(&mut s, what.as_bytes()).await
    };
    assert_eq!(roundtrip("no CRL yet").await?, b"no CRL yet");
    let ca_dir = t.dir.join("ca");
    let ca = ztunnel::identity::ca::Ca::from_files(
        &ca_dir.join("ca-cert.pem"),
        &ca_dir.join("ca-key.pem"),
    )?;
    let admin = "127.0.0.1:15000".parse()?;
    let client_serial = cert_serial(
        t.node(1),
        admin,
        "spiffe://cluster.local/ns/default/sa/client",
    )
    .await?;
    let echo_serial = cert_serial(
        t.node(2),
        admin,
        "spiffe://cluster.local/ns/default/sa/echo",
    )
    .await?;
    let reloads = || {
        waypoint
            .log_text()
            .matches("reloaded certificate revocation lists")
            .count()
    };
    let ttl = Duration::from_secs(3600);
    let refused = |what: &'static str| async move {
        let r = tokio::time::timeout(Duration::from_secs(10), roundtrip(what)).await?;
        assert!(
            r.as_ref().map(|v| v.is_empty()).unwrap_or(true),
            "{what}: got through the waypoint: {r:?}"
        );
        anyhow::Ok(())
    };

    // A CRL revoking nobody we know: an open tunnel stays open across the reload.
    let mut open = client.netns.connect(VIP.parse()?).await?;
    assert_eq!(echo_roundtrip_open(&mut open, b"before").await?, b"before");
    write_crl(&crl, &ca.revocation_list(&["0badc0de"], 1, ttl)?)?;
    wait_for(
        "the waypoint to load the first CRL",
        Duration::from_secs(10),
        || reloads() >= 1,
    )?;
    assert_eq!(
        echo_roundtrip_open(&mut open, b"after").await?,
        b"after",
        "a reload that revokes no peer cut the tunnel"
    );

    // The client's certificate revoked: the waypoint closes its open connection and
    // refuses its next handshake.
    write_crl(
        &crl,
        &ca.revocation_list(&["0badc0de", &client_serial], 2, ttl)?,
    )?;
    wait_for(
        "the CRL revoking the client",
        Duration::from_secs(10),
        || reloads() >= 2,
    )?;
    assert!(
        is_cut(&mut open).await,
        "the tunnel from a revoked client stayed open at the waypoint"
    );
    wait_for(
        "the waypoint to close the revoked client's connection",
        Duration::from_secs(5),
        || {
            waypoint
                .log_text()
                .contains("closing an HBONE connection: the peer's certificate is revoked")
        },
    )?;
    refused("from a revoked client").await?;

    // Un-revoked, traffic flows; then the backend's certificate revoked: the waypoint
    // closes its pooled connection to it and dials no new one.
    write_crl(&crl, &ca.revocation_list(&["0badc0de"], 3, ttl)?)?;
    wait_for(
        "the CRL un-revoking the client",
        Duration::from_secs(10),
        || reloads() >= 3,
    )?;
    let mut open = client.netns.connect(VIP.parse()?).await?;
    assert_eq!(echo_roundtrip_open(&mut open, b"again").await?, b"again");
    write_crl(&crl, &ca.revocation_list(&[&echo_serial], 4, ttl)?)?;
    wait_for(
        "the CRL revoking the backend",
        Duration::from_secs(10),
        || reloads() >= 4,
    )?;
    assert!(
        is_cut(&mut open).await,
        "the tunnel to a revoked backend stayed open at the waypoint"
    );
    wait_for(
        "the waypoint to close its pooled connection to the revoked backend",
        Duration::from_secs(5),
        || {
            waypoint
                .log_text()
                .contains("closing a pooled HBONE connection: the server's certificate is revoked")
        },
    )?;
    refused("to a revoked backend").await?;
    Ok(())
}

/// One echo exchange on a connection that stays open.
async fn echo_roundtrip_open(s: &mut tokio::net::TcpStream, data: &[u8]) -> Result<Vec<u8>> {
    tokio::io::AsyncWriteExt::write_all(s, data).await?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await??;
    Ok(back)
}
