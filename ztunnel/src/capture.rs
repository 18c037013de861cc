//! Traffic capture for enrolled pods. nftables REDIRECT inside each pod's netns is the
//! fallback mode (and the only one until eBPF lands).

pub mod nftables;

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("cannot run {program} in {netns}: {source}; install nftables and iproute2")]
    Spawn { program: &'static str, netns: String, source: std::io::Error },
    #[error("{program} failed in {netns}: {stderr}")]
    Failed { program: &'static str, netns: String, stderr: String },
}
