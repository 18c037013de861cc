//! The network the waypoint is in: where it looks addresses up (an address is unique
//! only within its network) and the only network whose endpoints it sends to (it does
//! not originate double HBONE through east-west gateways). Process-wide and set once at
//! start, as HBONE's HTTP/2 sizes are: every config, from the file or from the cluster,
//! is read in it.

use std::sync::{Arc, OnceLock};

use ztunnel::state::Workload;

static NETWORK: OnceLock<String> = OnceLock::new();

/// Sets the network (its own workload's, or in a cluster NETWORK); later calls are ignored.
pub fn set(network: &str) {
    let _ = NETWORK.set(network.to_string());
}

/// The waypoint's network ("" until set: the default network).
pub fn get() -> &'static str {
    NETWORK.get().map_or("", String::as_str)
}

/// The endpoints in the waypoint's own network: another network's endpoints are
/// reached through their gateway with double HBONE, which the waypoint does not do.
pub fn same_network(mut eps: Vec<(Arc<Workload>, u16)>) -> Vec<(Arc<Workload>, u16)> {
    eps.retain(|(w, _)| w.network == get());
    eps
}
