//! The TLS ClientHello of a connection to a TLS port, read as Istio's waypoint reads it:
//! Envoy's `tls_inspector` listener filter runs on the ports that declare TLS, under the
//! listener's default `listener_filters_timeout` (15 s, not continued on timeout) and
//! its default `max_client_hello_size` (64 KiB). Nothing is terminated and nothing is
//! routed by it: the waypoint routes by config alone (`route::l4`); the SNI read here
//! goes to the logs.
//!
//! Outcomes, as the inspector's: a whole ClientHello, or bytes that are not one (not a
//! handshake record, not a ClientHello, a message over BoringSSL's 16 KiB bound, a
//! malformed hello: Envoy's `tls_not_found`, which lets the connection through), are
//! relayed with what was read; 64 KiB read without a whole ClientHello closes the
//! connection (`client_hello_too_large`), so do 15 s without one and a client that
//! ends first.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::RecvStream;

/// Envoy's default `listener_filters_timeout`, which Istio leaves on the waypoint's
/// listener.
pub const TIMEOUT: Duration = Duration::from_secs(15);
/// Envoy's default `max_client_hello_size`.
const MAX_READ: usize = 64 * 1024;
/// BoringSSL's bound on a handshake message a server reads before the handshake
/// (`kMaxMessageLen`), and on a record's plaintext.
const MAX_MESSAGE: usize = 16 * 1024;
const HANDSHAKE: u8 = 22;
const CLIENT_HELLO: u8 = 1;
const SERVER_NAME: u16 = 0;

/// What the first bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hello {
    /// A whole ClientHello; its `server_name` (host_name), if it has one.
    Tls { sni: Option<String> },
    /// Not a TLS ClientHello: relayed all the same.
    NotTls,
}

#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    #[error("no whole TLS ClientHello within {} KiB; connection closed (as Envoy's tls_inspector closes it)", MAX_READ / 1024)]
    TooLarge,
    #[error("no whole TLS ClientHello within {0:?}; connection closed (Envoy's listener filter timeout)")]
    Timeout(Duration),
    #[error("the client ended the connection before its ClientHello")]
    Ended,
    #[error("tunnel stream failed: {0}")]
    Stream(#[from] h2::Error),
}

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Done(Hello),
    NeedMore,
}

/// A big-endian reader over a slice; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }

    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    /// A vector with a `len`-byte length prefix.
    fn vec(&mut self, len: usize) -> Option<&'a [u8]> {
        let n = match len {
            1 => self.u8()?,
            _ => self.u16()?,
        };
        self.take(n)
    }
}

/// What the connection's first bytes hold so far, read incrementally: each byte is
/// looked at once however the client splits its writes.
#[derive(Default)]
struct Inspector {
    /// Bytes of whole records taken so far.
    taken: usize,
    /// The handshake bytes, reassembled from the records they came in.
    handshake: Vec<u8>,
}

impl Inspector {
    /// `buf`: every byte read so far (a prefix of it was seen before).
    fn advance(&mut self, buf: &[u8]) -> Verdict {
        loop {
            if let Some(need) = message_len(&self.handshake) {
                if need > MAX_MESSAGE {
                    return Verdict::Done(Hello::NotTls);
                }
                if self.handshake.len() >= 4 + need {
                    return Verdict::Done(match server_name(&self.handshake[4..4 + need]) {
                        Some(sni) => Hello::Tls { sni },
                        None => Hello::NotTls,
                    });
                }
            }
            if self.handshake.first().is_some_and(|t| *t != CLIENT_HELLO) {
                return Verdict::Done(Hello::NotTls);
            }
            // A record: type, version, length (BoringSSL needs the 5 bytes to decide).
            let mut records = Reader(&buf[self.taken..]);
            let Some(header) = records.take(5) else {
                return Verdict::NeedMore;
            };
            let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
            if header[0] != HANDSHAKE || header[1] != 3 || len > MAX_MESSAGE {
                return Verdict::Done(Hello::NotTls);
            }
            let Some(body) = records.take(len) else {
                return Verdict::NeedMore;
            };
            self.handshake.extend_from_slice(body);
            self.taken += 5 + len;
        }
    }
}

#[cfg(test)]
fn classify(buf: &[u8]) -> Verdict {
    Inspector::default().advance(buf)
}

/// For `fuzzing::tls_client_hello`: `data` taken whole, and in two pieces split at
/// `split` as a client's two writes would bring it; both must come to the same verdict
/// (None: still waiting).
pub(crate) fn verdicts(data: &[u8], split: usize) -> (Option<Hello>, Option<Hello>) {
    let done = |v: Verdict| match v {
        Verdict::Done(h) => Some(h),
        Verdict::NeedMore => None,
    };
    let whole = done(Inspector::default().advance(data));
    let mut pieces = Inspector::default();
    let split = split.min(data.len());
    let first = pieces.advance(&data[..split]);
    let last = match first {
        Verdict::Done(_) => first,
        Verdict::NeedMore => pieces.advance(data),
    };
    (whole, done(last))
}

