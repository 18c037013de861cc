//! ztunnel configured by istiod, end to end: a fake istiod (tests/src/fake_istiod.rs: delta ADS
//! and the Istio CA over TLS) on node1, ztunnels on two nodes, pods enrolled at start
//! (node1) or by a stand-in CNI agent over ZDS (node2), real traffic throughout.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::fake_istiod::*;
use mesh_tests::netsim::*;
use mesh_tests::{bins, json_schema};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use ztunnel::xds::proto::istio::security as pb_sec;
use ztunnel::xds::proto::istio::workload as pb;
use ztunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

const SLEEP_ID: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const ZTUNNEL_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/ztunnel";

fn vip(v: [u8; 4], port: u16) -> SocketAddr {
    SocketAddr::from((v, port))
}

/// Two nodes: n1p1 (sa sleep) enrolled at start on node1; node2's pods (n2p1, n2p2,
/// sa echo) enrolled over ZDS by the test. istiod starts with n1p1, n2p1 and the echo
/// service (n2p1 behind it).
struct XdsMesh {
    mesh: Mesh,
    istiod: FakeIstiod,
    _cni: Child,
    pods_dir: PathBuf,
    token: PathBuf,
    _echo: Vec<EchoServer>,
}

impl XdsMesh {
    async fn start(
        tag: &str,
        extra_env: &[(&str, &str)],
        setup: impl FnOnce(&mut Resources),
    ) -> Result<XdsMesh> {
        let topo = Topology::build(&prefix(tag), &[2, 2])?;
        let (istiod, token) = start_base_mesh(&topo, setup)?;
        let (cni, pods_dir, socket) = start_cni_agent(&topo, 2)?;
        let mut env = istiod.env(&token);
        env.extend(
            extra_env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        // node1: n1p1 at start; node2: pods from the CNI agent.
        let node_args = [
            vec![
                "--pod".to_string(),
                format!(
                    "{}={}",
                    pod_uid("n1p1"),
                    topo.pod("n1p1").netns.path().display()
                ),
            ],
            vec!["--zds-socket".to_string(), socket.display().to_string()],
        ];
        let mesh = Mesh::start_with_istiod(topo, &node_args, &env)?;
        let t = &mesh.topo;
        let echo = vec![
            EchoServer::start(&t.pod("n2p1").netns, 8080, Some("n2p1"))?,
            EchoServer::start(&t.pod("n2p2").netns, 8080, Some("n2p2"))?,
        ];
        Ok(XdsMesh {
            mesh,
            istiod,
            _cni: cni,
            pods_dir,
            token,
            _echo: echo,
        })
    }

    /// Enrolls a node2 pod through the CNI agent, with a Kubernetes-style pod UID (not
    /// istiod's workload uid: ztunnel finds the workload by namespace/name).
    fn enroll(&self, pod: &str, sa: &str) -> Result<()> {
        let p = self.mesh.topo.pod(pod);
        sh(
            bins::ztunnel(),
            &[
                "enroll",
                "--pods-dir",
                &self.pods_dir.display().to_string(),
                "--uid",
                &format!("0d9e-{pod}"),
                "--name",
                pod,
                "--namespace",
                "default",
                "--service-account",
                sa,
                "--netns",
                &p.netns.path().display().to_string(),
            ],
        )?;
        Ok(())
    }

    fn client(&self) -> &Pod {
        self.mesh.topo.pod("n1p1")
    }

    async fn ready(&self, node: usize) -> Result<(u16, String)> {
        readiness(self.mesh.topo.node(node), "127.0.0.1:15021".parse()?).await
    }

    /// Who answers `n` fresh connections to `to` (the echo servers greet with their pod name).
    async fn who(
        &self,
        to: SocketAddr,
        n: usize,
    ) -> Result<std::collections::BTreeMap<String, usize>> {
        let mut seen = std::collections::BTreeMap::new();
        for _ in 0..n {
            let mut s = self.client().netns.connect(to).await?;
            let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
                .await
                .context("no greeting")??;
            *seen.entry(who).or_insert(0) += 1;
        }
        Ok(seen)
    }
}

/// A connection that stays open: a greeting, then echoes on demand.
struct LongLived {
    s: tokio::net::TcpStream,
    pub who: String,
}

impl LongLived {
    async fn open(from: &Pod, to: SocketAddr) -> Result<LongLived> {
        let mut s = from.netns.connect(to).await?;
        let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
            .await
            .context("no greeting")??;
        Ok(LongLived { s, who })
    }

