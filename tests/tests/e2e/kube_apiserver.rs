//! Against a real Kubernetes API server (kube-apiserver v1.37.2 and etcd from their Go
//! modules, `mesh_tests::kube_apiserver`) with Gateway API v1.6.0's and Istio's CRDs from
//! their Go modules: our waypoint with the RBAC of its chart (charts/waypoint, rendered
//! by `helm template`), and the charts themselves applied with the server's dry run.
//! istiod's part (xDS, the CA) is still the fake istiod here.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::kube_apiserver::{self, KubeApiServer};
use mesh_tests::netsim::*;
use mesh_tests::{bins, fake_istiod, http_app};
use serde_json::{json, Value};

/// Where the API server listens: node 1, beside the fake istiod.
const API: &str = "10.0.0.1:6443";

fn charts() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../charts"))
}

async fn config_dump(ns: &Netns) -> Result<Value> {
    let (code, body) =
        fake_istiod::http_get(ns, "127.0.0.1:15000".parse()?, "/config_dump").await?;
    anyhow::ensure!(code == 200, "config_dump: {code} {body}");
    Ok(serde_json::from_str(&body)?)
}

/// Waits (up to 30 s) until the waypoint's config_dump satisfies `f`; the last dump.
async fn wait_dump(ns: &Netns, what: &str, f: impl Fn(&Value) -> bool) -> Result<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let d = config_dump(ns).await;
        if let Ok(d) = &d {
            if f(d) {
                return Ok(d.clone());
            }
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("timed out waiting for {what}; last dump: {d:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_ready(ns: &Netns, addr: SocketAddr) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = fake_istiod::readiness(ns, addr).await;
        if r.as_ref().is_ok_and(|(c, _)| *c == 200) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("not ready: {r:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each kind's watch state in the dump, `Kind=state@apiVersion`.
fn watches(d: &Value) -> Vec<String> {
    d["waypoint"]["kubernetes"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            format!(
                "{k}={}@{}",
                v["state"].as_str().unwrap_or("?"),
                v["apiVersion"].as_str().unwrap_or("-")
            )
        })
        .collect()
}

fn names(d: &Value, k: &str) -> Vec<String> {
    d[k].as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            format!(
                "{}/{}",
                o["namespace"].as_str().unwrap_or("?"),
                o["name"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

/// Our waypoint, configured by the fake istiod (xDS, CA) and by a real API server with
/// Gateway API v1.6.0's standard channel and Istio's CRDs, with only the RBAC its chart
/// grants (a TokenRequest token of the chart's ServiceAccount): it becomes ready, reads
/// TCPRoute at `v1` (the only version the standard channel serves), and applies an
/// HTTPRoute and an AuthorizationPolicy to real traffic. Then, restarted with a CRD
/// removed and two lists forbidden, it is ready again, names each in its log and
/// config_dump, serves what it can, and fails closed for the AuthorizationPolicies it
/// cannot list (every request denied, by a stand-in named so) until RBAC allows them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waypoint_with_its_charts_rbac_on_a_real_api_server() -> Result<()> {
    use fake_istiod::*;
    use ztunnel::xds::proto::istio::workload as pb;
    let topo = Topology::build(&prefix("kapi"), &[3, 1])?;
    let token = topo.dir.join("istio-token");
    std::fs::write(&token, TOKEN)?;
    let istiod = FakeIstiod::start(topo.node(1), "10.0.0.1:15012".parse()?, &topo.dir)?;
    let kube = KubeApiServer::start(topo.node(1), API.parse()?, &topo.dir).await?;
    let (echo, v1, v2, wp) = (
        "echo.default.svc.cluster.local",
        "echo-v1.default.svc.cluster.local",
        "echo-v2.default.svc.cluster.local",
        "waypoint.default.svc.cluster.local",
    );
    istiod.update(|r| {
        r.set_workload(pod_workload("n1p1", topo.pod("n1p1").ip, 1, "sleep", &[]));
        let mut w = pod_workload(
            "n1p2",
            topo.pod("n1p2").ip,
            1,
            "waypoint",
            &[(wp, 15008, 15008)],
        );
        w.tunnel_protocol = pb::TunnelProtocol::None as i32;
        r.set_workload(w);
        r.set_workload(pod_workload(
            "n1p3",
            topo.pod("n1p3").ip,
            1,
            "echo",
            &[(echo, 80, 8080), (v2, 80, 8080)],
        ));
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[(echo, 80, 8080), (v1, 80, 8080)],
        ));
        let mut s = service("echo", [10, 96, 0, 10], 80, 8080);
        s.waypoint = Some(pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Hostname(
                pb::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: wp.into(),
                },
            )),
            hbone_mtls_port: 15008,
        });
        r.set_service(s);
        r.set_service(service("echo-v1", [10, 96, 0, 11], 80, 8080));
        r.set_service(service("echo-v2", [10, 96, 0, 12], 80, 8080));
        r.set_service(service("waypoint", [10, 96, 0, 99], 15008, 15008));
    });

    // The CRDs, from their Go modules: Gateway API's standard channel, Istio's.
    let mut crds = kube_apiserver::gateway_api_crds("standard")?;
    crds.extend(kube_apiserver::istio_crds()?);
    let installed = kube.install_crds(&crds).await?;
    assert!(
        installed
            .iter()
            .any(|n| n == "tcproutes.gateway.networking.k8s.io")
            && installed
                .iter()
                .any(|n| n == "authorizationpolicies.security.istio.io"),
        "{installed:?}"
    );
    // The standard channel serves TCPRoute at v1 only (what the waypoint used to watch,
    // v1alpha2, is not served).
    let r = kube
        .get("/apis/gateway.networking.k8s.io/v1alpha2/tcproutes")
        .await?;
    assert_eq!(r.status, 404, "{}", r.body);

    // The waypoint chart as helm renders it (its Gateway, ServiceAccount and RBAC).
    kube.apply(
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    )
    .await?;
    let rendered =
        kube_apiserver::helm_template(&charts().join("waypoint"), "waypoint", "default", &[], &[])?;
    let mut rbac = Vec::new();
    for obj in &rendered {
        let obj = kube.in_namespace(obj, "default").await?;
        kube.apply(&obj).await.with_context(|| format!("{obj}"))?;
        if obj["apiVersion"] == "rbac.authorization.k8s.io/v1"
            && obj["kind"].as_str().is_some_and(|k| k.ends_with("Role"))
        {
            rbac.push(obj);
        }
    }
    assert_eq!(rbac.len(), 3, "the chart's Roles and ClusterRole: {rbac:?}");
    // Its route and policy for Service echo.
    let route = json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "echo", "namespace": "default"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
                 "rules": [{"matches": [{"headers": [{"type": "Exact", "name": "x-version", "value": "v2"}]}],
                            "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v2", "port": 80, "weight": 1}]},
                           {"backendRefs": [{"group": "", "kind": "Service", "name": "echo-v1", "port": 80, "weight": 1}]}]}});
    kube.apply(&route).await?;
    kube.apply(&json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy", "metadata": {"name": "echo-deny", "namespace": "default"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "DENY",
                 "rules": [{"to": [{"operation": {"paths": ["/denied"]}}]}]}}))
        .await?;

    // The mesh, and the waypoint with a token bound to the chart's ServiceAccount.
    let env = istiod.env(&token);
    let node_args = [
        vec![
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n1p1"),
                topo.pod("n1p1").netns.path().display()
            ),
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n1p3"),
                topo.pod("n1p3").netns.path().display()
            ),
        ],
        vec![
            "--pod".into(),
            format!(
                "{}={}",
                pod_uid("n2p1"),
                topo.pod("n2p1").netns.path().display()
            ),
        ],
    ];
    let mesh = Mesh::start_with_istiod(topo, &node_args, &env)?;
    let t = &mesh.topo;
    let kubeconfig = t.dir.join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, &kube.token_for("default", "waypoint").await?)?;
    let mut wenv: Vec<(String, String)> = env.clone();
    wenv.extend([
        ("RUST_LOG".into(), "info".into()),
        ("POD_NAME".into(), "n1p2".into()),
        ("POD_NAMESPACE".into(), "default".into()),
        ("INSTANCE_IP".into(), t.pod("n1p2").ip.to_string()),
        ("SERVICE_ACCOUNT".into(), "waypoint".into()),
        ("WAYPOINT_GATEWAY_NAME".into(), "waypoint".into()),
        ("KUBECONFIG".into(), kubeconfig.display().to_string()),
    ]);
    let wenv: Vec<(&str, &str)> = wenv.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let wp_ns = &t.pod("n1p2").netns;
    let ready_at = SocketAddr::new(t.pod("n1p2").ip, 15021);
    let spawn = |log: &str| wp_ns.spawn(bins::waypoint(), &[], &wenv, &t.dir.join(log));
    let waypoint = spawn("waypoint.log")?;
    let _apps = [
        http_app::HttpApp::start(&t.pod("n1p3").netns, 8080, "n1p3", false)?,
        http_app::HttpApp::start(&t.pod("n2p1").netns, 8080, "n2p1", false)?,
    ];
    wait_ready(t.node(1), ready_at)
        .await
        .with_context(|| format!("{}\n{}", waypoint.log_text(), kube.logs()))?;
    waypoint.wait_log("waypoint ready", READY)?;
    let d = config_dump(wp_ns).await?;
    let w = watches(&d);
    assert!(
        w.iter().all(|s| s.contains("=listed@")),
        "every kind listed with the chart's RBAC: {w:?}\n{}",
        waypoint.log_text()
    );
    // Both at v1, the only version Gateway API v1.6.0's standard channel serves of them.
    for kind in ["TCPRoute", "TLSRoute"] {
        assert!(
            w.contains(&format!("{kind}=listed@gateway.networking.k8s.io/v1")),
            "{w:?}"
        );
    }
    assert_eq!(names(&d, "httpRoutes"), ["default/echo"], "{d}");
    assert_eq!(
        names(&d, "authorizationPolicies"),
        ["default/echo-deny"],
        "{d}"
    );
    assert!(
        !waypoint.log_text().contains("unavailable"),
        "{}",
        waypoint.log_text()
    );

    // Real traffic: the HTTPRoute routes, the AuthorizationPolicy denies.
    let mut c =
        http_app::H1Client::connect(&t.pod("n1p1").netns, "10.96.0.10:80".parse()?, echo).await?;
    let r = c.get("/x").await.with_context(|| waypoint.log_text())?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n2p1"),
        "{r:?}"
    );
    let r = c.request("GET", "/x", &[("x-version", "v2")]).await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n1p3"),
        "{r:?}"
    );
    assert_eq!(c.get("/denied").await?.status, 403);
    waypoint.wait_log("authz.denied_by=\"default/echo-deny\"", READY)?;

    // Restarted with the Telemetry CRD removed and DestinationRules and
    // AuthorizationPolicies no longer listable across namespaces.
    drop(c);
    drop(waypoint);
    kube.delete_crd("telemetries.telemetry.istio.io").await?;
    let cluster_role = rbac
        .iter()
        .find(|o| o["kind"] == "ClusterRole")
        .context("no ClusterRole")?
        .clone();
    let mut narrowed = cluster_role.clone();
    for rule in narrowed["rules"].as_array_mut().into_iter().flatten() {
        if let Some(res) = rule["resources"].as_array_mut() {
            res.retain(|r| r != "destinationrules" && r != "authorizationpolicies");
        }
    }
    kube.apply(&narrowed).await?;
    let waypoint = spawn("waypoint-2.log")?;
    wait_ready(t.node(1), ready_at)
        .await
        .with_context(|| waypoint.log_text())?;
    waypoint.wait_log("waypoint ready", READY)?;
    let d = wait_dump(wp_ns, "the narrowed watches", |d| {
        let w = watches(d);
        w.iter().any(|s| s.starts_with("Telemetry=notServed"))
            && w.iter().any(|s| s.starts_with("DestinationRule=forbidden"))
            && w.iter()
                .any(|s| s.starts_with("AuthorizationPolicy=forbidden"))
    })
    .await?;
    assert!(
        watches(&d).contains(&"HTTPRoute=listed@gateway.networking.k8s.io/v1".to_string()),
        "{d}"
    );
    // Forbidden by RBAC, for the chart's ServiceAccount (the token's user), as the API
    // server says it.
    for kind in ["DestinationRule", "AuthorizationPolicy"] {
        let e = d["waypoint"]["kubernetes"][kind]["error"]
            .as_str()
            .unwrap_or_default();
        assert!(
            e.contains("forbidden")
                && e.contains("system:serviceaccount:default:waypoint")
                && e.contains("cannot list resource"),
            "{kind}: {e}"
        );
    }
    let log = waypoint.log_text();
    for kind in ["Telemetry", "DestinationRule", "AuthorizationPolicy"] {
        assert!(
            log.lines()
                .any(|l| l.contains("Kubernetes kind unavailable")
                    && l.contains(&format!("kind={kind}"))),
            "a warning naming {kind}:\n{log}"
        );
    }
    assert_eq!(
        names(&d, "authorizationPolicies"),
        ["istio-system/authorizationpolicies-unreadable"],
        "{d}"
    );
    // Routes still apply; every request is denied, by the stand-in.
    let mut c =
        http_app::H1Client::connect(&t.pod("n1p1").netns, "10.96.0.10:80".parse()?, echo).await?;
    assert_eq!(c.get("/x").await?.status, 403);
    waypoint.wait_log(
        "authz.denied_by=\"istio-system/authorizationpolicies-unreadable\"",
        READY,
    )?;
    // RBAC restored: the policies are listed again, the stand-in goes.
    kube.apply(&cluster_role).await?;
    let d = wait_dump(wp_ns, "AuthorizationPolicies listed again", |d| {
        names(d, "authorizationPolicies") == ["default/echo-deny"]
    })
    .await
    .with_context(|| waypoint.log_text())?;
    assert!(
        watches(&d).contains(&"AuthorizationPolicy=listed@security.istio.io/v1".to_string()),
        "{d}"
    );
    let r = c.request("GET", "/x", &[("x-version", "v2")]).await?;
    assert_eq!(
        (r.status.as_u16(), r.pod().as_str()),
        (200, "n1p3"),
        "{r:?}"
    );
    assert_eq!(c.get("/denied").await?.status, 403);

    // The experimental channel over the standard one: TCPRoute still read at v1.
    kube.install_crds(&kube_apiserver::gateway_api_crds("experimental")?)
        .await?;
    // (An updated CRD's storage answers 429 "storage is (re)initializing" for a moment.)
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let r = loop {
        let r = kube
            .get("/apis/gateway.networking.k8s.io/v1alpha2/tcproutes")
            .await?;
        if r.status != 429 || std::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        r.status, 200,
        "experimental serves v1alpha2 too: {}",
        r.body
    );
    wait_ready(t.node(1), ready_at).await?;
    Ok(())
}

