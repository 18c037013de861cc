//! Types generated from `proto/` (our own .proto files written from Istio's field
//! numbers), and the xDS type URLs of the resources ztunnel subscribes to.
#![allow(clippy::all, missing_docs, unreachable_pub)]

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

pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";
