//! Pod enrollment over ZDS, end to end: a stand-in CNI agent (`ztunnel cni-server`) per
//! node, `ztunnel enroll`/`unenroll` as the CNI plugin, and ztunnel as the ZDS client.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use mesh_tests::bins;
use mesh_tests::netsim::*;

/// How long an enrollment or a removal may take to show in the log. Generous: on a loaded
/// machine a removal (whose connections drain first) can take seconds, and a wait ends as
/// soon as its line is there.
const ENROLL: Duration = Duration::from_secs(30);

struct Node {
    cni: Child,
    ztunnel: Option<Child>,
    pods_dir: PathBuf,
    socket: PathBuf,
    config: PathBuf,
    state: PathBuf,
    index: usize,
}

fn start_ztunnel(topo: &Topology, n: &Node, log_name: &str) -> Result<Child> {
    let log = topo.dir.join(log_name);
    let node = format!("node{}", n.index);
    let mut args = vec![
        "--local-xds-path",
        n.config.to_str().unwrap_or_default(),
        "--node-name",
        &node,
        "--state-dir",
        n.state.to_str().unwrap_or_default(),
        "--zds-socket",
        n.socket.to_str().unwrap_or_default(),
    ];
    let capture = topo.capture_args(n.index);
    args.extend(capture.iter().map(String::as_str));
    let z = topo.node(n.index).spawn(
        bins::ztunnel(),
        &args,
        &[("RUST_LOG", "info"), ("RUST_BACKTRACE", "0")],
        &log,
    )?;
    z.wait_log("ZDS snapshot applied", READY)
        .map_err(|e| e.context(n.cni.log_text()))?;
    check_capture_mode(&z)?;
    Ok(z)
}

fn start_node(topo: &Topology, index: usize, config: &str) -> Result<Node> {
    let pods_dir = topo.dir.join(format!("pods-node{index}"));
    let socket = topo.dir.join(format!("zds-node{index}.sock"));
    let cfg = topo.dir.join("mesh.yaml");
    std::fs::write(&cfg, config)?;
    let cni_log = topo.dir.join(format!("cni-node{index}.log"));
    let cni = topo.node(index).spawn(
        bins::ztunnel(),
        &[
            "cni-server",
            "--socket",
            socket.to_str().unwrap_or_default(),
            "--pods-dir",
            pods_dir.to_str().unwrap_or_default(),
        ],
        &[("RUST_LOG", "info")],
        &cni_log,
    )?;
    cni.wait_log("listening", READY)?;
    let mut node = Node {
        cni,
        ztunnel: None,
        pods_dir,
        socket,
        config: cfg,
        state: topo.dir.join("ca"),
        index,
    };
    node.ztunnel = Some(start_ztunnel(
        topo,
        &node,
        &format!("ztunnel-node{index}.log"),
    )?);
    Ok(node)
}

fn enroll(node: &Node, pod: &Pod, sa: &str) -> Result<()> {
    sh(
        bins::ztunnel(),
        &[
            "enroll",
            "--pods-dir",
            node.pods_dir.to_str().unwrap_or_default(),
            "--uid",
            &pod.name,
            "--name",
            &pod.name,
            "--namespace",
            "default",
            "--service-account",
            sa,
            "--netns",
            pod.netns.path().to_str().unwrap_or_default(),
        ],
    )?;
    Ok(())
}

fn unenroll(node: &Node, pod: &Pod) -> Result<()> {
    sh(
        bins::ztunnel(),
        &[
            "unenroll",
            "--pods-dir",
            node.pods_dir.to_str().unwrap_or_default(),
            "--uid",
            &pod.name,
        ],
    )?;
    Ok(())
}

/// Log lines whose message is `event` (or `event, ...`), not a longer warning that starts
/// with the same words, such as "pod removed with connections still open".
fn count(log: &str, event: &str) -> usize {
    let comma = format!("{event},");
    log.lines()
        .filter(|l| {
            l.split('\t')
                .any(|field| field == event || field.starts_with(&comma))
        })
        .count()
}

