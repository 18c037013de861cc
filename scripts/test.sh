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
# Includes the backpressure test (~30 s, alone in its test binary, so nothing else runs
# beside it).
# The module map: no module uses its ancestor's items and no import cycles (see
# docs/design.md); prints what breaks the rule.
stage "module map" python3 scripts/module-map.py ztunnel/src waypoint/src
# Docs: relative links resolve, nothing cites files outside the project.
stage "docs links" python3 scripts/check-docs.py
stage "build the tests" cargo test --workspace --no-run
# The soak is left out here and runs beside the nftables suites below.
soak=soak_mixed_traffic_under_control_plane_churn
stage "unit and end-to-end tests (eBPF capture)" cargo test --workspace -- --skip "$soak"
# Helm charts (lint, render, offline schema validation), Dockerfiles and shell scripts.
stage "charts, Dockerfiles, shell scripts" bash scripts/check-charts.sh
# eBPF is the default capture; the end-to-end suites run again with the nftables fallback,
# then the L4 suite a third time on an IPv6-only topology and a fourth on a dual-stack one
# (eBPF capture; the nftables IPv6 rules are the same inet table, and l4's dual-stack
# tests run with both captures above).
# --workspace (not -p ztunnel) keeps the same feature set as above: no second build.
# The soak (SOAK_SECONDS, 120 s by default, mostly waiting on timers and the network)
# runs at the same time in its own namespaces, which saves a minute of CI; its output is
# printed when both are done.
soak_and_nftables() {
  local log rc=0 soak_rc=0
  log=$(mktemp)
  cargo test --workspace --test soak -- --exact "$soak" >"$log" 2>&1 &
  local pid=$!
  ZTUNNEL_TEST_CAPTURE=nftables cargo test --workspace --test l4 --test enrollment --test dns || rc=$?
  ZTUNNEL_TEST_IP_FAMILY=v6 cargo test --workspace --test l4 || rc=$?
  ZTUNNEL_TEST_IP_FAMILY=dual cargo test --workspace --test l4 || rc=$?
  wait "$pid" || soak_rc=$?
  echo "== soak output"
  cat "$log"
  rm -f "$log"
  [ "$soak_rc" -eq 0 ] || echo "== the soak FAILED (exit $soak_rc)"
  [ "$rc" -eq 0 ] && [ "$soak_rc" -eq 0 ]
}
stage "end-to-end tests (nftables capture; L4 on IPv6 and dual-stack) beside the soak" soak_and_nftables
# Fuzzing: every cargo-fuzz target for 10 s from its committed corpus, regressions replayed
# (`bash scripts/fuzz.sh 600` is the thorough run).
stage "fuzz smoke" bash scripts/fuzz.sh 10
echo "== all tests passed in $((SECONDS - start))s:"
printf '%s\n' "${timings[@]}"
