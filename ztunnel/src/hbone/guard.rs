//! A read-side guard on an HBONE server connection: it follows the HTTP/2 frame headers
//! as the bytes go by (nothing is buffered or copied) and ends the connection when a peer
//! floods it with DATA frames that carry no data. h2 drops such frames silently, so they
//! would cost CPU without ever reaching (or being refused by) the proxy; Envoy limits them
//! the same way (`max_consecutive_inbound_frames_with_empty_payload`). CONTINUATION floods,
//! rapid reset and too many streams are refused by h2 itself.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Consecutive DATA frames without payload (and without END_STREAM) tolerated.
pub const MAX_EMPTY_DATA_FRAMES: u32 = 100;

const PREFACE_LEN: usize = 24;
const FRAME_DATA: u8 = 0x0;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_PADDED: u8 = 0x8;

#[derive(Debug)]
enum Parse {
    /// Client connection preface bytes still to skip.
    Preface(usize),
    /// Collecting a 9-byte frame header.
    Header { buf: [u8; 9], have: usize },
    /// A padded DATA frame: its first payload byte (the pad length) tells what's data.
    PadLength { frame_len: usize },
    /// Payload bytes still to skip.
    Payload(usize),
}

/// Follows the client side of an HTTP/2 connection (server view).
#[derive(Debug)]
pub struct FrameGuard<T> {
    inner: T,
    parse: Parse,
    empty_run: u32,
    limit: u32,
}

/// The guard tripped: the peer sent more empty DATA frames in a row than allowed.
pub fn is_flood(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData && e.to_string().contains(FLOOD)
}

const FLOOD: &str = "empty DATA frame flood";

impl<T> FrameGuard<T> {
    pub fn new(inner: T) -> FrameGuard<T> {
        Self::with_limit(inner, MAX_EMPTY_DATA_FRAMES)
    }

    pub fn with_limit(inner: T, limit: u32) -> FrameGuard<T> {
        FrameGuard { inner, parse: Parse::Preface(PREFACE_LEN), empty_run: 0, limit }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Counts a DATA frame: empty ones in a row trip the guard.
    fn data_frame(&mut self, data_len: usize, flags: u8) -> io::Result<()> {
        if data_len == 0 && flags & FLAG_END_STREAM == 0 {
            self.empty_run += 1;
            if self.empty_run > self.limit {
                return Err(io::Error::new(io::ErrorKind::InvalidData, FLOOD));
            }
        } else {
            self.empty_run = 0;
        }
        Ok(())
    }

    /// Advances the frame parser over bytes just read.
    fn observe(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match &mut self.parse {
                Parse::Preface(left) => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.parse = Parse::Header { buf: [0; 9], have: 0 };
                    }
                }
                Parse::Header { buf, have } => {
                    let n = (9 - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    bytes = &bytes[n..];
                    if *have < 9 {
                        continue;
                    }
                    let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
                    let (kind, flags) = (buf[3], buf[4]);
                    if kind == FRAME_DATA && flags & FLAG_PADDED != 0 && len > 0 {
                        self.parse = Parse::PadLength { frame_len: len };
                        // The END_STREAM flag is judged with the data length below.
                        if flags & FLAG_END_STREAM != 0 {
                            self.empty_run = 0;
                        }
                        continue;
                    }
                    if kind == FRAME_DATA {
                        self.data_frame(len, flags)?;
                    } else {
                        self.empty_run = 0;
                    }
                    self.parse = if len == 0 { Parse::Header { buf: [0; 9], have: 0 } } else { Parse::Payload(len) };
                }
                Parse::PadLength { frame_len } => {
                    let frame_len = *frame_len;
                    let pad = usize::from(bytes[0]);
                    bytes = &bytes[1..];
                    // A pad longer than the frame is h2's error to report; count it as empty.
                    let data_len = frame_len.saturating_sub(1 + pad);
                    self.data_frame(data_len, 0)?;
                    let left = frame_len - 1;
                    self.parse = if left == 0 { Parse::Header { buf: [0; 9], have: 0 } } else { Parse::Payload(left) };
                }
                Parse::Payload(left) => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.parse = Parse::Header { buf: [0; 9], have: 0 };
                    }
                }
            }
        }
        Ok(())
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FrameGuard<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.observe(&buf.filled()[before..])?;
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FrameGuard<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn guard() -> FrameGuard<()> {
        let mut g = FrameGuard::with_limit((), 3);
        g.observe(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        g
    }

    #[test]
    fn empty_data_floods_trip_it_and_real_data_resets_the_count() {
        let mut g = guard();
        let empty = frame(FRAME_DATA, 0, 1, b"");
        for _ in 0..3 {
            g.observe(&empty).unwrap();
        }
        g.observe(&frame(FRAME_DATA, 0, 1, b"x")).unwrap();
        for _ in 0..3 {
            g.observe(&empty).unwrap();
        }
        let e = g.observe(&empty).unwrap_err();
        assert!(is_flood(&e), "{e}");
    }

    #[test]
    fn frames_split_anywhere_and_padding_are_followed() {
        let mut g = guard();
        // Padded DATA with only padding is empty; other frame kinds reset the run.
        let mut stream: Vec<u8> = Vec::new();
        for _ in 0..3 {
            stream.extend(frame(FRAME_DATA, FLAG_PADDED, 1, &[4, 0, 0, 0, 0]));
        }
        stream.extend(frame(0x8, 0, 0, &[0, 0, 0, 1])); // WINDOW_UPDATE
        for _ in 0..3 {
            stream.extend(frame(FRAME_DATA, FLAG_PADDED, 1, &[2, b'a', 0, 0]));
        }
        for chunk in stream.chunks(5) {
            g.observe(chunk).unwrap();
        }
        for _ in 0..3 {
            g.observe(&frame(FRAME_DATA, FLAG_PADDED, 1, &[4, 0, 0, 0, 0])).unwrap();
        }
        assert!(g.observe(&frame(FRAME_DATA, 0, 1, b"")).is_err());
        // END_STREAM on an empty frame is the normal end of a stream, not a flood.
        let mut g = guard();
        for _ in 0..10 {
            g.observe(&frame(FRAME_DATA, FLAG_END_STREAM, 1, b"")).unwrap();
        }
    }
}
