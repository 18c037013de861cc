//! Hostile peers against ztunnel, end to end: bad TLS, lying HBONE requests, spoofed
//! sources and HTTP/2 floods. Each is refused and counted, and a victim pod pair keeps
//! its traffic flowing meanwhile (its median latency during each attack is asserted
//! against a baseline and printed; run with `--nocapture` to see it: the numbers are in
//! SECURITY.md).
//!
//! Topology: node1 has n1p1 (a host outside the mesh that speaks HBONE by hand with a
//! mesh certificate for `sa/attacker`) and n1p2 (the victim client, `sa/victim`); node2
//! has n2p1 (server, `sa/server`) and n2p2 (`sa/guarded`, which only `sa/victim` may call).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use mesh_tests::h2_raw::*;
use mesh_tests::netsim::*;
use mesh_tests::{hbone_peer, netsim};
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use ztunnel::identity::Identity;

struct Hostile {
    mesh: Mesh,
    ca: ztunnel::identity::ca::Ca,
    _echo: Vec<EchoServer>,
}

fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "default", sa)
}

impl Hostile {
    fn start(tag: &str) -> Result<Hostile> {
        Hostile::start_with(tag, &[])
    }

    /// With extra ztunnel environment (limits set low for a test).
    fn start_with(tag: &str, env: &[(&str, &str)]) -> Result<Hostile> {
        let topo = Topology::build(&prefix(tag), &[2, 2])?;
        let guarded = ", authorizationPolicies: [default/only-victim]";
        let cfg = format!(
            "workloads:\n{}{}{}policies:\n- {{name: only-victim, namespace: default, scope: WorkloadSelector, action: Allow, rules: [[[{{principals: [{{Exact: cluster.local/ns/default/sa/victim}}]}}]]]}}\n",
            workload(&topo, "n1p2", "victim", ""),
            workload(&topo, "n2p1", "server", ", services: {default/server.default.svc.cluster.local: {80: 8080}}"),
            workload(&topo, "n2p2", "guarded", guarded),
        ) + "services:\n- {name: server, namespace: default, hostname: server.default.svc.cluster.local, vips: [/10.96.0.80], ports: {80: 8080}}\n";
        let mesh = Mesh::start(topo, &cfg, &["n1p2", "n2p1", "n2p2"], &HashMap::new(), env)?;
        let ca = hbone_peer::load_ca(&mesh.topo.dir.join("ca"))?;
        let t = &mesh.topo;
        let echo = vec![
            EchoServer::start(&t.pod("n2p1").netns, 8080, None)?,
            EchoServer::start(&t.pod("n2p2").netns, 8080, None)?,
        ];
        Ok(Hostile {
            mesh,
            ca,
            _echo: echo,
        })
    }

    fn pod_addr(&self, pod: &str, port: u16) -> SocketAddr {
        SocketAddr::new(self.mesh.topo.pod(pod).ip, port)
    }

    fn attacker(&self) -> &netsim::Netns {
        &self.mesh.topo.pod("n1p1").netns
    }

    /// A TLS 1.3 mTLS client config with a mesh certificate for `sa/<sa>`.
    fn mesh_tls(&self, sa: &str, server: &str) -> Result<rustls::ClientConfig> {
        let cert = self.ca.issue(&id(sa), Duration::from_secs(600))?;
        let key = rustls::crypto::ring::sign::any_supported_type(&cert.key)?;
        let ck = rustls::sign::CertifiedKey::new(cert.chain.clone(), key);
        Ok(ztunnel::tls::client_config(
            &ck,
            &[self.ca.root()],
            vec![id(server)],
        )?)
    }

    async fn metrics(&self, node: usize) -> Result<String> {
        let mut s = self
            .mesh
            .topo
            .node(node)
            .connect("127.0.0.1:15020".parse()?)
            .await?;
        s.write_all(b"GET /stats/prometheus HTTP/1.0\r\n\r\n")
            .await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    async fn rejections(&self, reason: &str) -> Result<u64> {
        let text = self.metrics(2).await?;
        let prefix = format!("ztunnel_hbone_rejections_total{{reason=\"{reason}\"}} ");
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }
}

/// Accepts any server certificate: the tests probe the server, not its identity.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &rustls_pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn any_server_config(
    versions: &[&'static rustls::SupportedProtocolVersion],
    cert: Option<(
        Vec<CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    )>,
) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
    Ok(match cert {
        Some((chain, key)) => b.with_client_auth_cert(chain, key)?,
        None => b.with_no_client_auth(),
    })
}

