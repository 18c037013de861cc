//! HBONE: TCP tunnelled as HTTP/2 CONNECT streams inside mTLS, port 15008.

pub mod batch;
pub mod client;
pub mod error;
pub mod guard;
pub mod pool;
pub mod request;
pub mod server;
pub mod stream;
pub mod tuning;

pub use error::HboneError;
pub use pool::{Pool, PoolKey, StreamGuard};
pub use request::{
    connect_authority, connect_target, protocol_abuse, respond_status, BadConnect, HboneAddress,
};
pub use stream::H2Stream;
pub use tuning::{
    h2_sizes, server_builder, set_h2_sizes, tune_tls, H2Sizes, CONNECTION_WINDOW, MAX_FRAME,
    MAX_HEADER_BYTES, PING_INTERVAL, PING_TIMEOUT, SERVER_MAX_STREAMS, STREAM_WINDOW,
    TLS_SEND_BUFFER_LIMIT,
};

/// The W3C `traceparent` of one tunnelled connection, as Istio's ztunnel keeps it: a
/// fresh one for each outbound connection, sent on its CONNECT; the CONNECT's for an
/// inbound stream (a new one when it has none or a bad one). Each side's span for the
/// connection carries its trace id as `id`, so the log lines of both ends of a tunnel
/// (and of a waypoint between them) share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    version: u8,
    // Bytes, not u128/u64: alignment 1 keeps every outbound connection's task (which holds
    // one for its life) from padding out to 16.
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

impl Default for TraceParent {
    fn default() -> Self {
        TraceParent::new()
    }
}

impl TraceParent {
    /// Fresh ids, not sampled (nothing exports a connection's span), as Istio's.
    pub fn new() -> TraceParent {
        TraceParent {
            version: 0,
            trace_id: rand::random(),
            parent_id: rand::random(),
            flags: 0,
        }
    }

    /// `version-traceid-parentid-flags`, 55 characters of lowercase or uppercase hex.
    pub fn parse(v: &str) -> Option<TraceParent> {
        let parts: Vec<&str> = v.split('-').collect();
        let [version, trace, parent, flags] = parts.as_slice() else {
            return None;
        };
        if v.len() != 55
            || version.len() != 2
            || trace.len() != 32
            || parent.len() != 16
            || flags.len() != 2
        {
            return None;
        }
        let hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
        if !(hex(version) && hex(trace) && hex(parent) && hex(flags)) {
            return None;
        }
        Some(TraceParent {
            version: u8::from_str_radix(version, 16).ok()?,
            trace_id: u128::from_str_radix(trace, 16).ok()?.to_be_bytes(),
            parent_id: u64::from_str_radix(parent, 16).ok()?.to_be_bytes(),
            flags: u8::from_str_radix(flags, 16).ok()?,
        })
    }

    /// The CONNECT's, else a new one.
    pub fn of_request<B>(req: &http::Request<B>) -> TraceParent {
        req.headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(TraceParent::parse)
            .unwrap_or_default()
    }

    /// The same trace, a new span of this hop as the parent (what a proxy passing the
    /// connection on sends).
    pub fn child(&self) -> TraceParent {
        TraceParent {
            parent_id: rand::random(),
            ..*self
        }
    }

    /// The header value.
    pub fn header(&self) -> String {
        format!(
            "{:02x}-{}-{:016x}-{:02x}",
            self.version,
            self.trace_id(),
            u64::from_be_bytes(self.parent_id),
            self.flags
        )
    }

    /// The trace id, 32 hex digits (the span field `id`).
    pub fn trace_id(&self) -> String {
        format!("{:032x}", u128::from_be_bytes(self.trace_id))
    }
}

/// A fresh `traceparent` header value (see [`TraceParent`]).
pub fn traceparent() -> String {
    TraceParent::new().header()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_and_pass_on_their_trace() {
        let tp = TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
            .expect("valid");
        assert_eq!(tp.trace_id(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(
            tp.header(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        let child = tp.child();
        assert_eq!(child.trace_id(), tp.trace_id());
        assert_ne!(child.header(), tp.header());
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
            "000-af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
        let req = http::Request::builder()
            .header("traceparent", tp.header())
            .body(())
            .unwrap();
        assert_eq!(TraceParent::of_request(&req), tp);
        let fresh = TraceParent::of_request(&http::Request::new(()));
        assert_eq!(fresh.header().len(), 55);
        assert!(fresh.header().ends_with("-00"), "not sampled, as Istio's");
    }
}
