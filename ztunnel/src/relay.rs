//! Relays: the byte copies behind every proxied connection, both ways, until both
//! directions end, with half-close carried through and a failure on one side resetting
//! the other. TCP to TCP (passthrough and plaintext inbound), TCP to an HBONE stream
//! (ztunnel's tunnels), HBONE stream to HBONE stream (the waypoint). Each counts the
//! bytes it moved, reported also when it fails, and the TCP ones end on an idle timeout
//! or when policy revokes the connection.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::ReadHalf;
use tokio::net::TcpStream;

/// Read buffer of a TCP to HBONE copy while data flows.
const COPY_BUF: usize = 64 * 1024;
/// Read buffer of a TCP to TCP copy while data flows.
const TCP_COPY_BUF: usize = 32 * 1024;

/// How many bytes a relay moved each way, until it ended (also when it failed).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// bytes from the relay's first side to its second: TCP to tunnel ([`copy_tcp_h2`]),
    /// client to upstream ([`copy_tcp`]), downstream to upstream ([`copy_h2_h2`])
    pub sent: u64,
    /// bytes the other way
    pub received: u64,
}

/// Which side broke a tunnel, so the other side can be reset rather than closed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("TCP side failed: {0}")]
    Tcp(io::Error),
    #[error("tunnel stream failed: {0}")]
    Stream(h2::Error),
    #[error("closed: authorization policy now denies this connection")]
    Revoked,
    #[error("closed: no bytes either way for longer than the idle timeout")]
    Idle,
}

/// Completes once neither counter has moved for `timeout` (checked every `timeout`, so
/// an idle connection ends within twice the timeout); never without a timeout.
async fn idle_watchdog(counters: [&AtomicU64; 2], timeout: Option<Duration>) {
    let Some(timeout) = timeout.filter(|t| !t.is_zero()) else {
        return std::future::pending().await;
    };
    let total = || counters.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
    let mut last = total();
    loop {
        tokio::time::sleep(timeout).await;
        let now = total();
        if now == last {
            return;
        }
        last = now;
    }
}

/// Relays between a client connection `a` and its upstream `b`, counting the connection
/// in `conn` (opened by the caller); returns the bytes moved (`sent`: from the client), with the error if it
/// failed. It ends early, with both sides reset, when `revoked` completes (a policy
/// change that denies the connection) or when no byte moved either way for `idle`. An
/// error resets both sides.
pub(crate) async fn copy_tcp(
    conn: crate::metrics::OpenConnection,
    a: &mut TcpStream,
    b: &mut TcpStream,
    revoked: impl std::future::Future<Output = ()>,
    idle: Option<Duration>,
) -> Result<Transferred, (io::Error, Transferred)> {
    let (from_client, to_client) = (AtomicU64::new(0), AtomicU64::new(0));
    let r = {
        let (mut ar, mut aw) = a.split();
        let (mut br, mut bw) = b.split();
        let up = copy_half(&mut ar, &mut bw, &from_client);
        let down = copy_half(&mut br, &mut aw, &to_client);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
            _ = revoked => Err(io::Error::other(CopyError::Revoked.to_string())),
            _ = idle_watchdog([&from_client, &to_client], idle) => Err(io::Error::other(CopyError::Idle.to_string())),
        }
    };
    let t = Transferred { sent: from_client.into_inner(), received: to_client.into_inner() };
    conn.closed(t.sent, t.received);
    match r {
        Ok(()) => Ok(t),
        Err(e) => {
            crate::netns::set_reset_on_close(a);
            crate::netns::set_reset_on_close(b);
            Err((e, t))
        }
    }
}

/// One direction of a TCP relay: copies until EOF, then half-closes the other side.
async fn copy_half(from: &mut ReadHalf<'_>, to: &mut (impl AsyncWrite + Unpin), count: &AtomicU64) -> io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        if buf.capacity() == 0 {
            // No buffer while quiet (an idle connection holds none): wait, then take one.
            from.readable().await?;
            buf.reserve(TCP_COPY_BUF);
        }
        // Into the spare capacity: nothing to zero first.
        let n = match from.try_read_buf(&mut buf) {
            Ok(0) => return to.shutdown().await,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                buf = Vec::new();
                continue;
            }
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n]).await?;
        buf.clear();
        count.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Copies both ways between a TCP connection and an HTTP/2 stream until both directions