    async fn echo(&mut self, data: &[u8]) -> Result<()> {
        self.s.write_all(data).await?;
        let mut back = vec![0u8; data.len()];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut back))
            .await
            .context("echo timed out")??;
        anyhow::ensure!(back == data, "echo mismatch");
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiod_state_drives_the_mesh_while_traffic_flows() -> Result<()> {
    let m = XdsMesh::start("xa", &[], |r| r.hold_authorizations = true).await?;
    // Not ready until both types arrived once (authorizations are held back).
    let (code, body) = m.ready(1).await?;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("waiting for xds"), "{body}");
    m.istiod.update(|r| r.hold_authorizations = false);
    wait_for_async("node1 ready", Duration::from_secs(10), || async {
        Ok(m.ready(1).await?.0 == 200)
    })
    .await?;

    // What istiod saw: Istio's node id, the token, an mTLS client certificate with the
    // proxy's own identity, and certificates requested on behalf of the pods.
    m.istiod
        .wait("node1 subscription", Duration::from_secs(5), |r| {
            r.seen.iter().any(|s| s.node_id.as_deref() == Some("ztunnel~10.0.0.1~ztunnel-node1.istio-system~istio-system.svc.cluster.local"))
        })
        .await?;
    m.istiod
        .wait("an mTLS xDS stream", Duration::from_secs(5), |r| {
            r.seen
                .iter()
                .any(|s| s.client_identity.as_deref() == Some(ZTUNNEL_ID))
        })
        .await?;
    m.istiod
        .wait("a certificate for sleep", Duration::from_secs(5), |r| {
            r.issued.iter().any(|i| {
                i.identity == SLEEP_ID
                    && i.impersonated.as_deref() == Some(SLEEP_ID)
                    && i.validity_secs == 86400
            })
        })
        .await?;
    assert!(m
        .istiod
        .res
        .lock()
        .unwrap()
        .issued
        .iter()
        .any(|i| i.identity == ZTUNNEL_ID && i.impersonated.is_none()));

    // /config_dump on the admin port shows istiod's state and the certificates, in
    // Istio ztunnel's shape.
    let (code, body) = http_get(
        m.mesh.topo.node(1),
        "127.0.0.1:15000".parse()?,
        "/config_dump",
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let dump: serde_json::Value = serde_json::from_str(&body).context("config_dump is not JSON")?;
    let uids: Vec<&str> = dump["workloads"]
        .as_array()
        .context("workloads")?
        .iter()
        .filter_map(|w| w["uid"].as_str())
        .collect();
    assert!(uids.contains(&pod_uid("n2p1").as_str()), "{uids:?}");
    assert_eq!(dump["services"][0]["hostname"], ECHO);
    assert_eq!(dump["services"][0]["vips"][0], "/10.96.0.10");
    let certs = dump["certificates"].as_array().context("certificates")?;
    let sleep = certs
        .iter()
        .find(|c| c["identity"] == SLEEP_ID)
        .context("sleep's certificate")?;
    assert_eq!(sleep["state"], "Available");
    assert!(
        sleep["certChain"][0]["serialNumber"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{sleep}"
    );
    assert!(
        sleep["certChain"][0]["expirationTime"]
            .as_str()
            .is_some_and(|s| s.ends_with('Z')),
        "{sleep}"
    );
    assert_eq!(dump["config"]["xdsAddress"], format!("https://{ISTIOD}"));

    // n2p1 joins over ZDS; traffic to the service VIP reaches it over HBONE.
    m.enroll("n2p1", "echo")?;
    m.mesh.ztunnels[1].wait_log("pod enrolled", READY)?;
    let mut long = LongLived::open(m.client(), vip(ECHO_VIP, 80)).await?;
    assert_eq!(long.who, "n2p1");
    long.echo(b"first").await?;
    assert_eq!(m.who(vip(ECHO_VIP, 80), 1).await?.get("n2p1"), Some(&1));
    m.mesh.wait_logs(&[
        &format!("src.identity={SLEEP_ID}"),
        "dst.identity=spiffe://cluster.local/ns/default/sa/echo",
    ])?;

    // Added: n2p2 is enrolled by the CNI agent before istiod knows it (enrollment
    // waits), then istiod pushes it into the service.
    m.enroll("n2p2", "echo")?;
    // Pending on node2 (its /config_dump lists the proxy, not up) while istiod does not know it.
    wait_for_async("n2p2 pending on node2", Duration::from_secs(5), || async {
        let (code, body) = http_get(
            m.mesh.topo.node(2),
            "127.0.0.1:15000".parse()?,
            "/config_dump",
        )
        .await?;
        anyhow::ensure!(code == 200, "config_dump answered {code}: {body}");
        let dump: serde_json::Value =
            serde_json::from_str(&body).context("config_dump is not JSON")?;
        let states = dump["workloadState"]
            .as_object()
            .context("no workloadState")?;
        let n2p2 = states
            .values()
            .find(|s| s["info"]["name"] == "n2p2")
            .with_context(|| format!("n2p2 not in workloadState: {states:?}"))?;
        anyhow::ensure!(
            n2p2["state"] == "Pending",
            "n2p2 is {}, not Pending",
            n2p2["state"]
        );
        Ok(true)
    })
    .await?;
    assert!(
        !m.istiod
            .res
            .lock()
            .unwrap()
            .addresses
            .contains_key(&pod_uid("n2p2")),
        "istiod knew n2p2 already"
    );
    let topo = &m.mesh.topo;
    m.istiod.update(|r| {
        r.set_workload(pod_workload(
            "n2p2",
            topo.pod("n2p2").ip,
            2,
            "echo",
            &[(ECHO, 80, 8080)],
        ))
    });
    wait_for("n2p2 enrolled", Duration::from_secs(10), || {
        m.mesh.ztunnels[1]
            .log_text()
            .matches("pod enrolled")
            .count()
            >= 2
    })?;
    let seen = m.who(vip(ECHO_VIP, 80), 30).await?;
    assert!(
        seen.contains_key("n2p1") && seen.contains_key("n2p2"),
        "{seen:?}"
    );

    // Changed: n2p1 turns unhealthy; new connections go to n2p2 only, the open one lives on.
    m.istiod.update(|r| {
        let mut w = pod_workload("n2p1", topo.pod("n2p1").ip, 2, "echo", &[(ECHO, 80, 8080)]);
        w.status = pb::WorkloadStatus::Unhealthy as i32;
        r.set_workload(w);
    });
    wait_for_async("n2p1 out of rotation", Duration::from_secs(5), || async {
        Ok(m.who(vip(ECHO_VIP, 80), 10).await?.keys().eq(["n2p2"]))
    })
    .await?;
    long.echo(b"still here").await?;

    // Removed: n2p2 leaves and n2p1 is healthy again.
    m.istiod.update(|r| {
        r.remove_address(&pod_uid("n2p2"));
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[(ECHO, 80, 8080)],
        ));
    });
    wait_for_async("only n2p1 left", Duration::from_secs(5), || async {
        Ok(m.who(vip(ECHO_VIP, 80), 10).await?.keys().eq(["n2p1"]))
    })
    .await?;

