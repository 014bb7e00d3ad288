#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for weft: installs the dependencies from Debian main
# (as root; idempotent), fetches the bundled corpus and builds everything into build/.
#
#   tools/setup.sh            install + corpus + build
#   WEFT_SKIP_APT=1 tools/setup.sh   skip apt (dependencies already present)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  g++ cmake ninja-build python3
  libtorch-dev libopenblas0-openmp       # LibTorch 1.13 (CPU); OpenBLAS: fp32 GEMM ~20x the netlib default
  libtomlplusplus-dev libspdlog-dev nlohmann-json3-dev
  libboost-dev libboost-program-options-dev libgtest-dev
  libdlpack-dev                          # DLPack: tensors across the plugin ABI (sdk/)
  libgloo-dev                            # c10d's ProcessGroupGloo headers include gloo's
  python3-torch                          # trainer bench --baseline pytorch (tools/pytorch_baseline.py)
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

# Every fp32 number depends on this: refuse to go on with the reference BLAS.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
if [[ "$blas" != *openblas* ]]; then
  echo "setup: libblas.so.3 resolves to '$blas', not OpenBLAS; fp32 would run ~20x slower" >&2
  echo "setup: fix with: update-alternatives --config libblas.so.3-x86_64-linux-gnu" >&2
  exit 1
fi

tools/fetch_austen.sh data/austen

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
echo "setup: built build/trainer"
