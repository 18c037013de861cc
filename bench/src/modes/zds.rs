//! `--reference-zds`: a node proxy run the way istio-cni and Istio's chart run Istio's
//! ztunnel, so any ZDS-speaking ztunnel can be measured beside ours:
//! - configuration only from environment variables: the local config file
//!   (`LOCAL_XDS_PATH`, without the waypoint's lists, which Istio's parser refuses), the
//!   node name, no istiod (`XDS_ADDRESS` empty) and the built-in test CA (`FAKE_CA`;
//!   Istio's ztunnel has it only when built with `--features testing`);
//! - pods from the CNI agent over ZDS (`INPOD_UDS`): our `ztunnel cni-server` stands in
//!   for istio-cni's agent, pods recorded with `ztunnel enroll`;
//! - capture by istio-cni's in-pod rules (its nftables backend with default settings),
//!   not by the proxy.

use std::path::Path;

use anyhow::{Context, Result};

use mesh_tests::netsim::{self, Child, Pod, Topology};

/// Starts node `n`'s CNI agent stand-in with `pods` (name, service account) recorded
/// and captured, then `bin` as that node's proxy; returns both once the proxy is ready
/// (200 on :15021/healthz/ready, which Istio's ztunnel answers once the agent's
/// snapshot is enrolled).
pub fn start(
    topo: &Topology,
    ztunnel: &Path,
    bin: &Path,
    cfg: &Path,
    n: usize,
    pods: &[(&Pod, &str)],
    name: &str,
) -> Result<(Child, Child)> {
    let dir = topo.dir.join(format!("zds-node{n}"));
    let pods_dir = dir.join("pods");
    let socket = dir.join("ztunnel.sock");
    std::fs::create_dir_all(&pods_dir)?;
    let zt = ztunnel.display().to_string();
    for (pod, account) in pods {
        let netns = pod.netns.path().display().to_string();
        let pods_dir = pods_dir.display().to_string();
        let args = [
            "enroll",
            "--pods-dir",
            &pods_dir,
            "--uid",
            &pod.name,
            "--name",
            &pod.name,
            "--namespace",
            "default",
        ];
        netsim::sh(
            &zt,
            &[
                &args[..],
                &["--service-account", account, "--netns", &netns],
            ]
            .concat(),
        )?;
        netsim::istio_cni_capture(pod)?;
    }
    let node = topo.node(n);
    let agent = node.spawn(
        &zt,
        &[
            "cni-server",
            "--socket",
            &socket.display().to_string(),
            "--pods-dir",
            &pods_dir.display().to_string(),
        ],
        &[("RUST_LOG", "info")],
        &topo.dir.join(format!("cni-agent-node{n}.log")),
    )?;
    if let Some(pid) = agent.pid() {
        crate::cleanup::register_pid(pid);
    }
    netsim::wait_for("CNI agent socket", netsim::READY, || socket.exists())
        .with_context(|| agent.log_text())?;
    let state = topo.dir.join("ca").display().to_string();
    let (cfg, socket, node_name) = (
        cfg.display().to_string(),
        socket.display().to_string(),
        format!("node{n}"),
    );
    let proxy = node.spawn(
        &bin.display().to_string(),
        &[],
        &[
            ("LOCAL_XDS_PATH", &cfg),
            ("NODE_NAME", &node_name),
            ("INPOD_UDS", &socket),
            ("XDS_ADDRESS", ""),
            ("CA_ADDRESS", ""),
            ("FAKE_CA", "true"),
            // Ours keeps its built-in CA's root there (one root for both nodes); Istio's
            // fake CA signs with a root compiled in.
            ("ZTUNNEL_STATE_DIR", &state),
            ("ISTIO_META_DNS_CAPTURE", "false"),
            ("RUST_LOG", "info"),
            ("RUST_BACKTRACE", "0"),
        ],
        &topo.dir.join(format!("{name}.log")),
    )?;
    if let Some(pid) = proxy.pid() {
        crate::cleanup::register_pid(pid);
    }
    let proxy = super::wait_ready(topo, n, name, proxy)?;
    Ok((agent, proxy))
}