    // A malformed resource is NACKed with its name; the rest of the same push applies.
    m.istiod.update(|r| {
        r.set_raw_address(
            "default/broken.default.svc.cluster.local",
            vec![0x12, 0x03, 0xff, 0xff, 0xff],
        );
        let mut s = service("echo2", [10, 96, 0, 11], 80, 8080);
        s.hostname = "echo2.default.svc.cluster.local".into();
        r.set_service(s);
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[
                (ECHO, 80, 8080),
                ("echo2.default.svc.cluster.local", 80, 8080),
            ],
        ));
    });
    m.istiod
        .wait(
            "a NACK naming the broken resource",
            Duration::from_secs(5),
            |r| {
                r.nacks()
                    .iter()
                    .any(|n| n.contains("default/broken.default.svc.cluster.local"))
            },
        )
        .await?;
    assert_eq!(
        m.who(vip([10, 96, 0, 11], 80), 3)
            .await?
            .keys()
            .collect::<Vec<_>>(),
        ["n2p1"]
    );
    let log = m.mesh.logs();
    assert!(log.contains("(NACK)"), "{log}");
    long.echo(b"and at the end").await?;

    // Control-plane and process metrics on node2 (which saw the NACK too).
    let (_, text) = http_get(
        m.mesh.topo.node(2),
        "127.0.0.1:15020".parse()?,
        "/stats/prometheus",
    )
    .await?;
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    assert!(
        value(&format!(
            "istio_xds_message_total{{url=\"{ADDRESS_TYPE}\"}}"
        )) >= 5.0,
        "{text}"
    );
    assert!(
        value(&format!(
            "istio_xds_message_bytes_total{{url=\"{ADDRESS_TYPE}\"}}"
        )) > 100.0,
        "{text}"
    );
    assert_eq!(
        value(&format!(
            "ztunnel_xds_rejected_resources_total{{url=\"{ADDRESS_TYPE}\"}}"
        )),
        1.0,
        "{text}"
    );
    assert!(
        value("ztunnel_certificate_requests_total{result=\"success\"}") >= 2.0,
        "its own and sa/echo: {text}"
    );
    assert!(value("ztunnel_certificates ") >= 2.0, "{text}");
    assert!(
        value("ztunnel_certificate_nearest_expiry_seconds ") > 80_000.0,
        "{text}"
    );
    assert!(
        value("process_resident_memory_bytes ") > 1_000_000.0,
        "{text}"
    );
    assert!(value("process_open_fds ") > 5.0, "{text}");
    Ok(())
}

