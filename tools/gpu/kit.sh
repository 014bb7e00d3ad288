#!/usr/bin/env bash
# The GPU verification kit: what must run on an NVIDIA GPU to be trusted, for a machine that has a
# GPU, a PyTorch 2.x with CUDA in its plain `python3`, CMake, ninja and nvcc, but no package
# registry (docs/gpu.md says what it checks and what it found).
#
#   here (Debian 12, online):  tools/gpu/kit.sh fetch        .gpu-kit/debs: weft's build dependencies
#                                                           as Debian packages; data/austen as usual
#   there, from the repo root: tools/gpu/kit.sh build        unpacks them into a prefix and builds
#                                                           weft against python3's own libtorch
#                              tools/gpu/kit.sh check        the checks below, in order
#                              tools/gpu/kit.sh throughput   Llama 3.2 1B shape, bf16: weft vs PyTorch
#                              tools/gpu/kit.sh profile      the same shape's step: MFU, GPU time by kernel
#                              tools/gpu/kit.sh lora         LoRA on the 1B shape: weft vs transformers + PEFT
#                              tools/gpu/kit.sh quick        the CUDA kernels and single on CUDA only
#                              tools/gpu/kit.sh zero         ZeRO-3 of the 1B shape on CUDA, 2 ranks
#                              tools/gpu/kit.sh quantized    LoRA over int8 / nf4 bases on CUDA
#                              tools/gpu/kit.sh adalora      AdaLoRA on CUDA: conformance, the 1B shape
#                              tools/gpu/kit.sh classification  sequence classification on CUDA: conformance
#                              tools/gpu/kit.sh mesh         plugins composed over a device mesh on CUDA
#                              tools/gpu/kit.sh resume       a LoRA run with dropout resumes bit-exactly on CUDA
#
# Each step appends to $KIT_OUT/gpu-kit.md (default: $OUT where the device tool sets it, else
# build-gpu/kit) and goes on after a failure; the exit status is the number of failed checks.
# With the workplace's device tool: carry [".gpu-kit", "data", "build-gpu"] and run one step per
# call (each call has 10 minutes). Settings: WEFT_KIT_BUILD (build-gpu), WEFT_KIT_PREFIX
# (/tmp/weft-deps), WEFT_KIT_JOBS (nproc), WEFT_KIT_TARGETS (what `build` compiles: the trainer,
# the plugins and the three test executables `check` runs; a short session names fewer).
set -uo pipefail
cd "$(dirname "$0")/../.."

build=${WEFT_KIT_BUILD:-build-gpu}
prefix=${WEFT_KIT_PREFIX:-/tmp/weft-deps}
jobs=${WEFT_KIT_JOBS:-$(nproc)}
out=${KIT_OUT:-${OUT:-$build/kit}}
report=$out/gpu-kit.md
failed=0

# Debian 12 packages weft builds with that a bare CUDA machine lacks (headers, CMake configs, and
# the few shared libraries they link: spdlog, fmt, toml++, Boost.ProgramOptions).
debs=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev
      libboost-dev libboost1.74-dev libboost-program-options-dev libboost-program-options1.74-dev
      libboost-program-options1.74.0 libgtest-dev libdlpack-dev libgloo-dev)

say() { echo "$*" | tee -a "$report"; }

# run NAME TIMEOUT COMMAND...: runs a check, keeps its whole log, reports PASS/FAIL and its tail.
run() {
  local name=$1 limit=$2
  shift 2
  local log="$out/$name.log" started=$(date +%s)
  timeout "$limit" "$@" > "$log" 2>&1
  local status=$?
  local seconds=$(( $(date +%s) - started ))
  if [[ $status -eq 0 ]]; then
    say "- PASS \`$name\` (${seconds} s): \`$*\`"
  else
    failed=$((failed + 1))
    say "- FAIL \`$name\` (exit $status after ${seconds} s): \`$*\`"
  fi
  { echo '  ```'; tail -n "${KIT_TAIL:-12}" "$log" | sed 's/^/  /'; echo '  ```'; } >> "$report"
  return $status
}

# A run's summary line (metrics.jsonl) as a few figures.
summary_of() {
  python3 - "$1" <<'PY'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if '"summary"' in l][-1]
keys = ["device_name", "precision", "tokens_per_s", "mfu", "peak_tflops", "device_peak_allocated_mib",
        "device_peak_reserved_mib", "device_peak_allocated_mib_per_rank", "memory_plan_mib_per_rank", "eval_loss",
        "perplexity", "skipped_steps", "train_loss"]
