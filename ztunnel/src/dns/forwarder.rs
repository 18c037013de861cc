//! Forwarding to the node's upstream resolvers: the nameservers of ztunnel's own
//! /etc/resolv.conf (or `--dns-upstream`), tried in order. Each question goes out as a
//! fresh query of ours (random id, EDNS with our payload size, the client's DO and CD
//! bits) from a fresh socket (random source port) in ztunnel's own netns with the proxy
//! mark, so pod capture never sees it. UDP first; a truncated answer is asked again over
//! TCP. An answer counts only if its id and question are ours; anything else arriving
//! on the socket is ignored (spoofing), so a bad datagram cannot end the wait early.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::error::DnsError;
use super::message::EDNS_PAYLOAD;

/// Receive buffer for upstream UDP answers (larger than we advertise, for lenient servers).
const UDP_BUFFER: usize = 4096;
/// At most this many servers are tried per question (glibc's MAXNS).
const MAX_TRIES: usize = 3;

/// An upstream answer: parsed, and as received (what the cache keeps).
pub struct Answer {
    pub message: Message,
    pub wire: Vec<u8>,
    pub server: SocketAddr,
}

pub struct Forwarder {
    upstreams: Vec<SocketAddr>,
    /// One try (one server, UDP, plus TCP after truncation).
    attempt_timeout: Duration,
    /// The whole question, over every server.
    total_timeout: Duration,
    /// Node-wide bound on questions in flight upstream.
    in_flight: tokio::sync::Semaphore,
    max_in_flight: usize,
}

impl Forwarder {
    pub fn new(
        upstreams: Vec<SocketAddr>,
        attempt_timeout: Duration,
        total_timeout: Duration,
        max_in_flight: usize,
    ) -> Forwarder {
        Forwarder {
            upstreams,
            attempt_timeout,
            total_timeout,
            in_flight: tokio::sync::Semaphore::new(max_in_flight),
            max_in_flight,
        }
    }

    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }

    /// Asks the upstream servers `q`; the first valid answer wins.
    pub async fn ask(
        &self,
        q: &Query,
        dnssec_ok: bool,
        checking_disabled: bool,
    ) -> Result<Answer, DnsError> {
        let Ok(_permit) = self.in_flight.try_acquire() else {
            return Err(DnsError::Overloaded(self.max_in_flight));
        };
        let deadline = Instant::now() + self.total_timeout;
        let mut last = DnsError::NoUpstream;
        for &server in self.upstreams.iter().take(MAX_TRIES) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let timeout = left.min(self.attempt_timeout);
            match tokio::time::timeout(
                timeout,
                self.try_server(server, q, dnssec_ok, checking_disabled),
            )
            .await
            {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(e)) => last = e,
                Err(_) => last = DnsError::Timeout { server, timeout },
            }
            tracing::debug!(upstream = %server, error = %last, "upstream DNS server failed; trying the next");
        }
        Err(last)
    }

    async fn try_server(
        &self,
        server: SocketAddr,
        q: &Query,
        dnssec_ok: bool,
        cd: bool,
    ) -> Result<Answer, DnsError> {
        let answer = exchange_udp(server, q, dnssec_ok, cd).await?;
        if !answer.message.metadata.truncation {
            return Ok(answer);
        }
        match exchange_tcp(server, q, dnssec_ok, cd).await {
            Ok(full) => Ok(full),
            Err(e) => {
                // The truncated answer still tells the client to retry over TCP itself.
                tracing::debug!(upstream = %server, error = %e, "TCP retry of a truncated answer failed");
                Ok(answer)
            }
        }
    }
}

/// Our query for `q` with a random id.
fn query_message(q: &Query, dnssec_ok: bool, cd: bool) -> Result<(u16, Vec<u8>), DnsError> {
    let id: u16 = rand::random();
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.metadata.checking_disabled = cd;
    m.queries.push(q.clone());
    let mut edns = Edns::new();
    edns.set_max_payload(EDNS_PAYLOAD);
    edns.set_dnssec_ok(dnssec_ok);
    m.edns = Some(edns);
    let wire = m.to_vec().map_err(|e| DnsError::Encode(e.to_string()))?;
    Ok((id, wire))
}

/// The answer in `wire` if it answers our query `id` for `q`.
pub fn accept(wire: &[u8], id: u16, q: &Query) -> Result<Message, &'static str> {
    let header = super::message::Header::parse(wire).ok_or("shorter than a header")?;
    if header.id != id {
        return Err("another query's id");
    }
    if !header.response || header.qdcount != 1 {
        return Err("not a response to one question");
    }
    let m = Message::from_vec(wire).map_err(|_| "malformed")?;
    let Some(rq) = m.queries.first() else {
        return Err("no question");
    };
    let same_name = rq
        .name()
        .to_ascii()
        .eq_ignore_ascii_case(&q.name().to_ascii());
    if !same_name || rq.query_type() != q.query_type() || rq.query_class() != q.query_class() {
        return Err("another question");
    }
    if m.metadata.message_type != MessageType::Response {
        return Err("not a response");
    }
    Ok(m)
}

/// A socket of ours towards `server`: in ztunnel's own netns (callers never run this
/// inside a pod's), carrying the proxy mark.
fn upstream_socket(server: SocketAddr, ty: Type, proto: Protocol) -> io::Result<Socket> {
    let s = Socket::new(
        Domain::for_address(server),
        ty.nonblocking().cloexec(),
        Some(proto),
    )?;
    s.set_mark(crate::marks::PROXY_MARK)?;
    Ok(s)
}

