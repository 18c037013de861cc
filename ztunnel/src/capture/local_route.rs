//! Replies to the proxy's transparent deliveries. The proxy connects to the app from the
//! real client's address (IP_TRANSPARENT) with mark 0x111; the app's replies to that
//! address must come back to the proxy over lo rather than leave by the pod's default
//! route. Packets marked 0x111 (nftables: restored from the conntrack mark; eBPF: the
//! app's accepted socket takes the SYN's mark through tcp_fwmark_accept) are sent by an
//! ip rule to a table whose only route is local (one of each per IP family).

use super::command::{run_in, run_in_output};
use super::error::CaptureError;
use crate::marks::DELIVERY_MARK;
use crate::netns::InPodNetns;

pub const ROUTE_TABLE: &str = "133";
const RULE_PREF: &str = "32764";

/// Installs the rule and route for IPv4, and for IPv6 too when `ipv6` (a pod with IPv6
/// capture: Istio's in-pod rules do the same for `::/0`).
pub async fn install(netns: &InPodNetns, ipv6: bool) -> Result<(), CaptureError> {
    install_family(netns, "-4", "0.0.0.0/0").await?;
    if ipv6 {
        install_family(netns, "-6", "::/0").await?;
    }
    Ok(())
}

async fn install_family(netns: &InPodNetns, family: &str, all: &str) -> Result<(), CaptureError> {
    let mark = format!("{DELIVERY_MARK:#x}/0xfff");
    // A proxy taking over from another finds the rule in place: keep it rather than
    // delete-and-add, which would briefly misroute the old proxy's replies.
    let existing = run_in_output(netns, "ip", &[family, "rule", "show", "pref", RULE_PREF]).await?;
    if !existing.contains(&format!("lookup {ROUTE_TABLE}")) {
        let _ = run_in(
            netns,
            "ip",
            &[family, "rule", "del", "pref", RULE_PREF],
            None,
        )
        .await;
        run_in(
            netns,
            "ip",
            &[
                family,
                "rule",
                "add",
                "fwmark",
                &mark,
                "pref",
                RULE_PREF,
                "lookup",
                ROUTE_TABLE,
            ],
            None,
        )
        .await?;
    }
    run_in(
        netns,
        "ip",
        &[
            family,
            "route",
            "replace",
            "local",
            all,
            "dev",
            "lo",
            "table",
            ROUTE_TABLE,
        ],
        None,
    )
    .await
}

/// Removes what `install` added, IPv6 too when `ipv6`.
pub async fn remove(netns: &InPodNetns, ipv6: bool) {
    for family in ["-4", "-6"].into_iter().take(if ipv6 { 2 } else { 1 }) {
        let _ = run_in(
            netns,
            "ip",
            &[family, "rule", "del", "pref", RULE_PREF],
            None,
        )
        .await;
        let _ = run_in(
            netns,
            "ip",
            &[family, "route", "flush", "table", ROUTE_TABLE],
            None,
        )
        .await;
    }
}
