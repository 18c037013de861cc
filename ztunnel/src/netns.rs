//! Pod network namespaces. The proxy keeps its own netns and creates sockets inside a
//! pod's netns by switching the calling thread there just for the `socket()` call
//! (a socket stays in the netns it was created in), as Istio's in-pod mode does.

use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use socket2::{Domain, Protocol, SockAddr, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::marks::{DELIVERY_MARK, PROXY_MARK};

pub mod source_port;

use source_port::{AcceptedTuples, HeldTuple, SourcePorts};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("cannot open network namespace {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot enter network namespace {name}: {source} (ztunnel needs CAP_SYS_ADMIN)")]
    Enter { name: String, source: nix::Error },
    #[error("socket operation in network namespace {name} failed: {source}")]
    Socket { name: String, source: io::Error },
}

static PROXY_NETNS: OnceLock<io::Result<File>> = OnceLock::new();

/// Remembers the proxy's own netns. Call once at start, before any pod netns is entered.
pub fn init() -> io::Result<()> {
    match proxy_netns() {
        Ok(_) => Ok(()),
        Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
    }
}

fn proxy_netns() -> &'static io::Result<File> {
    PROXY_NETNS.get_or_init(|| File::open("/proc/thread-self/ns/net"))
}

/// Socket settings from the environment (Istio's KEEPALIVE_*, USER_TIMEOUT_ENABLED and
/// INPOD_PORT_REUSE), fixed at start; unset: Istio's defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketOptions {
    pub keepalive: Keepalive,
    /// SO_REUSEPORT on the in-pod listeners, so a new proxy can bind beside the old one
    /// during an upgrade (Istio: INPOD_PORT_REUSE, default on).
    pub no_port_reuse: bool,
    pub delivery: DeliveryReplies,
}

/// What brings the replies to the proxy's transparent deliveries (connections to a pod's
/// app from the real client's address) back to the proxy instead of out of the pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeliveryReplies {
    /// Our capture: deliveries carry [`DELIVERY_MARK`], which our rules (or eBPF's
    /// `tcp_fwmark_accept`) put on the replies; the local route takes them to lo.
    #[default]
    OwnCapture,
    /// istio-cni's in-pod rules: they mark the connection for its replies when its SYN
    /// carries the proxy's mark (1337), as Istio's ztunnel sends every socket's. A
    /// delivery marked otherwise would have its replies routed out of the pod.
    IstioCni,
}

impl DeliveryReplies {
    /// SO_MARK of a socket the proxy connects from inside a pod.
    pub fn mark(self, transparent: bool) -> u32 {
        match (self, transparent) {
            (DeliveryReplies::OwnCapture, true) => DELIVERY_MARK,
            _ => PROXY_MARK,
        }
    }
}

/// TCP keepalive of the proxy's connections (Istio's KEEPALIVE_*, USER_TIMEOUT_ENABLED).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    pub enabled: bool,
    pub time: Duration,
    pub interval: Duration,
    pub retries: u32,
    /// TCP_USER_TIMEOUT of time + interval × retries, so unacknowledged data also ends
    /// a dead connection.
    pub user_timeout: bool,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            enabled: true,
            time: Duration::from_secs(180),
            interval: Duration::from_secs(180),
            retries: 9,
            user_timeout: false,
        }
    }
}

static SOCKET_OPTIONS: OnceLock<SocketOptions> = OnceLock::new();

/// Sets the socket options for the rest of the process (the first call wins).
pub fn set_socket_options(o: SocketOptions) {
    let _ = SOCKET_OPTIONS.set(o);
}

pub fn socket_options() -> SocketOptions {
    SOCKET_OPTIONS.get().copied().unwrap_or_default()
}

/// A handle to one pod's network namespace.
#[derive(Clone, Debug)]
pub struct InPodNetns {
    fd: Arc<OwnedFd>,
    name: Arc<str>,
    /// Read from the pod on its first transparent connection.
    source_ports: Arc<OnceLock<SourcePorts>>,
    /// Connections accepted here with their original tuples, which deliveries keep off.
    accepted: Arc<AcceptedTuples>,
}

impl InPodNetns {
    pub fn open(path: &Path) -> Result<InPodNetns, NetnsError> {
        let f = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(InPodNetns::from_fd(f.into(), &path.display().to_string()))
    }

