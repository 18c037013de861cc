//! What a VirtualService route does besides sending on, as Istio's `TranslateRoute`
//! builds it for Envoy (`pilot/pkg/networking/core/route/route.go`): `redirect`
//! (`ApplyRedirect`, Envoy's RedirectAction), `directResponse` (`ApplyDirectResponse`),
//! and the path rewrites `rewrite.uri` (Envoy's `prefix_rewrite`) and
//! `rewrite.uriRegexRewrite` (`regex_rewrite`).

use bytes::Bytes;
use http::StatusCode;
use regex::Regex;
use serde::Deserialize;

/// A rule the waypoint answers itself.
#[derive(Clone, Debug)]
pub enum Answer {
    Redirect(Redirect),
    Direct(DirectResponse),
}

/// Envoy's RedirectAction as Istio fills it.
#[derive(Clone, Debug)]
pub struct Redirect {
    /// `path_redirect`: the whole path (its own query, if it has one, replaces the
    /// request's); None keeps the request's path.
    pub uri: Option<String>,
    /// `host_redirect`: replaces the request's host and port.
    pub authority: Option<String>,
    pub scheme: Option<String>,
    /// `port_redirect`, after Istio's rules (`derivePort: FROM_REQUEST_PORT` is the
    /// service port; 80 for http and 443 for https are left out).
    pub port: RedirectPort,
    pub status: StatusCode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedirectPort {
    /// Envoy's default: the request's host as it came (its port stripped when the scheme
    /// changes from the port's own scheme).
    Keep,
    /// The service port the request was sent to.
    FromRequest,
    Port(u16),
}

/// Envoy's DirectResponseAction: a status and maybe a body, as a local reply (a gRPC
/// client gets the gRPC status for it, as Envoy's local replies do).
#[derive(Clone, Debug)]
pub struct DirectResponse {
    pub status: StatusCode,
    pub body: Bytes,
}

/// How the path sent upstream is rewritten.
#[derive(Clone, Debug)]
pub enum UriRewrite {
    /// Envoy's `prefix_rewrite`: the part of the path the match matched (the prefix of
    /// a prefix match, the whole path of an exact or regex match, `/` with no uri match)
    /// is replaced with this.
    Prefix(String),
    /// Envoy's `regex_rewrite`: every match of the regex in the path replaced with the
    /// substitution (`\1` style groups, RE2's `GlobalReplace`).
    Regex(Regex, String),
}

/// How much of the path a match covers, for `prefix_rewrite`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Matched {
    /// The first `n` bytes (a prefix match; `/` when there is no uri match).
    Prefix(usize),
    /// The whole path (an exact or regex match).
    #[default]
    Whole,
}

impl UriRewrite {
    /// The path sent upstream for the (normalized) `path` the match covered as `matched`.
    pub fn apply(&self, path: &str, matched: Matched) -> String {
        match self {
            UriRewrite::Prefix(to) => match matched {
                Matched::Whole => to.clone(),
                Matched::Prefix(n) => match path.get(n..) {
                    Some(rest) => format!("{to}{rest}"),
                    None => to.clone(),
                },
            },
            UriRewrite::Regex(re, sub) => re.replace_all(path, sub.as_str()).into_owned(),
        }
    }
}

/// RE2's rewrite string (`\0`-`\9` groups, `\\` a backslash) as the regex crate's
/// replacement (`${1}`, `$$` a dollar).
pub fn re2_substitution(s: &str, groups: usize) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '$' => out.push_str("$$"),
            '\\' => match chars.next() {
                Some('\\') => out.push('\\'),
                Some(d @ '0'..='9') => {
                    let n = d as usize - '0' as usize;
                    if n >= groups {
                        return Err(format!(
                            "rewrite {s:?}: \\{n} names a group the regex does not have"
                        ));
                    }
                    out.push_str(&format!("${{{n}}}"));
                }
                _ => {
                    return Err(format!(
                        "rewrite {s:?}: a backslash must be followed by a digit or a backslash"
                    ))
                }
            },
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Istio's HTTPRedirect, as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsRedirect {
    pub uri: Option<String>,
    pub authority: Option<String>,
    pub port: Option<u32>,
    pub derive_port: Option<String>,
    pub scheme: Option<String>,
    pub redirect_code: Option<u32>,
}

