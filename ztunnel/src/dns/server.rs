//! One pod's DNS listeners: UDP and TCP on 127.0.0.1:15053 (and `[::1]:15053` for a pod
//! with IPv6 capture) inside the pod's netns, bound
//! before capture steers port 53 to them and closed with the pod's other listeners
//! (SO_REUSEPORT lets a new ztunnel bind beside the old one). The pod that asks is the
//! listener's pod. Work is bounded per pod: questions in flight over UDP (more are
//! dropped; the client retries), TCP connections, and TCP idle time.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::answer::Transport;
use super::error::DnsError;
use super::proxy::DnsProxy;
use crate::listen::accept_backoff;
use crate::netns::InPodNetns;
use crate::ports;
use crate::proxy::pod::LocalPod;

/// UDP questions of one pod being answered at once.
const UDP_IN_FLIGHT: usize = 256;
/// A UDP query larger than this is cut short (and then malformed): EDNS's largest payload.
const MAX_UDP_QUERY: usize = 4096;
/// TCP connections of one pod at once.
const TCP_CONNECTIONS: usize = 64;
/// A TCP connection with no complete question for this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);

pub struct Listeners {
    pub udp: Vec<UdpSocket>,
    pub tcp: Vec<TcpListener>,
}

/// Binds the DNS listeners inside the pod: on 127.0.0.1, and on `[::1]` with `ipv6`.
pub fn bind(netns: &InPodNetns, ipv6: bool) -> Result<Listeners, DnsError> {
    let mut out = Listeners {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    let loopbacks = [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ];
    for ip in loopbacks.into_iter().take(if ipv6 { 2 } else { 1 }) {
        let addr = SocketAddr::new(ip, ports::DNS);
        let err = |source| DnsError::Bind {
            pod: netns.name().to_string(),
            addr,
            source,
        };
        let domain = if ip.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let s = netns
            .run(|| {
                Socket::new(
                    domain,
                    Type::DGRAM.nonblocking().cloexec(),
                    Some(Protocol::UDP),
                )
            })
            .map_err(|e| err(io::Error::other(e)))?
            .map_err(err)?;
        s.set_reuse_address(true).map_err(err)?;
        s.set_reuse_port(!crate::netns::socket_options().no_port_reuse)
            .map_err(err)?;
        if ip.is_ipv6() {
            s.set_only_v6(true).map_err(err)?;
        }
        s.bind(&addr.into()).map_err(err)?;
        out.udp
            .push(UdpSocket::from_std(std::net::UdpSocket::from(s)).map_err(err)?);
        out.tcp.push(
            netns
                .listen(addr, false)
                .map_err(|e| err(io::Error::other(e)))?,
        );
    }
    Ok(out)
}

/// Serves the pod's DNS listeners until draining starts (or the task is dropped, which
/// also drops every question in progress).
pub async fn serve(
    proxy: Arc<DnsProxy>,
    pod: LocalPod,
    listeners: Listeners,
    drain: Arc<crate::drain::Drain>,
) {
    let mut all = JoinSet::new();
    for sock in listeners.udp {
        all.spawn(serve_udp(proxy.clone(), pod.clone(), sock));
    }
    for l in listeners.tcp {
        all.spawn(serve_tcp(proxy.clone(), pod.clone(), l));
    }
    tokio::select! {
        _ = drain.signaled() => {}
        _ = all.join_next() => {}
    }
}

async fn serve_udp(proxy: Arc<DnsProxy>, pod: LocalPod, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let permits = Arc::new(Semaphore::new(UDP_IN_FLIGHT));
    let mut tasks = JoinSet::new();
    let mut buf = vec![0u8; MAX_UDP_QUERY];
    loop {
        while tasks.try_join_next().is_some() {}
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                accept_backoff("dns-udp", e).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(pod = %pod.workload.name, "too many DNS questions in flight; dropping one");
            continue;
        };
        let wire = buf[..n].to_vec();
        let (proxy, pod, sock) = (proxy.clone(), pod.clone(), sock.clone());
        tasks.spawn(async move {
            let _permit = permit;
            if let Some(resp) = proxy.handle(&pod, &wire, Transport::Udp).await {
                if let Err(e) = sock.send_to(&resp, peer).await {
                    tracing::debug!(pod = %pod.workload.name, %peer, error = %e, "cannot send a DNS response");
                }
            }
        });
    }
}

async fn serve_tcp(proxy: Arc<DnsProxy>, pod: LocalPod, listener: TcpListener) {
    let permits = Arc::new(Semaphore::new(TCP_CONNECTIONS));
    let mut tasks = JoinSet::new();
    loop {
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                accept_backoff("dns-tcp", e).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(pod = %pod.workload.name, %peer, "too many DNS TCP connections; closing one");
            continue;
        };
        let (proxy, pod) = (proxy.clone(), pod.clone());
        tasks.spawn(async move {
            let _permit = permit;
            if let Err(e) = serve_tcp_conn(&proxy, &pod, stream).await {
                tracing::debug!(pod = %pod.workload.name, %peer, error = %e, "DNS TCP connection ended");
            }
        });
    }
}

/// Length-prefixed questions, answered in order, until the client closes or idles.
async fn serve_tcp_conn(proxy: &DnsProxy, pod: &LocalPod, mut stream: TcpStream) -> io::Result<()> {
    // The server the client dialled (capture keeps it; with eBPF, reading it also frees
    // the entry). Forwarding goes to the node's resolvers, whatever it was.
    if let Ok(dst) = crate::netns::original_dst(&stream) {
        tracing::trace!(pod = %pod.workload.name, original_dst = %dst, "DNS over TCP");
    }
    let timed_out = |_| io::Error::new(io::ErrorKind::TimedOut, "idle");
    loop {
        let len = match tokio::time::timeout(TCP_IDLE, stream.read_u16())
            .await
            .map_err(timed_out)?
        {
            Ok(len) => len,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut buf = vec![0u8; usize::from(len)];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut buf))
            .await
            .map_err(timed_out)??;
        let Some(resp) = proxy.handle(pod, &buf, Transport::Tcp).await else {
            return Ok(());
        };
        let Ok(rlen) = u16::try_from(resp.len()) else {
            return Ok(());
        };
        let mut out = Vec::with_capacity(resp.len() + 2);
        out.extend_from_slice(&rlen.to_be_bytes());
        out.extend_from_slice(&resp);
        tokio::time::timeout(TCP_IDLE, stream.write_all(&out))
            .await
            .map_err(timed_out)??;
    }
}
