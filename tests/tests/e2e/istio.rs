//! Our ztunnel under Istio's own control plane: istiod's discovery server with its
//! ambient index (tests/src/istio_xds.rs, a Go program on Istio's module) turns
//! Kubernetes objects (Pods, Services, a Gateway, AuthorizationPolicies) into the
//! workloads, services and policies our ztunnels receive, and the same program serves
//! Istio's CA, from which the ztunnels (each as its node's ztunnel pod, impersonating
//! the pods of its node) and the waypoint get their certificates. What this catches that
//! the xds suite cannot: resources istiod really sends (and how: uids, TCP waypoints,
//! hostname waypoint addresses, policy names) that our own fake never would, and what
//! Istio's CA and its node authorizer accept and refuse.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::fake_istiod::http_get;
use mesh_tests::istio_xds::*;
use mesh_tests::netsim::*;
use mesh_tests::{bins, http_app};

const SLEEP_ID: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const ECHO_ID: &str = "spiffe://cluster.local/ns/default/sa/echo";
const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/default/sa/waypoint";
const ZTUNNEL_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/ztunnel";
const ECHO_VIP: &str = "10.96.0.10";
/// Pods in the mesh carry this (istio-cni sets it once it captured the pod): istiod
/// then describes them as HBONE workloads.
const CAPTURED: (&str, &str) = ("ambient.istio.io/redirection", "enabled");

/// A topology whose ztunnels take their state from Istio's discovery server.
struct IstioMesh {
    // Dropped in this order: Istio's server, then the ztunnels and the topology (whose
    // netns the server runs in).
    istio: IstioXds,
    mesh: Mesh,
}

