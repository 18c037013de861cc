//! Envoy's ext_authz types and service, generated from `proto/` (our own .proto files
//! with Envoy's names and field numbers).
#![allow(clippy::all, missing_docs, unreachable_pub)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/envoy.r#type.v3.rs"));
        }
    }
    pub mod service {
        pub mod auth {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.auth.v3.rs"));
            }
        }
    }
}
