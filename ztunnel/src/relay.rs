//! Relays: the byte copies behind every proxied connection, both ways, until both
//! directions end, with half-close carried through and a failure on one side resetting
//! the other. TCP to TCP (passthrough and plaintext inbound), TCP to an HBONE stream
//! (ztunnel's tunnels), HBONE stream to HBONE stream (the waypoint). Each counts the
//! bytes it moved, reported also when it fails, and the TCP ones end on an idle timeout
//! or when policy revokes the connection.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
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
        let n = match read_once(from, &mut buf).await {
            Poll::Ready(Ok(0)) => return to.shutdown().await,
            Poll::Ready(Ok(n)) => n,
            Poll::Pending => {
                buf = Vec::new();
                continue;
            }
            Poll::Ready(Err(e)) => return Err(e),
        };
        to.write_all(&buf[..n]).await?;
        buf.clear();
        count.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// One read attempt into `buf`'s spare capacity, `Pending` when nothing is there. It goes
/// through `AsyncRead`, whose read that leaves the buffer unfilled marks the socket
/// drained (edge-triggered epoll reports the next arrival), so the next attempt waits
/// for readiness without a `recvfrom` that can only say `EAGAIN`: one syscall of the
/// seven each ztunnel makes per request.
async fn read_once(from: &mut ReadHalf<'_>, buf: &mut Vec<u8>) -> Poll<io::Result<usize>> {
    std::future::poll_fn(|cx| Poll::Ready(tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut *from), cx, buf))).await
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
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let res = {
        let relay = TcpH2 { tcp, send: &mut send, recv: &mut recv, sent: &sent, received: &received, up: Up::default(), down: Down::default() };
        tokio::select! {
            r = relay => r,
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

/// Chunks one direction of a relay moves per wake-up before it lets other tasks run.
const BURST: usize = 32;

/// Both directions of a TCP ⇄ HTTP/2 stream copy as one small state machine instead of
/// two composed `async fn`s: every open tunnel holds it for its life, and composed
/// futures keep the read, write, flow-control and shutdown states side by side
/// (`tests::relay_futures_stay_small`: 496 bytes with its select and idle watchdog,
/// where `copy_tcp`, built the composed way, takes 1464).
struct TcpH2<'a> {
    tcp: &'a mut TcpStream,
    send: &'a mut SendStream<Bytes>,
    recv: &'a mut RecvStream,
    sent: &'a AtomicU64,
    received: &'a AtomicU64,
    up: Up,
    down: Down,
}

/// TCP to the tunnel: the read buffer (none while the connection is quiet, so an idle
/// tunnel holds none), the chunk waiting for flow-control credit, done once EOF went out
/// as END_STREAM.
#[derive(Default)]
struct Up {
    buf: BytesMut,
    chunk: Bytes,
    done: bool,
}

/// The tunnel to TCP: the chunk being written, then END_STREAM as a write shutdown.
#[derive(Default)]
struct Down {
    chunk: Bytes,
    state: DownState,
}

#[derive(Default, PartialEq, Eq)]
enum DownState {
    #[default]
    Receiving,
    ShuttingDown,
    Done,
}

impl std::future::Future for TcpH2<'_> {
    type Output = Result<(), CopyError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        // Either side failing ends both at once (the caller resets the other).
        if !this.up.done {
            if let Poll::Ready(r) = this.poll_up(cx) {
                r?;
                this.up.done = true;
            }
        }
        if this.down.state != DownState::Done {
            if let Poll::Ready(r) = this.poll_down(cx) {
                r?;
                this.down.state = DownState::Done;
            }
        }
        if this.up.done && this.down.state == DownState::Done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

impl TcpH2<'_> {
    /// TCP to the tunnel until EOF (sent as END_STREAM).
    fn poll_up(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), CopyError>> {
        for _ in 0..BURST {
            let up = &mut self.up;
            if !up.chunk.is_empty() {
                self.send.reserve_capacity(up.chunk.len());
                match self.send.poll_capacity(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(0))) => continue,
                    Poll::Ready(Some(Ok(cap))) => {
                        let part = up.chunk.split_to(cap.min(up.chunk.len()));
                        self.send.send_data(part, false).map_err(CopyError::Stream)?;
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(CopyError::Stream(e))),
                    Poll::Ready(None) => return Poll::Ready(Err(CopyError::Stream(h2::Error::from(h2::Reason::CANCEL)))),
                }
            }
            // Read what is there with the buffer in hand; when nothing is, give the
            // buffer back before waiting (10,000 idle tunnels would otherwise keep a
            // touched page or two of 64 KiB each).
            if up.buf.capacity() == 0 {
                match self.tcp.poll_read_ready(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => r.map_err(CopyError::Tcp)?,
                }
                up.buf.reserve(COPY_BUF);
            } else if up.buf.capacity() < COPY_BUF / 4 {
                // What is left of the last allocation after the chunks went to h2: read large.
                up.buf.reserve(COPY_BUF);
            }
            // Through `AsyncRead` (see `read_once`): after a read that left the buffer
            // unfilled, this returns `Pending` without another `recvfrom`.
            match tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut *self.tcp), cx, &mut up.buf) {
                Poll::Ready(Ok(0)) => {
                    self.send.send_data(Bytes::new(), true).map_err(CopyError::Stream)?;
                    up.buf = BytesMut::new();
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(n)) => {
                    self.sent.fetch_add(n as u64, Ordering::Relaxed);
                    up.chunk = up.buf.split().freeze();
                }
                Poll::Pending => {
                    up.buf = BytesMut::new();
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(CopyError::Tcp(e))),
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The tunnel to TCP until END_STREAM (then a write shutdown); a stream that ends
    /// with RST_STREAM is an error.
    fn poll_down(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), CopyError>> {
        for _ in 0..BURST {
            let down = &mut self.down;
            if !down.chunk.is_empty() {
                let n = match std::pin::Pin::new(&mut *self.tcp).poll_write(cx, &down.chunk) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(CopyError::Tcp(io::ErrorKind::WriteZero.into()))),
                    Poll::Ready(Ok(n)) => n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(CopyError::Tcp(e))),
                };
                bytes::Buf::advance(&mut down.chunk, n);
                self.received.fetch_add(n as u64, Ordering::Relaxed);
                // Credit goes back only for bytes written, so a slow reader pushes back
                // on the sender instead of growing our buffers.
                let _ = self.recv.flow_control().release_capacity(n);
                continue;
            }
            match down.state {
                DownState::Receiving => match self.recv.poll_data(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(chunk))) => down.chunk = chunk,
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(CopyError::Stream(e))),
                    Poll::Ready(None) => down.state = DownState::ShuttingDown,
                },
                DownState::ShuttingDown => {
                    return match std::pin::Pin::new(&mut *self.tcp).poll_shutdown(cx) {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(r) => Poll::Ready(r.map_err(CopyError::Tcp)),
                    }
                }
                DownState::Done => return Poll::Ready(Ok(())),
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_futures_stay_small() {
        use crate::task_size::Returns;
        // Every open tunnel holds one for its life, inside its connection's task (496 and
        // 1464 bytes in the test build: copy_tcp is still two composed async fns, as
        // copy_tcp_h2 was before its state machine).
        type Never = std::future::Pending<()>;
        let tcp_h2 = Returns::<(&mut TcpStream, SendStream<Bytes>, RecvStream, Never, Option<Duration>)>::returned_size(&copy_tcp_h2);
        let tcp = Returns::<(crate::metrics::OpenConnection, &mut TcpStream, &mut TcpStream, Never, Option<Duration>)>::returned_size(&copy_tcp);
        let watchdog = idle_watchdog.returned_size();
        let relay = std::mem::size_of::<TcpH2<'_>>();
        println!("copy_tcp_h2 {tcp_h2} (TcpH2 {relay}), copy_tcp {tcp}, idle_watchdog {watchdog} (Sleep {})", std::mem::size_of::<tokio::time::Sleep>());
        assert!(tcp_h2 <= 560 && tcp <= 1600, "relay futures grew: copy_tcp_h2 {tcp_h2} bytes, copy_tcp {tcp} bytes");
    }
}
