#!/usr/bin/env bash
# cmake/libtorch.cmake's floor: a LibTorch older than 2.5 is refused at configure time, in one
# message naming the version found and the one needed, before its TorchConfig.cmake runs; 2.5
# itself passes the check (and reaches TorchConfig.cmake). Each fake LibTorch is a prefix holding
# only share/cmake/Torch/TorchConfigVersion.cmake and a TorchConfig.cmake that stops the configure.
#   usage: libtorch_floor.sh SOURCE_DIR WORK_DIR
set -uo pipefail
src=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }
configure() {  # VERSION -> the configure's output in $work/VERSION.log; its exit status
  local version=$1 prefix=$work/torch-$1
  mkdir -p "$prefix/share/cmake/Torch"
  echo "set(PACKAGE_VERSION \"$version\")" > "$prefix/share/cmake/Torch/TorchConfigVersion.cmake"
  echo 'message(FATAL_ERROR "reached TorchConfig.cmake")' > "$prefix/share/cmake/Torch/TorchConfig.cmake"
  # CMake wraps its messages: one line, single spaces.
  cmake -S "$src" -B "$work/build-$version" -DCMAKE_PREFIX_PATH="$prefix" -DWEFT_CUDA=OFF 2>&1 |
    tr '\n' ' ' | tr -s ' ' > "$work/$version.log"
}
for old in 1.13.1 2.4.1; do
  configure "$old" && fail "LibTorch $old was accepted"
  grep -q "weft: LibTorch $old found at $work/torch-$old; weft needs LibTorch" "$work/$old.log" ||
    fail "LibTorch $old: no message naming it: $(cat "$work/$old.log")"
  grep -q "2.5 or" "$work/$old.log" || fail "LibTorch $old: the message does not name 2.5"
  grep -q "reached TorchConfig.cmake" "$work/$old.log" && fail "LibTorch $old: refused only after TorchConfig.cmake ran"
done
configure 2.5.0 && fail "the fake LibTorch 2.5.0 configured"
grep -q "reached TorchConfig.cmake" "$work/2.5.0.log" || fail "LibTorch 2.5.0 did not pass the floor: $(cat "$work/2.5.0.log")"
grep -q "weft needs LibTorch" "$work/2.5.0.log" && fail "LibTorch 2.5.0 refused"
echo "PASS: 1.13.1 and 2.4.1 refused at configure time, 2.5.0 passes the floor"
