//! Our ztunnel under Istio's own control plane: istiod's discovery server with its
//! ambient index (tests/src/istio_xds.rs, a Go program on Istio's module) turns
//! Kubernetes objects (Pods, Services, a Gateway, AuthorizationPolicies) into the
//! workloads, services and policies our ztunnels receive. The fake istiod
//! (tests/src/fake_istiod.rs) serves only the CA here. What this catches that the xds
//! suite cannot: resources istiod really sends (and how: uids, TCP waypoints, hostname
//! waypoint addresses, policy names) that our own fake never would.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::fake_istiod::{http_get, FakeIstiod, ISTIOD, TOKEN};
use mesh_tests::istio_xds::*;
use mesh_tests::netsim::*;
use mesh_tests::{bins, http_app};

const SLEEP_ID: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const ECHO_ID: &str = "spiffe://cluster.local/ns/default/sa/echo";
const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/default/sa/waypoint";
const ECHO_VIP: &str = "10.96.0.10";
/// Pods in the mesh carry this (istio-cni sets it once it captured the pod): istiod
/// then describes them as HBONE workloads.
const CAPTURED: (&str, &str) = ("ambient.istio.io/redirection", "enabled");

/// A topology whose ztunnels take their state from Istio's discovery server.
struct IstioMesh {
    // Dropped in this order: Istio's server, then the CA, then the ztunnels and the
    // topology (whose netns the two servers run in).
    istio: IstioXds,
    ca: FakeIstiod,
    mesh: Mesh,
}

impl IstioMesh {
    /// Builds the topology, starts Istio's discovery server on node 1 with the objects
    /// `objects` makes for it, the fake istiod's CA beside it, and a ztunnel per node
    /// with `enrolled` pods enrolled at start (by istiod's pod uid).
    fn start(
        tag: &str,
        pods_per_node: &[usize],
        enrolled: &[&str],
        objects: impl FnOnce(&Topology) -> String,
    ) -> Result<IstioMesh> {
        IstioMesh::start_with_mesh(tag, pods_per_node, enrolled, None, objects)
    }

    /// As `start`, with istiod's MeshConfig `mesh` (YAML); an `enrolled` entry
    /// `namespace/pod` is a pod of that namespace (else of default).
    fn start_with_mesh(
        tag: &str,
        pods_per_node: &[usize],
        enrolled: &[&str],
        mesh: Option<&str>,
        objects: impl FnOnce(&Topology) -> String,
    ) -> Result<IstioMesh> {
        // IPv4 whatever ZTUNNEL_TEST_IP_FAMILY says: the servers' addresses and the VIPs are.
        let topo = Topology::build_family(&prefix(tag), pods_per_node, IpFamily::V4)?;
        let token = topo.dir.join("istio-token");
        std::fs::write(&token, TOKEN)?;
        let ca = FakeIstiod::start(topo.node(1), ISTIOD.parse()?, &topo.dir)?;
        let istio = IstioXds::start_with_mesh(
            topo.node(1),
            ISTIO_XDS.parse()?,
            &topo.dir,
            &objects(&topo),
            mesh,
        )?;
        let env = istio.env(&ca, &token);
        let node_args: Vec<Vec<String>> = (1..=topo.nodes.len())
            .map(|n| {
                enrolled
                    .iter()
                    .map(|e| e.split_once('/').unwrap_or(("default", e)))
                    .map(|(ns, p)| (ns, topo.pod(p)))
                    .filter(|(_, p)| p.node == n)
                    .flat_map(|(ns, p)| {
                        [
                            "--pod".to_string(),
                            format!("{}={}", pod_uid(ns, &p.name), p.netns.path().display()),
                        ]
                    })
                    .collect()
            })
            .collect();
        let mesh = Mesh::start_with_istiod(topo, &node_args, &env)
            .with_context(|| format!("istio-xds log:\n{}", istio.log_text()))?;
        Ok(IstioMesh { istio, ca, mesh })
    }

    /// Fails naming the resources if a ztunnel NACKed anything istiod sent.
    fn no_nacks(&self) -> Result<()> {
        for (n, z) in self.mesh.ztunnels.iter().enumerate() {
            let log = z.log_text();
            anyhow::ensure!(
                log.contains("xDS update applied (ACK)"),
                "node{}'s ztunnel applied no xDS update:\n{log}",
                n + 1
            );
            if let Some(nack) = log.lines().find(|l| l.contains("(NACK)")) {
                anyhow::bail!("node{}'s ztunnel NACKed what istiod sent: {nack}", n + 1);
            }
        }
        Ok(())
    }
}

