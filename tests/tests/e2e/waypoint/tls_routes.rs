//! Issue 41 item 2: TLS and TCP routing in the waypoint as Istio's waypoint does it, with
//! real peers: curl and raw TCP clients, nginx serving TLS with a certificate of each
//! backend pod's own (from a test CA the mesh knows nothing of), Python-free.
//!
//! - VirtualService `tls`: a client's TLS to `web:443` reaches the backend un-terminated
//!   (curl verifies the backend pod's certificate against the test CA; nginx reports the
//!   SNI it got), split by weight between two backends; `tcp`: port 9000 goes to a
//!   subset; TLSRoute on `store`.
//! - Hostile, asserting what Istio's waypoint does: an SNI naming another namespace's
//!   service changes nothing (the route is chosen by config, the SNI passes through as
//!   sent); a `tls` rule whose `sniHosts` names another host is skipped (`shop`'s
//!   connections stay on `shop`); bytes that are not TLS are relayed as they are (nginx
//!   refuses them: Envoy's `tls_not_found` passes them on); a client silent or stalled
//!   in its ClientHello is closed after 15 s (Envoy's listener filter timeout) and an
//!   endless ClientHello after 64 KiB, while other connections keep being served.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mesh_tests::netsim::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WEB: &str = "10.96.0.60";
const SHOP: &str = "10.96.0.63";
const STORE: &str = "10.96.0.64";
const OTHER: &str = "10.96.0.65";

/// A CA and one server certificate per backend pod (CN = the pod), each valid for every
/// service name the test dials.
struct Pki {
    dir: std::path::PathBuf,
}

impl Pki {
    fn new(dir: std::path::PathBuf, pods: &[&str], names: &[&str]) -> Result<Pki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        std::fs::create_dir_all(&dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "tls routes test CA");
        let ca_cert = ca.self_signed(&ca_key)?;
        std::fs::write(dir.join("ca.pem"), ca_cert.pem())?;
        let issuer = Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key)?;
        for pod in pods {
            let key = KeyPair::generate()?;
            let mut p =
                CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
            p.distinguished_name.push(DnType::CommonName, *pod);
            let cert = p.signed_by(&key, &issuer)?;
            std::fs::write(dir.join(format!("{pod}.pem")), cert.pem())?;
            std::fs::write(dir.join(format!("{pod}-key.pem")), key.serialize_pem())?;
        }
        Ok(Pki { dir })
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}

const L7: &str = r#"destinationRules:
- {name: web, namespace: default, host: web.default.svc.cluster.local, subsets: [{name: v2, labels: {version: v2}}]}
virtualServices:
- name: web
  namespace: default
  hosts: [web.default.svc.cluster.local, other.other-ns.svc.cluster.local]
  tls:
  - match: [{sniHosts: [other.other-ns.svc.cluster.local]}]
    route: [{destination: {host: other.other-ns.svc.cluster.local}}]
  - match: [{sniHosts: [web.default.svc.cluster.local], port: 443}]
    route: [{destination: {host: web-v1}, weight: 50}, {destination: {host: web-v2, port: {number: 443}}, weight: 50}]
  tcp:
  - match: [{port: 9000}]
    route: [{destination: {host: web, subset: v2, port: {number: 9000}}}]
- name: shop
  namespace: default
  hosts: [shop.default.svc.cluster.local, other.other-ns.svc.cluster.local]
  tls:
  - match: [{sniHosts: [other.other-ns.svc.cluster.local]}]
    route: [{destination: {host: other.other-ns.svc.cluster.local}}]
tlsRoutes:
- {name: store-elsewhere, namespace: default, hostnames: [elsewhere.example.com], parentRefs: [{group: "", kind: Service, name: store, port: 443}],
   rules: [{backendRefs: [{name: other, namespace: other-ns, port: 443}]}]}
- {name: store, namespace: default, hostnames: [store.default.svc.cluster.local], parentRefs: [{group: "", kind: Service, name: store, port: 443}],
   rules: [{backendRefs: [{name: web-v2, port: 443}]}]}
"#;

