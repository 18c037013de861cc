//! ZDS, istio-cni's pod enrollment protocol: an AF_UNIX SOCK_SEQPACKET socket where the
//! node proxy connects as client, says hello, and then receives one WorkloadRequest per
//! message (a pod's netns fd rides along with Add via SCM_RIGHTS) and answers each with
//! an Ack.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr};
use prost::Message;
use tokio::io::unix::AsyncFd;

pub mod client;
pub mod server;

/// Default socket path, as Istio's ztunnel.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
const MAX_MESSAGE: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("cannot connect to the ZDS socket {path}: {source}; is the CNI agent running?")]
    Connect { path: String, source: nix::Error },
    #[error("cannot listen on the ZDS socket {path}: {source}")]
    Listen { path: String, source: nix::Error },
    #[error("ZDS socket I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZDS peer closed the connection")]
    Closed,
    #[error("malformed ZDS message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("ZDS message has no payload")]
    Empty,
    #[error("ZDS Add for {0} came without a network namespace file descriptor")]
    MissingNetns(String),
}

// Messages, field numbers from istio-cni's zds.proto.

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<Payload>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ResponsePayload {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "ResponsePayload", tags = "1")]
    pub payload: Option<ResponsePayload>,
}

impl WorkloadResponse {
    pub fn ack(error: Option<String>) -> Self {
        WorkloadResponse { payload: Some(ResponsePayload::Ack(Ack { error: error.unwrap_or_default() })) }
    }
}

/// The CNI agent's view of a pod must agree with the mesh's: the pod's identity comes
/// from the mesh state, and a disagreement means one of them is wrong about who it is.
pub fn check_workload_info(uid: &crate::state::WorkloadUid, info: &WorkloadInfo, wl: &crate::state::Workload) -> Result<(), String> {
    if info.name != wl.name || info.namespace != wl.namespace || info.service_account != wl.service_account {
        return Err(format!(
            "pod {uid} is {}/{} (sa {}) per the CNI agent but {}/{} (sa {}) per mesh config",
            info.namespace, info.name, info.service_account, wl.namespace, wl.name, wl.service_account
        ));
    }
    Ok(())
}

/// Registers an owned socket with the reactor.
pub(crate) fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open fd and returns the same fd for as long as it lives,
    // which is as long as the AsyncFd that owns it.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// A connected SEQPACKET socket: one protobuf message per packet, fds alongside.
pub struct SeqPacket {
    fd: AsyncFd<OwnedFd>,
}

impl SeqPacket {
    pub fn connect(path: &Path) -> Result<SeqPacket, ZdsError> {
        let err = |source| ZdsError::Connect { path: path.display().to_string(), source };
        let fd = socket::socket(
            socket::AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .map_err(err)?;
        let addr = UnixAddr::new(path).map_err(err)?;
        socket::connect(fd.as_raw_fd(), &addr).map_err(err)?;
        Ok(SeqPacket { fd: register(fd)? })
    }

    pub fn from_fd(fd: OwnedFd) -> Result<SeqPacket, ZdsError> {
        Ok(SeqPacket { fd: register(fd)? })
    }

    pub async fn send(&self, msg: &impl Message, pass_fd: Option<RawFd>) -> Result<(), ZdsError> {
        let buf = msg.encode_to_vec();
        loop {
            let mut guard = self.fd.writable().await?;
            let fds = pass_fd.map(|f| [f]);
            let cmsgs: Vec<ControlMessage<'_>> = fds.as_ref().map(|f| vec![ControlMessage::ScmRights(f)]).unwrap_or_default();
            let res = guard.try_io(|fd| {
                socket::sendmsg::<()>(fd.as_raw_fd(), &[IoSlice::new(&buf)], &cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(std::io::Error::from)
            });
            match res {
                Ok(r) => return r.map(|_| ()).map_err(ZdsError::Io),
                Err(_would_block) => continue,
            }
        }
    }

    /// The next message and the fd that came with it, if any.
    pub async fn recv<M: Message + Default>(&self) -> Result<(M, Option<OwnedFd>), ZdsError> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|fd| {
                let mut cmsg = nix::cmsg_space!([RawFd; 4]);
                let mut iov = [IoSliceMut::new(&mut buf)];
                let msg = socket::recvmsg::<()>(fd.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
                    .map_err(std::io::Error::from)?;
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(std::io::Error::from)? {
                    if let ControlMessageOwned::ScmRights(got) = c {
                        // SAFETY: the kernel just installed these fds for us; we own them now.
                        fds.extend(got.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                }
                Ok((msg.bytes, fds))
            });
            match res {
                Ok(Ok((0, _))) => return Err(ZdsError::Closed),
                Ok(Ok((n, mut fds))) => {
                    let m = M::decode(&buf[..n])?;
                    // Extra fds beyond the first are closed when dropped.
                    let first = if fds.is_empty() { None } else { Some(fds.swap_remove(0)) };
                    return Ok((m, first));
                }
                Ok(Err(e)) => return Err(ZdsError::Io(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_numbers_match_istio() {
        // add(1){uid(1)="u", workload_info(2){name(1)="n"}}
        let req = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: "u".into(),
                workload_info: Some(WorkloadInfo { name: "n".into(), ..Default::default() }),
            })),
        };
        assert_eq!(req.encode_to_vec(), vec![0x0a, 0x08, 0x0a, 0x01, b'u', 0x12, 0x03, 0x0a, 0x01, b'n']);
        // del(2){uid(2)="u"}
        let del = WorkloadRequest { payload: Some(Payload::Del(DelWorkload { uid: "u".into() })) };
        assert_eq!(del.encode_to_vec(), vec![0x12, 0x03, 0x12, 0x01, b'u']);
        // keep(5){uid(1)}, snapshot_sent(3){}
        let keep = WorkloadRequest { payload: Some(Payload::Keep(KeepWorkload { uid: "u".into() })) };
        assert_eq!(keep.encode_to_vec(), vec![0x2a, 0x03, 0x0a, 0x01, b'u']);
        let snap = WorkloadRequest { payload: Some(Payload::SnapshotSent(SnapshotSent {})) };
        assert_eq!(snap.encode_to_vec(), vec![0x1a, 0x00]);
        assert_eq!(ZdsHello { version: Version::V1 as i32 }.encode_to_vec(), vec![0x08, 0x01]);
        assert_eq!(WorkloadResponse::ack(Some("e".into())).encode_to_vec(), vec![0x0a, 0x03, 0x0a, 0x01, b'e']);
    }

    #[tokio::test]
    async fn passes_fds_over_seqpacket() {
        let (a, b) = socket::socketpair(
            socket::AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        )
        .unwrap();
        let (a, b) = (SeqPacket::from_fd(a).unwrap(), SeqPacket::from_fd(b).unwrap());
        let f = std::fs::File::open("/proc/self/ns/net").unwrap();
        let req = WorkloadRequest { payload: Some(Payload::Add(AddWorkload { uid: "x".into(), workload_info: None })) };
        a.send(&req, Some(f.as_raw_fd())).await.unwrap();
        let (got, fd): (WorkloadRequest, _) = b.recv().await.unwrap();
        assert_eq!(got, req);
        assert!(fd.is_some());
        drop(a);
        assert!(matches!(b.recv::<WorkloadRequest>().await, Err(ZdsError::Closed)));
    }
}