/// Both charts, as `helm template` renders them (the ztunnel chart with Istio's own
/// values where they apply), pass the real API server's validation and admission:
/// server-side apply with `dryRun=All`, after Gateway API's and Istio's CRDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_pass_a_real_api_servers_dry_run() -> Result<()> {
    let topo = Topology::build(&prefix("kchart"), &[1])?;
    let kube = KubeApiServer::start(topo.node(1), API.parse()?, &topo.dir).await?;
    let mut crds = kube_apiserver::gateway_api_crds("standard")?;
    crds.extend(kube_apiserver::istio_crds()?);
    kube.install_crds(&crds).await?;
    kube.apply(
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    )
    .await?;
    // Istio's own values file for its ztunnel chart, from the istio.io/istio module: what
    // docs/install-over-istio.md upgrades Istio's release with.
    let istio_values = kube_apiserver::module_cache_dir("istio.io/istio")?
        .join("manifests/charts/ztunnel/values.yaml");
    let ztunnel = charts().join("ztunnel");
    let waypoint = charts().join("waypoint");
    let renders = [
        (
            "ztunnel",
            "istio-system",
            kube_apiserver::helm_template(&ztunnel, "ztunnel", "istio-system", &[], &[])?,
        ),
        (
            "ztunnel with Istio's values.yaml",
            "istio-system",
            kube_apiserver::helm_template(
                &ztunnel,
                "ztunnel",
                "istio-system",
                &[&istio_values],
                &[],
            )?,
        ),
        (
            "waypoint",
            "default",
            kube_apiserver::helm_template(&waypoint, "waypoint", "default", &[], &[])?,
        ),
        (
            "waypoint as Istio's class defaults (install-over-istio.md)",
            "istio-system",
            kube_apiserver::helm_template(
                &waypoint,
                "waypoint-class",
                "istio-system",
                &[],
                &[
                    ("istioClassDefaults.enabled", "true"),
                    ("gateway.create", "false"),
                    ("replicas", "0"),
                ],
            )?,
        ),
    ];
    for (chart, ns, objects) in renders {
        assert!(!objects.is_empty(), "{chart} rendered nothing");
        for obj in objects {
            let obj = kube.in_namespace(&obj, ns).await?;
            let r = kube.apply_reply(&obj, true).await?;
            assert!(
                (200..300).contains(&r.status),
                "{chart}: {} {} refused: {} {}",
                obj["kind"],
                obj["metadata"]["name"],
                r.status,
                r.body
            );
        }
    }
    Ok(())
}

