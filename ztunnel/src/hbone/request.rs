//! The server side's view of one HBONE request: what it targets, whether its connection
//! misbehaved, and a bodyless answer.

use bytes::Bytes;

use super::guard;

/// Why an HBONE request is refused before anything else looks at it (answered 400).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadConnect {
    #[error("HBONE request is {0}, not CONNECT")]
    NotConnect(String),
    #[error("CONNECT authority {0:?} is not ip:port")]
    BadAuthority(String),
}

/// The target of an HBONE request: it must be `CONNECT ip:port` (IPv6 in brackets).
/// Anything else, headers included, is never used to decide where a tunnel goes.
pub fn connect_target<B>(req: &http::Request<B>) -> Result<std::net::SocketAddr, BadConnect> {
    if req.method() != http::Method::CONNECT {
        return Err(BadConnect::NotConnect(req.method().to_string()));
    }
    req.uri()
        .authority()
        .and_then(|a| a.as_str().parse().ok())
        .ok_or_else(|| BadConnect::BadAuthority(req.uri().to_string()))
}

/// The `forwarded` header a client side sends on CONNECT, as Istio's ztunnel: the
/// original client, and the service it meant (`host=`), so the server side can label
/// the connection with that service.
pub fn forwarded(client: std::net::SocketAddr, service_hostname: Option<&str>) -> String {
    match service_hostname {
        Some(h) => format!("for=\"{client}\";host={h}"),
        None => format!("for=\"{client}\""),
    }
}

/// The `host=` a client put in `forwarded` (quotes removed), if any. A claim only: the
/// server side uses it to pick among the services the target really belongs to.
pub fn forwarded_host<B>(req: &http::Request<B>) -> Option<String> {
    let v = req.headers().get(http::header::FORWARDED)?.to_str().ok()?;
    v.split(';')
        .filter_map(|part| part.trim().strip_prefix("host="))
        .map(|h| h.trim_matches('"').to_string())
        .find(|h| !h.is_empty())
}

/// Whether an HTTP/2 connection error means the peer misbehaved, and how (a bounded
/// metric label): floods of empty DATA frames (our guard), floods h2 cuts off with GOAWAY
/// ENHANCE_YOUR_CALM (rapid reset, CONTINUATION floods), and other protocol violations
/// h2 answers with GOAWAY. A peer that just went away is not abuse.
pub fn protocol_abuse(e: &h2::Error) -> Option<&'static str> {
    if e.get_io().is_some_and(guard::is_flood) {
        return Some("empty_data_flood");
    }
    match e.reason() {
        Some(h2::Reason::ENHANCE_YOUR_CALM) => Some("h2_flood"),
        Some(h2::Reason::NO_ERROR) | Some(h2::Reason::CANCEL) | None => None,
        Some(_) if e.is_go_away() || e.is_library() => Some("h2_protocol"),
        Some(_) => None,
    }
}

/// Answers a CONNECT stream with a bodyless status (400/401/503...).
pub fn respond_status(mut tx: h2::server::SendResponse<Bytes>, status: http::StatusCode) {
    let resp = http::Response::builder().status(status).body(()).unwrap_or_default();
    let _ = tx.send_response(resp, true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_targets() {
        let req = |m: &str, uri: &str| http::Request::builder().method(m).uri(uri).body(()).unwrap();
        assert_eq!(connect_target(&req("CONNECT", "10.0.0.1:8080")), Ok("10.0.0.1:8080".parse().unwrap()));
        assert_eq!(connect_target(&req("CONNECT", "[fd00::1]:80")), Ok("[fd00::1]:80".parse().unwrap()));
        assert!(matches!(connect_target(&req("GET", "http://10.0.0.1:80/")), Err(BadConnect::NotConnect(_))));
        for bad in ["echo.default:80", "10.0.0.1", "10.0.0.1:99999", "user@10.0.0.1:80"] {
            assert!(matches!(connect_target(&req("CONNECT", bad)), Err(BadConnect::BadAuthority(_))), "{bad}");
        }
    }

    #[test]
    fn forwarded_names_the_client_and_the_service() {
        let client = "10.0.0.1:4000".parse().unwrap();
        assert_eq!(forwarded(client, None), r#"for="10.0.0.1:4000""#);
        assert_eq!(forwarded("[fd00::1]:80".parse().unwrap(), None), r#"for="[fd00::1]:80""#);
        let v = forwarded(client, Some("echo.default.svc.cluster.local"));
        assert_eq!(v, r#"for="10.0.0.1:4000";host=echo.default.svc.cluster.local"#);
        let req = |f: &str| http::Request::builder().header("forwarded", f).body(()).unwrap();
        assert_eq!(forwarded_host(&req(&v)).as_deref(), Some("echo.default.svc.cluster.local"));
        assert_eq!(forwarded_host(&req(r#"for="1.2.3.4:5"; host="a.b""#)).as_deref(), Some("a.b"));
        assert_eq!(forwarded_host(&req(r#"for="1.2.3.4:5""#)), None);
        assert_eq!(forwarded_host(&req("host=")), None);
        assert_eq!(forwarded_host(&http::Request::new(())), None);
    }
}
