#!/usr/bin/env bash
# Installs the system packages the demo and the tests need (Debian/Ubuntu, as root).
set -euo pipefail
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v tcpdump >/dev/null || need+=(tcpdump)
command -v ss >/dev/null || need+=(iproute2)
command -v cc >/dev/null || need+=(gcc)
# Faster linking of the test binaries (scripts/link-gcc).
command -v mold >/dev/null || need+=(mold)
# eBPF capture: clang -target bpf, libbpf's headers (bpf/bpf_helpers.h).
command -v clang >/dev/null || need+=(clang llvm)
[ -e /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
# Real peers for the waypoint's end-to-end tests.
command -v curl >/dev/null || need+=(curl)
command -v nginx >/dev/null || need+=(nginx)
command -v h2load >/dev/null || need+=(nghttp2-client)
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
# Python WebSocket peers (tests/ws_peers.py); Debian's own python3 is externally managed.
py_pkgs=(websockets==17.4 h2==4.4.1 hypercorn==0.18.0)
if ! python3 -c "import websockets, h2, hypercorn" 2>/dev/null; then
  python3 -m pip install -q "${py_pkgs[@]}" 2>/dev/null || python3 -m pip install -q --break-system-packages "${py_pkgs[@]}"
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
# The toolchain rust-toolchain.toml pins. When rustup lacks it but its stable is that very
# release (a machine set up with stable only), stable's is used under the pinned name
# without a download; otherwise rustup installs it.
pin=$(sed -n 's/^channel = "\(.*\)"$/\1/p' "$(dirname "$0")/../rust-toolchain.toml")
host=$(cd / && rustc -vV | sed -n 's/^host: //p')
toolchains="$(cd / && rustup show home)/toolchains"
if [ ! -e "$toolchains/$pin-$host" ]; then
  if (cd / && rustup run stable rustc --version 2>/dev/null) | grep -q "^rustc $pin "; then
    ln -s "$toolchains/stable-$host" "$toolchains/$pin-$host"
  else
    (cd / && rustup toolchain install "$pin" --profile minimal -c clippy,rustfmt)
  fi
fi
[ "$(id -u)" = 0 ] || { echo "run as root: the demo and tests create network namespaces" >&2; exit 1; }
