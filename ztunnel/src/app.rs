//! What both binaries (ztunnel and the waypoint) share at start-up.

pub mod flags;
