//! Our ztunnels under Istio's istiod itself: `pilot-discovery discovery` (Istio's Go
//! module, tests/istio) against a real kube-apiserver and etcd, with
//! kube-controller-manager making EndpointSlices (tests/kube), the cluster written as
//! Kubernetes and Istio would write it (Nodes, a namespace in ambient, pods scheduled on
//! nodes with their status written as a kubelet would and istio-cni's redirection
//! annotation, ServiceAccounts, the ztunnel pods in istio-system, a Service). The
//! ztunnels connect as in a cluster: xDS and CA at istiod's 15012, istiod's root from the
//! ConfigMap it writes, a projected-style token bound to their pod. Harness:
//! `mesh_tests::istiod`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use base64::Engine;
use mesh_tests::bins;
use mesh_tests::fake_istiod::{self, http_get};
use mesh_tests::istio_xds::pod_uid;
use mesh_tests::istiod::{self, Istiod};
use mesh_tests::kube_apiserver::{self, KubeApiServer};
use mesh_tests::netsim::*;
use serde_json::{json, Value};

/// The API server on node 1, beside istiod.
const API: &str = "10.0.0.1:6443";
/// Service echo's ClusterIP, in the API server's service range (10.254.0.0/16).
const ECHO_VIP: &str = "10.254.0.10";
const SLEEP_ID: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const ECHO_ID: &str = "spiffe://cluster.local/ns/default/sa/echo";

/// Everything the test started, stopped in this order on drop (also on failure):
/// istiod, the API server (controller manager, kube-apiserver, etcd), then the ztunnels
/// and the topology whose namespaces and directory the others used.
struct Cluster {
    istiod: Istiod,
    kube: KubeApiServer,
    /// Node 2's stand-in for istio-cni's node agent (ZDS).
    _cni: Child,
    pods_dir: PathBuf,
    mesh: Mesh,
}

impl Cluster {
    fn no_nacks(&self) -> Result<()> {
        self.mesh.no_nacks()
    }

    /// Enrolls pod `name` of node 2 over ZDS as istio-cni does once it set up the pod's
    /// network: by its Kubernetes uid, name, namespace and service account.
    async fn enroll(&self, name: &str, sa: &str) -> Result<()> {
        let uid = istiod::kube_uid(&self.kube, "default", name).await?;
        sh(
            bins::ztunnel(),
            &[
                "enroll",
                "--pods-dir",
                &self.pods_dir.display().to_string(),
                "--uid",
                &uid,
                "--name",
                name,
                "--namespace",
                "default",
                "--service-account",
                sa,
                "--netns",
                &self.mesh.topo.pod(name).netns.path().display().to_string(),
            ],
        )?;
        Ok(())
    }

    fn logs(&self) -> String {
        format!(
            "{}\n== istiod\n{}",
            self.mesh.logs(),
            self.istiod.log_tail(80)
        )
    }
}

/// A pod of namespace default in the mesh, scheduled on its node: istio-cni's
/// annotation says it is captured (istiod then sends it as HBONE). Its status comes
/// apart (`set_pod_running`, with the simulated pod's address).
async fn app_pod(kube: &KubeApiServer, p: &Pod, sa: &str, app: &str) -> Result<()> {
    kube.apply(&istiod::pod(
        "default",
        &p.name,
        &format!("node{}", p.node),
        sa,
        json!({"app": app}),
        json!({"ambient.istio.io/redirection": "enabled"}),
    ))
    .await?;
    Ok(())
}

/// Connects from `from` to `to` and reads the echo server's greeting; None when the
/// connection is refused, reset or closed before it (a denial).
async fn greeting(from: &Pod, to: SocketAddr) -> Option<String> {
    let mut s = from.netns.connect(to).await.ok()?;
    tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .ok()?
        .ok()
        .filter(|g| !g.is_empty())
}