    /// From a netns fd received from the CNI agent.
    pub fn from_fd(fd: OwnedFd, name: &str) -> InPodNetns {
        InPodNetns {
            fd: Arc::new(fd),
            name: name.into(),
            source_ports: Arc::default(),
            accepted: Arc::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Runs `f` with the current thread inside this netns, then switches back.
    /// Keep `f` to socket creation: it runs on a runtime thread and must not block.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Result<R, NetnsError> {
        let home = match proxy_netns() {
            Ok(f) => f,
            Err(e) => {
                return Err(NetnsError::Enter {
                    name: "proxy".into(),
                    source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)),
                })
            }
        };
        setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
            name: self.name.to_string(),
            source,
        })?;
        let out = f();
        if let Err(e) = setns(home.as_fd(), CloneFlags::CLONE_NEWNET) {
            // A runtime thread stuck in a pod's netns would create later sockets in the wrong
            // pod: that cannot be allowed to continue.
            tracing::error!(error = %e, "cannot return to the proxy network namespace; aborting");
            std::process::abort();
        }
        Ok(out)
    }

    fn socket(&self, addr: &SocketAddr) -> Result<Socket, NetnsError> {
        let domain = if addr.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        self.run(|| {
            Socket::new(
                domain,
                Type::STREAM.nonblocking().cloexec(),
                Some(Protocol::TCP),
            )
        })?
        .map_err(|source| self.sock_err(source))
    }

    fn sock_err(&self, source: io::Error) -> NetnsError {
        NetnsError::Socket {
            name: self.name.to_string(),
            source,
        }
    }

    /// Whether both handles name the same network namespace (same nsfs inode), however
    /// they were opened.
    pub fn same_as(&self, other: &InPodNetns) -> bool {
        let id = |n: &InPodNetns| {
            nix::sys::stat::fstat(n.fd.as_fd())
                .ok()
                .map(|st| (st.st_dev, st.st_ino))
        };
        // A handle we cannot stat is never taken for the other: replacing costs a re-enrollment, mixing them up a pod.
        matches!((id(self), id(other)), (Some(a), Some(b)) if a == b)
    }

    /// The kernel's unique id for this netns (SO_NETNS_COOKIE), as eBPF programs see it.
    pub fn cookie(&self) -> Result<u64, NetnsError> {
        let s = self
            .run(|| Socket::new(Domain::IPV4, Type::DGRAM.cloexec(), None))?
            .map_err(|source| self.sock_err(source))?;
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
        let r = unsafe {
            libc::getsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                libc::SOL_SOCKET,
                libc::SO_NETNS_COOKIE,
                &mut cookie as *mut u64 as *mut libc::c_void,
                &mut len,
            )
        };
        if r != 0 {
            return Err(self.sock_err(io::Error::last_os_error()));
        }
        Ok(cookie)
    }

    /// A listener bound inside the pod. SO_REUSEPORT lets a new proxy bind beside the old one.
    /// An IPv6 listener takes IPv6 only: IPv4 has its own listener, so no address the
    /// proxy sees is ever v4-mapped.
    pub fn listen(&self, addr: SocketAddr, transparent: bool) -> Result<TcpListener, NetnsError> {
        let s = self.socket(&addr)?;
        let r = (|| {
            s.set_reuse_address(true)?;
            s.set_reuse_port(!socket_options().no_port_reuse)?;
            if addr.is_ipv6() {
                s.set_only_v6(true)?;
            }
            if transparent {
                set_transparent(&s, &addr)?;
            }
            s.bind(&SockAddr::from(addr))?;
            s.listen(1024)?;
            TcpListener::from_std(std::net::TcpListener::from(s))
        })();
        r.map_err(|e| self.sock_err(e))
    }

    /// Connects from inside the pod with the proxy mark, so capture lets it through.
    /// With `transparent_src`, the connection appears to come from that address (the
    /// real client), which needs IP_TRANSPARENT and the pod's local-delivery route.
    pub async fn connect(
        &self,
        dst: SocketAddr,
        transparent_src: Option<SocketAddr>,
        timeout: Duration,
    ) -> Result<TcpStream, NetnsError> {
        let attempts = async {
            let Some(src) = transparent_src else {
                return self.connect_from(dst, None).await;
            };
            // Our own pick of port first (see `source_port`); a port in use by another
            // connection to the same destination fails at once, so another is tried. The
            // client's own port, and any of an accepted connection from its address to
            // `dst`, would reverse that connection's tuple (see `AcceptedTuples`).
            let avoid = |port: u16| {
                port == src.port() || self.accepted.holds(SocketAddr::new(src.ip(), port), dst)
            };
            for _ in 0..source_port::TRIES {
                let Some(port) = self.source_ports().pick(avoid) else {
                    break;
                };
                match self
                    .connect_from(dst, Some(SocketAddr::new(src.ip(), port)))
                    .await
                {
                    Err(e) if source_port_taken(&e) => continue,
                    r => return r,
                }
            }
            self.connect_from(dst, Some(SocketAddr::new(src.ip(), 0)))
                .await
        };
        match tokio::time::timeout(timeout, attempts).await {
            Ok(r) => r,
            Err(_) => Err(self.sock_err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect to {dst} timed out"),
            ))),
        }
    }

    /// One connect, from `src` if given (port 0: the kernel's choice).
    async fn connect_from(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
    ) -> Result<TcpStream, NetnsError> {
        let s = self.socket(&dst)?;
        let setup = (|| {
            s.set_mark(socket_options().delivery.mark(src.is_some()))?;
            s.set_tcp_nodelay(true)?;
            set_keepalive(&s)?;
            if let Some(src) = src {
                set_transparent(&s, &dst)?;
                bind_source(&s, src)?;
            }
            Ok::<_, io::Error>(())
        })();
        setup.map_err(|e| self.sock_err(e))?;
        TcpSocket::from_std_stream(std::net::TcpStream::from(s))
            .connect(dst)
            .await
            .map_err(|e| self.sock_err(e))
    }

    /// Holds the original tuple of a connection accepted in this pod (`client` to the
    /// app's `local` address) while the guard lives, so no delivery reverses it.
    pub fn accepted(&self, client: SocketAddr, local: SocketAddr) -> HeldTuple {
        self.accepted.hold(client, local)
    }

    fn source_ports(&self) -> &SourcePorts {
        // Two small procfs reads inside the pod, once per pod: as quick as a socket().
        self.source_ports
            .get_or_init(|| self.run(SourcePorts::read).unwrap_or_default())
    }
}

