//! The per-pod proxy: listeners inside each enrolled pod's netns, like Istio's in-pod mode.
//! 15001 outbound (captured), 15008 inbound HBONE, 15006 inbound plaintext, 15053 DNS.
//!
//! `lifecycle` enrolls and removes a pod, `pods` keeps the enrolled ones, `states`
//! what the admin dump shows of them; each pod's
//! listeners (`outbound`, `inbound`, `inbound_passthrough`, and `crate::dns::server`)
//! serve `pod::LocalPod` with the `inputs` they share, under the `limits`. Accepting
//! is `crate::listen`'s, relaying `crate::relay`'s.

pub mod inbound;
pub mod inbound_passthrough;
pub mod inputs;
pub mod lifecycle;
mod limits;
pub mod outbound;
pub mod pod;
pub mod pods;
pub mod states;

pub use self::inputs::ProxyInputs;
pub use self::lifecycle::{
    await_workload, enroll, enroll_workload, EnrolledPod, ProxyError, ENROLL_WAIT,
};
pub use self::pod::{InboundConns, InboundGuard, LocalPod};
pub use self::pods::Pods;
pub use self::states::WorkloadStates;