/// A leaf signed by the test mesh CA (files in `state`) with any URI SAN at all.
fn leaf_with_san(
    state: &std::path::Path,
    san: &str,
) -> Result<(
    Vec<CertificateDer<'static>>,
    rustls_pki_types::PrivateKeyDer<'static>,
)> {
    let ca_key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(state.join("ca-key.pem"))?)?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(
        &std::fs::read_to_string(state.join("ca-cert.pem"))?,
        ca_key,
    )?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.subject_alt_names = vec![rcgen::SanType::URI(san.to_string().try_into()?)];
    p.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = p.signed_by(&key, &issuer)?;
    Ok((
        vec![cert.der().clone()],
        rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    ))
}

/// Sends one CONNECT on a raw connection and says whether a 200 came back.
async fn connect_answered_200(h: &mut RawH2, authority: &str) -> bool {
    if h.send(&frame(HEADERS, END_HEADERS, 1, &connect_block(authority)))
        .await
        .is_err()
    {
        return false;
    }
    // HPACK static index 8 is ":status 200", sent as the single byte 0x88.
    h.next_of(HEADERS, Duration::from_secs(3))
        .await
        .is_some_and(|f| f.3.first() == Some(&0x88))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tls_peers_are_refused() -> Result<()> {
    let h = Hostile::start("ha")?;
    let server = h.pod_addr("n2p1", 15008);
    let target = h.pod_addr("n2p1", 8080).to_string();
    let state = h.mesh.topo.dir.join("ca");
    let before = h.rejections("tls_handshake").await?;
    let mesh_leaf = {
        let c = h.ca.issue(&id("attacker"), Duration::from_secs(600))?;
        (c.chain.clone(), c.key.clone_key())
    };
    let attempts: Vec<(&str, rustls::ClientConfig)> = vec![
        (
            "no client certificate",
            any_server_config(&[&rustls::version::TLS13], None)?,
        ),
        (
            "TLS 1.2 only",
            any_server_config(&[&rustls::version::TLS12], Some(mesh_leaf))?,
        ),
        (
            "another trust domain",
            any_server_config(
                &[&rustls::version::TLS13],
                Some(leaf_with_san(
                    &state,
                    "spiffe://evil.local/ns/default/sa/victim",
                )?),
            )?,
        ),
        (
            "a SAN with an embedded NUL",
            any_server_config(
                &[&rustls::version::TLS13],
                Some(leaf_with_san(
                    &state,
                    "spiffe://cluster.local/ns/default/sa/victim\0.evil",
                )?),
            )?,
        ),
        (
            "a SAN that is no SPIFFE id",
            any_server_config(
                &[&rustls::version::TLS13],
                Some(leaf_with_san(&state, "https://cluster.local/victim")?),
            )?,
        ),
    ];
    for (what, cfg) in attempts {
        let answered = match RawH2::connect(h.attacker(), server, cfg).await {
            Ok(mut raw) => connect_answered_200(&mut raw, &target).await,
            Err(_) => false,
        };
        assert!(!answered, "{what}: the tunnel was opened");
    }
    wait_for_async("TLS refusals counted", || async {
        Ok(h.rejections("tls_handshake").await? >= before + 5)
    })
    .await?;
    // A proper mesh peer on the same path works.
    let mut raw = RawH2::connect(h.attacker(), server, h.mesh_tls("attacker", "server")?).await?;
    assert!(
        connect_answered_200(&mut raw, &target).await,
        "a valid mesh client was refused"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_hbone_requests_are_refused() -> Result<()> {
    let h = Hostile::start("hb")?;
    let attacker = id("attacker");
    let n2p1 = hbone_peer::connect(
        h.attacker(),
        &h.ca,
        &attacker,
        id("server"),
        h.pod_addr("n2p1", 15008),
    )
    .await?;
    let bad = |a: SocketAddr| hbone_peer::connect_req(&a.to_string());
    let before = h.rejections("bad_request").await?;
    // The CONNECT target must be the pod the connection reached, never a proxy port, never
    // a pod elsewhere.
    assert_eq!(
        hbone_peer::status(&n2p1, bad(h.pod_addr("n2p2", 8080))).await?,
        400,
        "another pod on the node"
    );
    assert_eq!(
        hbone_peer::status(&n2p1, bad(h.pod_addr("n1p2", 8080))).await?,
        400,
        "a pod on another node"
    );
    assert_eq!(
        hbone_peer::status(&n2p1, bad(h.pod_addr("n2p1", 15001))).await?,
        400,
        "the proxy's own port"
    );
    assert_eq!(
        hbone_peer::status(&n2p1, hbone_peer::connect_req("echo.default.svc:8080")).await?,
        400,
        "a hostname"
    );
    // A service's hostname (double HBONE's target) reaches only a pod of that service,
    // on the port the service maps it to; a network claim changes nothing of that.
    let (status, back) =
        hbone_peer::roundtrip(&n2p1, "server.default.svc.cluster.local:80", b"by name").await?;
    assert_eq!((status.as_u16(), back.as_slice()), (200, &b"by name"[..]));
    let n2p2_as_server = hbone_peer::connect(
        h.attacker(),
        &h.ca,
        &attacker,
        id("guarded"),
        h.pod_addr("n2p2", 15008),
    )
    .await?;
    let other_pods_service = http::Request::builder()
        .method("CONNECT")
        .uri("server.default.svc.cluster.local:80")
        .header("x-forwarded-network", "elsewhere")
        .body(())?;
    assert_eq!(
        hbone_peer::status(&n2p2_as_server, other_pods_service).await?,
        400,
        "another pod's service"
    );
    assert_eq!(
        hbone_peer::status(
            &n2p1,
            hbone_peer::connect_req("server.default.svc.cluster.local:81")
        )
        .await?,
        400,
        "a port the service does not have"
    );
    wait_for_async("bad requests counted", || async {
        Ok(h.rejections("bad_request").await? >= before + 6)
    })
    .await?;

    // Headers claiming to be the victim change nothing: identity comes from the certificate.
    let n2p2 = hbone_peer::connect(
        h.attacker(),
        &h.ca,
        &attacker,
        id("guarded"),
        h.pod_addr("n2p2", 15008),
    )
    .await?;
    let victim_ip = h.mesh.topo.pod("n1p2").ip;
    let lying = http::Request::builder()
        .method("CONNECT")
        .uri(h.pod_addr("n2p2", 8080).to_string())
        .header("forwarded", format!("for=\"{victim_ip}:40000\""))
        .header(
            "baggage",
            "k8s.namespace.name=default,k8s.pod.name=n1p2,service.name=victim",
        )
        .header(
            "x-forwarded-client-cert",
            "URI=spiffe://cluster.local/ns/default/sa/victim",
        )
        .body(())?;
    assert_eq!(hbone_peer::status(&n2p2, lying).await?, 401);

    // Data sent before the answer to a denied CONNECT never reaches the app.
    let mut send = n2p2.clone().ready().await?;
    let (resp, mut body) = send.send_request(
        hbone_peer::connect_req(&h.pod_addr("n2p2", 8080).to_string()),
        false,
    )?;
    let _ = body.send_data(bytes::Bytes::from_static(b"smuggled bytes"), false);
    let resp = tokio::time::timeout(Duration::from_secs(5), resp).await??;
    assert_eq!(resp.status(), 401);
    // No waiting for something not to happen: a connection the policy allows, opened
    // after the 401 through the same proxy to the same app, gets there; a connection
    // the denied CONNECT made (with its bytes) would have been there first.
    let victim = h.mesh.topo.pod("n1p2");
    let mut s = victim.netns.connect(h.pod_addr("n2p2", 8080)).await?;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), echo_roundtrip(&mut s, b"allowed")).await??,
        b"allowed"
    );
    let peers: Vec<_> = h._echo[1].peers().iter().map(|p| p.ip()).collect();
    assert_eq!(
        peers,
        [victim.ip],
        "only the allowed victim reached the guarded app"
    );
    Ok(())
}