/// Istio's HTTPDirectResponse, as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsDirectResponse {
    pub status: u32,
    pub body: Option<VsBody>,
}

/// `string` or `bytes` (base64, as protobuf's JSON writes bytes).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsBody {
    pub string: Option<String>,
    pub bytes: Option<String>,
}

/// Istio's `uriRegexRewrite`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VsRegexRewrite {
    #[serde(rename = "match")]
    pub pattern: String,
    pub rewrite: String,
}

/// Istio's largest direct response body (its webhook's limit, and the one it gives Envoy).
const MAX_DIRECT_BODY: usize = 1024 * 1024;

fn header_safe(field: &str, v: &str) -> Result<(), String> {
    // What goes into Location must be one header value: no CR, LF or NUL (header
    // injection), nothing http refuses.
    if v.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(format!("{field}: {v:?} has a control character or space"));
    }
    Ok(())
}

impl VsRedirect {
    /// Istio's `ApplyRedirect`; errors name the field.
    pub fn compile(&self) -> Result<Redirect, String> {
        let status = match self.redirect_code.unwrap_or(0) {
            0 | 301 => StatusCode::MOVED_PERMANENTLY,
            302 => StatusCode::FOUND,
            303 => StatusCode::SEE_OTHER,
            307 => StatusCode::TEMPORARY_REDIRECT,
            308 => StatusCode::PERMANENT_REDIRECT,
            c => {
                return Err(format!(
                    "redirect.redirectCode: {c} is not one of 301, 302, 303, 307, 308"
                ))
            }
        };
        let uri = self.uri.clone().filter(|u| !u.is_empty());
        if let Some(u) = &uri {
            header_safe("redirect.uri", u)?;
            if !u.starts_with('/') {
                return Err(format!("redirect.uri: {u:?} must start with '/'"));
            }
        }
        let authority = self.authority.clone().filter(|a| !a.is_empty());
        if let Some(a) = &authority {
            header_safe("redirect.authority", a)?;
            crate::http::authority::Authority::parse(a)
                .map_err(|e| format!("redirect.authority: {a:?}: {e}"))?;
        }
        let scheme = self.scheme.clone().filter(|s| !s.is_empty());
        if let Some(s) = &scheme {
            let ok = s.starts_with(|c: char| c.is_ascii_alphabetic())
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
            if !ok {
                return Err(format!("redirect.scheme: {s:?} is not a URI scheme"));
            }
        }
        let port = match (self.port, self.derive_port.as_deref()) {
            (Some(_), Some(_)) => {
                return Err("redirect: set one of port and derivePort".into());
            }
            (Some(p), None) => RedirectPort::Port(
                u16::try_from(p)
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("redirect.port: {p} is not a port"))?,
            ),
            (None, Some("FROM_REQUEST_PORT")) => RedirectPort::FromRequest,
            (None, Some("FROM_PROTOCOL_DEFAULT") | None) => RedirectPort::Keep,
            (None, Some(d)) => {
                return Err(format!(
                    "redirect.derivePort: {d:?} is not FROM_PROTOCOL_DEFAULT or FROM_REQUEST_PORT"
                ))
            }
        };
        Ok(Redirect {
            uri,
            authority,
            scheme,
            port,
            status,
        })
    }
}

impl VsDirectResponse {
    pub fn compile(&self) -> Result<DirectResponse, String> {
        let status = u16::try_from(self.status)
            .ok()
            .filter(|s| (200..=599).contains(s))
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| {
                format!(
                    "directResponse.status: {} is not an HTTP status 200-599",
                    self.status
                )
            })?;
        let body = match &self.body {
            None => Bytes::new(),
            Some(VsBody {
                string: Some(s),
                bytes: None,
            }) => Bytes::from(s.clone()),
            Some(VsBody {
                string: None,
                bytes: Some(b),
            }) => {
                use base64::Engine;
                Bytes::from(
                    base64::engine::general_purpose::STANDARD
                        .decode(b.as_bytes())
                        .map_err(|e| format!("directResponse.body.bytes: not base64: {e}"))?,
                )
            }
            Some(_) => return Err("directResponse.body: set one of string and bytes".into()),
        };
        if body.len() > MAX_DIRECT_BODY {
            return Err(format!(
                "directResponse.body: {} bytes, at most {MAX_DIRECT_BODY}",
                body.len()
            ));
        }
        Ok(DirectResponse { status, body })
    }
}