/// The handshake message's length, once its 4-byte header is there.
fn message_len(handshake: &[u8]) -> Option<usize> {
    let h = handshake.get(..4)?;
    Some(usize::from(h[1]) << 16 | usize::from(h[2]) << 8 | usize::from(h[3]))
}

/// A ClientHello body's host_name, Some(None) without one; None if it is malformed.
fn server_name(hello: &[u8]) -> Option<Option<String>> {
    let mut r = Reader(hello);
    r.take(2 + 32)?; // legacy_version, random
    r.vec(1).filter(|id| id.len() <= 32)?;
    r.vec(2).filter(|c| !c.is_empty() && c.len() % 2 == 0)?;
    r.vec(1).filter(|c| !c.is_empty())?;
    if r.0.is_empty() {
        return Some(None);
    }
    let extensions = r.vec(2)?;
    if !r.0.is_empty() {
        return None;
    }
    let mut exts = Reader(extensions);
    let mut sni = None;
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec(2)?;
        if kind != usize::from(SERVER_NAME) {
            continue;
        }
        if sni.is_some() {
            return None; // a repeated extension is malformed
        }
        let mut list = Reader(data);
        let mut names = Reader(list.vec(2)?);
        if !list.0.is_empty() {
            return None;
        }
        while !names.0.is_empty() {
            let name_type = names.u8()?;
            let name = names.vec(2)?;
            if name_type == 0 && sni.is_none() {
                // A name must be a DNS name: no control bytes, nothing a log could be fooled by.
                if name.is_empty() || !name.iter().all(|b| b.is_ascii_graphic()) {
                    return None;
                }
                sni = Some(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    Some(sni)
}

/// Reads the tunnel's first bytes until they are a whole ClientHello or are not one;
/// returns what they are and the bytes, which the caller relays first. Flow-control
/// credit for them is returned.
pub async fn read(recv: &mut RecvStream, timeout: Duration) -> Result<(Hello, Bytes), HelloError> {
    let mut buf = BytesMut::new();
    let mut inspector = Inspector::default();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, recv.data()).await {
            Err(_) => return Err(HelloError::Timeout(timeout)),
            Ok(None) => return Err(HelloError::Ended),
            Ok(Some(chunk)) => chunk?,
        };
        let _ = recv.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        if let Verdict::Done(hello) = inspector.advance(&buf) {
            return Ok((hello, buf.freeze()));
        }
        if buf.len() >= MAX_READ {
            return Err(HelloError::TooLarge);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello with these extensions, in `records` records of about equal size.
    fn hello(extensions: &[(u16, Vec<u8>)], records: usize) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7; 32]);
        body.push(0); // session id
        body.extend([0, 2, 0x13, 0x01]); // one cipher suite
        body.extend([1, 0]); // null compression
        let mut ext = Vec::new();
        for (kind, data) in extensions {
            ext.extend(kind.to_be_bytes());
            ext.extend((data.len() as u16).to_be_bytes());
            ext.extend(data);
        }
        body.extend((ext.len() as u16).to_be_bytes());
        body.extend(ext);
        let mut msg = vec![CLIENT_HELLO, 0];
        msg.extend((body.len() as u16).to_be_bytes());
        msg.extend(body);
        let size = msg.len().div_ceil(records);
        msg.chunks(size)
            .flat_map(|c| {
                let mut r = vec![HANDSHAKE, 3, 1];
                r.extend((c.len() as u16).to_be_bytes());
                r.extend(c);
                r
            })
            .collect()
    }

    fn sni(name: &[u8]) -> (u16, Vec<u8>) {
        let mut entry = vec![0];
        entry.extend((name.len() as u16).to_be_bytes());
        entry.extend(name);
        let mut list = (entry.len() as u16).to_be_bytes().to_vec();
        list.extend(entry);
        (SERVER_NAME, list)
    }

    #[test]
    fn a_client_hello_gives_its_server_name_also_across_records() {
        let want = Verdict::Done(Hello::Tls {
            sni: Some("web.default.svc.cluster.local".into()),
        });
        for records in [1, 2, 7] {
            let h = hello(
                &[
                    (10, vec![0, 2, 0, 29]),
                    sni(b"web.default.svc.cluster.local"),
                ],
                records,
            );
            assert_eq!(classify(&h), want, "{records} records");
            // Every prefix waits for more.
            for n in 0..h.len() {
                assert_eq!(
                    classify(&h[..n]),
                    Verdict::NeedMore,
                    "{records} records, {n} bytes"
                );
            }
        }
        assert_eq!(
            classify(&hello(&[], 1)),
            Verdict::Done(Hello::Tls { sni: None }),
            "no server_name"
        );
    }

    /// What Envoy's inspector lets through as `tls_not_found`: relayed, not refused.
    #[test]
    fn what_is_not_a_client_hello_is_relayed() {
        let not = Verdict::Done(Hello::NotTls);
        assert_eq!(classify(b"GET / HTTP/1.1\r\n\r\n"), not);
        assert_eq!(
            classify(b"\x15\x03\x03\x00\x02\x02\x28"),
            not,
            "an alert record"
        );
        assert_eq!(classify(b"\x16\x02\x00\x00\x04"), not, "SSL 2 version");
        assert_eq!(
            classify(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00"),
            not,
            "a ServerHello"
        );
        assert_eq!(
            classify(b"\x16\x03\x01\x50\x00"),
            not,
            "a record over 16 KiB"
        );
        assert_eq!(
            classify(b"\x16\x03\x01\x00\x04\x01\x01\x00\x00"),
            not,
            "a ClientHello over BoringSSL's 16 KiB"
        );
        let mut bad = hello(&[sni(b"a\nb")], 1);
        assert_eq!(classify(&bad), not, "a control byte in the name");
        bad = hello(&[sni(b"a"), sni(b"b")], 1);
        assert_eq!(classify(&bad), not, "server_name twice");
        bad = hello(&[sni(b"web")], 1);
        let last = bad.len() - 1;
        bad[last - 4] ^= 0xff; // a name length past its extension
        assert_eq!(classify(&bad), not, "malformed");
        // Under 5 bytes BoringSSL has not decided yet.
        assert_eq!(classify(b"GET "), Verdict::NeedMore);
    }

    /// Untrusted bytes: every mutation of a valid hello, fed in pieces, ends in a
    /// verdict or a wait, never a panic.
    #[test]
    fn mutated_hellos_never_panic() {
        let base = hello(
            &[
                sni(b"web.default.svc.cluster.local"),
                (16, vec![0, 3, 2, b'h', b'2']),
            ],
            3,
        );
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut h = base.clone();
            let i = (x as usize) % h.len();
            h[i] = (x >> 32) as u8;
            let cut = (x >> 40) as usize % (h.len() + 1);
            let mut inspector = Inspector::default();
            let _ = inspector.advance(&h[..cut / 2]);
            let _ = inspector.advance(&h[..cut]);
        }
    }

    #[tokio::test]
    async fn reading_is_bounded_in_size_and_time() {
        use bytes::Bytes;
        // An h2 pair in memory: the client's stream is what `read` reads.
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        // The connection is polled on (it carries the frames) while each stream is read.
        let (results_tx, mut results_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut conn = h2::server::handshake(server_io).await.unwrap();
            while let Some(Ok((req, mut tx))) = conn.accept().await {
                let results_tx = results_tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send_response(http::Response::new(()), false);
                    let mut body = req.into_body();
                    let r = read(&mut body, Duration::from_millis(300)).await;
                    let _ =
                        results_tx.send(r.map(|(h, b)| (h, b.len())).map_err(|e| e.to_string()));
                    drop(tx);
                });
            }
        });
        let (mut h2c, conn) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(conn);
        let mut open = || {
            let req = http::Request::post("http://x/").body(()).unwrap();
            h2c.send_request(req, false).unwrap().1
        };
        // 1: tiny handshake records that never make a whole hello: 64 KiB, then closed.
        let mut s = open();
        let mut flood = Vec::new();
        flood.extend(b"\x16\x03\x01\x00\x04\x01\x00\x3f\xff");
        while flood.len() < MAX_READ + 16 {
            flood.extend(b"\x16\x03\x01\x00\x01\x00");
        }
        s.send_data(Bytes::from(flood), false).unwrap();
        // 2: a record header and silence: the timeout.
        let mut s2 = open();
        s2.send_data(Bytes::from_static(b"\x16\x03\x01\x02\x00"), false)
            .unwrap();
        // 3: a whole hello.
        let mut s3 = open();
        s3.send_data(Bytes::from(hello(&[sni(b"x.test")], 3)), false)
            .unwrap();
        let mut results = Vec::new();
        for _ in 0..3 {
            let r = tokio::time::timeout(Duration::from_secs(5), results_rx.recv())
                .await
                .unwrap();
            results.push(r);
        }
        let text = format!("{results:?}");
        assert!(text.contains("64 KiB"), "{text}");
        assert!(text.contains("within 300ms"), "{text}");
        assert!(text.contains("x.test"), "{text}");
    }
}
