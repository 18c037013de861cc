//! OpenTelemetry's OTLP trace and log types and export services, generated from `proto/` (our
//! own .proto files with OpenTelemetry's names and field numbers).
#![allow(clippy::all, missing_docs, unreachable_pub)]

pub mod opentelemetry {
    pub mod proto {
        pub mod common {
            pub mod v1 {
                include!(concat!(
                    env!("OUT_DIR"),
                    "/opentelemetry.proto.common.v1.rs"
                ));
            }
        }
        pub mod resource {
            pub mod v1 {
                include!(concat!(
                    env!("OUT_DIR"),
                    "/opentelemetry.proto.resource.v1.rs"
                ));
            }
        }
        pub mod trace {
            pub mod v1 {
                include!(concat!(env!("OUT_DIR"), "/opentelemetry.proto.trace.v1.rs"));
            }
        }
        pub mod logs {
            pub mod v1 {
                include!(concat!(env!("OUT_DIR"), "/opentelemetry.proto.logs.v1.rs"));
            }
        }
        pub mod collector {
            pub mod trace {
                pub mod v1 {
                    include!(concat!(
                        env!("OUT_DIR"),
                        "/opentelemetry.proto.collector.trace.v1.rs"
                    ));
                }
            }
            pub mod logs {
                pub mod v1 {
                    include!(concat!(
                        env!("OUT_DIR"),
                        "/opentelemetry.proto.collector.logs.v1.rs"
                    ));
                }
            }
        }
    }
}

pub use opentelemetry::proto::collector::logs::v1 as logs_collector;
pub use opentelemetry::proto::collector::trace::v1 as collector;
pub use opentelemetry::proto::common::v1 as common;
pub use opentelemetry::proto::logs::v1 as logs;
pub use opentelemetry::proto::resource::v1 as resource;
pub use opentelemetry::proto::trace::v1 as trace;

/// The gRPC methods, exactly OpenTelemetry's.
pub const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
pub const LOGS_EXPORT_PATH: &str = "/opentelemetry.proto.collector.logs.v1.LogsService/Export";
