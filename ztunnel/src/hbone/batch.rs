//! An HBONE connection's socket writes, batched per turn of the runtime.
//!
//! h2 writes out every DATA frame of more than 256 bytes before it encodes the next one
//! (it keeps such a payload unbuffered, one at a time), and tokio-rustls sends each write
//! to the socket at once: with 32 streams busy on one connection, every request and every
//! response was one TLS record, one `writev` and one TCP segment (0.97 `writev`s per request
//! and ztunnel, `bench` 32 connections), and the peer paid a read and often a wake-up for
//! each. Under TLS, [`BatchedTcp`] keeps what the connection's task writes, and [`flushing`],
//! which drives that task, writes it out in one go once the other tasks this turn of the
//! runtime woke have run: the streams whose data arrived together leave together.
//!
//! Bounded: past [`LIMIT`] bytes kept, a write waits for the socket. A write of
//! [`DIRECT`] bytes or more with nothing kept goes straight to the socket (bulk transfers:
//! no copy, nothing to gain by waiting). Before [`flushing`] starts (the TLS and HTTP/2
//! handshakes) every write goes straight out.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// The most a connection keeps unwritten (rustls's own send buffer limit, `tuning.rs`).
pub const LIMIT: usize = 256 * 1024;
/// Writes this large go straight out when nothing is kept.
pub const DIRECT: usize = 16 * 1024;
/// Room kept for the next batch once one is written; a larger buffer is given back.
const KEEP: usize = 32 * 1024;

/// The socket under an HBONE connection's TLS. Reads go straight through.
#[derive(Debug)]
pub struct BatchedTcp {
    read: OwnedReadHalf,
    write: Arc<Mutex<Writer>>,
}

/// Writes out what the connection's task kept (see [`flushing`]).
#[derive(Debug)]
pub struct Flusher(Arc<Mutex<Writer>>);

#[derive(Debug)]
struct Writer {
    half: OwnedWriteHalf,
    out: Vec<u8>,
    /// Bytes of `out` already written.
    sent: usize,
    batching: bool,
    /// A write of a batch failed: every later write fails alike (the bytes are lost, so
    /// the connection must end).
    failed: Option<io::ErrorKind>,
    /// Writes that reached the socket.
    #[cfg(test)]
    socket_writes: usize,
}

impl BatchedTcp {
    pub fn new(tcp: TcpStream) -> (BatchedTcp, Flusher) {
        let (read, half) = tcp.into_split();
        let write = Arc::new(Mutex::new(Writer {
            half,
            out: Vec::new(),
            sent: 0,
            batching: false,
            failed: None,
            #[cfg(test)]
            socket_writes: 0,
        }));
        (
            BatchedTcp {
                read,
                write: write.clone(),
            },
            Flusher(write),
        )
    }

    fn writer(&self) -> MutexGuard<'_, Writer> {
        lock(&self.write)
    }
}

// Only the connection's task takes it, never across an await: uncontended.
fn lock(w: &Mutex<Writer>) -> MutexGuard<'_, Writer> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

impl Writer {
    fn count_write(&mut self) {
        #[cfg(test)]
        {
            self.socket_writes += 1;
        }
    }

    fn kept(&self) -> usize {
        self.out.len() - self.sent
    }

    fn check(&self) -> io::Result<()> {
        match self.failed {
            Some(kind) => Err(io::Error::new(
                kind,
                "an earlier batched write to this HBONE connection failed",
            )),
            None => Ok(()),
        }
    }

    /// Writes out everything kept.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        while self.sent < self.out.len() {
            let n = match Pin::new(&mut self.half).poll_write(cx, &self.out[self.sent..]) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => Err(io::ErrorKind::WriteZero.into()),
                Poll::Ready(r) => r,
            };
            match n {
                Ok(n) => {
                    self.sent += n;
                    self.count_write();
                }
                Err(e) => {
                    self.failed = Some(e.kind());
                    self.out = Vec::new();
                    self.sent = 0;
                    return Poll::Ready(Err(e));
                }
            }
        }
        self.out.clear();
        self.sent = 0;
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for BatchedTcp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for BatchedTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut w = self.writer();
        w.check()?;
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if w.kept() + len > LIMIT || !w.batching {
            ready!(w.poll_drain(cx))?;
        }
        if !w.batching || (w.kept() == 0 && len >= DIRECT) {
            let r = ready!(Pin::new(&mut w.half).poll_write_vectored(cx, bufs));
            w.count_write();
            return Poll::Ready(r);
        }
        for b in bufs {
            w.out.extend_from_slice(b);
        }
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut w = self.writer();
        if w.batching {
            // Written once the task's turn is over ([`flushing`]).
            return Poll::Ready(w.check());
        }
        ready!(w.poll_drain(cx))?;
        Pin::new(&mut w.half).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut w = self.writer();
        ready!(w.poll_drain(cx))?;
        Pin::new(&mut w.half).poll_shutdown(cx)
    }
}

