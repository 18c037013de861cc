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
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

/// Read buffer of a TCP to HBONE copy while data flows.
const COPY_BUF: usize = 64 * 1024;
/// Reads after one that filled its buffer (a bulk transfer): fewer, larger HTTP/2 frames
/// and TLS writes per byte. Request/response traffic never fills 64 KiB, so stays at that.
const BULK_BUF: usize = 256 * 1024;
/// Read buffer of a TCP to TCP copy while data flows.
const TCP_COPY_BUF: usize = 32 * 1024;
/// Reads of a TCP to TCP copy after one that filled its buffer: fewer reads and writes
/// per byte of a bulk transfer, as [`BULK_BUF`] for tunnels.
const TCP_BULK_BUF: usize = 256 * 1024;

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
    #[error("closed: the connection lasted its maximum duration (DestinationRule maxConnectionDuration)")]
    MaxDuration,
}

/// Completes once neither counter has moved for `timeout` (checked every `timeout`, so
/// an idle connection ends within twice the timeout); never without a timeout.
pub async fn idle_watchdog(counters: [&AtomicU64; 2], timeout: Option<Duration>) {
    let Some(timeout) = timeout.filter(|t| !t.is_zero()) else {
        return std::future::pending().await;
    };
    let total = || {
        counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<u64>()
    };
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
        let relay = TcpTcp::new(&mut *a, &mut *b, &from_client, &to_client);
        tokio::select! {
            r = relay => r,
            _ = revoked => Err(io::Error::other(CopyError::Revoked.to_string())),
            _ = idle_watchdog([&from_client, &to_client], idle) => Err(io::Error::other(CopyError::Idle.to_string())),
        }
    };
    let t = Transferred {
        sent: from_client.into_inner(),
        received: to_client.into_inner(),
    };
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

/// Both directions of a TCP ⇄ TCP relay as one small state machine, as [`TcpH2`] is for
/// tunnels: every open passthrough and plaintext connection holds it for its life
/// (`tests::relay_futures_stay_small`).
struct TcpTcp<'a> {
    client: &'a mut TcpStream,
    upstream: &'a mut TcpStream,
    from_client: &'a AtomicU64,
    to_client: &'a AtomicU64,
    up: OneWay,
    down: OneWay,
}

/// One direction of a TCP ⇄ TCP relay: the read buffer, which also holds the chunk being
/// written (`buf[written..]`), and none while the connection is quiet; EOF goes out as a
/// write shutdown.
#[derive(Default)]
struct OneWay {
    buf: Vec<u8>,
    written: usize,
    phase: Phase,
    /// The last read filled its buffer: read the next with [`TCP_BULK_BUF`].
    bulk: bool,
}

/// Where a direction of a relay is: copying, carrying EOF over (a write shutdown), done.
#[derive(Default, PartialEq, Eq)]
enum Phase {
    #[default]
    Copying,
    ShuttingDown,
    Done,
}

impl<'a> TcpTcp<'a> {
    fn new(
        client: &'a mut TcpStream,
        upstream: &'a mut TcpStream,
        from_client: &'a AtomicU64,
        to_client: &'a AtomicU64,
    ) -> Self {
        TcpTcp {
            client,
            upstream,
            from_client,
            to_client,
            up: OneWay::default(),
            down: OneWay::default(),
        }
    }
}

impl std::future::Future for TcpTcp<'_> {
    type Output = io::Result<()>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let this = &mut *self;
        // Either side failing ends both at once (the caller resets them); a direction
        // that is done answers `Ready` again without touching its sockets.
        let up = this
            .up
            .poll_copy(this.client, this.upstream, this.from_client, cx)?;
        let down = this
            .down
            .poll_copy(this.upstream, this.client, this.to_client, cx)?;
        if up.is_ready() && down.is_ready() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

