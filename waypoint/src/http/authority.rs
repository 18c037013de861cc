//! The request's authority (`Host`, `:authority`, an absolute-form target's), checked
//! to be exactly RFC 3986's `host [":" port]` before anything reads it.
//!
//! Why: host policies, routes and ext_authz read the authority as one string, while a
//! backend reads it as part of a URI. `Host: web/admin#` was matched as a host, then
//! became `http://web/admin#/public` for an HTTP/2 backend, which asked for `/admin`:
//! a DENY on `/admin*` saw `/public`. An authority that parses here has no `/ ? # @`,
//! whitespace or control characters, so it reads the same to every consumer, and the
//! upstream URI is built from its parsed form, never by pasting strings together.

use std::net::Ipv6Addr;

use http::header::{self, HeaderMap};
use http::uri::{Authority as UriAuthority, PathAndQuery, Uri};

/// A valid authority: a reg-name (IPv4 addresses included) or a bracketed IPv6
/// literal, then an optional port from 1 to 65535. Kept as received (case, trailing
/// dot): policies and routes normalize what they compare, the backend gets it as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authority {
    uri: UriAuthority,
    /// Where the host ends in `uri` (the `:` of the port, or the end).
    host_end: usize,
    port: Option<u16>,
}

/// Why an authority is refused (the request gets 400 with this text).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    #[error("the request has no Host or :authority")]
    Missing,
    #[error("the request has {0} Host headers; one is allowed")]
    SeveralHosts(usize),
    #[error("the authority is empty")]
    Empty,
    #[error("userinfo (`user@`) is not allowed in the authority")]
    Userinfo,
    #[error("{0:?} is not allowed in the authority: a path, query or fragment belongs in the request target, not in Host or :authority")]
    Delimiter(char),
    #[error("percent-encoding is not allowed in a host name")]
    PercentEncoded,
    #[error("whitespace is not allowed in the authority")]
    Whitespace,
    #[error("control character 0x{0:02x} in the authority")]
    Control(u8),
    #[error("non-ASCII byte 0x{0:02x} in the authority (an internationalized name is sent in its ASCII form, xn--...)")]
    NonAscii(u8),
    #[error("{0:?} is not allowed in a host name")]
    InvalidChar(char),
    #[error("the authority has no host before its port")]
    EmptyHost,
    #[error("`[` opens an IPv6 address that no `]` closes")]
    UnclosedBracket,
    #[error("{0:?} in brackets is not an IPv6 address")]
    NotIpv6(String),
    #[error("only `:port` may follow the `]` of an IPv6 address, not {0:?}")]
    AfterBracket(String),
    #[error("an IPv6 address must be in brackets, as in [fe80::1]:8080")]
    UnbracketedIpv6,
    #[error("port {0:?} is not a number from 1 to 65535")]
    Port(String),
    /// Never expected: what passes the checks above is a URI authority to `http` too.
    #[error("the authority cannot be put in a URI")]
    Unrepresentable,
}

/// Client input quoted in an error: at most this many characters of it.
const QUOTED: usize = 40;

fn quote(s: &str) -> String {
    s.chars().take(QUOTED).collect()
}

impl Authority {
    pub fn parse(s: &str) -> Result<Self, AuthorityError> {
        Self::from_bytes(s.as_bytes())
    }