/// end. EOF becomes END_STREAM (and END_STREAM a write shutdown), so half-close carries
/// through. An error on one side resets the other: RST_STREAM towards the tunnel, or the
/// caller resets the TCP connection (see [`CopyError`]).
///
/// It also ends early, with the tunnel reset, when `revoked` completes (a policy change
/// that denies the open connection: [`CopyError::Revoked`]) or when no byte moved either
/// way for `idle` ([`CopyError::Idle`]).
pub async fn copy_tcp_h2(
    tcp: &mut TcpStream,
    mut send: SendStream<Bytes>,
    mut recv: RecvStream,
    revoked: impl std::future::Future<Output = ()>,
    idle: Option<Duration>,
) -> Result<Transferred, (CopyError, Transferred)> {
    let (mut rd, mut wr) = tcp.split();
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let res = {
        let up = tcp_to_h2(&mut rd, &mut send, &sent);
        let down = h2_to_tcp(&mut recv, &mut wr, &received);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
            _ = revoked => Err(CopyError::Revoked),
            _ = idle_watchdog([&sent, &received], idle) => Err(CopyError::Idle),
        }
    };
    let t = Transferred { sent: sent.into_inner(), received: received.into_inner() };
    match res {
        Ok(()) => Ok(t),
        Err(e) => {
            if !matches!(e, CopyError::Stream(_)) {
                send.send_reset(h2::Reason::CANCEL);
            }
            Err((e, t))
        }
    }
}

async fn tcp_to_h2(rd: &mut ReadHalf<'_>, send: &mut SendStream<Bytes>, count: &AtomicU64) -> Result<(), CopyError> {
    let mut buf = BytesMut::new();
    loop {
        // Read what is there with the buffer in hand; when nothing is, give the buffer
        // back before waiting, so an idle tunnel holds no read buffer (10,000 idle
        // tunnels would otherwise keep a touched page or two of 64 KiB each).
        if buf.capacity() == 0 {
            rd.readable().await.map_err(CopyError::Tcp)?;
            buf.reserve(COPY_BUF);
        } else if buf.capacity() < COPY_BUF / 4 {
            // What is left of the last allocation after the chunks went to h2: read large.
            buf.reserve(COPY_BUF);
        }
        let n = match rd.try_read_buf(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                buf = BytesMut::new();
                continue;
            }
            Err(e) => return Err(CopyError::Tcp(e)),
        };
        if n == 0 {
            send.send_data(Bytes::new(), true).map_err(CopyError::Stream)?;
            return Ok(());
        }
        let mut chunk = buf.split().freeze();
        count.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let cap = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Err(CopyError::Stream(e)),
                None => return Err(CopyError::Stream(h2::Error::from(h2::Reason::CANCEL))),
            };
            if cap == 0 {
                continue;
            }
            let part = chunk.split_to(cap.min(chunk.len()));
            send.send_data(part, false).map_err(CopyError::Stream)?;
        }
    }
}

async fn h2_to_tcp<W: AsyncWrite + Unpin>(
    recv: &mut RecvStream,
    wr: &mut W,
    count: &AtomicU64,
) -> Result<(), CopyError> {
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.map_err(CopyError::Stream)?;
        let n = chunk.len();
        wr.write_all(&chunk).await.map_err(CopyError::Tcp)?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        // Return flow-control credit only once the bytes are written, so a slow reader
        // pushes back on the sender instead of growing our buffers.
        let _ = recv.flow_control().release_capacity(n);
    }
    // A stream that ends with RST_STREAM yields an error above; None here is END_STREAM.
    wr.shutdown().await.map_err(CopyError::Tcp)?;
    Ok(())
}

/// Relays between two HBONE streams (a waypoint's downstream and upstream) until both
/// directions end: END_STREAM carries over as END_STREAM, a reset on one side resets
/// the other. Credit is returned to each sender only once its bytes were sent on.
pub async fn copy_h2_h2(
    down_send: SendStream<Bytes>,
    down_recv: RecvStream,
    up_send: SendStream<Bytes>,
    up_recv: RecvStream,
) -> Result<Transferred, (h2::Error, Transferred)> {
    let mut t = Transferred::default();
    let (mut ds, mut dr, mut us, mut ur) = (down_send, down_recv, up_send, up_recv);
    let r = tokio::try_join!(h2_to_h2(&mut dr, &mut us, &mut t.sent), h2_to_h2(&mut ur, &mut ds, &mut t.received));
    match r {
        Ok(_) => Ok(t),
        Err(e) => {
            ds.send_reset(h2::Reason::CANCEL);
            us.send_reset(h2::Reason::CANCEL);
            Err((e, t))
        }
    }
}

async fn h2_to_h2(recv: &mut RecvStream, send: &mut SendStream<Bytes>, count: &mut u64) -> Result<(), h2::Error> {
    while let Some(chunk) = recv.data().await {
        let mut chunk = chunk?;
        let n = chunk.len();
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let cap = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(c) => c?,
                None => return Err(h2::Error::from(h2::Reason::CANCEL)),
            };
            if cap == 0 {
                continue;
            }
            send.send_data(chunk.split_to(cap.min(chunk.len())), false)?;
        }
        *count += n as u64;
        let _ = recv.flow_control().release_capacity(n);
    }
    send.send_data(Bytes::new(), true)
}
