//! nftables capture inside a pod netns (what istio-cni sets up in in-pod mode):
//! - outbound TCP from the pod's processes is REDIRECTed to 15001;
//! - inbound TCP from the network goes to 15006 unless it is HBONE to 15008;
//! - the proxy's own sockets (mark 1337) and loopback are never captured;
//! - replies from the app to a transparent (spoofed-source) proxy socket are routed back
//!   locally: connections the proxy opened over lo get ct mark 0x111, their reply packets
//!   get fwmark 0x111, and an ip rule sends that mark to a table whose only route is local.

use std::os::fd::AsRawFd;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use super::CaptureError;
use crate::netns::InPodNetns;
use crate::{ports, PROXY_MARK};

const TABLE: &str = "ztunnel-capture";
const CONN_MARK: u32 = 0x111;
const ROUTE_TABLE: &str = "133";
const RULE_PREF: &str = "32764";
/// kubelet health probes arrive from this address in Istio's ambient mode; never capture them.
const PROBE_SOURCE: &str = "169.254.7.127";

fn ruleset() -> String {
    format!(
        r#"table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    iifname "lo" return
    meta l4proto tcp tcp dport {hbone} return
    ip saddr {PROBE_SOURCE} return
    meta l4proto tcp redirect to :{inbound}
  }}
  chain output {{
    type nat hook output priority -100; policy accept;
    meta mark {mark} return
    oifname "lo" return
    meta l4proto tcp redirect to :{outbound}
  }}
  chain output_route {{
    type route hook output priority -150; policy accept;
    meta mark {mark} oifname "lo" ct mark set {CONN_MARK} return
    ct mark {CONN_MARK} meta mark set {CONN_MARK}
  }}
}}
"#,
        hbone = ports::HBONE,
        inbound = ports::INBOUND_PLAINTEXT,
        outbound = ports::OUTBOUND,
        mark = PROXY_MARK,
    )
}

async fn run_in(netns: &InPodNetns, program: &'static str, args: &[&str], stdin: Option<&str>) -> Result<(), CaptureError> {
    run_capturing(netns, program, args, stdin).await.map(|_| ())
}

async fn run_in_output(netns: &InPodNetns, program: &'static str, args: &[&str]) -> Result<String, CaptureError> {
    run_capturing(netns, program, args, None).await
}

async fn run_capturing(netns: &InPodNetns, program: &'static str, args: &[&str], stdin: Option<&str>) -> Result<String, CaptureError> {
    let fd = netns.fd().as_raw_fd();
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: setns is async-signal-safe and only touches the child after fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawn_err = |source| CaptureError::Spawn { program, netns: netns.name().to_string(), source };
    let mut child = cmd.spawn().map_err(spawn_err)?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).await.map_err(spawn_err)?;
    }
    let out = child.wait_with_output().await.map_err(spawn_err)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    } else {
        Err(CaptureError::Failed {
            program,
            netns: netns.name().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

pub async fn install(netns: &InPodNetns) -> Result<(), CaptureError> {
    let mark = format!("{CONN_MARK:#x}/0xfff");
    // A proxy taking over from another finds the rule in place: keep it rather than
    // delete-and-add, which would briefly misroute the old proxy's replies.
    let existing = run_in_output(netns, "ip", &["rule", "show", "pref", RULE_PREF]).await?;
    if !existing.contains(&format!("lookup {ROUTE_TABLE}")) {
        let _ = run_in(netns, "ip", &["rule", "del", "pref", RULE_PREF], None).await;
        run_in(netns, "ip", &["rule", "add", "fwmark", &mark, "pref", RULE_PREF, "lookup", ROUTE_TABLE], None).await?;
    }
    run_in(netns, "ip", &["route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", ROUTE_TABLE], None).await?;
    run_in(netns, "nft", &["-f", "-"], Some(&ruleset())).await
}

pub async fn remove(netns: &InPodNetns) -> Result<(), CaptureError> {
    let nft = run_in(netns, "nft", &["delete", "table", "inet", TABLE], None).await;
    let _ = run_in(netns, "ip", &["rule", "del", "pref", RULE_PREF], None).await;
    let _ = run_in(netns, "ip", &["route", "flush", "table", ROUTE_TABLE], None).await;
    nft
}