/// Polls an async condition.
async fn wait_for_async<F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match f().await {
            Ok(true) => return Ok(()),
            Ok(false) => "the condition was false".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("timed out waiting for {what} (last check: {last})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_policy_applies_to_open_connections() -> Result<()> {
    let m = XdsMesh::start("xp", &[], |_| {}).await?;
    m.enroll("n2p1", "echo")?;
    m.mesh.ztunnels[1].wait_log("pod enrolled", READY)?;
    let server = SocketAddr::new(m.mesh.topo.pod("n2p1").ip, 8080);
    let mut open = LongLived::open(m.client(), server).await?;
    open.echo(b"before the policy").await?;

    // A DENY for sleep arrives: the open connection is closed, new ones are refused.
    m.istiod.update(|r| {
        r.set_policy(principal_policy(
            "deny-sleep",
            pb_sec::Action::Deny,
            &["cluster.local/ns/default/sa/sleep"],
        ))
    });
    m.mesh.wait_logs(&["policy now denies"])?;
    // The connection ends (reset or EOF); nothing written after the push comes back.
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = open.s.write_all(b"after").await;
        open.s.read(&mut buf).await
    })
    .await
    .context("the open connection was not closed by the pushed DENY")?;
    assert!(
        matches!(r, Ok(0) | Err(_)),
        "the connection still carries data: {r:?}"
    );
    // Refused: the client's ztunnel resets the captured connection, which can come before
    // connect() returns (then connect fails) or after (then the echo is empty).
    if let Ok(mut s) = m.client().netns.connect(server).await {
        let r =
            tokio::time::timeout(Duration::from_secs(5), echo_roundtrip(&mut s, b"new")).await?;
        assert!(
            r.map(|v| v.is_empty()).unwrap_or(true),
            "a new connection got through the DENY"
        );
    }

    // Removing the policy lets new connections through again.
    m.istiod.update(|r| r.remove_policy("default/deny-sleep"));
    wait_for_async("policy removed", Duration::from_secs(5), || async {
        let mut s = m.client().netns.connect(server).await?;
        Ok(
            tokio::time::timeout(Duration::from_secs(2), read_line(&mut s))
                .await??
                .as_str()
                == "n2p1",
        )
    })
    .await?;

    // A CA answering with another identity is refused: the pod is not enrolled with it.
    m.istiod.update(|r| {
        r.wrong_identity_for
            .insert("spiffe://cluster.local/ns/default/sa/other".into());
        r.set_workload(pod_workload(
            "n2p2",
            m.mesh.topo.pod("n2p2").ip,
            2,
            "other",
            &[],
        ));
    });
    m.enroll("n2p2", "other")?;
    m.mesh.ztunnels[1].wait_log("not the requested identity", Duration::from_secs(10))?;
    assert_eq!(
        m.mesh.ztunnels[1]
            .log_text()
            .matches("pod enrolled")
            .count(),
        1
    );
    Ok(())
}