/// The value of the first series of `name` carrying every label in `labels`.
fn series(scrape: &str, name: &str, labels: &[&str]) -> Option<u64> {
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// istiod (`pilot-discovery`) on a real API server serves our ztunnels as in a cluster:
/// each ztunnel authenticates with a token bound to its pod (audience istio-ca) and gets
/// its pods' certificates from istiod's CA by impersonation; every resource istiod sends
/// is ACKed; TCP from a pod on node 1 to Service echo's ClusterIP reaches the pod on node
/// 2 over HBONE with both identities. Then, at run time: an AuthorizationPolicy denying
/// port 8080 reaches node 2's ztunnel, which denies that port (its log and metrics say
/// by which policy) and not the Service's other port, until the policy is deleted; and a
/// pod created for the Service (enrolled at node 2 before istiod knew it) gets its
/// endpoint pushed and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiod_on_a_real_api_server_serves_our_ztunnels() -> Result<()> {
    let started = Instant::now();
    // IPv4 whatever ZTUNNEL_TEST_IP_FAMILY says: the servers' addresses and the VIP are.
    let topo = Topology::build_family(&prefix("istiod"), &[1, 2], IpFamily::V4)?;
    let mut kube = KubeApiServer::start(topo.node(1), API.parse()?, &topo.dir).await?;
    kube.start_controller_manager().await?;
    let mut crds = kube_apiserver::gateway_api_crds("standard")?;
    crds.extend(kube_apiserver::istio_crds()?);
    kube.install_crds(&crds).await?;
    let objects = [
        istiod::namespace("istio-system", json!({})),
        istiod::namespace("default", json!({"istio.io/dataplane-mode": "ambient"})),
        istiod::node("node1"),
        istiod::node("node2"),
        // No ServiceAccount controller runs: the accounts, as it and the charts make them.
        istiod::service_account("istio-system", "ztunnel"),
        istiod::service_account("default", "sleep"),
        istiod::service_account("default", "echo"),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "default"},
            "spec": {"clusterIP": ECHO_VIP, "selector": {"app": "echo"},
                     "ports": [{"name": "tcp-echo", "port": 80, "targetPort": 8080},
                               {"name": "tcp-other", "port": 81, "targetPort": 9090}]}}),
    ];
    for o in &objects {
        kube.apply(o).await?;
    }
    // Each node's ztunnel pod, as Istio's DaemonSet makes them (not in ambient).
    for n in 1..=2 {
        let name = format!("ztunnel-node{n}");
        kube.apply(&istiod::pod(
            istiod::ZTUNNEL_NS,
            &name,
            &format!("node{n}"),
            istiod::ZTUNNEL_SA,
            json!({"app": "ztunnel"}),
            json!({}),
        ))
        .await?;
        kube.set_pod_running(istiod::ZTUNNEL_NS, &name, &node_ip(n).to_string())
            .await?;
    }
    for (p, sa) in [("n1p1", "sleep"), ("n2p1", "echo")] {
        app_pod(&kube, topo.pod(p), sa, sa).await?;
        kube.set_pod_running("default", p, &topo.pod(p).ip.to_string())
            .await?;
    }

    let istiod = Istiod::start(topo.node(1), &kube, &topo.dir).await?;
    let root = istiod::root_cert(&kube, istiod::ZTUNNEL_NS)
        .await
        .with_context(|| istiod.log_tail(60))?;
    let root_path = topo.dir.join("istio-ca-root-cert.pem");
    std::fs::write(&root_path, &root)?;
    let mut node_env = Vec::new();
    for n in 1..=2 {
        let pod = format!("ztunnel-node{n}");
        let token = istiod::pod_token(
            &kube,
            istiod::ZTUNNEL_NS,
            istiod::ZTUNNEL_SA,
            &pod,
            istiod::AUDIENCE,
        )
        .await?;
        let token_path = topo.dir.join(format!("istio-token-node{n}"));
        std::fs::write(&token_path, token)?;
        node_env.push(istiod.ztunnel_env(&root_path, &token_path));
    }
    // Node 1 enrolls n1p1 at its start (by istiod's uid); node 2 takes its pods from
    // the node agent over ZDS, as under istio-cni.
    let (cni, pods_dir, socket) = fake_istiod::start_cni_agent(&topo, 2)?;
    let n1p1 = topo.pod("n1p1");
    let node_args = [
        vec![
            "--pod".to_string(),
            format!(
                "{}={}",
                pod_uid("default", "n1p1"),
                n1p1.netns.path().display()
            ),
        ],
        vec!["--zds-socket".to_string(), socket.display().to_string()],
    ];
    let mesh = Mesh::start_with_istiod_per_node(topo, &node_args, &[], &node_env)?;
    let c = Cluster {
        istiod,
        kube,
        _cni: cni,
        pods_dir,
        mesh,
    };
    let t = &c.mesh.topo;
    c.enroll("n2p1", "echo").await?;
    c.mesh.ztunnels[1]
        .wait_log("pod enrolled", READY)
        .with_context(|| c.logs())?;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, Some("n2p1"))?;
    let _other = EchoServer::start(&server.netns, 9090, Some("n2p1"))?;
    let vip: SocketAddr = format!("{ECHO_VIP}:80").parse()?;
    let vip_other: SocketAddr = format!("{ECHO_VIP}:81").parse()?;

    // Through the ClusterIP, over HBONE: both identities in the access logs.
    let mut s = client.netns.connect(vip).await?;
    let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .with_context(|| format!("no greeting\n{}", c.logs()))?
        .with_context(|| c.logs())?;
    assert_eq!(who, "n2p1");
    assert_eq!(echo_roundtrip(&mut s, b"over hbone").await?, b"over hbone");
    drop(s);
    c.mesh.wait_log_line(&[
        &format!("src.identity={SLEEP_ID}"),
        &format!("dst.identity={ECHO_ID}"),
    ])?;
    c.no_nacks()?;
    let istiod_log = c.istiod.log_text();
    assert!(
        istiod_log.contains("ADS: new delta connection for node:"),
        "{istiod_log}"
    );
    assert!(!istiod_log.contains("Unauthorized XDS"), "{istiod_log}");

    // What istiod sent, as node 2's ztunnel holds it; the server pod's certificate is
    // from istiod's CA (its root is the ConfigMap's).
    let (code, body) = http_get(t.node(2), "127.0.0.1:15000".parse()?, "/config_dump").await?;
    anyhow::ensure!(code == 200, "config_dump: {code} {body}");
    let dump: Value = serde_json::from_str(&body)?;
    let echo = dump["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["uid"] == pod_uid("default", "n2p1").as_str())
        .with_context(|| format!("no n2p1 in {}", dump["workloads"]))?;
    assert_eq!(
        (&echo["protocol"], &echo["node"], &echo["clusterId"]),
        (&json!("HBONE"), &json!("node2"), &json!("Kubernetes")),
        "{echo}"
    );
    let cert = dump["certificates"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["identity"] == ECHO_ID)
        .with_context(|| format!("no certificate for echo: {}", dump["certificates"]))?;
    let root_b64 = cert["rootCerts"][0]["pem"].as_str().unwrap_or_default();
    let root_pem = base64::engine::general_purpose::STANDARD.decode(root_b64)?;
    // The same certificate (the dump wraps its PEM lines at 60 columns, Go at 64).
    let body = |pem: &str| -> String { pem.split_whitespace().collect() };
    assert_eq!(
        body(&String::from_utf8_lossy(&root_pem)),
        body(&root),
        "{cert}"
    );

    // An AuthorizationPolicy created at run time: DENY to port 8080 of the echo pods.
    let policy = json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-echo-8080", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "echo"}}, "action": "DENY",
                 "rules": [{"to": [{"operation": {"ports": ["8080"]}}]}]}});
    c.kube.apply(&policy).await?;
    let server_ztunnel = &c.mesh.ztunnels[1];
    wait_for(
        "the policy pushed to node2's ztunnel",
        Duration::from_secs(30),
        || {
            server_ztunnel
                .log_text()
                .contains("kind=\"authorizations\" updated=1 removed=0")
        },
    )
    .with_context(|| c.logs())?;
    assert_eq!(
        greeting(client, vip).await,
        None,
        "port 8080 not denied:\n{}",
        c.logs()
    );
    c.mesh
        .wait_log_line(&["denied by DENY policy", "deny-echo-8080"])?;
    // The Service's other port (9090 on the pod) is not in the rule.
    assert_eq!(
        greeting(client, vip_other).await.as_deref(),
        Some("n2p1"),
        "{}",
        c.logs()
    );
    let (code, scrape) = http_get(t.node(2), "127.0.0.1:15020".parse()?, "/metrics").await?;
    anyhow::ensure!(code == 200, "metrics: {code}");
    assert!(
        series(
            &scrape,
            "istio_tcp_connections_failed_total",
            &[
                "reporter=\"destination\"",
                &format!("source_principal=\"{SLEEP_ID}\""),
                "response_flags=\"DENY\"",
            ]
        )
        .is_some_and(|n| n >= 1),
        "{scrape}"
    );
    c.no_nacks()?;
    // Deleted: the removal is pushed and port 8080 answers again.
    c.kube.delete(&policy).await?;
    wait_for(
        "the policy's removal pushed to node2's ztunnel",
        Duration::from_secs(30),
        || {
            server_ztunnel
                .log_text()
                .contains("kind=\"authorizations\" updated=0 removed=1")
        },
    )
    .with_context(|| c.logs())?;
    assert_eq!(
        greeting(client, vip).await.as_deref(),
        Some("n2p1"),
        "{}",
        c.logs()
    );

    // A pod added at run time, as a kubelet and istio-cni bring it up: created, enrolled
    // over ZDS (node 2's ztunnel holds it Pending: istiod does not know it), then its
    // status written; kube-controller-manager adds it to Service echo's EndpointSlice,
    // istiod pushes the workload and the endpoint, and the pod serves.
    let _added = EchoServer::start(&t.pod("n2p2").netns, 9090, Some("n2p2"))?;
    app_pod(&c.kube, t.pod("n2p2"), "echo", "echo").await?;
    c.enroll("n2p2", "echo").await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http_get(t.node(2), "127.0.0.1:15000".parse()?, "/config_dump").await?;
        let dump: Value = serde_json::from_str(&body)?;
        let state = dump["workloadState"]
            .as_object()
            .into_iter()
            .flatten()
            .find(|(_, s)| s["info"]["name"] == "n2p2")
            .map(|(_, s)| s["state"].clone());
        if state == Some(json!("Pending")) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "n2p2 not Pending on node 2 ({state:?}): {}",
            dump["workloadState"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.kube
        .set_pod_running("default", "n2p2", &t.pod("n2p2").ip.to_string())
        .await?;
    wait_for("n2p2 enrolled", Duration::from_secs(30), || {
        c.mesh.ztunnels[1]
            .log_text()
            .matches("pod enrolled")
            .count()
            >= 2
    })
    .with_context(|| c.logs())?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if greeting(client, vip_other).await.as_deref() == Some("n2p2") {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the added pod never answered through the Service:\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.no_nacks()?;
    eprintln!("istiod test done in {:.1?}", started.elapsed());
    Ok(())
}
