#!/usr/bin/env bash
# All tests: unit tests and end-to-end tests on network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
start=$SECONDS
timings=()
# Runs one stage and records how long it took (printed at the end: CI time is budgeted).
stage() {
  local name=$1 t=$SECONDS
  shift
  echo "== $name"
  "$@"
  timings+=("$(printf '%5ds  %s' $((SECONDS - t)) "$name")")
}
# Runs `name command` pairs (each command one string, run by bash) at the same time: the
# first in the foreground, its output live, the others each into a log printed when all
# are done; fails if any failed. For work that mostly waits (end-to-end suites: network
# and timers) beside work that needs the CPU (builds, fuzzers): on 2 cores that saves
# minutes.
together() {
  local first=$1 first_cmd=$2 names=() pids=() logs=() failed=() i
  shift 2
  while [ $# -gt 0 ]; do
    names+=("$1")
    logs+=("$(mktemp)")
    bash -c "$2" >"${logs[-1]}" 2>&1 &
    pids+=($!)
    shift 2
  done
  bash -c "$first_cmd" || failed+=("$first")
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed+=("${names[$i]}")
  done
  for i in "${!names[@]}"; do
    echo "== ${names[$i]}: output"
    cat "${logs[$i]}"
    rm -f "${logs[$i]}"
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "== FAILED: ${failed[*]}"
    return 1
  fi
}
# The module map: no module uses its ancestor's items and no import cycles (see
# ARCHITECTURE.md); prints what breaks the rule.
stage "module map" python3 scripts/module-map.py ztunnel/src waypoint/src
# Docs: relative links resolve, nothing cites files outside the project.
stage "docs links" python3 scripts/check-docs.py
stage "build the tests" cargo test --workspace --no-run
# Everything but the soak (run below), with the eBPF capture (the default). The
# backpressure test is alone in its test binary, so nothing else runs beside it. The fuzz
# targets' instrumented build (fuzz/target) runs meanwhile. (Measured: starting the fuzz
# build in the background with the test build, niced, made the whole run slower: on 2
# cores the builds only split the CPU, and with autogroup scheduling `nice` across
# sessions does nothing.)
soak=soak_mixed_traffic_under_control_plane_churn
stage "unit and end-to-end tests (eBPF capture), fuzz build" together \
  "unit and end-to-end tests (eBPF capture)" "cargo test --workspace -- --skip $soak" \
  "fuzz build" "bash scripts/fuzz.sh build"
# Helm charts (lint, render, offline schema validation), Dockerfiles and shell scripts.
stage "charts, Dockerfiles, shell scripts" bash scripts/check-charts.sh
# The end-to-end suites that depend on capture again with the nftables fallback, then the
# L4 suite a third time on an IPv6-only topology and a fourth on a dual-stack one (eBPF
# capture: nftables' IPv6 rules are the same inet table, and the l4 and dns tests built
# on dual-stack topologies run with nftables here too), beside the soak (SOAK_SECONDS, 120
# s by default, mostly waiting on timers and the network, in its own namespaces) and the
# fuzz smoke: every cargo-fuzz target for 10 s from its committed corpus, regressions
# replayed (`bash scripts/fuzz.sh 600` is the thorough run). --workspace keeps the
# feature set of the build above: nothing is built again.
stage "end-to-end tests (nftables capture; L4 on IPv6 and dual-stack), soak, fuzz smoke" together \
  "end-to-end tests (nftables capture; L4 on IPv6 and dual-stack)" "ZTUNNEL_TEST_CAPTURE=nftables cargo test --workspace --test e2e -- l4:: enrollment:: dns:: && ZTUNNEL_TEST_IP_FAMILY=v6 cargo test --workspace --test e2e -- l4:: && ZTUNNEL_TEST_IP_FAMILY=dual cargo test --workspace --test e2e -- l4::" \
  "soak" "cargo test --workspace --test soak -- --exact $soak" \
  "fuzz smoke" "bash scripts/fuzz.sh 10"
echo "== all tests passed in $((SECONDS - start))s:"
printf '%s\n' "${timings[@]}"