/// A policy ztunnel cannot convert is NACKed and enforced as a deny-all in its scope:
/// dropping a DENY (or the only ALLOW) would widen access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconvertible_policy_denies_everything_in_its_scope() -> Result<()> {
    let m = XdsMesh::start("xu", &[], |_| {}).await?;
    m.enroll("n2p1", "echo")?;
    m.mesh.ztunnels[1].wait_log("pod enrolled", READY)?;
    let server = SocketAddr::new(m.mesh.topo.pod("n2p1").ip, 8080);
    let reaches = || async {
        let mut s = m.client().netns.connect(server).await?;
        Ok::<_, anyhow::Error>(
            tokio::time::timeout(Duration::from_secs(2), read_line(&mut s))
                .await
                .ok()
                .and_then(|r| r.ok())
                .as_deref()
                == Some("n2p1"),
        )
    };
    assert!(reaches().await?);

    // A DENY for sleep with a clause ztunnel cannot convert (a port that is no port).
    let mut deny = principal_policy(
        "deny-sleep",
        pb_sec::Action::Deny,
        &["cluster.local/ns/default/sa/sleep"],
    );
    deny.rules[0].clauses.push(pb_sec::Clause {
        matches: vec![pb_sec::Match {
            destination_ports: vec![70000],
            ..Default::default()
        }],
    });
    m.istiod.update(|r| r.set_policy(deny.clone()));
    m.istiod
        .wait("a NACK naming the policy", Duration::from_secs(5), |r| {
            r.nacks().iter().any(|n| n.contains("default/deny-sleep"))
        })
        .await?;
    wait_for_async("the deny-all", Duration::from_secs(5), || async {
        Ok(!reaches().await?)
    })
    .await?;
    m.mesh.ztunnels[1].wait_log(
        "denying every connection in its scope",
        Duration::from_secs(5),
    )?;
    let (_, body) = http_get(
        m.mesh.topo.node(2),
        "127.0.0.1:15000".parse()?,
        "/config_dump",
    )
    .await?;
    let dump: serde_json::Value = serde_json::from_str(&body)?;
    let p = dump["policies"]
        .as_array()
        .context("policies")?
        .iter()
        .find(|p| p["name"] == "deny-sleep")
        .context("the policy in config_dump")?;
    assert_eq!(
        (p["action"].as_str(), p["scope"].as_str()),
        (Some("Deny"), Some("Namespace")),
        "{p}"
    );
    assert!(
        p["unenforceable"]
            .as_str()
            .is_some_and(|r| r.contains("destination_ports")),
        "{p}"
    );
    let gauge = || async {
        let (_, text) = http_get(
            m.mesh.topo.node(2),
            "127.0.0.1:15020".parse()?,
            "/stats/prometheus",
        )
        .await?;
        Ok::<_, anyhow::Error>(
            text.lines()
                .find(|l| l.starts_with("ztunnel_unenforceable_policies{source=\"xds\"}"))
                .map(str::to_string),
        )
    };
    assert_eq!(
        gauge().await?.as_deref(),
        Some("ztunnel_unenforceable_policies{source=\"xds\"} 1")
    );

    // Fixed by istiod (now a DENY for another principal): it applies as written.
    deny.rules[0].clauses.pop();
    deny.rules[0].clauses[0].matches[0].principals[0] = pb_sec::StringMatch {
        match_type: Some(pb_sec::string_match::MatchType::Exact(
            "cluster.local/ns/default/sa/other".into(),
        )),
    };
    m.istiod.update(|r| r.set_policy(deny));
    wait_for_async("the fixed policy", Duration::from_secs(5), reaches).await?;
    assert_eq!(
        gauge().await?.as_deref(),
        Some("ztunnel_unenforceable_policies{source=\"xds\"} 0")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_keeps_flowing_while_istiod_restarts() -> Result<()> {
    let mut m = XdsMesh::start("xr", &[], |_| {}).await?;
    m.enroll("n2p1", "echo")?;
    m.mesh.ztunnels[1].wait_log("pod enrolled", READY)?;
    let _plain = EchoServer::start(&m.mesh.topo.pod("n2p1").netns, 9090, None)?;
    let stop = Arc::new(AtomicBool::new(false));
    let looping = connect_loop(
        m.client(),
        SocketAddr::new(m.mesh.topo.pod("n2p1").ip, 9090),
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    m.istiod.kill();
    m.mesh.wait_logs(&["serving the last known state"])?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Still ready: the last known state serves.
    assert_eq!(m.ready(1).await?.0, 200);

    let before = m.istiod.res.lock().unwrap().seen.len();
    m.istiod.restart()?;
    // The proxies come back announcing what they hold, so istiod sends only changes.
    m.istiod
        .wait(
            "a resubscription with initial versions",
            Duration::from_secs(20),
            |r| {
                r.seen[before..].iter().any(|s| {
                    s.type_url == ADDRESS_TYPE && s.initial_versions.contains_key(&pod_uid("n2p1"))
                })
            },
        )
        .await?;
    // Changes after the restart apply.
    m.istiod.update(|r| {
        r.set_service(service("echo3", [10, 96, 0, 12], 80, 8080));
        let topo = &m.mesh.topo;
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[
                (ECHO, 80, 8080),
                ("echo3.default.svc.cluster.local", 80, 8080),
            ],
        ));
    });
    wait_for_async(
        "the post-restart change",
        Duration::from_secs(10),
        || async {
            Ok(m.who(vip([10, 96, 0, 12], 80), 1)
                .await?
                .contains_key("n2p1"))
        },
    )
    .await?;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = looping
        .join()
        .map_err(|_| anyhow::anyhow!("loop panicked"))?;
    assert!(
        ok > 20,
        "only {ok} connections; failures: {:?}",
        &failed[..failed.len().min(5)]
    );
    assert!(
        failed.is_empty(),
        "{} of {} connections failed while istiod restarted: {:?}",
        failed.len(),
        ok + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(m.istiod.res.lock().unwrap().acks(AUTHORIZATION_TYPE) >= 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_a_long_transfer() -> Result<()> {
    // 6 s certificates: refreshed every 3 s.
    let m = XdsMesh::start("xc", &[("WORKLOAD_CERT_TTL_SECONDS", "6")], |_| {}).await?;
    m.enroll("n2p1", "echo")?;
    m.mesh.ztunnels[1].wait_log("pod enrolled", READY)?;
    let issued = |id: &str| m.istiod.res.lock().unwrap().issued_for(id);
    let start_sleep = issued(SLEEP_ID);

    // ~10 s of traffic on one connection while the certificates of both ends rotate.
    let mut s = m
        .client()
        .netns
        .connect(SocketAddr::new(m.mesh.topo.pod("n2p1").ip, 8080))
        .await?;
    assert_eq!(read_line(&mut s).await?, "n2p1");
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut sent = Vec::new();
        for i in 0..100u64 {
            let chunk = pattern(32 * 1024, i);
            wr.write_all(&chunk).await?;
            sent.extend_from_slice(&chunk);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        wr.shutdown().await?;
        Ok::<_, std::io::Error>(sent)
    });
    // Mid-transfer: the mesh root file is rewritten (re-issue everything) and the token rotates.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let root = m.istiod.pki.root_path.clone();
    let pem = std::fs::read_to_string(&root)?;
    std::fs::write(&root, format!("{pem}\n"))?;
    m.istiod
        .res
        .lock()
        .unwrap()
        .tokens
        .insert("rotated-token".into());
    std::fs::write(&m.token, "rotated-token")?;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), rd.read_to_end(&mut got)).await??;
    let sent = writer.await??;
    assert_eq!(got.len(), sent.len());
    assert!(got == sent, "bytes changed in transit");
    assert!(
        issued(SLEEP_ID) >= start_sleep + 3,
        "{} certificates for sleep during the transfer",
        issued(SLEEP_ID) - start_sleep
    );
    m.mesh
        .wait_logs(&["mesh root certificate changed", "certificate rotated"])?;
    assert!(
        m.istiod
            .res
            .lock()
            .unwrap()
            .issued
            .iter()
            .any(|i| i.token == "rotated-token"),
        "the new token was never used"
    );
    // New connections use the rotated certificates.
    assert_eq!(
        m.who(SocketAddr::new(m.mesh.topo.pod("n2p1").ip, 8080), 3)
            .await?
            .get("n2p1"),
        Some(&3)
    );
    Ok(())
}

