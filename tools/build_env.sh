# Sourced by tools/setup.sh, tools/test.sh and tools/quickstart.sh: which LibTorch to build
# against, and where the build and the Python environment live. Each may be set by the caller.
#   WEFT_LIBTORCH   wheel (default: PyTorch's wheel from tools/requirements.txt), or the folder of
#                   another LibTorch 2.5+ (an unzipped libtorch, a conda or pip torch/ folder)
#   WEFT_BUILD_DIR  build/
#   WEFT_VENV       the virtual environment of tools/requirements.txt (~/.cache/weft/venv)
export WEFT_LIBTORCH=${WEFT_LIBTORCH:-wheel}
export WEFT_BUILD_DIR=${WEFT_BUILD_DIR:-build}
export WEFT_VENV=${WEFT_VENV:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/weft/venv}
# Parallel jobs for builds and ctest: the machine's processors. Not plain nproc, which answers
# OMP_NUM_THREADS when it is set (tools/test.sh sets it to 1 for the tests: CI built and tested one
# job at a time until this was found).
export WEFT_JOBS=${WEFT_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