/// The source port chosen is held by another connection to the same destination (connect:
/// EADDRNOTAVAIL) or by a listener (bind: EADDRINUSE).
fn source_port_taken(e: &NetnsError) -> bool {
    matches!(e, NetnsError::Socket { source, .. } if matches!(source.raw_os_error(), Some(libc::EADDRINUSE) | Some(libc::EADDRNOTAVAIL)))
}

/// Binds a connecting socket to `src`. Port 0 leaves the port to connect(), which picks
/// one by the whole 4-tuple (a plain bind to port 0 would search the address's ports for
/// one no socket holds, across all destinations). A given port is bound with
/// SO_REUSEADDR, as every socket bound here is, so a tuple of ours left in TIME_WAIT does
/// not block it (see `source_port`).
fn bind_source(s: &Socket, src: SocketAddr) -> io::Result<()> {
    if src.port() == 0 {
        nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::IpBindAddressNoPort, &true)?;
    }
    s.set_reuse_address(true)?;
    s.bind(&SockAddr::from(src))
}

/// IP_TRANSPARENT or IPV6_TRANSPARENT, by the family of the socket (made for `addr`).
fn set_transparent(s: &Socket, addr: &SocketAddr) -> io::Result<()> {
    if addr.is_ipv4() {
        s.set_ip_transparent_v4(true)
    } else {
        s.set_ip_transparent_v6(true)
    }
}

/// Whether IPv6 is on for the calling thread's netns's loopback (Istio checks the same
/// before binding its `[::1]` listeners: a pod may have IPv6 disabled). Run it inside a
/// pod with [`InPodNetns::run`].
pub fn ipv6_on_loopback() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
        .is_ok_and(|v| v.trim() == "0")
}

/// TCP keepalive as configured (Istio's default: 180 s idle, 180 s interval, 9 probes).
pub fn set_keepalive(s: &Socket) -> io::Result<()> {
    let k = socket_options().keepalive;
    if !k.enabled {
        return Ok(());
    }
    s.set_keepalive(true)?;
    s.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(k.time)
            .with_interval(k.interval)
            .with_retries(k.retries),
    )?;
    if k.user_timeout {
        s.set_tcp_user_timeout(Some(
            k.time.saturating_add(k.interval.saturating_mul(k.retries)),
        ))?;
    }
    Ok(())
}