/// A CA that takes a pod's certificate request and never answers must not stall
/// enrollment on the node: that pod's Add fails after the CA timeout, and a pod added
/// beside it is enrolled and reachable meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_ca_request_does_not_stall_other_pods() -> Result<()> {
    const STUCK: &str = "spiffe://cluster.local/ns/default/sa/stuck";
    let m = XdsMesh::start("xh", &[], |_| {}).await?;
    m.istiod.update(|r| {
        r.stall_for.insert(STUCK.into());
        r.set_workload(pod_workload(
            "n2p1",
            m.mesh.topo.pod("n2p1").ip,
            2,
            "stuck",
            &[],
        ));
        r.set_workload(pod_workload(
            "n2p2",
            m.mesh.topo.pod("n2p2").ip,
            2,
            "echo",
            &[],
        ));
    });
    // Give the push a moment so both workloads are known when the Adds arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // n2p1 (the stuck one) sorts first: the agent sends its Add before n2p2's.
    m.enroll("n2p1", "stuck")?;
    m.enroll("n2p2", "echo")?;
    m.mesh.ztunnels[1]
        .wait_log("pod enrolled", READY)
        .context("the second pod was never enrolled")?;
    let to = SocketAddr::new(m.mesh.topo.pod("n2p2").ip, 8080);
    let mut s = m.client().netns.connect(to).await?;
    let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .context("no greeting")??;
    assert_eq!(who, "n2p2");
    m.mesh.ztunnels[1].wait_log("no answer from the CA", READY)?;
    assert_eq!(
        m.mesh.ztunnels[1]
            .log_text()
            .matches("pod enrolled")
            .count(),
        1,
        "the stuck pod was enrolled"
    );
    Ok(())
}

