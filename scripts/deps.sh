#!/usr/bin/env bash
# Installs the system packages the demo and the tests need (Debian/Ubuntu, as root).
set -euo pipefail
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v tcpdump >/dev/null || need+=(tcpdump)
command -v ss >/dev/null || need+=(iproute2)
command -v cc >/dev/null || need+=(gcc)
# eBPF capture: clang -target bpf, libbpf's headers (bpf/bpf_helpers.h).
command -v clang >/dev/null || need+=(clang llvm)
[ -e /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
# Real peers for the waypoint's end-to-end tests.
command -v curl >/dev/null || need+=(curl)
command -v nginx >/dev/null || need+=(nginx)
command -v h2load >/dev/null || need+=(nghttp2-client)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run as root: the demo and tests create network namespaces" >&2; exit 1; }
