#!/usr/bin/env bash
# The local demo: pods on two simulated nodes talking through two ztunnels over HBONE.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build -p waypoint
exec cargo test -p ztunnel --test demo
