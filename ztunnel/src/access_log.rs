//! The access log: one line per completed connection, with Istio ztunnel's field names
//! (`src.addr`, `src.workload`, `src.namespace`, `src.identity`, `src.cluster`, `dst.addr`,
//! `dst.hbone_addr`, `dst.service`, `dst.workload`, `dst.namespace`, `dst.identity`, `dst.cluster`,
//! `direction`, `bytes_sent`, `bytes_recv`, `duration`, `error`), as text or JSON
//! (`LOG_FORMAT=json`). Fields that are not known are left out. `bytes_sent` counts the
//! bytes that went towards the destination, `bytes_recv` those that came back, whichever
//! proxy logs.

use std::net::SocketAddr;
use std::time::Duration;

use crate::identity::Identity;
use crate::state::{Service, Workload};

/// One side of a logged connection.
#[derive(Clone, Copy, Default)]
pub struct Side<'a> {
    pub workload: Option<&'a Workload>,
    /// Verified identity (or the one the peer must prove).
    pub identity: Option<&'a Identity>,
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
            src.workload = $l.src.workload.map(|w| display(&w.name)),
            src.namespace = $l.src.workload.map(|w| display(&w.namespace)),
            src.identity = $l.src.identity.map(display),
            src.cluster = $l.src.workload.and_then(|w| cluster(w)).map(display),
            dst.addr = %$l.dst_addr,
            dst.hbone_addr = $l.dst_hbone_addr.as_ref().map(display),
            dst.service = $l.dst_service.map(|s| display(&s.hostname)),
            dst.workload = $l.dst.workload.map(|w| display(&w.name)),
            dst.namespace = $l.dst.workload.map(|w| display(&w.namespace)),
            dst.identity = $l.dst.identity.map(display),
            dst.cluster = $l.dst.workload.and_then(|w| cluster(w)).map(display),
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
