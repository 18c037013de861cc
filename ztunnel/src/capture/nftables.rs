//! nftables capture inside a pod netns (what istio-cni sets up in in-pod mode):
//! - outbound TCP from the pod's processes is REDIRECTed to 15001;
//! - inbound TCP from the network goes to 15006 unless it is HBONE to 15008;
//! - only a connection's first SYN is redirected: conntrack picks up connections that
//!   were open before the rules arrived mid-stream, and those must stay as they are;
//! - DNS from the pod's processes (UDP and TCP port 53) is REDIRECTed to the DNS proxy on
//!   15053 when DNS capture is on (conntrack makes the answers come from the server
//!   asked); IPv6 DNS only for a pod with IPv6 capture (else nothing listens on `[::1]`);
//! - the table is `inet`, so every rule without an address holds for IPv6 as for IPv4
//!   (REDIRECT goes to `::1` for outbound, to the pod's address for inbound). A pod
//!   without IPv6 capture has no IPv6 listeners: its IPv6 TCP is redirected to nothing
//!   and reset (fail closed);
//! - the proxy's own sockets (mark 1337) and loopback are never captured;
//! - replies from the app to a transparent (spoofed-source) proxy socket are routed back
//!   locally: the proxy's deliveries (mark 0x111) get ct mark 0x111, their reply packets
//!   get fwmark 0x111, and the local-route rule (see `local_route`) sends them to lo.

use super::command::run_in;
use super::error::CaptureError;
use super::local_route;
use crate::marks::{DELIVERY_MARK, PROXY_MARK};
use crate::netns::InPodNetns;
use crate::ports;

/// kubelet health probes arrive from this address in Istio's ambient mode; never capture them.
pub const PROBE_SOURCE: &str = "169.254.7.127";
/// istio-cni's IPv6 probe source (its HOST_PROBE_SNAT_IPV6 default).
pub const PROBE_SOURCE_V6: &str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff";

const TABLE: &str = "ztunnel-capture";

fn ruleset(exempt_inbound_ports: &[u16], capture_dns: bool, ipv6: bool) -> String {
    let exempt = if exempt_inbound_ports.is_empty() {
        String::new()
    } else {
        let ports: Vec<String> = exempt_inbound_ports.iter().map(u16::to_string).collect();
        format!(
            "meta l4proto tcp tcp dport {{ {} }} return",
            ports.join(", ")
        )
    };
    let dns = match (capture_dns, ipv6) {
        (false, _) => String::new(),
        (true, false) => format!(
            "meta nfproto ipv4 udp dport 53 redirect to :{port}\n    meta nfproto ipv4 tcp dport 53 tcp flags & (syn | ack) == syn redirect to :{port}",
            port = ports::DNS
        ),
        (true, true) => {
            format!("udp dport 53 redirect to :{port}\n    tcp dport 53 tcp flags & (syn | ack) == syn redirect to :{port}", port = ports::DNS)
        }
    };
    format!(
        r#"table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    iifname "lo" return
    meta l4proto tcp tcp dport {hbone} return
    ip saddr {PROBE_SOURCE} return
    ip6 saddr {PROBE_SOURCE_V6} return
    {exempt}
    tcp flags & (syn | ack) == syn redirect to :{inbound}
  }}
  chain output {{
    type nat hook output priority -100; policy accept;
    meta mark {{ {mark}, {delivery} }} return
    oifname "lo" return
    {dns}
    tcp flags & (syn | ack) == syn redirect to :{outbound}
  }}
  chain output_route {{
    type route hook output priority -150; policy accept;
    meta mark {delivery} ct mark set {delivery} return
    ct mark {delivery} meta mark set {delivery}
  }}
}}
"#,
        hbone = ports::HBONE,
        inbound = ports::INBOUND_PLAINTEXT,
        outbound = ports::OUTBOUND,
        mark = PROXY_MARK,
        delivery = DELIVERY_MARK,
    )
}

/// `ipv6`: the pod has IPv6 capture (listeners on its IPv6 address and `[::1]`).
pub async fn install(
    netns: &InPodNetns,
    exempt_inbound_ports: &[u16],
    capture_dns: bool,
    ipv6: bool,
) -> Result<(), CaptureError> {
    local_route::install(netns, ipv6).await?;
    run_in(
        netns,
        "nft",
        &["-f", "-"],
        Some(&ruleset(exempt_inbound_ports, capture_dns, ipv6)),
    )
    .await
}

/// Empties the redirecting chains. The chains themselves stay until `finish_removal`:
/// while a nat chain exists its hook keeps translating connections redirected before,
/// and `output_route` keeps routing established deliveries' replies.
pub async fn stop_steering(netns: &InPodNetns) -> Result<(), CaptureError> {
    let script = format!("flush chain inet {TABLE} prerouting\nflush chain inet {TABLE} output\n");
    run_in(netns, "nft", &["-f", "-"], Some(&script)).await
}

/// `ipv6`: the pod had IPv6 capture (its IPv6 reply route goes too).
pub async fn finish_removal(netns: &InPodNetns, ipv6: bool) -> Result<(), CaptureError> {
    let nft = run_in(netns, "nft", &["delete", "table", "inet", TABLE], None).await;
    local_route::remove(netns, ipv6).await;
    nft
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_rules_only_when_asked() {
        let on = ruleset(&[], true, false);
        assert!(
            on.contains("meta nfproto ipv4 udp dport 53 redirect to :15053"),
            "{on}"
        );
        assert!(
            on.contains(
                "meta nfproto ipv4 tcp dport 53 tcp flags & (syn | ack) == syn redirect to :15053"
            ),
            "{on}"
        );
        // After the proxy's own marks and loopback are let through, before the TCP catch-all.
        let at = |needle: &str| on.find(needle).unwrap();
        assert!(
            at("meta mark") < at("udp dport 53")
                && at("oifname \"lo\" return") < at("udp dport 53")
        );
        assert!(at("tcp dport 53") < at("redirect to :15001"));
        assert!(!ruleset(&[], false, false).contains("dport 53"));
        assert!(!ruleset(&[], false, true).contains("dport 53"));
    }

    #[test]
    fn ipv6_dns_and_probes() {
        // With IPv6 capture, DNS of both families goes to the proxy (`[::1]:15053` for IPv6).
        let on = ruleset(&[], true, true);
        assert!(on.contains("\n    udp dport 53 redirect to :15053"), "{on}");
        assert!(
            on.contains("\n    tcp dport 53 tcp flags & (syn | ack) == syn redirect to :15053"),
            "{on}"
        );
        assert!(!on.contains("nfproto"), "{on}");
        // Both families' kubelet probe sources are let through, before the inbound redirect.
        let at = |needle: &str| on.find(needle).unwrap();
        assert!(
            at("ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff return")
                < at("redirect to :15006")
        );
        assert!(at("ip saddr 169.254.7.127 return") < at("redirect to :15006"));
    }
}