/// What istiod needs of a cluster without kubelets: kube-controller-manager's EndpointSlice
/// controller turns a Service and the pods a test creates (with `nodeName`, their status
/// written as a kubelet would) into EndpointSlices: ready endpoints with the pods' IPs
/// and their node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_slices_for_pods_without_kubelets() -> Result<()> {
    let topo = Topology::build(&prefix("kcm"), &[1])?;
    let mut kube = KubeApiServer::start(topo.node(1), API.parse()?, &topo.dir).await?;
    kube.start_controller_manager().await?;
    kube.apply(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}}))
        .await?;
    // No ServiceAccount controller: the namespace's default account, as it would make it.
    kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": "default"}}))
        .await?;
    kube.apply(&json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "default"},
        "spec": {"selector": {"app": "echo"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}))
        .await?;
    for (name, ip) in [("echo-1", "10.10.1.11"), ("echo-2", "10.10.1.12")] {
        kube.apply(&json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": {"app": "echo"}},
            "spec": {"nodeName": "node1", "containers": [{"name": "app", "image": "echo"}]}}))
            .await?;
        kube.set_pod_running("default", name, ip).await?;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let endpoints = loop {
        let r = kube
            .get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Decho")
            .await?;
        let v = r.json()?;
        let mut eps: Vec<String> = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .map(|e| {
                format!(
                    "{} {} ready={}",
                    e["addresses"][0].as_str().unwrap_or("?"),
                    e["nodeName"].as_str().unwrap_or("?"),
                    e["conditions"]["ready"]
                )
            })
            .collect();
        eps.sort();
        if eps.len() == 2 {
            break eps;
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "no EndpointSlice with both pods: {}\n{}",
                r.body,
                kube.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        endpoints,
        ["10.10.1.11 node1 ready=true", "10.10.1.12 node1 ready=true"]
    );
    Ok(())
}