async fn exchange_udp(
    server: SocketAddr,
    q: &Query,
    dnssec_ok: bool,
    cd: bool,
) -> Result<Answer, DnsError> {
    let io_err = |source| DnsError::Upstream { server, source };
    let s = upstream_socket(server, Type::DGRAM, Protocol::UDP).map_err(io_err)?;
    s.connect(&server.into()).map_err(io_err)?;
    let sock = tokio::net::UdpSocket::from_std(std::net::UdpSocket::from(s)).map_err(io_err)?;
    let (id, wire) = query_message(q, dnssec_ok, cd)?;
    sock.send(&wire).await.map_err(io_err)?;
    let mut buf = vec![0u8; UDP_BUFFER];
    loop {
        // A connected socket only receives from the server; ICMP unreachable ends the wait.
        let n = sock.recv(&mut buf).await.map_err(io_err)?;
        match accept(&buf[..n], id, q) {
            Ok(message) => {
                return Ok(Answer {
                    message,
                    wire: buf[..n].to_vec(),
                    server,
                })
            }
            Err(reason) => {
                tracing::debug!(upstream = %server, reason, "ignoring a datagram that does not answer our query")
            }
        }
    }
}

async fn exchange_tcp(
    server: SocketAddr,
    q: &Query,
    dnssec_ok: bool,
    cd: bool,
) -> Result<Answer, DnsError> {
    let io_err = |source| DnsError::Upstream { server, source };
    let s = upstream_socket(server, Type::STREAM, Protocol::TCP).map_err(io_err)?;
    let sock = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(s));
    let mut stream = sock.connect(server).await.map_err(io_err)?;
    let (id, wire) = query_message(q, dnssec_ok, cd)?;
    let len = u16::try_from(wire.len()).map_err(|_| io_err(io::Error::other("query too long")))?;
    let mut out = Vec::with_capacity(wire.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&wire);
    stream.write_all(&out).await.map_err(io_err)?;
    let len = stream.read_u16().await.map_err(io_err)?;
    let mut buf = vec![0u8; usize::from(len)];
    stream.read_exact(&mut buf).await.map_err(io_err)?;
    let message =
        accept(&buf, id, q).map_err(|reason| DnsError::InvalidAnswer { server, reason })?;
    Ok(Answer {
        message,
        wire: buf,
        server,
    })
}

/// The nameservers of a resolv.conf, port 53.
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            (f.next()? == "nameserver").then_some(())?;
            // Zone-scoped IPv6 (fe80::1%eth0) does not parse and is skipped.
            let ip: IpAddr = f.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, 53))
        })
        .collect()
}

pub fn read_resolv_conf(path: &Path) -> Result<Vec<SocketAddr>, DnsError> {
    let text = std::fs::read_to_string(path).map_err(|source| DnsError::ResolvConf {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parse_resolv_conf(&text))
}

/// `IP` (port 53) or `IP:PORT` (IPv6 with a port in brackets).
pub fn parse_upstream(s: &str) -> Result<SocketAddr, DnsError> {
    let s = s.trim();
    s.parse::<SocketAddr>()
        .or_else(|_| s.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| DnsError::BadUpstream(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::{Name, RecordType};

    #[test]
    fn resolv_conf_and_upstream_addresses() {
        let conf = "# comment\nsearch default.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\nnameserver  2001:db8::53 \noptions ndots:5\nnameserver\n";
        assert_eq!(
            parse_resolv_conf(conf),
            vec![
                "10.96.0.10:53".parse().unwrap(),
                "[2001:db8::53]:53".parse().unwrap()
            ]
        );
        assert_eq!(
            parse_upstream("10.0.0.9").unwrap(),
            "10.0.0.9:53".parse().unwrap()
        );
        assert_eq!(
            parse_upstream("10.0.0.9:5353").unwrap(),
            "10.0.0.9:5353".parse().unwrap()
        );
        assert_eq!(
            parse_upstream("[::1]:5353").unwrap(),
            "[::1]:5353".parse().unwrap()
        );
        assert!(parse_upstream("dns.example:53").is_err());
    }

    #[test]
    fn upstream_sockets_carry_the_proxy_mark() {
        // SO_MARK needs CAP_NET_ADMIN; the e2e tests (root) always get here.
        match upstream_socket("127.0.0.1:53".parse().unwrap(), Type::DGRAM, Protocol::UDP) {
            Ok(s) => assert_eq!(s.mark().unwrap(), crate::marks::PROXY_MARK),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => crate::test_skip::skipped(
                &format!("cannot set SO_MARK (needs CAP_NET_ADMIN: run as root): {e}"),
            ),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn accepts_only_the_answer_to_our_query() {
        let q = Query::query(Name::from_ascii("Example.com.").unwrap(), RecordType::A);
        let (id, wire) = query_message(&q, false, false).unwrap();
        assert!(accept(&wire, id, &q).is_err(), "a query is not an answer");
        let mut resp = Message::from_vec(&wire).unwrap();
        resp.metadata.message_type = MessageType::Response;
        let ok = resp.to_vec().unwrap();
        assert!(accept(&ok, id, &q).is_ok());
        // Case differences (0x20) are fine; another id or question is not.
        let lower = Query::query(Name::from_ascii("example.com.").unwrap(), RecordType::A);
        assert!(accept(&ok, id, &lower).is_ok());
        assert_eq!(
            accept(&ok, id.wrapping_add(1), &q).unwrap_err(),
            "another query's id"
        );
        let other = Query::query(Name::from_ascii("example.org.").unwrap(), RecordType::A);
        assert_eq!(accept(&ok, id, &other).unwrap_err(), "another question");
        let aaaa = Query::query(Name::from_ascii("example.com.").unwrap(), RecordType::AAAA);
        assert_eq!(accept(&ok, id, &aaaa).unwrap_err(), "another question");
        assert!(accept(&ok[..11], id, &q).is_err());
        assert!(accept(&ok[..ok.len() - 3], id, &q).is_err());
    }
}
