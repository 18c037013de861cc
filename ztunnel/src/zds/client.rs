//! The node proxy's side of ZDS: connect, say hello, apply Add/Keep/Del/SnapshotSent,
//! ack each. Pods stay enrolled while the CNI agent is away; after a reconnect its
//! snapshot says which to keep.

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::error::ZdsError;
use super::messages::{
    Payload, Version, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
};
use super::seqpacket::SeqPacket;
use crate::netns::InPodNetns;
use crate::proxy::inputs::ProxyInputs;
use crate::proxy::lifecycle::{await_workload, enroll_workload, ENROLL_WAIT};
use crate::proxy::pods::Pods;
use crate::state::{Workload, WorkloadUid};

/// Runs forever: reconnects with backoff (100 ms doubling to 5 s) when the agent goes away.
pub async fn run(path: PathBuf, inputs: Arc<ProxyInputs>, pods: Pods) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match session(&path, &inputs, &pods).await {
            Ok(()) | Err(ZdsError::Closed) => {
                tracing::info!("ZDS connection closed by the CNI agent; keeping enrolled pods");
                backoff = Duration::from_millis(100);
            }
            Err(e) => tracing::warn!(error = %e, retry_in = ?backoff, "ZDS connection failed"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn session(
    path: &std::path::Path,
    inputs: &Arc<ProxyInputs>,
    pods: &Pods,
) -> Result<(), ZdsError> {
    let sock = SeqPacket::connect(path)?;
    sock.send(
        &ZdsHello {
            version: Version::V1 as i32,
        },
        None,
    )
    .await?;
    tracing::info!(path = %path.display(), "connected to the CNI agent (ZDS)");
    let mut in_snapshot: HashSet<WorkloadUid> = HashSet::new();
    // Adds in flight, in request order: one pod waiting for its workload or certificate
    // does not hold back the others an agent has already sent. Acks go out in order
    // (ZDS answers carry no id); anything else waits until the Adds before it are done.
    let mut adds: VecDeque<(WorkloadUid, JoinHandle<Result<(), String>>)> = VecDeque::new();
    loop {
        let next = tokio::select! {
            r = sock.recv::<WorkloadRequest>() => Some(r?),
            done = async { (&mut adds.front_mut().expect("guarded by the condition").1).await }, if !adds.is_empty() => {
                send_ack(&sock, joined(done)).await?;
                None
            }
        };
        let Some((req, fd)) = next else {
            adds.pop_front();
            continue;
        };
        let add_in_flight = matches!(&req.payload, Some(Payload::Add(add)) if adds.iter().any(|(u, _)| u.0 == add.uid));
        if !matches!(req.payload, Some(Payload::Add(_))) || add_in_flight {
            // Everything else, and a second Add of a pod still being added, after the
            // Adds already in flight.
            while let Some((_, task)) = adds.pop_front() {
                send_ack(&sock, joined(task.await)).await?;
            }
        }
        let result = match req.payload {
            Some(Payload::Add(add)) => {
                let uid = WorkloadUid(add.uid.clone());
                in_snapshot.insert(uid.clone());
                let task = match fd {
                    None => tokio::spawn(std::future::ready(Err(
                        ZdsError::MissingNetns(add.uid).to_string()
                    ))),
                    Some(fd) => {
                        let (inputs, pods, uid) = (inputs.clone(), pods.clone(), uid.clone());
                        tokio::spawn(async move {
                            add_pod(&inputs, &pods, uid, add.workload_info, fd).await
                        })
                    }
                };
                adds.push_back((uid, task));
                continue;
            }
            Some(Payload::Keep(keep)) => {
                let uid = WorkloadUid(keep.uid);
                in_snapshot.insert(uid.clone());
                if pods.contains(&uid).await {
                    Ok(())
                } else {
                    Err(format!("cannot keep {uid}: not enrolled"))
                }
            }
            Some(Payload::Del(del)) => {
                remove_pod(pods, &WorkloadUid(del.uid)).await;
                Ok(())
            }
            Some(Payload::SnapshotSent(_)) => {
                let stale = pods
                    .uids()
                    .await
                    .into_iter()
                    .filter(|u| !in_snapshot.contains(u));
                for uid in stale {
                    remove_pod(pods, &uid).await;
                }
                pods.retain_capture(&inputs.capture).await;
                let enrolled = pods.count().await;
                inputs.metrics.ready_part("zds");
                tracing::info!(pods = enrolled, "ZDS snapshot applied");
                Ok(())
            }
            None => Err(ZdsError::Empty.to_string()),
        };
        send_ack(&sock, result).await?;
    }
}

fn joined(r: Result<Result<(), String>, tokio::task::JoinError>) -> Result<(), String> {
    r.unwrap_or_else(|e| Err(format!("enrollment task failed: {e}")))
}

async fn send_ack(sock: &SeqPacket, result: Result<(), String>) -> Result<(), ZdsError> {
    if let Err(e) = &result {
        tracing::warn!(error = %e, "ZDS request failed");
    }
    sock.send(&WorkloadResponse::ack(result.err()), None).await
}

async fn add_pod(
    inputs: &Arc<ProxyInputs>,
    pods: &Pods,
    uid: WorkloadUid,
    info: Option<WorkloadInfo>,
    fd: std::os::fd::OwnedFd,
) -> Result<(), String> {
    let netns = InPodNetns::from_fd(fd, &format!("pod {uid}"));
    match pods.enrolled_in(&uid, &netns).await {
        // The agent repeating itself (a reconnect, a retried Add): nothing to do.
        Some(true) => return Ok(()),
        // The pod's sandbox was recreated: its old netns is gone or going, so is its proxy.
        Some(false) => {
            tracing::info!(uid = %uid, "pod added again with a new network namespace (sandbox recreated); replacing its proxy");
            remove_pod(pods, &uid).await;
        }
        None => {}
    }
    let named = info
        .as_ref()
        .map(|i| (i.namespace.as_str(), i.name.as_str()));
    let _pending = inputs.metrics.workload_manager.pending();
    let info_view = info.as_ref().map(|i| crate::proxy::states::ProxyInfo {
        name: i.name.clone(),
        namespace: i.namespace.clone(),
        service_account: i.service_account.clone(),
    });
    let _listed = inputs
        .workload_states
        .pending(&uid, info_view.unwrap_or_default());
    let wl = await_workload(inputs, &uid, named, ENROLL_WAIT)
        .await
        .map_err(|e| e.to_string())?;
    // The agent's view of the pod must agree with the mesh's: its identity comes from the
    // mesh state, and a disagreement means one of them is wrong about who this pod is.
    if let Some(info) = &info {
        check_workload_info(&uid, info, &wl)?;
    }
    let pod = enroll_workload(inputs.clone(), wl, netns)
        .await
        .map_err(|e| e.to_string())?;
    pods.insert(uid, pod).await;
    Ok(())
}

pub async fn remove_pod(pods: &Pods, uid: &WorkloadUid) {
    if let Some(pod) = pods.take(uid).await {
        match pod.remove().await {
            Ok(()) => tracing::info!(uid = %uid, "pod removed"),
            Err(e) => {
                tracing::warn!(uid = %uid, error = %e, "pod removed, but capture cleanup failed")
            }
        }
    }
}

/// The CNI agent's view of a pod must agree with the mesh's: the pod's identity comes
/// from the mesh state, and a disagreement means one of them is wrong about who it is.
pub fn check_workload_info(
    uid: &WorkloadUid,
    info: &WorkloadInfo,
    wl: &Workload,
) -> Result<(), String> {
    if info.name != wl.name
        || info.namespace != wl.namespace
        || info.service_account != wl.service_account
    {
        return Err(format!(
            "pod {uid} is {}/{} (sa {}) per the CNI agent but {}/{} (sa {}) per mesh config",
            info.namespace,
            info.name,
            info.service_account,
            wl.namespace,
            wl.name,
            wl.service_account
        ));
    }
    Ok(())
}
