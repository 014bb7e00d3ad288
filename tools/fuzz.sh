#!/usr/bin/env bash
# Fuzzes weft's parsers of untrusted input with libFuzzer (clang, with AddressSanitizer, its leak
# checker, and UBSan): builds fuzz/ into build-fuzz/ and runs every target from its seed corpus
# for SECONDS each (default 60), or until WEFT_FUZZ_RUNS executions, as many at once as there are
# cores (WEFT_FUZZ_JOBS). Prints executions, corpus and findings per target; exits non-zero if any
# target found a crash, a leak, undefined behaviour or an exception other than weft::Error (bad
# input must get one clear error). A finding is kept as
# build-fuzz/crash-<target>-* (replay: build-fuzz/fuzz_<target> FILE).
#
#   tools/fuzz.sh               every target, 60 s each
#   tools/fuzz.sh 10            the short pass CI runs
#   WEFT_FUZZ_RUNS=1000000 tools/fuzz.sh 3600    a long run: 10^6 executions per target
#   tools/fuzz.sh 60 jsonl      one target
#
# Targets (fuzz/*.cpp): config (TOML with `extends` and overrides, validated against a schema),
# tokenizer_json (BPE vocab/merges, pre-tokenizer regex, added tokens; then encode/decode),
# jsonl (JSONL records, text documents), token_file (u16/u32 token files, document boundaries),
# gguf (GGUF metadata, tensor table, every type weft dequantizes);
# and, linked with the LibTorch that tools/setup.sh installs: safetensors (header, tensor table,
# metadata, data), checkpoint_state (trainer_state.json), adapter_config (PEFT's
# adapter_config.json), shard_index (a sharded checkpoint's index.json and piece metadata).
# Seeds: configs/*.toml and fuzz/seeds/<target>/ (the shapes tests/data's fixtures use).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
targets=("$@")
all_targets=(config tokenizer_json jsonl token_file labeled gguf safetensors checkpoint_state adapter_config shard_index)
runs=${WEFT_FUZZ_RUNS:--1}

if ! command -v clang++ >/dev/null || ! compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  if [[ $(id -u) -eq 0 && "${WEFT_SKIP_APT:-0}" != 1 ]]; then
    echo "fuzz: installing clang and its fuzzer runtime"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-14-dev >/dev/null
  else
    echo "fuzz: needs clang and libFuzzer (apt-get install clang libclang-rt-14-dev)" >&2
    exit 1
  fi
fi

# The file parsers' targets link LibTorch: the wheel tools/setup.sh installs, where it is there.
torch_prefix=
venv=${WEFT_VENV:-$HOME/.cache/weft/venv}
if [[ -x $venv/bin/python ]]; then
  torch_prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
fi
mkdir -p build-fuzz
CC=clang CXX=clang++ cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix"} >build-fuzz/cmake.log 2>&1 || { cat build-fuzz/cmake.log >&2; exit 1; }
cmake --build build-fuzz >build-fuzz/build.log 2>&1 || { tail -40 build-fuzz/build.log >&2; exit 1; }
if [[ ${#targets[@]} -eq 0 ]]; then
  for target in "${all_targets[@]}"; do
    if [[ -x build-fuzz/fuzz_$target ]]; then
      targets+=("$target")
    else
      echo "fuzz: $target not built (no LibTorch found: run tools/setup.sh first)"
    fi
  done
fi

# The targets run side by side, one per core (WEFT_FUZZ_JOBS, default nproc): each is one
# single-threaded process, so each gets the executions it would alone; rows print in target order.
jobs=${WEFT_FUZZ_JOBS:-$(nproc)}
fuzz_one() {
  local target=$1 corpus=build-fuzz/corpus/$1 seeds=() log=build-fuzz/$1.log result
  mkdir -p "$corpus"
  if [[ $target == config ]]; then
    seeds=(build-fuzz/seeds-config)
    mkdir -p "${seeds[0]}" && cp configs/*.toml "${seeds[0]}/"
  else
    seeds=(fuzz/seeds/$target)
  fi
  # The targets that read files write them in a scratch folder of their own (fuzz/scratch.h), removed after.
  local scratch
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/weft-fuzz-$target.XXXXXX")
  if TMPDIR=$scratch build-fuzz/fuzz_$target "$corpus" "${seeds[@]}" -max_total_time="$seconds" -runs="$runs" \
       -print_final_stats=1 -artifact_prefix="build-fuzz/crash-$target-" >"$log" 2>&1; then
    result=ok
  else
    result="FAILED: $(grep -m1 -E 'ERROR: |terminate called|runtime error' "$log" || echo "exit status")"
  fi
  rm -rf "$scratch"
  local executions speed
  executions=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
  speed=$(awk '/stat::average_exec_per_sec/ {print $2}' "$log")
  printf 'fuzz: %-15s %12s %8s %8s  %s\n' "$target" "${executions:-?}" "${speed:-?}" "$(ls "$corpus" | wc -l)" "$result" \
    >"build-fuzz/$target.row"
}

printf 'fuzz: %-15s %12s %8s %8s  %s\n' target executions exec/s corpus result
running=0
for target in "${targets[@]}"; do
  rm -f "build-fuzz/$target.row"
  if (( running >= jobs )); then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
wait || true
failed=0
for target in "${targets[@]}"; do
  if [[ -f build-fuzz/$target.row ]]; then
    cat "build-fuzz/$target.row"
    grep -q '  ok$' "build-fuzz/$target.row" || failed=1
  else
    echo "fuzz: $target: no result (the fuzzing process did not finish)"
    failed=1
  fi
done
[[ $failed == 0 ]] || echo "fuzz: findings above; the log of each target is build-fuzz/<target>.log" >&2
exit $failed