impl IstioMesh {
    /// Builds the topology, starts Istio's discovery server and CA on node 1 with the
    /// objects `objects` makes for it (and istio-system's ztunnel pods), and a ztunnel
    /// per node with `enrolled` pods enrolled at start (by istiod's pod uid).
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
        let mut all = objects(&topo);
        all.push_str("---\n");
        all.push_str(&docs(
            &std::iter::once(istio_system_yaml())
                .chain((1..=topo.nodes.len()).map(ztunnel_pod_yaml))
                .collect::<Vec<_>>(),
        ));
        let istio =
            IstioXds::start_with_mesh(topo.node(1), ISTIO_XDS.parse()?, &topo.dir, &all, mesh)?;
        let node_env = (1..=topo.nodes.len())
            .map(|n| istio.ztunnel_env(n))
            .collect::<Result<Vec<_>>>()?;
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
        let mesh = Mesh::start_with_istiod_per_node(topo, &node_args, &[], &node_env)
            .with_context(|| format!("istio-xds log:\n{}", istio.log_text()))?;
        Ok(IstioMesh { istio, mesh })
    }

    fn no_nacks(&self) -> Result<()> {
        self.mesh.no_nacks()
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

/// Istio's waypoint `waypoint` for namespace default: the GatewayClass, the Gateway as
/// the gateway controller leaves it, the pod n1p2 from Istio's waypoint template (not
/// captured, so istiod describes it as a TCP workload) and its Service.
fn waypoint_objects(t: &Topology) -> Vec<String> {
    vec![
        "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: istio-waypoint}\n\
         spec: {controllerName: istio.io/mesh-controller}\n"
            .into(),
        // As the gateway controller leaves it once the deployment is ready: its address
        // is the Service's hostname.
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: waypoint, namespace: default}\n\
         spec:\n  gatewayClassName: istio-waypoint\n  listeners: [{name: mesh, port: 15008, protocol: HBONE}]\n\
         status:\n  addresses: [{type: Hostname, value: waypoint.default.svc.cluster.local}]\n"
            .into(),
        // Istio's waypoint template (manifests/.../files/waypoint.yaml): the pod's labels,
        // the Service's ports (status-port 15021/tcp, the listener mesh 15008/hbone).
        pod_yaml(
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
        ),
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: waypoint\n  namespace: default\n\
         \x20 labels: {gateway.networking.k8s.io/gateway-name: waypoint, gateway.networking.k8s.io/gateway-class-name: istio-waypoint}\n\
         spec:\n  clusterIP: 10.96.0.15\n  selector: {gateway.networking.k8s.io/gateway-name: waypoint}\n\
         \x20 ports:\n  - {name: status-port, port: 15021, protocol: TCP, appProtocol: tcp}\n  - {name: mesh, port: 15008, protocol: TCP, appProtocol: hbone}\n"
            .into(),
    ]
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
        o.extend(waypoint_objects(t));
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

    // Our waypoint in the waypoint pod: certificates from Istio's CA as the ztunnels'
    // (its own identity, with its own token: no impersonation), its L7 config (routes,
    // policy) from a local file.
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
    let token = m.istio.token("default", "waypoint", Some("n1p2"))?;
    let ca_env = m.istio.ca_env(&token);
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

/// Node1's ztunnel, with the token `token` makes (from Istio's token table), started
/// with a local state claiming that both sleep's pod (n1p1) and echo's pod (n1p2) run on
/// node1, while the cluster has echo's on node2, and asked to enroll both. Returns the
/// start's error (with the ztunnel's log) and Istio's log; fails if the ztunnel started.
async fn start_refused(
    tag: &str,
    token: impl FnOnce(&IstioXds) -> Result<std::path::PathBuf>,
) -> Result<(String, String)> {
    let topo = Topology::build_family(&prefix(tag), &[2], IpFamily::V4)?;
    let mut o = base_objects();
    o.push(pod_yaml(
        topo.pod("n1p1"),
        "default",
        "sleep",
        &[("app", "sleep")],
        &[CAPTURED],
    ));
    let on_node2 = pod_yaml(
        topo.pod("n1p2"),
        "default",
        "echo",
        &[("app", "echo")],
        &[CAPTURED],
    )
    .replace("nodeName: node1", "nodeName: node2");
    anyhow::ensure!(on_node2.contains("nodeName: node2"), "{on_node2}");
    o.push(on_node2);
    o.push(istio_system_yaml());
    o.push(ztunnel_pod_yaml(1));
    o.push(ztunnel_pod_yaml(2));
    let istio = IstioXds::start(topo.node(1), ISTIO_XDS.parse()?, &topo.dir, &docs(&o))?;
    let config = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "sleep", ""),
        workload(&topo, "n1p2", "echo", "")
    );
    let env = istio.ca_env(&token(&istio)?);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // Istio's log lives in the topology's directory, which a failed start removes: read
    // it through a handle opened before.
    let mut istio_log = std::fs::File::open(&istio.log)?;
    let mut read_log = move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut istio_log, &mut text).map(|_| text)
    };
    match Mesh::start(
        topo,
        &config,
        &["n1p1", "n1p2"],
        &std::collections::HashMap::new(),
        &env,
    ) {
        Ok(m) => anyhow::bail!(
            "the ztunnel started, both pods enrolled:\n{}\nistio-xds:\n{}",
            m.logs(),
            istio.log_text()
        ),
        Err(e) => Ok((format!("{e:#}"), read_log()?)),
    }
}