impl OneWay {
    /// Copies `from` to `to` until EOF, then shuts down `to`'s write side; up to [`BURST`]
    /// chunks per wake-up. `count` grows by the bytes written.
    ///
    /// Reads go through `AsyncRead`, whose read that leaves the buffer unfilled marks the
    /// socket drained (edge-triggered epoll reports the next arrival), so the next attempt
    /// waits for readiness without a `recvfrom` that can only say `EAGAIN` (6 syscalls per
    /// request per ztunnel instead of 7).
    fn poll_copy(
        &mut self,
        from: &mut TcpStream,
        to: &mut TcpStream,
        count: &AtomicU64,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        for _ in 0..BURST {
            // A write may take part of the chunk; the rest waits for the socket's room.
            while self.written < self.buf.len() {
                let n = match std::pin::Pin::new(&mut *to).poll_write(cx, &self.buf[self.written..])
                {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                };
                self.written += n;
                count.fetch_add(n as u64, Ordering::Relaxed);
            }
            match self.phase {
                Phase::Copying => {}
                Phase::ShuttingDown => {
                    std::task::ready!(std::pin::Pin::new(&mut *to).poll_shutdown(cx))?;
                    self.phase = Phase::Done;
                    return Poll::Ready(Ok(()));
                }
                Phase::Done => return Poll::Ready(Ok(())),
            }
            self.buf.clear();
            self.written = 0;
            let size = if self.bulk {
                TCP_BULK_BUF
            } else {
                TCP_COPY_BUF
            };
            if self.buf.capacity() == 0 {
                // No buffer while quiet (an idle connection holds none): wait, then take one.
                std::task::ready!(from.poll_read_ready(cx))?;
            }
            // Empty here: this makes the capacity at least `size` (a bulk read grows it once).
            self.buf.reserve(size);
            let room = self.buf.capacity();
            // Into the spare capacity: nothing to zero first.
            match tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut *from), cx, &mut self.buf) {
                Poll::Ready(Ok(0)) => {
                    self.buf = Vec::new();
                    self.phase = Phase::ShuttingDown;
                }
                Poll::Ready(Ok(n)) => self.bulk = n == room,
                Poll::Pending => {
                    self.buf = Vec::new();
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
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
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let res = {
        let relay = TcpH2 {
            tcp,
            send: &mut send,
            recv: &mut recv,
            sent: &sent,
            received: &received,
            up: Up::default(),
            down: Down::default(),
        };
        tokio::select! {
            r = relay => r,
            _ = revoked => Err(CopyError::Revoked),
            _ = idle_watchdog([&sent, &received], idle) => Err(CopyError::Idle),
        }
    };
    let t = Transferred {
        sent: sent.into_inner(),
        received: received.into_inner(),
    };
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
/// (`tests::relay_futures_stay_small`: 496 bytes with its select and idle watchdog;
/// [`TcpTcp`] does the same for `copy_tcp`, 1464 bytes composed, 448 now).
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
    /// The last read filled its buffer: read the next with [`BULK_BUF`].
    bulk: bool,
}

/// The tunnel to TCP: the chunk being written, then END_STREAM as a write shutdown.
#[derive(Default)]
struct Down {
    chunk: Bytes,
    state: Phase,
}

impl std::future::Future for TcpH2<'_> {
    type Output = Result<(), CopyError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        // Either side failing ends both at once (the caller resets the other).
        if !this.up.done {
            if let Poll::Ready(r) = this.poll_up(cx) {
                r?;
                this.up.done = true;
            }
        }
        if this.down.state != Phase::Done {
            if let Poll::Ready(r) = this.poll_down(cx) {
                r?;
                this.down.state = Phase::Done;
            }
        }
        if this.up.done && this.down.state == Phase::Done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

impl TcpH2<'_> {
    /// TCP to the tunnel until EOF (sent as END_STREAM).
    fn poll_up(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), CopyError>> {
        for _ in 0..BURST {
            let up = &mut self.up;
            if !up.chunk.is_empty() {
                self.send.reserve_capacity(up.chunk.len());
                match self.send.poll_capacity(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(0))) => continue,
                    Poll::Ready(Some(Ok(cap))) => {
                        let part = up.chunk.split_to(cap.min(up.chunk.len()));
                        self.send
                            .send_data(part, false)
                            .map_err(CopyError::Stream)?;
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(CopyError::Stream(e))),
                    Poll::Ready(None) => {
                        return Poll::Ready(Err(CopyError::Stream(h2::Error::from(
                            h2::Reason::CANCEL,
                        ))))
                    }
                }
            }
            // Read what is there with the buffer in hand; when nothing is, give the
            // buffer back before waiting (10,000 idle tunnels would otherwise keep a
            // touched page or two of 64 KiB each).
            let size = if up.bulk { BULK_BUF } else { COPY_BUF };
            if up.buf.capacity() == 0 {
                match self.tcp.poll_read_ready(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => r.map_err(CopyError::Tcp)?,
                }
                up.buf.reserve(size);
            } else if up.buf.capacity() < size / 4 {
                // What is left of the last allocation after the chunks went to h2: read large.
                up.buf.reserve(size);
            }
            let room = up.buf.capacity() - up.buf.len();
            // Through `AsyncRead` (see `OneWay::poll_copy`): after a read that left the buffer
            // unfilled, this returns `Pending` without another `recvfrom`.
            match tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut *self.tcp), cx, &mut up.buf)
            {
                Poll::Ready(Ok(0)) => {
                    self.send
                        .send_data(Bytes::new(), true)
                        .map_err(CopyError::Stream)?;
                    up.buf = BytesMut::new();
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(n)) => {
                    self.sent.fetch_add(n as u64, Ordering::Relaxed);
                    up.bulk = n == room;
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
    fn poll_down(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), CopyError>> {
        for _ in 0..BURST {
            let down = &mut self.down;
            if !down.chunk.is_empty() {
                let n = match std::pin::Pin::new(&mut *self.tcp).poll_write(cx, &down.chunk) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(CopyError::Tcp(io::ErrorKind::WriteZero.into())))
                    }
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
                Phase::Copying => match self.recv.poll_data(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(chunk))) => down.chunk = chunk,
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(CopyError::Stream(e))),
                    Poll::Ready(None) => down.state = Phase::ShuttingDown,
                },
                Phase::ShuttingDown => {
                    return match std::pin::Pin::new(&mut *self.tcp).poll_shutdown(cx) {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(r) => Poll::Ready(r.map_err(CopyError::Tcp)),
                    }
                }
                Phase::Done => return Poll::Ready(Ok(())),
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Called with the bytes carried so far (sent, received), see [`copy_h2_h2`].
pub type Report<'a> = dyn Fn(u64, u64) + Sync + 'a;

