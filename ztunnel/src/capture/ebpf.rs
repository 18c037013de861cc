//! eBPF capture of one pod (programs and maps: the ztunnel-ebpf crate). Besides the map
//! entries and the pod's sk_lookup link, the pod gets the local-reply route and two
//! sysctls so that everything answering a proxy delivery carries the delivery mark and
//! routes back to the proxy: tcp_fwmark_accept (the app's accepted socket takes the
//! SYN's mark) and fwmark_reflect (a kernel RST for a closed port does too, so the proxy
//! sees "refused" at once instead of timing out).

use std::net::IpAddr;
use std::os::fd::AsFd;

use super::error::CaptureError;
use super::local_route;
use crate::netns::InPodNetns;
use crate::state::PodIps;

/// Sets tcp_fwmark_accept (one switch for both families) and fwmark_reflect (one per family).
fn sysctl(netns: &InPodNetns, value: &str, ipv6: bool) -> Result<(), CaptureError> {
    let what = "setting net.ipv4.tcp_fwmark_accept and net.ipv{4,6}.fwmark_reflect";
    let err = |source| CaptureError::Netns {
        netns: netns.name().to_string(),
        what,
        source,
    };
    let r = netns
        .run(|| {
            std::fs::write("/proc/sys/net/ipv4/tcp_fwmark_accept", value)?;
            std::fs::write("/proc/sys/net/ipv4/fwmark_reflect", value)?;
            if ipv6 {
                std::fs::write("/proc/sys/net/ipv6/fwmark_reflect", value)?;
            }
            Ok(())
        })
        .map_err(|e| err(std::io::Error::other(e.to_string())))?;
    r.map_err(err)
}

fn cookie(netns: &InPodNetns) -> Result<ztunnel_ebpf::NetnsCookie, CaptureError> {
    netns
        .cookie()
        .map(ztunnel_ebpf::NetnsCookie)
        .map_err(|e| CaptureError::Netns {
            netns: netns.name().to_string(),
            what: "reading the netns cookie",
            source: std::io::Error::other(e.to_string()),
        })
}

pub async fn install(
    capture: &ztunnel_ebpf::Capture,
    netns: &InPodNetns,
    inbound: &[(IpAddr, &tokio::net::TcpListener)],
) -> Result<(), CaptureError> {
    let cookie = cookie(netns)?;
    let ipv6 = inbound.iter().any(|(ip, _)| ip.is_ipv6());
    local_route::install(netns, ipv6).await?;
    sysctl(netns, "1", ipv6)?;
    let pod = ztunnel_ebpf::PodCapture {
        netns: netns.fd(),
        cookie,
        addresses: inbound.iter().map(|(ip, l)| (*ip, l.as_fd())).collect(),
    };
    capture.enroll(&pod).map_err(|source| CaptureError::Ebpf {
        netns: netns.name().to_string(),
        source,
    })
}

pub async fn stop_steering(
    capture: &ztunnel_ebpf::Capture,
    netns: &InPodNetns,
    ips: PodIps,
) -> Result<(), CaptureError> {
    let cookie = cookie(netns)?;
    capture
        .remove(cookie, &ips.iter().collect::<Vec<_>>())
        .map_err(|source| CaptureError::Ebpf {
            netns: netns.name().to_string(),
            source,
        })
}

/// `ipv6`: the pod had IPv6 capture (what `install` set up for IPv6 goes too).
pub async fn finish_removal(netns: &InPodNetns, ipv6: bool) -> Result<(), CaptureError> {
    local_route::remove(netns, ipv6).await;
    sysctl(netns, "0", ipv6)
}
