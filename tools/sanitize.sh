#!/usr/bin/env bash
# The suite under AddressSanitizer + UndefinedBehaviorSanitizer: builds the host, the plugins, the
# SDK and the tests with GCC's -fsanitize=address,undefined (-DWEFT_SANITIZE=ON, RelWithDebInfo)
# against the wheel's LibTorch, CPU only (WEFT_CUDA=OFF: nothing here runs CUDA), into
# build-asan/, then runs every test through ctest. Any report of either sanitizer ends its process
# with an error and fails the test; LeakSanitizer checks every process at exit, except for the
# leaks tools/sanitize.supp suppresses in libraries weft does not build. Meant to run before landing
# a change to memory handling, outside CI (a third build, and the suite slowed by the sanitizers).
# Status: first whole run 2026-11-26 (2-core AMD EPYC, 27 min of suite): 386 of 467 passed at
# d437b6c, the other 81 failed on one heap-use-after-free (the host's DLPack views of temporary
# tensors), fixed in c872046, after which they passed (tools/sanitize.sh --rerun-failed). The whole
# suite at f31d3e8: 484 of 484 passed (the CUDA kernels' test skipped without a GPU), no report,
# 2809 s of suite under load.
#
#   tools/sanitize.sh               build, then every test
#   tools/sanitize.sh -R Safetensors  ctest's arguments select tests
set -euo pipefail
cd "$(dirname "$0")/.."
export WEFT_LIBTORCH=wheel WEFT_BUILD_DIR=${WEFT_BUILD_DIR:-build-asan}
export WEFT_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_SANITIZE=ON -DWEFT_CUDA=OFF"
tools/setup.sh
source tools/build_env.sh  # WEFT_JOBS

# verify_asan_link_order=0: the crash tests LD_PRELOAD a fault injector that is not instrumented.
# detect_odr_violation=0: the SDK's static library is linked into the host and into each plugin
# (each its own copy, by design: plugins see only the SDK).
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:verify_asan_link_order=0:detect_odr_violation=0:strict_string_checks=1
export LSAN_OPTIONS=suppressions=$PWD/tools/sanitize.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=1
ctest --test-dir "$WEFT_BUILD_DIR" --output-on-failure -j "$WEFT_JOBS" --timeout 2400 "$@" 2>&1 | tee "$WEFT_BUILD_DIR/ctest.log"