impl Redirect {
    /// The `Location` for a request whose (normalized) path and query are `path` and
    /// `query`, sent with Host `host` (as received) to service port `port`; the request's
    /// scheme is `http` (plain HTTP inside the tunnel; the waypoint sets
    /// `x-forwarded-proto: http`). Envoy's `RouteEntryImplBase::newUri`.
    pub fn location(&self, host: &str, port: u16, path: &str, query: Option<&str>) -> String {
        const REQUEST_SCHEME: &str = "http";
        let scheme = self.scheme.as_deref().unwrap_or(REQUEST_SCHEME);
        // Istio: FROM_REQUEST_PORT is the listener's port; a scheme's own port is left out.
        let port = match self.port {
            RedirectPort::Keep => None,
            RedirectPort::FromRequest => Some(port),
            RedirectPort::Port(p) => Some(p),
        }
        .filter(|p| !((*p == 80 && scheme == "http") || (*p == 443 && scheme == "https")));
        let host = match &self.authority {
            Some(a) => a.clone(),
            None => {
                // Envoy's processRequestHost: the request's port goes when a port is set,
                // or when the scheme changes from http and it is :80.
                let (h, p) = split_port(host);
                let strip = port.is_some() || (scheme != REQUEST_SCHEME && p == Some("80"));
                if strip {
                    h.to_string()
                } else {
                    host.to_string()
                }
            }
        };
        let mut loc = format!("{scheme}://{host}");
        if let Some(p) = port {
            loc.push_str(&format!(":{p}"));
        }
        match &self.uri {
            Some(u) if u.contains('?') => loc.push_str(u),
            Some(u) => {
                loc.push_str(u);
                if let Some(q) = query {
                    loc.push('?');
                    loc.push_str(q);
                }
            }
            None => {
                loc.push_str(path);
                if let Some(q) = query {
                    loc.push('?');
                    loc.push_str(q);
                }
            }
        }
        loc
    }
}

/// `host[:port]` or `[v6][:port]` into the host and the port's digits.
fn split_port(authority: &str) -> (&str, Option<&str>) {
    let at = if authority.starts_with('[') {
        authority.rfind("]:").map(|i| i + 1)
    } else {
        authority.rfind(':')
    };
    match at {
        Some(i) => (&authority[..i], Some(&authority[i + 1..])),
        None => (authority, None),
    }
}

