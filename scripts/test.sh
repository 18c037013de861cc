#!/usr/bin/env bash
# All tests: unit tests and end-to-end tests on network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# A full run builds everything once: incremental compilation would only add work.
export CARGO_INCREMENTAL=0
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
# Docs: relative links (and #anchors) resolve, nothing cites files outside the project,
# every cited test exists; the self-test shows a missing cited test is caught.
stage "docs links" bash -c "python3 scripts/check-docs.py --self-test && python3 scripts/check-docs.py"
# Build in two steps so the end-to-end suites (mostly waiting on the network and timers:
# ~40% of 2 cores) start as soon as what they run exists, while the compiler builds the
# rest. First the binaries under test (the `cli` tests make cargo build them) and the
# e2e and soak test binaries; their paths come from cargo's JSON messages.
# Beside it, the Go program the istio:: suite runs (Istio's own discovery server on
# Istio's Go module, tests/istio; its first build fetches and compiles Istio's
# dependencies, minutes; later ones come from Go's cache): built here, not by the first
# istio:: test in the middle of the timing-sensitive suites.
exes=$(mktemp)
trap 'rm -f "$exes"' EXIT
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "go not found: install Go 1.26 (the istio:: tests run Istio's discovery server, tests/istio)" >&2; exit 1; }
target_dir=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export ZTUNNEL_TEST_ISTIO_XDS="$target_dir/debug/istio-xds"
stage "build the binaries and the end-to-end tests" together \
  "cargo" "cargo test --workspace --no-run --test e2e --test soak --test cli --message-format=json-render-diagnostics >'$exes'" \
  "Istio's discovery server (tests/istio)" "cd tests/istio && GOFLAGS=-buildvcs=false GOTOOLCHAIN=local go build -o '$ZTUNNEL_TEST_ISTIO_XDS' ./cmd/istio-xds"
exe() {
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[2] and m.get("executable"):
        print(m["executable"])' "$exes" "$1"
}
e2e=$(exe e2e)
soak_exe=$(exe soak)
if [ -z "$e2e" ] || [ -z "$soak_exe" ]; then
  echo "cargo named no e2e or soak test binary: were tests/tests/e2e or soak.rs renamed?" >&2
  exit 1
fi
# Then, side by side: the e2e suites with the eBPF capture (the default); again with the
# nftables fallback for the suites that depend on capture, then the L4 suite on an
# IPv6-only and on a dual-stack topology (eBPF capture: nftables' IPv6 rules are the same
# inet table, and the l4 and dns tests built on dual-stack topologies run with nftables
# here too); the soak (SOAK_SECONDS, 120 s by default, in its own namespaces); the rest
# of the build and then every other test (unit tests, command lines, backpressure, the
# demo, the bench smoke); and the chart checks. The test binaries run directly, not
# through cargo (which would wait for the build directory the compiler holds), with the
# binaries under test from target/debug; each topology's names carry its process id, so
# the runs do not meet. Fuzzing: the unit tests replay every committed corpus and
# regression input through the fuzz targets' entry points (`ztunnel::fuzzing`,
# `waypoint::fuzzing`); coverage-guided runs are `bash scripts/fuzz.sh [SECONDS]`.
soak=soak_mixed_traffic_under_control_plane_churn
# Every integration test target but those two (`--test cli --test limits ...`).
rest=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json,sys
names = {t["name"] for p in json.load(sys.stdin)["packages"] for t in p["targets"] if "test" in t["kind"]}
print(" ".join("--test " + n for n in sorted(names - {"e2e", "soak"})))')
stage "tests" together \
  "end-to-end tests (eBPF capture)" "cd tests && '$e2e'" \
  "end-to-end tests (nftables capture; L4 on IPv6 and dual-stack)" "cd tests && ZTUNNEL_TEST_CAPTURE=nftables '$e2e' l4:: enrollment:: dns:: && ZTUNNEL_TEST_IP_FAMILY=v6 '$e2e' l4:: && ZTUNNEL_TEST_IP_FAMILY=dual '$e2e' l4::" \
  "soak" "cd tests && '$soak_exe' --exact $soak" \
  "unit tests, command lines, backpressure, demo, bench smoke" "cargo test --workspace --no-run && cargo test --workspace --lib --bins $rest" \
  "charts, Dockerfiles, shell scripts" "bash scripts/check-charts.sh"
echo "== all tests passed in $((SECONDS - start))s:"
printf '%s\n' "${timings[@]}"
