#!/usr/bin/env bash
# All tests: unit tests and end-to-end tests on network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# A full run builds everything once: incremental compilation would only add work.
export CARGO_INCREMENTAL=0
start=$SECONDS
timings=()
# Temporary files, removed on exit; together()'s logs join them.
exes=$(mktemp)
tmp_files=("$exes")
# Every topology a test builds is recorded here (`prefix dir`, tests/src/netsim.rs): on
# Ctrl-C or a kill, cleanup removes exactly what this run's tests left, never another
# run's namespaces on the same machine.
ZTUNNEL_TEST_PREFIXES=$(mktemp)
export ZTUNNEL_TEST_PREFIXES
# Tests that could not check what they name in this run (another IP family, capture
# mode, no root) append `SKIPPED: <test>: <why>` here; listed at the end, pass or fail.
ZTUNNEL_TEST_SKIPS=$(mktemp)
export ZTUNNEL_TEST_SKIPS
tmp_files+=("$ZTUNNEL_TEST_PREFIXES" "$ZTUNNEL_TEST_SKIPS")
# The processes below this script, deepest first.
descendants() {
  local c
  for c in $(pgrep -P "$1"); do
    descendants "$c"
    echo "$c"
  done
}
# Interrupted: end every process this run started (test binaries, the ztunnels and
# servers they spawned, cargo), then remove what their topologies left: network
# namespaces `<prefix>-*` (and any process still in one), the bpf filesystem with the
# eBPF pins under `<dir>/bpf`, and `<dir>`. (The eBPF programs attach to the root cgroup through links pinned there and
# held by the ztunnels: with both gone, they detach.)
cleanup() {
  set +e
  trap - INT TERM
  echo "== interrupted: stopping this run's processes and removing its namespaces" >&2
  local pids inside p alive prefix dir ns
  mapfile -t pids < <(descendants $$)
  if [ ${#pids[@]} -gt 0 ]; then kill -TERM "${pids[@]}" 2>/dev/null; fi
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  mapfile -t pids < <(descendants $$)
  if [ ${#pids[@]} -gt 0 ]; then kill -KILL "${pids[@]}" 2>/dev/null; fi
  while read -r prefix dir; do
    [ -n "$prefix" ] || continue
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
      case $ns in
        "$prefix"-*)
          # Processes still in it (a ztunnel whose test died is no descendant any more).
          mapfile -t inside < <(ip netns pids "$ns" 2>/dev/null)
          if [ ${#inside[@]} -gt 0 ]; then kill -KILL "${inside[@]}" 2>/dev/null; fi
          ip netns del "$ns" 2>/dev/null
          ;;
      esac
    done
    umount -l "$dir/bpf" 2>/dev/null
    rm -rf "$dir"
  done <"$ZTUNNEL_TEST_PREFIXES"
  exit 130
}
trap cleanup INT TERM
finish() {
  if [ -s "$ZTUNNEL_TEST_SKIPS" ]; then
    echo "== $(wc -l <"$ZTUNNEL_TEST_SKIPS") tests skipped (passed in cargo's count, checked nothing):"
    sort "$ZTUNNEL_TEST_SKIPS"
  fi
  rm -f "${tmp_files[@]}"
}
trap finish EXIT
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
    tmp_files+=("${logs[-1]}")
    bash -c "$2" >"${logs[-1]}" 2>&1 &
    pids+=($!)
    shift 2
  done
  # In the background and waited for, though its output is live: bash runs a trap only
  # once the foreground command ends, and `wait` lets a kill reach cleanup at once.
  bash -c "$first_cmd" &
  wait $! || failed+=("$first")
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
# Formatting: rustfmt's defaults (rustfmt.toml), the workspace and the fuzz crate (its
# own workspace). A second or two.
stage "fmt" bash -c "cargo fmt --all --check && (cd fuzz && cargo fmt --check)"
# Lints: every warning of clippy's default set fails the run (its checks share no
# artifacts with the test build, so this is a check build of its own, a few minutes).
stage "clippy" cargo clippy --workspace --all-targets -- -D warnings
# The allocator build options (ztunnel's `jemalloc` and `mimalloc` features, measured in
# docs/benchmarks.md) build and lint too, each on its own (with both, jemalloc wins).
stage "allocator features" bash -c "cargo clippy -p ztunnel --lib --bins --features jemalloc -- -D warnings && cargo clippy -p ztunnel --lib --bins --features mimalloc -- -D warnings"
# Build in two steps so the end-to-end suites (mostly waiting on the network and timers:
# ~40% of 2 cores) start as soon as what they run exists, while the compiler builds the
# rest. First the binaries under test (the `cli` tests make cargo build them) and the
# e2e and soak test binaries; their paths come from cargo's JSON messages.
# Beside it, the Go programs the istio:: and istiod:: suites run, from Istio's Go module
# pinned in tests/istio: istio-xds (Istio's own discovery server and CA), Istio's
# istioctl and istiod itself, pilot-discovery (the go.mod's `tool` lines), in one `go
# build` (their packages are nearly all shared; the links run side by side). The first
# build fetches and compiles Istio's dependencies, minutes (docs/testing.md has the cold
# times); later ones come from Go's cache. Built here, not by the first test in the
# middle of the timing-sensitive suites.
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "go not found: install Go 1.26 (the istio:: tests run Istio's discovery server, tests/istio)" >&2; exit 1; }
target_dir=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export ZTUNNEL_TEST_ISTIO_XDS="$target_dir/debug/istio-xds"
export ZTUNNEL_TEST_ISTIOCTL="$target_dir/debug/istioctl"
export ZTUNNEL_TEST_PILOT_DISCOVERY="$target_dir/debug/pilot-discovery"
# And after them (one Go build at a time on 2 cores), kube-apiserver, kube-controller-manager
# and etcd for the kube_apiserver:: suite (tests/kube, one program; its own module: its
# Kubernetes versions are not tests/istio's). Cold, it compiles most of Kubernetes: minutes.
export ZTUNNEL_TEST_KUBE_HARNESS="$target_dir/debug/kube-harness"
# helm for the same suite (the charts' dry run, the waypoint's RBAC), where
# check-charts.sh keeps it; installed now if missing, as check-charts.sh does.
CHECK_CHARTS_HELM_ONLY=1 bash scripts/check-charts.sh >/dev/null
stage "build the binaries and the end-to-end tests" together \
  "cargo" "cargo test --workspace --no-run --test e2e --test soak --test cli --message-format=json-render-diagnostics >'$exes'" \
  "Go harnesses: Istio's discovery server and CA, istioctl, istiod (tests/istio), kube-apiserver, kube-controller-manager and etcd (tests/kube)" "export GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
    t=\$SECONDS; mkdir -p '$target_dir/debug'
    (cd tests/istio && go build -o '$target_dir/debug/' ./cmd/istio-xds istio.io/istio/istioctl/cmd/istioctl istio.io/istio/pilot/cmd/pilot-discovery) || exit 1
    echo \"tests/istio built in \$((SECONDS - t))s\"; t=\$SECONDS
    (cd tests/kube && go build -o '$ZTUNNEL_TEST_KUBE_HARNESS' ./cmd/kube-harness) || exit 1
    echo \"tests/kube built in \$((SECONDS - t))s\""
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
  "end-to-end tests (nftables capture; L4 on IPv6 and dual-stack)" "cd tests && rc=0
    ZTUNNEL_TEST_CAPTURE=nftables '$e2e' l4:: enrollment:: dns:: || { echo '== FAILED: nftables capture'; rc=1; }
    ZTUNNEL_TEST_IP_FAMILY=v6 '$e2e' l4:: || { echo '== FAILED: L4 on IPv6'; rc=1; }
    ZTUNNEL_TEST_IP_FAMILY=dual '$e2e' l4:: || { echo '== FAILED: L4 on dual-stack'; rc=1; }
    exit \$rc" \
  "soak" "cd tests && '$soak_exe' --exact $soak" \
  "unit tests, command lines, backpressure, demo, bench smoke" "cargo test --workspace --no-run && cargo test --workspace --no-fail-fast --lib --bins $rest" \
  "charts, Dockerfiles, shell scripts" "bash scripts/check-charts.sh"
echo "== all tests passed in $((SECONDS - start))s:"
printf '%s\n' "${timings[@]}"