/// Relays between two HBONE streams (a waypoint's downstream and upstream) until both
/// directions end: END_STREAM carries over as END_STREAM, a reset on one side resets
/// the other. Credit is returned to each sender only once its bytes were sent on. With
/// `idle`, no byte either way for that long resets both ([`CopyError::Idle`]'s
/// reason, as h2's CANCEL).
///
/// With `report`, every period the bytes carried so far (sent, received) are given to
/// it while the relay goes on (Envoy's periodic TCP metric reporting). With `max`, the
/// relay ends (both reset) once it has lasted that long ([`CopyError::MaxDuration`]).
pub async fn copy_h2_h2(
    down_send: SendStream<Bytes>,
    down_recv: RecvStream,
    up_send: SendStream<Bytes>,
    up_recv: RecvStream,
    idle: Option<Duration>,
    report: Option<(Duration, &Report<'_>)>,
    max: Option<Duration>,
) -> Result<Transferred, (h2::Error, Transferred)> {
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let (mut ds, mut dr, mut us, mut ur) = (down_send, down_recv, up_send, up_recv);
    let reporting = async {
        let Some((every, f)) = report.filter(|(every, _)| !every.is_zero()) else {
            return std::future::pending::<()>().await;
        };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            f(
                sent.load(Ordering::Relaxed),
                received.load(Ordering::Relaxed),
            );
        }
    };
    let r = tokio::select! {
        r = async { tokio::try_join!(h2_to_h2(&mut dr, &mut us, &sent), h2_to_h2(&mut ur, &mut ds, &received)) } => r.map(|_| ()),
        _ = idle_watchdog([&sent, &received], idle) => {
            tracing::debug!("{}", CopyError::Idle);
            Err(h2::Error::from(h2::Reason::CANCEL))
        }
        // Never ends: it reports until the relay does.
        () = reporting => Ok(()),
        () = async {
            match max {
                Some(m) => tokio::time::sleep(m).await,
                None => std::future::pending().await,
            }
        } => {
            tracing::debug!("{}", CopyError::MaxDuration);
            Err(h2::Error::from(h2::Reason::CANCEL))
        }
    };
    let t = Transferred {
        sent: sent.into_inner(),
        received: received.into_inner(),
    };
    match r {
        Ok(()) => Ok(t),
        Err(e) => {
            ds.send_reset(h2::Reason::CANCEL);
            us.send_reset(h2::Reason::CANCEL);
            Err((e, t))
        }
    }
}

