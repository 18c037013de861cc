//! Running the capture tools (nft, ip) inside a pod's netns.

use std::os::fd::AsRawFd;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use super::error::CaptureError;
use crate::netns::InPodNetns;

pub(crate) async fn run_in(
    netns: &InPodNetns,
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<(), CaptureError> {
    run_capturing(netns, program, args, stdin).await.map(|_| ())
}

pub(crate) async fn run_in_output(
    netns: &InPodNetns,
    program: &'static str,
    args: &[&str],
) -> Result<String, CaptureError> {
    run_capturing(netns, program, args, None).await
}

async fn run_capturing(
    netns: &InPodNetns,
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, CaptureError> {
    let fd = netns.fd().as_raw_fd();
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setns is async-signal-safe and only touches the child after fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawn_err = |source| CaptureError::Spawn {
        program,
        netns: netns.name().to_string(),
        source,
    };
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
