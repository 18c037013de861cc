#!/usr/bin/env bash
# All tests: unit tests and end-to-end tests on network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo test --workspace
# Helm charts (lint, render, offline schema validation), Dockerfiles and shell scripts.
bash scripts/check-charts.sh
# eBPF is the default capture; the end-to-end suites run again with the nftables fallback.
ZTUNNEL_TEST_CAPTURE=nftables cargo test -p ztunnel --test l4 --test enrollment --test dns
# Fuzzing: every cargo-fuzz target for 20 s from its committed corpus, regressions replayed
# (installs cargo-fuzz if missing; `bash scripts/fuzz.sh 600` is the thorough run).
bash scripts/fuzz.sh 20
