//! A read-side guard on an HBONE server connection: it follows the HTTP/2 frame headers
//! as the bytes go by (nothing is buffered or copied) and ends the connection when a peer
//! floods it with DATA frames that carry no data. h2 drops such frames silently, so they
//! would cost CPU without ever reaching (or being refused by) the proxy. Envoy counts
//! them in a row (`max_consecutive_inbound_frames_with_empty_payload`), which any other
//! frame (a PRIORITY, say) resets; here they are counted per time window, whatever comes
//! between them. CONTINUATION floods, rapid reset and too many streams are refused by h2
//! itself.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// DATA frames without payload (and without END_STREAM) tolerated per window.
pub const MAX_EMPTY_DATA_FRAMES: u32 = 100;
/// The window empty DATA frames are counted in.
pub const EMPTY_DATA_WINDOW: Duration = Duration::from_secs(1);

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
    PadLength { frame_len: usize, end_stream: bool },
    /// Payload bytes still to skip.
    Payload(usize),
}

/// Follows the client side of an HTTP/2 connection (server view).
#[derive(Debug)]
pub struct FrameGuard<T> {
    inner: T,
    parse: Parse,
    /// Empty DATA frames seen since `window_start`.
    empty: u32,
    window_start: Option<Instant>,
    limit: u32,
}

/// The guard tripped: the peer sent more empty DATA frames in a window than allowed.
pub fn is_flood(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData && e.to_string().contains(FLOOD)
}

const FLOOD: &str = "empty DATA frame flood";

impl<T> FrameGuard<T> {
    pub fn new(inner: T) -> FrameGuard<T> {
        Self::with_limit(inner, MAX_EMPTY_DATA_FRAMES)
    }

    pub fn with_limit(inner: T, limit: u32) -> FrameGuard<T> {
        FrameGuard {
            inner,
            parse: Parse::Preface(PREFACE_LEN),
            empty: 0,
            window_start: None,
            limit,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Counts a DATA frame: more than `limit` empty ones in one window trip the guard.
    fn data_frame(&mut self, data_len: usize, end_stream: bool, now: Instant) -> io::Result<()> {
        if data_len > 0 || end_stream {
            return Ok(());
        }
        match self.window_start {
            Some(start) if now.saturating_duration_since(start) < EMPTY_DATA_WINDOW => {}
            _ => {
                self.window_start = Some(now);
                self.empty = 0;
            }
        }
        self.empty += 1;
        if self.empty > self.limit {
            return Err(io::Error::new(io::ErrorKind::InvalidData, FLOOD));
        }
        Ok(())
    }

    /// Advances the frame parser over bytes just read.
    fn observe(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.observe_at(bytes, Instant::now())
    }

    fn observe_at(&mut self, mut bytes: &[u8], now: Instant) -> io::Result<()> {
        while !bytes.is_empty() {
            match &mut self.parse {
                Parse::Preface(left) => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.parse = Parse::Header {
                            buf: [0; 9],
                            have: 0,
                        };
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
                    let len = (usize::from(buf[0]) << 16)
                        | (usize::from(buf[1]) << 8)
                        | usize::from(buf[2]);
                    let (kind, flags) = (buf[3], buf[4]);
                    let end_stream = flags & FLAG_END_STREAM != 0;
                    if kind == FRAME_DATA && flags & FLAG_PADDED != 0 && len > 0 {
                        // The data length is known once the pad length byte is read.
                        self.parse = Parse::PadLength {
                            frame_len: len,
                            end_stream,
                        };
                        continue;
                    }
                    if kind == FRAME_DATA {
                        self.data_frame(len, end_stream, now)?;
                    }
                    self.parse = if len == 0 {
                        Parse::Header {
                            buf: [0; 9],
                            have: 0,
                        }
                    } else {
                        Parse::Payload(len)
                    };
                }
                Parse::PadLength {
                    frame_len,
                    end_stream,
                } => {
                    let (frame_len, end_stream) = (*frame_len, *end_stream);
                    let pad = usize::from(bytes[0]);
                    bytes = &bytes[1..];
                    // A pad longer than the frame is h2's error to report; count it as empty.
                    let data_len = frame_len.saturating_sub(1 + pad);
                    self.data_frame(data_len, end_stream, now)?;
                    let left = frame_len - 1;
                    self.parse = if left == 0 {
                        Parse::Header {
                            buf: [0; 9],
                            have: 0,
                        }
                    } else {
                        Parse::Payload(left)
                    };
                }
                Parse::Payload(left) => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.parse = Parse::Header {
                            buf: [0; 9],
                            have: 0,
                        };
                    }
                }
            }
        }
        Ok(())
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FrameGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
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
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
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
    fn empty_data_floods_trip_it_within_a_window() {
        let t0 = Instant::now();
        let mut g = guard();
        let empty = frame(FRAME_DATA, 0, 1, b"");
        for _ in 0..3 {
            g.observe_at(&empty, t0).unwrap();
        }
        // Real data between them changes nothing: the count is per window.
        g.observe_at(&frame(FRAME_DATA, 0, 1, b"x"), t0).unwrap();
        let e = g.observe_at(&empty, t0).unwrap_err();
        assert!(is_flood(&e), "{e}");
        // The next window starts from zero.
        let mut g = guard();
        for _ in 0..3 {
            g.observe_at(&empty, t0).unwrap();
        }
        for _ in 0..3 {
            g.observe_at(&empty, t0 + EMPTY_DATA_WINDOW).unwrap();
        }
        assert!(g.observe_at(&empty, t0 + EMPTY_DATA_WINDOW).is_err());
    }

