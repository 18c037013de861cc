//! One HBONE stream as a byte stream (`AsyncRead + AsyncWrite`), so an HTTP server or
//! client (the waypoint's hyper) can run inside a tunnel.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::pool::StreamGuard;

/// Largest chunk handed to h2 per write; bounds what one write buffers.
const MAX_WRITE: usize = 256 * 1024;

pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// Received bytes not yet read (flow-control credit for them is already returned).
    pending: Bytes,
    /// Bytes put back by a protocol sniffer, read before `pending`.
    unread: Bytes,
    recv_done: bool,
    shut_down: bool,
    /// Keeps the pooled connection's stream slot while the stream lives.
    _guard: Option<StreamGuard>,
}

impl H2Stream {
    pub fn new(send: SendStream<Bytes>, recv: RecvStream, guard: Option<StreamGuard>) -> H2Stream {
        H2Stream {
            send,
            recv,
            pending: Bytes::new(),
            unread: Bytes::new(),
            recv_done: false,
            shut_down: false,
            _guard: guard,
        }
    }

    /// Puts bytes already read back in front of the stream (after sniffing a protocol).
    pub fn unread(&mut self, data: Bytes) {
        debug_assert!(self.unread.is_empty());
        self.unread = data;
    }

    /// Resets the stream (RST_STREAM CANCEL), for an abandoned exchange.
    pub fn reset(&mut self) {
        self.send.send_reset(h2::Reason::CANCEL);
    }
}

fn to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e
            .into_io()
            .unwrap_or_else(|| io::Error::other("HTTP/2 I/O error"));
    }
    io::Error::new(io::ErrorKind::ConnectionReset, e)
}

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            for buf in [&mut this.unread, &mut this.pending] {
                if !buf.is_empty() {
                    let n = buf.len().min(out.remaining());
                    out.put_slice(&buf[..n]);
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
            }
            if this.recv_done {
                return Poll::Ready(Ok(()));
            }
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    let _ = this.recv.flow_control().release_capacity(chunk.len());
                    this.pending = chunk;
                }
                // A peer that resets with NO_ERROR has finished sending.
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => this.recv_done = true,
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
                None => this.recv_done = true,
            }
        }
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let this = &mut *self;
        let want = buf.len().min(MAX_WRITE);
        this.send.reserve_capacity(want);
        loop {
            match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(0)) => continue,
                Some(Ok(cap)) => {
                    let n = cap.min(want);
                    this.send
                        .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .map_err(to_io)?;
                    return Poll::Ready(Ok(n));
                }
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.shut_down {
            self.shut_down = true;
            self.send.send_data(Bytes::new(), true).map_err(to_io)?;
        }
        Poll::Ready(Ok(()))
    }
}
