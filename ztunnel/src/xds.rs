//! Workload discovery from istiod: delta ADS over gRPC for `istio.workload.Address`
//! (workloads and services) and `istio.security.Authorization` (L4 policies).
//!
//! `client` keeps the stream (ACK/NACK, reconnect with the versions it holds, backoff)
//! and applies each response to a `store::Store`, which rebuilds the mesh state;
//! `convert` turns protobuf resources into the proxy's own types, one resource at a time,
//! so a malformed one is NACKed while the rest of the update applies.

pub mod client;
pub mod convert;
pub mod store;

pub use client::{run, XdsConfig};
pub use store::Store;

/// Types generated from `proto/` (our own .proto files written from Istio's field numbers).
#[allow(clippy::all, missing_docs, unreachable_pub)]
pub mod proto {
    pub mod envoy {
        pub mod service {
            pub mod discovery {
                pub mod v3 {
                    include!(concat!(env!("OUT_DIR"), "/envoy.service.discovery.v3.rs"));
                }
            }
        }
    }
    pub mod google {
        pub mod rpc {
            include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
        }
    }
    pub mod istio {
        pub mod workload {
            include!(concat!(env!("OUT_DIR"), "/istio.workload.rs"));
        }
        pub mod security {
            include!(concat!(env!("OUT_DIR"), "/istio.security.rs"));
        }
        pub mod v1 {
            pub mod auth {
                include!(concat!(env!("OUT_DIR"), "/istio.v1.auth.rs"));
            }
        }
    }
}

pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";