/// HBONE baggage is what a peer says of itself: believed only for the metric labels of a
/// source config does not describe (as Istio's ztunnel does; the principal stays the
/// certificate's), and bounded. Oversize, non-ASCII or garbled baggage is ignored (the
/// labels stay `unknown`) and the tunnel opens all the same; every 200 carries the
/// destination pod's own baggage (Istio's response baggage), whatever the request said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_baggage_is_bounded_and_never_fatal() -> Result<()> {
    let h = Hostile::start("hbg")?;
    let n2p1 = hbone_peer::connect(
        h.attacker(),
        &h.ca,
        &id("attacker"),
        id("server"),
        h.pod_addr("n2p1", 15008),
    )
    .await?;
    let target = h.pod_addr("n2p1", 8080).to_string();
    let hostile: [(&str, Vec<Vec<u8>>); 5] = [
        (
            "over 8 KiB",
            vec![format!("k8s.deployment.name={}", "a".repeat(9000)).into_bytes()],
        ),
        (
            "over 8 KiB in several headers",
            vec![format!("x={}", "a".repeat(5000)).into_bytes(); 2],
        ),
        (
            "a value over 253 bytes",
            vec![format!("k8s.namespace.name={}", "n".repeat(300)).into_bytes()],
        ),
        (
            "not visible ASCII",
            vec![b"k8s.deployment.name=caf\xc3\xa9".to_vec()],
        ),
        ("garbage", vec![b"=,==,,;;,k8s.namespace.name".to_vec()]),
    ];
    let claim = vec![b"k8s.deployment.name=claimed,k8s.namespace.name=elsewhere".to_vec()];
    let mut streams = Vec::new();
    for (what, values) in hostile.iter().chain([&("a claim", claim)]) {
        let mut req = http::Request::builder().method("CONNECT").uri(&target);
        for v in values {
            req = req.header("baggage", http::HeaderValue::from_bytes(v)?);
        }
        let mut send = n2p1.clone().ready().await?;
        let (resp, stream) = send.send_request(req.body(())?, false)?;
        let resp = tokio::time::timeout(Duration::from_secs(10), resp).await??;
        assert_eq!(resp.status(), 200, "{what}");
        assert_eq!(
            resp.headers().get("baggage").and_then(|v| v.to_str().ok()),
            Some("k8s.namespace.name=default"),
            "{what}: the 200 describes n2p1"
        );
        streams.push(stream);
    }
    // Counted as each tunnel opened: the hostile ones as `unknown`, the claim as claimed,
    // all with the certificate's principal.
    let opened = |text: &str, workload: &str| {
        let want = format!("source_workload=\"{workload}\"");
        text.lines()
            .filter(|l| l.starts_with("istio_tcp_connections_opened_total{"))
            .filter(|l| {
                l.contains("reporter=\"destination\"")
                    && l.contains(
                        "source_principal=\"spiffe://cluster.local/ns/default/sa/attacker\"",
                    )
                    && l.contains(&want)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    wait_for_async("the six tunnels counted", || async {
        let text = h.metrics(2).await?;
        Ok(opened(&text, "unknown") == 5 && opened(&text, "claimed") == 1)
    })
    .await?;
    let text = h.metrics(2).await?;
    assert!(
        text.lines()
            .any(|l| l.contains("source_workload=\"claimed\"")
                && l.contains("source_workload_namespace=\"elsewhere\"")),
        "{text}"
    );
    assert!(
        !text.contains("source_workload=\"caf"),
        "non-ASCII baggage reached a label"
    );
    assert!(
        !text.contains("aaaaaaaa"),
        "oversize baggage reached a label"
    );
    drop(streams);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofed_source_ip_gains_nothing() -> Result<()> {
    let h = Hostile::start("hc")?;
    let victim = h.mesh.topo.pod("n1p2");
    let to = h.pod_addr("n2p1", 8080);
    // The victim pod's process binds a foreign address (IP_FREEBIND needs no privilege)
    // and connects: capture hands the connection to the pod's own proxy, which speaks
    // with the pod's identity from the pod's real address.
    let spoofed: std::net::Ipv4Addr = "10.10.1.99".parse()?;
    let attempt = victim.netns.run(move || -> std::io::Result<Vec<u8>> {
        use std::io::{Read, Write};
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        s.set_freebind_v4(true)?;
        s.bind(&SocketAddr::from((spoofed, 0)).into())?;
        s.connect_timeout(&to.into(), Duration::from_secs(3))?;
        let mut s: std::net::TcpStream = s.into();
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.write_all(b"who am i")?;
        s.shutdown(std::net::Shutdown::Write)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        Ok(out)
    })?;
    let spoofed_ip = std::net::IpAddr::from(spoofed);
    assert!(
        !h._echo[0].peers().iter().any(|p| p.ip() == spoofed_ip),
        "the app saw the spoofed address"
    );
    if let Ok(out) = attempt {
        if out == b"who am i" {
            // It went through: as the victim pod, from its real address.
            assert_eq!(h._echo[0].peers().last().map(|p| p.ip()), Some(victim.ip));
            h.mesh
                .wait_logs(&["src.identity=spiffe://cluster.local/ns/default/sa/victim"])?;
        }
    }
    // The guarded pod admits only sa/victim: an unenrolled host claiming the victim's
    // address gets nowhere (no mesh identity, plaintext policy needs a principal).
    let spoof_host = h.attacker().run(move || -> std::io::Result<()> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        s.set_freebind_v4(true)?;
        s.bind(&SocketAddr::from((std::net::Ipv4Addr::new(10, 10, 1, 12), 0)).into())?;
        s.connect_timeout(
            &SocketAddr::from((std::net::Ipv4Addr::new(10, 10, 2, 12), 8080)).into(),
            Duration::from_secs(3),
        )
    })?;
    let _ = spoof_host;
    assert!(
        h._echo[1].peers().is_empty(),
        "a spoofed host reached the guarded app"
    );
    Ok(())
}

/// The victim's round trips on one open connection until `stop`: (latencies, failures).
fn victim_loop(
    pod: &Pod,
    to: SocketAddr,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(Vec<Duration>, usize)> {
    let path = pod.netns.path();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut lat = Vec::new();
        let mut failed = 0;
        let Ok(ns) = std::fs::File::open(&path) else {
            return (lat, 1);
        };
        if nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
            return (lat, 1);
        }
        let connect = || -> std::io::Result<std::net::TcpStream> {
            let s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            s.set_nodelay(true)?;
            Ok(s)
        };
        let mut s = match connect() {
            Ok(s) => s,
            Err(_) => return (lat, 1),
        };
        let payload = [7u8; 1024];
        let mut back = [0u8; 1024];
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            match s.write_all(&payload).and_then(|_| s.read_exact(&mut back)) {
                Ok(()) if back == payload => lat.push(t.elapsed()),
                _ => {
                    failed += 1;
                    if let Ok(n) = connect() {
                        s = n;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (lat, failed)
    })
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

async fn wait_for_async<F, Fut>(what: &str, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let mut last = String::new();
    for _ in 0..100 {
        match f().await {
            Ok(true) => return Ok(()),
            Ok(false) => last = "the condition was false".into(),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("timed out waiting for {what} (last check: {last})")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_floods_are_cut_off_while_other_tenants_keep_flowing() -> Result<()> {
    let h = Hostile::start("hd")?;
    let server = h.pod_addr("n2p1", 15008);
    let target = h.pod_addr("n2p1", 8080).to_string();
    let victim_to = h.pod_addr("n2p1", 8080);
    let victim = h.mesh.topo.pod("n1p2");

    // Baseline: the victim's 1 KiB round trips with nobody attacking.
    let stop = Arc::new(AtomicBool::new(false));
    let v = victim_loop(victim, victim_to, stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut base, failed) = v.join().map_err(|_| anyhow::anyhow!("victim panicked"))?;
    assert_eq!(failed, 0);
    assert!(!base.is_empty(), "the victim made no round trip");
    let base_p50 = percentile(&mut base, 0.5);
    println!(
        "victim baseline: {} round trips, p50 {base_p50:?}, p99 {:?}",
        base.len(),
        percentile(&mut base, 0.99)
    );
    // What "keeps flowing" means: the victim's median round trip during an attack stays
    // within 10x the baseline median measured above, or 5 ms if more (this machine:
    // baseline ~0.3 ms, attacks ~0.3-0.4 ms). Generous because the suites run side by
    // side on 2 cores; a proxy the flood starves adds tens of ms or fails round trips. The
    // median, not the p99: one scheduling stall on a loaded machine moves the tail.
    let p50_bound = (base_p50 * 10).max(Duration::from_millis(5));

    type Attack = (&'static str, &'static str);
    let attacks: [Attack; 4] = [
        ("rapid reset", "h2_flood"),
        ("CONTINUATION flood", "h2_flood"),
        ("empty DATA flood", "empty_data_flood"),
        ("too many streams", ""),
    ];
    for (name, reason) in attacks {
        let before = if reason.is_empty() {
            0
        } else {
            h.rejections(reason).await?
        };
        let stop = Arc::new(AtomicBool::new(false));
        let v = victim_loop(victim, victim_to, stop.clone());
        let mut raw =
            RawH2::connect(h.attacker(), server, h.mesh_tls("attacker", "server")?).await?;
        let started = Instant::now();
        match name {
            "rapid reset" => {
                // Open and cancel streams as fast as possible.
                for i in 0..20_000u32 {
                    let s = 2 * i + 1;
                    let mut burst = frame(HEADERS, END_HEADERS, s, &connect_block(&target));
                    burst.extend(frame(RST_STREAM, 0, s, &8u32.to_be_bytes()));
                    if raw.send(&burst).await.is_err() || raw.is_closed() {
                        break;
                    }
                }
            }
            "CONTINUATION flood" => {
                let junk = header_block(&[("x-junk", &"a".repeat(100))]);
                let _ = raw
                    .send(&frame(HEADERS, 0, 1, &connect_block(&target)))
                    .await;
                for _ in 0..100_000 {
                    if raw.send(&frame(CONTINUATION, 0, 1, &junk)).await.is_err() || raw.is_closed()
                    {
                        break;
                    }
                }
            }
            "empty DATA flood" => {
                assert!(
                    connect_answered_200(&mut raw, &target).await,
                    "the flood's stream was not opened"
                );
                let burst: Vec<u8> = (0..1000).flat_map(|_| frame(DATA, 0, 1, &[])).collect();
                for _ in 0..1000 {
                    if raw.send(&burst).await.is_err() || raw.is_closed() {
                        break;
                    }
                }
            }
            _ => {
                // 300 concurrent CONNECTs on one connection; the server allows 200.
                let mut all = Vec::new();
                for i in 0..300u32 {
                    all.extend(frame(
                        HEADERS,
                        END_HEADERS,
                        2 * i + 1,
                        &connect_block(&target),
                    ));
                }
                raw.send(&all).await?;
            }
        }
        if reason.is_empty() {
            // Too many streams: the excess is refused stream by stream; the connection lives.
            let mut refused = 0;
            let mut opened = 0;
            let deadline = Instant::now() + Duration::from_secs(10);
            while opened + refused < 300 && Instant::now() < deadline {
                for f in raw.drain() {
                    match f.0 {
                        RST_STREAM if f.3 == 7u32.to_be_bytes() => refused += 1,
                        HEADERS => opened += 1,
                        _ => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(refused, 100, "{name}: {opened} opened");
            assert!(opened <= 200, "{name}: {opened} streams opened");
        } else {
            assert!(
                raw.wait_closed(Duration::from_secs(10)).await,
                "{name}: the attacker's connection was not closed"
            );
            wait_for_async(&format!("{name} counted"), || async {
                Ok(h.rejections(reason).await? > before)
            })
            .await?;
        }
        let took = started.elapsed();
        // The victim's figures cover the attack and its aftermath: at least a second.
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(took)).await;
        stop.store(true, Ordering::Relaxed);
        let (mut lat, failed) = v.join().map_err(|_| anyhow::anyhow!("victim panicked"))?;
        assert_eq!(failed, 0, "{name}: the victim's round trips failed");
        assert!(!lat.is_empty(), "{name}: the victim made no round trip");
        let p50 = percentile(&mut lat, 0.5);
        println!(
            "{name}: attack ended in {took:?}; victim {} round trips, p50 {p50:?}, p99 {:?}",
            lat.len(),
            percentile(&mut lat, 0.99)
        );
        assert!(p50 <= p50_bound, "{name}: the victim's median round trip {p50:?} exceeds {p50_bound:?} (baseline median {base_p50:?})");
    }
    Ok(())
}

/// Sandwich mode: a workload with `applicationTunnel: {protocol: PROXY, port: 15088}`
/// trusts the PROXY header on 15088 to carry the client's verified SPIFFE id. A client
/// outside the mesh reaching that port in plaintext must not be able to write that header
/// itself: ztunnel puts its own first (the client's real address, no identity), so the
/// forged one arrives as payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_proxy_header_in_plaintext_carries_no_identity() -> Result<()> {
    use ztunnel::proxy_protocol::{self, Addresses, TLV_PEER_IDENTITY};
    let topo = Topology::build(&prefix("hp"), &[1, 1])?;
    let tunnel = ", applicationTunnel: {protocol: PROXY, port: 15088}";
    let cfg = format!("workloads:\n{}", workload(&topo, "n2p1", "server", tunnel));
    let mesh = Mesh::start(topo, &cfg, &["n2p1"], &HashMap::new(), &[])?;
    let (outsider, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let listener = server.netns.listen(15088)?;
    let app = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let first = proxy_protocol::read_header(&mut s).await?;
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await??;
        Ok::<_, anyhow::Error>((first, rest))
    });
    let victim = "spiffe://cluster.local/ns/default/sa/victim";
    let tunnel_port = SocketAddr::new(server.ip, 15088);
    let forged = proxy_protocol::encode(
        SocketAddr::new(server.ip, 1234),
        tunnel_port,
        &[(TLV_PEER_IDENTITY, victim.as_bytes())],
    )?;
    let mut s = outsider.netns.connect(tunnel_port).await?;
    s.write_all(&forged).await?;
    s.write_all(b"hello").await?;
    s.shutdown().await?;
    let (first, rest) = tokio::time::timeout(Duration::from_secs(10), app)
        .await??
        .map_err(|e| anyhow::anyhow!("app: {e:#}"))?;
    assert_eq!(
        first.peer_identity(),
        None,
        "the app was handed an identity from a plaintext client: {first:?}"
    );
    assert!(first.tlv(TLV_PEER_IDENTITY).is_none());
    let Addresses::Ip { src, .. } = first.addresses else {
        panic!("no addresses in {first:?}")
    };
    assert_eq!(src.ip(), outsider.ip, "the header names the real client");
    let mut expected = forged.clone();
    expected.extend_from_slice(b"hello");
    assert_eq!(
        rest, expected,
        "the client's bytes, its forged header included, arrive as payload"
    );
    Ok(())
}

/// ztunnel delivers an HBONE stream from the peer's TCP source address. Where the mesh
/// knows that address as a workload, the peer must hold that workload's identity: a
/// certificate for `sa/attacker` from `sa/owner`'s address is refused (and counted); the
/// owner's own certificate from there works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_address_of_another_identity_is_refused() -> Result<()> {
    let topo = Topology::build(&prefix("hs"), &[1, 1])?;
    // n1p1 is not enrolled (no capture): its process speaks HBONE by hand from its address,
    // which the mesh knows as `sa/owner`'s.
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "owner", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n2p1"], &HashMap::new(), &[])?;
    let ca = hbone_peer::load_ca(&mesh.topo.dir.join("ca"))?;
    let _echo = EchoServer::start(&mesh.topo.pod("n2p1").netns, 8080, None)?;
    let (from, server) = (&mesh.topo.pod("n1p1").netns, mesh.topo.pod("n2p1"));
    let hbone = SocketAddr::new(server.ip, 15008);
    let target = SocketAddr::new(server.ip, 8080).to_string();
    let impostor = hbone_peer::connect(from, &ca, &id("attacker"), id("server"), hbone).await?;
    assert_eq!(
        hbone_peer::status(&impostor, hbone_peer::connect_req(&target)).await?,
        401,
        "another identity from sa/owner's address"
    );
    let owner = hbone_peer::connect(from, &ca, &id("owner"), id("server"), hbone).await?;
    assert_eq!(
        hbone_peer::status(&owner, hbone_peer::connect_req(&target)).await?,
        200,
        "the address's own identity"
    );
    mesh.wait_logs(&["source address belongs to another workload"])?;
    Ok(())
}

/// Connections from one source that stall in the handshake (nothing sent, or half a
/// ClientHello) hold at most HBONE_MAX_HANDSHAKES_PER_IP places of the node's
/// HBONE_MAX_HANDSHAKES: the excess is closed at once and counted (`handshake_limit`),
/// the rest at the 5 s handshake deadline, and a victim pod's new HBONE connection to the
/// same pod goes through meanwhile (without the per-source cap the flood would hold every
/// place).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_from_one_source_does_not_starve_others() -> Result<()> {
    const PER_IP: usize = 4;
    const FLOOD: usize = 100;
    let h = Hostile::start_with(
        "he",
        &[
            ("HBONE_MAX_HANDSHAKES", "16"),
            ("HBONE_MAX_HANDSHAKES_PER_IP", "4"),
        ],
    )?;
    let server = h.pod_addr("n2p1", 15008);
    let before = h.rejections("handshake_limit").await?;
    // A TLS record header announcing a 512-byte ClientHello, then its first bytes only.
    let partial_hello: &[u8] = &[
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    let mut flood = Vec::new();
    for i in 0..FLOOD {
        let opened = Instant::now();
        let mut s = match h.attacker().connect(server).await {
            Ok(s) => s,
            // Reset before connect(2) even returned: closed at once.
            Err(e)
                if e.root_cause()
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset) =>
            {
                flood.push(tokio::spawn(async { Some(Duration::ZERO) }));
                continue;
            }
            Err(e) => return Err(e),
        };
        if i % 2 == 1 {
            // Fails if the server has already reset this one.
            let _ = s.write_all(partial_hello).await;
        }
        flood.push(tokio::spawn(async move {
            // Until the server closes (EOF or reset); the deadline is only the test's.
            let mut buf = [0u8; 1024];
            let r = tokio::time::timeout(Duration::from_secs(15), async {
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            r.ok().map(|_| opened.elapsed())
        }));
    }
    // The victim's first connection to the server pod: a new HBONE connection from node1.
    let victim = h.mesh.topo.pod("n1p2");
    let t = Instant::now();
    let mut s = victim.netns.connect(h.pod_addr("n2p1", 8080)).await?;
    let echoed = tokio::time::timeout(
        Duration::from_secs(3),
        echo_roundtrip(&mut s, b"still here"),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(
        echoed.map_err(|_| anyhow::anyhow!("the victim got no answer within 3 s"))??,
        b"still here"
    );
    println!("victim's request during the flood: {took:?}");
    let mut closed = Vec::new();
    for f in flood {
        closed.push(
            f.await?.ok_or_else(|| {
                anyhow::anyhow!("a flooding connection was still open after 15 s")
            })?,
        );
    }
    closed.sort();
    let slowest = closed[FLOOD - 1];
    let at_once = closed
        .iter()
        .filter(|d| **d < Duration::from_secs(1))
        .count();
    println!("flood: {at_once} of {FLOOD} closed within 1 s, the slowest after {slowest:?}");
    assert!(
        at_once >= FLOOD - PER_IP,
        "only {at_once} of {FLOOD} over-limit connections were closed at once: {closed:?}"
    );
    assert!(
        slowest <= Duration::from_millis(6500),
        "a stalled handshake was held {slowest:?}, past the 5 s deadline"
    );
    let counted = h.rejections("handshake_limit").await? - before;
    assert!(
        counted >= (FLOOD - PER_IP) as u64,
        "{counted} refusals counted"
    );
    Ok(())
}

/// An authenticated HBONE connection that opens no stream gets GOAWAY and is closed
/// after HBONE_IDLE_TIMEOUT_SECONDS; one with a stream open stays however long the
/// stream is silent, and is closed once the stream is gone and the timeout passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hbone_connection_without_streams_is_closed_when_idle() -> Result<()> {
    let h = Hostile::start_with("hi", &[("HBONE_IDLE_TIMEOUT_SECONDS", "1")])?;
    let server = h.pod_addr("n2p1", 15008);
    let target = h.pod_addr("n2p1", 8080).to_string();
    let goaway = |frames: Vec<Frame>| frames.into_iter().find(|f| f.0 == GOAWAY);

    let t = Instant::now();
    let mut idle = RawH2::connect(h.attacker(), server, h.mesh_tls("attacker", "server")?).await?;
    assert!(
        idle.wait_closed(Duration::from_secs(5)).await,
        "an HBONE connection without streams stayed open"
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the idle timeout"
    );
    let g = goaway(idle.drain()).ok_or_else(|| anyhow::anyhow!("closed without GOAWAY"))?;
    assert_eq!(
        g.3.get(4..8),
        Some(&0u32.to_be_bytes()[..]),
        "GOAWAY carries NO_ERROR"
    );
    println!("idle connection closed after {took:?}");

    let mut busy = RawH2::connect(h.attacker(), server, h.mesh_tls("attacker", "server")?).await?;
    assert!(
        connect_answered_200(&mut busy, &target).await,
        "the stream was not opened"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        !busy.is_closed(),
        "a connection with an open stream was closed as idle"
    );
    assert!(
        goaway(busy.drain()).is_none(),
        "GOAWAY on a connection with an open stream"
    );
    busy.send(&frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()))
        .await?;
    assert!(
        busy.wait_closed(Duration::from_secs(5)).await,
        "the connection stayed open after its last stream ended"
    );
    Ok(())
}

/// A peer that accepts HBONE connections and never says a word (no TLS ServerHello):
/// every client connection to it ends within CONNECT_TIMEOUT_MS, the one that dials and
/// the one queued behind that dial, and the access log says why. Without one deadline
/// around TCP + TLS + HTTP/2 + CONNECT, both hung for as long as the peer held them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_hbone_peer_fails_every_waiting_client_within_the_connect_timeout() -> Result<()> {
    const TIMEOUT: Duration = Duration::from_millis(1500);
    let topo = Topology::build(&prefix("hz"), &[1, 1])?;
    // n2p1 is in the mesh as an HBONE workload but not enrolled: what listens on its
    // 15008 is the silent peer below.
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "silent", "")
    );
    let mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1"],
        &HashMap::new(),
        &[("CONNECT_TIMEOUT_MS", "1500")],
    )?;
    let silent = mesh.topo.pod("n2p1").netns.listen(15008)?;
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let client = mesh.topo.pod("n1p1");
    let target = SocketAddr::new(mesh.topo.pod("n2p1").ip, 8080);
    let mut waits = Vec::new();
    for _ in 0..2 {
        let mut s = client.netns.connect(target).await?;
        waits.push(tokio::spawn(async move {
            let t = Instant::now();
            let _ = s.write_all(b"hello").await;
            let mut buf = [0u8; 64];
            // Until ztunnel gives up (a reset, or EOF); the deadline is only the test's.
            let ended = tokio::time::timeout(Duration::from_secs(8), async {
                loop {
                    match s.read(&mut buf).await {
                        Ok(n) if n > 0 => continue,
                        r => return r.map(|_| ()),
                    }
                }
            })
            .await;
            (ended.is_ok(), t.elapsed())
        }));
    }
    for w in waits {
        let (ended, took) = w.await?;
        assert!(
            ended,
            "a client connection to a silent HBONE peer was still open after 8 s"
        );
        println!("client released after {took:?}");
        assert!(
            took <= TIMEOUT + Duration::from_millis(1500),
            "released after {took:?}, long past the {TIMEOUT:?} connect timeout"
        );
    }
    mesh.wait_logs(&["did not complete within the connect timeout"])?;
    held.abort();
    Ok(())
}
