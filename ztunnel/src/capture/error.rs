//! Errors of traffic capture.

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("cannot run {program} in {netns}: {source}; install nftables and iproute2")]
    Spawn {
        program: &'static str,
        netns: String,
        source: std::io::Error,
    },
    #[error("{program} failed in {netns}: {stderr}")]
    Failed {
        program: &'static str,
        netns: String,
        stderr: String,
    },
    #[error("eBPF capture of {netns}: {source}")]
    Ebpf {
        netns: String,
        source: ztunnel_ebpf::EbpfError,
    },
    #[error("{netns}: {what}: {source}")]
    Netns {
        netns: String,
        what: &'static str,
        source: std::io::Error,
    },
}
