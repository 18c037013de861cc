//! What a tunnelled connection speaks, from its first bytes: HTTP/2 with prior
//! knowledge (the client preface), HTTP/1.x (a request line), or anything else, which
//! the waypoint relays at L4. A client that sends nothing for a while (a server-first
//! protocol) is relayed at L4 too.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::RecvStream;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A request line longer than this is not something we will parse as HTTP.
const MAX_SNIFF: usize = 8 * 1024;

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
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() >= MAX_SNIFF || buf.iter().any(|b| *b == b'\n' || *b == 0) {
            return Verdict::Known(Protocol::Opaque);
        }
        return Verdict::NeedMore;
    };
    let line = &buf[..eol];
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
            (b"GET / HTTP/1.1", Verdict::NeedMore),
            (b"GE", Verdict::NeedMore),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Verdict::Known(Http2)),
            (b"PRI * HTTP/2", Verdict::NeedMore),
            (b"PRI * HTTP/3.0\r\n", Verdict::Known(Opaque)),
            (b"hello world\n", Verdict::Known(Opaque)),
            (b"\x16\x03\x01\x02\x00", Verdict::Known(Opaque)),
            (b"GET / SSH-2.0\r\n", Verdict::Known(Opaque)),
            (b"PING\r\n", Verdict::Known(Opaque)),
            (b"GET /\n", Verdict::Known(Opaque)),
        ];
        for (input, want) in cases {
            assert_eq!(&classify(input), want, "{:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(classify(&[b'A'; 30]), Verdict::Known(Opaque));
        let mut long = b"GET /".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_SNIFF));
        assert_eq!(classify(&long), Verdict::Known(Opaque));
    }
}
