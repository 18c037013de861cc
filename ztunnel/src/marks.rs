//! The SO_MARK values the proxy puts on its sockets, which capture rules match on.

/// SO_MARK on every socket the proxy opens, so capture rules exempt its own traffic.
pub const PROXY_MARK: u32 = 1337;

/// SO_MARK on the proxy's transparent deliveries to a pod's app (connections that carry
/// the real client's address); replies to them are routed back over lo by this mark.
pub const DELIVERY_MARK: u32 = 0x111;