/// An ASCII-case-insensitive full-match regex source for `literal` (Envoy's
/// `case_sensitive: false` compares ASCII letters only).
pub fn ascii_case_insensitive(literal: &str) -> String {
    let mut out = String::with_capacity(literal.len() * 4);
    for c in literal.chars() {
        if c.is_ascii_alphabetic() {
            out.push('[');
            out.push(c.to_ascii_lowercase());
            out.push(c.to_ascii_uppercase());
            out.push(']');
        } else {
            out.push_str(&regex::escape(&c.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redirect(yaml: &str) -> Redirect {
        serde_yaml::from_str::<VsRedirect>(yaml)
            .expect("parses")
            .compile()
            .expect("compiles")
    }

    /// Envoy's `newUri` as Istio configures it: 301 by default, the request's query kept
    /// unless the uri has its own, FROM_REQUEST_PORT the service port, a scheme's own
    /// port left out, the request's port dropped when a port is set.
    #[test]
    fn redirect_locations() {
        let loc =
            |y: &str, host: &str, q: Option<&str>| redirect(y).location(host, 8080, "/a/b", q);
        let r = redirect("{uri: /new}");
        assert_eq!(r.status, StatusCode::MOVED_PERMANENTLY);
        assert_eq!(
            loc("{uri: /new}", "echo:8080", Some("x=1")),
            "http://echo:8080/new?x=1"
        );
        assert_eq!(
            loc("{uri: '/new?y=2'}", "echo", Some("x=1")),
            "http://echo/new?y=2"
        );
        assert_eq!(
            loc("{authority: example.com}", "echo:8080", None),
            "http://example.com/a/b"
        );
        assert_eq!(
            loc("{derivePort: FROM_REQUEST_PORT}", "echo:9", None),
            "http://echo:8080/a/b"
        );
        // Istio leaves out port 80 for http before Envoy sees it: the request's stays.
        assert_eq!(loc("{port: 80}", "echo:9", None), "http://echo:9/a/b");
        assert_eq!(loc("{port: 81}", "echo:9", None), "http://echo:81/a/b");
        assert_eq!(
            loc("{scheme: https, port: 443}", "echo", None),
            "https://echo/a/b"
        );
        assert_eq!(loc("{scheme: https}", "echo:80", None), "https://echo/a/b");
        assert_eq!(
            loc("{scheme: https}", "[::1]:80", None),
            "https://[::1]/a/b"
        );
        assert_eq!(
            loc("{scheme: https}", "echo:8443", None),
            "https://echo:8443/a/b"
        );
        assert_eq!(
            redirect("{redirectCode: 307}").status,
            StatusCode::TEMPORARY_REDIRECT
        );
        for bad in [
            "{uri: \"/a\\r\\nx: y\"}",
            "{uri: relative}",
            "{authority: \"a\\nb\"}",
            "{port: 1, derivePort: FROM_REQUEST_PORT}",
            "{derivePort: SOMETIMES}",
            "{scheme: 'ht tp'}",
            "{port: 0}",
        ] {
            let r: VsRedirect = serde_yaml::from_str(bad).expect("parses");
            assert!(r.compile().is_err(), "{bad}");
        }
    }

    #[test]
    fn uri_rewrites() {
        let p = UriRewrite::Prefix("/v2".into());
        assert_eq!(p.apply("/v1/users", Matched::Prefix(3)), "/v2/users");
        assert_eq!(
            p.apply("/anything", Matched::Prefix(1)),
            "/v2anything",
            "Envoy's prefix_rewrite of /"
        );
        assert_eq!(p.apply("/exact", Matched::Whole), "/v2");
        let re = Regex::new("^/service/([^/]+)(/.*)$").expect("regex");
        let sub = re2_substitution("\\2/instance/\\1", re.captures_len()).expect("sub");
        let r = UriRewrite::Regex(re, sub);
        assert_eq!(
            r.apply("/service/foo/v1/api", Matched::Whole),
            "/v1/api/instance/foo"
        );
        assert_eq!(r.apply("/other", Matched::Whole), "/other");
        let all = UriRewrite::Regex(
            Regex::new("a").expect("regex"),
            re2_substitution("$b", 1).expect("sub"),
        );
        assert_eq!(
            all.apply("/aXa", Matched::Whole),
            "/$bX$b",
            "every match; `$` literal"
        );
        assert!(re2_substitution("\\x", 1).is_err());
    }

    #[test]
    fn direct_responses() {
        let d = |y: &str| {
            serde_yaml::from_str::<VsDirectResponse>(y)
                .expect("parses")
                .compile()
        };
        let ok = d("{status: 503, body: {string: down}}").expect("ok");
        assert_eq!((ok.status.as_u16(), &ok.body[..]), (503, &b"down"[..]));
        assert_eq!(
            &d("{status: 200, body: {bytes: aGk=}}").expect("ok").body[..],
            b"hi"
        );
        assert!(d("{status: 600}").is_err());
        assert!(d("{status: 200, body: {bytes: '%%'}}").is_err());
    }

    #[test]
    fn case_insensitive_literals() {
        let re = Regex::new(&format!("^{}$", ascii_case_insensitive("/Ab.c"))).expect("regex");
        assert!(re.is_match("/aB.C") && !re.is_match("/abXc") && !re.is_match("/\u{212a}b.c"));
    }
}