/// The objects both tests start from: namespace default in ambient, two nodes.
fn base_objects() -> Vec<String> {
    vec![
        ambient_namespace_yaml("default"),
        node_yaml("node1"),
        node_yaml("node2"),
    ]
}

fn echo_service(extra_labels: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: echo\n  namespace: default\n  labels: {{{extra_labels}}}\n\
         spec:\n  clusterIP: {ECHO_VIP}\n  selector: {{app: echo}}\n  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]\n"
    )
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

/// istiod turns a Namespace, Pods and a Service into the workloads and service our
/// ztunnels route by: TCP through the Service VIP is carried over HBONE with both
/// identities, every resource is ACKed, and an AuthorizationPolicy created while the
/// mesh runs reaches the server's ztunnel, which then denies the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiods_xds_carries_hbone_between_pods() -> Result<()> {
    let m = IstioMesh::start("ia", &[1, 1], &["n1p1", "n2p1"], |t| {
        let mut o = base_objects();
        o.push(pod_yaml(
            t.pod("n1p1"),
            "default",
            "sleep",
            &[("app", "sleep")],
            &[CAPTURED],
        ));
        o.push(pod_yaml(
            t.pod("n2p1"),
            "default",
            "echo",
            &[("app", "echo")],
            &[CAPTURED],
        ));
        o.push(echo_service(""));
        docs(&o)
    })?;
    let t = &m.mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, Some("n2p1"))?;
    let vip: SocketAddr = format!("{ECHO_VIP}:80").parse()?;

    // Through the VIP, over HBONE, both identities in the access logs.
    let mut s = client.netns.connect(vip).await?;
    let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .context("no greeting")?
        .with_context(|| m.mesh.logs())?;
    assert_eq!(who, "n2p1");
    assert_eq!(echo_roundtrip(&mut s, b"over hbone").await?, b"over hbone");
    drop(s);
    m.mesh.wait_logs(&[
        &format!("src.identity={SLEEP_ID}"),
        &format!("dst.identity={ECHO_ID}"),
    ])?;
    m.no_nacks()?;

    // What istiod sent, as ztunnel holds it: the pods by istiod's uid, HBONE, on their
    // nodes; the service with its VIP.
    let (code, body) = http_get(t.node(1), "127.0.0.1:15000".parse()?, "/config_dump").await?;
    assert_eq!(code, 200, "{body}");
    let dump: serde_json::Value = serde_json::from_str(&body).context("config_dump is not JSON")?;
    let workloads = dump["workloads"].as_array().context("workloads")?;
    let echo = workloads
        .iter()
        .find(|w| w["uid"] == pod_uid("default", "n2p1").as_str())
        .with_context(|| format!("no n2p1 in {workloads:?}"))?;
    assert_eq!(echo["protocol"], "HBONE", "{echo}");
    assert_eq!(echo["node"], "node2", "{echo}");
    let services = dump["services"].as_array().context("services")?;
    let svc = services
        .iter()
        .find(|s| s["hostname"] == "echo.default.svc.cluster.local")
        .with_context(|| format!("no echo in {services:?}"))?;
    assert!(
        svc["vips"].as_array().is_some_and(|v| v
            .iter()
            .any(|v| v.as_str().is_some_and(|v| v.ends_with(ECHO_VIP)))),
        "{svc}"
    );
    // As Istio's ztunnel: istiod's cluster (named or defaulted to Kubernetes), our own
    // certificate's pem as base64 of the PEM text, and istiod found our ISTIO_VERSION.
    assert_eq!(echo["clusterId"], "Kubernetes", "{echo}");
    let pem = dump["certificates"][0]["certChain"][0]["pem"]
        .as_str()
        .with_context(|| format!("{:#}", dump["certificates"]))?;
    assert!(
        pem.starts_with("LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t"),
        "not base64 of a PEM: {pem}"
    );
    let istiod_log = m.istio.log_text();
    // (istiod's own log is there: the warning would be beside this line.)
    assert!(
        istiod_log.contains("ADS: new delta connection for node:"),
        "{istiod_log}"
    );
    assert!(
        !istiod_log.contains("Istio Version is not found in metadata"),
        "{istiod_log}"
    );

    // A DENY policy for the client's principal, created at run time.
    m.istio.apply(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-sleep, namespace: default}\n\
         spec:\n  action: DENY\n  rules:\n  - from: [{source: {principals: [\"cluster.local/ns/default/sa/sleep\"]}}]\n",
    )?;
    let server_ztunnel = &m.mesh.ztunnels[1];
    wait_for(
        "the policy pushed to node2's ztunnel",
        Duration::from_secs(15),
        || {
            server_ztunnel
                .log_text()
                .contains("kind=\"authorizations\" updated=1 removed=0")
        },
    )
    .with_context(|| format!("{}\nistio-xds:\n{}", m.mesh.logs(), m.istio.log_text()))?;
    assert_eq!(
        greeting(client, vip).await,
        None,
        "the DENY policy did not deny:\n{}",
        m.mesh.logs()
    );
    m.mesh.wait_logs(&["denied by DENY policy", "deny-sleep"])?;
    m.no_nacks()?;
    // Removed again: the client is let through.
    m.istio.delete("apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-sleep, namespace: default}\n")?;
    wait_for(
        "the policy's removal pushed to node2's ztunnel",
        Duration::from_secs(15),
        || {
            server_ztunnel
                .log_text()
                .contains("kind=\"authorizations\" updated=0 removed=1")
        },
    )
    .with_context(|| m.mesh.logs())?;
    assert_eq!(
        greeting(client, vip).await.as_deref(),
        Some("n2p1"),
        "{}",
        m.mesh.logs()
    );
    m.no_nacks()
}

/// A waypoint as Istio deploys one: a Gateway of class istio-waypoint and a pod from
/// Istio's waypoint template (not captured: `istio.io/dataplane-mode: none`, no
/// redirection annotation, so istiod describes it as a TCP workload) behind Service
/// `waypoint`; Service `echo` uses it (`istio.io/use-waypoint`), so istiod gives echo a
/// waypoint by hostname. Our ztunnel must still reach the waypoint over HBONE on 15008;
/// our waypoint (its L7 config from a local file) applies a DENY on /admin*.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_waypoint_as_istiod_describes_it_serves_its_service() -> Result<()> {
    let m = IstioMesh::start("ib", &[2, 1], &["n1p1", "n2p1"], |t| {
        let mut o = base_objects();
        o.push(pod_yaml(
            t.pod("n1p1"),
            "default",
            "sleep",
            &[("app", "sleep")],
            &[CAPTURED],
        ));
        o.push(pod_yaml(
            t.pod("n2p1"),
            "default",
            "echo",
            &[("app", "echo")],
            &[CAPTURED],
        ));
        o.push(echo_service("istio.io/use-waypoint: waypoint"));
        o.push(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: istio-waypoint}\n\
             spec: {controllerName: istio.io/mesh-controller}\n"
                .into(),
        );
        // As the gateway controller leaves it once the deployment is ready: its address
        // is the Service's hostname.
        o.push(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: waypoint, namespace: default}\n\
             spec:\n  gatewayClassName: istio-waypoint\n  listeners: [{name: mesh, port: 15008, protocol: HBONE}]\n\
             status:\n  addresses: [{type: Hostname, value: waypoint.default.svc.cluster.local}]\n"
                .into(),
        );
        // Istio's waypoint template (manifests/.../files/waypoint.yaml): the pod's labels,
        // the Service's ports (status-port 15021/tcp, the listener mesh 15008/hbone).
        o.push(pod_yaml(
            t.pod("n1p2"),
            "default",
            "waypoint",
            &[
                ("gateway.networking.k8s.io/gateway-name", "waypoint"),
                (
                    "gateway.networking.k8s.io/gateway-class-name",
                    "istio-waypoint",
                ),
                ("istio.io/dataplane-mode", "none"),
                ("sidecar.istio.io/inject", "false"),
                ("service.istio.io/canonical-name", "waypoint"),
                ("service.istio.io/canonical-revision", "latest"),
            ],
            &[],
        ));
        o.push(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: waypoint\n  namespace: default\n\
             \x20 labels: {gateway.networking.k8s.io/gateway-name: waypoint, gateway.networking.k8s.io/gateway-class-name: istio-waypoint}\n\
             spec:\n  clusterIP: 10.96.0.15\n  selector: {gateway.networking.k8s.io/gateway-name: waypoint}\n\
             \x20 ports:\n  - {name: status-port, port: 15021, protocol: TCP, appProtocol: tcp}\n  - {name: mesh, port: 15008, protocol: TCP, appProtocol: hbone}\n"
                .into(),
        );
        docs(&o)
    })?;
    let t = &m.mesh.topo;
    let wp = t.pod("n1p2");
    // What this test is about: istiod sends the waypoint pod as a TCP workload, and
    // echo's waypoint by hostname.
    let (code, body) = http_get(t.node(1), "127.0.0.1:15000".parse()?, "/config_dump").await?;
    assert_eq!(code, 200, "{body}");
    let dump: serde_json::Value = serde_json::from_str(&body).context("config_dump is not JSON")?;
    let workloads = dump["workloads"].as_array().context("workloads")?;
    let wp_uid = pod_uid("default", "n1p2");
    let w = workloads
        .iter()
        .find(|w| w["uid"] == wp_uid.as_str())
        .with_context(|| format!("no waypoint pod in {workloads:?}"))?;
    assert_eq!(w["protocol"], "TCP", "{w}");
    let services = dump["services"].as_array().context("services")?;
    let echo = services
        .iter()
        .find(|s| s["hostname"] == "echo.default.svc.cluster.local")
        .with_context(|| format!("no echo in {services:?}"))?;
    assert!(
        echo["waypoint"]
            .to_string()
            .contains("waypoint.default.svc.cluster.local"),
        "{echo}"
    );

    // Our waypoint in the waypoint pod: certificates from the same CA as the ztunnels,
    // its L7 config (routes, policy) from a local file.
    let cfg = format!(
        "workloads:\n{}{}{}services:\n\
         - {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/{ECHO_VIP}\"], ports: {{80: 8080}}, waypoint: {{destination: \"/{}\"}}}}\n\
         authorizationPolicies:\n\
         - {{name: deny-admin, namespace: default, targetRefs: [{{kind: Service, group: \"\", name: echo}}], action: DENY, rules: [{{to: [{{operation: {{paths: [\"/admin*\"]}}}}]}}]}}\n",
        workload(t, "n1p1", "sleep", ""),
        waypoint_workload(t, "n1p2", "waypoint", ""),
        workload(t, "n2p1", "echo", ", services: {default/echo.default.svc.cluster.local: {80: 8080}}"),
        wp.ip,
    );
    let cfg_path = t.dir.join("waypoint.yaml");
    std::fs::write(&cfg_path, cfg)?;
    let token = t.dir.join("istio-token");
    let ca_env: Vec<(String, String)> = m
        .istio
        .env(&m.ca, &token)
        .into_iter()
        .filter(|(k, _)| !k.starts_with("XDS_") && k != "ALT_XDS_HOSTNAME")
        .collect();
    let mut env: Vec<(&str, &str)> = ca_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.push(("RUST_LOG", "info"));
    let cfg_arg = cfg_path.display().to_string();
    let state = t.dir.join("waypoint-state").display().to_string();
    let waypoint = wp.netns.spawn(
        bins::waypoint(),
        &[
            "--local-xds-path",
            &cfg_arg,
            "--workload-uid",
            "n1p2",
            "--gateway-name",
            "waypoint",
            "--state-dir",
            &state,
        ],
        &env,
        &t.dir.join("waypoint.log"),
    )?;
    waypoint.wait_log("waypoint ready", READY)?;
    let _app = http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false)?;

    let mut c = http_app::H1Client::connect(
        &t.pod("n1p1").netns,
        format!("{ECHO_VIP}:80").parse()?,
        "echo.default.svc.cluster.local",
    )
    .await?;
    let r = c
        .get("/")
        .await
        .with_context(|| format!("{}\nwaypoint:\n{}", m.mesh.logs(), waypoint.log_text()))?;
    assert_eq!(
        r.status,
        200,
        "{r:?}\n{}\nwaypoint:\n{}",
        m.mesh.logs(),
        waypoint.log_text()
    );
    assert_eq!(r.pod(), "n2p1", "{r:?}");
    let r = c.get("/admin").await?;
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(r.body.trim(), "RBAC: access denied");
    drop(c);
    wait_for(
        "the waypoint's denial in its log",
        Duration::from_secs(5),
        || {
            waypoint
                .log_text()
                .contains("authz.denied_by=\"default/deny-admin\"")
        },
    )
    .with_context(|| waypoint.log_text())?;
    // The client's ztunnel went to the waypoint pod's address, on 15008, over HBONE.
    m.mesh.wait_logs(&[
        &format!("dst.addr={}", SocketAddr::new(wp.ip, 15008)),
        &format!("dst.identity={WAYPOINT_ID}"),
    ])?;
    let wl = waypoint.log_text();
    assert!(
        wl.contains(&format!("src.identity={SLEEP_ID}")) && wl.contains("dst.workload=\"n2p1\""),
        "{wl}"
    );
    m.no_nacks()
}

