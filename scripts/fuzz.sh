#!/usr/bin/env bash
# Fuzzing (cargo-fuzz targets in fuzz/): builds every target once, replays the crash
# inputs kept in fuzz/regressions/<target>/, then runs each target for SECONDS (default
# 10) starting from a temporary copy of its committed corpus fuzz/corpus/<target>/, so
# runs never grow the repository. Exits non-zero on any crash. CI does not run this (the
# instrumented build of every dependency is minutes of a 2-core machine): its unit tests
# replay the committed corpora and regression inputs through the same entry points.
#
#   bash scripts/fuzz.sh          # a smoke run: 10 s per target
#   bash scripts/fuzz.sh 600      # a thorough run: 10 min per target
#   FUZZ_TARGETS="dns_message proxy_protocol" bash scripts/fuzz.sh 60
#   bash scripts/fuzz.sh build    # only build the targets
#
# A crash input lands in fuzz/artifacts/<target>/ (git-ignored): fix the bug, then keep
# the input in fuzz/regressions/<target>/ and as a unit test next to the code.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"
start=$SECONDS

# The build is what `cargo fuzz build -s none` does (same instrumentation flags), done with
# plain cargo so CI need not compile cargo-fuzz itself (minutes on 2 cores). Developers
# can use `cargo fuzz run <target>` in fuzz/ as usual (RUSTC_BOOTSTRAP=1 on stable).
# No sanitizer: the code under test is safe Rust and what we hunt is panics (and hangs,
# and unbounded allocation), which need none; ASan would double the build and halve the
# speed. 16 codegen units keep the build of the ztunnel library short on small machines.
triple=$(rustc -vV | sed -n 's/^host: //p')
sancov=(
  -Cpasses=sancov-module
  -Cllvm-args=-sanitizer-coverage-level=4
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
  -Cllvm-args=-sanitizer-coverage-pc-table
  -Cllvm-args=-sanitizer-coverage-trace-compares
  -Cllvm-args=-sanitizer-coverage-stack-depth
  -Cllvm-args=-simplifycfg-branch-fold-threshold=0
  --cfg fuzzing
  -Ccodegen-units=16
)
cd fuzz
echo "fuzz: building the targets (instrumented, release)"
# --target keeps the instrumentation off build scripts and proc macros.
RUSTFLAGS="${sancov[*]}" cargo build --release --bins --target "$triple"
if [ "$secs" = build ]; then
  echo "fuzz: built in $((SECONDS - start))s"
  exit 0
fi
bindir=target/$triple/release
targets="${FUZZ_TARGETS:-$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^ztunnel-fuzz$')}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Per input: 10 s before it counts as a hang, 2 GiB before it counts as a leak or bomb.
limits=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048)
failed=()
summary=()
for t in $targets; do
  mkdir -p "artifacts/$t"
  if compgen -G "regressions/$t/*" >/dev/null; then
    echo "fuzz: $t: replaying $(find "regressions/$t" -type f | wc -l) regression inputs"
    if ! "$bindir/$t" "${limits[@]}" "regressions/$t"/* >"$work/$t.replay.log" 2>&1; then
      tail -40 "$work/$t.replay.log"
      failed+=("$t (regression)")
      continue
    fi
  fi
  mkdir -p "$work/corpus/$t"
  if [ -d "corpus/$t" ]; then
    cp -r "corpus/$t/." "$work/corpus/$t/"
  fi
  echo "fuzz: $t: running ${secs}s"
  if "$bindir/$t" "${limits[@]}" -max_total_time="$secs" -print_final_stats=1 \
    -artifact_prefix="artifacts/$t/" "$work/corpus/$t" >"$work/$t.log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/$t.log")
    cov=$(grep -o 'cov: [0-9]*' "$work/$t.log" | tail -1)
    summary+=("$t: ${runs:-?} runs, ${rate:-?} exec/s, ${cov:-cov: ?}, corpus $(find "$work/corpus/$t" -type f | wc -l) inputs")
  else
    tail -60 "$work/$t.log"
    failed+=("$t")
  fi
done

echo "fuzz: summary (${secs}s per target, $((SECONDS - start))s in all):"
for s in "${summary[@]}"; do echo "  $s"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: CRASHED: ${failed[*]} (inputs in fuzz/artifacts/<target>/)" >&2
  exit 1
fi
