//! What a tunnelled connection speaks, from its first bytes: HTTP/2 with prior
//! knowledge (the client preface), HTTP/1.x (a request line), or anything else, which
//! the waypoint relays at L4. A client that sends nothing for a while (a server-first
//! protocol) is relayed at L4 too.
//!
//! That guess is made only on a port of unknown protocol (`Expect::Any`). On a port that
//! declares HTTP (`Expect::Http`) the client chose nothing: only its HTTP version is
//! read from the bytes, and whatever is not HTTP is left to the HTTP/1 parser to refuse,
//! since an opaque verdict there would let a client skip the L7 policy and header
//! handling by pausing or padding its request.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::RecvStream;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A request line with an unknown method longer than this is not taken for HTTP.
const MAX_SNIFF: usize = 64 * 1024;
/// Methods recognized from `METHOD SP` alone: whatever follows, hyper parses it (and
/// answers 400 if it is not HTTP), so a long or oddly terminated request line cannot
/// make the tunnel look opaque and skip L7 handling.
const METHODS: [&[u8]; 9] = [
    b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT",
];

/// What the target's port lets a tunnel speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The port declares HTTP (HTTP/1.1, HTTP/2 or gRPC): HTTP only.
    Http,
    /// The port's protocol is unknown: HTTP or anything else, as the bytes say.
    Any,
}

#[derive(Debug, thiserror::Error)]
pub enum SniffError {
    #[error("tunnel stream failed: {0}")]
    Stream(#[from] h2::Error),
    #[error("no bytes within {0:?} on a port that declares HTTP")]
    Silent(Duration),
}

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
    let skip = buf
        .iter()
        .take_while(|b| **b == b'\r' || **b == b'\n')
        .count();
    if skip == buf.len() {
        return if skip <= 8 {
            Verdict::NeedMore
        } else {
            Verdict::Known(Protocol::Opaque)
        };
    }
    let buf = &buf[skip..];
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if buf.len() >= H2_PREFACE.len() {
            Verdict::Known(Protocol::Http2)
        } else {
            Verdict::NeedMore
        };
    }
    // HTTP/1 request line: token SP request-target SP "HTTP/1." digit CRLF
    let method_len = buf
        .iter()
        .take_while(|b| b.is_ascii_uppercase() || **b == b'-')
        .count();
    if method_len == buf.len() {
        return if method_len <= 20 {
            Verdict::NeedMore
        } else {
            Verdict::Known(Protocol::Opaque)
        };
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
    Verdict::Known(if is_http1 {
        Protocol::Http1
    } else {
        Protocol::Opaque
    })
}

/// On a port that declares HTTP: HTTP/2 for the client preface, HTTP/1 for anything
/// else (the HTTP/1 parser answers 400 to what is not a request; a preface cut short
/// waits for more).
fn classify_http(buf: &[u8]) -> Verdict {
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] != H2_PREFACE[..n] {
        return Verdict::Known(Protocol::Http1);
    }
    if buf.len() >= H2_PREFACE.len() {
        Verdict::Known(Protocol::Http2)
    } else {
        Verdict::NeedMore
    }
}

