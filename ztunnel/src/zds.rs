//! ZDS, istio-cni's pod enrollment protocol: an AF_UNIX SOCK_SEQPACKET socket where the
//! node proxy connects as client, says hello, and then receives one WorkloadRequest per
//! message (a pod's netns fd rides along with Add via SCM_RIGHTS) and answers each with
//! an Ack.

pub mod client;
pub mod error;
pub mod messages;
pub mod seqpacket;
pub mod server;

pub use self::client::check_workload_info;
pub use self::error::ZdsError;
pub use self::messages::*;
pub use self::seqpacket::SeqPacket;

/// Default socket path, as Istio's ztunnel.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