/// Polls node `node`'s `/config_dump` until `ready` holds for it; returns the dump.
async fn dump_when(
    m: &IstioMesh,
    node: usize,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (code, body) = http_get(
            m.mesh.topo.node(node),
            "127.0.0.1:15000".parse()?,
            "/config_dump",
        )
        .await?;
        anyhow::ensure!(code == 200, "{body}");
        let dump: serde_json::Value =
            serde_json::from_str(&body).context("config_dump is not JSON")?;
        if ready(&dump) {
            return Ok(dump);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "node{node}'s dump never showed {what}:\n{dump:#}\nistio-xds:\n{}",
            m.istio.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn policy_in(dump: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
    dump["policies"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .cloned()
}

/// Whether the dump holds policy `default/name` and pod `pod`'s workload lists it.
fn selects(dump: &serde_json::Value, pod: &str, name: &str) -> bool {
    let uid = pod_uid("default", pod);
    let listed = dump["workloads"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["uid"] == uid.as_str()))
        .is_some_and(|w| {
            w["authorizationPolicies"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p == format!("default/{name}").as_str()))
        });
    listed && policy_in(dump, name).is_some()
}

/// A DENY whose rule has only HTTP attributes (`to.operation.methods`) on a workload
/// without a waypoint: istiod sends it as one empty match, which Istio's ztunnel skips,
/// so the DENY does nothing at L4 (istiod warns it has no effect). An ALLOW with only
/// HTTP attributes comes without rules and so allows nothing: the workload is then
/// closed to every client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_only_rules_at_l4_decide_as_istios_ztunnel() -> Result<()> {
    let m = IstioMesh::start("ic", &[1, 1], &["n1p1", "n2p1"], |t| {
        let mut o = base_objects();
        o.push(pod_yaml(
            t.pod("n1p1"),
            "default",
            "sleep",
            &[("app", "sleep")],
            &[CAPTURED],
        ));
        o.push(pod_yaml(
            t.pod("n2p1"),
            "default",
            "echo",
            &[("app", "echo")],
            &[CAPTURED],
        ));
        o.push(echo_service(""));
        o.push(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-delete, namespace: default}\n\
             spec:\n  selector: {matchLabels: {app: echo}}\n  action: DENY\n  rules:\n  - to: [{operation: {methods: [DELETE]}}]\n"
                .into(),
        );
        docs(&o)
    })?;
    let t = &m.mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, Some("n2p1"))?;
    let vip: SocketAddr = format!("{ECHO_VIP}:80").parse()?;

    // The server's ztunnel holds the DENY as istiod sent it (one empty match) and its
    // workload lists it.
    let dump = dump_when(&m, 2, "deny-delete", |d| selects(d, "n2p1", "deny-delete")).await?;
    let p = policy_in(&dump, "deny-delete").context("deny-delete")?;
    assert_eq!(p["action"], "Deny", "{p}");
    assert_eq!(p["rules"], serde_json::json!([[[{}]]]), "{p}");
    assert_eq!(
        greeting(client, vip).await.as_deref(),
        Some("n2p1"),
        "an HTTP-only DENY denied at L4:\n{}",
        m.mesh.logs()
    );
    assert_eq!(
        greeting(client, SocketAddr::new(server.ip, 8080))
            .await
            .as_deref(),
        Some("n2p1"),
        "{}",
        m.mesh.logs()
    );
    assert!(
        !m.mesh.logs().contains("denied by DENY policy"),
        "{}",
        m.mesh.logs()
    );

    // An ALLOW for GET only: istiod drops the rule, the ALLOW has none, nothing is allowed.
    m.istio.apply(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: allow-get, namespace: default}\n\
         spec:\n  selector: {matchLabels: {app: echo}}\n  action: ALLOW\n  rules:\n  - to: [{operation: {methods: [GET]}}]\n",
    )?;
    let dump = dump_when(&m, 2, "allow-get", |d| selects(d, "n2p1", "allow-get")).await?;
    let p = policy_in(&dump, "allow-get").context("allow-get")?;
    assert!(p["rules"].as_array().is_none_or(|r| r.is_empty()), "{p}");
    assert_eq!(
        greeting(client, vip).await,
        None,
        "an ALLOW with no L4 rule let a client in:\n{}",
        m.mesh.logs()
    );
    m.mesh.wait_logs(&["no ALLOW policy matched"])?;
    m.no_nacks()
}

