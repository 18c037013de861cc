//! Replies to the proxy's transparent deliveries. The proxy connects to the app from the
//! real client's address (IP_TRANSPARENT) with mark 0x111; the app's replies to that
//! address must come back to the proxy over lo rather than leave by the pod's default
//! route. Packets marked 0x111 (nftables: restored from the conntrack mark; eBPF: the
//! app's accepted socket takes the SYN's mark through tcp_fwmark_accept) are sent by an
//! ip rule to a table whose only route is local.

use super::command::{run_in, run_in_output};
use super::error::CaptureError;
use crate::netns::InPodNetns;
use crate::marks::DELIVERY_MARK;

pub const ROUTE_TABLE: &str = "133";
const RULE_PREF: &str = "32764";

pub async fn install(netns: &InPodNetns) -> Result<(), CaptureError> {
    let mark = format!("{DELIVERY_MARK:#x}/0xfff");
    // A proxy taking over from another finds the rule in place: keep it rather than
    // delete-and-add, which would briefly misroute the old proxy's replies.
    let existing = run_in_output(netns, "ip", &["rule", "show", "pref", RULE_PREF]).await?;
    if !existing.contains(&format!("lookup {ROUTE_TABLE}")) {
        let _ = run_in(netns, "ip", &["rule", "del", "pref", RULE_PREF], None).await;
        run_in(netns, "ip", &["rule", "add", "fwmark", &mark, "pref", RULE_PREF, "lookup", ROUTE_TABLE], None).await?;
    }
    run_in(netns, "ip", &["route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", ROUTE_TABLE], None).await
}

pub async fn remove(netns: &InPodNetns) {
    let _ = run_in(netns, "ip", &["rule", "del", "pref", RULE_PREF], None).await;
    let _ = run_in(netns, "ip", &["route", "flush", "table", ROUTE_TABLE], None).await;
}
