//! A hostile HTTP/2 peer: mTLS like a mesh proxy (or not quite), then raw frames of our
//! choosing, so tests can send what a well-behaved client library never would
//! (rapid resets, CONTINUATION floods, empty DATA floods, too many streams).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::netsim::Netns;

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const GOAWAY: u8 = 0x7;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK header block of literals (no indexing, no Huffman).
pub fn header_block(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (k, v) in headers {
        b.push(0x00);
        for s in [k, v] {
            assert!(s.len() < 127, "short strings only");
            b.push(s.len() as u8);
            b.extend_from_slice(s.as_bytes());
        }
    }
    b
}

/// `CONNECT authority` as a HEADERS payload.
pub fn connect_block(authority: &str) -> Vec<u8> {
    header_block(&[(":method", "CONNECT"), (":authority", authority)])
}

/// A received frame (type, flags, stream, payload).
pub type Frame = (u8, u8, u32, Vec<u8>);

pub struct RawH2 {
    wr: WriteHalf<TlsStream<TcpStream>>,
    frames: tokio::sync::mpsc::UnboundedReceiver<Frame>,
    /// Set when the server closed the connection (EOF or error).
    pub closed: Arc<tokio::sync::Notify>,
    closed_flag: Arc<std::sync::atomic::AtomicBool>,
}

async fn read_frames(
    mut rd: ReadHalf<TlsStream<TcpStream>>,
    tx: tokio::sync::mpsc::UnboundedSender<Frame>,
) {
    loop {
        let mut head = [0u8; 9];
        if rd.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        if rd.read_exact(&mut payload).await.is_err() {
            return;
        }
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if tx.send((head[3], head[4], stream, payload)).is_err() {
            return;
        }
    }
}

impl RawH2 {
    /// TLS with `cfg` (ALPN h2 is set here), then the client preface and empty SETTINGS.
    pub async fn connect(
        from: &Netns,
        dst: SocketAddr,
        mut cfg: rustls::ClientConfig,
    ) -> Result<RawH2> {
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = from.connect(dst).await?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(
                rustls_pki_types::ServerName::IpAddress(dst.ip().into()),
                tcp,
            )
            .await
            .context("TLS handshake")?;
        let (rd, mut wr) = tokio::io::split(tls);
        wr.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
        wr.write_all(&frame(SETTINGS, 0, 0, &[])).await?;
        let (tx, frames) = tokio::sync::mpsc::unbounded_channel();
        let closed = Arc::new(tokio::sync::Notify::new());
        let closed_flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, f) = (closed.clone(), closed_flag.clone());
        tokio::spawn(async move {
            read_frames(rd, tx).await;
            f.store(true, std::sync::atomic::Ordering::SeqCst);
            c.notify_waiters();
        });
        Ok(RawH2 {
            wr,
            frames,
            closed,
            closed_flag,
        })
    }

    /// Writes frames; an error means the server has closed the connection.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.wr.write_all(bytes).await
    }

    pub fn is_closed(&self) -> bool {
        self.closed_flag.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until the server closes the connection.
    pub async fn wait_closed(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.is_closed() {
            if tokio::time::timeout_at(deadline, self.closed.notified())
                .await
                .is_err()
            {
                return self.is_closed();
            }
        }
        true
    }

    /// Frames received so far.
    pub fn drain(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Ok(f) = self.frames.try_recv() {
            out.push(f);
        }
        out
    }

    /// The next frame of `kind` within `timeout`.
    pub async fn next_of(&mut self, kind: u8, timeout: Duration) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.frames.recv()).await {
                Ok(Some(f)) if f.0 == kind => return Some(f),
                Ok(Some(_)) => continue,
                _ => return None,
            }
        }
    }
}