/// Multi-network names as istiod makes them: an east-west gateway (a Gateway of class
/// istio-remote labelled with its network) becomes a workload whose uid and name are
/// `NetworkGateway/<network>/<address>/<port>`. Both ztunnels take it (Istio's ztunnel
/// checks no name), and a ServiceEntry whose `subjectAltNames` are DNS names, not SPIFFE
/// ids, stays a service that carries traffic (the DNS SAN is ignored, as Istio's does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiods_multi_network_names_and_dns_sans_are_taken() -> Result<()> {
    const SE_VIP: &str = "10.96.0.20";
    let m = IstioMesh::start("id", &[1, 1], &["n1p1", "n2p1"], |t| {
        let mut o = base_objects();
        o.push(pod_yaml(
            t.pod("n1p1"),
            "default",
            "sleep",
            &[("app", "sleep")],
            &[CAPTURED],
        ));
        o.push(pod_yaml(
            t.pod("n2p1"),
            "default",
            "echo",
            &[("app", "echo")],
            &[CAPTURED],
        ));
        o.push(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\n\
             metadata: {name: eastwest, namespace: default, labels: {topology.istio.io/network: net-b}}\n\
             spec:\n  gatewayClassName: istio-remote\n  listeners: [{name: mesh, port: 15008, protocol: HBONE}]\n\
             status:\n  addresses: [{type: IPAddress, value: 172.18.0.9}]\n"
                .into(),
        );
        o.push(format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: echo-se, namespace: default}}\n\
             spec:\n  hosts: [echo.example.com]\n  addresses: [{SE_VIP}]\n  location: MESH_INTERNAL\n  resolution: STATIC\n\
             \x20 ports: [{{number: 80, name: tcp, protocol: TCP, targetPort: 8080}}]\n\
             \x20 workloadSelector: {{labels: {{app: echo}}}}\n  subjectAltNames: [echo.example.com]\n"
        ));
        docs(&o)
    })?;
    let t = &m.mesh.topo;
    let (client, server) = (t.pod("n1p1"), t.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, Some("n2p1"))?;
    for node in [1, 2] {
        let dump = dump_when(&m, node, "the network gateway and the ServiceEntry", |d| {
            let gw = d["workloads"].as_array().is_some_and(|ws| {
                ws.iter().any(|w| {
                    w["uid"]
                        .as_str()
                        .is_some_and(|u| u.starts_with("NetworkGateway/net-b/"))
                })
            });
            let se = d["services"]
                .as_array()
                .is_some_and(|ss| ss.iter().any(|s| s["hostname"] == "echo.example.com"));
            gw && se
        })
        .await?;
        let gw = dump["workloads"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| {
                w["uid"]
                    .as_str()
                    .is_some_and(|u| u.starts_with("NetworkGateway/"))
            })
            .context("gateway")?;
        assert_eq!(gw["uid"], "NetworkGateway/net-b/172.18.0.9/15008", "{gw}");
        assert_eq!(gw["name"], gw["uid"], "{gw}");
        assert_eq!(gw["network"], "net-b", "{gw}");
        let se = dump["services"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["hostname"] == "echo.example.com")
            .context("se")?;
        assert_eq!(
            se["subjectAltNames"],
            serde_json::json!(["echo.example.com"]),
            "{se}"
        );
    }
    let vip: SocketAddr = format!("{SE_VIP}:80").parse()?;
    assert_eq!(
        greeting(client, vip).await.as_deref(),
        Some("n2p1"),
        "{}",
        m.mesh.logs()
    );
    // Carried over HBONE to the workload's own identity; the DNS SAN is logged as ignored.
    m.mesh
        .wait_logs(&[&format!("dst.identity={ECHO_ID}"), "not a SPIFFE id"])?;
    m.no_nacks()
}