print(", ".join(f"{k} {s[k]:.4g}" if isinstance(s.get(k), float) else f"{k} {s.get(k)}" for k in keys if k in s))
PY
}

fetch() {
  mkdir -p .gpu-kit/debs
  (cd .gpu-kit/debs && apt-get download "${debs[@]}")
  tools/fetch_austen.sh data/austen
  du -sh .gpu-kit data/austen
}

build_step() {
  mkdir -p "$out"
  say "## build ($(date -u +%FT%TZ))"
  for deb in .gpu-kit/debs/*.deb; do dpkg -x "$deb" "$prefix"; done
  local torch_prefix
  torch_prefix=$(python3 -c 'import os, torch, torch.utils
print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))') || { say "- FAIL: python3 has no torch"; return 1; }
  run environment 60 bash -c 'nvidia-smi -L; python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")"; nvcc --version | tail -1; cmake --version | head -1; g++ --version | head -1; env | grep -E "^(LIBRARY_PATH|COMPILER_PATH|LD_LIBRARY_PATH)=" || true'
  # The system's g++ (WEFT_KIT_CXX chooses another): a g++ of its own in /opt/gcc, first on the
  # PATH of the workplace's GPU machines, linked libtorch.so ahead of libstdc++, so libtorch's
  # static std::filesystem answered weft's calls and remove_all jumped to address 0.
  # The C compiler and nvcc's host compiler are the same GCC: with nvcc's default (the PATH's g++,
  # /opt/gcc's) CMake put that GCC's library folders (-L/opt/gcc/lib: its libstdc++) on the link
  # of every binary holding CUDA code, and libstdc++ was again not first.
  local cxx=${WEFT_KIT_CXX:-/usr/bin/g++}
  [[ -x "$cxx" ]] || cxx=$(command -v g++)
  local cc=${WEFT_KIT_CC:-$(dirname "$cxx")/gcc}
  [[ -x "$cc" ]] || cc=$(command -v gcc)
  local gcc_first
  gcc_first=$(mktemp -d)
  ln -s "$cxx" "$gcc_first/g++"; ln -s "$cxx" "$gcc_first/c++"; ln -s "$cc" "$gcc_first/gcc"; ln -s "$cc" "$gcc_first/cc"
  run configure 300 env PATH="$gcc_first:$PATH" CC="$cc" CXX="$cxx" CUDAHOSTCXX="$cxx" cmake -S . -B "$build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_CUDA_HOST_COMPILER="$cxx" -DWEFT_DEPS_PREFIX="$prefix" -DWEFT_PYTHON="$(command -v python3)"
  grep -h '^-- weft: ' "$out/configure.log" | tee -a "$report"
  local targets=${WEFT_KIT_TARGETS:-trainer single ddp gpipe pipedream tensor_parallel zero context_parallel test_device test_model test_dist}
  # shellcheck disable=SC2086  # a list of targets
  run compile 560 env PATH="$gcc_first:$PATH" cmake --build "$build" -j "$jobs" --target $targets
  # libstdc++ must come before libtorch.so in the search order (cmake/libtorch.cmake says why).
  local binary checked=""
  for binary in "$build/trainer" "$build/tests/test_model"; do [[ -f "$binary" ]] && checked+=" $binary"; done
  run libstdcxx_first 10 bash -c "for b in$checked; do readelf -d \$b | grep NEEDED | head -1 | grep -q libstdc++ || exit 1; done"
}

check_step() {
  mkdir -p "$out"
  say "## check ($(date -u +%FT%TZ))"
  local t=$build/trainer
  run plugins 60 "$t" plugins
  # Unit tests that take the GPU branch where there is a GPU: device resolution, NCCL's one-rank
  # world and routing, the kernels' ATen path (against the fused CPU kernels).
  run test_device 120 "$build/tests/test_device"
  run test_dist_process_groups 300 "$build/tests/test_dist" --gtest_filter='ProcessGroups.*:Rendezvous.*'
  run test_model 300 "$build/tests/test_model"
  # single on CUDA against single on the CPU (the reference always computes on the CPU), fp32 and bf16.
  run check_single_cuda_fp32 300 "$t" check --plugin single --set train.device=cuda
  run check_single_cuda_bf16 300 "$t" check --plugin single --set train.device=cuda --set train.precision=bf16
  run check_single_cuda_fp16 300 "$t" check --plugin single --set train.device=cuda --set train.precision=fp16
  # configs/austen-mini.toml on CUDA (its first 200 steps).
  if run austen_mini_cuda 400 "$t" --config configs/austen-mini.toml --set train.device=cuda --set train.max_steps=200 \
      --set train.out_dir="$out/austen-mini" --set train.overwrite=true --set log.progress=lines; then
    say "  austen-mini on CUDA: $(summary_of "$out/austen-mini/metrics.jsonl")"
  fi
  # Every plugin's multi-rank logic on CUDA tensors: one GPU per rank where there are enough,
  # else two ranks sharing one (WEFT_SHARE_GPUS=1: Gloo through host memory, as NCCL refuses a
  # shared GPU).
  local gpus share=0
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$gpus" -lt 2 ]] && share=1
  say "- $gpus GPU(s): multi-rank checks $([[ $share == 1 ]] && echo 'share one GPU (WEFT_SHARE_GPUS=1, Gloo)' || echo 'one GPU per rank (NCCL)')"
  local plugin
  for plugin in ddp gpipe pipedream tensor_parallel zero; do
    WEFT_SHARE_GPUS=$share run "check_${plugin}_cuda_2ranks" 400 "$t" check --plugin "$plugin" --nproc 2 --set train.device=cuda
  done
}

# What a short GPU session runs first: the CUDA kernels against ATen on the GPU (test_model) and
# single on CUDA against the CPU reference in fp32 and bf16.
quick_step() {
  mkdir -p "$out"
  say "## quick ($(date -u +%FT%TZ))"
  local t=$build/trainer
  run test_model_kernels 300 "$build/tests/test_model" --gtest_filter='FusedKernels.*'
  run check_single_cuda_fp32 300 "$t" check --plugin single --set train.device=cuda
  run check_single_cuda_bf16 300 "$t" check --plugin single --set train.device=cuda --set train.precision=bf16
}

# ZeRO-3 full fine-tuning of the llama-3.2-1b shape (configs/llama-3.2-1b-zero.toml) on CUDA
# tensors, 2 ranks (sharing one GPU over Gloo where there is one): the plan, step times, peaks.
zero_step() {
  mkdir -p "$out"
  say "## zero ($(date -u +%FT%TZ))"
  local t=$build/trainer gpus share=0
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$gpus" -lt 2 ]] && share=1
  if WEFT_SHARE_GPUS=$share KIT_TAIL=25 run zero3_1b_cuda_2ranks 400 "$t" --config configs/llama-3.2-1b-zero.toml \
      --plugin zero --nproc 2 --set train.device=cuda --set train.out_dir="$out/zero1b" --set train.overwrite=true \
      --set log.progress=lines; then
    say "  zero stage 3, llama-3.2-1b shape on CUDA: $(summary_of "$out/zero1b/metrics.jsonl")"
  fi
}

throughput_step() {
  mkdir -p "$out"
  say "## throughput ($(date -u +%FT%TZ))"
  local t=$build/trainer
  if run throughput_weft 500 "$t" --config configs/llama-3.2-1b-throughput.toml --set train.out_dir="$out/1b" \
      --set train.overwrite=true --set log.progress=lines; then
    say "  weft, Llama 3.2 1B shape, bf16, 4 x 2048 tokens per step: $(summary_of "$out/1b/metrics.jsonl")"
  fi
  # Where the step's GPU time goes: PyTorch's profiler over 3 steps after 5, summed by kernel.
  if run profile_weft 300 "$t" --config configs/llama-3.2-1b-throughput.toml --set train.out_dir="$out/1b-profile" \
      --set train.overwrite=true --set log.progress=off --set train.max_steps=9 --set eval.max_batches=1 \
      --set log.torch_profile="$out/1b-profile.json" --set log.torch_profile_from=5 --set log.torch_profile_steps=3; then
    { echo '  ```'; python3 tools/gpu/profile_summary.py "$out/1b-profile.json" --steps 3 --top 30 | sed 's/^/  /'; echo '  ```'; } >> "$report"
  fi
  # The plots need matplotlib: python3's there, not Debian's /usr/bin/python3.
  WEFT_PLOT_PYTHON=${WEFT_PLOT_PYTHON:-python3} KIT_TAIL=30 run throughput_weft_vs_pytorch 580 "$t" bench --config configs/llama-3.2-1b-throughput.toml \
      --plugin single --baseline pytorch --warmup 3 --steps 10 --repetitions 2 --out "$out/bench"
}

# LoRA r 16 / alpha 32 on all seven projections of the Llama 3.2 1B shape (bf16, 4 x 2048 tokens per
# step, no dropout) against transformers + PEFT's LoRA eager on the same GPU (`trainer bench
# --baseline pytorch`: transformers' initialisation of the same shape); weft with the frozen base
# stored in fp32 (cast to bf16 by each product, as autocast does) and in bf16 (model.frozen_dtype:
# the same products); then where weft's LoRA step spends its GPU time (3 profiled steps after 5).
lora_step() {
  mkdir -p "$out"
  say "## lora ($(date -u +%FT%TZ))"
  local t=$build/trainer
  local lora=(--config configs/llama-3.2-1b-throughput.toml --set train.mode=lora --set lora.r=16 --set lora.alpha=32
              --set lora.dropout=0 --set 'lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')
  WEFT_PLOT_PYTHON=${WEFT_PLOT_PYTHON:-python3} KIT_TAIL=30 run lora_weft_vs_peft 580 "$t" bench "${lora[@]}" \
      --plugin single --plugin "single --set model.frozen_dtype=bf16" --baseline pytorch --warmup 3 --steps 10 \
      --repetitions 2 --out "$out/lora-bench"
  if run profile_lora 300 "$t" "${lora[@]}" --set train.out_dir="$out/lora-profile" --set train.overwrite=true \
      --set log.progress=off --set train.max_steps=8 --set eval.max_batches=1 --set log.torch_profile="$out/lora-profile.json" \
      --set log.torch_profile_from=5 --set log.torch_profile_steps=3; then
    { echo '  ```'; python3 tools/gpu/profile_summary.py "$out/lora-profile.json" --steps 3 --top 30 | sed 's/^/  /'; echo '  ```'; } >> "$report"
  fi
}

# Where the full fine-tuning step of the Llama 3.2 1B shape spends its GPU time, and its MFU.
profile_step() {
  mkdir -p "$out"
  say "## profile ($(date -u +%FT%TZ))"
  local t=$build/trainer
  if run profile_weft 300 "$t" --config configs/llama-3.2-1b-throughput.toml --set train.out_dir="$out/1b-profile" \
      --set train.overwrite=true --set log.progress=off --set train.max_steps=20 --set eval.max_batches=1 \
      --set log.torch_profile="$out/1b-profile.json" --set log.torch_profile_from=15 --set log.torch_profile_steps=3; then
    say "  weft, Llama 3.2 1B shape, bf16, 20 steps, 3 profiled: $(summary_of "$out/1b-profile/metrics.jsonl")"
    { echo '  ```'; python3 tools/gpu/profile_summary.py "$out/1b-profile.json" --steps 3 --top 40 | sed 's/^/  /'; echo '  ```'; } >> "$report"
  fi
}

# LoRA over a quantized base (model.quantize) on CUDA: the dequantization kernels against the CPU's
# values (test_model's Quantize.*), single against the CPU reference for int8 and nf4, the per-GEMM
# costs of the ways to multiply by a quantized weight (tools/gpu/quant_gemm_bench.py), and the
# Llama 3.2 1B shape (LoRA r 16 on all seven projections, bf16, 4 x 512 tokens per step) with each
# format: step time, tokens/s, peak device memory.
quantized_step() {
  mkdir -p "$out"
  say "## quantized ($(date -u +%FT%TZ))"
  local t=$build/trainer q
  run test_model_quantize 300 "$build/tests/test_model" --gtest_filter='Quantize.*'
  KIT_TAIL=20 run quant_gemm_bench 120 python3 tools/gpu/quant_gemm_bench.py --tokens 2048
  for q in int8 nf4; do
    run "check_single_cuda_lora_$q" 300 "$t" check --plugin single --set train.device=cuda --set train.mode=lora --set model.quantize=$q
  done
  for q in none int8 nf4; do
    if run "lora_1b_cuda_$q" 300 "$t" --config configs/base.toml --set model.preset=llama-3.2-1b --set model.quantize=$q \
        --set train.device=cuda --set train.precision=bf16 --set data.seq_len=512 --set train.batch_size=4 \
        --set train.mode=lora --set lora.r=16 --set lora.alpha=32 \
        --set 'lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]' \
        --set train.max_steps=15 --set eval.max_batches=2 --set checkpoint.save_final=false --set checkpoint.keep_best=false \
        --set train.out_dir="$out/lora1b-$q" --set train.overwrite=true --set log.progress=lines --log-level info; then
      say "  LoRA on the 1B shape, base $q: $(grep -o 'held as [a-z0-9]* in [0-9.]* MiB' "$out/lora_1b_cuda_$q.log" | head -1) $(summary_of "$out/lora1b-$q/metrics.jsonl"), step_time_median_s $(python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if "\"summary\"" in l][-1].get("step_time_median_s"))' "$out/lora1b-$q/metrics.jsonl")"
    fi
  done
}

# AdaLoRA on CUDA: the conformance check against the CPU reference (single, and ddp's 2 ranks
# sharing the GPU), then the 1B shape in bf16 (rank allocator, orthogonal regulariser on the device).
adalora_step() {
  mkdir -p "$out"
  say "## adalora ($(date -u +%FT%TZ))"
  local t=$build/trainer
  run check_single_cuda_adalora 300 "$t" check --plugin single --set train.device=cuda --set train.mode=adalora
  run check_single_cuda_adalora_nf4 300 "$t" check --plugin single --set train.device=cuda --set train.mode=adalora \
      --set model.quantize=nf4
  local gpus share=0
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$gpus" -lt 2 ]] && share=1
  WEFT_SHARE_GPUS=$share run check_ddp_cuda_adalora 300 "$t" check --plugin ddp --nproc 2 --set train.device=cuda \
      --set train.mode=adalora
  if run adalora_1b_cuda 300 "$t" --config configs/base.toml --set model.preset=llama-3.2-1b \
      --set train.device=cuda --set train.precision=bf16 --set data.seq_len=512 --set train.batch_size=4 \
      --set train.mode=adalora --set adalora.init_r=12 --set adalora.target_r=8 --set adalora.tinit=3 \
      --set adalora.tfinal=3 --set 'lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]' \
      --set train.max_steps=15 --set eval.max_batches=2 --set checkpoint.save_final=false --set checkpoint.keep_best=false \
      --set train.out_dir="$out/adalora1b" --set train.overwrite=true --set log.progress=lines --log-level info; then
    say "  AdaLoRA on the 1B shape: $(summary_of "$out/adalora1b/metrics.jsonl"), $(grep -o 'AdaLoRA: [0-9]* of [0-9]* triplets kept (target [0-9]*)' "$out/adalora_1b_cuda.log" | head -1)"
  fi
}

classification_step() {
  mkdir -p "$out"
  say "## classification ($(date -u +%FT%TZ))"
  local t=$build/trainer
  run check_single_cuda_classification 300 "$t" check --plugin single --set train.device=cuda \
      --set train.task=classification
  local gpus share=0
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$gpus" -lt 2 ]] && share=1
  WEFT_SHARE_GPUS=$share run check_ddp_cuda_classification_lora 300 "$t" check --plugin ddp --nproc 2 \
      --set train.device=cuda --set train.task=classification --set train.mode=lora
}

# Plugins composed over a device mesh (ABI 1.12; sequence splits across stages 1.13) on CUDA tensors against the CPU reference
# (single.so), as Conformance.mesh.* checks them on the CPU: every rank on the one GPU where there
# is one (WEFT_SHARE_GPUS=1: the mesh's slice groups over Gloo through host memory), one GPU per
# rank over NCCL where there are enough. fp32, and tp x pp once in bf16; with them tensor parallelism
# with sequence parallelism (each region's gathered input released after its forward and gathered
# again in its backward: storage swapped on the device) and interleaved chunks with the embedding and
# the head alone (LoRA: a part with nothing to train).
mesh_step() {
  mkdir -p "$out"
  say "## mesh ($(date -u +%FT%TZ))"
  local t=$build/trainer gpus share=0
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  local cases=(
    "tp2xpp2 4 tensor_parallel,gpipe --set mesh.tp=2 --set mesh.pp=2"
    "pp2xdp2_lora 4 gpipe,ddp --set mesh.pp=2 --set mesh.dp=2 --set train.mode=lora"
    "tp2xdp2 4 tensor_parallel,ddp --set mesh.tp=2 --set mesh.dp=2"
    "cp2xtp2 4 context_parallel,tensor_parallel --set mesh.cp=2 --set mesh.tp=2"
    "cp2xdp2_ring 4 context_parallel,ddp --set mesh.cp=2 --set mesh.dp=2 --set plugin.mode=ring"
    "pp2xzero1 4 gpipe,zero --set mesh.pp=2 --set plugin.stage=1"
    "tp2xpp2_bf16 4 tensor_parallel,gpipe --set mesh.tp=2 --set mesh.pp=2 --set train.precision=bf16 --steps 10"
    "tp2xpp2xdp2 8 tensor_parallel,pipedream,ddp --set mesh.tp=2 --set mesh.pp=2 --set mesh.dp=2"
    "cp2xpp2 4 context_parallel,gpipe --set mesh.cp=2 --set mesh.pp=2"
    "tp2spxpp2 4 tensor_parallel,gpipe --set mesh.tp=2 --set mesh.pp=2 --set plugin.sequence_parallel=true"
    "tp2xzero3 4 tensor_parallel,zero --set mesh.tp=2 --set plugin.stage=3"
    "cp2xtp2sp_ring 4 context_parallel,tensor_parallel --set mesh.cp=2 --set mesh.tp=2 --set plugin.sequence_parallel=true --set plugin.mode=ring"
    "tp2_sequence_parallel 2 tensor_parallel --set plugin.sequence_parallel=true"
    "tp2_sequence_parallel_lora 2 tensor_parallel --set plugin.sequence_parallel=true --set train.mode=lora"
    "interleaved_3chunks_lora 2 gpipe --set plugin.schedule=\"interleaved1f1b\" --set plugin.chunks=3 --set train.mode=lora"
  )
  local case name ranks plugins
  for case in "${cases[@]}"; do
    # shellcheck disable=SC2086  # a case is its name, its ranks, its plugins and its settings
    set -- $case
    name=$1 ranks=$2 plugins=$3
    shift 3
    share=0
    [[ "$gpus" -lt "$ranks" ]] && share=1
    WEFT_SHARE_GPUS=$share run "check_mesh_${name}_cuda" "${WEFT_KIT_MESH_TIMEOUT:-150}" "$t" check --plugin "$plugins" \
        --nproc "$ranks" --set train.device=cuda "$@"
  done
  say "- $gpus GPU(s): ranks $([[ "$gpus" -lt 4 ]] && echo 'share one GPU (WEFT_SHARE_GPUS=1, Gloo)' || echo 'on their own GPUs where there are enough (NCCL)')"
}

# A LoRA run with dropout under gpipe on CUDA saves at step 3 and resumes on its layout: the
# resumed losses equal the uninterrupted run's to the bit (each rank's CUDA generator restored).
resume_step() {
  mkdir -p "$out"
  say "## resume ($(date -u +%FT%TZ))"
  local t=$build/trainer gpus share=0 dir=$out/resume
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$gpus" -lt 2 ]] && share=1
  local common=(--config configs/tiny.toml --plugin gpipe --nproc 2 --set train.device=cuda --set train.mode=lora
                --set plugin.microbatches=2 --set train.batch_size=12 --set train.max_steps=6 --set eval.every_steps=0
                --set checkpoint.keep_best=false --set checkpoint.save_final=false --set log.progress=off)
  rm -rf "$dir"
  WEFT_SHARE_GPUS=$share run resume_first_cuda 300 "$t" "${common[@]}" --set train.out_dir="$dir/first" --set checkpoint.every_steps=3
  WEFT_SHARE_GPUS=$share run resume_again_cuda 300 "$t" "${common[@]}" --set train.out_dir="$dir/again" \
      --set checkpoint.resume="$dir/first/checkpoints/step-00000003"
  run resume_losses_equal 30 python3 -c 'import json, sys
losses = lambda d: {j["step"]: j["loss"] for j in map(json.loads, open(d + "/metrics.jsonl")) if j.get("type") == "step"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print("uninterrupted", [a[s] for s in sorted(b)], "resumed", [b[s] for s in sorted(b)])
sys.exit(0 if sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in b) else 1)' "$dir/first" "$dir/again"
}

case "${1:-}" in
  fetch) fetch ;;
  build) build_step ;;
  check) check_step ;;
  throughput) throughput_step ;;
  quick) quick_step ;;
  zero) zero_step ;;
  quantized) quantized_step ;;
  adalora) adalora_step ;;
  classification) classification_step ;;
  mesh) mesh_step ;;
  resume) resume_step ;;
  lora) lora_step ;;
  profile) profile_step ;;
  *) echo "usage: tools/gpu/kit.sh fetch|build|check|quick|throughput|profile|lora|zero|quantized|adalora|classification|mesh|resume (see the top of this file)" >&2; exit 2 ;;
esac
exit "$failed"