/// The end of a log, for a timeout's error.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// What ztunnel leaves in a pod netns (and, with eBPF, in the node's pinned maps and
/// links): must be nothing once the pod is removed.
fn leftovers(topo: &Topology, pod: &Pod) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let netns = std::fs::File::open(pod.netns.path())?;
    if ztunnel_ebpf::sk_lookup_programs(std::os::fd::AsFd::as_fd(&netns))? > 0 {
        found.push("sk_lookup program".into());
    }
    let pins = topo.bpffs.join(format!("node{}", pod.node));
    if pins.exists() {
        let seen = ztunnel_ebpf::inspect(&pins)?;
        for map in ["zt_pods_netns", "zt_pods_ip", "zt_inbound"] {
            if seen.entries(map) > 0 {
                found.push(format!("{map} entry"));
            }
        }
        if !seen.pod_links.is_empty() {
            found.push("pod link pin".into());
        }
    }
    if pod
        .netns
        .exec("nft", &["list", "tables"])?
        .contains("ztunnel")
    {
        found.push("nft table".into());
    }
    if pod.netns.exec("ip", &["rule"])?.contains("32764") {
        found.push("ip rule".into());
    }
    if !pod
        .netns
        .exec("ip", &["route", "show", "table", "133"])?
        .trim()
        .is_empty()
    {
        found.push("route table 133".into());
    }
    let listening = pod.netns.exec("ss", &["-Hltun"])?;
    for port in ["15001", "15006", "15008", "15053"] {
        if listening.contains(&format!(":{port} ")) {
            found.push(format!("listener {port}"));
        }
    }
    Ok(found)
}

