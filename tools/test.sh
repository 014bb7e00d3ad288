#!/usr/bin/env bash
# Runs the test suite: set up and build (tools/setup.sh: packages, the Python environment with
# PyTorch's wheel, the corpus, the build against the LibTorch WEFT_LIBTORCH names, by default the
# wheel), then every test through ctest, then the 15 slowest tests with their times. Exits
# non-zero if the set-up, the build or any test fails; the last line counts the tests.
#
#   tools/test.sh                 what CI runs (.ci/run): every test
#   tools/test.sh -R Conformance  ctest's arguments select tests (the set-up and build still run)
#
# With WEFT_PHASE_LOG=FILE each phase appends "NAME SECONDS" to FILE (.ci/run's phase table).
# The budget (docs/testing.md): the whole .ci/run within 45 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."

source tools/build_env.sh  # WEFT_JOBS (before OMP_NUM_THREADS, which nproc would answer)
export OMP_NUM_THREADS=1
dir=$WEFT_BUILD_DIR
log="$dir/ctest.log"

status=0
tools/setup.sh || { echo "test: set-up or build failed" >&2; echo "test: 0 passed, 0 failed"; exit 1; }

# Scratch files: every test's go under one folder of this run (TMPDIR), removed when every test
# passed and kept, with its path printed, when one failed. Each GoogleTest process also removes its
# own folder in it as soon as its tests pass (tests/common/gtest_main.cpp).
scratch=$(mktemp -d "${TMPDIR:-/tmp}/weft-tests.XXXXXX")
free_gib() { df -P -k "$1" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }
echo "test: scratch files in $scratch ($(free_gib "$scratch") GiB free there, $(free_gib "$dir") GiB on the build's disk)"
# The tests write up to ~1.6 GiB at once (measured, docs/testing.md); with less than 2 GiB free
# they would fail by the dozen with "No space left on device", so they do not start.
need_gib=${WEFT_TEST_DISK_GIB:-2}  # the check: WEFT_TEST_DISK_GIB=0 turns it off
for where in "$scratch" "$dir"; do
  if awk -v free="$(free_gib "$where")" -v need="$need_gib" 'BEGIN { exit !(free < need) }'; then
    echo "test: only $(free_gib "$where") GiB free on the disk of $where; the tests need $need_gib GiB there: free some space (or point TMPDIR at another disk)" >&2
    rm -rf "$scratch"
    echo "test: 0 passed, 0 failed"
    exit 1
  fi
done

rm -f "$log"
started=$(date +%s)
TMPDIR=$scratch ctest --test-dir "$dir" --output-on-failure -j "$WEFT_JOBS" --timeout 600 "$@" 2>&1 | tee "$log" || status=$?
seconds=$(( $(date +%s) - started ))
if [[ $status == 0 ]]; then
  rm -rf "$scratch"
else
  echo "test: the scratch files of this run are kept in $scratch ($(du -sh "$scratch" | cut -f1))"
fi
[[ -n "${WEFT_PHASE_LOG:-}" ]] && echo "tests $seconds" >> "$WEFT_PHASE_LOG"

# ctest's lines "  12/640 Test #301: NAME ......   Passed   41.20 sec": the slowest 15. (No `head`
# in the pipe: under pipefail the writer it cuts off fails the script with SIGPIPE.)
echo "test: the 15 slowest tests (of ${seconds} s of ctest on $WEFT_JOBS parallel jobs)"
sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) [ .*]*(Passed|\*\*\*Failed|\*\*\*Timeout|Failed).* ([0-9.]+) sec$/\3 \1 \2/p' "$log" |
  sort -rn | awk 'NR <= 15 { printf "test: %8.1f s  %s%s\n", $1, $2, ($3 == "Passed" ? "" : "  (" $3 ")") }'

line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$log" | tail -1 || true)
if [[ -n "$line" ]]; then
  total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
  bad=$(sed -E 's/.* ([0-9]+) tests failed.*/\1/' <<<"$line")
  echo "test: $((total - bad)) passed, $bad failed"
else
  echo "test: no test ran (ctest exit $status)"
  status=1
fi
exit $status