/// Drives `connection` (the future that polls an HBONE connection over a [`BatchedTcp`])
/// with its writes batched. After a poll that kept bytes, the batch stays open until the
/// runtime's turn is over: tokio wakes a deferred waker once no task is ready and it has
/// looked for more I/O without sleeping (`tokio::task::yield_now`), so the streams that
/// other tasks of this turn write to join the batch; then the batch is written out. A
/// socket that cannot take it all wakes the task when it can.
///
/// Waiting for the turn's end costs one more look for I/O (an `epoll_wait` that does not
/// sleep) and one more poll of the connection. When a batch gathered nothing more than its
/// first write (one busy stream, say), the next [`SKIP_AFTER_LONE`] batches are written
/// out at once, so a connection that gains nothing by waiting seldom pays for it.
///
/// When `connection` ends, what is kept is written if the socket takes it at once (a
/// normal close has written everything already: h2 shuts the socket down, which drains).
pub fn flushing<F: Future>(connection: F, flusher: Flusher) -> Flushing<F> {
    lock(&flusher.0).batching = true;
    let turn = Arc::new(TurnEnd::default());
    Flushing {
        connection,
        flusher,
        turn_waker: Waker::from(turn.clone()),
        turn,
        batch: Batch::default(),
    }
}

pin_project_lite::pin_project! {
    /// [`flushing`]'s future: the connection's own, held in place (an `async fn` would keep
    /// its argument and its pinned copy, twice the connection's state).
    pub struct Flushing<F> {
        #[pin]
        connection: F,
        flusher: Flusher,
        turn: Arc<TurnEnd>,
        turn_waker: Waker,
        batch: Batch,
    }
}