    /// Audit finding 11: a PRIORITY (or any other frame) after every `limit` empty DATA
    /// frames used to reset the count, so the flood never tripped.
    #[test]
    fn other_frames_between_empty_data_do_not_reset_the_count() {
        let t0 = Instant::now();
        let empty = frame(FRAME_DATA, 0, 1, b"");
        let priority = frame(0x2, 0, 1, &[0, 0, 0, 3, 16]);
        let settings = frame(0x4, 0, 0, b"");
        for between in [priority, settings] {
            let mut g = guard();
            let mut tripped = false;
            for round in 0..10 {
                for _ in 0..3 {
                    if g.observe_at(&empty, t0).is_err() {
                        tripped = true;
                    }
                }
                if tripped {
                    assert!(round <= 1, "tripped only in round {round}");
                    break;
                }
                g.observe_at(&between, t0).unwrap();
            }
            assert!(
                tripped,
                "empty DATA frames with other frames between them never tripped the guard"
            );
        }
    }

    #[test]
    fn frames_split_anywhere_and_padding_are_followed() {
        let t0 = Instant::now();
        let mut g = guard();
        // Padded DATA with only padding is empty; with data in it, it is not.
        let mut stream: Vec<u8> = Vec::new();
        for _ in 0..2 {
            stream.extend(frame(FRAME_DATA, FLAG_PADDED, 1, &[4, 0, 0, 0, 0]));
        }
        stream.extend(frame(0x8, 0, 0, &[0, 0, 0, 1])); // WINDOW_UPDATE
        for _ in 0..3 {
            stream.extend(frame(FRAME_DATA, FLAG_PADDED, 1, &[2, b'a', 0, 0]));
        }
        stream.extend(frame(FRAME_DATA, FLAG_PADDED, 1, &[4, 0, 0, 0, 0]));
        for chunk in stream.chunks(5) {
            g.observe_at(chunk, t0).unwrap();
        }
        assert!(g.observe_at(&frame(FRAME_DATA, 0, 1, b""), t0).is_err());
        // END_STREAM on an empty frame (padded or not) is the normal end of a stream.
        let mut g = guard();
        for _ in 0..10 {
            g.observe_at(&frame(FRAME_DATA, FLAG_END_STREAM, 1, b""), t0)
                .unwrap();
            g.observe_at(
                &frame(FRAME_DATA, FLAG_END_STREAM | FLAG_PADDED, 1, &[2, 0, 0]),
                t0,
            )
            .unwrap();
        }
    }
}