/// istiod's `serviceEntryVisibility` (MeshConfig) scopes the ServiceEntries of namespace
/// `private` to it: istiod sends them with visibility NAMESPACE (field 14), and our
/// ztunnel routes their VIP for that namespace's pods only; a public ServiceEntry is
/// sent `canonical` (field 11). A pod of another namespace reaching the VIP gets no
/// service (its connection passes through to the bare address, where nothing answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_entry_visibility_and_canonical_from_istiod() -> Result<()> {
    const PRIVATE_VIP: &str = "10.96.0.30";
    let mesh = "serviceEntryVisibility:\n  policies:\n  - visibility: NAMESPACE\n    matchingRules:\n    - namespaceSelector: {matchLabels: {se-visibility: namespace}}\n";
    let m = IstioMesh::start_with_mesh(
        "ie",
        &[2, 1],
        &["n1p1", "private/n1p2", "private/n2p1"],
        Some(mesh),
        |t| {
            let mut o = base_objects();
            o.push("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: private\n  labels: {istio.io/dataplane-mode: ambient, se-visibility: namespace}\n".into());
            o.push(pod_yaml(
                t.pod("n1p1"),
                "default",
                "sleep",
                &[("app", "sleep")],
                &[CAPTURED],
            ));
            o.push(pod_yaml(
                t.pod("n1p2"),
                "private",
                "sleep",
                &[("app", "sleep")],
                &[CAPTURED],
            ));
            o.push(pod_yaml(
                t.pod("n2p1"),
                "private",
                "echo",
                &[("app", "echo")],
                &[CAPTURED],
            ));
            let se = |ns: &str, host: &str, vip: &str| {
                format!(
                "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: se, namespace: {ns}}}\n\
                 spec:\n  hosts: [{host}]\n  addresses: [{vip}]\n  location: MESH_INTERNAL\n  resolution: STATIC\n\
                 \x20 ports: [{{number: 80, name: tcp, protocol: TCP, targetPort: 8080}}]\n  workloadSelector: {{labels: {{app: echo}}}}\n"
            )
            };
            o.push(se("private", "private.example.com", PRIVATE_VIP));
            o.push(se("default", "public.example.com", "10.96.0.31"));
            docs(&o)
        },
    )?;
    let t = &m.mesh.topo;
    let _echo = EchoServer::start(&t.pod("n2p1").netns, 8080, Some("n2p1"))?;
    let dump = dump_when(&m, 1, "both ServiceEntries", |d| {
        d["services"].as_array().is_some_and(|ss| {
            ["private.example.com", "public.example.com"]
                .iter()
                .all(|h| ss.iter().any(|s| s["hostname"] == *h))
        })
    })
    .await?;
    let svc = |h: &str| {
        dump["services"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["hostname"] == h)
            .cloned()
            .unwrap_or_default()
    };
    let (private, public) = (svc("private.example.com"), svc("public.example.com"));
    assert_eq!(
        (&private["visibility"], &private["canonical"]),
        (&serde_json::json!("Namespace"), &serde_json::json!(false)),
        "{private}"
    );
    assert_eq!(
        (&public["visibility"], &public["canonical"]),
        (&serde_json::json!("Public"), &serde_json::json!(true)),
        "{public}"
    );

    let vip: SocketAddr = format!("{PRIVATE_VIP}:80").parse()?;
    assert_eq!(
        greeting(t.pod("n1p2"), vip).await.as_deref(),
        Some("n2p1"),
        "from its own namespace:\n{}",
        m.mesh.logs()
    );
    m.mesh
        .wait_logs(&["dst.identity=spiffe://cluster.local/ns/private/sa/echo"])?;
    assert_eq!(
        greeting(t.pod("n1p1"), vip).await,
        None,
        "another namespace reached a NAMESPACE-visible service:\n{}",
        m.mesh.logs()
    );
    m.no_nacks()
}
