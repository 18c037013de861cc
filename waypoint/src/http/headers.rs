//! Request and response heads as the waypoint forwards them: hop-by-hop headers
//! dropped, identity and origin headers set by the waypoint, the authority read.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Request;
use ztunnel::identity::Identity;

/// The request's authority as the head says it, unchecked: the URI's (HTTP/2
/// `:authority`, absolute-form HTTP/1), else `Host`; empty when there is neither. For the
/// access log and for a head the plan already rewrote; decisions on a client's request
/// use `authority::Authority::of_request`, which refuses what is not `host[:port]`.
pub fn authority(parts: &http::request::Parts) -> String {
    parts
        .uri
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            parts
                .headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// Hop-by-hop headers are per connection and never forwarded (RFC 9110 7.6.1).
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    ] {
        h.remove(n);
    }
    // gRPC needs `te: trailers`; any other te value is hop-by-hop.
    if h.get(header::TE).is_some_and(|v| v != "trailers") {
        h.remove(header::TE);
    }
}

/// Identity and origin headers. `x-forwarded-client-cert` is the waypoint's to set
/// (Envoy's SANITIZE_SET): the client's is dropped, so a backend can trust it.
/// `x-forwarded-for` gets the peer's address appended, as Envoy does, so its last entry
/// is always the one the waypoint saw; `x-forwarded-proto` is kept (an ingress gateway
/// may have terminated TLS) or set to `http`. Unverifiable claims (`forwarded`,
/// `x-real-ip`) and Envoy-internal `x-envoy-*` headers are dropped.
pub fn set_trusted_headers(
    h: &mut HeaderMap,
    waypoint: &Identity,
    src_identity: &Identity,
    src_ip: IpAddr,
) {
    let client_set: Vec<HeaderName> = h
        .keys()
        .filter(|k| {
            let k = k.as_str();
            k.starts_with("x-envoy-")
                || k == "x-forwarded-client-cert"
                || k == "forwarded"
                || k == "x-real-ip"
        })
        .cloned()
        .collect();
    for k in client_set {
        h.remove(k);
    }
    // Several x-forwarded-for lines are one list (RFC 9110 5.3); join them first.
    let prior: Vec<&str> = h
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let xff = if prior.is_empty() {
        src_ip.to_string()
    } else {
        format!("{}, {src_ip}", prior.join(", "))
    };
    match HeaderValue::from_str(&xff) {
        Ok(v) => {
            h.insert("x-forwarded-for", v);
        }
        Err(_) => {
            h.remove("x-forwarded-for");
        }
    }
    if !h.contains_key("x-forwarded-proto") {
        h.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    }
    if let Ok(v) = HeaderValue::from_str(&format!("By={waypoint};URI={src_identity}")) {
        h.insert("x-forwarded-client-cert", v);
    }
    if !h.contains_key("x-request-id") {
        let id: u128 = rand::random();
        if let Ok(v) = HeaderValue::from_str(&format!("{id:032x}")) {
            h.insert("x-request-id", v);
        }
    }
}

pub fn header_bytes(h: &HeaderMap) -> u64 {
    h.iter()
        .map(|(k, v)| (k.as_str().len() + v.len() + 4) as u64)
        .sum()
}

/// A copy of a request head, without its extensions but an extended CONNECT's
/// `:protocol`.
pub fn clone_parts(p: &http::request::Parts) -> http::request::Parts {
    let mut r = Request::new(());
    if let Some(proto) = p.extensions.get::<hyper::ext::Protocol>() {
        r.extensions_mut().insert(proto.clone());
    }
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("gzip"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut g = HeaderMap::new();
        g.insert("te", HeaderValue::from_static("trailers"));
        strip_hop_by_hop(&mut g);
        assert!(g.contains_key("te"));
    }
}