/// Istio's CA with its node authorizer (`CA_TRUSTED_NODE_ACCOUNTS`) refuses a node agent
/// that asks for an identity no pod of its node runs as. Node1's ztunnel, authenticated
/// as node1's ztunnel pod, believes echo's pod is on node1 (the cluster has it on
/// node2): it gets sleep's certificate (its pod is on node1) and enrolls it, and is
/// refused echo's, Istio logging why ("no instances of default/echo found on node
/// node1"); our ztunnel then fails the enrollment, naming the CA's answer. With the
/// token of a workload (sleep's pod, not a trusted node account) instead, even sleep's
/// own identity is refused as an impersonation ("not allowed to impersonate"); with a
/// token the cluster does not know, the caller is not authenticated at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_ca_refuses_identities_not_on_the_node() -> Result<()> {
    let refusal = "request impersonation authentication failure (Unauthenticated)";
    let (err, istio_log) = start_refused("if", |i| {
        i.token("istio-system", "ztunnel", Some("ztunnel-node1"))
    })
    .await?;
    assert!(
        err.contains(&format!("pod enrolled\tuid=n1p1 identity={SLEEP_ID}")),
        "sleep's pod was not enrolled:\n{err}"
    );
    assert!(
        err.contains(&format!(
            "the Istio CA gave no usable certificate for {ECHO_ID}: {refusal}"
        )),
        "{err}"
    );
    assert!(
        istio_log.contains(&format!("impersonation failed for identity {ECHO_ID}, error: no instances of \"default/echo\" found on node \"node1\"")),
        "{istio_log}"
    );
    assert!(
        !istio_log.contains(&format!("impersonation failed for identity {SLEEP_ID}")),
        "{istio_log}"
    );

    let (err, istio_log) =
        start_refused("ih", |i| i.token("default", "sleep", Some("n1p1"))).await?;
    assert!(
        err.contains(&format!(
            "the Istio CA gave no usable certificate for {SLEEP_ID}: {refusal}"
        )),
        "{err}"
    );
    assert!(
        istio_log.lines().any(|l| l.contains(&format!(
            "impersonation failed for identity {SLEEP_ID}, error: caller"
        )) && l.contains("is not allowed to impersonate")),
        "{istio_log}"
    );

    // A token the cluster does not know: Istio's authenticator refuses the caller.
    let (err, istio_log) = start_refused("ii", |i| {
        let p = i.root_path.with_file_name("unknown-token");
        std::fs::write(&p, "istio-token-of-nobody")?;
        Ok(p)
    })
    .await?;
    assert!(
        err.contains(&format!(
            "the Istio CA gave no usable certificate for {SLEEP_ID}: request authenticate failure (Unauthenticated)"
        )),
        "{err}"
    );
    assert!(
        istio_log
            .lines()
            .any(|l| l.contains("Failed to authenticate client")
                && l.contains("the token is not authenticated")),
        "{istio_log}"
    );
    Ok(())
}

/// The first certificate in `pem`, DER.
fn first_der(pem: &str) -> Result<Vec<u8>> {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .context("no certificate")?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(der.as_ref().to_vec())
}

/// The rows of an `istioctl` table (header dropped), each split at whitespace.
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Whether `v` is what Go's encoder writes for a zero value (istioctl re-encodes the
/// dump through its structs: a field we leave out comes back as its zero value).
fn go_zero(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::Bool(b) => !b,
        serde_json::Value::Number(n) => n.as_f64() == Some(0.0),
        serde_json::Value::String(s) => s.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.values().all(go_zero),
    }
}

/// Every field istioctl read from `ours` (its `-o json` value `theirs`) has our value, at
/// every depth: a field it does not know by our name would come back zero while ours is
/// not (and one of the wrong type fails its whole parse).
fn same_fields(what: &str, ours: &serde_json::Value, theirs: &serde_json::Value) {
    use serde_json::Value;
    match theirs {
        v if go_zero(v) => assert!(go_zero(ours), "{what}: istioctl read {v}, ours is {ours}"),
        Value::Object(o) => {
            for (k, v) in o {
                same_fields(
                    &format!("{what}.{k}"),
                    ours.get(k).unwrap_or(&Value::Null),
                    v,
                );
            }
        }
        Value::Array(a) => {
            let mine = ours.as_array().cloned().unwrap_or_default();
            assert_eq!(
                mine.len(),
                a.len(),
                "{what}: ours {ours}, istioctl's {theirs}"
            );
            for (n, (m, t)) in mine.iter().zip(a).enumerate() {
                same_fields(&format!("{what}[{n}]"), m, t);
            }
        }
        v => assert_eq!(ours, v, "{what}"),
    }
}

