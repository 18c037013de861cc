//! The access log: one line per completed connection, with Istio ztunnel's field names
//! (`src.addr`, `src.workload`, `src.namespace`, `src.identity`, `src.cluster`, `dst.addr`,
//! `dst.hbone_addr`, `dst.service`, `dst.workload`, `dst.namespace`, `dst.identity`, `dst.cluster`,
//! `direction`, `bytes_sent`, `bytes_recv`, `duration`, `error`), as text or JSON
//! (`LOG_FORMAT=json`). Fields that are not known are left out. `bytes_sent` counts the
//! bytes that went towards the destination, `bytes_recv` those that came back, whichever
//! proxy logs.

use std::net::SocketAddr;
use std::time::Duration;

use crate::baggage::Baggage;
use crate::identity::Identity;
use crate::state::{Service, Workload};

/// One side of a logged connection.
#[derive(Clone, Copy, Default)]
pub struct Side<'a> {
    pub workload: Option<&'a Workload>,
    /// Verified identity (or the one the peer must prove).
    pub identity: Option<&'a Identity>,
    /// What the peer said of itself in its baggage, for a peer config does not describe
    /// (`workload` None): its namespace and cluster, and as Istio's ztunnel logs it, for a
    /// source its canonical service (`src.workload`), for a destination its workload name
    /// (`dst.workload`).
    pub baggage: Option<&'a Baggage>,
}

impl Side<'_> {
    fn namespace(&self) -> Option<Value<'_>> {
        match (self.workload, self.baggage) {
            (Some(w), _) => Some(Value(&w.namespace)),
            (None, Some(b)) => b.namespace.as_deref().map(Value),
            (None, None) => None,
        }
    }

    fn cluster(&self) -> Option<Value<'_>> {
        match (self.workload, self.baggage) {
            (Some(w), _) => cluster(w).map(Value),
            (None, Some(b)) => b.cluster_id.as_deref().map(Value),
            (None, None) => None,
        }
    }

    /// `src.workload`: the pod's name, else (Istio) the canonical service its baggage names.
    fn source_name(&self) -> Option<Value<'_>> {
        match (self.workload, self.baggage) {
            (Some(w), _) => Some(Value(&w.name)),
            (None, Some(b)) => b.service_name.as_deref().map(Value),
            (None, None) => None,
        }
    }

    /// `dst.workload`: the pod's name, else (Istio) the workload name its baggage names.
    fn destination_name(&self) -> Option<Value<'_>> {
        match (self.workload, self.baggage) {
            (Some(w), _) => Some(Value(&w.name)),
            (None, Some(b)) => b.workload_name.as_deref().map(Value),
            (None, None) => None,
        }
    }
}

/// A name in a text log line: as it is when made of name characters only, else quoted
/// and escaped (Debug), so a value a peer chose (its baggage: any visible ASCII, spaces
/// and `=` included) cannot pass for another field of the line.
struct Value<'a>(&'a str);

impl std::fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plain = !self.0.is_empty()
            && self
                .0
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._:/@".contains(&b));
        if plain {
            f.write_str(self.0)
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

pub struct ConnectionLog<'a> {
    /// `outbound`, `inbound` or `waypoint`.
    pub direction: &'static str,
    /// `HBONE` or `TCP`.
    pub protocol: &'static str,
    pub src_addr: SocketAddr,
    pub src: Side<'a>,
    /// The address connected to: for HBONE the peer's 15008, as Istio logs it.
    pub dst_addr: SocketAddr,
    /// HBONE only: the CONNECT target (the workload's address and port, or through an
    /// east-west gateway the service's hostname and port).
    pub dst_hbone_addr: Option<crate::hbone::HboneAddress>,
    pub dst_service: Option<&'a Service>,
    pub dst: Side<'a>,
    pub bytes_sent: u64,
    pub bytes_recv: u64,
    pub duration: Duration,
    pub error: Option<String>,
}

/// The workload's cluster, when config names one.
fn cluster(w: &Workload) -> Option<&str> {
    Some(w.cluster_id.as_str()).filter(|c| !c.is_empty())
}

/// tracing wants a static level: the same event at `info` or `warn`. Values are written
/// unquoted (Display), so a line can be grepped for `src.identity=spiffe://...`.
macro_rules! connection_event {
    ($level:ident, $l:expr) => {
        tracing::$level!(
            target: "access",
            direction = $l.direction,
            protocol = $l.protocol,
            connection_security_policy = if $l.protocol == "HBONE" { "mutual_tls" } else { "unknown" },
            src.addr = %$l.src_addr,
            src.workload = $l.src.source_name().map(display),
            src.namespace = $l.src.namespace().map(display),
            src.identity = $l.src.identity.map(display),
            src.cluster = $l.src.cluster().map(display),
            dst.addr = %$l.dst_addr,
            dst.hbone_addr = $l.dst_hbone_addr.as_ref().map(display),
            dst.service = $l.dst_service.map(|s| display(&s.hostname)),
            dst.workload = $l.dst.destination_name().map(display),
            dst.namespace = $l.dst.namespace().map(display),
            dst.identity = $l.dst.identity.map(display),
            dst.cluster = $l.dst.cluster().map(display),
            bytes_sent = $l.bytes_sent,
            bytes_recv = $l.bytes_recv,
            duration = %format_args!("{}ms", $l.duration.as_millis()),
            error = $l.error.as_deref(),
            "connection complete"
        )
    };
}

impl ConnectionLog<'_> {
    /// Writes the line: `warn` when the connection ended with an error, else `info`.
    pub fn write(&self) {
        if self.error.is_some() {
            connection_event!(warn, self);
        } else {
            connection_event!(info, self);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_chosen_values_cannot_forge_fields() {
        assert_eq!(Value("echo-v1").to_string(), "echo-v1");
        assert_eq!(Value("Kubernetes").to_string(), "Kubernetes");
        assert_eq!(
            Value("x dst.identity=spiffe://evil").to_string(),
            "\"x dst.identity=spiffe://evil\""
        );
        assert_eq!(Value("a\"b").to_string(), "\"a\\\"b\"");
        assert_eq!(Value("").to_string(), "\"\"");
    }

    #[test]
    fn a_side_config_does_not_know_is_its_baggage() {
        let b = Baggage {
            namespace: Some("ns".into()),
            workload_name: Some("wl".into()),
            service_name: Some("svc".into()),
            cluster_id: Some("c1".into()),
            ..Default::default()
        };
        let side = Side {
            workload: None,
            identity: None,
            baggage: Some(&b),
        };
        let s = |v: Option<Value<'_>>| v.map(|v| v.to_string());
        assert_eq!(s(side.source_name()).as_deref(), Some("svc"));
        assert_eq!(s(side.destination_name()).as_deref(), Some("wl"));
        assert_eq!(s(side.namespace()).as_deref(), Some("ns"));
        assert_eq!(s(side.cluster()).as_deref(), Some("c1"));
        // Config wins over baggage.
        let w = Workload::new("u", "pod-1", "default");
        let side = Side {
            workload: Some(&w),
            ..side
        };
        assert_eq!(s(side.destination_name()).as_deref(), Some("pod-1"));
        assert_eq!(s(side.namespace()).as_deref(), Some("default"));
        assert_eq!(s(side.cluster()), None);
    }
}