async fn echo_once(from: &Pod, to: SocketAddr) -> Result<Vec<u8>> {
    let mut s = from.netns.connect(to).await?;
    echo_roundtrip(&mut s, b"zds").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_enroll_and_leave_over_zds() -> Result<()> {
    let topo = Topology::build(&prefix("en"), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let node1 = start_node(&topo, 1, &cfg)?;
    let mut node2 = start_node(&topo, 2, &cfg)?;
    let (client, server) = (topo.pod("n1p1"), topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let z1 = node1
        .ztunnel
        .as_ref()
        .map(|z| z.log.clone())
        .unwrap_or_default();
    let mut z2_log = node2
        .ztunnel
        .as_ref()
        .map(|z| z.log.clone())
        .unwrap_or_default();
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();

    enroll(&node1, client, "client")?;
    enroll(&node2, server, "server")?;
    wait_for("both pods enrolled", ENROLL, || {
        std::fs::read_to_string(&z1)
            .unwrap_or_default()
            .contains("pod enrolled")
            && read(&z2_log).contains("pod enrolled")
    })?;
    let to = SocketAddr::new(server.ip, 8080);
    assert_eq!(echo_once(client, to).await?, b"zds");
    wait_for("HBONE in the logs", Duration::from_secs(5), || {
        read(&z2_log).contains("direction=\"inbound\"")
    })?;

    // Remove and re-add the server pod 100 times: nothing may be left behind.
    let pins = topo.bpffs.join("node2");
    let before = ztunnel_ebpf::inspect(&pins).ok();
    for round in 0..100 {
        unenroll(&node2, server)?;
        wait_for(&format!("pod removed (round {round})"), ENROLL, || {
            count(&read(&z2_log), "pod removed") == round + 1
        })
        .map_err(|e| e.context(tail(&read(&z2_log))))?;
        let left = leftovers(&topo, server)?;
        assert!(
            left.is_empty(),
            "round {round}: left in the pod netns: {left:?}"
        );
        enroll(&node2, server, "server")?;
        wait_for(
            &format!("pod enrolled again (round {round})"),
            ENROLL,
            || count(&read(&z2_log), "pod enrolled") == round + 2,
        )
        .map_err(|e| e.context(tail(&read(&z2_log))))?;
    }
    assert_eq!(echo_once(client, to).await?, b"zds");
    if capture_mode() == "ebpf" {
        let after = ztunnel_ebpf::inspect(&pins)?;
        let before = before.unwrap_or_default();
        assert_eq!(
            after.global_links, before.global_links,
            "process-wide programs must not pile up"
        );
        assert_eq!(
            after.pod_links.len(),
            1,
            "one pod, one sk_lookup link: {after:?}"
        );
        // Per-connection state goes with the sockets (sock_release), on both nodes: once
        // ztunnel has closed its side too, which may come after the client saw the echo.
        for node in ["node1", "node2"] {
            let maps = [
                "zt_orig_by_cookie",
                "zt_orig_by_tuple",
                "zt_local_conns",
                "zt_local_by_cookie",
            ];
            let mut seen = None;
            let drained = wait_for(
                &format!("{node}'s per-connection maps to empty"),
                Duration::from_secs(10),
                || {
                    let s = ztunnel_ebpf::inspect(&topo.bpffs.join(node)).ok();
                    let empty = s
                        .as_ref()
                        .is_some_and(|s| maps.iter().all(|m| s.entries(m) == 0));
                    seen = s;
                    empty
                },
            );
            assert!(
                drained.is_ok(),
                "{node}: per-connection maps keep entries of closed connections: {seen:?}"
            );
        }
    }

    // ztunnel restarts: the CNI agent's snapshot brings the pod back.
    if let Some(mut z) = node2.ztunnel.take() {
        z.stop();
    }
    // Capture stays while no proxy runs (the CNI owns it): the pod fails closed rather
    // than talking around the mesh.
    let left = leftovers(&topo, server)?;
    let stays: &[&str] = if capture_mode() == "ebpf" {
        // The listener's zt_inbound entry went with its socket; SYNs are dropped meanwhile.
        &[
            "sk_lookup program",
            "zt_pods_netns entry",
            "zt_pods_ip entry",
            "pod link pin",
            "ip rule",
            "route table 133",
        ]
    } else {
        &["nft table", "ip rule", "route table 133"]
    };
    assert_eq!(left, stays, "capture must stay, listeners must go");
    let bypass = tokio::time::timeout(Duration::from_secs(5), echo_once(client, to)).await?;
    assert!(
        bypass.map(|v| v.is_empty()).unwrap_or(true),
        "traffic reached the pod with its proxy down"
    );
    node2.ztunnel = Some(start_ztunnel(&topo, &node2, "ztunnel-node2-restarted.log")?);
    z2_log = topo.dir.join("ztunnel-node2-restarted.log");
    wait_for("pod enrolled after restart", ENROLL, || {
        read(&z2_log).contains("pod enrolled")
    })?;
    assert_eq!(echo_once(client, to).await?, b"zds");
    // Captured by the new proxy: HBONE into it, not around it.
    wait_for(
        "HBONE into the restarted ztunnel",
        Duration::from_secs(5),
        || read(&z2_log).contains("direction=\"inbound\""),
    )?;

    // The client side too: while node1's ztunnel is down its pod's connections fail
    // (outbound capture stays), and after the restart they go through the new one.
    let mut node1 = node1;
    if let Some(mut z) = node1.ztunnel.take() {
        z.stop();
    }
    let down = tokio::time::timeout(Duration::from_secs(5), echo_once(client, to)).await;
    assert!(
        down.map(|r| r.map(|v| v.is_empty()).unwrap_or(true))
            .unwrap_or(true),
        "client traffic left the pod with its proxy down"
    );
    node1.ztunnel = Some(start_ztunnel(&topo, &node1, "ztunnel-node1-restarted.log")?);
    let z1_log = topo.dir.join("ztunnel-node1-restarted.log");
    wait_for("client enrolled after restart", ENROLL, || {
        read(&z1_log).contains("pod enrolled")
    })?;
    assert_eq!(echo_once(client, to).await?, b"zds");
    wait_for(
        "outbound through the restarted ztunnel",
        Duration::from_secs(5),
        || read(&z1_log).contains("direction=\"outbound\""),
    )?;

    // A pod removed while its node's ztunnel is down: the next ztunnel, seeing it missing
    // from the agent's snapshot, drops the capture state it left on the node.
    if let Some(mut z) = node2.ztunnel.take() {
        z.stop();
    }
    unenroll(&node2, server)?;
    node2.ztunnel = Some(start_ztunnel(&topo, &node2, "ztunnel-node2-third.log")?);
    let left = leftovers(&topo, server)?;
    let ebpf_left: Vec<&String> = left
        .iter()
        .filter(|l| l.contains("zt_") || l.contains("sk_lookup") || l.contains("pin"))
        .collect();
    assert!(
        ebpf_left.is_empty(),
        "capture of a pod removed while ztunnel was down stayed: {left:?}"
    );
    enroll(&node2, server, "server")?;
    let z2_log = topo.dir.join("ztunnel-node2-third.log");
    wait_for("server enrolled again", ENROLL, || {
        read(&z2_log).contains("pod enrolled")
    })?;
    assert_eq!(echo_once(client, to).await?, b"zds");

    // The CNI agent's view of the pod must match the mesh config's.
    unenroll(&node2, server)?;
    wait_for("pod removed", ENROLL, || {
        read(&z2_log).contains("pod removed")
    })?;
    enroll(&node2, server, "impostor")?;
    wait_for("mismatch refused", ENROLL, || {
        read(&z2_log).contains("per the CNI agent but")
    })?;
    assert!(leftovers(&topo, server)?.is_empty());
    drop(node1);
    drop(node2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrollment_under_traffic_loses_no_connection() -> Result<()> {
    let topo = Topology::build(&prefix("et"), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "client", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let node1 = start_node(&topo, 1, &cfg)?;
    let node2 = start_node(&topo, 2, &cfg)?;
    let (client, server) = (topo.pod("n1p1"), topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    let z1 = node1
        .ztunnel
        .as_ref()
        .map(|z| z.log.clone())
        .unwrap_or_default();
    let z2 = node2
        .ztunnel
        .as_ref()
        .map(|z| z.log.clone())
        .unwrap_or_default();
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = connect_loop(client, SocketAddr::new(server.ip, 8080), stop.clone());
    let pause = || std::thread::sleep(Duration::from_millis(400));

    // Plaintext -> server captured (15006) -> both captured (HBONE) -> and back.
    pause();
    enroll(&node2, server, "server")?;
    wait_for("server enrolled", ENROLL, || {
        read(&z2).contains("pod enrolled")
    })?;
    pause();
    enroll(&node1, client, "client")?;
    wait_for("client enrolled", ENROLL, || {
        read(&z1).contains("pod enrolled")
    })?;
    pause();
    wait_for("HBONE under the loop", Duration::from_secs(5), || {
        read(&z2).contains("direction=\"inbound\"")
    })?;
    unenroll(&node1, client)?;
    wait_for("client removed", ENROLL, || {
        read(&z1).contains("pod removed")
    })?;
    pause();
    unenroll(&node2, server)?;
    wait_for("server removed", ENROLL, || {
        read(&z2).contains("pod removed")
    })?;
    pause();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = looping
        .join()
        .map_err(|_| anyhow::anyhow!("client loop panicked"))?;
    println!(
        "capture={}: {ok} connections through enrollment and removal of both pods, {} failed",
        capture_mode(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "connections failed during enrollment/removal: {failed:?}"
    );
    assert!(ok > 20, "the loop hardly ran ({ok} connections)");
    assert!(
        read(&z2).contains("inbound_plaintext"),
        "the server's capture never saw the plaintext phase"
    );
    assert!(leftovers(&topo, server)?.is_empty() && leftovers(&topo, client)?.is_empty());
    Ok(())
}

/// istio-cni re-sends an Add for a known pod uid with a new netns when the pod's sandbox
/// is recreated (no Del in between): the proxy moves to the new netns. The same Add again
/// (same netns) changes nothing. The test plays the CNI agent itself, on ZDS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_added_again_with_a_new_netns_moves_its_proxy() -> Result<()> {
    use ztunnel::zds::{
        AddWorkload, Payload, SnapshotSent, WorkloadInfo, WorkloadRequest, WorkloadResponse,
        ZdsHello,
    };

    let topo = Topology::build(&prefix("ra"), &[1])?;
    let pod = topo.pod("n1p1");
    let cfg = topo.dir.join("mesh.yaml");
    std::fs::write(
        &cfg,
        format!("workloads:\n{}", workload(&topo, "n1p1", "server", "")),
    )?;
    let socket = topo.dir.join("agent.sock");
    let agent = ztunnel::zds::server::listen(&socket)?;
    let log = topo.dir.join("ztunnel.log");
    let mut args = vec![
        "--local-xds-path".to_string(),
        cfg.display().to_string(),
        "--node-name".into(),
        "node1".into(),
        "--state-dir".into(),
        topo.dir.join("ca").display().to_string(),
        "--zds-socket".into(),
        socket.display().to_string(),
    ];
    args.extend(topo.capture_args(1));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let z = topo
        .node(1)
        .spawn(bins::ztunnel(), &args, &[("RUST_LOG", "info")], &log)?;
    let sock = tokio::time::timeout(READY, agent.accept()).await??;
    let _hello: (ZdsHello, _) = sock.recv().await?;

    let add = |netns: &std::path::Path| -> Result<(WorkloadRequest, std::fs::File)> {
        let info = WorkloadInfo {
            name: "n1p1".into(),
            namespace: "default".into(),
            service_account: "server".into(),
        };
        let req = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: "n1p1".into(),
                workload_info: Some(info),
            })),
        };
        Ok((req, std::fs::File::open(netns)?))
    };
    let ack = |resp: WorkloadResponse| format!("{:?}", resp.payload);
    let request = |req: WorkloadRequest, fd: Option<std::fs::File>| {
        let sock = &sock;
        async move {
            sock.send(&req, fd.as_ref().map(std::os::fd::AsRawFd::as_raw_fd))
                .await?;
            let (resp, _): (WorkloadResponse, _) =
                tokio::time::timeout(READY, sock.recv()).await??;
            anyhow::Ok(resp)
        }
    };
    let ok = "Some(Ack(Ack { error: \"\" }))";
    let (req, fd) = add(&pod.netns.path())?;
    assert_eq!(ack(request(req, Some(fd)).await?), ok);
    assert_eq!(
        ack(request(
            WorkloadRequest {
                payload: Some(Payload::SnapshotSent(SnapshotSent {}))
            },
            None
        )
        .await?),
        ok
    );
    z.wait_log("ZDS snapshot applied", READY)?;
    let listens = |ns: &Netns| {
        ns.exec("ss", &["-Hltn"])
            .map(|s| s.contains(":15008 "))
            .unwrap_or(false)
    };
    assert!(listens(&pod.netns), "enrolled in its first netns");

    // The recreated sandbox: a fresh netns (removed with the topology's prefix).
    let fresh = Netns {
        name: format!("{}-recreated", topo.prefix),
    };
    sh("ip", &["netns", "add", &fresh.name])?;
    sh("ip", &["-n", &fresh.name, "link", "set", "lo", "up"])?;
    let (req, fd) = add(&fresh.path())?;
    assert_eq!(ack(request(req, Some(fd)).await?), ok);
    assert!(
        listens(&fresh),
        "the proxy listens in the new netns once the Add is answered"
    );
    wait_for("the old netns released", ENROLL, || !listens(&pod.netns))?;
    assert!(
        z.log_text().contains("sandbox recreated"),
        "{}",
        z.log_text()
    );
    let left = leftovers(&topo, pod)?;
    let in_old_netns: Vec<&String> = left
        .iter()
        .filter(|l| l.contains("listener") || l.contains("nft") || l.contains("sk_lookup"))
        .collect();
    assert!(
        in_old_netns.is_empty(),
        "the old netns keeps {in_old_netns:?}"
    );

    // The same Add again (the same netns, opened anew): nothing changes.
    let (req, fd) = add(&fresh.path())?;
    assert_eq!(ack(request(req, Some(fd)).await?), ok);
    assert_eq!(count(&z.log_text(), "pod enrolled"), 2, "{}", z.log_text());
    assert!(listens(&fresh));
    Ok(())
}