/// `istioctl ztunnel-config` (Istio's own, from the pinned module) reads our ztunnel's
/// `/config_dump` as it reads Istio's ztunnel's: the workload, service, policy,
/// certificate and connection tables show the mesh istiod described (pods with their
/// node, protocol and waypoint, services with their VIP, waypoint and healthy
/// endpoints, an ALLOW and a DENY with their scope, the certificates Istio's CA issued,
/// a live connection from both ends), `all` shows every table, and `-o json` gives back
/// every field we dump under Istio's names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istioctl_reads_our_config_dump() -> Result<()> {
    let m = IstioMesh::start("ig", &[2, 1], &["n1p1", "n2p1"], |t| {
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
        o.extend(waypoint_objects(t));
        o.push(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: allow-sleep, namespace: default}\n\
             spec:\n  selector: {matchLabels: {app: echo}}\n  action: ALLOW\n  rules:\n  - from: [{source: {principals: [\"cluster.local/ns/default/sa/sleep\"]}}]\n"
                .into(),
        );
        o.push(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-intruder, namespace: default}\n\
             spec:\n  action: DENY\n  rules:\n  - from: [{source: {principals: [\"cluster.local/ns/default/sa/intruder\"]}}]\n"
                .into(),
        );
        docs(&o)
    })?;
    let t = &m.mesh.topo;
    let (client, server, wp) = (t.pod("n1p1"), t.pod("n2p1"), t.pod("n1p2"));
    let _echo = EchoServer::start(&server.netns, 8080, Some("n2p1"))?;
    // A connection held open while the dumps are taken (to the pod: echo's service
    // would go through its waypoint, which this test does not run).
    let mut conn = client
        .netns
        .connect(SocketAddr::new(server.ip, 8080))
        .await?;
    let who = tokio::time::timeout(Duration::from_secs(5), read_line(&mut conn))
        .await
        .context("no greeting")?
        .with_context(|| m.mesh.logs())?;
    assert_eq!(who, "n2p1");
    let up = |d: &serde_json::Value, uid: &str, dir: &str| {
        d["workloadState"][uid]["connections"][dir]
            .as_array()
            .is_some_and(|c| !c.is_empty())
    };
    let policies = |d: &serde_json::Value| {
        policy_in(d, "allow-sleep").is_some() && policy_in(d, "deny-intruder").is_some()
    };
    let sleep_uid = pod_uid("default", "n1p1");
    let echo_uid = pod_uid("default", "n2p1");
    let d1 = dump_when(&m, 1, "the outbound connection", |d| {
        up(d, &sleep_uid, "outbound") && policies(d)
    })
    .await?;
    let d2 = dump_when(&m, 2, "the inbound connection", |d| {
        up(d, &echo_uid, "inbound") && policies(d)
    })
    .await?;
    let f1 = t.dir.join("dump-node1.json");
    let f2 = t.dir.join("dump-node2.json");
    std::fs::write(&f1, serde_json::to_string_pretty(&d1)?)?;
    std::fs::write(&f2, serde_json::to_string_pretty(&d2)?)?;
    let (f1, f2) = (f1.display().to_string(), f2.display().to_string());
    let ctl = |cmd: &str, file: &str| istioctl(&["ztunnel-config", cmd, "-f", file]);

    // Workloads: every pod with its address, node, waypoint and protocol.
    let w = ctl("workload", &f1)?;
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let (ip1, ip2, ipw) = (
        client.ip.to_string(),
        server.ip.to_string(),
        wp.ip.to_string(),
    );
    assert_eq!(
        rows(&w),
        vec![
            s(&["default", "n1p1", &ip1, "node1", "None", "HBONE"]),
            s(&["default", "n1p2", &ipw, "node1", "None", "TCP"]),
            s(&["default", "n2p1", &ip2, "node2", "None", "HBONE"]),
        ],
        "{w}"
    );
    // Services: VIP, waypoint by name, healthy endpoints of all.
    let sv = ctl("service", &f1)?;
    assert_eq!(
        rows(&sv),
        vec![
            s(&["default", "echo", ECHO_VIP, "waypoint", "1/1"]),
            s(&["default", "waypoint", "10.96.0.15", "None", "1/1"]),
        ],
        "{sv}"
    );
    // Policies: the ALLOW on echo's pods, the namespace-wide DENY.
    let p = ctl("policy", &f2)?;
    assert_eq!(
        rows(&p),
        vec![
            s(&["default", "allow-sleep", "Allow", "WorkloadSelector"]),
            s(&["default", "deny-intruder", "Deny", "Namespace"]),
        ],
        "{p}"
    );
    // Certificates: node1 holds sleep's and its own (the ztunnel's, for its xDS
    // client certificate), each a leaf and Istio's root, valid, Available; the root is
    // the one Istio's CA signs with.
    let root = d1["certificates"][0]["rootCerts"][0]["pem"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(
        first_der(&String::from_utf8(
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, root)
                .with_context(|| format!("root pem not base64: {root}"))?
        )?)?,
        first_der(&std::fs::read_to_string(&m.istio.root_path)?)?,
    );
    let c = ctl("certificate", &f1)?;
    let cr = rows(&c);
    assert_eq!(
        cr.iter()
            .map(|r| r.iter().take(4).cloned().collect::<Vec<_>>())
            .collect::<Vec<_>>(),
        vec![
            s(&[SLEEP_ID, "Leaf", "Available", "true"]),
            s(&[SLEEP_ID, "Root", "Available", "true"]),
            s(&[ZTUNNEL_ID, "Leaf", "Available", "true"]),
            s(&[ZTUNNEL_ID, "Root", "Available", "true"]),
        ],
        "{c}"
    );
    // Connections: the open one, from both ends, with the pods' names.
    let c1 = ctl("connections", &f1)?;
    let out = rows(&c1);
    // (Outbound: the remote is the HBONE address, the target the pod's port.)
    assert!(
        out.iter().any(|r| r[0] == "n1p1.default"
            && r[1] == "Outbound"
            && r[2].starts_with("n1p1.default:")
            && r[3] == "n2p1.default:15008"
            && r[4] == "n2p1.default:8080"
            && r[5] == "HBONE"),
        "{c1}"
    );
    let c2 = ctl("connections", &f2)?;
    let inb = rows(&c2);
    assert!(
        inb.iter().any(|r| r[0] == "n2p1.default"
            && r[1] == "Inbound"
            && r[2] == "n2p1.default:8080"
            && r[3].starts_with("n1p1.default:")
            && r[5] == "HBONE"),
        "{c2}"
    );
    // `all`: every table.
    let all = ctl("all", &f1)?;
    for header in [
        "NAMESPACE   POD NAME",
        "SERVICE NAME",
        "POLICY NAME",
        "CERTIFICATE NAME",
    ] {
        assert!(
            all.split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .contains(&header.split_whitespace().collect::<Vec<_>>().join(" ")),
            "no {header:?} in:\n{all}"
        );
    }

    // -o json: what istioctl read is what we dumped, field by field.
    let json = |cmd: &str, file: &str| -> Result<serde_json::Value> {
        let out = istioctl(&["ztunnel-config", cmd, "-f", file, "-o", "json"])?;
        serde_json::from_str(&out).with_context(|| format!("istioctl {cmd} -o json: {out}"))
    };
    let by = |list: &serde_json::Value, key: &str, val: &serde_json::Value| {
        list.as_array()
            .into_iter()
            .flatten()
            .find(|x| &x[key] == val)
            .cloned()
            .unwrap_or_default()
    };
    let theirs = json("workload", &f1)?;
    assert_eq!(theirs.as_array().map(Vec::len), Some(3), "{theirs:#}");
    for w in theirs.as_array().into_iter().flatten() {
        same_fields("workload", &by(&d1["workloads"], "uid", &w["uid"]), w);
    }
    let theirs = json("service", &f1)?;
    assert_eq!(theirs.as_array().map(Vec::len), Some(2), "{theirs:#}");
    for sv in theirs.as_array().into_iter().flatten() {
        same_fields(
            "service",
            &by(&d1["services"], "hostname", &sv["hostname"]),
            sv,
        );
    }
    let theirs = json("policy", &f2)?;
    for p in theirs.as_array().into_iter().flatten() {
        same_fields("policy", &by(&d2["policies"], "name", &p["name"]), p);
    }
    let theirs = json("certificate", &f1)?;
    for c in theirs.as_array().into_iter().flatten() {
        same_fields(
            "certificate",
            &by(&d1["certificates"], "identity", &c["identity"]),
            c,
        );
    }
    let theirs = json("connections", &f1)?;
    assert!(
        theirs.as_array().is_some_and(|a| !a.is_empty()),
        "{theirs:#}"
    );
    drop(conn);
    m.no_nacks()
}
