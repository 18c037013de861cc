//! The DNS proxy, as Istio's ztunnel has it: UDP and TCP listeners on 127.0.0.1:15053
//! inside each enrolled pod (capture sends the pod's port-53 traffic there). A/AAAA
//! questions for mesh names (service hostnames, with Kubernetes search-domain expansion
//! from the asking pod's namespace; see `name`) are answered from the mesh state with
//! the services' VIPs; everything else is forwarded to the node's upstream resolvers
//! (`forwarder`) through a bounded, node-wide cache (`cache`). Counted in Istio's DNS
//! metrics (`metrics::dns`). The same upstreams resolve workload hostnames for
//! outbound connections (`on_demand`).

pub mod answer;
pub mod cache;
pub mod error;
pub mod forwarder;
pub mod message;
pub mod name;
pub mod on_demand;
pub mod proxy;
pub mod resolver;
pub mod server;

pub use self::answer::{answer_locally, Local, Transport};
pub use self::error::DnsError;
pub use self::proxy::{DnsConfig, DnsProxy};
/// The DNS proxy's port inside each pod (Istio's), on 127.0.0.1, UDP and TCP.
pub use crate::ports::DNS as PORT;