/// The mesh: client n1p1, waypoint n1p2; web's pods n1p3 (v2), n2p1 and n2p2 (v1);
/// n2p3 is `other` in namespace other-ns. Every backend pod runs nginx with TLS on
/// 8443 (answering with its name and the SNI it got) and an echo server on 9000.
fn mesh_config(topo: &Topology) -> String {
    let wp_ip = topo.pod("n1p2").ip;
    let web = "default/web.default.svc.cluster.local: {443: 8443, 9000: 9000}";
    let svc = |name: &str, ns: &str, vip: &str, ports: &str, extra: &str| {
        format!("- {{name: {name}, namespace: {ns}, hostname: {name}.{ns}.svc.cluster.local, vips: [\"/{vip}\"], ports: {{{ports}}}{extra}}}\n")
    };
    let wp = format!(", waypoint: {{destination: \"/{wp_ip}\"}}");
    let tls = |p: &str| format!(", appProtocols: {{{p}}}{wp}");
    format!(
        "workloads:\n{}{}{}{}{}{}services:\n{}{}{}{}{}{}",
        workload(topo, "n1p1", "client", ""),
        waypoint_workload(topo, "n1p2", "waypoint", ""),
        workload(topo, "n1p3", "web", &format!(", services: {{{web}, default/web-v2.default.svc.cluster.local: {{443: 8443, 9000: 9000}}}}, labels: {{app: web, version: v2}}")),
        workload(topo, "n2p1", "web", &format!(", services: {{{web}, default/web-v1.default.svc.cluster.local: {{443: 8443}}, default/shop.default.svc.cluster.local: {{443: 8443}}}}, labels: {{app: web, version: v1}}")),
        workload(topo, "n2p2", "web", &format!(", services: {{{web}, default/web-v1.default.svc.cluster.local: {{443: 8443}}, default/store.default.svc.cluster.local: {{443: 8443}}}}, labels: {{app: web, version: v1}}")),
        workload(topo, "n2p3", "other", ", services: {other-ns/other.other-ns.svc.cluster.local: {443: 8443}}"),
        svc("web", "default", WEB, "443: 8443, 9000: 9000", &tls("443: TLS, 9000: TCP")),
        svc("web-v1", "default", "10.96.0.61", "443: 8443", ""),
        svc("web-v2", "default", "10.96.0.62", "443: 8443, 9000: 9000", ""),
        svc("shop", "default", SHOP, "443: 8443", &tls("443: TLS")),
        svc("store", "default", STORE, "443: 8443", &tls("443: TLS")),
        svc("other", "other-ns", OTHER, "443: 8443", ""),
    )
}

