#!/usr/bin/env bash
# Installs the weft SDK (CMake component weft_sdk) from a configured build into a temporary prefix,
# then builds every example under sdk/examples/ out of tree against that prefix alone (warnings
# are errors) and checks each plugin, named <example>.so:
# it exports exactly weft_plugin_entry (weft/plugin.h), whose table answers major 2 (with
#   the example's name) and refuses major 1, and it passes the cases its conformance.toml lists,
#   which its build puts beside it: `trainer check --all --plugin <example>` with the build folder
#   on WEFT_PLUGIN_PATH, 8 steps a case, full and LoRA (DiLoCo conforms to single on one worker
#   with an outer step that lands on the workers' parameters; its multi-rank behaviour is checked by
#   test_plugin's Diloco.*, which builds the same source in tree; ZB-V's case runs its V over 2
#   ranks).
#   usage: tools/check_sdk_examples.sh <main build dir> <source dir>
# Exits non-zero on the first failure. Needs cmake, a C/C++ compiler, nm, python3 and the built
# trainer (<main build dir>/trainer).
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 <main build dir> <source dir>" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd)
source_dir=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/weft-sdk-examples.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

cmake --install "$build_dir" --component weft_sdk --prefix "$prefix" >/dev/null
for file in include/weft/common.h include/weft/plugin.h include/weft/plugin_torch.hpp \
            lib/cmake/weft_sdk/weft_sdkConfig.cmake lib/cmake/weft_sdk/weft_sdkConfigVersion.cmake; do
  [[ -f "$prefix/$file" ]] || { echo "check_sdk_examples: $file was not installed" >&2; exit 1; }
done

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
examples=0
for example_dir in "$source_dir"/sdk/examples/*/; do
  example=$(basename "$example_dir")
  [[ -f "$example_dir/CMakeLists.txt" ]] || continue
  echo "check_sdk_examples: $example"
  # No CMAKE_PREFIX_PATH from the environment and no package registry: only the temp prefix.
  env -u CMAKE_PREFIX_PATH cmake -S "$example_dir" -B "$work/build-$example" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
    -DCMAKE_COMPILE_WARNING_AS_ERROR=ON >"$work/configure-$example.log" 2>&1 ||
    { cat "$work/configure-$example.log" >&2; exit 1; }
  grep -q "weft_sdk_DIR:PATH=$prefix/" "$work/build-$example/CMakeCache.txt" ||
    { echo "check_sdk_examples: $example did not find the installed SDK" >&2; exit 1; }
  cmake --build "$work/build-$example" -j 2

  plugin="$work/build-$example/$example.so"
  [[ -f "$plugin" ]] || { echo "check_sdk_examples: $plugin was not built" >&2; exit 1; }
  if nm -D --defined-only "$plugin" | awk '{print $3}' | grep -qx weft_plugin_entry; then
    exported=$(nm -D --defined-only "$plugin" | awk '$2 ~ /^[A-Zu]$/ && $2 != "A" {print $3}')
    if [[ "$exported" != "weft_plugin_entry" ]]; then
      echo "check_sdk_examples: $example.so must export only weft_plugin_entry, exports:" >&2
      echo "$exported" >&2
      exit 1
    fi
    python3 - "$plugin" "$example" <<'PY'
import ctypes, sys
path, name = sys.argv[1], sys.argv[2]
lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
entry = lib.weft_plugin_entry
entry.restype = ctypes.c_void_p
entry.argtypes = [ctypes.c_uint16, ctypes.c_uint16]
table = entry(2, 1)
assert table, f"{name}: entry(2, 1) returned NULL"
struct_size, major = ctypes.c_uint32.from_address(table).value, ctypes.c_uint16.from_address(table + 4).value
# weft_plugin: {uint32 struct_size, uint16 major, minor, name, version, description, uint32 dims, 3 functions}
assert major == 2 and struct_size >= 8 + 7 * ctypes.sizeof(ctypes.c_void_p), (major, struct_size)
table_name = ctypes.c_char_p.from_address(table + 8).value.decode()
assert table_name == name, f"table name {table_name!r}, expected {name!r}"
assert not entry(1, 14), f"{name}: entry(1, 14) must return NULL"
PY
    # Its cases, beside it as the shipped plugins' are: trainer check --all finds them on the path.
    [[ -f "$work/build-$example/$example.conformance.toml" ]] ||
      { echo "check_sdk_examples: $example.conformance.toml was not put beside $example.so" >&2; exit 1; }
    echo "check_sdk_examples: trainer check --all --plugin $example --steps 8 (WEFT_PLUGIN_PATH=$work/build-$example)"
    WEFT_PLUGIN_PATH="$work/build-$example" OMP_NUM_THREADS=1 "$build_dir/trainer" check --all --plugin "$example" --steps 8
    examples=$((examples + 1))
    continue
  fi
  echo "check_sdk_examples: $example.so exports no weft_plugin_entry" >&2
  exit 1
done
[[ $examples -ge 3 ]] || { echo "check_sdk_examples: found only $examples examples" >&2; exit 1; }
echo "check_sdk_examples: $examples examples built against the installed SDK"
