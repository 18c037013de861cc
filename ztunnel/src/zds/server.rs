//! A standalone stand-in for the istio-cni agent's side of ZDS, for the demo and tests:
//! pods are files in a directory (written by `ztunnel enroll`); the server sends the node
//! proxy a snapshot when it connects, then Add/Del as files appear and disappear.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{self, SockFlag, SockType, UnixAddr};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;

use super::error::ZdsError;
use super::messages::{
    AddWorkload, DelWorkload, Payload, ResponsePayload, SnapshotSent, WorkloadInfo,
    WorkloadRequest, WorkloadResponse, ZdsHello,
};
use super::seqpacket::{register, SeqPacket};

/// One enrolled pod, as `ztunnel enroll` records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodSpec {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns: PathBuf,
}

fn file_for(dir: &Path, uid: &str) -> PathBuf {
    let safe: String = uid
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{safe}.yaml"))
}

/// Records a pod for enrollment (atomically: write then rename).
pub fn write_pod(dir: &Path, pod: &PodSpec) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = file_for(dir, &pod.uid);
    let tmp = path.with_extension("tmp");
    let text = serde_yaml::to_string(pod).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

pub fn remove_pod(dir: &Path, uid: &str) -> std::io::Result<()> {
    std::fs::remove_file(file_for(dir, uid))
}

fn read_pods(dir: &Path) -> BTreeMap<String, PodSpec> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("yaml") {
            continue;
        }
        match std::fs::read_to_string(&p).map(|t| serde_yaml::from_str::<PodSpec>(&t)) {
            Ok(Ok(pod)) => {
                out.insert(pod.uid.clone(), pod);
            }
            Ok(Err(err)) => {
                tracing::warn!(file = %p.display(), error = %err, "ignoring malformed pod file")
            }
            Err(err) => tracing::warn!(file = %p.display(), error = %err, "cannot read pod file"),
        }
    }
    out
}

/// The agent's listening socket (what node proxies connect to).
pub struct Listener(AsyncFd<std::os::fd::OwnedFd>);

/// Listens on `path` as istio-cni's agent does (replacing a stale socket file).
pub fn listen(path: &Path) -> Result<Listener, ZdsError> {
    let err = |source| ZdsError::Listen {
        path: path.display().to_string(),
        source,
    };
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let fd = socket::socket(
        socket::AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(err)?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path).map_err(err)?).map_err(err)?;
    socket::listen(&fd, socket::Backlog::new(8).map_err(err)?).map_err(err)?;
    Ok(Listener(register(fd)?))
}

impl Listener {
    /// The next node proxy's connection.
    pub async fn accept(&self) -> Result<SeqPacket, ZdsError> {
        loop {
            let mut guard = self.0.readable().await?;
            match guard.try_io(|fd| {
                socket::accept4(fd, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK)
                    .map_err(std::io::Error::from)
            }) {
                Ok(Ok(owned)) => return SeqPacket::from_fd(owned),
                Ok(Err(e)) => return Err(ZdsError::Io(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

/// Serves node proxies, forever.
pub async fn serve(socket_path: &Path, pods_dir: &Path) -> Result<(), ZdsError> {
    let listener = listen(socket_path)?;
    tracing::info!(socket = %socket_path.display(), pods = %pods_dir.display(), "CNI agent (ZDS server) listening");
    loop {
        // Serve each connection on its own: an old session of a proxy that died quietly
        // must not keep its replacement waiting.
        let sock = listener.accept().await?;
        let dir = pods_dir.to_path_buf();
        tokio::spawn(async move {
            match session(sock, &dir).await {
                Ok(()) | Err(ZdsError::Closed) => tracing::info!("node proxy disconnected"),
                Err(e) => tracing::warn!(error = %e, "ZDS session ended"),
            }
        });
    }
}

async fn request(sock: &SeqPacket, payload: Payload, netns: Option<&Path>) -> Result<(), ZdsError> {
    send(sock, payload, netns).await?;
    ack(sock).await
}

async fn send(sock: &SeqPacket, payload: Payload, netns: Option<&Path>) -> Result<(), ZdsError> {
    let file = match netns {
        Some(p) => Some(std::fs::File::open(p)?),
        None => None,
    };
    sock.send(
        &WorkloadRequest {
            payload: Some(payload),
        },
        file.as_ref().map(|f| f.as_raw_fd()),
    )
    .await
}

async fn ack(sock: &SeqPacket) -> Result<(), ZdsError> {
    let (resp, _): (WorkloadResponse, _) = sock.recv().await?;
    if let Some(ResponsePayload::Ack(a)) = resp.payload {
        if !a.error.is_empty() {
            tracing::warn!(error = %a.error, "node proxy refused a request");
        }
    }
    Ok(())
}

fn add(pod: &PodSpec) -> Payload {
    Payload::Add(AddWorkload {
        uid: pod.uid.clone(),
        workload_info: Some(WorkloadInfo {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: pod.service_account.clone(),
        }),
    })
}

async fn session(sock: SeqPacket, pods_dir: &Path) -> Result<(), ZdsError> {
    let (hello, _): (ZdsHello, _) = sock.recv().await?;
    tracing::info!(version = hello.version, "node proxy connected");
    let mut sent = read_pods(pods_dir);
    // The snapshot's Adds go out together and are answered in order: the node proxy
    // enrolls them side by side, so one slow pod does not delay the rest.
    for pod in sent.values() {
        send(&sock, add(pod), Some(&pod.netns)).await?;
    }
    for _ in sent.values() {
        ack(&sock).await?;
    }
    request(&sock, Payload::SnapshotSent(SnapshotSent {}), None).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read_pods(pods_dir);
        for (uid, old) in &sent {
            if now.get(uid) != Some(old) {
                request(&sock, Payload::Del(DelWorkload { uid: uid.clone() }), None).await?;
            }
        }
        let new: Vec<&PodSpec> = now
            .iter()
            .filter(|(uid, pod)| sent.get(*uid) != Some(*pod))
            .map(|(_, p)| p)
            .collect();
        for pod in &new {
            send(&sock, add(pod), Some(&pod.netns)).await?;
        }
        for _ in &new {
            ack(&sock).await?;
        }
        sent = now;
    }
}