async fn h2_to_h2(
    recv: &mut RecvStream,
    send: &mut SendStream<Bytes>,
    count: &AtomicU64,
) -> Result<(), h2::Error> {
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
        count.fetch_add(n as u64, Ordering::Relaxed);
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
        // Every open tunnel or passthrough connection holds one for its life, inside its
        // connection's task (496 and 448 bytes in the test build; copy_tcp took 1464 as
        // two composed async fns, before its state machine).
        type Never = std::future::Pending<()>;
        let tcp_h2 = Returns::<(
            &mut TcpStream,
            SendStream<Bytes>,
            RecvStream,
            Never,
            Option<Duration>,
        )>::returned_size(&copy_tcp_h2);
        let tcp = Returns::<(
            crate::metrics::OpenConnection,
            &mut TcpStream,
            &mut TcpStream,
            Never,
            Option<Duration>,
        )>::returned_size(&copy_tcp);
        let watchdog = idle_watchdog.returned_size();
        let (relay, tcp_relay) = (
            std::mem::size_of::<TcpH2<'_>>(),
            std::mem::size_of::<TcpTcp<'_>>(),
        );
        println!(
            "copy_tcp_h2 {tcp_h2} (TcpH2 {relay}), copy_tcp {tcp} (TcpTcp {tcp_relay}), idle_watchdog {watchdog} (Sleep {})",
            std::mem::size_of::<tokio::time::Sleep>()
        );
        assert!(
            tcp_h2 <= 560 && tcp <= 512,
            "relay futures grew: copy_tcp_h2 {tcp_h2} bytes, copy_tcp {tcp} bytes"
        );
    }

    use crate::metrics::{Metrics, Peer, TcpLabels};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Long enough to catch a hang only.
    const HANG: Duration = Duration::from_secs(60);

    /// A client's connection and its upstream over loopback: the far ends (`client`,
    /// `upstream`) and the relay's ends (`a` from the client, `b` to the upstream).
    async fn connections() -> (TcpStream, TcpStream, TcpStream, TcpStream) {
        let (front, back) = (
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
        );
        let (client, (a, _)) = tokio::try_join!(
            TcpStream::connect(front.local_addr().unwrap()),
            front.accept()
        )
        .unwrap();
        let (b, (upstream, _)) = tokio::try_join!(
            TcpStream::connect(back.local_addr().unwrap()),
            back.accept()
        )
        .unwrap();
        (client, a, b, upstream)
    }

    fn opened(metrics: &Metrics) -> crate::metrics::OpenConnection {
        metrics.opened(&TcpLabels::new(
            "destination",
            Peer::default(),
            Peer::default(),
            None,
            true,
        ))
    }

    /// `len` bytes of a stream numbered by `seed`, from byte `from` on: no two nearby
    /// positions alike, so a lost, repeated or reordered chunk shows.
    fn pattern(seed: u64, from: usize, len: usize) -> Vec<u8> {
        (from..from + len)
            .map(|i| ((i as u64 ^ (seed << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect()
    }

    /// TCP into an HBONE-like stream: a client writing as fast as it can gets frames larger
    /// than 64 KiB once a read fills its buffer (fewer frames and TLS writes per byte), every
    /// byte arrives in order, and a lone small write still goes out as it is.
    #[tokio::test]
    async fn tcp_to_h2_reads_larger_once_a_read_fills_its_buffer() {
        const LEN: usize = 8 << 20;
        let (mut client, mut a, _b, _upstream) = connections().await;
        let (io_client, io_server) = tokio::io::duplex(1 << 20);
        let sizes = |b: &mut h2::client::Builder| {
            b.initial_window_size(16 << 20)
                .initial_connection_window_size(16 << 20)
                .max_frame_size(1 << 20);
        };
        let mut cb = h2::client::Builder::new();
        sizes(&mut cb);
        // Told when the first DATA frame has arrived.
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        let server = tokio::spawn(async move {
            let mut first_tx = Some(first_tx);
            let mut conn = h2::server::Builder::new()
                .initial_window_size(16 << 20)
                .initial_connection_window_size(16 << 20)
                .max_frame_size(1 << 20)
                .handshake::<_, Bytes>(io_server)
                .await
                .unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let mut _send = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            let mut body = req.into_body();
            let (mut got, mut frames) = (Vec::with_capacity(LEN), Vec::new());
            while let Some(chunk) = body.data().await {
                let chunk = chunk.unwrap();
                let _ = body.flow_control().release_capacity(chunk.len());
                frames.push(chunk.len());
                got.extend_from_slice(&chunk);
                if let Some(t) = first_tx.take() {
                    let _ = t.send(());
                }
            }
            (got, frames)
        });
        let (mut h2c, conn) = cb.handshake::<_, Bytes>(io_client).await.unwrap();
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method("CONNECT")
            .uri("127.0.0.1:8080")
            .body(())
            .unwrap();
        let (resp, send) = h2c.send_request(req, false).unwrap();
        let recv = resp.await.unwrap().into_body();
        let relay = tokio::spawn(async move {
            copy_tcp_h2(&mut a, send, recv, std::future::pending(), None)
                .await
                .map_err(|(e, _)| e.to_string())
        });
        // A lone small write first, then as much as the socket takes.
        client.write_all(b"hello").await.unwrap();
        // The bulk only once that frame is out: written together, the two could be read
        // as one, and the test is about a lone write.
        tokio::time::timeout(HANG, first_rx)
            .await
            .expect("the small write was not relayed")
            .unwrap();
        let data = pattern(7, 0, LEN);
        client.write_all(&data).await.unwrap();
        client.shutdown().await.unwrap();
        let (got, frames) = tokio::time::timeout(HANG, server).await.unwrap().unwrap();
        let mut want = b"hello".to_vec();
        want.extend_from_slice(&data);
        assert_same(&got, &want, "tunnelled bytes");
        assert_eq!(frames.first(), Some(&5), "the small write went out alone");
        let largest = frames.iter().copied().max().unwrap_or(0);
        assert!(
            largest > COPY_BUF && largest <= BULK_BUF,
            "largest frame {largest} bytes: frames {frames:?}"
        );
        drop(client);
        let _ = tokio::time::timeout(HANG, relay).await;
    }

    fn assert_same(got: &[u8], want: &[u8], what: &str) {
        let first = got.iter().zip(want).position(|(g, w)| g != w);
        assert!(
            got.len() == want.len() && first.is_none(),
            "{what}: {} bytes of {}, first difference at {first:?}",
            got.len(),
            want.len()
        );
    }

    #[tokio::test]
    async fn tcp_relay_copies_every_byte_both_ways_and_carries_each_half_close() {
        const UP: usize = 5 << 20;
        const DOWN: usize = (3 << 20) + 12_345;
        let (client, mut a, mut b, upstream) = connections().await;
        let metrics = Metrics::default();
        let (mut client_rx, mut client_tx) = client.into_split();
        let (mut upstream_rx, mut upstream_tx) = upstream.into_split();
        let client_sends = tokio::spawn(async move {
            client_tx.write_all(&pattern(1, 0, UP)).await?;
            client_tx.shutdown().await?;
            io::Result::Ok(client_tx)
        });
        let client_gets = tokio::spawn(async move {
            let mut got = Vec::new();
            client_rx.read_to_end(&mut got).await.map(|_| got)
        });
        // The upstream sends half its bytes while the client's flow, the rest once it has
        // the client's EOF (the relay keeps that direction open), then its own EOF.
        let upstream = tokio::spawn(async move {
            let down = pattern(2, 0, DOWN);
            let mut got = Vec::new();
            tokio::try_join!(
                upstream_rx.read_to_end(&mut got),
                upstream_tx.write_all(&down[..DOWN / 2])
            )?;
            upstream_tx.write_all(&down[DOWN / 2..]).await?;
            upstream_tx.shutdown().await?;
            io::Result::Ok((got, upstream_tx))
        });
        let t = tokio::time::timeout(
            HANG,
            copy_tcp(
                opened(&metrics),
                &mut a,
                &mut b,
                std::future::pending(),
                None,
            ),
        )
        .await
        .expect("the relay hung")
        .expect("the relay failed");
        assert_eq!(
            t,
            Transferred {
                sent: UP as u64,
                received: DOWN as u64
            }
        );
        let (at_upstream, _open) = upstream.await.unwrap().unwrap();
        assert_same(&at_upstream, &pattern(1, 0, UP), "client to upstream");
        assert_same(
            &client_gets.await.unwrap().unwrap(),
            &pattern(2, 0, DOWN),
            "upstream to client",
        );
        client_sends.await.unwrap().unwrap();
        let text = metrics.encode();
        let counted = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        };
        assert_eq!(
            counted("istio_tcp_received_bytes_total{"),
            Some(UP.to_string()),
            "{text}"
        );
        assert_eq!(
            counted("istio_tcp_sent_bytes_total{"),
            Some(DOWN.to_string()),
            "{text}"
        );
        assert_eq!(
            counted("istio_tcp_connections_closed_total{"),
            Some("1".into()),
            "{text}"
        );
    }

    #[tokio::test]
    async fn tcp_relay_fails_with_the_counts_so_far_when_the_upstream_resets() {
        let (mut client, mut a, mut b, mut upstream) = connections().await;
        let far_ends = async {
            client.write_all(b"hello upstream").await?;
            upstream.read_exact(&mut [0; 14]).await?;
            upstream.write_all(b"hello client").await?;
            client.read_exact(&mut [0; 12]).await?;
            crate::netns::reset(upstream);
            io::Result::Ok(())
        };
        let (r, ends) = tokio::time::timeout(HANG, async {
            tokio::join!(
                copy_tcp(
                    opened(&Metrics::default()),
                    &mut a,
                    &mut b,
                    std::future::pending(),
                    None
                ),
                far_ends
            )
        })
        .await
        .expect("the relay hung");
        ends.unwrap();
        let (e, t) = r.expect_err("the upstream's reset fails the relay");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        assert_eq!(
            t,
            Transferred {
                sent: 14,
                received: 12
            }
        );
        // The caller's end of the client connection closes with a reset too.
        drop(a);
        let r = tokio::time::timeout(HANG, client.read(&mut [0; 16]))
            .await
            .expect("the client's read hung");
        assert_eq!(
            r.map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::ConnectionReset)
        );
    }

    #[tokio::test]
    async fn tcp_relay_ends_on_the_idle_timeout_or_a_revocation() {
        let (mut client, mut a, mut b, mut upstream) = connections().await;
        client.write_all(b"ping").await.unwrap();
        let relay = copy_tcp(
            opened(&Metrics::default()),
            &mut a,
            &mut b,
            std::future::pending(),
            Some(Duration::from_millis(50)),
        );
        let mut ping = [0; 4];
        let (r, got) = tokio::time::timeout(HANG, async {
            tokio::join!(relay, upstream.read_exact(&mut ping))
        })
        .await
        .expect("the idle timeout never fired");
        got.unwrap();
        let (e, t) = r.expect_err("a quiet connection ends");
        assert_eq!(e.to_string(), CopyError::Idle.to_string());
        assert_eq!(
            t,
            Transferred {
                sent: 4,
                received: 0
            }
        );

        let (_client, mut a, mut b, _upstream) = connections().await;
        let r = tokio::time::timeout(
            HANG,
            copy_tcp(
                opened(&Metrics::default()),
                &mut a,
                &mut b,
                std::future::ready(()),
                None,
            ),
        )
        .await
        .expect("the relay hung");
        let (e, t) = r.expect_err("a revoked connection ends");
        assert_eq!(e.to_string(), CopyError::Revoked.to_string());
        assert_eq!(t, Transferred::default());
    }

    /// A TCP relay reads a bulk transfer in larger chunks once a read fills its buffer,
    /// and a lone small write with the small buffer; every byte arrives in order.
    #[tokio::test]
    async fn tcp_relay_reads_larger_once_a_read_fills_its_buffer() {
        const LEN: usize = 8 << 20;
        let (mut client, mut a, mut b, mut upstream) = connections().await;
        let (from_client, to_client) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut relay = TcpTcp::new(&mut a, &mut b, &from_client, &to_client);
        let reader = tokio::spawn(async move {
            let mut got = Vec::with_capacity(LEN + 5);
            upstream.read_to_end(&mut got).await.map(|_| got)
        });
        // The largest buffer a poll left in hand (a poll that ends its burst, or waits to
        // write, keeps its chunk).
        let mut largest = 0;
        client.write_all(b"hello").await.unwrap();
        while from_client.load(Ordering::Relaxed) < 5 {
            let _ = poll_once(&mut relay, &mut largest).await;
            tokio::task::yield_now().await;
        }
        assert!(!relay.up.bulk, "a small write is not a bulk transfer");
        let writer = tokio::spawn(async move {
            client.write_all(&pattern(9, 0, LEN)).await?;
            client.shutdown().await?;
            io::Result::Ok(client)
        });
        let done = tokio::time::timeout(HANG, async {
            loop {
                if let Poll::Ready(r) = poll_once(&mut relay, &mut largest).await {
                    break r;
                }
                tokio::task::yield_now().await;
            }
        });
        done.await
            .expect("the relay hung")
            .expect("the relay failed");
        let _client = writer.await.unwrap().unwrap();
        let mut want = b"hello".to_vec();
        want.extend_from_slice(&pattern(9, 0, LEN));
        assert_same(&reader.await.unwrap().unwrap(), &want, "relayed bytes");
        assert!(
            largest > TCP_COPY_BUF && largest <= TCP_BULK_BUF,
            "largest buffer {largest} bytes"
        );
    }

    /// Polls `relay` once (its wake-ups go to the calling task) and notes the largest read
    /// buffer it kept.
    async fn poll_once(relay: &mut TcpTcp<'_>, largest: &mut usize) -> Poll<io::Result<()>> {
        std::future::poll_fn(|cx| {
            let r = std::future::Future::poll(std::pin::Pin::new(&mut *relay), cx);
            *largest = (*largest).max(relay.up.buf.capacity());
            Poll::Ready(r)
        })
        .await
    }

    #[tokio::test]
    async fn tcp_relay_holds_one_chunk_for_a_slow_reader_and_no_buffer_while_quiet() {
        const MORE: usize = 1 << 20;
        let (client, mut a, mut b, upstream) = connections().await;
        let (from_client, to_client) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut relay = TcpTcp::new(&mut a, &mut b, &from_client, &to_client);
        let (waits_tx, waits) = tokio::sync::oneshot::channel();
        let (go, go_rx) = tokio::sync::oneshot::channel::<()>();
        let client = tokio::spawn(async move {
            let mut client = client;
            client.read_exact(&mut [0; 2]).await?;
            // Writes until a write waits: with an upstream that reads nothing, a relay
            // that kept reading would never make it wait.
            let mut sent = 0;
            while let Ok(n) = tokio::time::timeout(
                Duration::from_millis(500),
                client.write(&pattern(3, sent, 64 << 10)),
            )
            .await
            {
                sent += n?;
                assert!(
                    sent < 256 << 20,
                    "{sent} bytes went in and no write waited: the relay buffers without bound"
                );
            }
            let _ = waits_tx.send(());
            client.write_all(&pattern(3, sent, MORE)).await?;
            client.shutdown().await?;
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).await?;
            io::Result::Ok(sent + MORE)
        });
        let upstream = tokio::spawn(async move {
            let mut upstream = upstream;
            upstream.write_all(b"hi").await?;
            let _ = go_rx.await;
            let mut got = Vec::new();
            upstream.read_to_end(&mut got).await?;
            upstream.shutdown().await?;
            io::Result::Ok(got)
        });
        tokio::time::timeout(HANG, async {
            tokio::select! {
                biased;
                _ = waits => {}
                r = &mut relay => panic!("the relay ended early: {r:?}"),
            }
        })
        .await
        .expect("the client's writes never waited");
        // The chunk it could not write (the read buffer, at most a bulk read's) and nothing
        // for the direction whose two bytes went through: it is quiet.
        assert!(
            relay.up.buf.capacity() <= TCP_BULK_BUF,
            "the relay holds {} bytes",
            relay.up.buf.capacity()
        );
        assert_eq!(
            relay.down.buf.capacity(),
            0,
            "a quiet direction holds no buffer"
        );
        let _ = go.send(());
        tokio::time::timeout(HANG, &mut relay)
            .await
            .expect("the relay hung")
            .expect("the relay failed");
        assert_eq!(
            relay.up.buf.capacity() + relay.down.buf.capacity(),
            0,
            "a finished relay holds no buffer"
        );
        let sent = client.await.unwrap().unwrap();
        assert_eq!(
            (from_client.into_inner(), to_client.into_inner()),
            (sent as u64, 2)
        );
        assert_same(
            &upstream.await.unwrap().unwrap(),
            &pattern(3, 0, sent),
            "client to a slow upstream",
        );
    }
}