/// Reads until the peer closes (or resets); how long that took. Fails after `limit`.
async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> Result<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .context("the connection was not closed")?;
    Ok(start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_passes_through_by_vs_tls_and_tls_routes_and_tcp_routes_by_port() -> Result<()> {
    for tool in ["nginx", "curl"] {
        anyhow::ensure!(
            sh("sh", &["-c", &format!("command -v {tool}")]).is_ok(),
            "{tool} is needed (scripts/deps.sh installs it)"
        );
    }
    let topo = Topology::build(&prefix("tlsr"), &[3, 3])?;
    let cfg = format!("{}{L7}", mesh_config(&topo));
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n1p3", "n2p1", "n2p2", "n2p3"],
        &HashMap::new(),
        &[],
    )?;
    let t = &mesh.topo;
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, &cfg)?;
    let waypoint = super::start_waypoint(t, "n1p2", &cfg_path, "waypoint.log")?;
    let log = || waypoint.log_text();
    let names = [
        "web.default.svc.cluster.local",
        "shop.default.svc.cluster.local",
        "store.default.svc.cluster.local",
        "other.other-ns.svc.cluster.local",
    ];
    let backends = ["n1p3", "n2p1", "n2p2", "n2p3"];
    let pki = Pki::new(t.dir.join("pki"), &backends, &names)?;
    let mut servers = Vec::new();
    for pod in backends {
        let (cert, key) = (
            pki.path(&format!("{pod}.pem")),
            pki.path(&format!("{pod}-key.pem")),
        );
        let conf = format!(
            "server {{ listen 8443 ssl; ssl_certificate {cert}; ssl_certificate_key {key}; \
             location / {{ return 200 \"pod={pod} sni=$ssl_server_name\\n\"; }} }}"
        );
        servers.push(super::start_nginx_in(
            &t.pod(pod).netns,
            &t.dir.join(format!("nginx-{pod}")),
            &conf,
            &[8443],
        )?);
    }
    let _echo: Vec<EchoServer> = ["n1p3", "n2p1", "n2p2"]
        .iter()
        .map(|p| EchoServer::start(&t.pod(p).netns, 9000, Some(p)))
        .collect::<Result<_>>()?;
    let client = &t.pod("n1p1").netns;
    let ca = pki.path("ca.pem");
    // curl's TLS to `name` at `vip`:443, the certificate checked against the test CA:
    // nginx's answer, "pod=<backend> sni=<what it got>".
    let curl = |name: &str, vip: &str| -> Result<String> {
        client
            .exec(
                "curl",
                &[
                    "-sS",
                    "--max-time",
                    "10",
                    "--cacert",
                    &ca,
                    "--resolve",
                    &format!("{name}:443:{vip}"),
                    &format!("https://{name}/"),
                ],
            )
            .with_context(log)
    };

    // VS tls with the service's own sniHost: the backend's certificate, the SNI as sent,
    // 50/50 between web-v1 (n2p1, n2p2) and web-v2 (n1p3).
    let mut seen = BTreeSet::new();
    for i in 0..30 {
        let out = curl(names[0], WEB)?;
        let pod = out
            .strip_prefix("pod=")
            .and_then(|r| r.split_whitespace().next())
            .with_context(|| format!("{out:?}"))?
            .to_string();
        assert!(
            out.trim_end().ends_with(&format!("sni={}", names[0])),
            "{i}: {out}"
        );
        assert_ne!(pod, "n2p3", "{i}: {out}");
        seen.insert(pod);
    }
    assert!(
        seen.contains("n1p3") && (seen.contains("n2p1") || seen.contains("n2p2")),
        "weights 50/50 over 30 connections reached only {seen:?}"
    );

    // Hostile SNI: naming another namespace's service changes nothing. The route is
    // web's (Istio's waypoint chooses it by config, never by the ClientHello) and the
    // backend gets the SNI as the client sent it.
    for _ in 0..6 {
        let out = curl(names[3], WEB)?;
        assert!(
            out.starts_with("pod=n1p3")
                || out.starts_with("pod=n2p1")
                || out.starts_with("pod=n2p2"),
            "{out}"
        );
        assert!(
            out.trim_end().ends_with(&format!("sni={}", names[3])),
            "{out}"
        );
    }
    // The other service itself is n2p3 (what a misroute would have reached).
    assert!(curl(names[3], OTHER)?.starts_with("pod=n2p3"));
    // A tls rule whose sniHosts is not the service's own is skipped, as Istio's waypoint
    // skips it: shop's connections go to shop's own endpoint, whatever the SNI.
    for name in [names[1], names[3]] {
        let out = curl(name, SHOP)?;
        assert!(out.starts_with("pod=n2p1"), "{name}: {out}");
    }
    // TLSRoute: the one whose hostnames are store's own applies (to web-v2); the one
    // for elsewhere.example.com does not.
    for _ in 0..4 {
        let out = curl(names[2], STORE)?;
        assert!(out.starts_with("pod=n1p3"), "{out}");
    }

    // VS tcp on port 9000: the subset v2 (n1p3), every connection, bytes as sent.
    for i in 0..8 {
        let mut s = client.connect(format!("{WEB}:9000").parse()?).await?;
        let out = String::from_utf8(echo_roundtrip(&mut s, b"over tcp\n").await?)?;
        assert_eq!(out, "n1p3\nover tcp\n", "connection {i}\n{}", log());
    }

    // Not TLS on the TLS port: relayed as it is (Envoy's tls_not_found), so nginx gets
    // plain HTTP on its TLS port, answers 400 and closes.
    let mut s = client.connect(format!("{WEB}:443").parse()?).await?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: web\r\n\r\n").await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
        .await
        .context("not closed")??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400")
            && answer.contains("plain HTTP request was sent to HTTPS port"),
        "{answer}"
    );

    // An endless ClientHello (1-byte handshake records): closed after 64 KiB, at once.
    let mut flood = client.connect(format!("{WEB}:443").parse()?).await?;
    let mut bytes = b"\x16\x03\x01\x00\x04\x01\x00\x3f\xff".to_vec();
    while bytes.len() < 70 * 1024 {
        bytes.extend(b"\x16\x03\x01\x00\x01\x00");
    }
    // The waypoint may close before every byte is written: a write error is fine.
    let _ = flood.write_all(&bytes).await;
    let took = closed_within(&mut flood, Duration::from_secs(10)).await?;
    assert!(took < Duration::from_secs(5), "took {took:?}");

    // Silent, and stalled in the record header: closed at Envoy's 15 s, not before,
    // while other connections go on being served.
    let mut silent = client.connect(format!("{WEB}:443").parse()?).await?;
    let mut stalled = client.connect(format!("{WEB}:443").parse()?).await?;
    stalled.write_all(b"\x16\x03\x01\x02\x00\x01").await?;
    let start = Instant::now();
    for _ in 0..3 {
        assert!(curl(names[0], WEB)?.starts_with("pod="));
    }
    let (a, b) = tokio::join!(
        closed_within(&mut silent, Duration::from_secs(30)),
        closed_within(&mut stalled, Duration::from_secs(30))
    );
    let (a, b) = (a?, b?);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(12) && waited < Duration::from_secs(25),
        "closed after {waited:?} ({a:?}, {b:?})"
    );
    wait_for("the closes logged", Duration::from_secs(5), || {
        log().matches("no whole TLS ClientHello").count() >= 3
    })?;
    assert!(
        log().contains(&format!("sni=\"{}\"", names[3]))
            || log().contains(&format!("sni={}", names[3])),
        "{}",
        log()
    );
    drop(servers);
    Ok(())
}
