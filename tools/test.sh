#!/usr/bin/env bash
# Runs the whole test suite: set up (install, corpus, build), then every GoogleTest through ctest.
# Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
export OMP_NUM_THREADS=1
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
