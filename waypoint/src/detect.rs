//! What a tunnelled connection speaks, from its first bytes: HTTP/2 with prior
//! knowledge (the client preface), HTTP/1.x (a request line), or anything else, which
//! the waypoint relays at L4. A client that sends nothing for a while (a server-first
//! protocol) is relayed at L4 too.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::RecvStream;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A request line with an unknown method longer than this is not taken for HTTP.
const MAX_SNIFF: usize = 64 * 1024;
/// Methods recognized from `METHOD SP` alone: whatever follows, hyper parses it (and
/// answers 400 if it is not HTTP), so a long or oddly terminated request line cannot
/// make the tunnel look opaque and skip L7 handling.
const METHODS: [&[u8]; 9] = [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
    Opaque,
}

impl Protocol {
    pub fn is_http(self) -> bool {
        self != Protocol::Opaque
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Known(Protocol),
    NeedMore,
}

fn classify(buf: &[u8]) -> Verdict {
    // HTTP/1.1 servers ignore empty lines before a request line (RFC 9112 2.2); so
    // does hyper, so they must not make a request look opaque either.
    let skip = buf.iter().take_while(|b| **b == b'\r' || **b == b'\n').count();
    if skip == buf.len() {
        return if skip <= 8 { Verdict::NeedMore } else { Verdict::Known(Protocol::Opaque) };
    }
    let buf = &buf[skip..];
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if buf.len() >= H2_PREFACE.len() { Verdict::Known(Protocol::Http2) } else { Verdict::NeedMore };
    }
    // HTTP/1 request line: token SP request-target SP "HTTP/1." digit CRLF
    let method_len = buf.iter().take_while(|b| b.is_ascii_uppercase() || **b == b'-').count();
    if method_len == buf.len() {
        return if method_len <= 20 { Verdict::NeedMore } else { Verdict::Known(Protocol::Opaque) };
    }
    if method_len == 0 || buf[method_len] != b' ' {
        return Verdict::Known(Protocol::Opaque);
    }
    if METHODS.contains(&&buf[..method_len]) {
        return Verdict::Known(Protocol::Http1);
    }
    // An unknown method: only a whole request line ending in an HTTP/1 version counts
    // (bare LF line ends too, as hyper accepts them).
    let Some(eol) = buf.iter().position(|b| *b == b'\n') else {
        if buf.len() >= MAX_SNIFF || buf.contains(&0) {
            return Verdict::Known(Protocol::Opaque);
        }
        return Verdict::NeedMore;
    };
    let line = buf[..eol].strip_suffix(b"\r").unwrap_or(&buf[..eol]);
    let is_http1 = line.len() > method_len + 10
        && line[line.len() - 9..].starts_with(b" HTTP/1.")
        && line[line.len() - 1].is_ascii_digit();
    Verdict::Known(if is_http1 { Protocol::Http1 } else { Protocol::Opaque })
}

/// Reads from the tunnel until the protocol is known; returns it with the bytes read,
/// which the caller must hand on first. Flow-control credit for them is returned.
pub async fn sniff(recv: &mut RecvStream, timeout: Duration) -> Result<(Protocol, Bytes), h2::Error> {
    let mut buf = BytesMut::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let next = match tokio::time::timeout_at(deadline, recv.data()).await {
            Ok(next) => next,
            Err(_) => return Ok((Protocol::Opaque, buf.freeze())),
        };
        match next {
            Some(chunk) => {
                let chunk = chunk?;
                let _ = recv.flow_control().release_capacity(chunk.len());
                buf.extend_from_slice(&chunk);
                if buf.is_empty() {
                    continue;
                }
                if let Verdict::Known(p) = classify(&buf) {
                    return Ok((p, buf.freeze()));
                }
            }
            // The client half-closed before we could tell: relay what there is.
            None => return Ok((Protocol::Opaque, buf.freeze())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_first_bytes() {
        use Protocol::*;
        let cases: &[(&[u8], Verdict)] = &[
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Verdict::Known(Http1)),
            (b"POST /a?b=c HTTP/1.0\r\n", Verdict::Known(Http1)),
            (b"M-SEARCH * HTTP/1.1\r\n", Verdict::Known(Http1)),
            (b"GET / HTTP/1.1", Verdict::Known(Http1)),
            (b"GET ", Verdict::Known(Http1)),
            (b"\r\nGET / HTTP/1.1\r\n", Verdict::Known(Http1)),
            (b"\n\nPOST /x HTTP/1.1\n", Verdict::Known(Http1)),
            (b"M-SEARCH * HTTP/1.1\n", Verdict::Known(Http1)),
            (b"M-SEARCH * HTTP/1.1", Verdict::NeedMore),
            (b"\r\n", Verdict::NeedMore),
            (b"GE", Verdict::NeedMore),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Verdict::Known(Http2)),
            (b"PRI * HTTP/2", Verdict::NeedMore),
            (b"PRI * HTTP/3.0\r\n", Verdict::Known(Opaque)),
            (b"hello world\n", Verdict::Known(Opaque)),
            (b"\x16\x03\x01\x02\x00", Verdict::Known(Opaque)),
            (b"FOO / SSH-2.0\r\n", Verdict::Known(Opaque)),
            (b"PING\r\n", Verdict::Known(Opaque)),
            (b"FOO /\n", Verdict::Known(Opaque)),
        ];
        for (input, want) in cases {
            assert_eq!(&classify(input), want, "{:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(classify(&[b'A'; 30]), Verdict::Known(Opaque));
        let mut long = b"GET /".to_vec();
        long.extend(std::iter::repeat_n(b'a', 2 * MAX_SNIFF));
        assert_eq!(classify(&long), Verdict::Known(Http1), "a long URL is still HTTP");
        let mut long = b"FOO /".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_SNIFF));
        assert_eq!(classify(&long), Verdict::Known(Opaque));
    }
}