    /// Parses raw header bytes (a `Host` value need not be UTF-8).
    pub fn from_bytes(b: &[u8]) -> Result<Self, AuthorityError> {
        if b.is_empty() {
            return Err(AuthorityError::Empty);
        }
        // Bytes that are never part of `host [":" port]`, named for the user first: they
        // are the ones that would make the authority read differently elsewhere.
        for &c in b {
            match c {
                b'@' => return Err(AuthorityError::Userinfo),
                b'/' | b'?' | b'#' => return Err(AuthorityError::Delimiter(char::from(c))),
                b'%' => return Err(AuthorityError::PercentEncoded),
                b' ' | b'\t' => return Err(AuthorityError::Whitespace),
                0..=0x1f | 0x7f => return Err(AuthorityError::Control(c)),
                0x80.. => return Err(AuthorityError::NonAscii(c)),
                _ => {}
            }
        }
        // Only ASCII is left.
        let s = std::str::from_utf8(b).map_err(|_| AuthorityError::NonAscii(0x80))?;
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let Some((literal, after)) = rest.split_once(']') else {
                return Err(AuthorityError::UnclosedBracket);
            };
            if literal.parse::<Ipv6Addr>().is_err() {
                return Err(AuthorityError::NotIpv6(quote(literal)));
            }
            let port = match after {
                "" => None,
                _ => Some(
                    after
                        .strip_prefix(':')
                        .ok_or_else(|| AuthorityError::AfterBracket(quote(after)))?,
                ),
            };
            (&s[..literal.len() + 2], port)
        } else {
            let (host, port) = match s.split_once(':') {
                Some((_, p)) if p.contains(':') => return Err(AuthorityError::UnbracketedIpv6),
                Some((h, p)) => (h, Some(p)),
                None => (s, None),
            };
            if host.is_empty() {
                return Err(AuthorityError::EmptyHost);
            }
            if let Some(c) = host.chars().find(|c| !is_reg_name_char(*c)) {
                return Err(AuthorityError::InvalidChar(c));
            }
            (host, port)
        };
        let port = port.map(parse_port).transpose()?;
        // What passes the checks above is an authority to `http` too (the fuzz target
        // checks it); were it not, the request is refused, never the proxy stopped.
        let uri = UriAuthority::try_from(s).map_err(|_| AuthorityError::Unrepresentable)?;
        Ok(Authority {
            uri,
            host_end: host.len(),
            port,
        })
    }

    /// The request's authority, as hyper and Envoy decide it: the URI's (HTTP/2
    /// `:authority`, an absolute-form HTTP/1.1 target) when it has one, else `Host`. A
    /// `Host` is checked even where the URI's wins (RFC 9112 3.2: an invalid or repeated
    /// Host is a bad request), and is then replaced upstream by the URI's authority, so
    /// what policy read is what the backend gets.
    pub fn of_request(parts: &http::request::Parts) -> Result<Self, AuthorityError> {
        let host = single_host(&parts.headers)?
            .map(|h| Self::from_bytes(h.as_bytes()))
            .transpose()?;
        match parts.uri.authority() {
            Some(a) => Self::parse(a.as_str()),
            None => host.ok_or(AuthorityError::Missing),
        }
    }

    /// `host[:port]` as received.
    pub fn as_str(&self) -> &str {
        self.uri.as_str()
    }

    /// The host as received, without the port (an IPv6 literal keeps its brackets).
    pub fn host(&self) -> &str {
        &self.as_str()[..self.host_end]
    }

    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The URI for an HTTP/2 upstream: `http://<this><path_and_query>`, assembled from
    /// parsed parts (a path cannot leak into the authority, nor the reverse).
    pub fn uri_with(&self, path_and_query: PathAndQuery) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("http")
            .authority(self.uri.clone())
            .path_and_query(path_and_query)
            .build()
    }
}

impl std::fmt::Display for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The request's one Host header, if any.
fn single_host(headers: &HeaderMap) -> Result<Option<&header::HeaderValue>, AuthorityError> {
    let mut all = headers.get_all(header::HOST).iter();
    let first = all.next();
    match all.count() {
        0 => Ok(first),
        more => Err(AuthorityError::SeveralHosts(more + 1)),
    }
}

/// RFC 3986 reg-name: unreserved and sub-delims (percent-encoding is refused above).
fn is_reg_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(
            c,
            '-' | '.'
                | '_'
                | '~'
                | '!'
                | '$'
                | '&'
                | '\''
                | '('
                | ')'
                | '*'
                | '+'
                | ','
                | ';'
                | '='
        )
}