/// Reads from the tunnel until the protocol is known; returns it with the bytes read,
/// which the caller must hand on first. Flow-control credit for them is returned.
/// `timeout`: with `Expect::Any`, silence that long makes the tunnel opaque (a
/// server-first protocol); with `Expect::Http` it is an error (HTTP is client-first).
pub async fn sniff(
    recv: &mut RecvStream,
    timeout: Duration,
    expect: Expect,
) -> Result<(Protocol, Bytes), SniffError> {
    let mut buf = BytesMut::new();
    let deadline = tokio::time::Instant::now() + timeout;
    let verdict: fn(&[u8]) -> Verdict = match expect {
        Expect::Http => classify_http,
        Expect::Any => classify,
    };
    // What the bytes so far make of a tunnel that ends or goes quiet.
    let undecided = |buf: BytesMut| match expect {
        Expect::Http => (Protocol::Http1, buf.freeze()),
        Expect::Any => (Protocol::Opaque, buf.freeze()),
    };
    loop {
        let next = match tokio::time::timeout_at(deadline, recv.data()).await {
            Ok(next) => next,
            Err(_) if expect == Expect::Http => return Err(SniffError::Silent(timeout)),
            Err(_) => return Ok(undecided(buf)),
        };
        match next {
            Some(chunk) => {
                let chunk = chunk?;
                let _ = recv.flow_control().release_capacity(chunk.len());
                buf.extend_from_slice(&chunk);
                if buf.is_empty() {
                    continue;
                }
                if let Verdict::Known(p) = verdict(&buf) {
                    return Ok((p, buf.freeze()));
                }
            }
            // The client half-closed before we could tell: relay what there is (or, on
            // an HTTP port, let the HTTP/1 parser answer it).
            None => return Ok(undecided(buf)),
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
            assert_eq!(
                &classify(input),
                want,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
        assert_eq!(classify(&[b'A'; 30]), Verdict::Known(Opaque));
        let mut long = b"GET /".to_vec();
        long.extend(std::iter::repeat_n(b'a', 2 * MAX_SNIFF));
        assert_eq!(
            classify(&long),
            Verdict::Known(Http1),
            "a long URL is still HTTP"
        );
        let mut long = b"FOO /".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_SNIFF));
        assert_eq!(classify(&long), Verdict::Known(Opaque));
    }

    /// On a port that declares HTTP nothing is opaque: padding, TLS or garbage go to the
    /// HTTP/1 parser (which answers 400), only the preface makes HTTP/2.
    #[test]
    fn an_http_port_has_no_opaque_verdict() {
        use Protocol::*;
        let padded = [&b"\r\n".repeat(9)[..], b"GET / HTTP/1.1\r\n"].concat();
        let cases: &[(&[u8], Verdict)] = &[
            (b"GET / HTTP/1.1\r\n", Verdict::Known(Http1)),
            (&padded, Verdict::Known(Http1)),
            (b"\r\n", Verdict::Known(Http1)),
            (b"hello world\n", Verdict::Known(Http1)),
            (b"\x16\x03\x01\x02\x00", Verdict::Known(Http1)),
            (b"PRI * HTTP/3.0\r\n", Verdict::Known(Http1)),
            (b"PRI * HTTP/2", Verdict::NeedMore),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Verdict::Known(Http2)),
        ];
        for (input, want) in cases {
            assert_eq!(
                &classify_http(input),
                want,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
        // On a port of unknown protocol the padding alone is opaque (the request line
        // may come after the verdict); on an HTTP port it is HTTP/1.
        assert_eq!(classify(&b"\r\n".repeat(9)), Verdict::Known(Opaque));
        assert_eq!(classify_http(&b"\r\n".repeat(9)), Verdict::Known(Http1));
    }

    /// A CONNECT stream over an in-memory HTTP/2 connection: the client's side sends
    /// `chunks` (each after its pause), the server's side is sniffed.
    async fn sniff_stream(
        chunks: Vec<(Duration, &'static [u8])>,
        timeout: Duration,
        expect: Expect,
    ) -> Result<(Protocol, Bytes), SniffError> {
        let (c, s) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::handshake(s).await.unwrap();
            let (req, _respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let mut body = req.into_body();
            sniff(&mut body, timeout, expect).await
        });
        let (mut h2c, conn) = h2::client::handshake(c).await.unwrap();
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method("CONNECT")
            .uri("10.0.0.1:80")
            .body(())
            .unwrap();
        let (_resp, mut send) = h2c.send_request(req, false).unwrap();
        let client = tokio::spawn(async move {
            for (pause, chunk) in chunks {
                tokio::time::sleep(pause).await;
                if send.send_data(Bytes::from_static(chunk), false).is_err() {
                    return;
                }
            }
            // Kept open: the sniffer decides from the bytes and the clock, not an end.
            std::future::pending::<()>().await;
        });
        let r = server.await.unwrap();
        client.abort();
        r
    }

    /// The attacks on the sniffer: a pause past the detection timeout, or more than
    /// eight empty lines, before the request. Opaque on a port of unknown protocol;
    /// HTTP/1 on a port that declares HTTP; silence there is an error, not a relay.
    #[tokio::test]
    async fn a_paused_or_padded_request_is_http_on_an_http_port() {
        // The detection timeout, and the (longer) wait for an HTTP port's first bytes.
        const T: Duration = Duration::from_millis(100);
        const HTTP_T: Duration = Duration::from_secs(5);
        let late = || {
            vec![(
                Duration::from_millis(300),
                &b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"[..],
            )]
        };
        let padded = || {
            vec![
                (Duration::ZERO, &b"\r\n\r\n\r\n\r\n\r\n\r\n\r\n\r\n\r\n"[..]),
                (Duration::from_millis(20), &b"GET / HTTP/1.1\r\n"[..]),
            ]
        };
        let (p, first) = sniff_stream(late(), T, Expect::Any).await.unwrap();
        assert_eq!((p, first.len()), (Protocol::Opaque, 0));
        let (p, first) = sniff_stream(late(), HTTP_T, Expect::Http).await.unwrap();
        assert_eq!(
            (p, &first[..4]),
            (Protocol::Http1, &b"GET "[..]),
            "the late request is read whole, as HTTP"
        );
        assert_eq!(
            sniff_stream(padded(), T, Expect::Any).await.unwrap().0,
            Protocol::Opaque
        );
        let (p, first) = sniff_stream(padded(), HTTP_T, Expect::Http).await.unwrap();
        assert_eq!(p, Protocol::Http1);
        assert!(
            first.starts_with(b"\r\n"),
            "the padding goes on to the HTTP/1 parser"
        );
        let h2 = || {
            vec![
                (Duration::ZERO, &b"PRI * HTTP/2.0\r\n"[..]),
                (Duration::from_millis(20), &b"\r\nSM\r\n\r\n"[..]),
            ]
        };
        assert_eq!(
            sniff_stream(h2(), HTTP_T, Expect::Http).await.unwrap().0,
            Protocol::Http2
        );
        let r = sniff_stream(Vec::new(), T, Expect::Http).await;
        assert!(matches!(r, Err(SniffError::Silent(_))), "{r:?}");
        assert_eq!(
            sniff_stream(Vec::new(), T, Expect::Any).await.unwrap().0,
            Protocol::Opaque,
            "a server-first protocol"
        );
    }
}
