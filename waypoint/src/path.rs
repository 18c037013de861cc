//! Request path normalization for the waypoint.
//!
//! The waypoint normalizes a path once and uses the result for routing, authorization
//! and the request it forwards, so policy and backend always see the same path. The
//! rules follow Envoy/Istio's `normalize_path` + `merge_slashes` with escaped slashes
//! rejected (`REJECT_REQUEST`):
//! - escapes of unreserved characters are decoded (`%61` -> `a`, `%2e` -> `.`); every
//!   other escape keeps its meaning and gets uppercase hex (`%3a` -> `%3A`); `%25` is
//!   never decoded, so one pass cannot turn `%252e` into a new dot;
//! - raw bytes a path may not carry (space, `"`, non-ASCII, ...) are percent-encoded,
//!   which leaves one spelling per path;
//! - NUL and control characters (raw or encoded), malformed escapes, backslashes and
//!   encoded slashes or backslashes are refused: backends disagree on what they mean;
//! - consecutive slashes are merged and dot segments removed (RFC 3986 5.2.4) after
//!   decoding, so `%2e%2e` counts as `..`.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("request target is not an origin-form path: it must start with '/'")]
    NotOriginForm,
    #[error(
        "the asterisk-form request target \"*\" has no path to authorize or route; refusing it"
    )]
    Asterisk,
    #[error("path contains a control character or NUL (raw or percent-encoded); refusing it")]
    ControlCharacter,
    #[error(
        "path contains a malformed percent escape at byte {0} ('%' must be followed by two hex digits); refusing it"
    )]
    MalformedEscape(usize),
    #[error("path contains an encoded slash or backslash (%2F, %5C); refusing it")]
    EncodedSlash,
    #[error(
        "path contains a backslash, which some servers treat as a path separator; refusing it"
    )]
    Backslash,
    #[error(
        "path contains '?' or '#': the query must be split off first, and fragments are never sent"
    )]
    QueryOrFragment,
}

/// Normalizes the path part (no query). Result always starts with '/'.
pub fn normalize(path: &str) -> Result<String, PathError> {
    if path == "*" {
        return Err(PathError::Asterisk);
    }
    if !path.starts_with('/') {
        return Err(PathError::NotOriginForm);
    }
    let canonical = canonical_escapes(path)?;
    Ok(remove_dot_segments(&canonical))
}

/// Splits `path?query` and normalizes the path, keeping the query byte for byte.
pub fn normalize_path_and_query(pq: &str) -> Result<(String, Option<String>), PathError> {
    let (path, query) = match pq.split_once('?') {
        Some((path, query)) => (path, Some(query.to_string())),
        None => (pq, None),
    };
    Ok((normalize(path)?, query))
}

fn canonical_escapes(path: &str) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex_value);
            let lo = bytes.get(i + 2).copied().and_then(hex_value);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(PathError::MalformedEscape(i));
            };
            let v = (hi << 4) | lo;
            if is_control(v) {
                return Err(PathError::ControlCharacter);
            }
            if v == b'/' || v == b'\\' {
                return Err(PathError::EncodedSlash);
            }
            if is_unreserved(v) {
                out.push(char::from(v));
            } else {
                push_escape(&mut out, v);
            }
            i += 3;
            continue;
        }
        if is_control(c) {
            return Err(PathError::ControlCharacter);
        }
        match c {
            b'\\' => return Err(PathError::Backslash),
            b'?' | b'#' => return Err(PathError::QueryOrFragment),
            _ if is_unreserved(c) || is_path_delim(c) => out.push(char::from(c)),
            // Everything else (space, '"', '<', non-ASCII bytes, ...) is data; encoding
            // it is equivalent for the backend and leaves a single spelling to match.
            _ => push_escape(&mut out, c),
        }
        i += 1;
    }
    Ok(out)
}

/// Merges slashes and removes `.` and `..` segments; a trailing slash (or a trailing
/// dot segment, which stands for one) is kept.
fn remove_dot_segments(path: &str) -> String {
    let mut stack: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    // `path` starts with '/', so the first split item is the empty string before it.
    for seg in path.split('/').skip(1) {
        trailing_slash = matches!(seg, "" | "." | "..");
        match seg {
            "" | "." => {}
            ".." => {
                stack.pop();
            }
            _ => stack.push(seg),
        }
    }
    let mut out = String::with_capacity(path.len());
    for seg in &stack {
        out.push('/');
        out.push_str(seg);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    out
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn push_escape(out: &mut String, v: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(v >> 4)]));
    out.push(char::from(HEX[usize::from(v & 0xF)]));
}

fn is_control(c: u8) -> bool {
    c < 0x20 || c == 0x7F
}

fn is_unreserved(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
}

