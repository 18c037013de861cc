#!/usr/bin/env bash
# All tests: unit tests and end-to-end tests on network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
exec cargo test --workspace
