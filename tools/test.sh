#!/usr/bin/env bash
# Runs the test suite against both LibTorch builds: PyTorch's wheel (2.x with CUDA + NCCL
# compiled in; the tests run on the CPU) and Debian 12's libtorch-dev 1.13. For each: set up
# (install, corpus, build: tools/setup.sh), then the tests through ctest. Exits non-zero if any
# test fails; the last line sums both.
#
#   tools/test.sh                 what CI runs (.ci/run): every test against the wheel, and against
#                                 Debian's 1.13 every test but the long ones (debian:short)
#   tools/test.sh wheel debian    every test against both (before landing a change to the LibTorch
#                                 compatibility layer, core/util/torch_compat.h)
#   tools/test.sh BUILD[:short]   one build: wheel, debian, or a LibTorch folder (WEFT_LIBTORCH in
#                                 setup.sh); :short leaves out the tests tests/long_tests.txt names
set -euo pipefail
cd "$(dirname "$0")/.."

builds=("$@")
[[ ${#builds[@]} -gt 0 ]] || builds=(wheel debian:short)
source tools/build_env.sh  # WEFT_JOBS (before OMP_NUM_THREADS, which nproc would answer)
export OMP_NUM_THREADS=1

build_dir_of() { (export WEFT_LIBTORCH=$1; unset WEFT_BUILD_DIR; source tools/build_env.sh; echo "$WEFT_BUILD_DIR"); }

passed=0 failed=0 status=0 summary=()
# tests/long_tests.txt as one ctest regex (exact names), after checking each is a registered test.
long_tests_regex() {
  local dir=$1 names name registered
  names=$(grep -v -e '^#' -e '^[[:space:]]*$' tests/long_tests.txt)
  registered=$(ctest --test-dir "$dir" -N | sed -n 's/^ *Test *#[0-9]*: //p')
  for name in $names; do
    grep -qxF "$name" <<<"$registered" || { echo "test: tests/long_tests.txt names $name, which is no test of $dir" >&2; return 1; }
  done
  echo "^($(tr '\n' '|' <<<"$names" | sed 's/[.]/\\./g; s/|$//'))\$"
}

for spec in "${builds[@]}"; do
  build=${spec%:short}
  ctest_args=()
  dir=$(build_dir_of "$build")
  rm -f "$dir/ctest.log"
  # (set -e does not apply inside a subshell tested by ||: the steps are chained with &&.)
  (
    export WEFT_LIBTORCH=$build WEFT_BUILD_DIR=$dir &&
    tools/setup.sh &&
    if [[ $spec == *:short ]]; then exclude=$(long_tests_regex "$dir") && ctest_args=(-E "$exclude"); fi &&
    ctest --test-dir "$dir" --output-on-failure -j "$WEFT_JOBS" --timeout 600 "${ctest_args[@]}" 2>&1 | tee "$dir/ctest.log"
  ) && rc=0 || rc=$?
  export WEFT_SKIP_APT=1  # the packages are in after the first build's set-up
  line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$dir/ctest.log" 2>/dev/null | tail -1 || true)
  if [[ -n "$line" ]]; then
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    bad=$(sed -E 's/.* ([0-9]+) tests failed.*/\1/' <<<"$line")
    passed=$((passed + total - bad)) failed=$((failed + bad))
    summary+=("$spec: $((total - bad)) passed, $bad failed")
  else
    summary+=("$spec: no test ran (set-up or build failed, exit $rc)")
  fi
  [[ $rc == 0 ]] || status=1
done
printf 'test: %s\n' "${summary[@]}"
echo "test: $passed passed, $failed failed"
exit $status
