# Sourced by tools/setup.sh, tools/test.sh and tools/quickstart.sh: which LibTorch to build
# against, and where the build and the Python environment live. Each may be set by the caller.
#   WEFT_LIBTORCH   wheel (default: PyTorch's wheel from tools/requirements.txt), debian (Debian
#                   12's libtorch-dev 1.13), or the folder of another LibTorch
#   WEFT_BUILD_DIR  build/ (build-debian/ for WEFT_LIBTORCH=debian)
#   WEFT_VENV       the virtual environment of tools/requirements.txt (~/.cache/weft/venv)
export WEFT_LIBTORCH=${WEFT_LIBTORCH:-wheel}
if [[ -z "${WEFT_BUILD_DIR:-}" ]]; then
  if [[ "$WEFT_LIBTORCH" == debian ]]; then WEFT_BUILD_DIR=build-debian; else WEFT_BUILD_DIR=build; fi
fi
export WEFT_BUILD_DIR
export WEFT_VENV=${WEFT_VENV:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/weft/venv}
# Parallel jobs for builds and ctest: the machine's processors. Not plain nproc, which answers
# OMP_NUM_THREADS when it is set (tools/test.sh sets it to 1 for the tests: CI built and tested one
# job at a time until this was found).
export WEFT_JOBS=${WEFT_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
