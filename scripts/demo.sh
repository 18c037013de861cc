#!/usr/bin/env bash
# The local demo: pods on two simulated nodes talking through two ztunnels over HBONE.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# --workspace: the same build the tests use (the demo builds the binaries it runs).
exec cargo test --workspace --test demo