impl<F: Future> Future for Flushing<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let out = this.connection.poll(cx);
        let mut w = lock(&this.flusher.0);
        if out.is_ready() {
            let _ = w.poll_drain(cx);
            return out;
        }
        let (batch, turn) = (this.batch, this.turn);
        let kept = w.kept();
        if kept == 0 {
            batch.open = false;
            return Poll::Pending;
        }
        if batch.open {
            if kept > batch.kept {
                batch.writes = batch.writes.saturating_add(1);
                batch.kept = kept;
            }
            if !turn.over.load(Ordering::Acquire) {
                // Woken within the turn (a stream's data): the batch stays open.
                turn.task.register(cx.waker());
                return Poll::Pending;
            }
            batch.open = false;
            if batch.writes < 2 {
                batch.skip = SKIP_AFTER_LONE;
            }
        } else if batch.skip > 0 {
            batch.skip -= 1;
        } else {
            *batch = Batch {
                open: true,
                kept,
                writes: 1,
                skip: 0,
            };
            turn.over.store(false, Ordering::Release);
            turn.task.register(cx.waker());
            // Its first poll hands `turn_waker` to the runtime to wake at the turn's end.
            let _ = std::pin::pin!(tokio::task::yield_now())
                .poll(&mut Context::from_waker(this.turn_waker));
            return Poll::Pending;
        }
        if let Poll::Ready(Err(_)) = w.poll_drain(cx) {
            // The connection meets the error at its next read or write.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

/// Batches written out at once after one that gathered a single write.
pub const SKIP_AFTER_LONE: u8 = 16;

#[derive(Debug, Default)]
struct Batch {
    open: bool,
    /// Bytes kept at the last poll, to count the polls that added to the batch.
    kept: usize,
    writes: u8,
    skip: u8,
}

/// Woken by the runtime at the end of the turn a batch opened in.
#[derive(Debug, Default)]
struct TurnEnd {
    over: AtomicBool,
    task: AtomicWaker,
}

impl Wake for TurnEnd {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.over.store(true, Ordering::Release);
        self.task.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    async fn pair() -> (BatchedTcp, Flusher, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (io, flusher) = BatchedTcp::new(client);
        (io, flusher, server)
    }

    /// A stand-in for an HTTP/2 connection: writes (and flushes) each chunk it is sent.
    async fn connection(
        mut io: BatchedTcp,
        mut chunks: tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
    ) -> BatchedTcp {
        while let Some(c) = chunks.recv().await {
            io.write_all(&c).await.unwrap();
            io.flush().await.unwrap();
        }
        io
    }

    /// A [`connection`] driven by [`flushing`] on a runtime task: what sends it chunks, its
    /// peer, its writer (to look at) and its task.
    struct Driven {
        tx: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
        peer: TcpStream,
        counter: Arc<Mutex<Writer>>,
        conn: tokio::task::JoinHandle<BatchedTcp>,
    }

    async fn driven() -> Driven {
        let (io, flusher, peer) = pair().await;
        let counter = Arc::clone(&flusher.0);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = tokio::spawn(flushing(connection(io, rx), flusher));
        Driven {
            tx,
            peer,
            counter,
            conn,
        }
    }

    fn socket_writes(f: &Flusher) -> usize {
        lock(&f.0).socket_writes
    }

    #[tokio::test]
    async fn before_flushing_starts_every_write_goes_straight_out() {
        let (mut io, flusher, mut peer) = pair().await;
        io.write_all(b"handshake").await.unwrap();
        io.flush().await.unwrap();
        let mut got = [0; 9];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"handshake");
        assert_eq!(socket_writes(&flusher), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn writes_of_streams_woken_in_one_turn_leave_in_one_socket_write() {
        let Driven {
            tx,
            mut peer,
            counter,
            conn,
        } = driven().await;
        // Three "streams", each woken by the same task in one poll (as one read of the
        // pods' sockets wakes several relays), each handing the connection its chunk.
        let mut wakers = Vec::new();
        for i in 0..3u8 {
            let (go, wait) = tokio::sync::oneshot::channel::<()>();
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = wait.await;
                tx.send(vec![i; 1000]).unwrap();
            });
            wakers.push(go);
        }
        tokio::task::yield_now().await;
        tokio::spawn(async move {
            for go in wakers {
                let _ = go.send(());
            }
        })
        .await
        .unwrap();
        let mut got = vec![0; 3000];
        peer.read_exact(&mut got).await.unwrap();
        let mut firsts: Vec<u8> = got.chunks(1000).map(|c| c[0]).collect();
        assert!(
            got.chunks(1000).all(|c| c.iter().all(|b| *b == c[0])),
            "chunks interleaved"
        );
        firsts.sort();
        assert_eq!(firsts, vec![0, 1, 2]);
        assert_eq!(
            lock(&counter).socket_writes,
            1,
            "one socket write for the three chunks"
        );
        drop(tx);
        conn.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_lone_write_per_turn_stops_waiting_for_the_turns_end() {
        let Driven {
            tx,
            mut peer,
            counter,
            conn,
        } = driven().await;
        // One request at a time (one busy stream): each batch gathers one write, and every
        // chunk still goes out, in order, before the next is sent.
        for i in 0..40u8 {
            tx.send(vec![i; 100]).unwrap();
            let mut got = [0; 100];
            peer.read_exact(&mut got).await.unwrap();
            assert!(got.iter().all(|b| *b == i));
        }
        assert_eq!(lock(&counter).socket_writes, 40);
        drop(tx);
        conn.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_peer_that_does_not_read_holds_the_writer_at_the_limit() {
        let Driven {
            tx,
            mut peer,
            counter,
            conn,
        } = driven().await;
        const CHUNK: usize = 1000;
        let total = 40 * 1024 * 1024 / CHUNK;
        for i in 0..total {
            tx.send(vec![(i % 251) as u8; CHUNK]).unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        // Stuck behind the socket's buffers, never more than the limit kept here.
        assert!(
            lock(&counter).kept() <= LIMIT,
            "kept {} bytes",
            lock(&counter).kept()
        );
        assert!(!conn.is_finished());
        let mut got = vec![0; total * CHUNK];
        peer.read_exact(&mut got).await.unwrap();
        assert!(
            got.chunks(CHUNK)
                .enumerate()
                .all(|(i, c)| c.iter().all(|b| *b == (i % 251) as u8)),
            "bytes lost or out of order"
        );
        drop(tx);
        conn.await.unwrap();
    }

    #[tokio::test]
    async fn after_a_failed_batch_every_write_fails() {
        let (io, flusher, peer) = pair().await;
        let counter = Arc::clone(&flusher.0);
        // A reset from the peer: the next batch fails, and so does every later write.
        crate::netns::reset(peer);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let conn = tokio::spawn(flushing(
            async move {
                let mut io = io;
                let mut rx = rx;
                let mut result = Ok(());
                while let Some(c) = rx.recv().await {
                    result = io.write_all(&c).await;
                    if result.is_err() {
                        break;
                    }
                }
                result
            },
            flusher,
        ));
        let mut failed = false;
        for _ in 0..200 {
            if tx.send(vec![1; 1000]).is_err() {
                failed = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(failed, "writes kept succeeding after the peer reset");
        assert!(conn.await.unwrap().is_err());
        assert!(lock(&counter).failed.is_some() || lock(&counter).kept() == 0);
    }
}