/// Reserved characters allowed raw in a path (sub-delims, ':', '@', '/'): encoding or
/// decoding them would change the path's meaning, so they stay as written.
fn is_path_delim(c: u8) -> bool {
    matches!(
        c,
        b'!' | b'$'
            | b'&'
            | b'\''
            | b'('
            | b')'
            | b'*'
            | b'+'
            | b','
            | b';'
            | b'='
            | b':'
            | b'@'
            | b'/'
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes() {
        let cases: &[(&str, &str)] = &[
            ("/", "/"),
            ("/a/b", "/a/b"),
            ("/admin/../x", "/x"),
            ("/x/%2e%2e/admin", "/admin"),
            ("/x/%2E%2E/admin", "/admin"),
            ("/x/.%2e/admin", "/admin"),
            ("/%61dmin", "/admin"),
            ("//admin", "/admin"),
            ("/a///b//", "/a/b/"),
            ("/admin/.", "/admin/"),
            ("/a/./b", "/a/b"),
            ("/a/../b", "/b"),
            ("/../a", "/a"),
            ("/../../..", "/"),
            ("/a/..", "/"),
            ("/a/b/", "/a/b/"),
            ("/a/.", "/a/"),
            ("/a/b/../../../c", "/c"),
            ("/...", "/..."),
            ("/a/..b/.c", "/a/..b/.c"),
            ("/%7euser", "/~user"),
            ("/a%3fb", "/a%3Fb"),
            ("/a%3Ab", "/a%3Ab"),
            ("/a%3ab", "/a%3Ab"),
            ("/a:b@c;d=e", "/a:b@c;d=e"),
            ("/%252e%252e/admin", "/%252e%252e/admin"),
            ("/a/%252e%252e", "/a/%252e%252e"),
            ("/%25", "/%25"),
            ("/a%20b", "/a%20b"),
            ("/a b", "/a%20b"),
            ("/caf\u{e9}", "/caf%C3%A9"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/a/%2E/b", "/a/b"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize(input).as_deref(), Ok(*want), "{input:?}");
            // Normalizing is idempotent: a second pass must not find anything new.
            assert_eq!(
                normalize(want).as_deref(),
                Ok(*want),
                "second pass of {want:?}"
            );
        }
    }

    #[test]
    fn rejects() {
        let cases: &[(&str, PathError)] = &[
            ("", PathError::NotOriginForm),
            ("admin", PathError::NotOriginForm),
            ("http://example.com/", PathError::NotOriginForm),
            ("*", PathError::Asterisk),
            ("/admin%2Fsecret", PathError::EncodedSlash),
            ("/admin%2fsecret", PathError::EncodedSlash),
            ("/a%5cb", PathError::EncodedSlash),
            ("/a%5Cb", PathError::EncodedSlash),
            ("/a\\b", PathError::Backslash),
            ("/a%00", PathError::ControlCharacter),
            ("/a\0b", PathError::ControlCharacter),
            ("/a%0d%0a", PathError::ControlCharacter),
            ("/a\tb", PathError::ControlCharacter),
            ("/a%7f", PathError::ControlCharacter),
            ("/a\u{7f}", PathError::ControlCharacter),
            ("/a%", PathError::MalformedEscape(2)),
            ("/a%4", PathError::MalformedEscape(2)),
            ("/%G1", PathError::MalformedEscape(1)),
            ("/a?b", PathError::QueryOrFragment),
            ("/a#b", PathError::QueryOrFragment),
        ];
        for (input, want) in cases {
            assert_eq!(normalize(input).as_ref(), Err(want), "{input:?}");
        }
        assert_eq!(
            PathError::EncodedSlash.to_string(),
            "path contains an encoded slash or backslash (%2F, %5C); refusing it"
        );
    }

    #[test]
    fn keeps_query() {
        assert_eq!(
            normalize_path_and_query("/a/../b?x=%2e%2e&y=/..//"),
            Ok(("/b".into(), Some("x=%2e%2e&y=/..//".into())))
        );
        assert_eq!(normalize_path_and_query("/a"), Ok(("/a".into(), None)));
        assert_eq!(
            normalize_path_and_query("/a?"),
            Ok(("/a".into(), Some(String::new())))
        );
        assert_eq!(
            normalize_path_and_query("/a?b?c"),
            Ok(("/a".into(), Some("b?c".into())))
        );
        assert_eq!(normalize_path_and_query("*"), Err(PathError::Asterisk));
        assert_eq!(
            normalize_path_and_query("/a%2fb?q"),
            Err(PathError::EncodedSlash)
        );
        assert_eq!(
            normalize_path_and_query("?q"),
            Err(PathError::NotOriginForm)
        );
    }
}
