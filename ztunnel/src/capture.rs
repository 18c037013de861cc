//! Traffic capture for enrolled pods: eBPF (the default; `ebpf`), nftables REDIRECT inside
//! each pod's netns (the fallback; `nftables`), or none (someone else captures). Both
//! capturing modes share `local_route`, which brings replies to the proxy's
//! transparent deliveries back to it.

use std::net::IpAddr;
use std::sync::Arc;

use crate::config::CaptureMode;
use crate::netns::InPodNetns;
use crate::state::PodIps;

mod command;
pub mod ebpf;
pub mod error;
pub mod local_route;
pub mod nftables;

pub use self::error::CaptureError;
pub use self::nftables::{PROBE_SOURCE, PROBE_SOURCE_V6};

/// Capture settings common to the modes.
#[derive(Clone, Debug, Default)]
pub struct CaptureOptions {
    pub bpf_pin_dir: Option<std::path::PathBuf>,
    pub cgroup: Option<std::path::PathBuf>,
    /// Inbound destination ports never captured (the app answers them directly).
    pub exempt_inbound_ports: Vec<u16>,
    /// Send the pods' DNS (UDP and TCP port 53) to the DNS proxy on 127.0.0.1:15053
    /// (`[::1]:15053` for IPv6).
    pub capture_dns: bool,
}

/// The capture this process performs, decided once at start.
#[derive(Clone)]
pub enum Backend {
    None,
    Nftables {
        exempt_inbound_ports: Vec<u16>,
        capture_dns: bool,
    },
    Ebpf(Arc<ztunnel_ebpf::Capture>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::None => "none",
            Backend::Nftables { .. } => "nftables",
            Backend::Ebpf(_) => "ebpf",
        })
    }
}

impl Backend {
    /// Sets up the requested mode; eBPF that the kernel or build cannot provide falls
    /// back to nftables with a warning saying why.
    pub fn start(mode: CaptureMode, opts: &CaptureOptions) -> Backend {
        let nft = || Backend::Nftables {
            exempt_inbound_ports: opts.exempt_inbound_ports.clone(),
            capture_dns: opts.capture_dns,
        };
        match mode {
            CaptureMode::None => Backend::None,
            CaptureMode::Nftables => nft(),
            CaptureMode::Ebpf => {
                let eopts = ztunnel_ebpf::Options {
                    pin_dir: opts
                        .bpf_pin_dir
                        .clone()
                        .unwrap_or_else(|| ztunnel_ebpf::DEFAULT_PIN_DIR.into()),
                    cgroup: opts.cgroup.clone(),
                    exempt_inbound_ports: opts.exempt_inbound_ports.clone(),
                    capture_dns: opts.capture_dns,
                };
                match ztunnel_ebpf::Capture::load(&eopts) {
                    Ok(c) => Backend::Ebpf(Arc::new(c)),
                    Err(e) => {
                        tracing::warn!(error = %e, "eBPF capture unavailable; falling back to nftables capture");
                        nft()
                    }
                }
            }
        }
    }

    pub fn mode(&self) -> CaptureMode {
        match self {
            Backend::None => CaptureMode::None,
            Backend::Nftables { .. } => CaptureMode::Nftables,
            Backend::Ebpf(_) => CaptureMode::Ebpf,
        }
    }

    /// Starts capturing a pod whose listeners are already accepting: each of its
    /// addresses with its inbound plaintext (15006) listener, of the same family.
    pub async fn install(
        &self,
        netns: &InPodNetns,
        inbound: &[(IpAddr, &tokio::net::TcpListener)],
    ) -> Result<(), CaptureError> {
        let ipv6 = inbound.iter().any(|(ip, _)| ip.is_ipv6());
        match self {
            Backend::None => Ok(()),
            Backend::Nftables {
                exempt_inbound_ports,
                capture_dns,
            } => nftables::install(netns, exempt_inbound_ports, *capture_dns, ipv6).await,
            Backend::Ebpf(c) => ebpf::install(c, netns, inbound).await,
        }
    }

    /// Drops capture state left for pods that are not in `enrolled` (removed while no
    /// ztunnel ran). Only eBPF keeps such state outside the pods' netns.
    pub fn retain(&self, enrolled: &[&InPodNetns]) {
        let Backend::Ebpf(c) = self else { return };
        let mut keep = Vec::new();
        for netns in enrolled {
            match netns.cookie() {
                Ok(cookie) => keep.push(ztunnel_ebpf::NetnsCookie(cookie)),
                // Unknown cookie: removing anything could uncapture that pod; keep all.
                Err(e) => {
                    return tracing::warn!(netns = netns.name(), error = %e, "cannot read a netns cookie; keeping all eBPF pod state")
                }
            }
        }
        match c.retain(&keep) {
            Ok(0) => {}
            Ok(n) => tracing::info!(pods = n, "removed eBPF capture of pods no longer enrolled"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot remove eBPF capture of pods no longer enrolled")
            }
        }
    }

    /// Removal, first half: stops steering new connections to the proxy.
    pub async fn stop_steering(&self, netns: &InPodNetns, ips: PodIps) -> Result<(), CaptureError> {
        match self {
            Backend::None => Ok(()),
            Backend::Nftables { .. } => nftables::stop_steering(netns).await,
            Backend::Ebpf(c) => ebpf::stop_steering(c, netns, ips).await,
        }
    }

    /// Removal, second half, once the pod's connections are done: removes the rest of
    /// what `install` put in the netns (the reply routing they needed).
    pub async fn finish_removal(
        &self,
        netns: &InPodNetns,
        ips: PodIps,
    ) -> Result<(), CaptureError> {
        let ipv6 = ips.v6.is_some();
        match self {
            Backend::None => Ok(()),
            Backend::Nftables { .. } => nftables::finish_removal(netns, ipv6).await,
            Backend::Ebpf(_) => ebpf::finish_removal(netns, ipv6).await,
        }
    }
}