/// Istio's DaemonSet shape (issue 18): container args `proxy ztunnel` and nothing but
/// Istio's environment names and formats: an address without a scheme and no CA_ADDRESS
/// (the CA is istiod, not a per-node CA), AUTH_TOKEN, CLUSTER_ID, SECRET_TTL as a
/// duration, inline-PEM XDS_ROOT_CA, XDS_HEADER_* / CA_HEADER_*, ISTIO_META(JSON)_* in
/// the node metadata, INPOD_UDS (istio-cni: no capture of our own), N% worker threads.
/// Settings we cannot honour safely refuse the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_container_args_and_environment_names() -> Result<()> {
    let topo = Topology::build(&prefix("istioenv"), &[0])?;
    let token = topo.dir.join("istio-token");
    std::fs::write(&token, TOKEN)?;
    let istiod = FakeIstiod::start(topo.node(1), ISTIOD.parse()?, &topo.dir)?;
    let socket = topo.dir.join("zds.sock").display().to_string();
    let pods_dir = topo.dir.join("pods").display().to_string();
    let _cni = topo.node(1).spawn(
        bins::ztunnel(),
        &["cni-server", "--socket", &socket, "--pods-dir", &pods_dir],
        &[("RUST_LOG", "info")],
        &topo.dir.join("cni.log"),
    )?;
    _cni.wait_log("listening", READY)?;
    let token_path = token.display().to_string();
    let root_path = istiod.pki.root_path.display().to_string();
    let env = [
        ("RUST_LOG", "info"),
        ("RUST_BACKTRACE", "0"),
        ("NODE_NAME", "node1"),
        ("POD_NAME", "ztunnel-abcde"),
        ("POD_NAMESPACE", "istio-system"),
        ("INSTANCE_IP", "10.0.0.1"),
        ("SERVICE_ACCOUNT", "ztunnel"),
        ("XDS_ADDRESS", ISTIOD),
        ("ALT_XDS_HOSTNAME", ISTIOD_SAN),
        ("ALT_CA_HOSTNAME", ISTIOD_SAN),
        ("XDS_ROOT_CA", istiod.pki.root_pem.as_str()),
        ("CA_ROOT_CA", root_path.as_str()),
        ("AUTH_TOKEN", token_path.as_str()),
        ("CLUSTER_ID", CLUSTER_ID),
        ("SECRET_TTL", "12h"),
        ("POOL_UNUSED_RELEASE_TIMEOUT", "2m"),
        ("CONNECTION_TERMINATION_DEADLINE", "3s"),
        ("KEEPALIVE_TIME", "60s"),
        ("ZTUNNEL_CPU_LIMIT", "4"),
        ("ZTUNNEL_WORKER_THREADS", "50%"),
        ("XDS_HEADER_X-Tenant", "t1"),
        ("CA_HEADER_X-Ca-Tenant", "t2"),
        ("ISTIO_META_DNS_CAPTURE", "true"),
        ("ISTIO_METAJSON_LABELS", r#"{"app":"ztunnel","rev":1}"#),
        ("INPOD_UDS", socket.as_str()),
        ("INPOD_ENABLED", "true"),
        ("PACKET_MARK", "1337"),
        ("INPOD_PORT_REUSE", "true"),
        ("ENABLE_ORIG_SRC", "true"),
        ("HTTP2_STREAM_WINDOW_SIZE", "1048576"),
        ("HTTP2_CONNECTION_WINDOW_SIZE", "8388608"),
        ("HTTP2_FRAME_SIZE", "65536"),
    ];
    let mut z = topo.node(1).spawn(
        bins::ztunnel(),
        &["proxy", "ztunnel"],
        &env,
        &topo.dir.join("ztunnel.log"),
    )?;
    z.wait_log("ztunnel ready", READY)?;
    let log = z.log_text();
    assert!(
        log.contains("INPOD_UDS is set: istio-cni captures"),
        "{log}"
    );
    assert!(
        log.contains("workload certificates from the Istio CA"),
        "{log}"
    );
    assert!(
        !log.contains("\twarn\t"),
        "Istio's values we support give no warning:\n{log}"
    );
    wait_for_async("ready (xDS and the ZDS snapshot)", READY, || async {
        Ok(readiness(topo.node(1), "127.0.0.1:15021".parse()?).await?.0 == 200)
    })
    .await
    .map_err(|e| e.context(z.log_text()))?;
    {
        let r = istiod.res.lock().unwrap();
        let own = r
            .issued
            .iter()
            .find(|i| i.identity == ZTUNNEL_ID)
            .context("no certificate for ztunnel itself")?;
        assert_eq!(own.validity_secs, 12 * 3600, "SECRET_TTL=12h");
        assert_eq!(
            own.headers.get("x-ca-tenant").map(String::as_str),
            Some("t2"),
            "{:?}",
            own.headers
        );
        assert!(
            !own.headers.contains_key("x-tenant"),
            "xDS headers stay on xDS"
        );
        let seen = r
            .seen
            .iter()
            .find(|s| s.node_metadata.is_some())
            .context("no xDS request with a node")?;
        assert_eq!(
            seen.headers.get("x-tenant").map(String::as_str),
            Some("t1"),
            "{:?}",
            seen.headers
        );
        assert_eq!(
            seen.node_id.as_deref(),
            Some("ztunnel~10.0.0.1~ztunnel-abcde.istio-system~istio-system.svc.cluster.local")
        );
        let md = &seen.node_metadata.as_ref().context("metadata")?.fields;
        use prost_types::value::Kind;
        assert_eq!(
            md.get("DNS_CAPTURE").and_then(|v| v.kind.clone()),
            Some(Kind::StringValue("true".into())),
            "{md:?}"
        );
        let Some(Some(Kind::StructValue(labels))) = md.get("LABELS").map(|v| v.kind.clone()) else {
            panic!("LABELS: {md:?}")
        };
        assert_eq!(
            labels.fields.get("app").and_then(|v| v.kind.clone()),
            Some(Kind::StringValue("ztunnel".into()))
        );
        assert_eq!(
            labels.fields.get("rev").and_then(|v| v.kind.clone()),
            Some(Kind::NumberValue(1.0))
        );
    }
    // /config_dump in upstream's shape (as istioctl ztunnel-config decodes it), with
    // Istio's config field names and this start's settings.
    let (code, body) = http_get(topo.node(1), "127.0.0.1:15000".parse()?, "/config_dump").await?;
    assert_eq!(code, 200, "{body}");
    let dump: serde_json::Value = serde_json::from_str(&body)?;
    let schema: serde_json::Value = serde_json::from_str(include_str!(
        "../../../ztunnel/tests/data/config_dump.schema.json"
    ))?;
    let bad = json_schema::violations(&schema, &dump);
    assert!(bad.is_empty(), "{bad:#?}");
    let c = &dump["config"];
    assert_eq!(c["localNode"], "node1");
    assert_eq!(c["xdsAddress"], format!("https://{ISTIOD}"));
    assert_eq!(c["caAddress"], format!("https://{ISTIOD}"));
    assert_eq!(
        c["secretTtl"],
        serde_json::json!({"secs": 43200, "nanos": 0})
    );
    assert_eq!(c["poolUnusedReleaseTimeout"]["secs"], 120);
    assert_eq!(c["selfTerminationDeadline"]["secs"], 3);
    assert_eq!(c["numWorkerThreads"], 2, "50% of ZTUNNEL_CPU_LIMIT=4");
    assert_eq!(c["socketConfig"]["keepaliveTime"]["secs"], 60);
    assert_eq!(
        c["xdsHeaders"],
        serde_json::json!([["x-tenant", "<redacted>"]])
    );
    assert_eq!(c["proxyMetadata"]["DNS_CAPTURE"], "true");
    assert_eq!(
        c["adminAddr"],
        serde_json::json!({"Localhost": [false, 15000]})
    );
    assert_eq!(
        (
            c["windowSize"].as_u64(),
            c["connectionWindowSize"].as_u64(),
            c["frameSize"].as_u64()
        ),
        (Some(1_048_576), Some(8_388_608), Some(65_536))
    );
    let own = dump["certificates"]
        .as_array()
        .context("certificates")?
        .iter()
        .find(|c| c["identity"] == ZTUNNEL_ID)
        .context("own certificate")?;
    assert_eq!(own["rootCerts"].as_array().map(Vec::len), Some(1), "{own}");

    z.terminate()?;
    anyhow::ensure!(
        z.wait_exit(Duration::from_secs(10)).is_some(),
        "ztunnel did not exit on SIGTERM"
    );

    // What we cannot honour without weakening security refuses the start, naming the variable.
    for (name, value, want) in [
        // A CRL file that cannot be read (here a directory) refuses the start, naming it.
        ("CRL_PATH", "/", "CRL_PATH"),
        ("CA_ROOT_CA", "SYSTEM", "CA_ROOT_CA=SYSTEM"),
        ("PACKET_MARK", "42", "PACKET_MARK"),
        // Post-quantum key exchange asked for, which ring cannot do: no silent X25519.
        (
            "COMPLIANCE_POLICY",
            "pqc",
            "COMPLIANCE_POLICY=\"pqc\" is not supported",
        ),
        ("INPOD_PORT_REUSE", "maybe", "INPOD_PORT_REUSE"),
        // h2 would panic on a frame size outside HTTP/2's range: refused at start instead.
        ("HTTP2_FRAME_SIZE", "1024", "HTTP2_FRAME_SIZE"),
    ] {
        let mut env: Vec<(&str, &str)> = env.iter().copied().filter(|(k, _)| *k != name).collect();
        env.push((name, value));
        let mut z = topo.node(1).spawn(
            bins::ztunnel(),
            &["proxy", "ztunnel"],
            &env,
            &topo.dir.join(format!("refused-{name}.log")),
        )?;
        let status = z
            .wait_exit(Duration::from_secs(10))
            .with_context(|| format!("{name}={value}: ztunnel kept running"))?;
        assert!(!status.success(), "{name}={value}: exit {status}");
        let log = z.log_text();
        assert!(log.contains(want), "{name}={value}: {log}");
    }
    Ok(())
}
