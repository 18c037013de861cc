//! Workload discovery from istiod: delta ADS over gRPC for `istio.workload.Address`
//! (workloads and services) and `istio.security.Authorization` (L4 policies).
//!
//! `client` keeps the stream (ACK/NACK, reconnect with the versions it holds, backoff)
//! and applies each response to a `store::Store`, which rebuilds the mesh state;
//! `convert` turns protobuf resources into the proxy's own types, one resource at a time,
//! so a malformed one is NACKed while the rest of the update applies.

pub mod client;
pub mod convert;
pub mod proto;
pub mod store;

pub use client::{run, XdsConfig};
pub use proto::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
pub use store::Store;