/// The destination a captured connection was addressed to before REDIRECT.
pub fn original_dst(stream: &TcpStream) -> io::Result<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    let local = stream.local_addr()?;
    if local.is_ipv4() {
        let sin = getsockopt(stream, sockopt::OriginalDst).map_err(io::Error::from)?;
        let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        Ok(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
    } else {
        let sin6 = getsockopt(stream, sockopt::Ip6tOriginalDst).map_err(io::Error::from)?;
        let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
        Ok(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
    }
}

/// The original destination of a captured connection; logs and yields None if unreadable.
/// REDIRECT (nftables) and the eBPF outbound hook answer SO_ORIGINAL_DST; a connection
/// steered by sk_lookup keeps its original local address, so there getsockname() is the
/// destination. A local address on a proxy port means nothing redirected it.
pub fn captured_destination(stream: &TcpStream) -> Option<SocketAddr> {
    let e = match original_dst(stream) {
        Ok(d) => return Some(d),
        Err(e) => e,
    };
    match stream.local_addr() {
        Ok(local) if !crate::ports::is_proxy_port(local.port()) => Some(local),
        _ => {
            tracing::warn!(error = %e, "cannot read the original destination; closing");
            None
        }
    }
}

/// Makes the next close of this socket send RST instead of FIN.
pub fn set_reset_on_close(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// Closes a TCP connection with RST instead of FIN, to propagate a reset.
pub fn reset(stream: TcpStream) {
    if let Ok(std) = stream.into_std() {
        let s = Socket::from(std);
        let _ = s.set_linger(Some(Duration::ZERO));
        drop(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_carry_the_mark_the_capture_routes_replies_by() {
        // Ours: the delivery mark; istio-cni's rules: Istio's proxy mark, which they turn
        // into the connection mark of the replies.
        assert_eq!(DeliveryReplies::OwnCapture.mark(true), DELIVERY_MARK);
        assert_eq!(DeliveryReplies::IstioCni.mark(true), PROXY_MARK);
        // Anything else the proxy connects is exempt from capture by the proxy mark.
        assert_eq!(DeliveryReplies::OwnCapture.mark(false), PROXY_MARK);
        assert_eq!(DeliveryReplies::IstioCni.mark(false), PROXY_MARK);
    }

    fn local(s: &Socket) -> SocketAddr {
        s.local_addr().unwrap().as_socket().unwrap()
    }

    #[test]
    fn a_source_without_port_takes_its_port_at_connect() {
        let app = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        bind_source(&s, "127.0.0.1:0".parse().unwrap()).unwrap();
        assert_eq!(local(&s).port(), 0, "no port is reserved by the bind");
        s.connect(&app.local_addr().unwrap().into()).unwrap();
        let (_, peer) = app.accept().unwrap();
        assert_eq!(
            peer,
            local(&s),
            "the app sees the bound address with the port connect picked"
        );
        assert_ne!(peer.port(), 0);
    }

    #[test]
    fn a_chosen_source_port_takes_over_its_own_time_wait() {
        use std::io::Read;
        let app = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to: SockAddr = app.local_addr().unwrap().into();
        // Ours closes first, as when the client does: our side is left in TIME_WAIT.
        let first = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        bind_source(&first, "127.0.0.1:0".parse().unwrap()).unwrap();
        first.connect(&to).unwrap();
        let from = local(&first);
        let (mut accepted, _) = app.accept().unwrap();
        first.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(accepted.read(&mut [0; 1]).unwrap(), 0);
        drop(accepted);
        let mut rest = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &first, &mut rest).unwrap(),
            0,
            "the app's close reached us"
        );
        drop(first);
        // The same tuple again, with the port given.
        let again = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        bind_source(&again, from).unwrap();
        again
            .connect(&to)
            .expect("a tuple of ours in TIME_WAIT is taken over");
        let (_, peer) = app.accept().unwrap();
        assert_eq!(peer, from);
        // A tuple in use is refused, and recognised as such.
        let busy = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        bind_source(&busy, from).unwrap();
        let e = NetnsError::Socket {
            name: "test".into(),
            source: busy.connect(&to).unwrap_err(),
        };
        assert!(source_port_taken(&e), "{e}");
    }
}
