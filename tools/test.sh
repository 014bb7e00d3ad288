#!/usr/bin/env bash
# Runs the whole test suite against both LibTorch builds: PyTorch's wheel (2.x with CUDA + NCCL
# compiled in; the tests run on the CPU) and Debian 12's libtorch-dev 1.13. For each: set up
# (install, corpus, build: tools/setup.sh), then every test through ctest. Exits non-zero if any
# test of either fails; the last line sums both.
#
#   tools/test.sh                 both builds (what CI runs)
#   tools/test.sh wheel|debian    one of them (or a LibTorch folder, as WEFT_LIBTORCH in setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

builds=("$@")
[[ ${#builds[@]} -gt 0 ]] || builds=(wheel debian)
export OMP_NUM_THREADS=1

build_dir_of() { (export WEFT_LIBTORCH=$1; unset WEFT_BUILD_DIR; source tools/build_env.sh; echo "$WEFT_BUILD_DIR"); }

passed=0 failed=0 status=0 summary=()
for build in "${builds[@]}"; do
  dir=$(build_dir_of "$build")
  rm -f "$dir/ctest.log"
  # (set -e does not apply inside a subshell tested by ||: the steps are chained with &&.)
  (
    export WEFT_LIBTORCH=$build WEFT_BUILD_DIR=$dir &&
    tools/setup.sh &&
    ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" --timeout 600 2>&1 | tee "$dir/ctest.log"
  ) && rc=0 || rc=$?
  export WEFT_SKIP_APT=1  # the packages are in after the first build's set-up
  line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$dir/ctest.log" 2>/dev/null | tail -1 || true)
  if [[ -n "$line" ]]; then
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    bad=$(sed -E 's/.* ([0-9]+) tests failed.*/\1/' <<<"$line")
    passed=$((passed + total - bad)) failed=$((failed + bad))
    summary+=("$build: $((total - bad)) passed, $bad failed")
  else
    summary+=("$build: no test ran (set-up or build failed, exit $rc)")
  fi
  [[ $rc == 0 ]] || status=1
done
printf 'test: %s\n' "${summary[@]}"
echo "test: $passed passed, $failed failed"
exit $status
