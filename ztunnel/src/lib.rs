//! ztunnel: the ambient mesh node proxy. Shared mesh code (identity, TLS, HBONE,
//! config, L4 policy) lives here so the waypoint can reuse it; L7 (HTTPRoute, L7
//! AuthorizationPolicy) is the waypoint's own.

// Errors are returned on start-up, enrollment and config-load paths, never per packet or
// request, and carry the file, field or pod they name: their size costs nothing there.
#![allow(clippy::result_large_err)]

pub mod access_log;
pub mod admin;
pub mod app;
pub mod baggage;
pub mod capture;
pub mod cidr;
pub mod config;
pub mod dns;
pub mod drain;
#[doc(hidden)]
pub mod fuzzing;
pub mod hbone;
pub mod http_endpoint;
pub mod identity;
pub mod istiod;
pub mod listen;
pub mod logging;
pub mod marks;
pub mod memory;
pub mod metrics;
pub mod metrics_endpoint;
pub mod netns;
pub mod ports;
pub mod proxy;
pub mod proxy_protocol;
pub mod rbac;
pub mod relay;
pub mod state;
#[cfg(test)]
mod task_size;
#[cfg(test)]
mod test_skip;
pub mod tls;
pub mod xds;
pub mod zds;

pub use marks::{DELIVERY_MARK, PROXY_MARK};
