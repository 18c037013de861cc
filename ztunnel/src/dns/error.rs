//! Errors of the DNS proxy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("no upstream DNS server (ztunnel's resolv.conf lists none); set --dns-upstream")]
    NoUpstream,
    #[error("cannot read {path}: {source}; set --dns-upstream")]
    ResolvConf {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid DNS upstream {0:?}: expected IP or IP:PORT")]
    BadUpstream(String),
    #[error("upstream DNS server {server}: {source}")]
    Upstream {
        server: SocketAddr,
        source: std::io::Error,
    },
    #[error("upstream DNS server {server} did not answer within {timeout:?}")]
    Timeout {
        server: SocketAddr,
        timeout: Duration,
    },
    #[error("upstream DNS server {server} sent an invalid answer: {reason}")]
    InvalidAnswer {
        server: SocketAddr,
        reason: &'static str,
    },
    #[error("{0} DNS questions already in flight upstream; refusing more")]
    Overloaded(usize),
    #[error("cannot encode a DNS query: {0}")]
    Encode(String),
    #[error("cannot bind the DNS proxy on {addr} in pod {pod}: {source}")]
    Bind {
        pod: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
}
