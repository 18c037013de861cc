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
    match connect_authority(req)? {
        HboneAddress::Addr(a) => Ok(a),
        HboneAddress::Host(..) => Err(BadConnect::BadAuthority(req.uri().to_string())),
    }
}

/// What a CONNECT names (Istio's HboneAddress): an `ip:port`, or a service's
/// `hostname:port`, which is how double HBONE through an east-west gateway names its
/// destination (the gateway, and the proxy behind it, pick the endpoint).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HboneAddress {
    Addr(std::net::SocketAddr),
    Host(String, u16),
}

impl From<std::net::SocketAddr> for HboneAddress {
    fn from(a: std::net::SocketAddr) -> Self {
        HboneAddress::Addr(a)
    }
}

impl std::fmt::Display for HboneAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // SocketAddr's Display brackets IPv6.
            HboneAddress::Addr(a) => a.fmt(f),
            HboneAddress::Host(h, p) => write!(f, "{h}:{p}"),
        }
    }
}

/// The target of an HBONE request that may name a service: `CONNECT ip:port` or
/// `CONNECT hostname:port` (a DNS name, no user info). What the hostname may reach is
/// for the caller to decide.
pub fn connect_authority<B>(req: &http::Request<B>) -> Result<HboneAddress, BadConnect> {
    if req.method() != http::Method::CONNECT {
        return Err(BadConnect::NotConnect(req.method().to_string()));
    }
    let bad = || BadConnect::BadAuthority(req.uri().to_string());
    let authority = req.uri().authority().ok_or_else(bad)?.as_str();
    if let Ok(a) = authority.parse() {
        return Ok(HboneAddress::Addr(a));
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    // An IP that did not parse with its port above, or anything but a DNS name: refused.
    if host.parse::<std::net::IpAddr>().is_ok()
        || host.starts_with('[')
        || crate::state::workload::validate_hostname(host).is_err()
    {
        return Err(bad());
    }
    Ok(HboneAddress::Host(host.to_ascii_lowercase(), port))
}

/// The header Istio's ztunnel puts on double HBONE's inner CONNECT, naming the client's
/// network (Istio's code calls it `x-istio-origin-network`; this is its name on the wire).
/// A value other than the receiving proxy's own network says the connection came
/// through a gateway: its source address is the gateway's, not the client's.
pub const FORWARDED_NETWORK: &str = "x-forwarded-network";

/// The network a CONNECT says its client is in (`x-forwarded-network`), if any.
pub fn forwarded_network<B>(req: &http::Request<B>) -> Option<String> {
    let v = req.headers().get(FORWARDED_NETWORK)?.to_str().ok()?;
    Some(v.to_string())
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
    let resp = http::Response::builder()
        .status(status)
        .body(())
        .unwrap_or_default();
    let _ = tx.send_response(resp, true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_targets() {
        let req = |m: &str, uri: &str| {
            http::Request::builder()
                .method(m)
                .uri(uri)
                .body(())
                .unwrap()
        };
        assert_eq!(
            connect_target(&req("CONNECT", "10.0.0.1:8080")),
            Ok("10.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            connect_target(&req("CONNECT", "[fd00::1]:80")),
            Ok("[fd00::1]:80".parse().unwrap())
        );
        assert!(matches!(
            connect_target(&req("GET", "http://10.0.0.1:80/")),
            Err(BadConnect::NotConnect(_))
        ));
        for bad in [
            "echo.default:80",
            "10.0.0.1",
            "10.0.0.1:99999",
            "user@10.0.0.1:80",
        ] {
            assert!(
                matches!(
                    connect_target(&req("CONNECT", bad)),
                    Err(BadConnect::BadAuthority(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn connect_authorities_may_name_a_service() {
        let req = |uri: &str| {
            http::Request::builder()
                .method("CONNECT")
                .uri(uri)
                .body(())
                .unwrap()
        };
        let host = |h: &str, p| Ok(HboneAddress::Host(h.into(), p));
        assert_eq!(
            connect_authority(&req("10.0.0.1:8080")),
            Ok(HboneAddress::Addr("10.0.0.1:8080".parse().unwrap()))
        );
        assert_eq!(
            connect_authority(&req("echo.default.svc.cluster.local:80")),
            host("echo.default.svc.cluster.local", 80)
        );
        assert_eq!(
            connect_authority(&req("Echo.Default:80")),
            host("echo.default", 80)
        );
        assert_eq!(
            connect_authority(&req("echo.default:80"))
                .unwrap()
                .to_string(),
            "echo.default:80"
        );
        for bad in [
            "echo.default",
            "echo.default:99999",
            "user@echo.default:80",
            "10.0.0.1:99999",
            "[fd00::1]:x",
            "*.default:80",
            "a..b:80",
        ] {
            assert!(
                matches!(
                    connect_authority(&req(bad)),
                    Err(BadConnect::BadAuthority(_))
                ),
                "{bad}"
            );
        }
        let get = http::Request::builder()
            .method("GET")
            .uri("http://echo.default:80/")
            .body(())
            .unwrap();
        assert!(matches!(
            connect_authority(&get),
            Err(BadConnect::NotConnect(_))
        ));
    }

    #[test]
    fn forwarded_names_the_client_and_the_service() {
        let client = "10.0.0.1:4000".parse().unwrap();
        assert_eq!(forwarded(client, None), r#"for="10.0.0.1:4000""#);
        assert_eq!(
            forwarded("[fd00::1]:80".parse().unwrap(), None),
            r#"for="[fd00::1]:80""#
        );
        let v = forwarded(client, Some("echo.default.svc.cluster.local"));
        assert_eq!(
            v,
            r#"for="10.0.0.1:4000";host=echo.default.svc.cluster.local"#
        );
        let req = |f: &str| {
            http::Request::builder()
                .header("forwarded", f)
                .body(())
                .unwrap()
        };
        assert_eq!(
            forwarded_host(&req(&v)).as_deref(),
            Some("echo.default.svc.cluster.local")
        );
        assert_eq!(
            forwarded_host(&req(r#"for="1.2.3.4:5"; host="a.b""#)).as_deref(),
            Some("a.b")
        );
        assert_eq!(forwarded_host(&req(r#"for="1.2.3.4:5""#)), None);
        assert_eq!(forwarded_host(&req("host=")), None);
        assert_eq!(forwarded_host(&http::Request::new(())), None);
    }
}
