//! Which endpoint a request keeps to: the key of a consistent-hash DestinationRule (a
//! header, a cookie, a query parameter, the client's address; Envoy's generated cookie
//! for a cookie with a `ttl`) and the endpoint an HTTPRoute session names.

use http::header::{self, HeaderValue};

use crate::destination::{Pick, Policy};
use crate::route::{SessionKind, SessionPersistence};

/// The endpoint a session cookie or header names (the base64url of `ip:port` the
/// waypoint set), if the request has a valid one.
pub(super) fn session_endpoint(
    sp: &SessionPersistence,
    headers: &http::HeaderMap,
) -> Option<std::net::SocketAddr> {
    use base64::Engine;
    let name = sp.name();
    let value = match sp.kind {
        SessionKind::Header => headers.get(name)?.to_str().ok()?.trim(),
        SessionKind::Cookie => cookie(headers, name)?,
    };
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(value.as_bytes())
        .ok()?;
    std::str::from_utf8(&raw).ok()?.parse().ok()
}

/// The value of the request's cookie `name` (the first, in any `Cookie` header).
fn cookie<'h>(headers: &'h http::HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

fn unquoted(v: &str) -> &str {
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v)
}

/// The key of a request that carries cookie value `v` (as `hash_key` makes it).
fn cookie_key(v: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    unquoted(v).hash(&mut h);
    h.finish()
}

/// The value that names `addr` as a session's endpoint.
pub fn session_value(addr: std::net::SocketAddr) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(addr.to_string())
}

/// The request's key for a consistent hash: the header's value (all of them), the
/// cookie's, the query parameter's, or the client's address.
pub(super) fn hash_key(
    pick: Option<&Pick>,
    parts: &http::request::Parts,
    query: Option<&str>,
    src: std::net::IpAddr,
) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match pick? {
        Pick::HashHeader(name) => {
            let mut any = false;
            for v in parts.headers.get_all(name) {
                v.as_bytes().hash(&mut h);
                any = true;
            }
            any.then_some(())?
        }
        // Envoy hashes the cookie's value without its quotes.
        Pick::HashCookie(name) => unquoted(cookie(&parts.headers, name)?).hash(&mut h),
        Pick::HashQuery(name) => {
            let value = query?.split('&').find_map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                (k == name).then_some(v)
            })?;
            value.hash(&mut h)
        }
        Pick::HashSourceIp => src.hash(&mut h),
        Pick::RoundRobin | Pick::LeastRequest | Pick::Random => return None,
    }
    Some(h.finish())
}

/// consistentHash.httpCookie with a ttl: a request without the cookie (no `hash`) gets
/// one that names its client, and is placed by it, so its next requests (with the
/// cookie) go to the same endpoint (Envoy's generated cookie). The request's key.
pub(super) fn generated_cookie(
    hash: Option<u64>,
    policy: Option<&Policy>,
    client: std::net::SocketAddr,
    response_headers: &mut Vec<(http::HeaderName, HeaderValue)>,
) -> Option<u64> {
    let Some(policy) = policy.filter(|_| hash.is_none()) else {
        return hash;
    };
    let (Some(Pick::HashCookie(_)), Some(c)) = (policy.pick.as_ref(), policy.cookie.as_ref())
    else {
        return hash;
    };
    let v = c.value_for(client);
    if let Ok(set) = HeaderValue::from_str(&c.set_cookie(&v)) {
        response_headers.push((header::SET_COOKIE, set));
    }
    Some(cookie_key(&v))
}