/// Digits only, 1 to 65535 (Envoy refuses port 0 and an empty port too).
fn parse_port(p: &str) -> Result<u16, AuthorityError> {
    let bad = || AuthorityError::Port(quote(p));
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad()),
        Ok(n) => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> (String, String, Option<u16>) {
        let a = Authority::parse(s).unwrap_or_else(|e| panic!("{s:?} refused: {e}"));
        (a.as_str().to_string(), a.host().to_string(), a.port())
    }

    fn err(s: &str) -> AuthorityError {
        Authority::parse(s)
            .err()
            .unwrap_or_else(|| panic!("{s:?} accepted"))
    }

    #[test]
    fn hosts_and_ports_parse_as_received() {
        let own = |s: &str, host: &str, port: Option<u16>| (s.to_string(), host.to_string(), port);
        assert_eq!(
            ok("web.default.svc.cluster.local"),
            own(
                "web.default.svc.cluster.local",
                "web.default.svc.cluster.local",
                None
            )
        );
        assert_eq!(
            ok("10.96.0.10:80"),
            own("10.96.0.10:80", "10.96.0.10", Some(80))
        );
        assert_eq!(
            ok("[fe80::1]:8080"),
            own("[fe80::1]:8080", "[fe80::1]", Some(8080))
        );
        assert_eq!(ok("[::1]"), own("[::1]", "[::1]", None));
        assert_eq!(
            ok("[::ffff:10.0.0.1]:443"),
            own("[::ffff:10.0.0.1]:443", "[::ffff:10.0.0.1]", Some(443))
        );
        // Case and a trailing dot are kept: policies and routes normalize what they compare.
        assert_eq!(
            ok("Web.Example.COM"),
            own("Web.Example.COM", "Web.Example.COM", None)
        );
        assert_eq!(
            ok("web.example.com.:65535"),
            own("web.example.com.:65535", "web.example.com.", Some(65535))
        );
        // RFC 3986 reg-name: unreserved and sub-delims.
        assert_eq!(
            ok("a_b~c-d!$&'()*+,;="),
            own("a_b~c-d!$&'()*+,;=", "a_b~c-d!$&'()*+,;=", None)
        );
    }

    #[test]
    fn anything_that_could_read_as_a_path_query_fragment_or_userinfo_is_refused() {
        for (s, c) in [
            ("a/admin#", '/'),
            ("web/admin?", '/'),
            ("admin.example.com/", '/'),
            ("a?x", '?'),
            ("a#", '#'),
            ("[::1]/x", '/'),
        ] {
            assert_eq!(err(s), AuthorityError::Delimiter(c), "{s}");
        }
        assert_eq!(err("user@a"), AuthorityError::Userinfo);
        assert_eq!(err("user:pw@a:80"), AuthorityError::Userinfo);
        assert_eq!(err("a b"), AuthorityError::Whitespace);
        assert_eq!(err("a\tb"), AuthorityError::Whitespace);
        assert_eq!(err("a\r\nb"), AuthorityError::Control(b'\r'));
        assert_eq!(err("a\0"), AuthorityError::Control(0));
        assert_eq!(
            Authority::from_bytes(b"caf\xc3\xa9").err(),
            Some(AuthorityError::NonAscii(0xc3))
        );
        // Percent-encoding: RFC 3986 allows it in a reg-name and Envoy passes it, but no
        // DNS name has it, `http` refuses it in a URI's host (so an HTTP/2 backend could
        // not be sent it), and a host policy compares it undecoded.
        assert_eq!(err("a%2fb"), AuthorityError::PercentEncoded);
        assert_eq!(err("%61dmin.example.com"), AuthorityError::PercentEncoded);
        assert_eq!(err("a\"b"), AuthorityError::InvalidChar('"'));
        assert_eq!(err("a\\b"), AuthorityError::InvalidChar('\\'));
        assert_eq!(err("a[b]"), AuthorityError::InvalidChar('['));
    }

    #[test]
    fn ports_are_digits_from_1_to_65535() {
        for p in [
            "a:80x", "a:99999", "a:65536", "a:", "a:0", "a:-1", "a:+80", "a:123456", "[::1]:x",
        ] {
            assert!(
                matches!(err(p), AuthorityError::Port(_)),
                "{p}: {:?}",
                err(p)
            );
        }
        assert_eq!(ok("a:00080").2, Some(80));
        assert_eq!(err(":80"), AuthorityError::EmptyHost);
    }

    #[test]
    fn ipv6_literals_are_bracketed_addresses() {
        assert_eq!(err("[::1"), AuthorityError::UnclosedBracket);
        assert_eq!(err("[::1]x"), AuthorityError::AfterBracket("x".into()));
        assert_eq!(err("[::1]]"), AuthorityError::AfterBracket("]".into()));
        assert_eq!(err("[not-v6]"), AuthorityError::NotIpv6("not-v6".into()));
        assert_eq!(err("[]"), AuthorityError::NotIpv6(String::new()));
        assert_eq!(
            err("[v1.x]"),
            AuthorityError::NotIpv6("v1.x".into()),
            "IPvFuture"
        );
        assert_eq!(err("fe80::1"), AuthorityError::UnbracketedIpv6);
        assert_eq!(err("fe80::1:8080"), AuthorityError::UnbracketedIpv6);
    }

    #[test]
    fn empty_is_refused_and_messages_say_what_is_wrong() {
        assert_eq!(err(""), AuthorityError::Empty);
        assert_eq!(
            err("web/admin?").to_string(),
            "'/' is not allowed in the authority: a path, query or fragment belongs in the request target, not in Host or :authority"
        );
        assert_eq!(
            err("a:99999").to_string(),
            "port \"99999\" is not a number from 1 to 65535"
        );
        // Client input is quoted short.
        let long = format!("[{}]", "x".repeat(1000));
        assert!(err(&long).to_string().len() < 100);
    }

    #[test]
    fn the_upstream_uri_has_exactly_the_authority_and_the_path() {
        let a = Authority::parse("[fe80::1]:8080").expect("valid");
        let uri = a
            .uri_with(PathAndQuery::from_static("/public?x=1"))
            .expect("uri");
        assert_eq!(uri.to_string(), "http://[fe80::1]:8080/public?x=1");
        assert_eq!(
            (uri.authority().map(|a| a.as_str()), uri.path()),
            (Some("[fe80::1]:8080"), "/public")
        );
    }

    fn parts(uri: &str, hosts: &[&[u8]]) -> http::request::Parts {
        let mut b = http::Request::get(uri);
        for h in hosts {
            b = b.header(header::HOST, *h);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn the_uri_authority_wins_over_host_and_both_are_checked() {
        let of = |uri: &str, hosts: &[&[u8]]| {
            Authority::of_request(&parts(uri, hosts)).map(|a| a.to_string())
        };
        assert_eq!(of("/x", &[b"web:80"]), Ok("web:80".into()));
        // Absolute form (or HTTP/2 :authority): its authority, a differing Host ignored.
        assert_eq!(of("http://web/x", &[b"other"]), Ok("web".into()));
        assert_eq!(of("http://web/x", &[]), Ok("web".into()));
        // ... but a Host that is no authority is still a bad request (RFC 9112 3.2).
        assert_eq!(
            of("http://web/x", &[b"web/admin#"]),
            Err(AuthorityError::Delimiter('/'))
        );
        assert_eq!(of("http://u@web/x", &[]), Err(AuthorityError::Userinfo));
        assert_eq!(
            of("/x", &[b"a", b"b"]),
            Err(AuthorityError::SeveralHosts(2))
        );
        assert_eq!(of("/x", &[]), Err(AuthorityError::Missing));
        assert_eq!(of("/x", &[b""]), Err(AuthorityError::Empty));
    }
}
