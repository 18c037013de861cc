//! The ZDS socket: AF_UNIX SOCK_SEQPACKET, one protobuf message per packet, a netns fd
//! riding along (SCM_RIGHTS).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{
    self, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use prost::Message;
use tokio::io::unix::AsyncFd;

use super::error::ZdsError;

const MAX_MESSAGE: usize = 64 * 1024;

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
        let err = |source| ZdsError::Connect {
            path: path.display().to_string(),
            source,
        };
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
            let cmsgs: Vec<ControlMessage<'_>> = fds
                .as_ref()
                .map(|f| vec![ControlMessage::ScmRights(f)])
                .unwrap_or_default();
            let res = guard.try_io(|fd| {
                socket::sendmsg::<()>(
                    fd.as_raw_fd(),
                    &[IoSlice::new(&buf)],
                    &cmsgs,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
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
                let msg = socket::recvmsg::<()>(
                    fd.as_raw_fd(),
                    &mut iov,
                    Some(&mut cmsg),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
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
                    let first = if fds.is_empty() {
                        None
                    } else {
                        Some(fds.swap_remove(0))
                    };
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
    use crate::zds::messages::{AddWorkload, Payload, WorkloadRequest};

    #[tokio::test]
    async fn passes_fds_over_seqpacket() {
        let (a, b) = socket::socketpair(
            socket::AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        )
        .unwrap();
        let (a, b) = (
            SeqPacket::from_fd(a).unwrap(),
            SeqPacket::from_fd(b).unwrap(),
        );
        let f = std::fs::File::open("/proc/self/ns/net").unwrap();
        let req = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: "x".into(),
                workload_info: None,
            })),
        };
        a.send(&req, Some(f.as_raw_fd())).await.unwrap();
        let (got, fd): (WorkloadRequest, _) = b.recv().await.unwrap();
        assert_eq!(got, req);
        assert!(fd.is_some());
        drop(a);
        assert!(matches!(
            b.recv::<WorkloadRequest>().await,
            Err(ZdsError::Closed)
        ));
    }
}
